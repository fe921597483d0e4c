"""``sparse-attn bench``: run a benchmark suite, write JSON + CSV, print a summary table."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (CPU_TIMING_NOTE, Once, add_pattern_options, console, default_device, device_arg, error,
                      file_stem, nonneg_int, positive_int, positive_tokens, device_scope, seed_arg, split_list,
                      usage_error, writable_dir)

DESCRIPTION = """Time attention providers on a suite of sparse patterns.

Every row is one (pattern, L, Hkv, mode, provider). Effective TFLOP/s count the blocks the
layout visits (4*B*Hq*D*block_q*block_k per block for fwd, x2.5 bwd, x3.5 fwd+bwd), the same
count for every provider of a pattern, so TFLOP/s ratios are time ratios. The SDPA providers
compute DENSE attention (causal-dense for causal patterns): they are the baseline to beat.
Timing is the median of repetitions after warm-up (CUDA events with an L2 flush on GPU,
perf_counter on CPU); peak memory (CUDA only) is the extra memory one call allocates beyond
its inputs. Failed rows (e.g. OOM) are recorded with an error, not fatal.

Options given below replace the suite's own values (--patterns selects by glob); pattern options
(--window, --block-size, ...) re-parameterise the selected patterns that take them, e.g. seed 002's
streaming benchmark: --patterns streaming --window 64 --num-sink 16 --seq-lens 1k 2k 4k.

A suite too long for one command (a GPU box whose commands are time-limited) runs in slices:
--plan N prints N contiguous slices with their rows and estimated time (the cost model of
sparse_attn.bench.slices), --slice K/N runs slice K; `sparse-attn report --from DIR` merges them."""


def add_parser(sub) -> None:
    from ..bench import MODES, SUITES
    from ..bench.suites import DTYPES
    p = sub.add_parser("bench", help="run a benchmark suite (JSON + CSV + table)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="small", choices=list(SUITES) + ["all"],
                   help="which suite (default: small, the CPU-friendly one; 'kernels' and 'sage' (8-bit) are H100 suites, "
                        "'sage' runs a tiny stand-in on a CPU; "
                        "'report-gpu' is the long-context report's; "
                        "'all': every suite that fits the device: small on CPU, kernels + demo-gpu + report-gpu "
                        "on CUDA)")
    p.add_argument("--slice", metavar="K/N",
                   help="run only slice K of N (contiguous runs of rows of about equal estimated time; "
                        "see --plan)")
    p.add_argument("--plan", nargs="?", type=int, const=0, metavar="N",
                   help="print the suite cut into N slices (default: the fewest of <= --slice-limit each) with "
                        "rows and estimated H100 seconds, and exit")
    p.add_argument("--slice-limit", type=float, default=420.0, metavar="S",
                   help="with --plan and no N: the longest estimated slice in seconds (default 420)")
    p.add_argument("--skip-done", type=Path, metavar="DIR",
                   help="skip rows that the result JSON files in DIR already hold (timed or failed): "
                        "re-running a slice that was cut off finishes it")
    p.add_argument("--stress", action="store_true",
                   help="with --suite all: also run each case at 2x and 4x its longest length "
                        "(to see where providers run out of memory; OOM rows are recorded, not fatal)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--providers", nargs="+", metavar="NAME",
                   help="providers to run instead of the suite's (space or comma separated; see --list)")
    p.add_argument("--patterns", nargs="+", metavar="GLOB",
                   help="keep only these patterns, by case name (a family name also selects its NAME-... "
                        "variants), shell globs ('random*')")
    p.add_argument("--seq-lens", nargs="+", type=positive_tokens, metavar="L",
                   help="sequence lengths, e.g. 4096 8k 128K")
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="fwd, bwd (backward only), fwd+bwd")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="input dtype (fp32, fp16, bf16, ...)")
    p.add_argument("--batch", type=positive_int, help="batch size B")
    p.add_argument("--heads", type=positive_int, help="query heads Hq")
    p.add_argument("--kv-heads", nargs="+", type=positive_int, metavar="HKV", help="key/value heads (GQA when < Hq)")
    p.add_argument("--head-dim", type=positive_int, help="head dim D")
    g = p.add_argument_group("pattern options: replace the selected patterns' own values where their builder takes "
                             "them (the rows are then named NAME[option=value,...] for builder options and "
                             "NAME<block_k=K,block_q=Q> for --block-q/--block-k, e.g. "
                             "local[window=64]<block_k=64,block_q=64>)")
    g.add_argument("--block-q", type=positive_int, action=Once, help="layout query block size (16..256)")
    g.add_argument("--block-k", type=positive_int, action=Once, help="layout key block size (16..256)")
    g.add_argument("--seed", type=seed_arg, action=Once, help="random/bigbird: RNG seed")
    p.set_defaults(pattern_option_names=("block_q", "block_k", "seed") + add_pattern_options(g))
    p.add_argument("--reps", type=positive_int,
                   help="timed repetitions per row (default: enough for ~200 ms, 3..100 on CUDA, 3..20 on a CPU)")
    p.add_argument("--warmup", type=nonneg_int,
                   help="untimed calls before timing (default: ~25 ms worth, 1..10 on CUDA, at most 2 on a CPU)")
    p.add_argument("--threads", type=nonneg_int,
                   help="CPU intra-op threads while timing (default 1: on a busy shared machine torch's spinning "
                        "OpenMP threads made CPU timing ratios noise; 0 = torch's default)")
    p.add_argument("--interleave", action="store_true",
                   help="time the providers of one row together, repetitions interleaved (each follows every other "
                        "equally often) "
                        "(default: each provider's repetitions back to back, its sustained speed alone; "
                        "on a power-capped GPU the two can rank kernels differently, see benchmarks/NOTES.md)")
    p.add_argument("--baseline", help="provider the speedup column compares with "
                   "(default: first of sdpa-cudnn, sdpa-flash, sdpa-math, reference present)")
    p.add_argument("--out-dir", default="out/bench", type=Path, help="where JSON and CSV go (default: out/bench)")
    p.add_argument("--name", type=file_stem, help="file stem of the results (default: the suite run and the device, e.g. small-cpu, "
                                  "sage-tiny-cpu; with --slice K/N, then -K-of-N)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list suites and providers (with availability) and exit")
    p.set_defaults(func=run)


def restriction(args) -> dict:
    """The ``bench.restrict`` options the command line gives (only those set), also recorded in the
    JSON header so that a report compares against the rows asked for."""
    pattern_options = {k: getattr(args, k) for k in getattr(args, "pattern_option_names", ())
                       if getattr(args, k, None) is not None}
    opts = dict(providers=split_list(args.providers), patterns=split_list(args.patterns), seq_lens=args.seq_lens,
                modes=args.modes, dtype=args.dtype, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, pattern_options=pattern_options or None)
    return {k: v for k, v in opts.items() if v is not None}


def selected_suite(args, device: str = "cpu"):
    """The suite the options select: restricted (:func:`restriction`), then cut to ``--slice`` K/N."""
    from ..bench import restrict
    from ..bench.suites import ALL, suite_all, suite_for_device
    if getattr(args, "stress", False) and args.suite != ALL:
        raise KeyError("--stress only applies to --suite all")
    if getattr(args, "stress", False) and args.seq_lens:  # restrict() would replace the stress lengths
        raise KeyError("--stress adds 2x and 4x each case's longest length and --seq-lens replaces the lengths: "
                       "give one of them")
    base = suite_all(device, stress=args.stress) if args.suite == ALL else suite_for_device(args.suite, device)
    try:
        suite = restrict(base, **restriction(args))
    except ValueError as e:  # a pattern option none of the selected patterns takes
        raise KeyError(str(e)) from None
    if getattr(args, "slice", None):  # before dropping providers the device lacks: same rows everywhere
        from ..bench.slices import parse_slice, slice_suite
        try:
            suite = slice_suite(suite, *parse_slice(args.slice))
        except ValueError as e:
            raise KeyError(str(e)) from None
    return suite


def print_plan(suite, n: int, limit_s: float, con, suite_arg: str | None = None, restricted: bool = False) -> int:
    """The suite's slices (rows, first and last row, estimated seconds); n=0: the fewest within limit_s.
    ``suite_arg``: the --suite given, for the command line printed (on a CPU ``sage`` runs as its stand-in
    ``sage-tiny``, which is no --suite choice); ``restricted``: options cut the suite (a slice needs them too)."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text
    from ..bench.runner import expand
    from ..bench.slices import estimate_seconds, plan, slices_needed
    try:
        n = n or slices_needed(suite, limit_s)
        parts = plan(suite, n)
    except ValueError as e:
        return error(escape(str(e)))
    t = Table(title=f"suite {suite.name}: {len(expand(suite))} rows in {n} slices "
                    f"(estimated for an H100; compiles charged per slice)")
    for col in ("slice", "rows", "est. s", "first row", "last row"):
        t.add_column(col, justify="right" if col in ("rows", "est. s") else "left")
    total = 0.0
    for i, part in enumerate(parts, 1):
        pts = expand(part)
        est = estimate_seconds(part)
        total += est
        t.add_row(f"{i}/{n}", str(len(pts)), f"{est:.0f}", Text(pts[0].label()), Text(pts[-1].label()))
    con.print(t)
    con.print(f"total estimate {total:.0f} s ({total / 60:.1f} min); run one with "
              f"`sparse-attn bench --suite {suite_arg or suite.name} --slice K/{n}`"
              + (" with this plan's other options" if restricted else ""))
    return 0


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


def earlier_rows(json_path: Path, suite) -> list:
    """The rows of an earlier ``json_path`` that ``suite`` does not run again (kept by ``--skip-done``)."""
    from ..bench.results import read_result
    from ..bench.runner import expand
    if not json_path.exists():
        return []
    try:
        _, old, _ = read_result(json_path)
    except ValueError as e:
        usage_error(f"--skip-done: cannot keep the earlier rows ({e}); move the file away")
    again = {p.key() for p in expand(suite)}  # Point.key() ends with the provider already (Row.key() does not)
    return [r for r in old if r.key() + (r.provider,) not in again]


def run_suite_to_files(suite, device, *, out_dir: Path, name: str | None, reps=None, warmup=None,
                       baseline=None, progress=True, con=None, header_extra: dict | None = None,
                       interleave: bool = False, keep_earlier: bool = False):
    """Run ``suite`` on ``device``, writing JSON + CSV after every row; print the table.

    ``header_extra`` is added to the JSON header (e.g. ``slice``). ``keep_earlier``: the rows an existing
    JSON of the same name holds and ``suite`` does not run again are kept in front of the new ones (a
    slice finished with ``--skip-done`` over its own folder lost its earlier rows otherwise).
    Returns (the rows run now, json_path, csv_path)."""
    from rich.markup import escape
    from ..bench import make_header, run_suite, summary_table, write_csv, write_json
    from ..bench.results import eight_bit
    from ..bench.runner import expand
    from ..ops.block_sparse.launch import autotune_picks
    con = con or console()
    suite, skipped = drop_unavailable(suite, device, con)
    stem = name or f"{suite.name}-{device.split(':')[0]}"
    json_path, csv_path = Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.csv"
    header = make_header(device, suite.name, reps=reps, skipped_providers=skipped,
                         timing="interleaved" if interleave else "blocks", **(header_extra or {}))
    n = len(expand(suite))
    if n == 0:
        error("nothing to run: no rows left after filtering and dropping unavailable providers")
        return [], None, None
    if header["gpu"] == "cpu":
        import torch
        header.update(note=CPU_TIMING_NOTE, threads=torch.get_num_threads())
    where = device if header["gpu"] == "cpu" else f"{header['gpu']} ({device})"
    est = ""
    if header["gpu"] != "cpu":
        from ..bench.slices import estimate_seconds
        try:
            est = f", ~{estimate_seconds(suite) / 60:.0f} min on an H100"
        except Exception:  # noqa: BLE001 - an estimate must never stop a run (e.g. a pattern that fails to build)
            est = ""
    kept = earlier_rows(json_path, suite) if keep_earlier else []
    con.print(f"suite [bold]{suite.name}[/bold] on [bold]{where}[/bold], torch {header['torch']}, "
              f"triton {header['triton']}: {n} rows{est} -> {json_path}"
              + (f" (keeping its {len(kept)} earlier rows)" if kept else ""))
    if header["gpu"] == "cpu":
        con.print(f"[yellow]{CPU_TIMING_NOTE}; {header['threads']} thread(s)[/yellow]")
    rows, new = list(kept), []

    def save(row):
        rows.append(row)
        new.append(row)
        picks = autotune_picks()  # our kernels' choices so far (none on CPU, where nothing is tuned)
        if picks:
            header["autotune_picks"] = picks
        write_json(json_path, header, rows)

    run_suite(suite, device, reps=reps, warmup=warmup, progress=progress, on_row=save, interleave=interleave)
    write_csv(csv_path, rows)
    ops = "TFLOP/s, TOPS for 8-bit rows" if any(eight_bit(r.provider) for r in rows) else "TFLOP/s"
    con.print(summary_table(rows, baseline=baseline, title=f"{suite.name} on {header['gpu']} "
                                                         f"(effective {ops}; SDPA rows are dense baselines)"))
    failed = [r for r in new if r.error]
    if failed and len(failed) == len(new):
        error(f"all {len(new)} rows failed, e.g. {escape(failed[0].error or '')}")
    elif failed:
        con.print(f"[yellow]{len(failed)} of {len(new)} rows failed (see the error column)[/yellow]")
    con.print(f"wrote {json_path} and {csv_path}")
    return new, json_path, csv_path


def check_gqa(suite, args) -> None:
    """Exit 2 unless every (Hq, Hkv) the suite will run has Hq a multiple of Hkv (grouped-query attention):
    ``--heads 4 --kv-heads 3`` (or ``--heads 3`` against a suite's Hkv 2) ran and failed every such row
    with an internal error, exit 0."""
    bad = sorted({(c.heads, hkv) for c in suite.cases for hkv in c.kv_heads if c.heads % hkv})
    if bad:
        pairs = ", ".join(f"{hq} query heads with {hkv} key/value heads" for hq, hkv in bad)
        heads = f"--heads {args.heads}" if args.heads else "the suite's query heads"
        kv = f"--kv-heads {' '.join(map(str, args.kv_heads))}" if args.kv_heads else "the suite's key/value heads"
        usage_error(f"{heads} and {kv}: query heads must be a multiple of key/value heads (grouped-query "
                    f"attention), not {pairs}; give --heads and --kv-heads that divide")


def gpu_only_suites() -> list[str]:
    """Suites sized for a GPU that have no CPU stand-in (see bench.suites.CPU_STAND_INS)."""
    from ..bench import SUITES
    from ..bench.suites import CPU_STAND_INS
    return [n for n in SUITES if n != "small" and n not in CPU_STAND_INS]


def run(args) -> int:
    from rich.markup import escape
    con = console()
    device = args.device or default_device()
    if args.list:
        return list_all(device, con)
    if args.plan is not None and args.slice:  # it planned slices of the slice, and its hint ran other rows
        usage_error(f"--plan cuts the suite into slices and --slice {args.slice} runs one of them: give one of "
                    "the two (--plan N, then --slice K/N with the same other options)")
    try:
        suite = selected_suite(args, device)
    except KeyError as e:
        return error(escape(str(e.args[0])))
    if not suite.cases:  # (--plan crashed on it, a run said only "nothing to run")
        from ..bench.suites import ALL, suite_all, suite_for_device
        base = suite_all(device) if args.suite == ALL else suite_for_device(args.suite, device)
        names = ", ".join(dict.fromkeys(c.pattern.name for c in base.cases))
        return error(f"--patterns {escape(' '.join(args.patterns or []))} selects no case of suite {base.name}; "
                     f"its cases: {escape(names)}")
    check_gqa(suite, args)
    from ..bench import provider_names
    unknown = sorted({p for c in suite.cases for p in c.providers} - set(provider_names()))
    if unknown:  # before --plan, whose cost model looks every provider up (a KeyError traceback)
        return error(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(provider_names())}")
    if args.plan is not None:
        return print_plan(suite, args.plan, args.slice_limit, con, suite_arg=args.suite,
                          restricted=bool(restriction(args)))
    if not device.startswith("cuda") and args.suite in gpu_only_suites():
        # its rows reach 128K tokens: on the CPU reference path that is hours, not a benchmark
        usage_error(f"--suite {args.suite} is a GPU suite (up to 128K tokens) and --device is {device}; on a CPU "
                    f"run --suite small, sage (its tiny stand-in) or all (= small); --plan works anywhere")
    if args.baseline:
        running = sorted({p for c in suite.cases for p in c.providers})
        if args.baseline not in running:
            usage_error(f"--baseline {args.baseline} is not one of the providers this run times: "
                        f"{', '.join(running)}")
    if args.skip_done:
        from ..bench.slices import drop_done
        if not args.skip_done.is_dir():
            usage_error(f"--skip-done {args.skip_done}: no such folder (give the --out-dir of the earlier run)")
        try:
            suite, n_done = drop_done(suite, args.skip_done)
        except (ValueError, TypeError, AttributeError) as e:
            usage_error(f"--skip-done {args.skip_done}: a JSON file there is not a bench result ({e})")
        con.print(f"skipping {n_done} rows already in {args.skip_done}")
    if args.suite not in (suite.name, "all"):
        con.print(f"[yellow]suite {args.suite} is sized for a GPU: on {device} running its tiny stand-in "
                  f"{suite.name} ({suite.description})[/yellow]")
    name, extra = args.name, {}
    restricted = restriction(args)
    if restricted:  # the report then compares against the restricted suite, not all of it
        extra["restricted"] = restricted
    if args.slice:
        extra["slice"] = args.slice
        name = name or f"{suite.name}-{device.split(':')[0]}-{args.slice.replace('/', '-of-')}"
    writable_dir(args.out_dir, "--out-dir")
    with device_scope(device, args.threads):
        rows, json_path, _ = run_suite_to_files(suite, device, out_dir=args.out_dir, name=name, reps=args.reps,
                                                warmup=args.warmup, baseline=args.baseline,
                                                progress=not args.no_progress, con=con, header_extra=extra,
                                                interleave=args.interleave, keep_earlier=bool(args.skip_done))
    if json_path is None:
        return 1
    return 1 if all(r.error for r in rows) else 0  # every row failed: nothing was measured
