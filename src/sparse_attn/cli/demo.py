"""``sparse-attn demo``: a benchmark suite sized for this machine, then the pattern gallery."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ._common import console, default_device

DESCRIPTION = """Run the benchmark suite sized for this machine and draw the pattern gallery.

Without CUDA this runs the CPU 'small' suite (L 256-1024, fp32; the PyTorch reference path:
correctness-sized, not a performance claim); with CUDA the 'demo-gpu' suite (bf16, L 4K-16K).
Results go to OUT/bench/demo-DEVICE.{json,csv} (accuracy vs dense: OUT/bench/accuracy-DEVICE.json),
pictures to OUT/gallery/*.png, and the readable report (scaling tables T | Dense | Pattern |
Speedup, accuracy, plots) to OUT/report.md + OUT/report-*.png."""


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="benchmark suite + pattern gallery, sized for this machine",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--out-dir", type=Path, default=Path("out"), help="output root (default: out)")
    p.add_argument("--quick", action="store_true",
                   help="a few rows and a small gallery (seconds; used by the tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def demo_suite(device: str, quick: bool):
    from ..bench import get_suite, restrict
    if device.startswith("cuda"):
        suite = get_suite("demo-gpu")
        if quick:
            suite = restrict(suite, patterns=["dense", "local"], seq_lens=[4096])
        return suite
    suite = get_suite("small")
    if quick:
        suite = restrict(suite, patterns=["dense", "causal", "local", "random"], seq_lens=[256],
                         providers=["reference", "sdpa-math", "sparse_attn"], modes=["fwd"])
    return suite


def run(args) -> int:
    from .. import viz
    from .bench import run_suite_to_files
    con = console()
    device = args.device or default_device()
    t0 = time.perf_counter()
    suite = demo_suite(device, args.quick)
    why = "CUDA found" if device.startswith("cuda") else "no CUDA: CPU reference path, correctness-sized"
    con.rule(f"sparse_attn demo: device {device} ({why}), suite '{suite.name}'{' (quick)' if args.quick else ''}")
    rows, json_path, csv_path = run_suite_to_files(
        suite, device, out_dir=args.out_dir / "bench", name=f"demo-{device.split(':')[0]}",
        reps=3 if args.quick else (None if device.startswith("cuda") else 5),  # CPU: keep it well under 3 min
        progress=not args.no_progress, con=con)
    gallery_dir = args.out_dir / "gallery"
    con.rule("pattern gallery")
    paths = viz.write_gallery(gallery_dir, seq_len=1024 if args.quick else 4096,
                              markdown=gallery_dir / "gallery.md")
    con.print(f"drew {len(paths)} patterns: {', '.join(p.stem for p in paths)}")
    report_path = None
    if json_path is not None:
        from .. import report
        from ..bench.accuracy_rows import accuracy_rows, write_accuracy_json
        con.rule("accuracy vs dense + report")
        # CPU: at the largest length (at L=256 a 256-token window is the whole causal row);
        # CUDA: at the smallest, to keep the fp32 reference cheap.
        acc = accuracy_rows(suite, device, at="smallest" if device.startswith("cuda") else "largest")
        acc_path = write_accuracy_json(args.out_dir / "bench" / f"accuracy-{device.split(':')[0]}.json",
                                       {"device": device, "suite": suite.name}, acc)
        header, rows_, acc_ = report.load_results([json_path, acc_path])
        report.print_tables(rows_, acc_, con=con, header=header)
        report_path, pngs = report.write_report(args.out_dir, header, rows_, acc_)
    con.rule("outputs")
    if json_path is not None:
        con.print(f"benchmark results: {json_path} (+ {csv_path.name})")
    con.print(f"pattern gallery:   {gallery_dir}/*.png (index: {gallery_dir / 'gallery.md'})")
    if report_path is not None:
        con.print(f"report:            {report_path} (+ {len(pngs)} plots: {', '.join(p.name for p in pngs)})")
    con.print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if json_path is not None else 1
