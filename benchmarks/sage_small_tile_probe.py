"""Repro of the fuzz finding (tests/gpu/test_fuzz_gpu.py, 8-bit seed 14): the 8-bit forward on a
layout with 16 x 16 blocks at head_dim 32 faulted with 'misaligned address'. One configuration per
process (a CUDA fault poisons the context); prints ok / the error per variant.

    python benchmarks/sage_small_tile_probe.py            # all variants, each in a subprocess
    python benchmarks/sage_small_tile_probe.py --one NAME # one variant in this process
"""
import os
import subprocess
import sys

import torch

VARIANTS = {
    # name: (quant, granularity, d, block_q, block_k, env)
    "bf16-d32-b16": (None, "per_warp", 32, 16, 16, {}),
    "int8-thread-d32-b16": ("int8", "per_thread", 32, 16, 16, {}),
    "int8-thread-d32-b16-ptr": ("int8", "per_thread", 32, 16, 16, {"SPARSE_ATTN_FWD": "ptr"}),
    "int8-warp-d32-b16": ("int8", "per_warp", 32, 16, 16, {}),
    "int8-thread-d64-b16": ("int8", "per_thread", 64, 16, 16, {}),
    "int8-thread-d32-q16k32": ("int8", "per_thread", 32, 16, 32, {}),
    "int8-thread-d32-q32k16": ("int8", "per_thread", 32, 32, 16, {}),
    "int8-thread-d32-b64": ("int8", "per_thread", 32, 64, 64, {}),
    "int8-thread-d128-b16": ("int8", "per_thread", 128, 16, 16, {}),
    "int8-block-d32-b16": ("int8", "per_block", 32, 16, 16, {}),
}


def one(name):
    import sparse_attn
    from sparse_attn import metrics, patterns
    quant, gran, d, bq, bk, _ = VARIANTS[name]
    torch.manual_seed(0)
    L = 454
    lay = patterns.local(L, 57, causal=False, window_right=31, block_q=bq, block_k=bk, device="cuda")
    q, k, v = (torch.randn(1, 4, L, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = sparse_attn.attention(q, k, v, lay)
    out = sparse_attn.attention(q, k, v, lay, quant=quant, quant_granularity=gran) if quant else ref
    torch.cuda.synchronize()
    print(f"{name}: ok, cosine {metrics.cosine_similarity(out, ref):.5f}", flush=True)


def main():
    if "--one" in sys.argv:
        one(sys.argv[sys.argv.index("--one") + 1])
        return
    for name, (*_, env) in VARIANTS.items():
        p = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                           env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1", **env), timeout=300)
        if p.returncode == 0:
            print(p.stdout.strip().splitlines()[-1], flush=True)
        else:
            err = [ln for ln in (p.stdout + p.stderr).splitlines() if "Error" in ln or "error" in ln]
            print(f"{name}: FAILED rc {p.returncode}: {' | '.join(err[-3:])[:400]}", flush=True)
            frames = [ln.strip() for ln in p.stderr.splitlines() if ln.strip().startswith("File ")]
            print("    last frames: " + " <- ".join(f.split(", in ")[-1] for f in frames[-6:][::-1]), flush=True)


if __name__ == "__main__":
    main()
