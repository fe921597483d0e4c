"""Compile the kernels benchmarks/model_run.py will use, without the model: a 2-layer random Llama with
SmolLM2-135M's attention shapes (9 query / 3 KV heads, head_dim 64, hidden 576) runs the same patterns
through the same transformers integration (adaptive at blocks 128 and 64, streaming, dense), prefill and
greedy decoding, on the GPU. With ``TRITON_CACHE_DIR`` kept (same warm machine), the model run then finds
its kernels compiled. Used in GPU call 1 of benchmarks/model_run.sh, while the GGUF's second half waits.

    TRITON_CACHE_DIR=/tmp/tcache python benchmarks/model_warmup.py [--lengths 1024 8192] [--device cuda]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 8192])
    p.add_argument("--blocks", nargs="+", type=int, default=[128, 64])
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparse_attn import model_eval as me
    from sparse_attn.cli.eval_model import pattern_options
    from sparse_attn.integrations.transformers import SparseAttnConfig, disable, enable
    t0 = time.time()
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=max(args.lengths) + 64, rope_theta=100000.0)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(cfg).to(args.device, dtype).eval()
    configs = [(f"adaptive b{b}", lambda L, b=b: SparseAttnConfig(
        "adaptive", {"simthreshd1": 0.7, "cdfthreshd": 0.95, "block": b, "attention_sink": True})) for b in args.blocks]
    configs += [("streaming", lambda L: SparseAttnConfig("streaming", pattern_options("streaming", {}, L))),
                ("dense (ours)", lambda L: SparseAttnConfig("dense"))]
    for L in args.lengths:
        x = torch.randint(0, 256, (1, L), device=args.device)
        for name, make in configs:
            t = time.time()
            enable(model, make(L))
            try:
                me.run_model(model, x, args.new_tokens, None)
            finally:
                disable(model)
            print(f"L={L} {name}: {time.time() - t:.1f} s", flush=True)
    print(f"warm-up done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
