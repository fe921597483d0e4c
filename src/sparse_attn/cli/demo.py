"""``sparse-attn demo``: a benchmark suite sized for this machine, then the pattern gallery."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ._common import console, default_device, device_arg, error, nonneg_int, device_scope, writable_dir

DESCRIPTION = """Run the benchmark suite sized for this machine and draw the pattern gallery.

Without CUDA this runs the CPU 'small' suite (L 256-1024, fp32; the PyTorch reference path:
correctness-sized, not a performance claim); with CUDA the long-context 'report-gpu' suite (bf16,
H=32, D=128; dense baselines and every pattern at 4K-128K, forward and forward+backward, local and
streaming to 1M: about 15-20 minutes on an H100), or with --quick a few rows of 'demo-gpu'.
Results go to OUT/bench/demo-DEVICE.{json,csv} (accuracy vs dense: OUT/bench/accuracy-DEVICE.json,
computed on the CPU in fp32), pictures to OUT/gallery/*.png, and the readable report (summary,
dense baselines, scaling tables T | Dense | Pattern | Speedup, accuracy, plots) to OUT/report.md +
OUT/report-*.png. Where one command may only run a few minutes, run the suite in slices instead:
`sparse-attn bench --suite report-gpu --plan`, then `sparse-attn report --from DIR`."""


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="benchmark suite + pattern gallery, sized for this machine",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--out-dir", type=Path, default=Path("out"), help="output root (default: out)")
    p.add_argument("--quick", action="store_true",
                   help="a few rows and a small gallery (seconds; used by the tests)")
    p.add_argument("--threads", type=nonneg_int,
                   help="CPU intra-op threads (default 1: on a busy shared machine torch's spinning OpenMP "
                        "threads made CPU timing ratios noise; 0 = torch's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


GPU_ACCURACY_LEN = 8192  # the CPU fp32 accuracy rows of a GPU run: every report pattern is sparse there


def accuracy_length(suite, device: str) -> int | None:
    """The length of the accuracy rows: on a CPU None (each pattern's largest: at L=256 a 256-token
    window is the whole causal row); for a GPU run 8K (or the quick run's longest), computed on the CPU."""
    if not device.startswith("cuda"):
        return None
    return min(GPU_ACCURACY_LEN, max(L for c in suite.cases for L in c.seq_lens))


def demo_suite(device: str, quick: bool):
    """report-gpu on CUDA (quick: dense and local of demo-gpu at 4K); small on a CPU (quick: 4 patterns at 256)."""
    from ..bench import get_suite, restrict
    if device.startswith("cuda"):
        if quick:
            return restrict(get_suite("demo-gpu"), patterns=["dense", "local"], seq_lens=[4096])
        return get_suite("report-gpu")
    suite = get_suite("small")
    if quick:
        suite = restrict(suite, patterns=["dense", "causal", "local", "random"], seq_lens=[256],
                         providers=["reference", "sdpa-math", "sparse_attn"], modes=["fwd"])
    return suite


def run(args) -> int:
    device = args.device or default_device()
    writable_dir(args.out_dir, "--out-dir")
    with device_scope(device, args.threads):
        return run_demo(args, device)


def run_demo(args, device: str) -> int:
    from .. import viz
    from .bench import run_suite_to_files
    con = console()
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
    all_failed = bool(rows) and all(r.error for r in rows)
    if json_path is not None and not all_failed:
        from .. import report
        from ..bench.accuracy_rows import write_accuracy_json
        from .report import report_accuracy
        con.rule("accuracy vs dense (CPU, fp32) + report")
        acc_len = accuracy_length(suite, device)
        acc = report_accuracy(suite, acc_len)
        acc_path = write_accuracy_json(args.out_dir / "bench" / f"accuracy-{device.split(':')[0]}.json",
                                       {"device": "cpu", "suite": suite.name, "seq_len": acc_len}, acc)
        header, rows_, acc_ = report.load_results([json_path, acc_path])
        report.print_tables(rows_, acc_, con=con, header=header)
        report_path, pngs = report.write_report(args.out_dir, header, rows_, acc_, gallery="gallery/gallery.md",
                                                missing=report.missing_rows(header, rows_) if not args.quick else None)
    con.rule("outputs")
    if json_path is not None:
        con.print(f"benchmark results: {json_path} (+ {csv_path.name})")
    con.print(f"pattern gallery:   {gallery_dir}/*.png (index: {gallery_dir / 'gallery.md'})")
    if report_path is not None:
        con.print(f"report:            {report_path} (+ {len(pngs)} plots: {', '.join(p.name for p in pngs)})")
    con.print(f"done in {time.perf_counter() - t0:.1f} s")
    if all_failed:
        from rich.markup import escape
        error(f"every benchmark row failed (no report written), e.g. {escape(rows[0].error)}")
    return 0 if json_path is not None and not all_failed else 1
