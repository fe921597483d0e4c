"""Dense 32K Hkv 8 forward in a bare timing loop: does the autotune pick depend on which contiguous
layout (dense or local-4096) runs first in the process? Prints the times and the picks.

    python benchmarks/gqa_pick_probe.py dense local      # then in a fresh process: local dense
"""
import json
import sys

import torch
import triton

import sparse_attn
from sparse_attn import patterns
from sparse_attn.ops.block_sparse import launch

L, H, HKV, D = 32768, 32, 8, 128
q = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, HKV, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lays = {"dense": None, "local": patterns.local(L, 4096, device="cuda")}
out = {"order": sys.argv[1:], "rows": []}
for name in sys.argv[1:]:
    lay = lays[name]
    causal = name == "local"
    sparse_attn.attention(q, k, v, lay, causal=causal)
    ms = triton.testing.do_bench(lambda: sparse_attn.attention(q, k, v, lay, causal=causal), warmup=25, rep=200,
                                 return_mode="median")
    out["rows"].append({"layout": name, "ms": ms})
out["picks"] = launch.autotune_picks()
print(json.dumps(out))
