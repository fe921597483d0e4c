"""Where the context-parallel forward loses time at small per-GPU sizes: one rank's CP call against
the same local work, with parts of the CP path switched off one at a time.

    torchrun --standalone --nproc_per_node=N benchmarks/cp_overhead_probe.py --out $OUT/cp-overhead.json

Rows (per-rank medians of CUDA-event times, a barrier before each repetition):
  local            this rank's per-group attention calls on K/V already in memory (no communication)
  cp               zigzag_llama3_attention as shipped
  cp_no_check      the same with the cross-rank input check (an all_gather read back on the host) skipped
  gather_only      the K/V all-gather and merge alone
  host_cp          host milliseconds until the CP call returns (GPU idle at the start)
  host_check       host milliseconds of the cross-rank input check alone
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.parallel import zigzag as zz
from sparse_attn.parallel.comm import HeadChunkGather
from sparse_attn.parallel.plan import dense_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_run import Timer  # noqa: E402  the CP benchmark's timing: barrier, sync, CUDA-event median


def host_phases(cp, zz, with_check: bool) -> dict:
    """Median host milliseconds from the call to: the end of the input check (skipped unless
    ``with_check``), the start of the local attention, the return."""
    from sparse_attn.parallel import local as local_mod
    stamps, real_check, real_fwd = {}, zz.check_consistent_shapes, local_mod.forward

    def timed_check(*a, **kw):
        if with_check:
            real_check(*a, **kw)
        stamps["check_done"] = time.perf_counter()

    def timed_fwd(*a, **kw):
        stamps["local_start"] = time.perf_counter()
        return real_fwd(*a, **kw)

    zz.check_consistent_shapes, local_mod.forward = timed_check, timed_fwd
    rows = []
    try:
        for _ in range(30):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cp()
            t1 = time.perf_counter()
            rows.append({"check_done": stamps["check_done"] - t0, "local_start": stamps["local_start"] - t0,
                         "return": t1 - t0})
        torch.cuda.synchronize()
    finally:
        zz.check_consistent_shapes, local_mod.forward = real_check, real_fwd
    return {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[8192])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    H, Hkv, D = 32, 8, 128
    timer = Timer(torch.device("cuda"))
    median_ms = lambda fn: timer.median_ms(fn, reps=30, warmup=5, barrier=True)  # noqa: E731
    rows = []
    for tokens in a.tokens_per_gpu:
        L = tokens * world
        g = torch.Generator(device="cuda").manual_seed(rank)
        q = torch.randn(1, H, tokens, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, Hkv, tokens, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        kf, vf = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        plan = dense_plan(L, world, rank)
        groups = plan.groups(True)

        def local():
            for gr in groups:
                sparse_attn.attention(q[:, :, gr.q_start:gr.q_end], kf[:, :, gr.k_start:gr.k_end],
                                      vf[:, :, gr.k_start:gr.k_end], causal=True)

        def cp():
            zz.zigzag_llama3_attention(q, k, v, causal=True)

        def gather_only():
            HeadChunkGather((k, v), [(0, Hkv)], plan)[0]

        def host_ms(fn):
            times = []
            for _ in range(30):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            return statistics.median(times)

        def check():
            zz.check_consistent_shapes({"q": q, "k": k, "v": v}, None, {"causal": 1, "kv_head_chunk": -1})

        real_check = zz.check_consistent_shapes
        res = {"local": median_ms(local), "cp": median_ms(cp), "gather_only": median_ms(gather_only),
               "host_cp": host_ms(cp), "host_check": host_ms(check)}
        res["host_phases"] = host_phases(cp, zz, with_check=True)
        res["host_phases_no_check"] = host_phases(cp, zz, with_check=False)
        zz.check_consistent_shapes = lambda *args, **kw: None
        try:
            res["cp_no_check"] = median_ms(cp)
        finally:
            zz.check_consistent_shapes = real_check
        got = [None] * world
        dist.all_gather_object(got, res)
        row = {"tokens_per_gpu": tokens, "world": world, "per_rank": got}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        header = make_header("cuda", "probe", script="benchmarks/cp_overhead_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
