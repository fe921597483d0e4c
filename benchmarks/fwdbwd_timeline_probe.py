"""Where a training step's attention time goes: one ``forward().backward(grad)`` (the bench's fwd+bwd
row) under torch.profiler, for ours and for Flex given the same layout. Prints every CUDA kernel with
its duration, the sum of kernel time, and the span from the first kernel's start to the last one's end:
a span well above the kernel sum means idle gaps (host work, syncs), and kernels other than the
attention ones (copies, fills, casts) are overhead either side pays.

    python benchmarks/fwdbwd_timeline_probe.py --cases dense causal random0.25 streaming --seq-len 16384 \
        --out $OUT/fwdbwd-timeline-h200.json
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from sparse_attn import patterns
from sparse_attn.bench.providers import flex_provider, sparse_attn_provider
from sparse_attn.bench.results import make_header


def layout_for(case: str, seq_len: int, heads: int):
    if case == "dense":
        return patterns.dense(seq_len, device="cuda")
    if case == "causal":
        return patterns.causal(seq_len, device="cuda")
    if case.startswith("random"):
        return patterns.random(seq_len, density=float(case[len("random"):]), heads=heads, device="cuda")
    if case == "streaming":
        return patterns.streaming(seq_len, window=4096, num_sink=128, device="cuda")
    if case == "local":
        return patterns.local(seq_len, window=4096, device="cuda")
    if case == "block_diagonal":
        return patterns.block_diagonal(seq_len, 4096, device="cuda")
    raise SystemExit(f"unknown case {case!r}: dense, causal, randomD, streaming, local, block_diagonal")


def warm_up(step, leaves, calls: int = 3) -> None:
    for _ in range(calls):
        step()
        for t in leaves:
            t.grad = None
    torch.cuda.synchronize()


def profile_once(step, leaves) -> dict:
    """One ``step()`` under torch.profiler: ``span_ms`` (first kernel's start to last one's end),
    ``kernel_sum_ms`` and ``kernels`` (name -> ms, summed over launches, longest first)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min(e.time_range.start for e in ev)
    t1 = max(e.time_range.end for e in ev)
    per_name = defaultdict(float)
    for e in ev:
        per_name[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e3
    return dict(span_ms=(t1 - t0) / 1e3, kernel_sum_ms=sum(per_name.values()),
                kernels=dict(sorted(per_name.items(), key=lambda kv: -kv[1])))


def timeline(step, leaves) -> dict:
    warm_up(step, leaves)
    return profile_once(step, leaves)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense", "causal", "random0.25", "streaming"])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = (1, a.heads, a.seq_len, 128)
    kv_shape = (1, a.kv_heads, a.seq_len, 128)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows = []
    for case in a.cases:
        layout = layout_for(case, a.seq_len, a.heads)
        for name, provider in (("sparse_attn", sparse_attn_provider), ("flex", flex_provider)):
            fwd = provider(q, k, v, layout, False)
            row = dict(case=case, provider=name, **timeline(lambda: fwd().backward(grad), (q, k, v)))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/fwdbwd_timeline_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
