"""Forward with the two warpgroups of a 128-row tile taking turns at the tensor cores
(launch.FWD_PINGPONG "on", kernels.PP_TURN) against without ("off"): outputs and LSE must be bitwise
equal; forward times alternated setting by setting in one process (medians of CUDA-event timings).

    python benchmarks/fwd_pingpong_probe.py --cases dense:16384:32 causal:16384:32 --rounds 7 --out $OUT/x.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fwdbwd_timeline_probe import layout_for  # noqa: E402


def timed(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384:32", "causal:16384:32", "random0.25:16384:32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for spec in a.cases:
        case, seq_len, kv_heads = spec.split(":")
        seq_len, kv_heads = int(seq_len), int(kv_heads)
        torch.manual_seed(0)
        q = torch.randn(1, 32, seq_len, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, seq_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        layout = layout_for(case, seq_len, 32)
        kw = {"quant": a.quant} if a.quant else {}
        call = lambda: sparse_attn.attention(q, k, v, layout, return_lse=True, **kw)  # noqa: E731
        results, times = {}, {"off": [], "on": []}
        for setting in ("off", "on"):
            launch.FWD_PINGPONG = setting
            out, lse = call()
            torch.cuda.synchronize()
            results[setting] = (out.clone(), lse.clone())
        same = bool(torch.equal(results["off"][0], results["on"][0]) and torch.equal(results["off"][1], results["on"][1]))
        calls = max(3, int(2000 / max(1, seq_len * seq_len * layout.density / 2**24)))
        calls = min(calls, 50)
        for _ in range(a.rounds):
            for setting in ("off", "on"):
                launch.FWD_PINGPONG = setting
                call()
                times[setting].append(timed(call, calls))
        launch.FWD_PINGPONG = "off"
        med = {s: statistics.median(t) for s, t in times.items()}
        row = dict(case=case, seq_len=seq_len, kv_heads=kv_heads, quant=a.quant, bitwise_equal=same,
                   off_ms=med["off"], on_ms=med["on"], speedup=med["off"] / med["on"], calls=calls,
                   off_all=times["off"], on_all=times["on"])
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if not k.endswith("_all")}), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/fwd_pingpong_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
