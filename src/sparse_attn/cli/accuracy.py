"""``sparse-attn accuracy``: the adaptive-sparse accuracy suite -> markdown + JSON + PNGs."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ._common import (accuracy_dtype, add_accuracy_options, console, default_device, nonneg_int, device_scope,
                      writable_dir)

DESCRIPTION = """Accuracy suite of adaptive sparse attention (sparse_attn.predict: meansim prediction, then
the block-sparse call) against dense attention on structured inputs (see `sparse-attn quick --help`):

  levels     the sparse levels low / medium / high and top-k 30% (non-causal)
  lengths    the medium level at several sequence lengths
  causal     every level, causal
  stability  inputs x100 and x1e-3: outputs finite and equal to the fp64 reference on the same
             layout (accuracy vs dense is reported, not judged: scaling q and k scales the logits
             by the square and changes the attention itself)
  edge       L=1, L not a multiple of the block, Lq != Lk both ways, GQA with an attention sink

Writes OUT_DIR/accuracy_report.md (table of every case with metrics and pass/fail),
accuracy.json, attention_comparison.png (dense vs sparse attention map vs |difference|, one head,
small L, through the reference), block_pattern.png and block_pattern_causal.png (the predicted
layouts, first heads), and with --sweep a simthreshd1 x cdfthreshd grid (sweep.csv, sweep.png:
accuracy vs sparsity; also in the report and JSON). Exit code 0 when every case passes, else 1.
On a CPU (2 cores, one thread) --quick takes ~10 s and the full suite with --sweep ~40 s."""


def add_parser(sub) -> None:
    p = sub.add_parser("accuracy", help="accuracy suite of adaptive sparse attention (report + PNGs)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("out/accuracy"), help="output folder (default out/accuracy)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter cases (and a 3x3 sweep)")
    p.add_argument("--sweep", action="store_true", help="also run the simthreshd1 x cdfthreshd sweep")
    p.add_argument("--threads", type=nonneg_int, default=1,
                   help="CPU intra-op threads while the suite runs (default 1: the suite is many small ops, and "
                        "on a busy shared machine torch's spinning OpenMP threads made it ~10x slower; "
                        "0 = torch's default)")
    add_accuracy_options(p)
    p.set_defaults(func=run)


def case_line(row: dict) -> str:
    mark = "[green]pass[/green]" if row["passed"] else f"[red]FAIL ({', '.join(row['failed'])})[/red]"
    return (f"{row['category']:<9} {row['name']:<30} sparsity {row['sparsity']:6.1%}  cosine {row['cosine']:.5f}  "
            f"L1 {row['relative_l1']:.4f}  {row['seconds']:5.2f}s  {mark}")


def draw_pictures(out_dir: Path, rows: list[dict], seed: int) -> dict[str, Path]:
    from .. import accuracy as acc
    images = {"Attention maps: dense vs sparse (head 0)": acc.plot_attention_comparison(
        out_dir / "attention_comparison.png", seed=seed)}
    for causal, stem in ((False, "block_pattern"), (True, "block_pattern_causal")):
        pick = [r for r in rows if r["category"] in ("levels", "causal") and r["causal"] == causal
                and r["level"] == "medium" and "topk" not in r]
        if pick:
            r = pick[0]
            name = f"meansim (medium level{', causal' if causal else ''})"
            images[f"Predicted block layout ({'causal' if causal else 'non-causal'})"] = acc.plot_block_pattern(
                out_dir / f"{stem}.png", r["_layout"], name=name)
    return images


def write_sweep_csv(path: Path, rows: list[dict]) -> Path:
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def run(args) -> int:
    device = args.device or default_device()
    writable_dir(args.out_dir, "--out-dir")
    with device_scope(device, args.threads):
        return run_suite(args, device)


def run_suite(args, device: str) -> int:
    import torch
    from .. import accuracy as acc
    from ..predict import SPARSE_LEVELS
    con = console()
    t0 = time.perf_counter()
    from ..bench.suites import dtype_name as short_name
    dtype = accuracy_dtype(args.dtype, device, args.head_dim)
    dtype_name = short_name(dtype)
    th = acc.Thresholds(args.min_cosine, args.max_l1, args.min_sparsity)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = acc.suite_cases(quick=args.quick)
    con.rule(f"accuracy suite{' (quick)' if args.quick else ''}: {len(cases)} cases on {device}, {dtype_name}")
    rows = acc.run_suite(cases, device=device, dtype=dtype, head_dim=args.head_dim, seed=args.seed, thresholds=th,
                         on_row=lambda r: con.print(case_line(r)))
    sweep = None
    if args.sweep:
        sims, cdfs = (acc.SWEEP_SIM_QUICK, acc.SWEEP_CDF_QUICK) if args.quick else (acc.SWEEP_SIM, acc.SWEEP_CDF)
        seq_len = 1024 if args.quick else 2048
        con.rule(f"threshold sweep: {len(sims)} x {len(cdfs)} points at L={seq_len}")
        sweep = acc.run_sweep(seq_len, sims=sims, cdfs=cdfs, device=device, dtype=dtype, head_dim=args.head_dim,
                              seed=args.seed)
        write_sweep_csv(out_dir / "sweep.csv", sweep)
    con.rule("pictures and report")
    images = draw_pictures(out_dir, rows, args.seed)
    if sweep:
        images["Threshold sweep: accuracy vs sparsity"] = acc.plot_sweep(out_dir / "sweep.png", sweep, th)
    header = {"device": device, "dtype": dtype_name, "torch": torch.__version__, "quick": args.quick,
              "threads": torch.get_num_threads() if device == "cpu" else None,
              "head_dim": args.head_dim, "block": 128, "seed": args.seed, "thresholds": vars(th),
              "levels": {k: list(v) for k, v in SPARSE_LEVELS.items()}, "data": acc.DATA_DOC,
              "seconds": time.perf_counter() - t0}
    if device == "cpu":
        header["note"] = "CPU: the PyTorch reference path"
    json_path = acc.write_json(out_dir / "accuracy.json", header, rows, sweep)
    md_path = acc.write_markdown(out_dir / "accuracy_report.md", header, rows, images=images, sweep=sweep)
    n_pass = sum(r["passed"] for r in rows)
    con.print(f"wrote {md_path}, {json_path} and {len(images)} pictures "
              f"({', '.join(p.name for p in images.values())})")
    colour = "green" if n_pass == len(rows) else "red"
    con.rule(f"[{colour}]{n_pass} of {len(rows)} cases passed[/{colour}] in {time.perf_counter() - t0:.1f} s")
    return 0 if n_pass == len(rows) else 1
