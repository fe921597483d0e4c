"""Grouped attention in one launch vs one call per group (issue 6), zigzag-llama3 shapes.

A sequence of S tokens is split zigzag-style over W ranks (``--world``): with G query groups per rank
(``--groups``, even) the sequence is cut into G * W chunks and rank r holds chunks r, 2W-1-r,
2W+r, 4W-1-r, ...; K/V are all-gathered, so each chunk attends the K/V prefix that ends with it,
causal (bottom-right). This times rank ``--rank``'s local attention two ways:

    grouped   sparse_attn.grouped_attention: every group in one launch (one dQ + one dK/dV launch backward)
    loop      sparse_attn.grouped.grouped_attention_loop: one sparse_attn.attention call per group
              (the prototype, outputs assembled with torch.cat)

Per row: median ms of each (CUDA events, L2 flushed before every repetition, warm-up and the
compiling first call excluded: sparse_attn.bench.timing), the speedup loop / grouped, effective
TFLOP/s (causal blocks of 128 x 128 actually computed, x3.5 for fwd+bwd), and the theoretical K/V
bytes read: the loop reads each group's K/V slice once per group, one launch at best reads the union
of the slices once (what L2 reuse can reach; both kernels re-read K/V per query tile either way).

    python benchmarks/grouped_bench.py --out benchmarks/results/grouped-h100.json     # GPU, ~2-4 min
    python benchmarks/grouped_bench.py --device cpu --tiny --out /tmp/grouped.json     # smoke test

Writes JSON ``{gpu, torch, triton, date, ..., config, rows}``.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import Group, patterns
from sparse_attn.bench.flops import attention_flops, tflops
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_fn
from sparse_attn.grouped import grouped_attention_loop
from sparse_attn.json_io import dumps

# name -> (query heads, kv heads, head dim, sequence lengths)
MODELS = {
    "llama3-8b": (32, 8, 128, (8192, 16384, 32768)),
    "llama3-70b": (64, 8, 128, (8192, 16384)),
}
TINY = {"tiny": (4, 2, 32, (256,))}


def zigzag_groups(seq_len: int, n_groups: int, world: int, rank: int) -> tuple[list[Group], int]:
    """Rank ``rank``'s groups (packed query slices in chunk order) and its query token count."""
    if n_groups % 2 or n_groups < 2:
        raise ValueError(f"--groups takes even counts (zigzag pairs), got {n_groups}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    c = seq_len // (n_groups * world)
    if c == 0:
        raise ValueError(f"sequence {seq_len} is too short for {n_groups} groups on {world} ranks")
    chunks = []
    for j in range(n_groups // 2):
        chunks += [2 * world * j + rank, 2 * world * (j + 1) - 1 - rank]
    return [Group(i * c, (i + 1) * c, 0, (ch + 1) * c) for i, ch in enumerate(chunks)], n_groups * c


def kv_bytes(groups, hkv: int, d: int, elt: int) -> tuple[int, int]:
    """(loop, one launch): K and V bytes read once per group vs once per token of the slices' union."""
    per = 2 * hkv * d * elt
    loop = sum(g.k_len for g in groups) * per
    covered = set()
    for g in groups:
        covered.update(range(g.k_start, g.k_end))
    return loop, len(covered) * per


def flops(groups, hq: int, d: int, mode: str) -> int:
    return sum(attention_flops(patterns.dense(g.q_len, g.k_len), batch=1, heads=hq, head_dim=d, mode=mode,
                               causal=True) for g in groups)


def time_one(fn, q, k, v, mode: str, device) -> float:
    if mode == "fwd":
        with torch.no_grad():
            return time_fn(fn, device)
    grad = torch.randn_like(fn())

    def step():
        fn().backward(grad)
    return time_fn(step, device, grad_to_none=(q, k, v))


def run_row(model, hq, hkv, d, seq_len, n_groups, world, rank, mode, dtype, device) -> dict:
    groups, tq = zigzag_groups(seq_len, n_groups, world, rank)
    grad = mode != "fwd"
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda n, h: torch.randn(n, h, d, generator=g, device=device).to(dtype).requires_grad_(grad)  # noqa: E731
    q, k, v = mk(tq, hq), mk(seq_len, hkv), mk(seq_len, hkv)
    one = lambda: sparse_attn.grouped_attention(q, k, v, groups, causal=True)  # noqa: E731
    loop = lambda: grouped_attention_loop(q, k, v, groups, causal=True)  # noqa: E731
    with torch.no_grad():
        diff = (one().float() - loop().float()).abs().max().item()
    ms_one = time_one(one, q, k, v, mode, device)
    ms_loop = time_one(loop, q, k, v, mode, device)
    fl = flops(groups, hq, d, mode)
    b_loop, b_one = kv_bytes(groups, hkv, d, q.element_size())
    row = {"model": model, "seq_len": seq_len, "world": world, "rank": rank, "groups": n_groups,
           "q_tokens": tq, "q_lens": [x.q_len for x in groups], "k_lens": [x.k_len for x in groups],
           "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
           "ms_grouped": ms_one, "ms_loop": ms_loop, "speedup": ms_loop / ms_one,
           "tflops_grouped": tflops(fl, ms_one), "tflops_loop": tflops(fl, ms_loop), "flops": fl,
           "kv_bytes_loop": b_loop, "kv_bytes_grouped": b_one, "kv_bytes_ratio": b_loop / b_one,
           "kv_mb_saved": (b_loop - b_one) / 2**20, "kv_saved_pct": 100.0 * (b_loop - b_one) / b_loop,
           "max_abs_diff": diff}
    return row


def write_rows_csv(path: Path, rows: list[dict]) -> None:
    """The rows as CSV, one column per key any row has (lists as space-separated values)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for row in rows:
            w.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--models", nargs="+", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--seq-lens", nargs="+", type=int, default=None, help="override each model's lengths")
    ap.add_argument("--groups", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--world", nargs="+", type=int, default=[2])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float16; float32 on CPU")
    ap.add_argument("--out", default=None, help="JSON file to write (a CSV of the rows beside it, same stem)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    models = TINY if a.tiny else {m: MODELS[m] for m in (a.models or MODELS)}
    rows = []
    for model, (hq, hkv, d, lens) in models.items():
        for seq_len in a.seq_lens or lens:
            for world in a.world:
                for n_groups in a.groups:
                    for mode in a.modes:
                        try:
                            row = run_row(model, hq, hkv, d, seq_len, n_groups, world, a.rank, mode, dtype, device)
                        except torch.cuda.OutOfMemoryError as e:
                            row = {"model": model, "seq_len": seq_len, "world": world, "groups": n_groups,
                                   "mode": mode, "error": f"OOM: {str(e).splitlines()[0]}"}
                            torch.cuda.empty_cache()
                        rows.append(row)
                        if "error" in row:
                            print(f"{model:11s} S={seq_len:6d} W={world} G={n_groups} {mode:7s} {row['error']}",
                                  flush=True)
                        else:
                            print(f"{model:11s} S={seq_len:6d} W={world} G={n_groups} {mode:7s} "
                                  f"grouped {row['ms_grouped']:8.3f} ms  loop {row['ms_loop']:8.3f} ms  "
                                  f"x{row['speedup']:.3f}  {row['tflops_grouped'] or 0:6.1f} TFLOP/s  "
                                  f"K/V read saved {row['kv_mb_saved']:.1f} MB ({row['kv_saved_pct']:.1f}%)  "
                                  f"diff {row['max_abs_diff']:.1e}",
                                  flush=True)
    payload = {**make_header(device, "grouped"), "config": vars(a), "rows": rows}
    if device.type == "cuda":  # the configs the autotuner chose, per kernel family and key (length class)
        from sparse_attn.ops.block_sparse.launch import autotune_picks
        payload["autotune_picks"] = autotune_picks()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(dumps(payload))
        write_rows_csv(Path(a.out).with_suffix(".csv"), rows)
        print(f"wrote {a.out} and {Path(a.out).with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
