"""``sparse-attn bench``: run a benchmark suite, write JSON + CSV, print a summary table."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import console, default_device, split_list, tokens

DESCRIPTION = """Time attention providers on a suite of sparse patterns.

Every row is one (pattern, L, Hkv, mode, provider). Effective TFLOP/s count the blocks the
layout visits (4*B*Hq*D*block_q*block_k per block for fwd, x2.5 bwd, x3.5 fwd+bwd), the same
count for every provider of a pattern, so TFLOP/s ratios are time ratios. The SDPA providers
compute DENSE attention (causal-dense for causal patterns): they are the baseline to beat.
Timing is the median of repetitions after warm-up (CUDA events with an L2 flush on GPU,
perf_counter on CPU); peak memory (CUDA only) is the extra memory one call allocates beyond
its inputs. Failed rows (e.g. OOM) are recorded with an error, not fatal.

Options given below replace the suite's own values (--patterns selects by glob)."""


def add_parser(sub) -> None:
    from ..bench import MODES, SUITES
    from ..bench.suites import DTYPES
    p = sub.add_parser("bench", help="run a benchmark suite (JSON + CSV + table)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="small", choices=list(SUITES) + ["all"],
                   help="which suite (default: small, the CPU-friendly one; 'kernels' is the H100 suite; "
                        "'all': every suite that fits the device: small on CPU, kernels + demo-gpu on CUDA)")
    p.add_argument("--stress", action="store_true",
                   help="with --suite all: also run each case at 2x and 4x its longest length "
                        "(to see where providers run out of memory; OOM rows are recorded, not fatal)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--providers", nargs="+", metavar="NAME",
                   help="providers to run instead of the suite's (space or comma separated; see --list)")
    p.add_argument("--patterns", nargs="+", metavar="GLOB",
                   help="keep only these patterns, by case name or builder name, shell globs ('random*')")
    p.add_argument("--seq-lens", nargs="+", type=tokens, metavar="L", help="sequence lengths, e.g. 4096 8k 128K")
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="fwd, bwd (backward only), fwd+bwd")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (fp32, fp16, bf16, ...)")
    p.add_argument("--batch", type=int, help="batch size B")
    p.add_argument("--heads", type=int, help="query heads Hq")
    p.add_argument("--kv-heads", nargs="+", type=int, metavar="HKV", help="key/value heads (GQA when < Hq)")
    p.add_argument("--head-dim", type=int, help="head dim D")
    p.add_argument("--reps", type=int, help="timed repetitions per row (default: enough for ~200 ms, 3..100)")
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default: ~25 ms worth, 1..10)")
    p.add_argument("--baseline", help="provider the speedup column compares with "
                   "(default: first of sdpa-cudnn, sdpa-flash, sdpa-math, reference present)")
    p.add_argument("--out-dir", default="out/bench", type=Path, help="where JSON and CSV go (default: out/bench)")
    p.add_argument("--name", help="file stem of the results (default: SUITE-DEVICE, e.g. small-cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list suites and providers (with availability) and exit")
    p.set_defaults(func=run)


def selected_suite(args, device: str = "cpu"):
    from ..bench import get_suite, restrict
    from ..bench.suites import ALL, suite_all
    if getattr(args, "stress", False) and args.suite != ALL:
        raise KeyError("--stress only applies to --suite all")
    base = suite_all(device, stress=args.stress) if args.suite == ALL else get_suite(args.suite)
    return restrict(base, providers=split_list(args.providers), patterns=split_list(args.patterns),
                    seq_lens=args.seq_lens, modes=args.modes, dtype=args.dtype, batch=args.batch,
                    heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)


def list_all(device: str, con) -> int:
    from rich.table import Table
    from rich.text import Text
    from ..bench import SUITES, get_provider, provider_names
    t = Table(title=f"providers on {device}")
    for col in ("provider", "computes", "available", "why / what"):
        t.add_column(col)
    for name in provider_names():
        prov = get_provider(name)
        ok, why = prov.available(device)
        t.add_row(name, prov.computes, "yes" if ok else "no", Text(f"{prov.description} [{why}]"))
    con.print(t)
    s = Table(title="suites")
    for col in ("suite", "rows", "description"):
        s.add_column(col)
    for name, make in SUITES.items():
        suite = make()
        s.add_row(name, str(suite.num_rows()), suite.description)
    con.print(s)
    return 0


def drop_unavailable(suite, device, con):
    """The suite without providers that cannot run on ``device`` (each reported once)."""
    from dataclasses import replace
    from rich.markup import escape
    from ..bench import check_providers
    names = [p for c in suite.cases for p in c.providers]
    usable, skipped = check_providers(names, device)
    for name, why in skipped.items():
        con.print(f"[yellow]skipping provider {name}: {escape(why)}[/yellow]")
    cases = tuple(replace(c, providers=tuple(p for p in c.providers if p in usable)) for c in suite.cases)
    return replace(suite, cases=tuple(c for c in cases if c.providers)), skipped


def run_suite_to_files(suite, device, *, out_dir: Path, name: str | None, reps=None, warmup=None,
                       baseline=None, progress=True, con=None):
    """Run ``suite`` on ``device``, writing JSON + CSV after every row; print the table.

    Returns (rows, json_path, csv_path)."""
    from ..bench import make_header, run_suite, summary_table, write_csv, write_json
    from ..bench.runner import expand
    con = con or console()
    suite, skipped = drop_unavailable(suite, device, con)
    stem = name or f"{suite.name}-{device.split(':')[0]}"
    json_path, csv_path = Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.csv"
    header = make_header(device, suite.name, reps=reps, skipped_providers=skipped)
    n = len(expand(suite))
    if n == 0:
        con.print("[red]nothing to run: no rows left after filtering and dropping unavailable providers[/red]")
        return [], None, None
    where = device if header["gpu"] == "cpu" else f"{header['gpu']} ({device})"
    con.print(f"suite [bold]{suite.name}[/bold] on [bold]{where}[/bold], torch {header['torch']}, "
              f"triton {header['triton']}: {n} rows -> {json_path}")
    rows = []

    def save(row):
        rows.append(row)
        write_json(json_path, header, rows)

    run_suite(suite, device, reps=reps, warmup=warmup, progress=progress, on_row=save)
    write_csv(csv_path, rows)
    con.print(summary_table(rows, baseline=baseline, title=f"{suite.name} on {header['gpu']} "
                                                         f"(effective TFLOP/s; SDPA rows are dense baselines)"))
    failed = [r for r in rows if r.error]
    if failed:
        con.print(f"[yellow]{len(failed)} of {len(rows)} rows failed (see the error column)[/yellow]")
    con.print(f"wrote {json_path} and {csv_path}")
    return rows, json_path, csv_path


def run(args) -> int:
    from rich.markup import escape
    con = console()
    device = args.device or default_device()
    if args.list:
        return list_all(device, con)
    try:
        suite = selected_suite(args, device)
    except KeyError as e:
        con.print(f"[red]{escape(str(e.args[0]))}[/red]")
        return 2
    from ..bench import provider_names
    unknown = sorted({p for c in suite.cases for p in c.providers} - set(provider_names()))
    if unknown:
        con.print(f"[red]unknown provider(s) {', '.join(unknown)}; known: {', '.join(provider_names())}[/red]")
        return 2
    rows, json_path, _ = run_suite_to_files(suite, device, out_dir=args.out_dir, name=args.name, reps=args.reps,
                                            warmup=args.warmup, baseline=args.baseline,
                                            progress=not args.no_progress, con=con)
    return 0 if json_path is not None else 1
