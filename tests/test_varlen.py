"""Packed variable-length attention: the CPU (reference) path against per-sequence ``attention`` calls,
every validation error, the varlen kernel under the Triton interpreter, and ``prepare``'s caching."""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, reference, varlen
from sparse_attn.grouped import groups_from_cu_seqlens
from sparse_attn.layout import BlockLayout, LayoutError
from sparse_attn.testing import assert_close_to_oracle


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _packed(q_lens, k_lens, hq=2, hkv=2, d=8, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(sum(q_lens), hq), mk(sum(k_lens), hkv), mk(sum(k_lens), hkv)


def _per_sequence(q, k, v, q_lens, k_lens, layouts=None, causal=False):
    """Per-sequence ``sparse_attn.attention`` calls, packed back: out [Tq, Hq, D], lse [Hq, Tq]."""
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    outs, lses = [], []
    for b in range(len(q_lens)):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        lay = None if layouts is None else layouts[b]
        o, lse = sparse_attn.attention(qs, ks, vs, lay, causal=causal, return_lse=True)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _varlen(q, k, v, q_lens, k_lens, **kw):
    return sparse_attn.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
                                        return_lse=True, **kw)


def _assert_same(got, want):
    (o, lse), (o_w, lse_w) = got, want
    assert o.shape == o_w.shape and lse.shape == lse_w.shape
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o, o_w, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_w))
    fin = torch.isfinite(lse_w)
    torch.testing.assert_close(lse[fin], lse_w[fin], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- reference path == per sequence
Q_LENS, K_LENS = [17, 1, 40, 9], [30, 5, 40, 1]


def test_dense_matches_per_sequence():
    q, k, v = _packed(Q_LENS, K_LENS, hq=4, hkv=2)
    got = _varlen(q, k, v, Q_LENS, K_LENS)
    _assert_same(got, _per_sequence(q, k, v, Q_LENS, K_LENS))
    assert got[0].shape == (sum(Q_LENS), 4, 8) and got[1].shape == (4, sum(Q_LENS))
    assert got[1].dtype == torch.float32


def test_sequences_do_not_see_each_other():
    # changing the keys of sequence 0 changes nothing in the others
    q, k, v = _packed(Q_LENS, K_LENS)
    out = _varlen(q, k, v, Q_LENS, K_LENS)[0]
    k2, v2 = k.clone(), v.clone()
    k2[:K_LENS[0]] += 1.0
    v2[:K_LENS[0]] -= 2.0
    out2 = _varlen(q, k2, v2, Q_LENS, K_LENS)[0]
    assert not torch.allclose(out[:Q_LENS[0]], out2[:Q_LENS[0]])
    assert torch.equal(out[Q_LENS[0]:], out2[Q_LENS[0]:])


def test_causal_is_bottom_right_per_sequence():
    # sequence 0: q_len > kv_len (leading 20 rows see nothing); 1: q_len < kv_len; 2: single tokens
    q_lens, k_lens = [30, 7, 1, 12], [10, 25, 1, 12]
    q, k, v = _packed(q_lens, k_lens, hq=4, hkv=2)
    out, lse = _varlen(q, k, v, q_lens, k_lens, causal=True)
    _assert_same((out, lse), _per_sequence(q, k, v, q_lens, k_lens, causal=True))
    assert torch.equal(out[:20], torch.zeros_like(out[:20]))
    assert bool(torch.isneginf(lse[:, :20]).all()) and bool(torch.isfinite(lse[:, 20:]).all())
    # the 7-query / 25-key sequence: its first query sees keys 0..18, so it differs from dense
    s1 = slice(30, 37)
    dense = _varlen(q, k, v, q_lens, k_lens)[0]
    assert not torch.allclose(out[s1], dense[s1]) and torch.allclose(out[s1][-1], dense[s1][-1])


def test_causal_matches_a_token_mask_oracle():
    # independent of attention(): full-matrix softmax per sequence under j <= i + kv_len - q_len
    from sparse_attn.testing import causal_token_mask, naive_masked_attention
    q_lens, k_lens = [30, 7, 1], [10, 25, 1]
    q, k, v = _packed(q_lens, k_lens, hq=2, hkv=1)
    out = _varlen(q, k, v, q_lens, k_lens, causal=True)[0]
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        o = naive_masked_attention(q[cq[b]:cq[b + 1]].transpose(0, 1)[None], k[ck[b]:ck[b + 1]].transpose(0, 1)[None],
                                   v[ck[b]:ck[b + 1]].transpose(0, 1)[None], causal_token_mask(lq, lk))
        torch.testing.assert_close(out[cq[b]:cq[b + 1]], o[0].transpose(0, 1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_pattern_callable_matches_per_sequence(causal):
    q_lens, k_lens = [50, 1, 33, 64], [70, 9, 33, 20]
    pattern = lambda lq, lk: patterns.local(lq, 40, kv_len=lk, causal=False, block_q=16, block_k=16)  # noqa: E731
    q, k, v = _packed(q_lens, k_lens, hq=4, hkv=2)
    got = _varlen(q, k, v, q_lens, k_lens, pattern=pattern, causal=causal)
    want = _per_sequence(q, k, v, q_lens, k_lens, [pattern(a, b) for a, b in zip(q_lens, k_lens)], causal=causal)
    _assert_same(got, want)
    # the pattern really restricts: a dense run differs
    assert not torch.allclose(got[0], _varlen(q, k, v, q_lens, k_lens, causal=causal)[0])


def test_explicit_layouts_with_gqa_and_per_head_layouts():
    q_lens, k_lens = [40, 1, 23], [40, 17, 50]
    layouts = [patterns.block_diagonal(40, 13, block_q=16, block_k=16),
               patterns.dense(1, 17, block_q=16, block_k=16),
               patterns.random(23, density=0.5, kv_len=50, heads=4, block_q=16, block_k=16, seed=3)]
    q, k, v = _packed(q_lens, k_lens, hq=4, hkv=2)
    got = _varlen(q, k, v, q_lens, k_lens, layouts=layouts)
    _assert_same(got, _per_sequence(q, k, v, q_lens, k_lens, layouts))
    got_c = _varlen(q, k, v, q_lens, k_lens, layouts=layouts, causal=True)
    _assert_same(got_c, _per_sequence(q, k, v, q_lens, k_lens, layouts, causal=True))
    assert not torch.allclose(got[0], got_c[0])


def test_single_token_sequences():
    q_lens, k_lens = [1, 1, 1], [1, 4, 1]
    q, k, v = _packed(q_lens, k_lens, hq=2, hkv=1)
    out, lse = _varlen(q, k, v, q_lens, k_lens, causal=True)
    _assert_same((out, lse), _per_sequence(q, k, v, q_lens, k_lens, causal=True))
    # a query with one key returns that key's value
    torch.testing.assert_close(out[0], v[0].expand(2, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[2], v[5].expand(2, -1), rtol=0, atol=1e-12)


def test_scale_is_passed_through():
    q, k, v = _packed(Q_LENS, K_LENS)
    a = sparse_attn.varlen_attention(q, k, v, _cu(Q_LENS), _cu(K_LENS), 40, 40, scale=0.3)
    b = sparse_attn.varlen_attention(q * 0.3 * 8 ** 0.5, k, v, _cu(Q_LENS), _cu(K_LENS), 40, 40)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_return_lse_false_gives_only_the_output():
    q, k, v = _packed(Q_LENS, K_LENS)
    out = sparse_attn.varlen_attention(q, k, v, _cu(Q_LENS), _cu(K_LENS), 40, 40)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


@pytest.mark.parametrize("kw", [dict(causal=True),
                                dict(pattern=lambda lq, lk: patterns.streaming(lq, 9, 3, kv_len=lk, block_q=16,
                                                                               block_k=16))],
                         ids=["causal", "streaming"])
def test_gradients_match_per_sequence(kw):
    q_lens, k_lens = [20, 1, 35], [12, 6, 35]
    q, k, v = _packed(q_lens, k_lens, hq=4, hkv=2, grad=True)
    out, lse = _varlen(q, k, v, q_lens, k_lens, **kw)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    layouts = None if "pattern" not in kw else [kw["pattern"](a, b) for a, b in zip(q_lens, k_lens)]
    out2, lse2 = _per_sequence(q2, k2, v2, q_lens, k_lens, layouts, causal=kw.get("causal", False))
    do = torch.randn_like(out)
    out.backward(do)
    out2.backward(do)
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        assert a.grad is not None and not torch.isnan(a.grad).any(), name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-10, msg=name)
    assert float(v.grad.abs().sum()) > 0 and float(q.grad.abs().sum()) > 0


def test_gradients_against_finite_differences():
    q_lens, k_lens = [5, 1], [3, 4]
    q, k, v = _packed(q_lens, k_lens, hq=2, hkv=1, d=4, grad=True)
    fn = lambda q, k, v: sparse_attn.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 5, 4,  # noqa: E731
                                                       causal=True)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- validation errors
def _args(q_lens=(5, 3), k_lens=(4, 6), q=None):
    qq, k, v = _packed(list(q_lens), list(k_lens))
    return [qq if q is None else q, k, v, _cu(list(q_lens)), _cu(list(k_lens)), max(q_lens), max(k_lens)]


def _call(args, **kw):
    return sparse_attn.varlen_attention(*args, **kw)


def test_cu_seqlens_wrong_dtype():
    a = _args()
    a[3] = a[3].long()
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be a 1-D int32 tensor.*got torch\.int64 \(3,\)"):
        _call(a)


def test_cu_seqlens_not_a_tensor():
    a = _args()
    a[4] = [0, 4, 10]
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be a 1-D int32 tensor.*got list"):
        _call(a)


def test_cu_seqlens_wrong_dims():
    a = _args()
    a[4] = a[4][None]
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be a 1-D int32.*got torch\.int32 \(1, 3\)"):
        _call(a)


def test_cu_seqlens_on_another_device():
    a = _args()
    a[3] = torch.tensor([0, 5, 8], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"cu_seqlens_q is on meta but q is on cpu"):
        _call(a)


def test_cu_seqlens_not_starting_at_zero():
    a = _args()
    a[3] = torch.tensor([1, 5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must start at 0 and end at .*\(8\), got \[1, 5, 8\]$"):
        _call(a)


def test_cu_seqlens_not_ending_at_total():
    a = _args()
    a[4] = torch.tensor([0, 4, 9], dtype=torch.int32)      # k has 10 tokens
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0 and end at .*\(10\), got .*9\]"):
        _call(a)


def test_cu_seqlens_too_short():
    a = _args()
    a[3] = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must hold num_seqs \+ 1 >= 2 offsets \(start 0, end \d+\), got \[0\]"):
        _call(a)


def test_cu_seqlens_decreasing():
    q, k, v = _packed([8], [10])
    cq = torch.tensor([0, 6, 2, 8], dtype=torch.int32)
    ck = torch.tensor([0, 3, 6, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[1\]=6 > "
                                         r"cu_seqlens_q\[2\]=2"):
        sparse_attn.varlen_attention(q, k, v, cq, ck, 8, 10)


def test_max_seqlen_smaller_than_a_sequence():
    a = _args()
    a[5] = 4
    with pytest.raises(ValueError, match=r"max_seqlen for cu_seqlens_q is 4 but a sequence has 5 tokens"):
        _call(a)
    a = _args()
    a[6] = 5
    with pytest.raises(ValueError, match=r"max_seqlen for cu_seqlens_k is 5 but a sequence has 6 tokens"):
        _call(a)


def test_sequence_count_mismatch():
    q, k, v = _packed([5, 3], [10])
    with pytest.raises(ValueError, match=r"cu_seqlens_q has 2 sequences, cu_seqlens_k has 1"):
        sparse_attn.varlen_attention(q, k, v, _cu([5, 3]), _cu([10]), 5, 10)


def test_layouts_count_mismatch():
    a = _args()
    with pytest.raises(LayoutError, match=r"got 1 layouts for 2 sequences"):
        _call(a, layouts=[patterns.dense(5, 4, block_q=16, block_k=16)])


def test_layout_built_for_the_wrong_lengths():
    a = _args()
    layouts = [patterns.dense(5, 4, block_q=16, block_k=16), patterns.dense(3, 5, block_q=16, block_k=16)]
    with pytest.raises(LayoutError, match=r"layout 1 was built for q_len=3, kv_len=5 but sequence 1 has 3 query "
                                          r"and 6 key tokens"):
        _call(a, layouts=layouts)


def test_pattern_built_for_the_wrong_lengths():
    a = _args()
    with pytest.raises(LayoutError, match=r"layout 0 was built for q_len=5, kv_len=5 but sequence 0 has 5 query "
                                          r"and 4 key tokens"):
        _call(a, pattern=lambda lq, lk: patterns.dense(lq, block_q=16, block_k=16))


def test_layout_not_a_blocklayout_or_batched():
    a = _args()
    with pytest.raises(TypeError, match=r"layout 1 must be a BlockLayout, got str"):
        _call(a, layouts=[patterns.dense(5, 4, block_q=16, block_k=16), "dense"])
    batched = patterns.random(3, density=1.0, kv_len=6, batch=2, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match=r"layout 1 has batch 2"):
        _call(a, layouts=[patterns.dense(5, 4, block_q=16, block_k=16), batched])


def test_a_transposed_layout_is_refused():
    """transpose() is the backward's block-level view (its masks keep the original (query, key) frame):
    attention refuses it, and so must varlen / grouped attention and the reference oracle, which ran it
    as a pattern of its own (wrong inside partial blocks, silently). A square sequence (5 x 5) so that
    the transpose fits its lengths."""
    a = _args(q_lens=(5, 3), k_lens=(5, 6))
    t = patterns.local(5, 2, block_q=16, block_k=16).transpose()
    ok = patterns.dense(3, 6, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match=r"varlen_attention \(layout 0\): this layout is a transpose\(\)"):
        _call(a, layouts=[t, ok])
    with pytest.raises(LayoutError, match=r"varlen_attention \(layout 0\): this layout is a transpose\(\)"):
        _call(a, pattern=lambda lq, lk: t if lq == lk else ok)
    q, k, v = (x.transpose(0, 1)[None] for x in a[:3])
    with pytest.raises(LayoutError, match=r"reference.attention: this layout is a transpose\(\)"):
        reference.attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], t)
    groups = groups_from_cu_seqlens(a[3], a[4])
    with pytest.raises(LayoutError, match=r"grouped_attention \(layout 0\): this layout is a transpose\(\)"):
        sparse_attn.grouped_attention(a[0], a[1], a[2], groups, layouts=[t, ok], causal=False)


@pytest.mark.parametrize("heads", [2, 3])
def test_layout_with_wrong_heads_is_a_layout_error(heads):
    q, k, v = _packed([5, 3], [4, 6], hq=4, hkv=2)
    layouts = [patterns.random(5, density=0.5, kv_len=4, heads=heads, block_q=16, block_k=16),
               patterns.dense(3, 6, block_q=16, block_k=16)]
    with pytest.raises(LayoutError, match=rf"{heads} heads"):
        sparse_attn.varlen_attention(q, k, v, _cu([5, 3]), _cu([4, 6]), 5, 6, layouts=layouts)


@pytest.mark.parametrize("wrong", ["local", patterns.dense(5, 4, block_q=16, block_k=16)])
def test_pattern_that_is_not_a_function_is_a_clear_error(wrong):
    a = _args()
    hint = (r"pass layouts=\[one BlockLayout per sequence\]" if isinstance(wrong, BlockLayout)
            else r"e\.g\. pattern=lambda")
    with pytest.raises(TypeError, match=rf"pattern must be a function \(q_len, kv_len\) -> BlockLayout.*{hint}"):
        _call(a, pattern=wrong)


def test_one_layout_instead_of_a_list_is_a_clear_error():
    a = _args()
    with pytest.raises(TypeError, match=r"layouts must be a list with one BlockLayout per sequence, got BlockLayout"):
        _call(a, layouts=patterns.dense(5, 4, block_q=16, block_k=16))


def test_plan_cache_keeps_the_given_layouts_alive():
    """The plan cache keys on the layouts' ids: it must hold the layouts themselves, not the caller's
    list, or replacing a list entry frees a layout whose id a new layout can take (a stale plan)."""
    import gc
    import weakref
    a = _args()
    lays = [patterns.local(5, 2, kv_len=4, block_q=16, block_k=16), patterns.dense(3, 6, block_q=16, block_k=16)]
    _call(a, layouts=lays, causal=True)
    first = weakref.ref(lays[0])
    lays[0] = patterns.dense(5, 4, block_q=16, block_k=16)
    gc.collect()
    assert first() is not None, "the cached plan let a layout whose id is in its key be freed"
    out = _call(a, layouts=lays, causal=True)
    torch.testing.assert_close(out, _per_sequence(*a[:3], [5, 3], [4, 6], lays, causal=True)[0])


def test_layouts_and_pattern_both_given():
    a = _args()
    with pytest.raises(ValueError, match=r"give either layouts= or pattern=, not both"):
        _call(a, layouts=[patterns.dense(5, 4), patterns.dense(3, 6)], pattern=lambda lq, lk: patterns.dense(lq, lk))


def test_four_dimensional_q():
    q, k, v = _packed([5, 3], [4, 6])
    with pytest.raises(ValueError, match=r"packed \[total_tokens, heads, head_dim\], got \(1, 8, 2, 8\)"):
        sparse_attn.varlen_attention(q[None], k, v, _cu([5, 3]), _cu([4, 6]), 5, 6)


def test_head_mismatch_names_the_heads():
    q, k, v = _packed([5, 3], [4, 6], hq=3, hkv=2)
    with pytest.raises(ValueError, match=r"k has 2 heads, q has 3"):
        sparse_attn.varlen_attention(q, k, v, _cu([5, 3]), _cu([4, 6]), 5, 6)


# ----------------------------------------------------------------------------- the varlen kernel (interpreter)
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")
def test_varlen_kernel_block_diagonal_with_a_cut_tail():
    from sparse_attn.ops.block_sparse import varlen_attention_op
    # documents of 32 tokens over 16x16 blocks: whole blocks inside a document are full, so the cut last key
    # block of sequence 0 (45 = 2*16 + 13) and of sequence 1 (19 = 16 + 3) is full in the layout and only
    # the sequence-end bound keeps the kernel from reading the next sequence's keys
    q_lens, k_lens = [45, 1, 30], [45, 19, 32]
    hq, hkv, d = 2, 1, 16
    pattern = lambda lq, lk: patterns.block_diagonal(lq, 32, kv_len=lk, block_q=16, block_k=16)  # noqa: E731
    per_seq = varlen.build_layouts(q_lens, k_lens, None, pattern, causal=False)
    assert int(per_seq[0].kv_counts[0, 0, 2]) == 1
    assert per_seq[0].kv_indices[0, 0, 2, :1].tolist() == [2] and per_seq[0].kv_mask_ids[0, 0, 2, :1].tolist() == [-1]
    assert int(per_seq[1].kv_counts[0, 0, 0]) == 2 and per_seq[1].kv_mask_ids[0, 0, 0, :2].tolist() == [-1, -1]
    stacked = varlen.stack(per_seq, max(q_lens), max(k_lens), hq)
    q, k, v = _packed(q_lens, k_lens, hq=hq, hkv=hkv, d=d, dtype=torch.float16, seed=11)
    out, lse = varlen_attention_op(q, k, v, stacked, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
                                   torch.tensor(k_lens), return_lse=True)
    o_or, lse_or = sparse_attn.varlen_attention(q.double(), k.double(), v.double(), _cu(q_lens), _cu(k_lens),
                                                max(q_lens), max(k_lens), pattern=pattern, return_lse=True)
    # same-dtype reference per sequence (DESIGN rule 3: the kernel's error is judged against it)
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    o_lp = torch.cat([reference.attention(q[cq[b]:cq[b + 1]].transpose(0, 1)[None],
                                          k[ck[b]:ck[b + 1]].transpose(0, 1)[None],
                                          v[ck[b]:ck[b + 1]].transpose(0, 1)[None], per_seq[b],
                                          _lowp=True)[0].transpose(0, 1) for b in range(len(q_lens))])
    assert out.shape == o_or.shape and out.dtype == torch.float16
    assert_close_to_oracle(out, o_lp, o_or, name="out")
    assert lse.shape == lse_or.shape == (hq, sum(q_lens))
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_or))
    fin = torch.isfinite(lse_or)
    assert (lse[fin].double() - lse_or[fin]).abs().max() < 1e-2
    # the schedule was built per sequence's own key length
    assert ("schedule", True, tuple(k_lens)) in stacked._derived


# ----------------------------------------------------------------------------- prepare
def test_prepare_caches_both_schedules_and_returns_the_layout():
    layout = patterns.local(100, 30, block_q=16, block_k=32)
    assert layout._transpose is None and not layout._derived
    assert sparse_attn.prepare(layout) is layout
    assert ("schedule", True, None) in layout._derived
    assert layout._transpose is not None and ("schedule", False, None) in layout._transpose._derived
    from sparse_attn.ops.block_sparse.schedule import schedule
    fwd = layout._derived[("schedule", True, None)]
    assert schedule(layout) is fwd                       # the kernels' lookup hits the cache
    assert sparse_attn.prepare(layout) is layout and layout._derived[("schedule", True, None)] is fwd


def test_prepare_forward_only_skips_the_transpose():
    layout = patterns.causal(64, block_q=16, block_k=16)
    assert sparse_attn.prepare(layout, backward=False) is layout
    assert ("schedule", True, None) in layout._derived
    assert layout._transpose is None


def test_stack_keeps_each_sequences_blocks_and_masks():
    """varlen.stack (the layout the varlen/grouped kernels run) keeps, per batch row, the sequence's own
    blocks and, for each partial block, that sequence's own element mask (mask ids offset past the
    earlier sequences' masks), with rows past the sequence's length empty."""
    lays = [patterns.local(40, 7, block_q=16, block_k=16),
            patterns.streaming(70, 9, 3, kv_len=90, block_q=16, block_k=16),
            patterns.causal(33, block_q=16, block_k=16)]
    st = varlen.stack(lays, 70, 90, heads=1)
    smap = st._block_map()
    for b, lay in enumerate(lays):
        own = lay._block_map()[0, 0]
        nq, nk = own.shape
        got = smap[b, 0]
        assert (got[nq:] == -2).all() and (got[:, nk:] == -2).all()
        got = got[:nq, :nk]
        assert torch.equal(got < 0, own < 0) and torch.equal(got == -1, own == -1)
        for m_st, m_own in zip(got[own >= 0].tolist(), own[own >= 0].tolist()):
            assert st.masks[m_st] == lay.masks[m_own], (b, m_st, m_own)


def test_varlen_and_groups_from_offsets_refuse_cuda_graph_capture_by_name(monkeypatch):
    """Both read the offsets on the host; inside a CUDA graph capture that read is illegal and a replay
    would keep the plan it made. The capture state is faked here (no GPU): the error must name the call,
    the tensor and what to do instead, before any host read."""
    import sparse_attn.validation as validation
    monkeypatch.setattr(validation, "capturing", lambda t: isinstance(t, (torch.Tensor, torch.device)))
    q, k, v = _packed([5, 7], [5, 7])
    cu = _cu([5, 7])
    with pytest.raises(RuntimeError, match=r"varlen_attention cannot run inside CUDA graph capture: it reads "
                                           r"cu_seqlens_q on the host.*padded"):
        sparse_attn.varlen_attention(q, k, v, cu, cu, 7, 7)
    with pytest.raises(RuntimeError, match=r"groups_from_cu_seqlens cannot run inside CUDA graph capture.*"
                                           r"cu_seqlens_q.*before capturing"):
        groups_from_cu_seqlens(cu, cu)
    monkeypatch.setattr(validation, "capturing", lambda t: False)
    assert sparse_attn.varlen_attention(q, k, v, cu, cu, 7, 7).shape == q.shape


def test_offsets_given_on_the_cpu_are_copied_for_the_kernels_and_others_pass_through():
    """varlen.offsets_on: offsets on the CPU (read by the plan without a sync) reach q's device by one copy,
    in order and shape; offsets already there are passed as they are. (A 'meta' device stands in for CUDA.)"""
    from sparse_attn.varlen import offsets_on
    host, there = _cu([5, 7, 2]), torch.tensor([0, 3, 9], dtype=torch.int32, device="meta")
    a, b = offsets_on("meta", host, there)
    assert a.device.type == "meta" and a.shape == host.shape and a.dtype == torch.int32 and b is there
    same = offsets_on("cpu", host)
    assert same[0] is host
