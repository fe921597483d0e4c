"""Why does issuing one 8-bit sparse call take the host longer at 16K tokens than at 1K-4K?

    python benchmarks/host_issue_probe.py --out $OUT/host-issue.json [--lens 1024 4096 16384]

The sage-test benchmark's setting (B=4, H=32, D=128, bf16 inputs, random top-k block indices at
q block 64 / k block 128, ratio 0.5). For each length and for the 8-bit call (int8-fp8) and the bf16
call on the same layout:
- host milliseconds to issue one call after a synchronize (``bench.timing.host_issue_ms``'s method),
  each of the seven repetitions kept;
- whether a call synchronizes with the device (``torch.cuda.set_sync_debug_mode("error")``);
- what the caching allocator did during one call (memory_stats deltas: device mallocs / frees,
  retries), the suspect where host time grows with tensor size;
- the host's own time per Python function of one issued call (cProfile, top 12 by own time).
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
from sparse_attn.bench.results import make_header
from sparse_attn.patterns import from_block_index
from sparse_attn.sage_suite import block_grid, make_qkv, random_block_index, top_k_for

STAT_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.allocated",
             "segment.all.freed", "allocation.all.allocated")


def issue_times(fn, reps: int = 7) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return out


def syncs(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return f"synchronizes: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def allocator_deltas(fn) -> dict:
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    return {k: after.get(k, 0) - before.get(k, 0) for k in STAT_KEYS if k in after}


def host_profile(fn, calls: int = 5) -> str:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    B, H, D = 4, 32, 128
    rows = []
    for L in a.lens:
        q, k, v = make_qkv(B, H, L, D, dtype=torch.bfloat16, device="cuda", seed=0)
        nk = block_grid(L)[1]
        layout = from_block_index(random_block_index(B, H, L, top_k_for(a.ratio, nk), device="cuda"), seq_len=L)
        calls = {
            "int8-fp8": lambda: sparse_attn.attention(q, k, v, layout, quant="int8-fp8"),
            "bf16": lambda: sparse_attn.attention(q, k, v, layout),
        }
        for name, fn in calls.items():
            times = issue_times(fn)
            row = dict(seq_len=L, call=name, issue_ms=times, issue_ms_median=statistics.median(times),
                       sync=syncs(fn), allocator=allocator_deltas(fn), profile=host_profile(fn))
            print(f"L={L} {name}: issue ms {[round(t, 3) for t in times]}  sync: {row['sync']}  "
                  f"allocator: {row['allocator']}", flush=True)
            print(row["profile"], flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(dict(header=make_header("cuda", "host-issue-probe", lens=a.lens, ratio=a.ratio), rows=rows), indent=1))


if __name__ == "__main__":
    main()
