"""Padded and packed transformers batches on the GPU kernels (bf16, a random Llama, no download).

Each row of a left-padded batch, and each sequence of a packed row, must get what it gets run alone
through the same integration (forward, a cached decoding step, and a training step's gradients); bf16
kernels on different packings round differently, so the comparisons are by cosine and argmax.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

from sparse_attn.integrations.transformers import SparseAttnConfig, enable

pytestmark = pytest.mark.gpu
VOCAB = 256
PATTERNS = [("dense", {}), ("local", {"window": 96}), ("streaming", {"window": 96, "num_sink": 16}),
            ("local", {"window": 96, "block_q": 64, "block_k": 64})]


def _model(layers=2):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.05, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.float().flatten(0, -2), want.float().flatten(0, -2)
    assert torch.isfinite(got).all(), what
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert cos > 0.9995 and top1 > 0.97, (what, cos, top1)


@pytest.mark.parametrize("pattern,kwargs", PATTERNS)
@torch.no_grad()
def test_left_padded_prefill_and_decoding_step_match_rows_alone(pattern, kwargs):
    model = _model().eval()
    enable(model, SparseAttnConfig(pattern, kwargs))
    lengths, width = [700, 513, 130, 1], 700
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(1, VOCAB, (len(lengths), width + 1), generator=gen).cuda()
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    pre = model(x[:, :width], attention_mask=mask[:, :width], position_ids=pos[:, :width], use_cache=True)
    step = model(x[:, width:], attention_mask=mask, position_ids=pos[:, width:],
                 past_key_values=pre.past_key_values, use_cache=True).logits
    for b, n in enumerate(lengths):
        alone = model(x[b:b + 1, width - n:]).logits[0]
        _close(pre.logits[b, width - n:], alone[:-1], f"{pattern} prefill row {b}")
        _close(step[b, -1:], alone[-1:], f"{pattern} step row {b}")


def test_packed_training_step_matches_the_sequences_alone():
    """position_ids restarting at 0 (padding-free training): logits and every parameter's gradient against
    the sum over the sequences run alone; peak memory far below one layer's [H, L, L] scores (the mask
    interface checks the packed mask a bounded chunk at a time)."""
    model = _model().train()
    enable(model, SparseAttnConfig("local", {"window": 256}))
    seqs = [5000, 37, 8011, 3000]
    gen = torch.Generator().manual_seed(2)
    z = torch.randint(1, VOCAB, (1, sum(seqs)), generator=gen).cuda()
    pos = torch.cat([torch.arange(n) for n in seqs])[None].cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = model(z, position_ids=pos, use_cache=False).logits
    (out.float().square().mean()).backward()
    peak = torch.cuda.max_memory_allocated() - base
    scores_bytes = 8 * sum(seqs) ** 2 * 2  # one layer's bf16 [8, L, L] scores: what eager attention holds
    assert peak < scores_bytes / 4, (peak, scores_bytes)
    packed = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    s = 0
    for n in seqs:
        alone = model(z[:, s:s + n], use_cache=False).logits
        _close(out[0, s:s + n].detach(), alone[0].detach(), f"packed sequence at {s}")
        (alone.float().square().sum() / out.numel()).backward()
        s += n
    for name, p in model.named_parameters():
        cos = torch.nn.functional.cosine_similarity(packed[name].flatten(), p.grad.float().flatten(), dim=0).item()
        assert cos > 0.999, (name, cos)


def test_gradient_checkpointing_gives_the_same_gradients():
    """transformers' gradient checkpointing recomputes each layer's forward (attention included) in the backward;
    every parameter's gradient must be what the step gives without it."""
    model = _model().train()
    enable(model, SparseAttnConfig("local", {"window": 256}))
    x = torch.randint(1, VOCAB, (2, 700), generator=torch.Generator().manual_seed(4)).cuda()

    def grads():
        model.zero_grad()
        model(x, use_cache=False).logits.float().square().mean().backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters()}

    plain = grads()
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    for name, g in checkpointed.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), plain[name].flatten(), dim=0).item()
        assert cos > 0.99999, (name, cos)


def test_an_fp32_model_under_autocast_runs_like_sdpa():
    """An fp32 model under torch.autocast (HF Trainer's bf16=True) hands attention fp32 q / k (the rotary
    embedding's) next to a bf16 v. SDPA casts them to bf16; the kernels refused fp32. A left-padded batch (the
    padded in-place path, which launches the kernels without attention()) and a training step's gradients,
    against the same fp32 model on SDPA under the same autocast."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.05, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda()
    lengths, width = [600, 77, 1], 600
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(1, VOCAB, (len(lengths), width), generator=gen).cuda()
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.no_grad():
                padded = model.eval()(x, attention_mask=mask).logits
            model.train().zero_grad()
            model(x[:1], use_cache=False).logits.float().square().mean().backward()
        return padded, {n: p.grad.float().clone() for n, p in model.named_parameters()}

    want, want_grads = run()
    enable(model, SparseAttnConfig())
    got, got_grads = run()
    for b, n in enumerate(lengths):
        _close(got[b, width - n:], want[b, width - n:], f"padded row {b}")
    for name, g in got_grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), want_grads[name].flatten(), dim=0).item()
        assert cos > 0.999, (name, cos)


@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("streaming", {"window": 96, "num_sink": 16}),
                                            ("local", {"window": 128})])
@torch.no_grad()
def test_static_cache_generation_compiles_and_matches_an_uncompiled_forward(monkeypatch, pattern, kwargs):
    """generate(cache_implementation="static") on CUDA compiles the decoding step by itself (inductor,
    "reduce-overhead"), with the traced spans_attention op inside (counted through _unpad.in_place_spans,
    which the warm-up runs call eagerly). Each step's logits of a left-padded batch against one uncompiled
    forward over the tokens it generated (teacher forcing: greedy tokens of a random bf16 model part ways on
    near-ties, 7 of 12 agreed in a first version of this test), each row's cosine above 0.9995."""
    model = _model().eval()
    enable(model, SparseAttnConfig(pattern, kwargs))
    _static_generation_matches_a_forward(monkeypatch, model, pattern)


@pytest.mark.parametrize("window", [320, 306, 256])
@torch.no_grad()
def test_static_cache_on_sliding_window_layers_compiles_and_matches_an_uncompiled_forward(monkeypatch, window):
    """A Mistral-style model (every layer a sliding window) with a static cache: its buffer of ``window`` slots is
    filled from token 0, then rolled. 320: prompts up to 300 and 12 new tokens never fill it (the sliding mask is
    the causal one, key states); 306: it rolls during the generation; 256: the 300-token prompt is longer than it,
    so every decoding step runs on a rolled buffer with padding. Every step is traced whole (fullgraph)."""
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                        sliding_window=window, initializer_range=0.05, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    enable(model, SparseAttnConfig())
    _static_generation_matches_a_forward(monkeypatch, model, f"sliding window {window}")


def _static_generation_matches_a_forward(monkeypatch, model, what: str) -> None:
    """Compiled static generation of 12 tokens from 3 left-padded prompts (300, 129, 17 tokens), traced whole
    (fullgraph: a graph break fails), the traced op counted, each step's logits against one uncompiled forward over
    the generated tokens (cosine > 0.9995)."""
    from transformers import CompileConfig

    from sparse_attn.integrations import _unpad
    ran = []
    real = _unpad.in_place_spans
    monkeypatch.setattr(_unpad, "in_place_spans", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    torch._dynamo.reset()
    lengths, width, new = [300, 129, 17], 300, 12
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(1, VOCAB, (len(lengths), width), generator=gen).cuda()
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    static = model.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, cache_implementation="static",
                            compile_config=CompileConfig(fullgraph=True))  # a graph break fails
    assert hasattr(model, "_compiled_call") and ran  # the step was compiled, with the traced op
    tokens = static.sequences[:, :-1]
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new - 1])], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    forced = model(tokens, attention_mask=full_mask, position_ids=pos).logits
    for step in range(new):  # by cosine, row by row (a wrong plan is far off; a near-tie flips an argmax of 3 rows)
        got, want = static.logits[step].float(), forced[:, width - 1 + step].float()
        assert torch.isfinite(got).all()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert bool((cos > 0.9995).all()), (what, step, cos.tolist())
