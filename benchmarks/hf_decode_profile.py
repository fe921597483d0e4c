"""Where the GPU time of a compiled static-cache decoding step goes: torch.profiler over generate(), kernels grouped.

    python benchmarks/hf_decode_profile.py --out $OUT/profile.json --impl dense|local|sdpa [--window 1024]
        [--layers 16] [--hidden 4096] [--kv-heads 0] [--scale 4] [--sliding-window 0] [--tokens 32]

The model and prompts of hf_decode_ab.py (random Llama, or Mistral with ``--sliding-window``; 8 left-padded
prompts times SCALE). After two warm-up generate() calls (compilation, CUDA graph recording), one generate() of
``--tokens`` new tokens runs under torch.profiler and again with a single token (the prefill); the difference is the
decoding steps. Kernels are summed by group (our attention kernels, GEMMs, inductor's fused kernels, copies, other),
and the wall time is set against the summed kernel time: what the GPU did not spend in kernels was launch gaps or
host work between graph replays.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from hf_batch_probe import _model, padded_inputs

# Our Triton kernels' names (ops/block_sparse, ops/sage, ops/block_pool, ops/block_select).
OURS = ("fwd_kernel", "split_merge_kernel", "bwd_", "quant_", "kv_partials", "kv_finish", "block_pool",
        "select_pack")


def _group(name: str) -> str:
    low = name.lower()
    if any(low.startswith(p) for p in OURS):
        return "sparse_attn"
    if any(s in low for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "splitk")):
        return "gemm"
    if low.startswith("triton_"):
        return "inductor"
    if "memcpy" in low or "memset" in low or "copy" in low:
        return "copy"
    if "flash" in low or "fmha" in low or "attention" in low or "cudnn" in low:
        return "sdpa"
    return "other"


GAP_US = 20.0  # a pause between kernels longer than this is the host's (generate() between replays), not the graph's


def _profile(fn) -> tuple[float, dict, dict, dict]:
    """(wall ms, ms by group, ms by kernel name, gaps) of one call of fn under torch.profiler. gaps: the summed idle
    time between consecutive kernels, split at GAP_US into short pauses (launch latency inside a CUDA graph) and long
    ones, with the kernel count."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    groups: dict = collections.Counter()
    names: dict = collections.Counter()
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            ms = ev.device_time / 1e3  # us
            groups[_group(ev.name)] += ms
            groups["count:" + _group(ev.name)] += 1
            names[ev.name] += ms
            spans.append((ev.time_range.start, ev.time_range.end))
    spans.sort()
    gaps = {"short_ms": 0.0, "long_ms": 0.0, "kernels": len(spans)}
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            gaps["short_ms" if gap <= GAP_US else "long_ms"] += gap / 1e3
        end = max(end, stop)
    return wall, dict(groups), dict(names), gaps


def main() -> None:
    import transformers

    from sparse_attn.bench.results import make_header
    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--impl", choices=("dense", "local", "sdpa"), default="dense")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--sliding-window", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    x, mask = padded_inputs(args.scale)
    if args.impl == "sdpa":
        model = _model("sdpa", args.layers, args.hidden, args.kv_heads, args.sliding_window)
    else:
        model = _model("sparse_attn", args.layers, args.hidden, args.kv_heads, args.sliding_window)
        cfg = (SparseAttnConfig("dense") if args.impl == "dense"
               else SparseAttnConfig("local", {"window": args.window}))
        enable(model, cfg)
    gen = lambda n: model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   cache_implementation="static")
    with torch.no_grad():
        for _ in range(2):
            gen(args.tokens)
            gen(1)
        wall_n, groups_n, names_n, gaps_n = _profile(lambda: gen(args.tokens))
        wall_1, groups_1, names_1, gaps_1 = _profile(lambda: gen(1))
    steps = args.tokens - 1
    per_step = {g: round((groups_n.get(g, 0) - groups_1.get(g, 0)) / steps, 4)
                for g in sorted(set(groups_n) | set(groups_1)) if not g.startswith("count:")}
    counts = {g[6:]: round((groups_n.get(g, 0) - groups_1.get(g, 0)) / steps, 1)
              for g in sorted(set(groups_n) | set(groups_1)) if g.startswith("count:")}
    gaps = {k: round((gaps_n[k] - gaps_1[k]) / steps, 4) for k in gaps_n}
    kernels = {n: (names_n.get(n, 0) - names_1.get(n, 0)) / steps for n in set(names_n) | set(names_1)}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    row = {"impl": args.impl, "wall_ms_per_step": round((wall_n - wall_1) / steps, 4),
           "kernel_ms_per_step": round(sum(per_step.values()), 4), "groups_ms_per_step": per_step,
           "kernels_per_step": counts, "gaps_per_step": gaps,
           "top_kernels_ms_per_step": [[n[:160], round(ms, 4)] for n, ms in top],
           "wall_ms": {"generate": wall_n, "prefill": wall_1}}
    print(json.dumps({k: row[k] for k in ("impl", "wall_ms_per_step", "kernel_ms_per_step", "groups_ms_per_step",
                                           "kernels_per_step", "gaps_per_step")}))
    for n, ms in row["top_kernels_ms_per_step"][:25]:
        print(f"{ms:9.4f}  {n[:120]}")
    with open(args.out, "w") as f:
        header = make_header("cuda", "hf-decode-profile", transformers=transformers.__version__, layers=args.layers,
                             hidden=args.hidden, kv_heads=args.kv_heads, scale=args.scale, window=args.window,
                             sliding_window=args.sliding_window, tokens=args.tokens)
        json.dump({**header, "rows": [row]}, f, indent=1)


if __name__ == "__main__":
    main()
