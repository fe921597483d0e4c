"""Activation checkpointing (torch.utils.checkpoint, what transformers' gradient_checkpointing_enable runs) over
the kernels under TRITON_INTERPRET=1: the recomputed forward must give the gradients of the plain call, bit for
bit, in both of checkpoint's modes (non-reentrant: saved-tensor hooks, the recomputation's saved tensors checked
against the first forward's; reentrant: a first forward under no_grad, then one with a graph). The GPU twin,
through the public API with default, windowed, layout and varlen calls, is in tests/gpu/test_kernels_gpu.py."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from sparse_attn import patterns
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term
from sparse_attn.ops.block_sparse import attention_op

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]

LAYOUTS = {
    "random-gqa": (lambda: patterns.random(64, density=0.5, heads=4, seed=1, block_q=16, block_k=16), 64),
    "causal-masked": (lambda: BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=50, block_q=16,
                                                    block_k=16), 50),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_checkpointed_attention_gives_the_plain_call_s_gradients(name, reentrant):
    make, length = LAYOUTS[name]
    layout = make()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, length, 16, generator=g).half().requires_grad_()
    k, v = (torch.randn(1, 2, length, 16, generator=g).half().requires_grad_() for _ in range(2))
    do = torch.randn(1, 4, length, 16, generator=g).half()

    def block(q, k, v):  # a layer's worth: a projection before the attention, as in a model
        return attention_op(q * 2, k, v, layout)

    want_out = block(q, k, v)
    want = torch.autograd.grad(want_out, (q, k, v), do)
    out = checkpoint(block, q, k, v, use_reentrant=reentrant)
    assert torch.equal(out, want_out)
    out.backward(do)  # (reentrant checkpoint refuses autograd.grad)
    for name_, got, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want, strict=True):
        assert torch.equal(got, w), name_
