"""The PyTorch reference attention against an independent full-matrix fp64 oracle.

``naive_masked_attention`` (sparse_attn.testing) repeats K/V heads and runs one softmax over the
whole ``[Lq, Lk]`` matrix under a dense token mask; the reference walks query blocks, reads the
layout row by row and views query heads as GQA groups. Both in fp64 here, so they must agree to
rounding (1e-12); lower precisions are checked with the rule-3 helper.
"""
from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import sparse_attn
from sparse_attn import reference
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, causal_term, document_term, sink_term, window_term
from sparse_attn.testing import (ZERO_LENGTH_CASES, assert_close_to_oracle, causal_token_mask, check_non_finite_spread,
                                 check_zero_length_case, naive_masked_attention, oracle_attention, random_qkv)
from sparse_attn import patterns

F64 = torch.float64
TOL = 1e-12


def _close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not torch.isnan(a).any(), "NaN in the reference output"
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"max abs error {err:.3e} > {tol:.1e}"


def _check_lse(lse, lse_naive):
    """Same -inf rows; finite rows close (the reference returns lse in fp32)."""
    assert lse.dtype == torch.float32
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_naive))
    fin = torch.isfinite(lse_naive)
    if fin.any():
        torch.testing.assert_close(lse[fin].double(), lse_naive[fin], rtol=1e-6, atol=1e-6)


def _run(q, k, v, layout=None, causal=False, scale=None):
    """Reference (out, lse) and the naive oracle (out, lse) under the equivalent token mask."""
    out, lse = reference.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True)
    Lq, Lk = q.shape[2], k.shape[2]
    tok = torch.ones(1, 1, Lq, Lk, dtype=torch.bool) if layout is None else layout.to_token_mask()
    if causal:
        tok = tok & causal_token_mask(Lq, Lk)
    ref = naive_masked_attention(q, k, v, tok, scale, return_lse=True)
    return (out, lse), ref, tok


# ----------------------------------------------------------------------------- dense and causal
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 50), (50, 1), (17, 17), (130, 130), (40, 170), (170, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_and_causal(Lq, Lk, causal):
    q, k, v = random_qkv(2, 3, 3, Lq, Lk, 16, F64, "cpu", seed=Lq * 1000 + Lk)
    (out, lse), (out_n, lse_n), tok = _run(q, k, v, causal=causal)
    _close(out, out_n)
    _check_lse(lse, lse_n)
    assert out.dtype == F64 and out.shape == (2, 3, Lq, 16) and lse.shape == (2, 3, Lq)


def test_causal_rows_without_keys_are_exact_zero_and_neg_inf():
    """Lq > Lk bottom-right: the first Lq - Lk rows see no key -> out exactly 0, lse -inf, no NaN."""
    Lq, Lk = 70, 25
    q, k, v = random_qkv(1, 2, 1, Lq, Lk, 8, F64, "cpu", seed=3)
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    empty = Lq - Lk
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all() and torch.isfinite(out).all()
    # row `empty` sits at key position 0: it sees exactly key 0, so its output is v[0]
    torch.testing.assert_close(out[0, :, empty], v[0, 0, 0].expand(2, -1), rtol=0, atol=1e-15)
    torch.testing.assert_close(lse[0, :, empty].double(), (q[0, :, empty] @ k[0, 0, 0]) / math.sqrt(8),
                               rtol=1e-6, atol=1e-6)


def test_causal_lq_lt_lk_bottom_right():
    """Lq < Lk: query 0 sits at position Lk - Lq and sees Lk - Lq + 1 keys."""
    Lq, Lk = 5, 12
    q, k, v = random_qkv(1, 1, 1, Lq, Lk, 4, F64, "cpu", seed=4)
    out = reference.attention(q, k, v, causal=True)
    s = (q[0, 0] @ k[0, 0].T) / 2.0
    for i in range(Lq):
        n = Lk - Lq + 1 + i
        p = torch.softmax(s[i, :n], -1)
        torch.testing.assert_close(out[0, 0, i], p @ v[0, 0, :n], rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype):
    """A low-precision reference is as good as rounding the fp64 answer to its dtype (rule-3 check)."""
    q, k, v = random_qkv(2, 4, 2, 100, 140, 32, dtype, "cpu", seed=5)
    layout = BlockLayout.from_mask(ElementMask((window_term(50, 10), sink_term(4))), q_len=100, kv_len=140,
                                   block_q=32, block_k=16)
    out = reference.attention(q, k, v, layout)
    assert out.dtype == dtype
    oracle = oracle_attention(q, k, v, layout)
    assert_close_to_oracle(out, oracle.to(dtype), oracle, factor=1.5)


# ----------------------------------------------------------------------------- layouts
MASKS = {
    "window_sinks": ElementMask((window_term(30, 0), MaskTerm(k_lo=0, k_hi=3, right=0))),
    "two_sided": ElementMask((window_term(20, 11),)),
    "documents": ElementMask((document_term(37),)),
    "global_rows_or_causal": ElementMask((MaskTerm(q_lo=0, q_hi=5), causal_term())),
}


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 64), (64, 16)])
@pytest.mark.parametrize("Lq,Lk", [(100, 100), (37, 150), (150, 37), (1, 1), (1, 90)])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("causal", [False, True])
def test_layouts_with_partial_blocks(mask, Lq, Lk, block_q, block_k, causal):
    layout = BlockLayout.from_mask(MASKS[mask], q_len=Lq, kv_len=Lk, block_q=block_q, block_k=block_k)
    q, k, v = random_qkv(1, 2, 1, Lq, Lk, 8, F64, "cpu", seed=Lq + Lk)
    (out, lse), (out_n, lse_n), tok = _run(q, k, v, layout, causal)
    _close(out, out_n)
    _check_lse(lse, lse_n)
    assert torch.equal(torch.isneginf(lse[0, 0]), ~tok[0, 0].any(-1)), "lse is -inf exactly on rows with no key"


def _random_layout(B, H, Lq, Lk, bq, bk, seed, mask=None):
    g = torch.Generator().manual_seed(seed)
    nq, nk = math.ceil(Lq / bq), math.ceil(Lk / bk)
    bm = torch.rand(B, H, nq, nk, generator=g) < 0.5
    part = torch.rand(B, H, nq, nk, generator=g) < 0.5
    mask = mask or ElementMask((window_term(25, 4),))
    return BlockLayout.from_block_mask(bm, block_q=bq, block_k=bk, q_len=Lq, kv_len=Lk, partial=part, mask=mask)


@pytest.mark.parametrize("Bl,Hl", [(1, 8), (2, 8), (2, 1), (1, 1)], ids=["per-head", "per-batch-head",
                                                                      "per-batch", "shared"])
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_per_head_and_batch_layouts_with_gqa(Bl, Hl, Hkv):
    B, Hq, Lq, Lk = 2, 8, 70, 90
    layout = _random_layout(Bl, Hl, Lq, Lk, 16, 32, seed=Bl * 100 + Hl * 10 + Hkv)
    q, k, v = random_qkv(B, Hq, Hkv, Lq, Lk, 8, F64, "cpu", seed=Hkv, Dv=12)
    (out, lse), (out_n, lse_n), tok = _run(q, k, v, layout)
    assert out.shape == (B, Hq, Lq, 12)
    _close(out, out_n)
    _check_lse(lse, lse_n)


def test_gqa_uses_kv_head_h_div_group():
    """Hq=8, Hkv=2: query heads 0..3 read kv head 0, heads 4..7 kv head 1 (checked by hand)."""
    q, k, v = random_qkv(1, 8, 2, 10, 12, 4, F64, "cpu", seed=9)
    out = reference.attention(q, k, v)
    for h in range(8):
        kh = h // 4
        p = torch.softmax(q[0, h] @ k[0, kh].T / 2.0, -1)
        torch.testing.assert_close(out[0, h], p @ v[0, kh], rtol=0, atol=1e-14)


def test_per_head_layout_is_per_query_head():
    """A heads=Hq layout applies row h to query head h (not kv head): heads differ only by layout."""
    B, Hq, Hkv, L = 1, 4, 2, 32
    bm = torch.zeros(1, Hq, 2, 2, dtype=torch.bool)
    bm[:, :, :, 0] = True
    bm[0, 1, :, 1] = True  # only query head 1 sees the second key block
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16)
    q, k, v = random_qkv(B, Hq, Hkv, L, L, 8, F64, "cpu", seed=10)
    q = q[:, :1].expand(B, Hq, L, 8).contiguous()  # same queries in every head
    out = reference.attention(q, k, v, layout)
    first_half = reference.attention(q[:, :1], k[:, :1, :16], v[:, :1, :16])
    full = reference.attention(q[:, :1], k[:, :1], v[:, :1])
    torch.testing.assert_close(out[:, 0], first_half[:, 0], rtol=0, atol=1e-14)
    torch.testing.assert_close(out[:, 1], full[:, 0], rtol=0, atol=1e-14)


def test_layout_dense_equals_no_layout():
    q, k, v = random_qkv(2, 2, 1, 50, 70, 8, F64, "cpu", seed=11)
    dense = BlockLayout.from_block_mask(torch.ones(4, 5, dtype=torch.bool), block_q=16, block_k=16, q_len=50, kv_len=70)
    _close(reference.attention(q, k, v, dense), reference.attention(q, k, v))
    _close(reference.attention(q, k, v, dense, causal=True), reference.attention(q, k, v, causal=True))


def test_empty_layout_gives_zeros():
    q, k, v = random_qkv(1, 2, 2, 40, 40, 8, F64, "cpu", seed=12)
    layout = BlockLayout.from_mask(ElementMask(()), q_len=40, block_q=16, block_k=16)
    out, lse = reference.attention(q, k, v, layout, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------- scale, head dims, api
@pytest.mark.parametrize("scale", [None, 0.05, 1.0, 3.0])
def test_scale(scale):
    q, k, v = random_qkv(1, 2, 2, 33, 47, 16, F64, "cpu", seed=13)
    layout = BlockLayout.from_mask(MASKS["window_sinks"], q_len=33, kv_len=47, block_q=16, block_k=16)
    (out, lse), (out_n, lse_n), _ = _run(q, k, v, layout, scale=scale)
    _close(out, out_n)
    _check_lse(lse, lse_n)
    if scale is not None:  # scale s on q == default scale on q * s * sqrt(D)
        _close(out, reference.attention(q * (scale * 4.0), k, v, layout))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = random_qkv(1, 1, 1, 9, 9, 25, F64, "cpu", seed=14)
    _close(reference.attention(q, k, v), reference.attention(q, k, v, scale=0.2))
    assert (reference.attention(q, k, v) - reference.attention(q, k, v, scale=0.3)).abs().max() > 1e-3


@pytest.mark.parametrize("D,Dv", [(8, 24), (24, 8), (16, 1)])
def test_value_dim_differs(D, Dv):
    q, k, v = random_qkv(2, 4, 2, 30, 41, D, F64, "cpu", seed=15, Dv=Dv)
    layout = BlockLayout.from_mask(MASKS["two_sided"], q_len=30, kv_len=41, block_q=16, block_k=32)
    (out, lse), (out_n, lse_n), _ = _run(q, k, v, layout, causal=True)
    assert out.shape == (2, 4, 30, Dv)
    _close(out, out_n)
    _check_lse(lse, lse_n)


def test_return_lse_off_returns_tensor_only():
    q, k, v = random_qkv(1, 1, 1, 8, 8, 4, F64, "cpu", seed=16)
    out = reference.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    out2, lse = reference.attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2)
    torch.testing.assert_close(lse.double(), torch.logsumexp(q[0, 0] @ k[0, 0].T / 2.0, -1)[None, None],
                               rtol=1e-6, atol=1e-6)


def test_public_attention_on_cpu_is_the_reference():
    q, k, v = random_qkv(2, 4, 2, 50, 60, 8, F64, "cpu", seed=17)
    layout = _random_layout(1, 4, 50, 60, 16, 16, seed=17)
    a, la = sparse_attn.attention(q, k, v, layout, causal=True, scale=0.3, return_lse=True)
    b, lb = reference.attention(q, k, v, layout, causal=True, scale=0.3, return_lse=True)
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("Lq,Lk", [(5, 0), (300, 0)])
def test_no_keys_at_all(Lq, Lk):
    q, k, v = random_qkv(1, 2, 1, Lq, Lk, 8, torch.float32, "cpu", seed=18)
    out, lse = sparse_attn.attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_no_queries():
    q, k, v = random_qkv(1, 2, 1, 0, 9, 8, torch.float32, "cpu", seed=19)
    out, lse = sparse_attn.attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)


# ----------------------------------------------------------------------------- gradients
def _grads(fn, q, k, v, do, dl):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    lse_term = torch.where(torch.isfinite(lse), lse.double(), 0.0)  # -inf rows contribute nothing
    ((out * do).sum() + (lse_term * dl).sum()).backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", ["dense-causal-Lq>Lk", "layout-gqa", "per-head-mqa"])
def test_gradients_match_naive(case):
    if case == "dense-causal-Lq>Lk":
        B, Hq, Hkv, Lq, Lk, layout, causal = 1, 2, 2, 60, 35, None, True
    elif case == "layout-gqa":
        B, Hq, Hkv, Lq, Lk, causal = 2, 4, 2, 50, 70, False
        layout = BlockLayout.from_mask(MASKS["window_sinks"], q_len=Lq, kv_len=Lk, block_q=16, block_k=32)
    else:
        B, Hq, Hkv, Lq, Lk, causal = 2, 4, 1, 45, 45, True
        layout = _random_layout(2, 4, Lq, Lk, 16, 16, seed=20)
    q, k, v = random_qkv(B, Hq, Hkv, Lq, Lk, 8, F64, "cpu", seed=21, Dv=6)
    g = torch.Generator().manual_seed(22)
    do = torch.randn(B, Hq, Lq, 6, generator=g, dtype=F64)
    dl = torch.randn(B, Hq, Lq, generator=g, dtype=F64)
    tok = torch.ones(1, 1, Lq, Lk, dtype=torch.bool) if layout is None else layout.to_token_mask()
    if causal:
        tok = tok & causal_token_mask(Lq, Lk)
    got = _grads(lambda q, k, v: reference.attention(q, k, v, layout, causal=causal, return_lse=True), q, k, v, do, dl)
    want = _grads(lambda q, k, v: naive_masked_attention(q, k, v, tok, return_lse=True), q, k, v, do, dl)
    for name, a, b in zip("qkv", got, want):
        assert not torch.isnan(a).any(), f"NaN in d{name}"
        # lse comes back in fp32, so its gradient path is fp32-accurate
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")
    if case == "dense-causal-Lq>Lk":
        assert torch.equal(got[0][:, :, :Lq - Lk], torch.zeros_like(got[0][:, :, :Lq - Lk])), \
            "rows with no key must get zero dq"
    # the explicit backward (what the CPU custom op runs under torch.compile) gives the same gradients
    _, lse = reference.attention(q, k, v, layout, causal=causal, return_lse=True)
    explicit = reference.attention_backward(do, dl, q, k, v, lse, layout, causal=causal)
    for name, a, b in zip("qkv", explicit, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"explicit d{name}")


@pytest.mark.parametrize("case", ["dense-causal-gqa-Lq>Lk", "sinks+window-layout"])
def test_first_and_second_derivatives_match_finite_differences(case):
    """Autograd goes through reference._RecomputingAttention, whose backward recomputes P from the
    saved LSE: its gradients (of the output and of the LSE) and, since that backward is written in
    differentiable ops, its double backward must match finite differences."""
    if case == "dense-causal-gqa-Lq>Lk":
        B, Hq, Hkv, Lq, Lk, layout, causal = 1, 2, 1, 11, 7, None, True
    else:
        B, Hq, Hkv, Lq, Lk, causal = 1, 1, 1, 20, 40, False  # the last query block skips key block 1
        mask = ElementMask((window_term(4, 0), MaskTerm(k_lo=0, k_hi=3, right=0)))
        layout = BlockLayout.from_mask(mask, q_len=Lq, kv_len=Lk, block_q=16, block_k=16)
        assert reference.visited_keys(layout, 1)[2] is not None  # listed keys: the index_add_ path
    q, k, v = random_qkv(B, Hq, Hkv, Lq, Lk, 3, F64, "cpu", seed=31, requires_grad=True)

    def fn(q, k, v):  # the LSE in float64 (_acc_lse): the public one is fp32, too coarse for gradcheck
        out, lse = reference.attention(q, k, v, layout, causal=causal, return_lse=True, _acc_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)  # rows with no key: lse -inf

    assert type(fn(q, k, v)[0].grad_fn).__name__.startswith("_RecomputingAttention")
    assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-6)
    assert torch.autograd.gradgradcheck(fn, (q, k, v), atol=1e-6)


def test_autograd_saves_inputs_and_lse_only():
    """Training memory is linear in the length: what autograd keeps for a causal forward is q, k, v
    and the LSE (recording the chunk loop op by op kept every chunk's scores and probabilities: 880 MiB
    at 8K with 2 heads, D=16, against 3 MiB of inputs)."""
    L, H, D = 1024, 2, 16
    q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = reference.attention(q, k, v, causal=True)
    inputs_and_lse = 3 * q.numel() * q.element_size() + H * L * 4
    assert sum(saved) <= inputs_and_lse, (sum(saved), inputs_and_lse)
    out.square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive_masked_attention(q2, k2, v2, causal_token_mask(L, L)).square().sum().backward()
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(platform.system() != "Linux", reason="reads ru_maxrss in KiB")
def test_causal_training_peak_memory_is_linear():
    """Forward and backward of an 8K causal attention (2 heads, D=16, fp32) in a fresh process: peak RSS
    grew by 613 MiB when autograd recorded the chunk loop, 99 MiB with the recomputing backward."""
    grown_mib = _peak_rss_growth_mib(
        "q, k, v = (torch.randn(1, 2, 8192, 16, requires_grad=True) for _ in range(3))",
        "reference.attention(q, k, v, causal=True).square().sum().backward()\n"
        "assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))")
    assert grown_mib < 300, f"peak RSS grew by {grown_mib} MiB"


def _peak_rss_growth_mib(setup: str, call: str) -> int:
    """How far ``call`` raised the peak RSS (MiB) of a fresh one-thread process, after ``setup`` (both
    Python source; torch and sparse_attn.reference imported)."""
    code = ("import resource, torch\ntorch.set_num_threads(1)\nfrom sparse_attn import reference\n" + setup
            + "\nbase = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n" + call
            + "\nprint((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=300).stdout.split()[-1])


@pytest.mark.parametrize("case", ["empty-layout", "no-keys"])
def test_gradients_of_fully_masked_attention_are_zero(case):
    Lk = 0 if case == "no-keys" else 32
    q, k, v = random_qkv(1, 2, 1, 32, Lk, 8, F64, "cpu", seed=24, requires_grad=True)
    layout = None if case == "no-keys" else BlockLayout.from_mask(ElementMask(()), q_len=32, block_q=16, block_k=16)
    out, lse = reference.attention(q, k, v, layout, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)  # out and lse share one node
    explicit = reference.attention_backward(torch.ones_like(out), torch.ones_like(lse), q, k, v, lse, layout)
    # a loss on the LSE alone (merging partial attentions) once raised "does not require grad" here
    lse_grads = torch.autograd.grad(lse.clamp(min=0).sum(), (q, k, v))
    for g, e, lg, t in zip((dq, dk, dv), explicit, lse_grads, (q, k, v)):
        assert torch.equal(g, torch.zeros_like(t)) and torch.equal(e, torch.zeros_like(t))
        assert torch.equal(lg, torch.zeros_like(t))


@pytest.mark.parametrize("case", ZERO_LENGTH_CASES)
def test_zero_length_inputs_give_zeros_and_a_working_backward(case):
    """No query or no key token, on every public entry point (sparse_attn.testing.ZERO_LENGTH_CASES;
    those with no query token used to return an output outside the autograd graph, so backward()
    raised). As SDPA does: zeros of q's shape, backward() runs and gives zero gradients."""
    check_zero_length_case(case, "cpu", torch.float32)


def test_gradients_without_lse_tight():
    q, k, v = random_qkv(1, 2, 1, 40, 40, 8, F64, "cpu", seed=23)
    layout = BlockLayout.from_mask(MASKS["documents"], q_len=40, block_q=16, block_k=16)
    for t in (q, k, v):
        t.requires_grad_()
    reference.attention(q, k, v, layout, causal=True).square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    tok = layout.to_token_mask() & causal_token_mask(40, 40)
    naive_masked_attention(q2, k2, v2, tok).square().sum().backward()
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        _close(a, b)


# ----------------------------------------------------------------------------- memory
_MEMORY_PROBE = textwrap.dedent("""
    import torch
    from sparse_attn import reference
    from sparse_attn.layout import BlockLayout
    from sparse_attn.masks import ElementMask, window_term, sink_term

    def peak_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024

    Lq, Lk, D = 16384, 1024, 8
    q, k, v = (torch.randn(1, 1, n, D) for n in (Lq, Lk, Lk))
    mask = ElementMask((window_term(255, 0), sink_term(64)))
    layout = BlockLayout.from_mask(mask, q_len=Lq, kv_len=Lk, block_q=128, block_k=128)
    small = BlockLayout.from_mask(mask, q_len=256, kv_len=Lk, block_q=128, block_k=128)
    reference.attention(q[:, :, :256], k, v, None, causal=True)  # warm-up: one-time allocations
    reference.attention(q[:, :, :256], k, v, small)
    for lay, causal in ((None, True), (layout, False)):
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark
        base = peak_mb()
        out = reference.attention(q, k, v, lay, causal=causal)
        assert out.shape == (1, 1, Lq, D) and not out.isnan().any()
        print(peak_mb() - base)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux peak-RSS reset")
def test_reference_memory_is_chunked():
    """Lq=16384, Lk=1024: a dense bool token mask is 16 MiB, a fp32 score matrix 64 MiB; the chunked
    reference (one 128-row block at a time, ~3 MiB) must peak below half the bool mask.

    Runs in a subprocess with a fixed malloc mmap threshold so that freed chunks go back to the OS
    and the peak RSS measures live memory, not allocator fragmentation.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    res = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    peaks = [float(x) for x in res.stdout.split()]
    assert len(peaks) == 2
    bool_mask_mb = 16384 * 1024 / 2**20
    for what, peak in zip(("dense causal", "window+sinks layout"), peaks):
        assert peak < bool_mask_mb / 2, \
            f"{what}: peak RSS grew by {peak:.1f} MiB (a dense [Lq, Lk] bool mask is {bool_mask_mb:.0f} MiB)"


@pytest.mark.parametrize("make", [lambda L: sparse_attn.patterns.streaming(L, window=128, num_sink=4, block_q=64,
                                                                          block_k=64),
                                  lambda L: sparse_attn.patterns.random(L, density=0.08, seed=3, block_q=64,
                                                                        block_k=64)],
                         ids=["sinks+window", "random"])
def test_autograd_saves_only_visited_keys(make):
    """Layouts whose visited key blocks spread over the whole prefix (sinks + window, random): what
    autograd keeps for backward must grow with the visited keys, not with L^2 (it once kept every
    chunk's scores over the span from the first to the last visited key: 1.7 GiB at L=16K)."""
    L, D = 4096, 16
    lay = make(L)
    q, k, v = (torch.randn(1, 1, L, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = reference.attention(q, k, v, lay)
    visited_pairs = int(lay.kv_counts.sum()) * lay.block_q * lay.block_k
    assert visited_pairs < L * L / 8  # the layouts are sparse enough for the bound below to mean something
    assert sum(saved) < 16 * visited_pairs, (sum(saved), visited_pairs, L * L)
    out.sum().backward()
    dense = reference.attention(*(t.detach().double() for t in (q, k, v)), lay)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="measures how glibc's malloc reuses freed memory")
def test_causal_forward_peak_memory_stays_near_its_live_tensors():
    """A 16K causal forward (4 heads, D=16) holds about 0.2 GiB of temporaries at a time, but walking the
    query chunks first to last grew the process by 1.8 GiB: each chunk's larger temporaries could not
    reuse the freed blocks of the last (reference.row_chunks). Run in a fresh process, peak RSS growth."""
    grown_mib = _peak_rss_growth_mib("q, k, v = (torch.randn(1, 4, 16384, 16) for _ in range(3))",
                                     "with torch.no_grad():\n    reference.attention(q, k, v, causal=True)")
    assert grown_mib < 600, f"peak RSS grew by {grown_mib} MiB"


def test_self_only_window_survives_intersection_with_causal():
    """A window of one key (j == p: MaskTerm(left=0, right=0), left + right == 0) is not empty: cut with
    causal (``&`` of two partial masks, and what attention(causal=True) runs) each query still sees
    itself, so the output is v row for row."""
    L = 48
    a = ElementMask((MaskTerm(left=0, right=0),))
    b = ElementMask((MaskTerm(right=0),))
    assert (a & b).terms == (MaskTerm(left=0, right=0),)
    lay = patterns.local(L, 1, block_q=16, block_k=16)
    eye = torch.eye(L, dtype=torch.bool)
    assert torch.equal(lay.to_token_mask()[0, 0], eye)
    assert torch.equal((lay & patterns.causal(L, block_q=16, block_k=16)).to_token_mask()[0, 0], eye)
    q, k, v = (torch.randn(1, 2, L, 16, dtype=torch.float64) for _ in range(3))
    out = sparse_attn.attention(q, k, v, lay, causal=True)
    torch.testing.assert_close(out, v, rtol=0, atol=1e-12)


def test_a_nan_in_k_reaches_only_the_rows_that_see_it_one_in_v_its_visiting_blocks():
    """The README's non-finite rule on the reference: a masked score is set to -inf, so a NaN key stays
    in the rows that may see it; a NaN value meets the masked rows' zero probabilities (0 * NaN)."""
    lay = patterns.local(200, 20, block_q=32, block_k=32)
    q, k, v = random_qkv(1, 2, 2, 200, 200, 8, torch.float32, "cpu", seed=40)
    check_non_finite_spread(lambda q, k, v: reference.attention(q, k, v, lay), lay, q, k, v, key=70)


def test_autocast_does_not_lower_the_references_accumulation():
    """Under CPU autocast the forward's products ran in bf16 and the backward in fp32 from that LSE:
    gradients 4x worse than bf16 inputs without autocast. The reference accumulates in fp32 as documented."""
    from sparse_attn import patterns
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g, requires_grad=True) for _ in range(3))
    lay = patterns.local(256, 64, block_q=64, block_k=64)
    want = sparse_attn.attention(q, k, v, lay, causal=True)
    grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = sparse_attn.attention(q, k, v, lay, causal=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_layout_edited_between_forward_and_backward_is_an_error():
    """The backward held the layout as an object: zeroing its counts after the forward gave all-zero
    gradients, silently."""
    from sparse_attn import patterns
    lay = patterns.local(64, 16, block_q=16, block_k=16)
    q, k, v = (torch.randn(1, 1, 64, 8, requires_grad=True) for _ in range(3))
    out = sparse_attn.attention(q, k, v, lay)
    lay.kv_counts.zero_()
    with pytest.raises(RuntimeError, match="layout was modified after the forward"):
        torch.autograd.grad(out.sum(), (q, k, v))


def test_the_oracle_checks_what_the_api_checks():
    """reference.attention, public as the test oracle, ran an index past the grid and causal="False"."""
    from sparse_attn import BlockLayout, LayoutError
    q = torch.randn(1, 1, 32, 8)
    idx = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32).view(1, 1, 2, 2)
    bad = BlockLayout(16, 16, 32, 32, torch.tensor([2, 1], dtype=torch.int32).view(1, 1, 2), idx, torch.full_like(idx, -1))
    with pytest.raises(LayoutError):
        reference.attention(q, q, q, bad)
    with pytest.raises(TypeError, match="causal must be True or False"):
        reference.attention(q, q, q, causal="False")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_same_dtype_reference_lets_no_wrong_softmax_scale_through(dtype):
    """The tolerance rule's same-dtype reference (``_lowp``) took its values from products rounded to the
    input dtype, scores included, which no fused kernel does: at x10 inputs its output error was 28x
    (bf16) that of fp32 accumulation, and an output computed with a 3% wrong softmax scale passed
    assert_close_to_oracle. Its values are now a fused kernel's (fp32 scores and P.V, P rounded)."""
    lay = patterns.local(300, 100, block_q=32, block_k=32)
    q, k, v = random_qkv(1, 2, 2, 300, 300, 64, dtype, "cpu", seed=1)
    q, k = (q.float() * 10).to(dtype), (k.float() * 10).to(dtype)
    o_or = oracle_attention(q, k, v, lay)
    o_lp = reference.attention(q, k, v, lay, _lowp=True)
    assert_close_to_oracle(reference.attention(q, k, v, lay), o_lp, o_or)  # fp32 accumulation, rounded once
    assert_close_to_oracle(reference.attention(q, k, v, lay, _round_p=lambda e: e.to(dtype).float()), o_lp, o_or)
    with pytest.raises(AssertionError, match="too far from the fp64 oracle"):
        assert_close_to_oracle(reference.attention(q, k, v, lay, scale=1.03 / 8), o_lp, o_or)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_same_dtype_reference_lets_no_gradient_off_by_3_percent_through(dtype):
    """``_lowp``'s gradients had run every product in the input dtype, scores included: at x10 inputs their
    error against the fp64 oracle was so large (bf16 dQ: max 8.8, RMSE 0.21 for entries of RMS 0.86) that
    gradients 3% too large passed the tolerance rule (dQ and dK in fp16 and bf16, dV in bf16). They now
    round as the Triton backward does (P and dS rounded, delta from the rounded output; bf16 dQ max 0.11,
    RMSE 7e-3): fp32-accumulated gradients pass, the same scaled by 1.03 fail."""
    lay = patterns.local(256, 96, block_q=32, block_k=32)
    q, k, v = random_qkv(1, 2, 2, 256, 256, 64, dtype, "cpu", seed=5)
    q, k = (q.float() * 10).to(dtype), (k.float() * 10).to(dtype)  # peaked softmax: where rounding tells
    do = torch.randn(1, 2, 256, 64, dtype=dtype)
    leaves = lambda: [t.detach().clone().requires_grad_() for t in (q, k, v)]  # noqa: E731
    oracle, lowp, plain = [t.detach().double().requires_grad_() for t in (q, k, v)], leaves(), leaves()
    reference.attention(*oracle, lay, causal=True).backward(do.double())
    reference.attention(*lowp, lay, causal=True, _lowp=True).backward(do)
    reference.attention(*plain, lay, causal=True).backward(do)  # fp32 accumulation: a kernel stand-in
    for name, got, ref, exact in zip(("dq", "dk", "dv"), plain, lowp, oracle):
        assert_close_to_oracle(got.grad, ref.grad, exact.grad, name=name)
        with pytest.raises(AssertionError, match="too far from the fp64 oracle"):
            assert_close_to_oracle(got.grad * 1.03, ref.grad, exact.grad, name=name)


def test_the_same_dtype_reference_keeps_its_gradients_and_lse_in_the_graph():
    """``_lowp`` takes its values and gradients from the fused-kernel rounding: a loss on the LSE alone
    still backpropagates, and no-key rows keep output 0 and LSE -inf."""
    lay = patterns.local(40, 8, block_q=16, block_k=16)
    q, k, v = random_qkv(1, 2, 1, 40, 40, 16, torch.float16, "cpu", seed=3, requires_grad=True)
    out, lse = reference.attention(q, k, v, lay, causal=True, _lowp=True, return_lse=True)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    g_out = torch.autograd.grad(out.float().sum(), (q, k, v), retain_graph=True)
    g_lse = torch.autograd.grad(lse.sum(), (q, k))  # (the LSE does not depend on v)
    for a, b in zip(g_out + g_lse, (q, k, v, q, k)):
        assert a.shape == b.shape and torch.isfinite(a).all() and a.abs().sum() > 0
    empty = reference.attention(q, k[:, :, :0], v[:, :, :0], _lowp=True, return_lse=True)
    assert torch.equal(empty[0], torch.zeros_like(empty[0])) and bool(torch.isneginf(empty[1]).all())


def test_the_non_finite_check_looks_at_every_head_and_batch():
    """check_non_finite_spread read batch 0, head 0 only: a run that fed kv head 0 (or batch 0) to every
    head (batch), spreading its NaN key there, passed. GQA heads that read kv head 0 follow the rule."""
    lay = patterns.local(200, 20, block_q=32, block_k=32)
    q, k, v = random_qkv(2, 4, 2, 200, 200, 8, torch.float32, "cpu", seed=40)
    check_non_finite_spread(lambda q, k, v: reference.attention(q, k, v, lay), lay, q, k, v, key=70)
    wrong_head = lambda q, k, v: reference.attention(q, k[:, :1].expand_as(k), v[:, :1].expand_as(v), lay)  # noqa: E731
    wrong_batch = lambda q, k, v: reference.attention(q, k[:1].expand_as(k), v[:1].expand_as(v), lay)  # noqa: E731
    for run in (wrong_head, wrong_batch):
        with pytest.raises(AssertionError, match="which do not read it"):
            check_non_finite_spread(run, lay, q, k, v, key=70)
