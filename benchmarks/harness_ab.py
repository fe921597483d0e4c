"""The suite's two ways of timing the providers of one row, on the same inputs in one process:
back to back in blocks (time_cuda per provider, the harness before interleaving) and interleaved
(time_interleaved), alternated several times. Shows whether a change in a ratio comes from the method.

    python benchmarks/harness_ab.py --out $OUT/harness-ab-h100.json [--seq-len 16384] [--rounds 3]
"""
import argparse
import json

import torch

from sparse_attn import patterns
from sparse_attn.bench.registry import get_provider
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_cuda, time_interleaved
from sparse_attn.testing import random_qkv

PROVIDERS = ("sparse_attn", "flex", "sdpa-cudnn")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    L, H, D = a.seq_len, 32, 128
    q, k, v = random_qkv(1, H, H, L, L, D, torch.bfloat16, "cuda", seed=0)
    layout = patterns.dense(L, device="cuda")
    fns = [get_provider(p).make_run(q, k, v, layout, False, "fwd").fn for p in PROVIDERS]
    for fn in fns:
        fn()  # compile / autotune
    rows = []
    for r in range(a.rounds):
        blocks = [time_cuda(fn) for fn in fns]
        inter = time_interleaved(fns, "cuda")
        for method, ms in (("blocks", blocks), ("interleaved", inter)):
            row = {"round": r, "method": method, **{p: t for p, t in zip(PROVIDERS, ms)},
                   "ours_over_flex": ms[1] / ms[0], "ours_over_cudnn": ms[2] / ms[0]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump({**make_header("cuda", "probe", script="benchmarks/harness_ab.py", seq_len=L, pattern="dense"),
               "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
