"""What the LSE's gradient costs the backward (NOTES backward item 29): the same backward with the
loss on the output alone (dLSE None: the row-terms pass skips its load, HAS_DLSE off) and on the
output plus ``0 * lse`` (autograd hands a zero dLSE: HAS_DLSE on), timed interleaved on the same
inputs through ``torch.autograd.grad`` (forward outside the timing).

    python benchmarks/dlse_cost_probe.py --out $OUT/dlse-cost-h100.json
"""
from __future__ import annotations

import argparse
import json

import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved

CASES = {"dense": lambda L: patterns.dense(L, device="cuda"),
         "random-0.25": lambda L: patterns.random(L, density=0.25, heads=32, seed=0, device="cuda")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--out")
    a = ap.parse_args()
    L, rows = a.seq_len, []
    for name, make in CASES.items():
        layout = make(L)
        q, k, v = (torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out, lse = sparse_attn.attention(q, k, v, layout, return_lse=True)
        do = torch.randn_like(out)
        plain = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
        with_dlse = lambda: torch.autograd.grad((out, lse), (q, k, v), (do, torch.zeros_like(lse)),  # noqa: E731
                                                retain_graph=True)
        g1, g2 = plain(), with_dlse()
        same = all(torch.equal(x, y) for x, y in zip(g1, g2))
        ms = time_interleaved([plain, with_dlse], "cuda", reps=30)
        rows.append({"pattern": name, "seq_len": L, "ms_dlse_none": ms[0], "ms_dlse_zeros": ms[1],
                     "ratio": ms[1] / ms[0], "grads_bitwise_equal": same})
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"header": make_header("cuda", "probe", script="benchmarks/dlse_cost_probe.py"), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
