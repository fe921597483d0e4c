"""FlexAttention at head dim 64 on the H100: its default config (128 x 128 tiles, 3 stages) needs more
shared memory than an SM has under torch 2.11 / triton 3.6. Time it with kernel_options that fit,
next to ours on the same layouts and inputs, so the D=64 rows of the kernels suite get a Flex figure.

    python benchmarks/flex_d64_probe.py --out $OUT/flex-d64-h100.json
"""
import argparse
import json

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.flops import attention_flops, tflops
from sparse_attn.bench.providers import with_causal
from sparse_attn.bench.results import make_header
from sparse_attn.testing import random_qkv

OPTIONS = ({}, {"num_stages": 2}, {"BLOCK_N": 64}, {"BLOCK_N": 64, "num_warps": 8})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    L, H, D = a.seq_len, 32, 64
    q, k, v = random_qkv(1, H, H, L, L, D, torch.bfloat16, "cuda", seed=0)
    cases = {"dense": (patterns.dense(L, device="cuda"), False),
             "local-4096": (patterns.local(L, 4096, device="cuda"), True),
             "random-0.1": (patterns.random(L, density=0.1, heads=H, seed=0, device="cuda"), False)}
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for name, (layout, causal) in cases.items():
        lay = with_causal(layout, causal)  # what the suite's flex provider exports
        flops = attention_flops(layout, batch=1, heads=H, head_dim=D, mode="fwd", causal=causal)
        ours = triton.testing.do_bench(lambda: sparse_attn.attention(q, k, v, layout, causal=causal), warmup=25,
                                       rep=200, return_mode="median")
        rows.append(dict(case=name, provider="sparse_attn", ms=ours, tflops=tflops(flops, ours)))
        print(json.dumps(rows[-1]), flush=True)
        bm = patterns.to_flex(lay)
        ref = sparse_attn.attention(q, k, v, layout, causal=causal)
        for opts in OPTIONS:
            try:
                out = flex(q, k, v, block_mask=bm, kernel_options=dict(opts) or None)
                err = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: flex(q, k, v, block_mask=bm, kernel_options=dict(opts) or None),
                                             warmup=25, rep=200, return_mode="median")
                rows.append(dict(case=name, provider="flex", kernel_options=opts, ms=ms, tflops=tflops(flops, ms),
                                 ours_over_flex=ms / ours, max_abs_diff_vs_ours=err))
            except Exception as e:  # noqa: BLE001 - a config that does not fit must not hide the others
                lines = str(e).splitlines() or [""]
                why = next((ln for ln in lines if "out of resource" in ln), lines[-1])  # inductor's own line first
                rows.append(dict(case=name, provider="flex", kernel_options=opts,
                                 error=f"{type(e).__name__}: {why.strip()[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
    json.dump({**make_header("cuda", "probe", script="benchmarks/flex_d64_probe.py"), "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
