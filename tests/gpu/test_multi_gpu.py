"""Inputs on a GPU that is not the current one (sparse_attn.device_guard): transformers' device_map="auto" puts
layers on cuda:1 while cuda:0 stays current, and Triton launches on the current device. Each call on cuda:1
with cuda:0 current must give the bits of the same call with cuda:1 current (same kernels, same autotuner
picks, which the first call makes), gradients included. The inputs are made by torch ops on cuda:1 just
before each call, so a launch on another device's stream would race them. Needs two GPUs (skipped otherwise).
"""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import Group, patterns

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
OTHER = torch.device("cuda", 1)


def _both_ways(call, make):
    """``call(*make())`` with cuda:1 current, then with cuda:0 current; returns the two results (outputs and,
    where ``make`` gives leaves that require grad, their gradients), each computed on fresh inputs drawn by
    ``make`` from the same seed on cuda:1."""
    results = []
    for current in (1, 0):
        with torch.cuda.device(current):
            torch.manual_seed(0)
            inputs = make()
            out = call(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            grads = torch.autograd.grad(outs[0].float().square().sum(), leaves) if leaves else ()
            torch.cuda.synchronize(OTHER)
            results.append([t for t in (*outs, *grads) if isinstance(t, torch.Tensor)])
    for got, want in zip(results[1], results[0], strict=True):
        assert got.device == OTHER
        assert torch.equal(got, want)


def _qkv(b, hq, hkv, lq, lk, d, grad=False):
    """bf16 q, k, v made on cuda:1 by a chain of torch ops (queued on cuda:1's stream just before the call)."""
    def one(h, length):
        return (torch.randn(b, h, length, d, device=OTHER) * 2 + 1).to(torch.bfloat16).requires_grad_(grad)
    return one(hq, lq), one(hkv, lk), one(hkv, lk)


@pytest.mark.parametrize("grad", [False, True])
def test_attention_on_a_gpu_that_is_not_current(grad):
    layout = patterns.random(1500, density=0.3, heads=8, seed=1, device=OTHER)
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, layout, return_lse=True),
               lambda: _qkv(1, 8, 2, 1500, 1500, 128, grad))
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, causal=True),
               lambda: _qkv(2, 8, 2, 1000, 1000, 64, grad))
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, causal=True, window=256, num_sink=16),
               lambda: _qkv(1, 8, 8, 1100, 1100, 128, grad))


def test_decoding_steps_prepare_quant_and_adaptive_on_a_gpu_that_is_not_current():
    for _ in range(3):  # the decoding entry learns a geometry, then serves it
        _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, causal=True), lambda: _qkv(4, 32, 8, 1, 3000, 128))
    layout = sparse_attn.prepare(patterns.local(2048, 512, device=OTHER), causal=True)
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, layout, causal=True),
               lambda: _qkv(1, 4, 4, 2048, 2048, 128, True))
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, quant="int8-fp8"), lambda: _qkv(1, 4, 4, 2048, 2048, 128))
    _both_ways(lambda q, k, v: sparse_attn.attention(q, k, v, "adaptive"), lambda: _qkv(1, 4, 4, 2048, 2048, 128))


def test_varlen_and_grouped_on_a_gpu_that_is_not_current():
    cu = torch.tensor([0, 700, 777, 2000], dtype=torch.int32)

    def packed(grad):
        return lambda: tuple(t[0].transpose(0, 1).contiguous().detach().requires_grad_(grad)
                             for t in _qkv(1, 8, 2, 2000, 2000, 128))
    groups = [Group(0, 700, 0, 700), Group(700, 2000, 0, 2000)]
    for grad in (False, True):
        _both_ways(lambda q, k, v: sparse_attn.varlen_attention(q, k, v, cu, cu, 1223, 1223, causal=True),
                   packed(grad))
        _both_ways(lambda q, k, v: sparse_attn.grouped_attention(q, k, v, groups), packed(grad))


@torch.no_grad()
def test_a_padded_transformers_batch_on_a_gpu_that_is_not_current():
    """A model on cuda:1 (the padded in-place path launches the kernels itself, not through attention())."""
    transformers = pytest.importorskip("transformers")
    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   initializer_range=0.05, attn_implementation="sdpa", pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(OTHER, torch.bfloat16).eval()
    enable(model, SparseAttnConfig("local", {"window": 96}))
    x = torch.randint(1, 256, (3, 300), generator=torch.Generator().manual_seed(1)).to(OTHER)
    mask = torch.ones_like(x)
    mask[1, :120] = 0
    mask[2, :299] = 0
    _both_ways(lambda x, mask: model(x, attention_mask=mask).logits, lambda: (x.clone(), mask.clone()))
