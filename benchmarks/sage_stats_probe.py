"""The 8-bit path's statistics pass, old against new, on the GPU: K's mean and V's channel amax taken
by torch's two reductions (``k.mean`` + ``aminmax`` and their fp32 finishing ops: the launcher before
kv_stats) or by kv_stats' one Triton launch over both. Per case (int8-fp8, per_warp, bf16 inputs,
H=32, D=128), alternated round by round in one process, with FlexAttention on the same layout in the
rotation so the ratio comes from the same clocks:

- ``end_to_end``: ``sparse_attn.attention(..., quant="int8-fp8")`` under each statistics pass, and Flex;
- ``stats``: the statistics alone (each variant's K mean and V amax), against the copy-rate floor of
  reading K and V once;
- ``kernels``: one profiled call per variant, GPU time per kernel name (where the call's time goes).

    python benchmarks/sage_stats_probe.py --cases local4096:32768 local4096:131072 dense:16384 \
        --rounds 7 --out $OUT/sage-stats-h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch
import triton

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.providers import flex_provider
from sparse_attn.bench.results import make_header
from sparse_attn.ops.sage import launch as sage_launch
from sparse_attn.ops.sage.reference import smoothing_mean, v_channel_scale

FUSED = sage_launch.kv_stats


def torch_kv_stats(k, v, varlen, cu=None, max_len=None):
    """The launcher's statistics before kv_stats (dense inputs): two torch reductions (and the same
    finishing as kv_stats: K's smoothing mean, V's channel scale)."""
    assert not varlen
    mean = smoothing_mean(k.mean(2, dtype=torch.float32)) if k is not None and k.shape[2] else None
    scale = None
    if v is not None:
        mn, mx = torch.aminmax(v, dim=2)
        scale = v_channel_scale(torch.maximum(mx, -mn).float())
    return mean, scale


VARIANTS = {"torch": torch_kv_stats, "fused": FUSED}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def kernel_breakdown(fn) -> dict:
    """GPU ms per kernel name over one call (after a warm call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:80]] += e.device_time / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["local4096:32768", "local4096:131072", "dense:16384"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copy-rate", type=float, default=4.0e12, help="bytes/s of a device copy (the floor)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        kind, L = case.split(":")
        L = int(L)
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k += torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16) * 3  # what smoothing is for
        layout = None if kind == "dense" else patterns.local(L, int(kind[5:]), device="cuda")
        causal = kind != "dense"
        call = lambda: sparse_attn.attention(q, k, v, layout, causal=causal, quant="int8-fp8")  # noqa: E731
        outs = {}
        for name, fn in VARIANTS.items():  # the two passes agree, and the output is real (not poison)
            sage_launch.kv_stats = fn
            mean, amax = fn(k, v, False)
            outs[name] = (mean, amax, call())
        sage_launch.kv_stats = FUSED
        (m0, a0, o0), (m1, a1, o1) = outs["torch"], outs["fused"]
        check = dict(mean_max_abs_diff=(m0 - m1).abs().max().item(), v_scale_equal=bool(torch.equal(a0, a1)),
                     out_max_abs_diff=(o0.float() - o1.float()).abs().max().item(),
                     out_finite=bool(torch.isfinite(o1).all()))
        flex = flex_provider(q, k, v, layout, causal)
        e2e, stats = defaultdict(list), defaultdict(list)
        for _ in range(a.rounds):
            for name, fn in VARIANTS.items():
                sage_launch.kv_stats = fn
                e2e[name].append(ms(call))
                stats[name].append(ms(lambda fn=fn: fn(k, v, False)))
            sage_launch.kv_stats = FUSED
            e2e["flex"].append(ms(flex))
        shapes = {}  # the statistics kernel's rows per load and warps (the launcher's constants), alone
        saved = sage_launch.STAT_ROWS, sage_launch.STAT_WARPS
        for rows_, warps in ((32, 4), (64, 8), (64, 4), (16, 4)):
            sage_launch.STAT_ROWS, sage_launch.STAT_WARPS = rows_, warps
            shapes[f"{rows_}x{warps}"] = statistics.median(ms(lambda: FUSED(k, v, False)) for _ in range(3))
        sage_launch.STAT_ROWS, sage_launch.STAT_WARPS = saved
        kernels = {}
        for name, fn in VARIANTS.items():
            sage_launch.kv_stats = fn
            kernels[name] = kernel_breakdown(call)
        sage_launch.kv_stats = FUSED
        med = lambda d: {n: statistics.median(t) for n, t in d.items()}  # noqa: E731
        row = dict(case=case, seq_len=L, check=check, end_to_end_ms=med(e2e), stats_ms=med(stats), stats_fused_shapes_ms=shapes,
                   stats_copy_floor_ms=2 * k.numel() * k.element_size() / a.copy_rate * 1e3,
                   flex_over=({n: statistics.median(e2e["flex"]) / statistics.median(e2e[n]) for n in VARIANTS}),
                   kernels=kernels, rounds=a.rounds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/sage_stats_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
