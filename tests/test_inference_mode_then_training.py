"""A layout (or offsets) first used, or built, under torch.inference_mode and then trained with, on the
kernels under TRITON_INTERPRET=1. Evaluation passes run there (Lightning's sanity check and validation
loops use inference mode by default); what they cache on the layout are inference tensors, which autograd
refuses to save, so the next training call failed in its forward ("Inference tensors cannot be saved for
backward"). Gradients must be those of a layout never seen under inference mode, and the layout's caches
must be made normal once, not copied on every call."""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, varlen
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term, window_term
from sparse_attn.ops.block_sparse import (
    attention_op,
    layout_inputs,
    varlen_attention_op,
)
from sparse_attn.testing import random_packed_qkv

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]


def _random():
    return patterns.random(64, density=0.5, heads=4, seed=1, block_q=16, block_k=16)


def _causal():  # element masks: a term table, cached on the layout too
    return BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=50, block_q=16, block_k=16)


def _grads(layout, length: int):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, length, 16, generator=g).half().requires_grad_()
    k, v = (torch.randn(1, 2, length, 16, generator=g).half().requires_grad_() for _ in range(2))
    do = torch.randn(1, 4, length, 16, generator=g).half()
    return torch.autograd.grad(attention_op(q, k, v, layout), (q, k, v), do)


def _evaluate(layout, length: int) -> None:
    with torch.inference_mode():
        q = torch.randn(1, 4, length, 16).half()
        k, v = torch.randn(1, 2, length, 16).half(), torch.randn(1, 2, length, 16).half()
        attention_op(q, k, v, layout)


def _prepare(layout, length: int) -> None:  # both schedules, the transposed one too
    with torch.inference_mode():
        sparse_attn.prepare(layout)


@pytest.mark.parametrize("make, length", [(_random, 64), (_causal, 50)], ids=["random", "causal-masked"])
@pytest.mark.parametrize("built_in_inference", [False, True], ids=["built-outside", "built-inside"])
@pytest.mark.parametrize("first_use", [_evaluate, _prepare], ids=["evaluated", "prepared"])
def test_a_layout_first_used_under_inference_mode_then_trained(make, length, built_in_inference, first_use):
    if built_in_inference:
        with torch.inference_mode():
            layout = make()
    else:
        layout = make()
    first_use(layout, length)
    cached = [t for t in layout_inputs(layout, False) if isinstance(t, torch.Tensor)]
    if first_use is _evaluate:  # inference tensors cached, or the test proves nothing
        assert any(t.is_inference() for t in cached)
    else:  # prepare() builds the backward's inputs: copied out of inference mode there already
        assert not any(t.is_inference() for t in cached)
    got = _grads(layout, length)
    for name, a, b in zip(("dq", "dk", "dv"), got, _grads(make(), length), strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs from a layout never used under inference mode"
    first = layout_inputs(layout, True)
    tensors = [t for t in first if isinstance(t, torch.Tensor)]
    assert not any(t.is_inference() for t in tensors)
    again = [t for t in layout_inputs(layout, True) if isinstance(t, torch.Tensor)]
    assert all(a is b for a, b in zip(tensors, again, strict=True))  # made normal once, in the cache


def test_varlen_offsets_made_under_inference_mode_then_trained():
    """Offsets (cu_seqlens) made in an evaluation pass and kept: the op saves a normal copy."""
    q_lens = [19, 1, 33]
    q, k, v = random_packed_qkv(sum(q_lens), sum(q_lens), 4, 2, 16, seed=11)

    def pattern(lq, lk):
        return BlockLayout.from_mask(ElementMask((window_term(12, 0),)), q_len=lq, kv_len=lk, block_q=16,
                                     block_k=16)

    stacked = varlen.stack(varlen.build_layouts(q_lens, q_lens, None, pattern, causal=True), 33, 33, 4)
    with torch.inference_mode():
        cu = torch.tensor([0, 19, 20, 53], dtype=torch.int32)
    do = torch.randn(53, 4, 16, generator=torch.Generator().manual_seed(3)).half()
    got = torch.autograd.grad(varlen_attention_op(q, k, v, stacked, cu, cu, 33, 33, q_lens), (q, k, v), do)
    normal = torch.tensor([0, 19, 20, 53], dtype=torch.int32)
    want = torch.autograd.grad(varlen_attention_op(q, k, v, stacked, normal, normal, 33, 33, q_lens), (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name
