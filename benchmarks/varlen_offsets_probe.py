"""Continuous-batching steps with ``cu_seqlens`` on the GPU against the same offsets given on the CPU.

    python benchmarks/varlen_offsets_probe.py --out $OUT/varlen-offsets.json

varlen_attention reads the offsets on the host to plan its blocks; offsets on the GPU make that read a sync
(the host waits for the kernels queued before), offsets on the CPU do not (the kernels get one asynchronous
copy). 8 sequences x 1 query row, caches 1K-32K, causal, H=32, Hkv 8, D=128, bf16, no grad. ``growing``:
every cache one token longer each call (the plan shared per varlen.plan_key); ``fixed``: the same lengths
each call. Each case runs once over all its GROW lengths (plans, kernel variants), then CALLS calls back
to back: the host loop's time a call, the wall time to the end of the last kernel, and the GPU span
between events recorded before the first and after the last call. ``+ sync``: a
torch.cuda.synchronize() before every call (what offsets on the GPU cost, made explicit);
``shared plans 4096``: the shared-plan cache large enough to hold every plan of the cycle. Since the device
plan (forty-sixth session; benchmarks/varlen_graph_probe.py) these forward-only calls build no plan, so the
shared-plans cases time the same calls as the others.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import api
from sparse_attn.bench.results import make_header

H, HKV, D, GROW, CALLS, ROUNDS = 32, 8, 128, 2048, 600, 2


def _cases():
    dev, dt = "cuda", torch.bfloat16
    k_lens = [1024 + i * (32768 - 1024) // 7 for i in range(8)]
    q = torch.randn(8, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(sum(k_lens) + 8 * GROW, HKV, D, device=dev, dtype=dt) for _ in range(2))
    cu_q = torch.arange(9, dtype=torch.int32, device=dev)
    cu_k = [torch.tensor([0] + torch.tensor([n + s for n in k_lens]).cumsum(0).tolist(), dtype=torch.int32,
                         device=dev) for s in range(GROW + 1)]
    on_cpu = {"gpu": (cu_q, cu_k), "cpu": (cu_q.cpu(), [c.cpu() for c in cu_k])}

    def step(s: int, where: str, sync: bool = False):
        if sync:
            torch.cuda.synchronize()
        t = sum(k_lens) + 8 * s
        cq, ck = on_cpu[where]
        return sparse_attn.varlen_attention(q, k[:t], v[:t], cq, ck[s], 1, max(k_lens) + s, causal=True)
    return {
        "growing, offsets on the GPU": lambda s: step(s, "gpu"),
        "growing, offsets on the CPU": lambda s: step(s, "cpu"),
        "growing, offsets on the CPU + sync": lambda s: step(s, "cpu", sync=True),
        "fixed, offsets on the GPU": lambda s: step(0, "gpu"),
        "fixed, offsets on the CPU": lambda s: step(0, "cpu"),
        "growing, offsets on the CPU, shared plans 4096": lambda s: step(s, "cpu"),
        "growing, offsets on the GPU, shared plans 4096": lambda s: step(s, "gpu"),
    }


def _time(fn, warm: int = GROW, calls: int = CALLS) -> dict:
    """``fn(s)`` for steps 1 .. warm (not timed), then steps 1 .. calls back to back: the host loop's time a
    step, the wall time to the end of the last kernel and the GPU span between events around the loop (us)."""
    for s in range(1, warm + 1):
        fn(s)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    for s in range(1, calls + 1):
        fn(s)
    e1.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"host_loop_us": 1e6 * (t1 - t0) / calls, "wall_us": 1e6 * (t2 - t0) / calls,
            "gpu_span_us": 1e3 * e0.elapsed_time(e1) / calls}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases, rows = _cases(), []
    for r in range(1, ROUNDS + 1):
        for name, fn in cases.items():
            api._SHARED_VARLEN_PLANS.max_size = 4096 if "4096" in name else 16
            row = {"round": r, "case": name, **_time(fn)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    api._SHARED_VARLEN_PLANS.max_size = 16
    Path(a.out).write_text(json.dumps({"header": make_header("cuda", "varlen-offsets"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
