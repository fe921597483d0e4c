"""Host cost of the device guard (sparse_attn.device_guard) on the calls where it matters most: a decoding step's
attention, whose host time is the step's bound, served by the decoding entry (ops.block_sparse.entry).

    python benchmarks/device_guard_probe.py --out $OUT/device-guard.json

Cases (H=32, Hkv 8, D=128, bf16, no grad, one GPU, the inputs' device current, which is where the guard only
reads and compares): ``decode`` attention(q [1, 32, 1, D], K/V cache [1, 8, 32768, D], causal=True) and
``prefill-1k`` (q/k/v [1, 32 / 8, 1024, D], causal). Each round times ``sparse_attn.attention`` (guarded) and its
``__wrapped__`` body (unguarded) alternately, host clock around each call, medians of CALLS calls (the stream
synchronized every 50); the result is each variant's median over ROUNDS rounds.
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

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead_probe import host_us  # noqa: E402

ROUNDS = 7


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    cases = {
        "decode": (rand(1, 32, 1, 128), rand(1, 8, 32768, 128), rand(1, 8, 32768, 128)),
        "prefill-1k": (rand(1, 32, 1024, 128), rand(1, 8, 1024, 128), rand(1, 8, 1024, 128)),
    }
    variants = {"guarded": sparse_attn.attention, "unguarded": sparse_attn.attention.__wrapped__}
    rows = []
    with torch.no_grad():
        for name, (q, k, v) in cases.items():
            for fn in variants.values():
                for _ in range(20):  # warm-up: compile, autotune, the entry's learning
                    fn(q, k, v, causal=True)
            torch.cuda.synchronize()
            per = {label: [] for label in variants}
            for _ in range(ROUNDS):
                for label, fn in variants.items():
                    per[label].append(host_us(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal=True)))
            row = {"case": name, **{f"{label}_us": statistics.median(t) for label, t in per.items()},
                   "rounds_us": per}
            row["guard_us"] = row["guarded_us"] - row["unguarded_us"]
            rows.append(row)
            print(json.dumps({key: val for key, val in row.items() if key != "rounds_us"}), flush=True)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/device_guard_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
