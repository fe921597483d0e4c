"""attention() without a layout, forward only: the kernels' device plan against the host's plan of the same
default layout (what a call with gradients runs), on the same inputs.

    python benchmarks/device_plan_ab.py --out $OUT/device-plan-ab.json

Cases: dense and causal, B=1, H=32, Hkv 8, D=128, bf16, at 4K / 16K / 32K (the autotuned long-query kernel)
and decoding (1 query row on a 32K cache: the short-query kernel). ``device plan``:
``attention(q, k, v, causal=...)`` under no_grad; ``host plan``: the same call given the default layout
(``api._kernel_layout(None, ...)``, prepared). Both first run once and must agree bit for bit (one autotune
pick); then ROUNDS rounds alternate the two, REPS timed calls each (CUDA events, after a synchronize): the
median ms per case and plan. The kernels alone; their host time is the host_overhead probe's subject.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import api
from sparse_attn.bench.results import make_header

H, HKV, D, ROUNDS, REPS = 32, 8, 128, 5, 10


def _time(fn) -> float:
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(REPS):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / REPS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for causal in (False, True):
        for lq, lk in ((4096, 4096), (16384, 16384), (32768, 32768), (1, 32768)):
            q = torch.randn(1, H, lq, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, HKV, lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            layout = sparse_attn.prepare(api._kernel_layout(None, causal, lq, lk, q.device), backward=False)
            with torch.no_grad():
                device = lambda: sparse_attn.attention(q, k, v, causal=causal)  # noqa: E731
                host = lambda: sparse_attn.attention(q, k, v, layout)  # noqa: E731
                same = torch.equal(device(), host())
                times = {"device plan": [], "host plan": []}
                for _ in range(ROUNDS):
                    for name, fn in (("device plan", device), ("host plan", host)):
                        times[name].append(_time(fn))
            row = {"causal": causal, "lq": lq, "lk": lk, "bitwise_equal": same,
                   **{f"{name} ms": statistics.median(t) for name, t in times.items()}}
            row["device / host"] = row["device plan ms"] / row["host plan ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(a.out).write_text(json.dumps({"header": make_header("cuda", "device-plan-ab"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
