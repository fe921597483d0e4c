"""``sparse-attn quick``: dense vs adaptive-sparse attention on one input, with pass/fail."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (accuracy_dtype, add_accuracy_options, console, default_device, error, nonneg_int,
                      positive_int, positive_tokens, device_scope)

DESCRIPTION = """Quick accuracy check of adaptive sparse attention (sparse_attn.predict.adaptive_attention:
meansim block prediction from pooled Q/K, then the block-sparse call) against dense attention on
one input. Prints cosine similarity, relative L1 and RMSE of the sparse output against the dense
one, the sparsity (fraction of the dense baseline's blocks skipped; causal: of the causal blocks),
and PASS/FAIL against the thresholds; exit code 0 on pass, 1 on fail.

Sparse levels map to meansim (simthreshd1, cdfthreshd):
  {levels}.
Lower simthreshd1 treats more blocks as self-similar (prunable); lower cdfthreshd keeps less of
each row's pooled attention mass. --simthreshd1/--cdfthreshd/--topk override the level.

Inputs are random but structured (so that they are sparsifiable; pure N(0,1) inputs attend almost
uniformly, use --random to see that): per head a latent sequence mixing a slow AR(1) drift
(correlation length 128 tokens) with one of 8 recurring topic vectors (redrawn every 384 tokens),
q and k are the latent plus noise whose level varies per 64-token stretch in U(0.2, 1.8), v ~ N(0,1).

--benchmark also times dense vs sparse (median of repetitions). On the CPU both run the PyTorch
reference: those are CPU reference timings, not a statement about the GPU kernels."""


def levels_text() -> str:
    from ..predict import SPARSE_LEVELS
    return ", ".join(f"{name} = {pair}" for name, pair in SPARSE_LEVELS.items())


def add_parser(sub) -> None:
    p = sub.add_parser("quick", help="dense vs adaptive-sparse attention on one input (pass/fail)",
                       description=DESCRIPTION.format(levels=levels_text()), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=positive_tokens, default=1024,
                   help="query length L (default 1024; 8k style accepted)")
    p.add_argument("--kv-len", type=positive_tokens, help="key length (default: L)")
    p.add_argument("--sparse-level", choices=["low", "medium", "high"], default="medium",
                   help="threshold preset (default medium)")
    p.add_argument("--simthreshd1", type=float, help="override the level's self-similarity threshold")
    p.add_argument("--cdfthreshd", type=float, help="override the level's CDF threshold (0, 1]")
    p.add_argument("--topk", type=float, help="keep this fraction of key blocks per row instead of the CDF rule")
    p.add_argument("--causal", action="store_true", help="causal attention (bottom-right aligned)")
    p.add_argument("--attention-sink", action="store_true", help="always keep the first key block")
    p.add_argument("--benchmark", action="store_true", help="also time dense vs sparse")
    p.add_argument("--batch", type=positive_int, default=2, help="batch size (default 2)")
    p.add_argument("--heads", type=positive_int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (GQA when < heads; default: heads)")
    p.add_argument("--block", type=int, default=128, help="block size for queries and keys (default 128)")
    p.add_argument("--random", action="store_true", help="pure N(0,1) inputs instead of structured ones")
    p.add_argument("--qkv", type=Path, metavar="FILE.pt",
                   help="your own inputs instead: a torch.save'd dict {'q', 'k', 'v'} (or a tuple q, k, v) of "
                        "[B, H, L, D] tensors, e.g. captured from a model layer (sizes then come from the file)")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw dense vs sparse attention maps and their difference for one head (--head)")
    p.add_argument("--head", type=nonneg_int, default=0, help="query head --plot draws (default 0)")
    p.add_argument("--threads", type=nonneg_int,
                   help="CPU intra-op threads (default 1: on a busy shared machine torch's spinning OpenMP "
                        "threads made --benchmark timings noise; 0 = torch's default)")
    add_accuracy_options(p)
    p.set_defaults(func=run)


def predictor_kwargs(args) -> dict:
    from ..predict import level_params
    kw = level_params(args.sparse_level)
    if args.simthreshd1 is not None:
        kw["simthreshd1"] = args.simthreshd1
    if args.cdfthreshd is not None:
        kw["cdfthreshd"] = args.cdfthreshd
    if args.topk is not None:
        if args.cdfthreshd is not None:  # one rule or the other: --cdfthreshd was dropped without a word
            raise ValueError(f"give --topk ({args.topk}) or --cdfthreshd ({args.cdfthreshd}), not both: top-k keeps "
                             "a fraction of key blocks instead of the CDF rule")
        kw["topk"] = args.topk
        kw.pop("cdfthreshd")
    kw.update(block=args.block, attention_sink=args.attention_sink)
    return kw


def load_qkv(path: Path, device, dtype):
    """Floating-point q, k, v ``[B, H, L, D]`` from a ``torch.save`` file: a dict with keys q, k, v or a sequence
    of three tensors (loaded with weights_only=True: tensors only, no code runs)."""
    import torch
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"--qkv {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - a pickle of something else, a truncated file, ...
        raise ValueError(f"--qkv {path}: not a torch.save file of tensors ({type(e).__name__}: {e})") from None
    if isinstance(data, dict) and {"q", "k", "v"} <= set(data):
        q, k, v = data["q"], data["k"], data["v"]
    elif isinstance(data, (list, tuple)) and len(data) == 3:
        q, k, v = data
    else:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"--qkv {path}: expected a dict with keys q, k, v or a tuple (q, k, v), got {got}")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise ValueError(f"--qkv {path}: q, k, v must be 4-D [B, H, L, D] tensors, got "
                         f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (q, k, v)]}")
    for name, t in zip("qkv", (q, k, v)):  # complex lost its imaginary part in the cast; ints were read as numbers
        if not t.is_floating_point():
            raise ValueError(f"--qkv {path}: {name} is {t.dtype}; q, k, v must be real floating-point tensors (for a "
                             "complex one save torch.view_as_real(t).flatten(-2))")
    for name, t in zip("qkv", (q, k, v)):  # an empty L passed every check on "0 of 0 blocks", as --seq-len 0 may not
        empty = [dim for dim, n in zip(("B", "H", "L", "D"), t.shape) if n == 0]
        if empty:
            raise ValueError(f"--qkv {path}: {name} has shape {list(t.shape)}, empty in {', '.join(empty)}; every size "
                             "of [B, H, L, D] must be at least 1 (as --seq-len, --batch, --heads, --head-dim)")
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def make_inputs(args, device, dtype):
    from .. import accuracy
    if args.qkv is not None:
        return load_qkv(args.qkv, device, dtype)
    make = accuracy.random_qkv if args.random else accuracy.structured_qkv
    return make(args.batch, args.heads, args.seq_len, args.head_dim, kv_heads=args.kv_heads, kv_len=args.kv_len,
                seed=args.seed, dtype=dtype, device=device)


def benchmark(q, k, v, kw: dict, causal: bool, device: str, con) -> dict:
    """Median ms of dense, predict, sparse attention on the predicted layout, and predict + sparse."""
    import sparse_attn
    import torch
    from rich.table import Table
    from ..bench.timing import time_fn
    from ..predict import adaptive_attention, meansim
    layout = meansim(q, k, causal=causal, **kw)
    times = {"dense": time_fn(lambda: sparse_attn.attention(q, k, v, causal=causal), device),
             "predict (meansim)": time_fn(lambda: meansim(q, k, causal=causal, **kw), device),
             "sparse attention (layout given)": time_fn(lambda: sparse_attn.attention(q, k, v, layout, causal=causal),
                                                        device),
             "adaptive (predict + sparse)": time_fn(lambda: adaptive_attention(q, k, v, causal=causal, **kw),
                                                    device)}
    table = Table(title="timing (median ms)" + (f" - CPU reference timings, indicative only "
                                                 f"({torch.get_num_threads()} threads), not GPU kernel performance"
                                                 if device == "cpu" else ""))
    for col in ("what", "ms", "speedup vs dense"):
        table.add_column(col, justify="right" if col != "what" else "left")
    for name, ms in times.items():
        replaces_dense = name not in ("dense", "predict (meansim)")
        table.add_row(name, f"{ms:.2f}", f"{times['dense'] / ms:.2f}x" if replaces_dense else "")
    con.print(table)
    return times


def run(args) -> int:
    con = console()
    device = args.device or default_device()
    if args.plot is not None:  # its folder and format now, not after the run (a file as folder: a traceback)
        from .viz import output_path
        args.plot = output_path(args.plot, "--plot")  # noext -> noext.png, the file that is written
    with device_scope(device, args.threads):
        return check(args, device, con)


def check(args, device: str, con) -> int:
    from rich.markup import escape
    import sparse_attn
    from .. import accuracy
    from ..predict import adaptive_attention
    dtype = accuracy_dtype(args.dtype, device, None if args.qkv is not None else args.head_dim)
    try:
        kw = predictor_kwargs(args)
        q, k, v = make_inputs(args, device, dtype)
    except (ValueError, TypeError) as e:
        return error(escape(str(e)))
    settings = ", ".join(f"{key}={val}" for key, val in kw.items() if key not in ("block", "attention_sink"))
    con.rule(f"quick test: sparse level {args.sparse_level} ({settings})")
    con.print(f"L={q.shape[2]}{'' if k.shape[2] == q.shape[2] else f', Lk={k.shape[2]}'}, causal={args.causal}, "
              f"device {device}, {str(dtype).replace('torch.', '')}, blocks {args.block}x{args.block}")
    source = str(args.qkv) if args.qkv is not None else "random N(0,1)" if args.random else "structured"
    con.print(f"inputs ({escape(source)}): q {list(q.shape)}, k/v {list(k.shape)}")
    if args.plot is not None:  # the head and map size now: after the run it printed PASS lines, then exit 2
        try:
            accuracy.comparison_inputs(q, k, None, args.head, 0)
        except ValueError as e:
            return error(f"--plot: {escape(str(e))}")
    try:
        dense = sparse_attn.attention(q, k, v, causal=args.causal)
        out, layout = adaptive_attention(q, k, v, causal=args.causal, **kw)
    except (ValueError, TypeError) as e:
        return error(escape(str(e)))
    m = accuracy.metrics.compare(out, dense)
    sparsity = accuracy.effective_sparsity(layout, args.causal)
    con.print(f"\nCossim: {m['cosine']:.4f}, L1: {m['relative_l1']:.4f}, RMSE: {m['rmse']:.4f}")
    grid = f" ({layout.sparsity:.2%} of the whole block grid)" if args.causal else ""
    con.print(f"sparsity: {sparsity:.2%} of the {'causal' if args.causal else 'dense'} blocks skipped{grid}; "
              f"{layout.num_blocks} of {accuracy.baseline_blocks(layout, args.causal)} blocks computed")
    checks = [(m["cosine"] > args.min_cosine, f"cosine {m['cosine']:.4f} > {args.min_cosine}"),
              (m["relative_l1"] < args.max_l1, f"relative L1 {m['relative_l1']:.4f} < {args.max_l1}"),
              (sparsity > args.min_sparsity, f"sparsity {sparsity:.2%} > {100 * args.min_sparsity:g}%")]
    con.print("\nchecks:")
    for ok, text in checks:
        con.print(f"  {'[green]PASS[/green]' if ok else '[red]FAIL[/red]'} {text}")
    if args.plot is not None:
        try:
            path = accuracy.plot_attention_comparison(args.plot, q=q, k=k, v=v, head=args.head, causal=args.causal,
                                                      params=kw, layout=layout)
        except ValueError as e:
            return error(f"--plot: {escape(str(e))}")
        con.print(f"wrote {path} (head {args.head})")
    if args.benchmark:
        con.print()
        benchmark(q, k, v, kw, args.causal, device, con)
    passed = all(ok for ok, _ in checks) and bool(m["finite"])
    con.rule("[green]PASSED[/green]" if passed else "[red]FAILED[/red]")
    return 0 if passed else 1
