"""Dense 32K Hkv 8 forward: does the autotune pick depend on which contiguous layout ran first?"""
import json, sys, torch, triton, sparse_attn
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
out["picks"] = {str(k_): {str(kk): str(c) for kk, c in getattr(t, "cache", {}).items()} for k_, t in launch._TUNED.items()}
print(json.dumps(out))
