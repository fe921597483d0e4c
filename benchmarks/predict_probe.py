"""Device-time breakdown of one adaptive prediction (GPU): pooling configurations, the pooled-score
matmul, the fused rank-select-pack kernel vs its PyTorch twin. Prints one line per measurement.

    python benchmarks/predict_probe.py [--seq 32768] [--heads 32] [--block 64]
"""
from __future__ import annotations

import argparse
import math

import torch
import triton

from sparse_attn.accuracy import structured_qkv
from sparse_attn.ops.block_pool import kernels as pool_kernels
from sparse_attn.ops.block_pool.launch import block_pool
from sparse_attn.predict import level_params, meansim
from sparse_attn.predict.meansim import _per_head, rank_and_pack


def bench(fn, reps=20):
    return triton.testing.do_bench(fn, warmup=5, rep=reps * 5) * 1e3  # us


def pool_variant(x, block, br, warps):
    B, H, L, D = x.shape
    nb = math.ceil(L / block)
    pooled = torch.empty(B, H, nb, D, dtype=torch.float32, device=x.device)
    sim = torch.empty(B, H, nb, dtype=torch.float32, device=x.device)
    return lambda: pool_kernels.block_pool_kernel[(nb, H, B)](
        x, pooled, sim, L, *x.stride(), *pooled.stride()[:3], *sim.stride()[:2],
        D=D, BLOCK=block, BR=br, BD=triton.next_power_of_2(D), num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--block", type=int, default=64)
    a = ap.parse_args()
    q, k, _ = structured_qkv(1, a.heads, a.seq, 128, dtype=torch.bfloat16, device="cuda")
    gb = q.numel() * q.element_size() / 1e9
    print(f"L={a.seq} H={a.heads} block={a.block}: one tensor is {gb:.3f} GB "
          f"(read at 3.3 TB/s: {gb / 3.3e3 * 1e6:.0f} us)")
    print(f"pool (launcher)        {bench(lambda: block_pool(q, a.block)):8.1f} us")
    for br in (16, 32, 64):
        for warps in (2, 4, 8):
            if a.block % br == 0:
                print(f"pool BR={br:3d} warps={warps}  {bench(pool_variant(q, a.block, br, warps)):8.1f} us")
    mq, sq = block_pool(q, a.block)
    mk, sk = block_pool(k, a.block)
    raw = torch.einsum("bhqd,bhkd->bhqk", mq, mk)
    print(f"pooled scores einsum   {bench(lambda: torch.einsum('bhqd,bhkd->bhqk', mq, mk)):8.1f} us")
    H = a.heads
    for causal in (True, False):
        sim, cdf = level_params("medium").values()
        sim_t = _per_head("s", sim, H, "cuda", torch.float32)
        cdf_t = _per_head("c", cdf, H, "cuda", torch.float32, 0.0, 1.0)
        kw = dict(q_len=a.seq, kv_len=a.seq, block_q=a.block, block_k=a.block, scale=128 ** -0.5, causal=causal,
                  sink=False)
        for kernel in (True, False):
            t = bench(lambda: rank_and_pack(raw, sq, sk, sim_t, cdf_t, None, kernel=kernel, **kw))
            print(f"rank+pack causal={causal!s:5} kernel={kernel!s:5} {t:8.1f} us")
        lay = rank_and_pack(raw, sq, sk, sim_t, cdf_t, None, kernel=True, **kw)
        twin = rank_and_pack(raw, sq, sk, sim_t, cdf_t, None, kernel=False, **kw)
        rows = (lay.kv_indices != twin.kv_indices).any(-1) | (lay.kv_counts != twin.kv_counts)
        gap = (lay.kv_counts - twin.kv_counts)[rows].abs()
        print(f"  kernel == twin: {not bool(rows.any())}; rows differing {int(rows.sum())} of {rows.numel()} "
              f"(count differences {gap.unique().tolist()}: CDF rounding at the threshold); "
              f"sparsity {lay.sparsity:.4f} vs {twin.sparsity:.4f}")
        t = bench(lambda: meansim(q, k, causal=causal, block=a.block, **level_params("medium")))
        print(f"meansim total causal={causal!s:5} {t:8.1f} us")


if __name__ == "__main__":
    main()
