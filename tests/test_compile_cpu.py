"""torch.compile(fullgraph=True) of modules calling sparse_attn.attention on the CPU (reference path).

The eager reference finds each query block's keys on the host (data-dependent shapes Dynamo cannot
trace); while compiling it runs as the custom op sparse_attn::reference_fwd (sparse_attn.reference_op).
The compiled module must equal the eager one, forward and backward (also through the LSE)."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.masks import ElementMask, MaskTerm, mask_table
from sparse_attn.reference_op import masks_from_table

CASES = {  # name: (layout builder, Lq, Lk, Hq, Hkv, causal)
    "local-partial": (lambda: patterns.local(200, 40, block_q=32, block_k=64), 200, 200, 4, 2, False),
    "streaming": (lambda: patterns.streaming(192, 48, 8, block_q=64, block_k=32), 192, 192, 2, 2, False),
    "random-per-head": (lambda: patterns.random(256, density=0.3, heads=4, seed=3, block_q=64, block_k=64),
                        256, 256, 4, 1, True),
    "bigbird": (lambda: patterns.bigbird(256, heads=2, seed=1, block_q=32, block_k=32), 256, 256, 2, 2, False),
    "block-diagonal-lq-lt-lk": (lambda: patterns.block_diagonal(96, 48, kv_len=160, block_q=32, block_k=32),
                                96, 160, 2, 1, True),
}


def _inputs(Lq, Lk, Hq, Hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hq, Lq, 32, generator=g)
    k = torch.randn(2, Hkv, Lk, 32, generator=g)
    v = torch.randn(2, Hkv, Lk, 24, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_fullgraph_equals_eager_forward_and_backward(name):
    make, Lq, Lk, Hq, Hkv, causal = CASES[name]
    layout = make()

    def f(q, k, v):
        out, lse = sparse_attn.attention(q, k, v, layout, causal=causal, return_lse=True)
        return out, lse

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = _inputs(Lq, Lk, Hq, Hkv)
    out, lse = f(q, k, v)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isinf(lse), 0)
    grads = torch.autograd.grad((out * w_out).sum() + (lse.nan_to_num(0, 0, 0) * w_lse).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    c_out, c_lse = compiled(q2, k2, v2)
    c_grads = torch.autograd.grad((c_out * w_out).sum() + (c_lse.nan_to_num(0, 0, 0) * w_lse).sum(), (q2, k2, v2))
    torch.testing.assert_close(c_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_lse, lse, rtol=1e-5, atol=1e-6)
    for got, want in zip(c_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert all(torch.isfinite(g).all() for g in c_grads)


def test_compiled_float64_gradients_keep_float64_accuracy():
    """The custom op's backward recomputes P from its saved LSE: with an fp32 LSE, float64 gradients were
    off by ~1e-5 of their size (8e-5 on dQ here) while eager autograd was exact to 1e-13."""
    make, Lq, Lk, Hq, Hkv, causal = CASES["local-partial"]
    layout = make()

    def f(q, k, v):
        return sparse_attn.attention(q, k, v, layout, causal=causal, return_lse=True)

    q, k, v = (t.detach().double().mul(3).requires_grad_() for t in _inputs(Lq, Lk, Hq, Hkv, seed=5))
    out, lse = f(q, k, v)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v))
    c_out, c_lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert c_lse.dtype == lse.dtype == torch.float32  # the returned LSE stays fp32, as documented
    c_grads = torch.autograd.grad((c_out * w_out).sum() + (c_lse * w_lse).sum(), (q, k, v))
    for got, want in zip(c_grads, grads):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_compiled_module_with_inductor_and_scale():
    layout = patterns.local(128, 32, block_q=32, block_k=32)

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):  # x [B, H, L, 16]
            return self.proj(sparse_attn.attention(x, x, x, layout, scale=0.3))

    m = Attn()
    x = torch.randn(1, 2, 128, 16)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), m(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masks", [(), (ElementMask(()),), (ElementMask((MaskTerm(left=5, right=0),)),
                                                            ElementMask(()), ElementMask((MaskTerm(k_hi=3),
                                                                                          MaskTerm(doc=64))))])
def test_mask_table_round_trip(masks):
    assert masks_from_table(*mask_table(masks), len(masks)) == masks


def test_varlen_and_grouped_compile_with_graph_breaks():
    """varlen / grouped read cu_seqlens and group offsets on the host (documented): under
    torch.compile they are graph breaks, and the compiled function still equals eager."""
    from sparse_attn.grouped import Group
    cu = torch.tensor([0, 50, 130], dtype=torch.int32)
    q, k, v = (torch.randn(130, 2, 16) for _ in range(3))

    def varlen(q, k, v):
        return sparse_attn.varlen_attention(q, k, v, cu, cu, 80, 80, causal=True) * 2

    groups = [Group(0, 25, 0, 40), Group(25, 60, 30, 90)]

    def grouped(q, k, v):
        return sparse_attn.grouped_attention(q[:60], k[:90], v[:90], groups, causal=True) * 2

    for fn in (varlen, grouped):
        torch.testing.assert_close(torch.compile(fn, backend="aot_eager")(q, k, v), fn(q, k, v))


@pytest.mark.parametrize("quant", ["int8", "int8-fp8"])
def test_compiled_8bit_with_a_layout_equals_eager(quant):
    """The CPU 8-bit twin walks keys found on the host like the reference: with a layout,
    torch.compile(fullgraph=True) failed on a data-dependent guard. While compiling it now runs as the
    custom op sparse_attn::sage_reference_fwd; gradients still come from the fp16/bf16 path."""
    make, Lq, Lk, Hq, Hkv, causal = CASES["local-partial"]
    layout = make()

    def f(q, k, v):
        return sparse_attn.attention(q, k, v, layout, causal=True, return_lse=True, quant=quant,
                                     quant_granularity="per_thread")

    q, k, v = _inputs(Lq, Lk, Hq, Hkv, seed=7)
    v = torch.randn(*k.shape).requires_grad_()  # the 8-bit path needs Dv == D
    out, lse = f(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    c_out, c_lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    c_grads = torch.autograd.grad(c_out.square().sum(), (q, k, v))
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
    for got, want in zip(c_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_inductor_compiles_transposed_inputs_forward_and_backward():
    """The backward op's fake kept q's strides while the op returns contiguous gradients: inductor
    asserted on [B, L, H, D] activations viewed as [B, H, L, D]."""
    lay = patterns.local(64, 16, block_q=16, block_k=16)
    x = torch.randn(1, 64, 2, 16, requires_grad=True)

    def f(x):
        q = x.transpose(1, 2)
        return sparse_attn.attention(q, q, q, lay)

    (want,) = torch.autograd.grad(f(x).square().sum(), x)
    (got,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x).square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
