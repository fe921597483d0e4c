"""BlockLayout: construction from element masks and block masks, algebra, transpose, stats, validate.

Expected patterns are built independently: token masks with plain Python loops over (i, j) straight
from the definitions (causal, window, sinks, documents), block facts from those token masks, and
layout rows read back from the public tensors with ``.tolist()``.
"""
from __future__ import annotations

import functools
import math
import time

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.layout import BlockLayout, LayoutError
from sparse_attn.masks import ElementMask, MaskTerm, causal_term, document_term, sink_term, window_term
from sparse_attn.testing import block_map_from_token_mask, element_mask_dense


# ----------------------------------------------------------------------------- independent helpers
def loop_mask(q_len: int, kv_len: int, fn) -> torch.Tensor:
    """bool [q_len, kv_len]: fn(p, j) with p = i + kv_len - q_len (bottom-right alignment)."""
    off = kv_len - q_len
    rows = [[bool(fn(i + off, j)) for j in range(kv_len)] for i in range(q_len)]
    return torch.tensor(rows, dtype=torch.bool).reshape(q_len, kv_len)


# name -> (ElementMask, obvious predicate on (p, j))
PATTERNS = {
    "causal": (ElementMask((causal_term(),)), lambda p, j: j <= p),
    "window_causal_9": (ElementMask((window_term(8, 0),)), lambda p, j: p - 8 <= j <= p),
    "window_two_sided": (ElementMask((window_term(20, 5),)), lambda p, j: p - 20 <= j <= p + 5),
    "window_wide": (ElementMask((window_term(70, 33),)), lambda p, j: p - 70 <= j <= p + 33),
    "sinks_plus_window": (ElementMask((window_term(15, 0), MaskTerm(k_lo=0, k_hi=3, right=0))),
                          lambda p, j: (p - 15 <= j <= p) or (j <= 3 and j <= p)),
    "sinks_only": (ElementMask((sink_term(5),)), lambda p, j: j < 5),
    "documents_23": (ElementMask((document_term(23),)), lambda p, j: p >= 0 and p // 23 == j // 23),
    "documents_causal_40": (ElementMask((document_term(40, causal=True),)),
                            lambda p, j: p >= 0 and p // 40 == j // 40 and j <= p),
    "global_rows": (ElementMask((MaskTerm(q_lo=0, q_hi=9), causal_term())), lambda p, j: 0 <= p <= 9 or j <= p),
    "nothing": (ElementMask(()), lambda p, j: False),
    "everything": (ElementMask((MaskTerm(),)), lambda p, j: True),
}
SIZES = [(1, 1), (17, 17), (100, 100), (17, 100), (100, 17), (150, 37)]
BLOCKS = [(16, 16), (32, 64), (64, 16), (48, 80), (128, 256), (256, 128)]


@functools.lru_cache(maxsize=None)
def expected_tokens(name: str, q_len: int, kv_len: int) -> torch.Tensor:
    return loop_mask(q_len, kv_len, PATTERNS[name][1])


def rows_of(layout: BlockLayout) -> dict:
    """{(b, h, qb): [(kb, mask_id), ...]} from the public tensors, in stored order."""
    counts = layout.kv_counts.tolist()
    idx = layout.kv_indices.tolist()
    mids = layout.kv_mask_ids.tolist()
    out = {}
    for b in range(layout.batch):
        for h in range(layout.heads):
            for qb in range(layout.num_q_blocks):
                n = counts[b][h][qb]
                out[b, h, qb] = list(zip(idx[b][h][qb][:n], mids[b][h][qb][:n]))
    return out


def block_states(layout: BlockLayout) -> torch.Tensor:
    """int [Bl, Hl, Qb, Kb] from rows_of: -2 absent, -1 full, m partial (python loops)."""
    out = torch.full((layout.batch, layout.heads, layout.num_q_blocks, layout.num_kv_blocks), -2, dtype=torch.int32)
    for (b, h, qb), entries in rows_of(layout).items():
        for kb, mid in entries:
            out[b, h, qb, kb] = mid
    return out


def assert_canonical(layout: BlockLayout, tokens: torch.Tensor) -> None:
    """Listed blocks: never empty; marked full iff every token allowed; rows tight (max_k = max count)."""
    expect = block_map_from_token_mask(tokens.expand(layout.batch, layout.heads, -1, -1), layout.block_q,
                                       layout.block_k)
    got = block_states(layout)
    assert torch.equal(got == -2, expect == -2), "listed blocks must be exactly the blocks with an allowed token"
    assert torch.equal(got == -1, expect == -1), "a block is full iff all its tokens are allowed"
    assert layout.max_k == (int(layout.kv_counts.max()) if layout.kv_counts.numel() else 0)


# ----------------------------------------------------------------------------- from_mask
@pytest.mark.parametrize("block_q,block_k", BLOCKS)
@pytest.mark.parametrize("q_len,kv_len", SIZES)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_from_mask_matches_loop_mask(name, q_len, kv_len, block_q, block_k):
    mask = PATTERNS[name][0]
    layout = BlockLayout.from_mask(mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k)
    layout.validate()
    assert (layout.batch, layout.heads) == (1, 1)
    assert (layout.num_q_blocks, layout.num_kv_blocks) == (math.ceil(q_len / block_q), math.ceil(kv_len / block_k))
    tokens = expected_tokens(name, q_len, kv_len)
    assert torch.equal(layout.to_token_mask()[0, 0], tokens)
    assert_canonical(layout, tokens)
    for entries in rows_of(layout).values():  # strictly ascending rows
        kbs = [kb for kb, _ in entries]
        assert kbs == sorted(set(kbs))


def test_from_mask_random_terms_against_definition():
    """Random terms (every field, incl. q ranges, negative windows, documents) vs element_mask_dense."""
    g = torch.Generator().manual_seed(1)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    for _ in range(60):
        terms = []
        for _ in range(ri(1, 3)):
            kw = {}
            for field, lo, hi in (("q_lo", -20, 80), ("q_hi", -5, 120), ("k_lo", -5, 80), ("k_hi", -5, 120),
                                  ("left", -3, 60), ("right", -3, 60), ("doc", 1, 40)):
                if ri(0, 2) == 0:
                    kw[field] = ri(lo, hi)
            terms.append(MaskTerm(**kw))
        mask = ElementMask(tuple(terms))
        q_len, kv_len = ri(1, 90), ri(1, 90)
        bq, bk = 16 * ri(1, 4), 16 * ri(1, 4)
        layout = BlockLayout.from_mask(mask, q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk).validate()
        tokens = element_mask_dense(mask, q_len, kv_len)
        assert torch.equal(layout.to_token_mask()[0, 0], tokens), (mask, q_len, kv_len, bq, bk)
        assert_canonical(layout, tokens)


def test_element_mask_dense_helper_literal():
    """The loop oracle itself, on a literal: causal 3x4 (bottom-right: row 0 sits at p = 1)."""
    got = element_mask_dense(ElementMask((causal_term(),)), 3, 4)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)
    got = element_mask_dense(ElementMask((document_term(2), sink_term(1))), 4, 4)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_from_mask_causal_full_and_partial_blocks_exact():
    """Causal, 64 tokens, blocks 16: diagonal blocks partial, strictly-below full, above absent."""
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=64, block_q=16, block_k=16)
    rows = rows_of(layout)
    for qb in range(4):
        assert rows[0, 0, qb] == [(kb, -1) for kb in range(qb)] + [(qb, 0)]
    assert layout.num_blocks == 10
    assert layout.density == pytest.approx(10 / 16)


def test_from_mask_block_q_ne_block_k_causal():
    """block_q=32, block_k=16, L=64: query block qb visits key blocks 0..2qb+1; the last two are partial."""
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=64, block_q=32, block_k=16)
    rows = rows_of(layout)
    # rows 32qb..32qb+31 see j <= i: key block 2qb (keys 32qb..32qb+15) is partial (row 32qb sees one
    # of its keys), key block 2qb+1 too (rows 32qb..32qb+15 see none of it)
    assert rows[0, 0, 0] == [(0, 0), (1, 0)]
    assert rows[0, 0, 1] == [(0, -1), (1, -1), (2, 0), (3, 0)]


def test_from_mask_device_argument_and_masks_tuple():
    mask = ElementMask((window_term(10, 0),))
    layout = BlockLayout.from_mask(mask, q_len=50, block_q=16, block_k=16, device="cpu")
    assert layout.device == torch.device("cpu")
    assert layout.masks == (mask,)
    for t in (layout.kv_counts, layout.kv_indices, layout.kv_mask_ids):
        assert t.dtype == torch.int32


def test_from_mask_long_sequence_builds_without_quadratic_memory():
    """q_len = 262144, causal window 4096, blocks 128: closed-form rows, small storage, seconds."""
    L, W, blk = 262144, 4096, 128
    t0 = time.process_time()  # CPU seconds of this process: robust to other load on the machine
    layout = BlockLayout.from_mask(ElementMask((window_term(W - 1, 0),)), q_len=L, block_q=blk, block_k=blk)
    cpu_s = time.process_time() - t0
    nq = L // blk
    assert layout.max_k == W // blk + 1  # 33 key blocks at most: a dense row set would be 2048
    assert layout.nbytes == nq * 4 + 2 * nq * layout.max_k * 4  # ~0.5 MB; a token mask would be 64 GB
    qb = torch.arange(nq)
    assert torch.equal(layout.kv_counts[0, 0].long(), torch.clamp(qb + 1, max=W // blk + 1))
    partial = (layout.kv_mask_ids[0, 0] >= 0) & (layout.kv_indices[0, 0] >= 0)
    # diagonal block always partial; the left edge block (qb - 32) partial once the window starts sliding
    assert torch.equal(partial.sum(-1), torch.where(qb >= W // blk, 2, 1))
    assert torch.equal(layout.kv_indices[0, 0, qb, layout.kv_counts[0, 0].long() - 1].long(), qb)
    layout.validate()
    assert cpu_s < 20.0, f"from_mask took {cpu_s:.1f} CPU seconds (about 3.5 on 2 cores when written)"


# ----------------------------------------------------------------------------- from_block_mask
def test_from_block_mask_full_blocks_and_lengths():
    bm = torch.tensor([[True, False, True], [False, False, False]])
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=32, q_len=20, kv_len=70)
    assert (layout.q_len, layout.kv_len, layout.batch, layout.heads) == (20, 70, 1, 1)
    assert rows_of(layout) == {(0, 0, 0): [(0, -1), (2, -1)], (0, 0, 1): []}
    tok = layout.to_token_mask()[0, 0]
    want = torch.zeros(20, 70, dtype=torch.bool)
    want[:16, :32] = True
    want[:16, 64:] = True
    assert torch.equal(tok, want)
    assert torch.equal(layout.to_block_mask()[0, 0], bm)


def test_from_block_mask_defaults_to_whole_blocks():
    layout = BlockLayout.from_block_mask(torch.ones(3, 2, dtype=torch.bool), block_q=16, block_k=64)
    assert (layout.q_len, layout.kv_len) == (48, 128)


def test_from_block_mask_partial_blocks_are_classified():
    """Partial blocks the mask leaves empty are dropped; those it fully allows become full."""
    mask = ElementMask((causal_term(),))
    bm = torch.ones(3, 3, dtype=torch.bool)
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, partial=torch.ones(3, 3, dtype=torch.bool),
                                         mask=mask)
    rows = rows_of(layout)
    assert rows[0, 0, 0] == [(0, 0)]
    assert rows[0, 0, 2] == [(0, -1), (1, -1), (2, 0)]
    # mixed: block (0, 2) listed full stays full even though causal would empty it
    part = torch.zeros(3, 3, dtype=torch.bool)
    part[1, 1] = True
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, partial=part, mask=mask)
    rows = rows_of(layout)
    assert rows[0, 0, 0] == [(0, -1), (1, -1), (2, -1)]
    assert rows[0, 0, 1] == [(0, -1), (1, 0), (2, -1)]


@pytest.mark.parametrize("B,H", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_from_block_mask_batched_token_mask(B, H):
    g = torch.Generator().manual_seed(B * 10 + H)
    lq, lk, bq, bk = 70, 45, 16, 32
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    bm = torch.rand(B, H, nq, nk, generator=g) < 0.6
    part = torch.rand(B, H, nq, nk, generator=g) < 0.5
    mask = ElementMask((window_term(12, 3),))
    layout = BlockLayout.from_block_mask(bm, block_q=bq, block_k=bk, q_len=lq, kv_len=lk, partial=part, mask=mask)
    layout.validate()
    assert (layout.batch, layout.heads) == (B, H)
    win = loop_mask(lq, lk, lambda p, j: p - 12 <= j <= p + 3)
    blk = bm.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :lq, :lk]
    prt = part.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :lq, :lk]
    want = blk & (~prt | win)
    assert torch.equal(layout.to_token_mask(), want)
    assert_canonical(layout, want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_mask=torch.ones(2, 2, dtype=torch.int32)), r"block_mask must be bool, got torch\.int32"),
    (dict(block_mask=torch.ones(2, 2, 2, dtype=torch.bool)), r"got shape \(2, 2, 2\)"),
    (dict(block_mask=torch.ones(2, 2, dtype=torch.bool), q_len=40), r"2x2 blocks but q_len=40.*need 3x2"),
    (dict(block_mask=torch.ones(2, 2, dtype=torch.bool), partial=torch.ones(2, 2, dtype=torch.bool)),
     r"no element mask"),
])
def test_from_block_mask_errors(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        BlockLayout.from_block_mask(block_q=16, block_k=16, **kwargs)


@pytest.mark.parametrize("bad", [0, 8, 24, 100, 272, 512, 16.0])
def test_block_size_checks(bad):
    with pytest.raises(LayoutError, match=r"block_q must be a multiple of 16 in \[16, 256\], got " + repr(bad)):
        BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=64, block_q=bad, block_k=16)
    with pytest.raises(LayoutError, match=r"block_k must be a multiple of 16"):
        BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=64, block_q=16, block_k=bad)


# ----------------------------------------------------------------------------- union / intersection
def _random_block_layout(seed, B, H, lq=90, lk=75, bq=16, bk=32, mask=None, density=0.55):
    g = torch.Generator().manual_seed(seed)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    bm = torch.rand(B, H, nq, nk, generator=g) < density
    part = torch.rand(B, H, nq, nk, generator=g) < 0.5
    mask = mask or ElementMask((window_term(int(torch.randint(0, 40, (), generator=g)),
                                            int(torch.randint(0, 10, (), generator=g))),))
    return BlockLayout.from_block_mask(bm, block_q=bq, block_k=bk, q_len=lq, kv_len=lk, partial=part, mask=mask)


def _pattern_layout(name, lq=90, lk=75, bq=16, bk=32):
    return BlockLayout.from_mask(PATTERNS[name][0], q_len=lq, kv_len=lk, block_q=bq, block_k=bk)


def _check_combined(a, b, union):
    c = (a | b) if union else (a & b)
    c.validate()
    ta, tb = a.to_token_mask(), b.to_token_mask()
    want = (ta | tb) if union else (ta & tb)
    B, H = max(a.batch, b.batch), max(a.heads, b.heads)
    assert (c.batch, c.heads) == (B, H)
    assert torch.equal(c.to_token_mask(), want.expand(B, H, -1, -1))
    listed = block_states(c) >= -1
    nonempty = block_map_from_token_mask(want.expand(B, H, -1, -1), c.block_q, c.block_k) >= -1
    assert torch.equal(listed, nonempty), "union/intersection must list exactly the non-empty blocks"
    if not union:
        assert_canonical(c, want)
    return c


@pytest.mark.parametrize("union", [True, False], ids=["union", "intersection"])
@pytest.mark.parametrize("pair", [("causal", "sinks_only"), ("window_two_sided", "causal"),
                                  ("documents_23", "window_wide"), ("global_rows", "window_causal_9"),
                                  ("documents_causal_40", "sinks_plus_window"), ("causal", "causal"),
                                  ("nothing", "causal"), ("everything", "window_two_sided")])
def test_union_intersection_of_element_mask_layouts(pair, union):
    a, b = (_pattern_layout(n) for n in pair)
    _check_combined(a, b, union)


@pytest.mark.parametrize("union", [True, False], ids=["union", "intersection"])
def test_union_intersection_with_masks_differing_per_block(union):
    """Operands whose blocks carry different masks (built by earlier unions), chained."""
    a = _pattern_layout("causal") | _pattern_layout("documents_23")  # masks: causal, docs, causal|docs
    b = _pattern_layout("window_two_sided") | _pattern_layout("sinks_only")
    assert len(a.masks) >= 2 and len(b.masks) >= 2
    c = _check_combined(a, b, union)
    _check_combined(c, _pattern_layout("global_rows"), not union)


@pytest.mark.parametrize("union", [True, False], ids=["union", "intersection"])
@pytest.mark.parametrize("shapes", [((1, 1), (1, 1)), ((2, 1), (1, 3)), ((1, 3), (2, 3)), ((2, 3), (2, 3)),
                                    ((2, 1), (2, 1))])
def test_union_intersection_broadcast_batch_heads(shapes, union):
    (ba, ha), (bb, hb) = shapes
    a = _random_block_layout(1, ba, ha)
    b = _random_block_layout(2, bb, hb, mask=ElementMask((causal_term(), sink_term(7))))
    _check_combined(a, b, union)
    _check_combined(b, a, union)


def test_union_intersection_incompatible():
    a = _random_block_layout(1, 2, 1)
    with pytest.raises(LayoutError, match=r"cannot union layouts with batch 2 and 3: they must match or be 1"):
        a | _random_block_layout(2, 3, 1)
    with pytest.raises(LayoutError, match=r"cannot intersect layouts with heads 2 and 4"):
        _random_block_layout(1, 1, 2) & _random_block_layout(2, 1, 4)
    with pytest.raises(LayoutError,
                       match=r"\(block_q, block_k, q_len, kv_len\) \(16, 32, 90, 75\) and \(16, 32, 91, 75\)"):
        a | _random_block_layout(2, 1, 1, lq=91)
    with pytest.raises(LayoutError, match=r"\(16, 32, 90, 75\) and \(32, 32, 90, 75\)"):
        a & _random_block_layout(2, 1, 1, bq=32)


def test_intersection_of_unions_fits_term_limit():
    def all_partial(*terms):
        bm = torch.ones(2, 2, dtype=torch.bool)
        return BlockLayout.from_block_mask(bm, block_q=16, block_k=16, partial=bm, mask=ElementMask(terms))

    a = all_partial(window_term(3, 0), MaskTerm(k_lo=0, k_hi=5))
    b = all_partial(window_term(0, 3), MaskTerm(k_lo=10, k_hi=20))
    c = all_partial(window_term(5, 5), MaskTerm(k_lo=3, k_hi=30))
    got = (a | b) & (a | c)
    ta, tb, tc = (x.to_token_mask() for x in (a, b, c))
    assert torch.equal(got.to_token_mask(), ta | (tb & tc))


def test_intersection_drops_blocks_emptied_by_masks():
    """window ∩ disjoint window: the candidate blocks overlap but no token survives."""
    a = BlockLayout.from_mask(ElementMask((MaskTerm(left=0, right=0),)), q_len=64, block_q=32, block_k=32)
    b = BlockLayout.from_mask(ElementMask((MaskTerm(left=-1, right=1),)), q_len=64, block_q=32, block_k=32)
    c = a & b
    assert c.num_blocks == 0 and not c.to_token_mask().any()
    c.validate()


# ----------------------------------------------------------------------------- transpose
@pytest.mark.parametrize("make", [
    lambda: _pattern_layout("sinks_plus_window", 100, 37, 16, 32),
    lambda: _pattern_layout("documents_23", 17, 100, 64, 16),
    lambda: _random_block_layout(3, 2, 3),
    lambda: _pattern_layout("causal") | _pattern_layout("documents_23"),
], ids=["window-sinks", "documents-Lq<Lk", "random-B2H3", "multi-mask"])
def test_transpose(make):
    layout = make()
    t = layout.transpose()
    assert (t.block_q, t.block_k, t.q_len, t.kv_len) == (layout.block_k, layout.block_q, layout.kv_len, layout.q_len)
    assert (t.batch, t.heads) == (layout.batch, layout.heads)
    assert t.masks == layout.masks
    t.validate()
    want = {}
    for (b, h, qb), entries in rows_of(layout).items():
        for kb, mid in entries:
            want.setdefault((b, h, kb), []).append((qb, mid))
    got = {key: v for key, v in rows_of(t).items() if v}
    assert got == {key: sorted(v) for key, v in want.items()}
    assert torch.equal(t.to_block_mask(), layout.to_block_mask().transpose(-1, -2))
    # cached, and the transpose's transpose is the layout itself
    assert layout.transpose() is t
    assert t.transpose() is layout


def test_transpose_refuses_token_level_use():
    """transpose() is the backward's block-level view: its masks keep the original frame, so read as a
    pattern of its own it would be wrong inside partial blocks (536 tokens of a 100 x 37 window with
    sinks). Every token-level use says so instead; block-level facts stay available."""
    layout = _pattern_layout("sinks_plus_window", 100, 37, 16, 32)
    t = layout.transpose()
    q = torch.randn(1, 1, t.q_len, 16)
    k = torch.randn(1, 1, t.kv_len, 16)
    for use in (t.to_token_mask, lambda: t | t, lambda: layout.transpose() & t, lambda: patterns.causal_cut(t),
                lambda: sparse_attn.attention(q, k, k, t)):
        with pytest.raises(LayoutError, match="this layout is a transpose()"):
            use()
    assert torch.equal(t.to_block_mask(), layout.to_block_mask().transpose(-1, -2))
    with pytest.raises(LayoutError, match="transpose"):
        t.expand(1, 2).to_token_mask()
    layout.to_token_mask()  # the transpose's transpose is the layout itself, a pattern again
    with pytest.raises(TypeError, match="combines .* only with another BlockLayout, got NoneType"):
        layout | None


def test_transpose_of_empty_rows():
    bm = torch.zeros(3, 4, dtype=torch.bool)
    bm[2, 1] = True
    t = BlockLayout.from_block_mask(bm, block_q=16, block_k=16).transpose()
    assert t.kv_counts[0, 0].tolist() == [0, 1, 0, 0]
    assert t.kv_indices[0, 0, 1, 0].item() == 2


# ----------------------------------------------------------------------------- stats
def test_stats_values():
    g = torch.Generator().manual_seed(7)
    B, H, nq, nk = 2, 3, 5, 6
    bm = torch.rand(B, H, nq, nk, generator=g) < 0.4
    bm[0, 0, 0] = True  # max row count is nk
    layout = BlockLayout.from_block_mask(bm, block_q=32, block_k=16, q_len=5 * 32 - 3, kv_len=6 * 16 - 7)
    n = int(bm.sum())
    assert layout.num_blocks == n
    assert layout.density == pytest.approx(n / bm.numel())
    assert layout.sparsity == pytest.approx(1 - n / bm.numel())
    assert layout.max_k == nk
    assert layout.nbytes == 4 * B * H * nq + 2 * 4 * B * H * nq * nk
    assert torch.equal(layout.counts_per_head(), bm.sum((-1, -2)))
    assert layout.counts_per_head().dtype == torch.int64
    assert torch.equal(layout.kv_counts, bm.sum(-1).to(torch.int32))


def test_stats_empty_and_dense():
    empty = BlockLayout.from_mask(ElementMask(()), q_len=40, block_q=16, block_k=16)
    assert (empty.num_blocks, empty.density, empty.sparsity, empty.max_k) == (0, 0.0, 1.0, 0)
    assert empty.nbytes == 3 * 4
    empty.validate()
    dense = BlockLayout.from_mask(ElementMask((MaskTerm(),)), q_len=40, kv_len=33, block_q=16, block_k=16)
    assert dense.density == 1.0 and dense.sparsity == 0.0
    assert not dense.kv_partial.any(), "edge blocks of a dense mask are full, not partial"


def test_expand_and_to():
    layout = _pattern_layout("window_two_sided")
    e = layout.expand(2, 3)
    assert (e.batch, e.heads) == (2, 3)
    assert torch.equal(e.to_token_mask(), layout.to_token_mask().expand(2, 3, -1, -1))
    assert layout.to("cpu") is layout


# ----------------------------------------------------------------------------- validate
def _base():
    return BlockLayout.from_mask(ElementMask((window_term(40, 0),)), q_len=100, block_q=16, block_k=16)


def _corrupt(**changes):
    L = _base()
    fields = dict(block_q=L.block_q, block_k=L.block_k, q_len=L.q_len, kv_len=L.kv_len,
                  kv_counts=L.kv_counts.clone(), kv_indices=L.kv_indices.clone(),
                  kv_mask_ids=L.kv_mask_ids.clone(), masks=L.masks)
    for key, fn in changes.items():
        fields[key] = fn(fields[key])
    return BlockLayout(**fields)


def _set(index, value):
    def fn(t):
        t = t.clone()
        t[index] = value
        return t
    return fn


def _swap_first_two_of_row_4(t):
    t = t.clone()
    t[0, 0, 4, 0], t[0, 0, 4, 1] = int(t[0, 0, 4, 1]), int(t[0, 0, 4, 0])
    return t


CORRUPTIONS = {
    "negative count": (dict(kv_counts=_set((0, 0, 2), -1)), r"kv_counts\[0,0,2\] = -1 is outside \[0, 4\]"),
    "count > max_k": (dict(kv_counts=_set((0, 0, 2), 5)), r"kv_counts\[0,0,2\] = 5 is outside \[0, 4\] \(max_k=4"),
    "index too big": (dict(kv_indices=_set((0, 0, 3, 1), 7)),
                      r"kv_indices\[0,0,3,1\] = 7 is out of range: valid key-block indices are 0\.\.6"),
    "index negative": (dict(kv_indices=_set((0, 0, 3, 1), -3)), r"kv_indices\[0,0,3,1\] = -3 is out of range.*0\.\.6"),
    "unsorted": (dict(kv_indices=_swap_first_two_of_row_4),
                 r"kv_indices\[0,0,4\] has unsorted entries at slots 0,1: 2, 1; each row must be strictly ascending"),
    "duplicate": (dict(kv_indices=_set((0, 0, 4, 1), 1)),
                  r"kv_indices\[0,0,4\] has duplicate entries at slots 0,1: 1, 1"),
    "mask id too big": (dict(kv_mask_ids=_set((0, 0, 4, 0), 1)),
                        r"kv_mask_ids\[0,0,4,0\] = 1: must be -1 \(full\) or a mask index in \[0, 0\]"),
    "mask id -2": (dict(kv_mask_ids=_set((0, 0, 5, 1), -2)), r"kv_mask_ids\[0,0,5,1\] = -2"),
    "no masks": (dict(masks=lambda m: ()), r"kv_mask_ids\[0,0,0,0\] = 0: must be -1 \(full\)"),
    "indices int64": (dict(kv_indices=lambda t: t.long()), r"kv_indices must be int32 with 4 dims, got torch\.int64"),
    "counts int64": (dict(kv_counts=lambda t: t.long()), r"kv_counts must be int32 with 3 dims, got torch\.int64"),
    "mask ids float": (dict(kv_mask_ids=lambda t: t.float()), r"kv_mask_ids must be int32"),
    "counts 2-D": (dict(kv_counts=lambda t: t[0].clone()),
                   r"kv_counts must be int32 with 3 dims, got torch\.int32 \(1, 7\)"),
    "too few rows": (dict(kv_counts=lambda t: t[:, :, :5].clone()),
                     r"kv_counts has 5 query-block rows; q_len=100 with block_q=16 needs 7"),
    "indices rows": (dict(kv_indices=lambda t: t[:, :, :5].clone()),
                     r"kv_indices \(1, 1, 5, 4\) / kv_mask_ids \(1, 1, 7, 4\) do not match kv_counts \(1, 1, 7\)"),
    "mask ids slots": (dict(kv_mask_ids=lambda t: t[..., :2].clone()), r"kv_mask_ids \(1, 1, 7, 2\) do not match"),
    "q_len grown": (dict(q_len=lambda n: 200), r"needs 13"),
    "kv_len shrunk": (dict(kv_len=lambda n: 50),
                      r"kv_indices\[0,0,4,3\] = 4 is out of range: valid key-block indices are 0\.\.3 "
                      r"\(kv_len=50, block_k=16\)"),
    "negative q_len": (dict(q_len=lambda n: -1), r"q_len must be an int >= 0, got int -1"),
    "float kv_len": (dict(kv_len=lambda n: 100.0), r"kv_len must be an int >= 0, got float 100\.0"),  # it ran
    "bad block": (dict(block_k=lambda n: 24), r"block_k must be a multiple of 16 in \[16, 256\], got 24"),
}


def test_base_layout_is_what_corruptions_assume():
    L = _base().validate()
    assert L.kv_counts[0, 0].tolist() == [1, 2, 3, 4, 4, 4, 4] and L.max_k == 4
    assert L.kv_indices[0, 0, 4].tolist() == [1, 2, 3, 4]
    assert L.kv_mask_ids[0, 0, 0, 0].item() == 0


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_validate_catches(name):
    changes, match = CORRUPTIONS[name]
    with pytest.raises(LayoutError, match=match):
        _corrupt(**changes).validate()


def test_validate_ignores_padding_slots():
    """Slots past a row's count are padding: garbage there is not an error."""
    layout = _corrupt(kv_indices=_set((0, 0, 0, 3), 99), kv_mask_ids=_set((0, 0, 0, 3), 42))
    assert layout.validate() is layout


# ----------------------------------------------------------------------------- edge cases found by an adversarial pass
def test_mask_terms_clamp_to_unbounded_and_check_types():
    """Fields beyond +-INF mean "unbounded" and are clamped, so the kernels' int32 ``p + right`` cannot
    wrap (a window_right of 2**31 - 1 once reached the mask table as is)."""
    from sparse_attn.masks import INF
    lay = patterns.local(100, 0, causal=False, window_right=2**31 - 1, block_q=16, block_k=16)
    terms, _ = lay.mask_table()
    assert int(terms.max()) <= INF and int(terms.min()) >= -INF
    p = torch.arange(100)[:, None]
    assert torch.equal(lay.to_token_mask()[0, 0], torch.arange(100)[None, :] >= p)
    with pytest.raises(TypeError, match="MaskTerm.left must be an int, got float"):
        MaskTerm(left=1.5)
    with pytest.raises(TypeError, match="ElementMask terms must be MaskTerm, got int"):
        ElementMask((1,))
    assert ElementMask([causal_term()]).terms == (causal_term(),)  # a list is taken as a tuple
    with pytest.raises(TypeError, match="from_mask takes an ElementMask, got MaskTerm: wrap it"):
        BlockLayout.from_mask(causal_term(), q_len=32)


def test_block_diagonal_intersection_when_one_size_divides_the_other():
    a = patterns.block_diagonal(200, 100, block_q=16, block_k=16)
    b = patterns.block_diagonal(200, 50, block_q=16, block_k=16)
    _check_combined(a, b, union=False)
    assert torch.equal((a & b).to_token_mask(), b.to_token_mask())
    with pytest.raises(NotImplementedError, match="one size must divide the other"):
        a & patterns.block_diagonal(200, 30, block_q=16, block_k=16)


def test_union_marks_blocks_the_or_fills_as_full():
    """causal | (keys at or after the query) allows everything: no block may stay partial (masking work
    for nothing); only blocks partial on both sides are re-checked."""
    L = 64
    u = patterns.causal(L, block_q=16, block_k=16) | patterns.local(L, 0, causal=False, window_right=L, block_q=16,
                                                                     block_k=16)
    assert bool(u.to_token_mask().all())
    assert int((u.kv_mask_ids[u.kv_indices >= 0] >= 0).sum()) == 0 and not u.masks


def test_from_block_mask_mask_needs_partial_and_partial_is_checked():
    bm = torch.ones(3, 3, dtype=torch.bool)
    mask = ElementMask((causal_term(),))
    with pytest.raises(LayoutError, match="an element mask was given but no partial= blocks"):
        BlockLayout.from_block_mask(bm, block_q=16, block_k=16, mask=mask)
    with pytest.raises(LayoutError, match="partial must be a bool tensor"):
        BlockLayout.from_block_mask(bm, block_q=16, block_k=16, mask=mask, partial=bm.long())
    with pytest.raises(LayoutError, match=r"partial has shape \(1, 1, 2, 2\), block_mask \(1, 1, 3, 3\)"):
        BlockLayout.from_block_mask(bm, block_q=16, block_k=16, mask=mask, partial=torch.ones(2, 2, dtype=torch.bool))


def test_validate_and_expand_errors_are_clear():
    lay = patterns.causal(40, block_q=16, block_k=16)
    hand = BlockLayout(lay.block_q, lay.block_k, lay.q_len, lay.kv_len, lay.kv_counts, lay.kv_indices, lay.kv_mask_ids,
                       ("causal",))
    with pytest.raises(LayoutError, match="masks must be a tuple of ElementMask"):
        hand.validate()
    two_heads = patterns.random(40, density=0.5, heads=2, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match=r"batch 1, heads 2 expands only where it has 1: got expand\(2, 3\)"):
        two_heads.expand(2, 3)
    assert two_heads.expand(2, 2).batch == 2


def test_builders_take_numpy_integers():
    np = pytest.importorskip("numpy")
    a = patterns.local(np.int64(100), np.int64(5), block_q=16, block_k=16)
    assert torch.equal(a.to_token_mask(), patterns.local(100, 5, block_q=16, block_k=16).to_token_mask())
    with pytest.raises(TypeError, match="window must be an int, got bool"):
        patterns.local(100, True)


def test_csr_of_a_layout_without_query_blocks():
    crow, col = patterns.to_csr(patterns.dense(0, 10, block_q=16, block_k=16))
    assert crow.tolist() == [[[0]]] and crow.dtype == torch.int32 and col.shape == (1, 1, 0)


def test_pattern_expression_rejects_unknown_options():
    from sparse_attn.patterns.expr import build_pattern
    with pytest.raises(ValueError, match=r"unknown pattern option\(s\) \['windw'\]"):
        build_pattern("local", 1000, windw=100)
    assert build_pattern("local", 1000, window=100, density=None).num_blocks > 0


@pytest.mark.parametrize("expr", ["local|", "|local", "local||random", "local & "])
def test_pattern_expression_with_an_empty_name_says_so(expr):
    """It reported "unknown pattern ''", which names no mistake the caller can see."""
    from sparse_attn.patterns.expr import build_pattern
    with pytest.raises(ValueError, match="has an empty name"):
        build_pattern(expr, 1000)


def test_expand_refuses_a_batch_it_does_not_broadcast():
    """expand() materialises only dims of size 1: a batch-2 layout cannot become batch 3 (nor heads 2 -> 3)."""
    lay = patterns.random(64, density=0.5, batch=2, heads=2, block_q=16, block_k=16)
    assert lay.expand(2, 2).kv_counts.shape[:2] == (2, 2)
    with pytest.raises(LayoutError, match="expands only where it has 1"):
        lay.expand(3, 2)
    with pytest.raises(LayoutError, match="expands only where it has 1"):
        lay.expand(2, 3)


def test_mask_term_refuses_a_negative_document_size():
    """doc=0 means no documents; any negative size (-1 included) is an error, not a term whose
    p // doc blocks run backwards."""
    from sparse_attn.masks import MaskTerm
    assert MaskTerm(doc=0).doc == 0
    for bad in (-1, -16):
        with pytest.raises(ValueError, match="doc must be >= 0"):
            MaskTerm(doc=bad)
