"""Padded and packed transformers batches through ``attn_implementation="sparse_attn"``: what they cost.

    python benchmarks/hf_batch_probe.py --out $OUT/hf-batch.json

A random Llama (no download; 4 layers, hidden 2048, 16 heads, 4 kv heads, head dim 128, bf16) on CUDA.
Cases, each against transformers' sdpa on the same model and inputs, medians of ROUNDS after a warm-up:
* ``mask``: the mask interface alone for a packed row of 4 sequences (position_ids restarting at 0) at 8K
  and 32K tokens: sparse_attn reads the sequences off the mask function and checks the whole mask a
  chunk at a time (no [L, L] tensor), sdpa materialises the [1, 1, L, L] mask;
* ``prefill``: a left-padded batch of 8 prompts (4096 tokens down to 512), one forward;
* ``decode``: greedy generate() of 64 tokens from that batch (the cache's real keys are gathered every step);
  ``ms_per_token`` is the whole call, prefill included, over 64 (hf_decode_ab.py takes the prefill off);
* ``train``: forward + backward of one packed row (4 sequences, 16K tokens), local-1024 and dense.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ROUNDS = 5


def _model(attn: str, layers: int = 4, hidden: int = 2048, kv_heads: int = 0, sliding_window: int = 0):
    """A random Llama of ``layers`` layers and width ``hidden`` (heads of 128, ``kv_heads`` kv heads or by default a
    quarter as many, MLP 2.75x), bf16 on CUDA; the defaults are the 4-layer model every probe here used first.
    ``sliding_window`` > 0: a Mistral of the same shape instead, every layer a causal sliding window of that many
    keys (its static cache keeps that many slots and rolls)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    heads = hidden // 128
    shape = dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads or heads // 4, head_dim=128,
                 max_position_embeddings=65536, initializer_range=0.02, attn_implementation=attn, pad_token_id=0)
    torch.manual_seed(0)
    if sliding_window:
        return MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **shape)).to("cuda", torch.bfloat16)
    return LlamaForCausalLM(LlamaConfig(**shape)).to("cuda", torch.bfloat16)


def _median_ms(fn, rounds: int = ROUNDS) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def _packed_mask_fn(seqs):
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
    )
    pos = torch.cat([torch.arange(n) for n in seqs])[None].cuda()
    return and_masks(causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(pos)))


def mask_case(length: int) -> dict:
    from transformers.masking_utils import sdpa_mask

    from sparse_attn.integrations import transformers as sat
    seqs = [length // 2, length // 4, length // 8, length - length // 2 - length // 4 - length // 8]
    fn = _packed_mask_fn(seqs)
    ours = _median_ms(lambda: sat.sparse_attn_mask(1, length, length, mask_function=fn, device="cuda"))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    marker = sat.sparse_attn_mask(1, length, length, mask_function=fn, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert marker.untyped_storage().nbytes() == 1
    sdpa = _median_ms(lambda: sdpa_mask(batch_size=1, q_length=length, kv_length=length, mask_function=fn,
                                        allow_is_causal_skip=False, device="cuda"))
    return {"case": f"mask packed {length}", "sparse_attn_ms": ours, "sparse_attn_peak_mib": round(peak / 2**20, 1),
            "sdpa_mask_ms": sdpa, "sdpa_mask_mib": round(length * length / 2**20, 1)}


def padded_inputs(scale: int = 1):
    """8 left-padded prompts of 512-4096 tokens times ``scale`` (token ids, attention mask: ``[8, 4096 * scale]``)."""
    lengths = [n * scale for n in (4096, 3500, 3000, 2500, 2000, 1500, 1000, 512)]
    width = max(lengths)
    x = torch.randint(1, 32000, (len(lengths), width), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    return x, mask


@torch.no_grad()
def padded_cases(model, name: str) -> list[dict]:
    x, mask = padded_inputs()
    prefill = _median_ms(lambda: model(x, attention_mask=mask, use_cache=False))
    gen = _median_ms(lambda: model.generate(x, attention_mask=mask, max_new_tokens=64, min_new_tokens=64,
                                            do_sample=False), rounds=3)
    return [{"case": "prefill, 8 left-padded prompts 512-4096", "impl": name, "ms": prefill},
            {"case": "generate 64 tokens, 8 left-padded prompts", "impl": name, "ms": gen,
             "ms_per_token": round(gen / 64, 3)}]


def train_case(model, name: str) -> dict:
    seqs = [8192, 4096, 3000, 1096]
    z = torch.randint(1, 32000, (1, sum(seqs)), generator=torch.Generator().manual_seed(2)).cuda()
    pos = torch.cat([torch.arange(n) for n in seqs])[None].cuda()

    def step():
        model(z, position_ids=pos, use_cache=False).logits.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    ms = _median_ms(step, rounds=3)
    return {"case": f"train step, packed {len(seqs)} sequences {sum(seqs)} tokens", "impl": name, "ms": ms,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}


def main() -> None:
    import transformers

    from sparse_attn.bench.results import make_header
    from sparse_attn.integrations.transformers import SparseAttnConfig, disable, enable
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [mask_case(n) for n in (8192, 32768)]
    for r in rows:
        print(r, flush=True)
    model = _model("sdpa").eval()
    for impl, cfg in (("sdpa", None), ("sparse_attn dense", SparseAttnConfig("dense")),
                      ("sparse_attn local-1024", SparseAttnConfig("local", {"window": 1024}))):
        if cfg is not None:
            enable(model, cfg)
        for r in padded_cases(model, impl) + [train_case(model.train(), impl)]:
            print(r, flush=True)
            rows.append(r)
        model.eval()
        if cfg is not None:
            disable(model, "sdpa")
    record = {**make_header("cuda", "hf-batch", transformers=transformers.__version__), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
