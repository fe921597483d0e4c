"""What a decoding call served by the replay entry (ops.block_sparse.entry) spends its host time on, piece by piece,
beside torch's sdpa on the same inputs: ``attention(q [1, 32, 1, 128], K/V [1, 8, L, 128], causal=True)`` in bf16,
each piece timed alone in a loop of N calls (medians; the stream synchronized every 50 calls so the launch queue never
fills). Pieces: the entry's key, its table lookups, replay.run's allocations, each kept launch, and the whole call.

    PYTHONPATH=src:benchmarks python benchmarks/entry_cost_probe.py OUT.json [--lengths 4096,32768]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from host_overhead_probe import host_times

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.ops import fast_launch
from sparse_attn.ops.block_sparse import entry, launch, replay


def _us(fn, n: int = 2000) -> float:
    return round(statistics.median(host_times(fn, n)) * 1e6, 2)


def _case(length: int) -> dict:
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(4):  # first launches, the recording, the entry's learning
        sparse_attn.attention(q, k, v, causal=True)
    key = entry.key(q, k, v, True, None, False, None, 0)
    learnt = entry._keys.find(key)
    recipe = None if learnt is None else learnt.recipe_now()
    assert recipe is not None, "the geometry was not learnt"
    st = entry._stand_in(q.device)
    inputs = (q, k, v, st, st, st, st, st, st, None, None)
    table = list(inputs) + [torch.empty(s, dtype=d, device=q.device) for s, d in recipe.allocs]
    stream = fast_launch._stream(fast_launch._device())
    bound = []
    for launcher_, template, tensors in recipe.launches:
        values = list(template)
        for pos, s in tensors:
            values[pos] = table[s]
        bound.append((launcher_, values))
    row = {"length": length, "launches": len(recipe.launches), "allocs": len(recipe.allocs),
           "launch args": [len(vals) for _, vals in bound]}
    row["sdpa (F.scaled_dot_product_attention)"] = _us(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True))
    row["attention() served by the entry"] = _us(lambda: sparse_attn.attention(q, k, v, causal=True))
    row["entry.key"] = _us(lambda: entry.key(q, k, v, True, None, False, None, 0))
    row["  launch._replay_settings"] = _us(launch._replay_settings)
    row["  replay.geometry x3"] = _us(lambda: (replay.geometry(q), replay.geometry(k), replay.geometry(v)))
    row["  is_current_stream_capturing"] = _us(torch.cuda.is_current_stream_capturing)
    row["  fast_launch._device"] = _us(fast_launch._device)
    row["_keys.find + recipe_now + usable"] = _us(lambda: (entry._keys.find(key).recipe_now(), replay.usable()))
    row["replay.run (allocs + launches), lse dropped"] = _us(lambda: replay.run(recipe, inputs, q.device, False))
    row["  4 fresh allocs (before the scratch)"] = _us(
        lambda: [torch.empty(s, dtype=d, device=q.device) for s, d in recipe.allocs])
    row["  1 fresh alloc"] = _us(lambda: torch.empty(recipe.allocs[0][0], dtype=recipe.allocs[0][1], device=q.device))
    row["  fast_launch._stream"] = _us(lambda: fast_launch._stream(fast_launch._device()))
    for i, (launcher_, values) in enumerate(bound):
        row[f"  launch {i} alone"] = _us(lambda launcher_=launcher_, values=values: launcher_(stream, values))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", default="4096,32768")
    args = ap.parse_args()
    rows = [_case(int(n)) for n in args.lengths.split(",")]
    for row in rows:
        for name, value in row.items():
            print(f"{name:45s} {value}")
    with open(args.out, "w") as f:
        json.dump({**make_header("cuda", "entry-cost"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
