"""Host time of one attention call: what the CPU spends before the kernel runs.

    python benchmarks/launch_overhead.py --out $OUT/launch-overhead.json

Tiny inputs (B=1, H=32, L=256, D=128, bf16, causal), so the GPU finishes each kernel long before the
host issues the next and the per-call wall time is the host path. For each entry point: host
microseconds per call (median of 5 runs of 200 back-to-back calls), then a cProfile of 200 calls of
the public op sorted by own time. ``--quant int8-fp8``: also the 8-bit call, whose cProfile is then the
one printed (the sage-test benchmark's shortest rows looked host-bound).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import attention_op, forward_layout_inputs, launch, layout_inputs


def per_call_us(fn, n=200, runs=5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", help="also time (and profile) the 8-bit call with this quant")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    q, k, v = (torch.randn(1, 32, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lay = patterns.causal(256, 256, block_q=128, block_k=128, device="cuda")
    args = forward_layout_inputs(lay)
    scale = 128 ** -0.5

    def raw_launch():
        launch.forward(q, k, v, *args, None, None, lay.block_q, lay.block_k, scale, 256, 256)

    rows = {
        "empty_like (floor: one torch op)": per_call_us(lambda: torch.empty_like(q)),
        "launch.forward (Triton launch, no custom op)": per_call_us(raw_launch),
        "layout_inputs (cached schedule)": per_call_us(lambda: layout_inputs(lay, False)),
        "attention_op (custom op + launch)": per_call_us(lambda: attention_op(q, k, v, lay)),
        "sparse_attn.attention(layout=...)": per_call_us(lambda: sparse_attn.attention(q, k, v, lay)),
        "sparse_attn.attention(causal=True)": per_call_us(lambda: sparse_attn.attention(q, k, v, causal=True)),
    }
    profiled = lambda: sparse_attn.attention(q, k, v, causal=True)  # noqa: E731
    if a.quant:
        from sparse_attn.ops.sage import launch as sage_launch
        rows["quantize_rows (Q, per_warp)"] = per_call_us(lambda: sage_launch.quantize_rows(q, 16, 1, None, False))
        rows["kv_stats (K and V)"] = per_call_us(lambda: sage_launch.kv_stats(k, v, False))
        rows["quantize_v_fp8"] = per_call_us(lambda: sage_launch.quantize_v_fp8(v, False))
        profiled = lambda: sparse_attn.attention(q, k, v, lay, quant=a.quant)  # noqa: E731
        rows[f"sparse_attn.attention(layout=..., quant={a.quant})"] = per_call_us(profiled)
    for name, us in rows.items():
        print(f"{us:8.1f} us  {name}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        profiled()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue()[:9000])
    header = make_header("cuda", "probe", script="benchmarks/launch_overhead.py")
    Path(a.out).write_text(json.dumps({**header, "host_us_per_call": rows}, indent=1))


if __name__ == "__main__":
    main()
