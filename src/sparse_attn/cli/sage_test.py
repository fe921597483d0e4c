"""``sparse-attn sage-test``: the Sparse SageAttention test suite for the 8-bit path (JSON + markdown)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ._common import (CPU_TIMING_NOTE, console, default_device, device_arg, error, nonneg_int, positive_int,
                      positive_tokens, device_scope, seed_arg, usage_error, writable_dir)

DESCRIPTION = """Sparse SageAttention test suite: sparse_attn.attention(..., quant="int8" | "int8-fp8") on
block-sparse layouts given as SageAttention block indices [B, H, q_blocks, top_k] (q block 64, k block
128, -1 padded; converted by sparse_attn.patterns.from_block_index), checked against the fp16/bf16
attention on the SAME layout.

  --test-correctness  runs (dense, block indices, odd length, GQA with Lq < Lk), output shape/dtype,
                      finite, inputs not modified, no memory growth over repeated calls (CUDA),
                      invalid block indices rejected with an error naming the index and the valid
                      range, accuracy on normal inputs and on keys with a per-channel offset and
                      outlier channels
  --test-patterns     random, local, strided, block_diagonal block indices at each top-k ratio
                      (--pattern: some of them); each row holds top_k key blocks (block_diagonal:
                      the rows of its shorter last document fewer) and each label states the
                      blocks per row and the fraction kept, measured on the index
  --benchmark-perf    dense vs random top-k 8-bit attention: ms, speedup, blocks skipped, peak memory,
                      effective TOPS, and the bf16 attention on the same layout
                      (B=4, H=32, D=128, L 1K-32K, top-k ratios 0.25/0.5/0.75 on CUDA). On CUDA
                      times are the GPU's (each call queued behind a sleep, so the host's issue
                      time is not in them) and "host ms" is the host's time to issue one 8-bit
                      sparse call: where it exceeds sparse ms, eager calls are host-bound
With no test flag: correctness + patterns. Accuracy passes at cosine >= 0.999 and relative L1 <= 0.02;
int8-fp8 usually misses the L1 bar (e4m3 rounding of P and V, ~3%) and is reported as failing.

On a CPU the 8-bit path is the PyTorch emulation (ops/sage/reference.py) and every size is tiny
(B=1, H=2, D=64, L <= 512; --stress: up to 2K): a functional check, not a performance statement.
On CUDA checks use B=2, H=8, D=128, L=4096 (--stress: H=32, L=32K; benchmark up to 64K).
--batch-size, --num-heads and --head-dim replace those sizes in every section; --seq-lens gives the
lengths of every section (checks run once per length).
Writes OUT/sage_test.json and OUT/sage_test.md; exit code 1 when a check or a benchmark row fails,
2 on bad options."""


def add_parser(sub) -> None:
    from ..ops.sage.granularity import GRANULARITY, QUANT_MODES
    from ..sage_suite import PATTERNS, TOP_K_RATIOS
    p = sub.add_parser("sage-test", help="Sparse SageAttention suite: 8-bit attention on block indices (pass/fail)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("what to run (default: --test-correctness --test-patterns)")
    t.add_argument("--test-correctness", action="store_true", help="runs, shapes, memory, index validation, accuracy")
    t.add_argument("--test-patterns", action="store_true", help="accuracy on random/local/strided/block_diagonal")
    t.add_argument("--benchmark-perf", action="store_true", help="dense vs sparse timing, speedup, memory")
    t.add_argument("--stress", action="store_true", help="larger configurations (longer L, more heads)")
    p.add_argument("--quant", choices=list(QUANT_MODES),
                   help="8-bit mode (default: int8-fp8 on CUDA with compute capability 8.9+, else int8)")
    p.add_argument("--quant-gran", choices=list(GRANULARITY), default="per_warp",
                   help="Q/K scale groups (default per_warp)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="input dtype (default bf16)")
    z = p.add_argument_group("sizes (default: the preset of the device and --stress, see above)")
    z.add_argument("--batch-size", type=positive_int, metavar="B",
                   help="batch of all three sections: correctness, patterns, benchmark")
    z.add_argument("--num-heads", type=positive_int, metavar="H",
                   help="heads of all three sections: correctness, patterns, benchmark")
    z.add_argument("--head-dim", type=head_dim_arg, metavar="D",
                   help="head dim of all three sections: correctness, patterns, benchmark; a multiple of 16 "
                        "and >= 32 (what the 8-bit kernels take)")
    z.add_argument("--seq-lens", nargs="+", type=positive_tokens, metavar="L",
                   help="lengths of all three sections (e.g. 512 4k), instead of the defaults: correctness "
                        "(needs L > 128) and patterns run once per length, the benchmark times each")
    p.add_argument("--pattern", nargs="+", choices=list(PATTERNS), metavar="NAME",
                   help=f"patterns section only: which of {', '.join(PATTERNS)} to check (default all)")
    p.add_argument("--top-k-ratios", nargs="+", type=float, default=list(TOP_K_RATIOS), metavar="R",
                   help="fractions of key blocks per row, for patterns and benchmark (default 0.25 0.5 0.75)")
    p.add_argument("--reps", type=positive_int, help="timed repetitions per measurement (default: ~200 ms worth, >= 3)")
    p.add_argument("--threads", type=nonneg_int,
                   help="CPU intra-op threads (default 1: on a busy shared machine torch's spinning OpenMP "
                        "threads made CPU timings noise; 0 = torch's default)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of inputs and random block indices (default 0)")
    p.add_argument("--out", type=Path, default=Path("out/sage-test"), help="output folder (default out/sage-test)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def head_dim_arg(text: str) -> int:
    """An argparse type for --head-dim: a positive int the 8-bit kernels take, checked by the same rule
    as ``attention(quant=...)`` (ops.sage.granularity.check_quant_shapes), so a bad one is a usage error
    instead of a failed check per section."""
    import argparse

    from ..ops.sage.granularity import check_quant_shapes
    value = positive_int(text)
    try:
        check_quant_shapes(1, value, None)
    except ValueError as e:  # drop its advice for API callers ("pad q/k/v, or use quant=None")
        raise argparse.ArgumentTypeError(str(e).partition(": pad")[0]) from None
    return value


def check_lens(args, sizes) -> tuple[int, ...]:
    """The lengths the correctness / pattern checks run at: ``--seq-lens`` when given, else the preset's."""
    return tuple(args.seq_lens) if args.seq_lens else (sizes.seq_len,)


def selected_patterns(args) -> tuple[str, ...]:
    """The patterns --pattern names, in the suite's order and each once (default: all four)."""
    from ..sage_suite import PATTERNS
    return tuple(p for p in PATTERNS if not args.pattern or p in args.pattern)


def run_sizes(args, device: str):
    """The preset Sizes of ``device`` / ``--stress`` with --batch-size / --num-heads / --head-dim applied,
    and --seq-lens: the benchmark's lengths, the checks' first (check_lens lists them all). The header
    records these sizes: it kept the preset's lengths beside checks and rows run at others."""
    import dataclasses

    from .. import sage_suite as ss
    sizes = ss.with_sizes(ss.sizes_for(device, args.stress), batch=args.batch_size, heads=args.num_heads,
                          head_dim=args.head_dim)
    if args.seq_lens:
        sizes = dataclasses.replace(sizes, seq_len=args.seq_lens[0], bench_lens=tuple(args.seq_lens))
    return sizes


def _sections(args) -> tuple[bool, bool, bool]:
    if not (args.test_correctness or args.test_patterns or args.benchmark_perf):
        return True, True, False
    return args.test_correctness, args.test_patterns, args.benchmark_perf


def _check_options(args, device: str, quant: str) -> str | None:
    """The error text of an unusable option combination, else None."""
    import torch
    if device.startswith("cuda"):  # --device itself was checked when parsed (_common.device_arg)
        if quant == "int8-fp8" and torch.cuda.get_device_capability(device) < (8, 9):
            return (f"--quant int8-fp8 needs FP8 tensor cores (compute capability 8.9+); "
                    f"{torch.cuda.get_device_name(device)} has none: use --quant int8")
    if any(not 0.0 < r <= 1.0 for r in args.top_k_ratios):
        return f"--top-k-ratios must lie in (0, 1], got {args.top_k_ratios}"
    if args.pattern and not _sections(args)[1]:  # it ran silently, the header recording patterns never run
        return (f"--pattern {' '.join(args.pattern)} selects the layouts of the patterns section, which this run "
                "leaves out (the correctness checks and the benchmark use random top-k block indices): add "
                "--test-patterns")
    return None


def make_header(args, device: str, quant: str, sizes, dtype_name: str) -> dict:
    import dataclasses

    import torch
    from ..bench import make_header as bench_header
    from ..sage_suite import BLOCK_K, BLOCK_Q, MAX_L1, MIN_COSINE
    header = bench_header(device, "sage-test", quant=quant, granularity=args.quant_gran, dtype=dtype_name,
                          sizes=dataclasses.asdict(sizes), check_lens=list(check_lens(args, sizes)),
                          patterns=list(selected_patterns(args)) if _sections(args)[1] else [], block_q=BLOCK_Q,
                          block_k=BLOCK_K, seed=args.seed,
                          top_k_ratios=list(args.top_k_ratios), thresholds={"min_cosine": MIN_COSINE, "max_l1": MAX_L1},
                          stress=args.stress)
    if not device.startswith("cuda"):
        header["note"] = f"CPU: tiny sizes and the PyTorch emulation of the 8-bit path; {CPU_TIMING_NOTE}"
        header["threads"] = torch.get_num_threads()
    return header


def summary_tables(checks, bench, con, dtype: str = "bf16") -> None:
    from rich.table import Table
    from rich.text import Text
    from ..sage_suite import bench_top_k, status
    if checks:
        t = Table(title="checks (8-bit vs fp16/bf16 on the same layout)")
        for col in ("section", "check", "result", "cosine", "rel. L1", "detail"):
            t.add_column(col, justify="right" if col in ("cosine", "rel. L1") else "left")
        for c in checks:
            colour = {"pass": "green", "FAIL": "red"}.get(status(c), "yellow")
            t.add_row(c.section, c.name, Text(status(c), style=colour),
                      "" if c.cosine is None else f"{c.cosine:.5f}",
                      "" if c.relative_l1 is None else f"{c.relative_l1:.4f}", Text(c.detail[:120]))
        con.print(t)
    if bench:
        t = Table(title="benchmark: 8-bit attention, dense vs random top-k block indices (median ms; on CUDA the "
                        "GPU's time, host ms: the host's time to issue one 8-bit sparse call)")
        cols = ("L", "top-k", "dense ms", "sparse ms", "speedup", "blocks skipped", "peak MiB d/s", "sparse TOPS",
                f"{dtype} sparse ms", f"8-bit vs {dtype}", "host ms")  # the 16-bit run is in the inputs' dtype
        for col in cols:
            t.add_column(col, justify="right")
        for r in bench:
            if r.get("error"):
                t.add_row(str(r["seq_len"]), bench_top_k(r), Text(f"error: {r['error']}"[:80], style="red"))
                continue
            peaks = "-" if r["dense_peak_bytes"] is None else \
                f"{r['dense_peak_bytes'] / 2**20:.0f}/{r['sparse_peak_bytes'] / 2**20:.0f}"
            t.add_row(str(r["seq_len"]), bench_top_k(r), f"{r['dense_ms']:.3f}",
                      f"{r['sparse_ms']:.3f}", f"{r['speedup']:.2f}x", f"{r['block_savings']:.1%}", peaks,
                      f"{r['sparse_tops']:.3g}", f"{r['bf16_sparse_ms']:.3f}", f"{r['speedup_vs_bf16']:.2f}x",
                      "-" if r.get("sparse_host_ms") is None else f"{r['sparse_host_ms']:.3f}")
        con.print(t)


def run_steps(steps, *, desc: str, progress: bool) -> list:
    """Run ``(label, fn)`` steps under a progress bar; flatten what they return."""
    from tqdm.auto import tqdm
    out = []
    bar = tqdm(steps, desc=desc, unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    for label, fn in bar:
        bar.set_postfix_str(label, refresh=False)
        got = fn()
        out.extend(got if isinstance(got, list) else [got])
    bar.close()
    return out


def run(args) -> int:
    from .. import sage_suite as ss
    con = console()
    device = args.device or default_device()
    quant = args.quant or ss.default_quant(device)
    err = _check_options(args, device, quant)
    if err:
        from rich.markup import escape
        return error(escape(err))
    short = [n for n in (args.seq_lens or ()) if n <= 128]
    if short and _sections(args)[0]:  # block_index validation needs two key blocks, the odd length L - 37 > 0
        usage_error(f"--seq-lens {' '.join(map(str, short))}: the correctness checks need L > 128 (two key "
                    f"blocks of 128); give longer lengths, or run only --test-patterns / --benchmark-perf")
    writable_dir(args.out, "--out")
    with device_scope(device, args.threads):
        return run_suite(args, device, quant, con)


def run_suite(args, device: str, quant: str, con) -> int:
    import dataclasses

    import torch
    from .. import sage_suite as ss
    t0 = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    sizes = run_sizes(args, device)
    qz = ss.Quant(quant, args.quant_gran)
    correctness, pats, perf = _sections(args)
    header = make_header(args, device, quant, sizes, args.dtype)
    con.rule(f"sage-test: quant={quant}, {args.quant_gran}, {args.dtype}, on {header['gpu']} ({device})")
    if header.get("note"):
        con.print(f"[yellow]{header['note']}[/yellow]")
    lens = check_lens(args, sizes)
    con.print(f"sizes {sizes.name}: checks B={sizes.batch} H={sizes.heads} L={'/'.join(map(str, lens))} "
              f"D={sizes.head_dim}"
              + (f"; benchmark B={sizes.bench_batch} H={sizes.bench_heads} L={list(sizes.bench_lens)}"
                 if perf else ""))
    common = dict(dtype=dtype, device=device, seed=args.seed)
    progress = not args.no_progress
    checks, bench = [], []
    at = [dataclasses.replace(sizes, seq_len=L) for L in lens]  # the checks, once per length
    if correctness:
        checks += run_steps([s for z in at for s in ss.correctness_steps(qz, z, **common)], desc="correctness",
                            progress=progress)
    if pats:
        checks += run_steps([s for z in at for s in ss.pattern_steps(qz, z, args.top_k_ratios,
                                                                      names=selected_patterns(args), **common)],
                            desc="patterns", progress=progress)
    if perf:
        bench = run_steps(ss.benchmark_steps(qz, sizes, args.top_k_ratios, reps=args.reps, **common),
                          desc="benchmark", progress=progress)
    header["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    json_path = ss.write_json(out / "sage_test.json", header, checks, bench)
    md_path = ss.write_markdown(out / "sage_test.md", header, checks, bench)
    summary_tables(checks, bench, con, args.dtype)
    failed = [c for c in checks if c.passed is False]
    bench_errors = [r for r in bench if r.get("error")]
    if bench_errors:
        from rich.markup import escape
        con.print(f"[red]{len(bench_errors)} of {len(bench)} benchmark rows failed, e.g. "
                  f"{escape(str(bench_errors[0]['error']))}[/red]")
    con.print(f"wrote {md_path} and {json_path}")
    colour = "red" if failed else "green"
    con.rule(f"[{colour}]{ss.tally(checks)}[/{colour}] in {header['seconds']:.1f} s")
    for c in failed:
        con.print(f"[red]FAILED[/red] {c.section}: {c.name}: {c.detail}")
    return 1 if failed or bench_errors else 0

