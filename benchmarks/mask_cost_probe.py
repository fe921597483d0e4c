"""What the element masks cost each kernel: per-kernel times of one forward().backward(grad) for a
layout with masked blocks (causal, streaming), as shipped and with the masks ignored (``n_terms``
forced to 0 in launch.forward / launch.backward: the masked blocks then run as full ones, so the
dK/dV kernel takes the arithmetic walk that masks keep it from, item 18 of NOTES). Timing only: the
masks-ignored gradients are wrong. An upper bound on what any cheaper way of masking can buy.

    python benchmarks/mask_cost_probe.py --cases causal streaming dense --out $OUT/mask-cost-h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fwdbwd_timeline_probe import layout_for, profile_once, warm_up  # noqa: E402

_FWD, _BWD = launch.forward, launch.backward


def _unmasked_forward(*args, **kw):
    args = list(args)
    args[10] = 0  # n_terms
    return _FWD(*args, **kw)


def _unmasked_backward(*args, **kw):
    args = list(args)
    args[15] = 0  # n_terms
    return _BWD(*args, **kw)


def kernel_times(step, leaves, rounds: int) -> dict:
    """Median ms per kernel name over ``rounds`` profiled steps, and of the step's span ("span")."""
    return alternated_kernel_times(step, leaves, rounds, {None: lambda: None})[None]


def alternated_kernel_times(step, leaves, rounds: int, setups: dict) -> dict:
    """kernel_times under each of ``setups`` (label -> a callable putting that variant in place), the
    variants alternated step by step in every round: {label: {kernel name or "span": median ms}}."""
    for setup in setups.values():
        setup()
        warm_up(step, leaves)
    per = {label: defaultdict(list) for label in setups}
    for _ in range(rounds):
        for label, setup in setups.items():
            setup()
            once = profile_once(step, leaves)
            for name, ms in {**once["kernels"], "span": once["span_ms"]}.items():
                per[label][name].append(ms)
    return {label: {name: sorted(v)[len(v) // 2] for name, v in d.items()} for label, d in per.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["causal", "streaming", "dense"])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(0)
    q = torch.randn(1, a.heads, a.seq_len, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, a.kv_heads, a.seq_len, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    rows = []
    for case in a.cases:
        layout = layout_for(case, a.seq_len, a.heads)
        for variant in ("shipped", "masks-ignored"):
            launch.forward, launch.backward = ((_FWD, _BWD) if variant == "shipped"
                                               else (_unmasked_forward, _unmasked_backward))
            try:
                times = kernel_times(lambda: sparse_attn.attention(q, k, v, layout).backward(grad), (q, k, v),
                                     a.rounds)
            finally:
                launch.forward, launch.backward = _FWD, _BWD
            row = dict(case=case, variant=variant, density=layout.density, median_ms=times)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/mask_cost_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
