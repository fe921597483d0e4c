"""Grouped attention (packed query slices over their own, possibly overlapping, K/V slices): the CPU
path against a hand-built loop of reference calls and an independent dense-mask softmax, backward,
edge cases, and every validation error."""
from __future__ import annotations

import math

import pytest
import torch

import sparse_attn
from sparse_attn import Group, patterns, reference
from sparse_attn.grouped import grouped_attention_loop, groups_from_cu_seqlens
from sparse_attn.layout import LayoutError


def _qkv(tq, tk, hq=2, hkv=2, d=8, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(dtype).requires_grad_(grad)
    return mk(tq, hq), mk(tk, hkv), mk(tk, hkv)


def _loop(q, k, v, groups, causal, layouts=None):
    """Hand-built: one reference.attention call per group, written into zero / -inf buffers."""
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    out = torch.zeros(tq, hq, dv, dtype=q.dtype)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32)
    for i, g in enumerate(groups):
        if g.q_end == g.q_start:
            continue
        lay = None if layouts is None else layouts[i]
        o, l_ = reference.attention(q[g.q_start:g.q_end].transpose(0, 1)[None],
                                    k[g.k_start:g.k_end].transpose(0, 1)[None],
                                    v[g.k_start:g.k_end].transpose(0, 1)[None], lay,
                                    causal=causal, return_lse=True)
        out[g.q_start:g.q_end] = o[0].transpose(0, 1)
        lse[:, g.q_start:g.q_end] = l_[0]
    return out, lse


def _token_mask(groups, tq, tk, causal):
    """Dense bool [Tq, Tk]: each group's block of allowed (i, j), bottom-right causal."""
    m = torch.zeros(tq, tk, dtype=torch.bool)
    for g in groups:
        lq, lk = g.q_end - g.q_start, g.k_end - g.k_start
        for i in range(lq):
            hi = lk if not causal else min(lk, i + lk - lq + 1)
            if hi > 0:
                m[g.q_start + i, g.k_start:g.k_start + hi] = True
    return m


def _naive(q, k, v, mask, scale=None):
    """Masked softmax over the whole packed [Tq, Tk] score matrix (GQA by repeating K/V heads)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kr = k.repeat_interleave(hq // hkv, 1)
    vr = v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, kr) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, Tq], -inf on empty rows
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vr)
    return out, lse


def _assert_same(got, want, rtol=1e-10, atol=1e-10):
    (o, lse), (o_w, lse_w) = got, want
    assert o.shape == o_w.shape and lse.shape == lse_w.shape
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o, o_w.to(o.dtype), rtol=rtol, atol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_w))
    fin = torch.isfinite(lse_w)
    torch.testing.assert_close(lse[fin].double(), lse_w[fin].double(), rtol=1e-5, atol=1e-5)


def _check_both(q, k, v, groups, causal, dtype_tol=1e-10):
    got = sparse_attn.grouped_attention(q, k, v, groups, causal=causal, return_lse=True)
    _assert_same(got, _loop(q, k, v, groups, causal), rtol=dtype_tol, atol=dtype_tol)
    naive = _naive(q.double(), k.double(), v.double(), _token_mask(groups, q.shape[0], k.shape[0], causal))
    _assert_same(got, naive, rtol=max(dtype_tol, 1e-10) * (1 if q.dtype == torch.float64 else 100),
                 atol=max(dtype_tol, 1e-10) * (1 if q.dtype == torch.float64 else 100))
    return got


def _consecutive(q_lens, k_lens):
    groups, a, b = [], 0, 0
    for lq, lk in zip(q_lens, k_lens):
        groups.append(Group(a, a + lq, b, b + lk))
        a, b = a + lq, b + lk
    return groups


# ----------------------------------------------------------------------------- forward == loop == naive
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens,k_lens", [([20, 33], [40, 33]), ([7, 50, 13], [7, 70, 25]),
                                           ([16, 5, 30, 9], [16, 45, 30, 20])])
def test_multiple_groups_match_loop_and_naive(q_lens, k_lens, causal, dtype):
    q, k, v = _qkv(sum(q_lens), sum(k_lens), dtype=dtype)
    _check_both(q, k, v, _consecutive(q_lens, k_lens), causal, 1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_gqa(causal):
    q, k, v = _qkv(60, 90, hq=8, hkv=2, d=16)
    groups = [Group(0, 25, 0, 40), Group(25, 60, 30, 90)]  # overlapping K/V too
    _check_both(q, k, v, groups, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_variable_length_groups(causal):
    q_lens = [1, 200, 37, 3, 128, 64]
    k_lens = [1, 200, 50, 130, 128, 70]
    q, k, v = _qkv(sum(q_lens), sum(k_lens), hq=4, hkv=2, seed=1)
    _check_both(q, k, v, _consecutive(q_lens, k_lens), causal)


@pytest.mark.parametrize("causal", [True, False])
def test_all_groups_share_kv(causal):
    q, k, v = _qkv(90, 64)
    groups = [Group(0, 30, 0, 64), Group(30, 60, 0, 64), Group(60, 90, 0, 64)]
    _check_both(q, k, v, groups, causal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zigzag_llama3_prefix_slices(dtype):
    """A rank holding zigzag chunks c and 2W-1-c of a 2W-chunk sequence: each attends the K/V prefix
    ending at its own chunk (all-gathered K/V, causal)."""
    chunk, world, rank = 24, 2, 0
    total = 2 * world * chunk
    lo, hi = rank, 2 * world - 1 - rank
    q, k, v = _qkv(2 * chunk, total, hq=4, hkv=2, dtype=dtype, seed=3)
    groups = [Group(0, chunk, 0, (lo + 1) * chunk), Group(chunk, 2 * chunk, 0, (hi + 1) * chunk)]
    got = _check_both(q, k, v, groups, True, 1e-10 if dtype == torch.float64 else 1e-5)
    # same as full causal attention over the whole sequence, read off at the rank's rows
    full_q = torch.zeros(total, 4, 8, dtype=dtype)
    full_q[lo * chunk:(lo + 1) * chunk] = q[:chunk].detach()
    full_q[hi * chunk:(hi + 1) * chunk] = q[chunk:].detach()
    full = sparse_attn.attention(full_q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                 causal=True)[0].transpose(0, 1)
    want = torch.cat([full[lo * chunk:(lo + 1) * chunk], full[hi * chunk:(hi + 1) * chunk]])
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got[0], want, rtol=tol, atol=tol)


def test_single_token_group():
    q, k, v = _qkv(11, 40)
    groups = [Group(0, 1, 0, 1), Group(1, 2, 0, 40), Group(2, 11, 10, 40)]
    for causal in (True, False):
        _check_both(q, k, v, groups, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_single_group_equals_attention(causal):
    q, k, v = _qkv(50, 70, hq=4, hkv=2)
    got = sparse_attn.grouped_attention(q, k, v, [Group(0, 50, 0, 70)], causal=causal, return_lse=True)
    o, lse = sparse_attn.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   causal=causal, return_lse=True)
    _assert_same(got, (o[0].transpose(0, 1), lse[0]))


def test_tokens_in_no_group_are_zero_and_neg_inf():
    q, k, v = _qkv(40, 30)
    groups = [Group(5, 12, 0, 10), Group(20, 30, 5, 30), Group(30, 30, 0, 3)]  # gaps, tail, an empty group
    out, lse = _check_both(q, k, v, groups, True)
    free = torch.ones(40, dtype=torch.bool)
    free[5:12] = False
    free[20:30] = False
    assert torch.equal(out[free], torch.zeros_like(out[free]))
    assert torch.isneginf(lse[:, free]).all()
    assert torch.isfinite(lse[:, ~free]).all()


def test_empty_kv_slice_and_causal_rows_without_keys():
    q, k, v = _qkv(12, 10, grad=True)
    groups = [Group(0, 4, 3, 3), Group(4, 12, 0, 5)]  # empty K/V; causal q_len 8 > k_len 5: 3 rows see nothing
    out, lse = _check_both(q, k, v, groups, True)
    assert torch.equal(out[:7], torch.zeros_like(out[:7])) and torch.isneginf(lse[:, :7]).all()
    out.sum().backward()
    assert torch.equal(q.grad[:7], torch.zeros_like(q.grad[:7]))


@pytest.mark.parametrize("fn", [sparse_attn.grouped_attention, grouped_attention_loop])
def test_no_group_with_queries_still_has_a_backward(fn):
    """Every group empty on the query side (found by test_fuzz_grouped's draw): the output is all
    zeros and backward() works, giving zero gradients, as for any other call whose rows see nothing."""
    q, k, v = _qkv(20, 30, grad=True)
    out, lse = fn(q, k, v, [Group(0, 0, 3, 9), Group(7, 7, 0, 30)], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_imbalanced_groups():
    q, k, v = _qkv(200, 200, hq=4, hkv=1, seed=5)
    groups = [Group(0, 10, 0, 10), Group(10, 200, 10, 200)]
    _check_both(q, k, v, groups, True)
    _check_both(q, k, v, [Group(0, 10, 0, 200), Group(10, 200, 0, 200)], True)


def test_scale_and_return_lse_flag():
    q, k, v = _qkv(30, 30)
    groups = [Group(0, 10, 0, 20), Group(10, 30, 5, 30)]
    out = sparse_attn.grouped_attention(q, k, v, groups, scale=0.3)
    assert isinstance(out, torch.Tensor)
    want, _ = _naive(q, k, v, _token_mask(groups, 30, 30, True), scale=0.3)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_pattern_matches_loop_with_layouts():
    q, k, v = _qkv(300, 420, hq=2, hkv=1, seed=2)
    groups = [Group(0, 140, 0, 200), Group(140, 300, 100, 420)]
    pattern = lambda lq, lk: patterns.local(lq, 32, kv_len=lk, block_q=16, block_k=16)
    for causal in (True, False):
        got = sparse_attn.grouped_attention(q, k, v, groups, causal=causal, pattern=pattern, return_lse=True)
        layouts = [pattern(g.q_end - g.q_start, g.k_end - g.k_start) for g in groups]
        _assert_same(got, _loop(q, k, v, groups, causal, layouts))
        mask = torch.zeros(300, 420, dtype=torch.bool)  # local(window=32, causal): p - 32 < j <= p
        for g in groups:
            lq, lk = g.q_end - g.q_start, g.k_end - g.k_start
            p = torch.arange(lq)[:, None] + lk - lq
            j = torch.arange(lk)[None, :]
            mask[g.q_start:g.q_end, g.k_start:g.k_end] = (j <= p) & (j > p - 32)
        _assert_same(got, _naive(q, k, v, mask))


def test_explicit_layouts_equal_pattern():
    q, k, v = _qkv(80, 90, hq=2, hkv=1, seed=6)
    groups = [Group(0, 30, 0, 50), Group(30, 30, 0, 4), Group(30, 80, 40, 90)]  # an empty group takes None
    pattern = lambda lq, lk: patterns.local(lq, 24, kv_len=lk, block_q=16, block_k=16)  # noqa: E731
    layouts = [pattern(30, 50), None, pattern(50, 50)]
    got = sparse_attn.grouped_attention(q, k, v, groups, layouts=layouts, return_lse=True)
    _assert_same(got, sparse_attn.grouped_attention(q, k, v, groups, pattern=pattern, return_lse=True))
    _assert_same(got, _loop(q, k, v, groups, True, layouts))
    with pytest.raises(ValueError, match="either layouts= or pattern="):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=layouts, pattern=pattern)
    with pytest.raises(ValueError, match="got 2 layouts for 3 groups"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=layouts[:2])


def test_loop_is_public_and_equal():
    q, k, v = _qkv(30, 40)
    groups = [Group(0, 15, 0, 25), Group(15, 30, 0, 40)]
    a = sparse_attn.grouped_attention(q, k, v, groups, return_lse=True)
    b = grouped_attention_loop(q, k, v, groups, return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_groups_from_cu_seqlens():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    assert groups_from_cu_seqlens(cu_q, cu_k) == [Group(0, 3, 0, 5), Group(3, 3, 5, 9), Group(3, 10, 9, 20)]
    q, k, v = _qkv(10, 20)
    _check_both(q, k, v, groups_from_cu_seqlens(cu_q, cu_k), True)
    with pytest.raises(ValueError, match="int32"):
        groups_from_cu_seqlens(cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        groups_from_cu_seqlens(torch.tensor([0, 4, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="groups"):
        groups_from_cu_seqlens(cu_q, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, got cu_seqlens_k\[0\]=-3"):
        groups_from_cu_seqlens(cu_q, torch.tensor([-3, 5, 9, 20], dtype=torch.int32))


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_matches_naive(causal, with_lse):
    groups = [Group(0, 20, 0, 30), Group(20, 45, 0, 50), Group(50, 60, 40, 50)]  # overlap + an uncovered gap
    q, k, v = _qkv(60, 50, hq=4, hkv=2, grad=True, seed=7)
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    g = torch.Generator().manual_seed(11)
    do = torch.randn(60, 4, 8, generator=g, dtype=torch.float64)
    dl = torch.randn(4, 60, generator=g, dtype=torch.float64) * with_lse
    out, lse = sparse_attn.grouped_attention(q, k, v, groups, causal=causal, return_lse=True)
    fin = torch.isfinite(lse)
    ((out * do).sum() + (lse.double()[fin] * dl[fin]).sum()).backward()
    out2, lse2 = _naive(q2, k2, v2, _token_mask(groups, 60, 50, causal))
    ((out2 * do).sum() + (lse2[fin] * dl[fin]).sum()).backward()
    tol = 1e-6 if with_lse else 1e-10  # lse is fp32 by contract, so its gradient path is fp32-accurate
    for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert k.grad[:30].abs().sum() > 0  # the shared prefix got gradient from both groups
    assert torch.equal(q.grad[45:50], torch.zeros_like(q.grad[45:50]))  # tokens in no group


def test_backward_fp32_close_to_fp64():
    groups = [Group(0, 16, 0, 24), Group(16, 40, 0, 40)]
    q, k, v = _qkv(40, 40, hq=8, hkv=2, grad=True, seed=9)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    sparse_attn.grouped_attention(q, k, v, groups).square().sum().backward()
    sparse_attn.grouped_attention(q32, k32, v32, groups).square().sum().backward()
    for a, b in ((q32.grad, q.grad), (k32.grad, k.grad), (v32.grad, v.grad)):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_gradcheck_tiny():
    q, k, v = _qkv(5, 6, hq=2, hkv=1, d=3, grad=True, seed=4)
    groups = [Group(0, 2, 0, 4), Group(3, 5, 1, 6)]  # overlapping K/V, token 2 in no group
    for causal in (True, False):
        f = lambda q, k, v, c=causal: sparse_attn.grouped_attention(q, k, v, groups, causal=c)
        assert torch.autograd.gradcheck(f, (q, k, v))


# ----------------------------------------------------------------------------- validation
def _err(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        sparse_attn.grouped_attention(*args, **kw)


def test_validation_errors():
    q, k, v = _qkv(10, 12, hq=4, hkv=2)
    ok = [Group(0, 10, 0, 12)]
    _err(ValueError, "groups is empty", q, k, v, [])
    _err(TypeError, "wrap a single group in a list", q, k, v, ok[0])
    _err(TypeError, "list of sparse_attn.Group", q, k, v, None)
    _err(TypeError, r"groups\[0\] must be a sparse_attn.Group", q, k, v, [(0, 10, 0, 12)])
    _err(TypeError, r"groups\[0\].q_end must be a Python int.*float", q, k, v, [Group(0, 10.0, 0, 12)])
    _err(TypeError, r"k_start must be a Python int.*Tensor", q, k, v, [Group(0, 10, torch.tensor(0), 12)])
    _err(TypeError, "Python int.*bool", q, k, v, [Group(0, 10, False, 12)])
    _err(ValueError, r"groups\[0\] q slice \[0, 11\) is out of range: q has 10 tokens", q, k, v, [Group(0, 11, 0, 12)])
    _err(ValueError, r"q slice \[-1, 5\) is out of range", q, k, v, [Group(-1, 5, 0, 12)])
    _err(ValueError, r"groups\[1\] k slice \[0, 13\) is out of range: k/v has 12 tokens", q, k, v,
         [Group(0, 5, 0, 12), Group(5, 10, 0, 13)])
    _err(ValueError, r"q_end=3 < q_start=5", q, k, v, [Group(5, 3, 0, 12)])
    _err(ValueError, r"k_end=2 < k_start=4", q, k, v, [Group(0, 5, 4, 2)])
    _err(ValueError, r"query slices overlap: groups\[1\] has q \[0, 6\) and groups\[0\] has q \[5, 10\)", q, k, v,
         [Group(5, 10, 0, 12), Group(0, 6, 0, 12)])
    _err(ValueError, "packed", q[None], k, v, ok)
    _err(TypeError, "k must be a torch.Tensor", q, None, v, ok)
    _err(TypeError, "share a dtype", q, k.float(), v, ok)
    _err(TypeError, "dtype torch.int64", q.long(), k.long(), v.long(), ok)
    _err(ValueError, "head_dim", q, k[..., :4], v, ok)
    _err(ValueError, r"k \(12, 2, 8\) and v \(11, 2, 8\) must have the same tokens and heads", q, k, v[:11], ok)
    _err(ValueError, "k has 3 heads, q has 4: Hq must be a multiple of Hkv", q, k[:, :1].expand(12, 3, 8),
         v[:, :1].expand(12, 3, 8), ok)
    _err(ValueError, "scale", q, k, v, ok, scale=-1.0)
    _err(TypeError, r"pattern must be a function .*pass layouts=\[one BlockLayout per group\]", q, k, v, ok,
         pattern=sparse_attn.patterns.dense(10, 12))
    _err(LayoutError, "layout 0 was built for q_len=10, kv_len=10 but group 0 has 10 query and 12 key tokens", q, k, v,
         ok, layouts=[sparse_attn.patterns.dense(10, 10)])
    if torch.device("meta") != q.device:
        _err(ValueError, "one device", q, k.to("meta"), v, ok)


@pytest.mark.parametrize("fn", [sparse_attn.grouped_attention, grouped_attention_loop])
def test_lse_alone_has_a_backward_when_no_group_runs(fn):
    """Groups with queries but no keys: nothing runs, yet a loss on the LSE alone must backward() (the
    LSE came back outside the graph), with zero gradients, as sparse_attn.attention with Lk = 0."""
    q, k, v = _qkv(5, 4, grad=True)
    out, lse = fn(q, k, v, [Group(0, 5, 3, 3)], return_lse=True)
    assert torch.isneginf(lse).all()
    torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_every_group_layout_is_checked_before_any_group_runs(monkeypatch):
    """A bad layout (or a pattern that fails) for the last group is reported before the first group is
    computed: the CPU loop used to run the groups before it first (seconds at 8K)."""
    def no_compute(*a, **kw):
        raise AssertionError("a group was computed before every layout was checked")
    monkeypatch.setattr(sparse_attn.api, "attention", no_compute)
    q, k, v = _qkv(40, 40)
    groups = [Group(0, 20, 0, 20), Group(20, 40, 0, 40)]
    bad_heads = patterns.random(20, kv_len=40, heads=3, density=1.0, block_q=16, block_k=16)
    _err(LayoutError, "layout 1 has 3 heads; q has 2", q, k, v, groups,
         layouts=[patterns.dense(20, 20, block_q=16, block_k=16), bad_heads])

    def fails_on_the_second_shape(lq, lk):
        if lk == 40:
            raise ValueError("pattern refused (20, 40)")
        return patterns.dense(lq, lk, block_q=16, block_k=16)
    _err(ValueError, r"pattern refused \(20, 40\)", q, k, v, groups, pattern=fails_on_the_second_shape)


def test_mixed_block_sizes_from_a_pattern_are_refused_as_on_the_kernels():
    """A pattern giving other block sizes per length ran on the CPU (one call per group / sequence) and
    failed only on a GPU, where one launch runs every layout."""
    def pat(lq, lk):
        return patterns.local(lq, 8, kv_len=lk, block_q=16 if lq < 30 else 32, block_k=16)
    q, k, v = _qkv(50, 50)
    with pytest.raises(LayoutError, match=r"every group's layout \(from pattern=\) must have the same block_q x "
                                          r"block_k .*got 16x16 and 32x16"):
        sparse_attn.grouped_attention(q, k, v, [Group(0, 20, 0, 20), Group(20, 50, 20, 50)], pattern=pat)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    with pytest.raises(LayoutError, match=r"every sequence's layout \(from pattern=\) .*16x16 and 32x16"):
        sparse_attn.varlen_attention(q, k, v, cu, cu, 30, 30, pattern=pat)


def test_none_layout_only_for_an_empty_group():
    """layouts=[..., None]: None is for groups with no queries or no keys. For a group that runs, the
    CPU loop ran it dense while the kernels raised a bare TypeError."""
    q, k, v = _qkv(40, 40)
    lay = patterns.local(20, 4, kv_len=20, block_q=16, block_k=16)
    _err(TypeError, r"layouts\[1\] is None but group 1 has 20 query and 40 key tokens", q, k, v,
         [Group(0, 20, 0, 20), Group(20, 40, 0, 40)], layouts=[lay, None])
    out = sparse_attn.grouped_attention(q, k, v, [Group(0, 20, 0, 20), Group(20, 40, 5, 5)], layouts=[lay, None])
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))
