"""Property tests (hypothesis) over random small layouts.

A random layout: a random block mask ``[Bl, Hl, Qb, Kb]`` with random partial flags under a random
ElementMask (1-2 terms), block sizes in {16, 32, 48, 64}, lengths 1..150 drawn independently.
Examples are derandomized so a run is reproducible (no flaky reruns, DESIGN rule 3).
"""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_attn import reference
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm
from sparse_attn.testing import causal_token_mask, element_mask_dense, naive_masked_attention

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
BLOCKS = st.sampled_from([16, 32, 48, 64])
LENGTHS = st.integers(1, 150)
DOC = 24  # one document size: intersecting different sizes is documented as unsupported


@st.composite
def terms(draw):
    kw = {}
    if draw(st.booleans()):
        kw["left"] = draw(st.integers(-2, 80))
    if draw(st.booleans()):
        kw["right"] = draw(st.integers(-2, 80))
    if draw(st.integers(0, 3)) == 0:
        kw["k_lo"] = draw(st.integers(0, 60))
        kw["k_hi"] = kw["k_lo"] + draw(st.integers(0, 60))
    if draw(st.integers(0, 3)) == 0:
        kw["q_lo"] = draw(st.integers(-20, 100))
        kw["q_hi"] = kw["q_lo"] + draw(st.integers(0, 80))
    if draw(st.integers(0, 4)) == 0:
        kw["doc"] = DOC
    return MaskTerm(**kw)


def masks(max_terms=2):
    return st.lists(terms(), min_size=1, max_size=max_terms).map(lambda ts: ElementMask(tuple(ts)))


@st.composite
def geometry(draw):
    return dict(q_len=draw(LENGTHS), kv_len=draw(LENGTHS), block_q=draw(BLOCKS), block_k=draw(BLOCKS))


@st.composite
def block_layouts(draw, geo, batch=1, heads=1, max_terms=2):
    """(layout, block_mask, partial, mask) for a fixed geometry."""
    nq, nk = math.ceil(geo["q_len"] / geo["block_q"]), math.ceil(geo["kv_len"] / geo["block_k"])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    bm = torch.rand(batch, heads, nq, nk, generator=g) < density
    part = torch.rand(batch, heads, nq, nk, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    mask = draw(masks(max_terms))
    layout = BlockLayout.from_block_mask(bm, partial=part, mask=mask, **geo)
    return layout, bm, part, mask


def expected_tokens(geo, bm, part, mask):
    """Independent token mask: block listed and (full or the mask allows (i, j)), by plain loops."""
    lq, lk, bq, bk = geo["q_len"], geo["kv_len"], geo["block_q"], geo["block_k"]
    blk = bm.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :lq, :lk]
    prt = part.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :lq, :lk]
    return blk & (~prt | element_mask_dense(mask, lq, lk))


# ----------------------------------------------------------------------------- layout <-> tokens
@SETTINGS
@given(data=st.data())
def test_block_layout_token_mask_matches_definition(data):
    geo = data.draw(geometry())
    B, H = data.draw(st.sampled_from([(1, 1), (2, 1), (1, 3), (2, 2)]))
    layout, bm, part, mask = data.draw(block_layouts(geo, B, H))
    layout.validate()
    want = expected_tokens(geo, bm, part, mask)
    assert torch.equal(layout.to_token_mask(), want)
    assert_blocks_honest(layout, want)


def assert_blocks_honest(layout, tokens):
    """No listed block is empty; a block marked full is fully allowed (``tokens`` [Bl, Hl, Lq, Lk])."""
    bq, bk = layout.block_q, layout.block_k
    counts, idx, mids = layout.kv_counts.tolist(), layout.kv_indices.tolist(), layout.kv_mask_ids.tolist()
    for b in range(layout.batch):
        for h in range(layout.heads):
            for qb in range(layout.num_q_blocks):
                for s in range(counts[b][h][qb]):
                    kb, mid = idx[b][h][qb][s], mids[b][h][qb][s]
                    tile = tokens[b, h, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk]
                    assert tile.any(), f"empty block ({b}, {h}, {qb}, {kb}) listed"
                    if mid == -1:
                        assert tile.all(), f"block ({b}, {h}, {qb}, {kb}) marked full but not fully allowed"


@SETTINGS
@given(data=st.data())
def test_from_block_mask_roundtrip_preserves_block_set(data):
    geo = data.draw(geometry())
    B, H = data.draw(st.sampled_from([(1, 1), (2, 3)]))
    layout, *_ = data.draw(block_layouts(geo, B, H))
    bmask = layout.to_block_mask()
    again = BlockLayout.from_block_mask(bmask, **geo)
    again.validate()
    assert torch.equal(again.to_block_mask(), bmask)
    assert torch.equal(again.kv_counts, layout.kv_counts)
    assert torch.equal(again.kv_indices, layout.kv_indices)
    assert not again.kv_partial.any() and again.masks == ()


# ----------------------------------------------------------------------------- reference vs naive
@SETTINGS
@given(data=st.data())
def test_reference_matches_naive_on_random_layouts(data):
    geo = data.draw(geometry())
    B = data.draw(st.sampled_from([1, 2]))
    Hkv, group = data.draw(st.sampled_from([(1, 1), (1, 3), (2, 2), (2, 1)]))
    Hq = Hkv * group
    Bl = data.draw(st.sampled_from([1, B]))
    Hl = data.draw(st.sampled_from([1, Hq]))
    layout, *_ = data.draw(block_layouts(geo, Bl, Hl))
    causal = data.draw(st.booleans())
    scale = data.draw(st.sampled_from([None, 0.3]))
    lq, lk = geo["q_len"], geo["kv_len"]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    q = torch.randn(B, Hq, lq, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, lk, 4, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, lk, 3, generator=g, dtype=torch.float64)
    out, lse = reference.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True)
    tok = layout.to_token_mask()
    if causal:
        tok = tok & causal_token_mask(lq, lk)
    want, want_lse = naive_masked_attention(q, k, v, tok, scale, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out - want).abs().max().item() <= 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    if fin.any():
        assert (lse[fin].double() - want_lse[fin]).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- algebra
def _tok(layout, B, H):
    return layout.to_token_mask().expand(B, H, -1, -1)


@SETTINGS
@given(data=st.data())
def test_union_intersection_commutative_idempotent(data):
    geo = data.draw(geometry())
    a, *_ = data.draw(block_layouts(geo, data.draw(st.sampled_from([1, 2])), 1))
    b, *_ = data.draw(block_layouts(geo, 1, data.draw(st.sampled_from([1, 3]))))
    B, H = max(a.batch, b.batch), max(a.heads, b.heads)
    ta, tb = _tok(a, B, H), _tok(b, B, H)
    for c, want in ((a | b, ta | tb), (b | a, ta | tb), (a & b, ta & tb), (b & a, ta & tb)):
        c.validate()
        assert torch.equal(_tok(c, B, H), want)
    for c in (a | a, a & a):
        c.validate()
        assert torch.equal(c.to_token_mask(), a.to_token_mask())
        assert torch.equal(c.to_block_mask(), a.to_block_mask())


@SETTINGS
@given(data=st.data())
def test_union_intersection_distributive(data):
    """a & (b | c) == (a & b) | (a & c) and a | (b & c) == (a | b) & (a | c), in token-mask terms.

    One-term masks: ``(a | b) & (a | c)`` multiplies term counts, and an ElementMask holds at most 8.
    """
    geo = data.draw(geometry())
    a, *_ = data.draw(block_layouts(geo, max_terms=1))
    b, *_ = data.draw(block_layouts(geo, max_terms=1))
    c, *_ = data.draw(block_layouts(geo, 1, data.draw(st.sampled_from([1, 2])), max_terms=1))
    ta, tb, tc = (_tok(x, 1, c.heads) for x in (a, b, c))
    lhs, rhs = a & (b | c), (a & b) | (a & c)
    for x in (lhs, rhs):
        x.validate()
        assert torch.equal(_tok(x, 1, c.heads), ta & (tb | tc))
    lhs, rhs = a | (b & c), (a | b) & (a | c)
    for x in (lhs, rhs):
        x.validate()
        assert torch.equal(_tok(x, 1, c.heads), ta | (tb & tc))


@SETTINGS
@given(data=st.data())
def test_intersection_is_canonical(data):
    """After an intersection no listed block is empty and every fully allowed block is marked full."""
    geo = data.draw(geometry())
    a, *_ = data.draw(block_layouts(geo))
    b, *_ = data.draw(block_layouts(geo))
    c = a & b
    tok = c.to_token_mask()
    assert_blocks_honest(c, tok)
    bq, bk = geo["block_q"], geo["block_k"]
    for qb in range(c.num_q_blocks):
        for s in range(int(c.kv_counts[0, 0, qb])):
            kb, mid = int(c.kv_indices[0, 0, qb, s]), int(c.kv_mask_ids[0, 0, qb, s])
            assert (mid == -1) == bool(tok[0, 0, qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk].all())
