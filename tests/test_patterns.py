"""Pattern builders against token masks built the obvious way.

The oracles below do not use ``sparse_attn.masks``: each rule is a plain predicate on the query's
key-frame position ``p = i + Lk - Lq`` and the key ``j``, evaluated with Python loops for small
sizes and with numpy broadcasting (same predicate) at L ~ 1000. Block patterns are built with
Python loops over (query block, key block) from their documented definition.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_attn import BlockLayout, ElementMask, LayoutError, MaskTerm
from sparse_attn import patterns as P

SMALL = [(1, 1), (17, 17), (100, 100), (17, 100), (100, 17), (100, 37)]
# (Lq, Lk, block_q, block_k): odd lengths, Lq != Lk both ways, every block shape on some size
SIZE_BLOCKS = [(1, 1, 16, 16), (1, 1, 128, 128), (17, 17, 16, 16), (17, 17, 48, 32), (17, 17, 64, 128),
               (100, 100, 16, 16), (100, 100, 32, 32), (100, 100, 64, 128), (100, 100, 128, 128),
               (100, 100, 48, 32), (17, 100, 16, 16), (17, 100, 64, 128), (100, 17, 16, 16), (100, 17, 32, 32),
               (100, 37, 48, 32), (100, 37, 16, 16), (1000, 1000, 16, 16), (1000, 1000, 64, 128),
               (1000, 1300, 48, 32), (1000, 700, 16, 16), (1000, 700, 128, 128)]
BLOCK_SIZES = [(17, 17, 16, 16), (100, 100, 16, 16), (100, 100, 64, 128), (100, 37, 48, 32), (37, 100, 64, 128),
               (1000, 1000, 16, 16), (1000, 1300, 48, 32)]  # for the block-pattern tests
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- oracles
def token_mask(rule, lq: int, lk: int) -> np.ndarray:
    """bool [lq, lk]: rule(p, j) with p = i + lk - lq. Loops up to 100x100, numpy broadcasting above."""
    off = lk - lq
    if lq * lk <= 100 * 100:
        out = np.zeros((lq, lk), dtype=bool)
        for i in range(lq):
            for j in range(lk):
                out[i, j] = bool(rule(i + off, j))
        return out
    p = np.arange(lq)[:, None] + off
    j = np.arange(lk)[None, :]
    return np.broadcast_to(rule(p, j), (lq, lk)).copy()


def causal_rule(p, j):
    return j <= p


def expand(blocks: np.ndarray, lq: int, lk: int, bq: int, bk: int) -> np.ndarray:
    """Block bool [..., nq, nk] -> token bool [..., lq, lk]."""
    return blocks.repeat(bq, -2).repeat(bk, -1)[..., :lq, :lk]


def row_pos(qb: int, lq: int, lk: int, bq: int) -> tuple[int, int]:
    off = lk - lq
    return qb * bq + off, min((qb + 1) * bq, lq) - 1 + off


def listed_and_full(layout: BlockLayout) -> tuple[np.ndarray, np.ndarray]:
    """From the raw row tensors: bool [Bl, Hl, Qb, Kb] listed, and listed-as-full."""
    counts = layout.kv_counts.numpy()
    idx, mid = layout.kv_indices.numpy(), layout.kv_mask_ids.numpy()
    shape = counts.shape + (layout.num_kv_blocks,)
    listed, full = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    b, h, q, s = np.nonzero(np.arange(layout.max_k) < counts[..., None])
    listed[b, h, q, idx[b, h, q, s]] = True
    full[b, h, q, idx[b, h, q, s]] = mid[b, h, q, s] == -1
    return listed, full


def assert_exact(layout: BlockLayout, want: np.ndarray) -> None:
    """validate(); token mask == want; listed blocks == non-empty blocks of want; full == all-allowed."""
    layout.validate()
    want = np.asarray(want)
    if want.ndim == 2:
        want = want[None, None]
    bl, hl = layout.batch, layout.heads
    want = np.broadcast_to(want, (bl, hl) + want.shape[2:])
    got = layout.to_token_mask().numpy()
    assert got.shape == want.shape
    if not (got == want).all():
        b, h, i, j = (int(x) for x in np.argwhere(got != want)[0])
        pytest.fail(f"token ({b},{h},{i},{j}): layout says {got[b, h, i, j]}, oracle {want[b, h, i, j]}")
    lq, lk, bq, bk = layout.q_len, layout.kv_len, layout.block_q, layout.block_k
    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    pad_any = np.zeros((bl, hl, nq * bq, nk * bk), dtype=bool)
    pad_all = np.ones_like(pad_any)
    pad_any[..., :lq, :lk] = want
    pad_all[..., :lq, :lk] = want
    nonempty = pad_any.reshape(bl, hl, nq, bq, nk, bk).any((3, 5))
    allowed_all = pad_all.reshape(bl, hl, nq, bq, nk, bk).all((3, 5))
    listed, full = listed_and_full(layout)
    assert (listed == nonempty).all(), "listed blocks differ from the oracle's non-empty blocks"
    assert (full == allowed_all).all(), "full marks differ from the oracle's fully-allowed blocks"


def same_layout(a: BlockLayout, b: BlockLayout) -> None:
    assert (a.block_q, a.block_k, a.q_len, a.kv_len) == (b.block_q, b.block_k, b.q_len, b.kv_len)
    assert torch.equal(a.kv_counts, b.kv_counts)
    assert torch.equal(a.kv_indices, b.kv_indices)
    assert torch.equal(a.kv_mask_ids, b.kv_mask_ids)
    assert a.masks == b.masks


# ----------------------------------------------------------------------------- token-exact patterns
TOKEN_PATTERNS = {
    "dense": (lambda lq, lk, **kw: P.dense(lq, lk, **kw), lambda p, j: j >= 0),
    "causal": (lambda lq, lk, **kw: P.causal(lq, lk, **kw), causal_rule),
    "local_w1": (lambda lq, lk, **kw: P.local(lq, 1, lk, **kw), lambda p, j: (p - 1 < j) & (j <= p)),
    "local_w5": (lambda lq, lk, **kw: P.local(lq, 5, lk, **kw), lambda p, j: (p - 5 < j) & (j <= p)),
    "local_w40": (lambda lq, lk, **kw: P.local(lq, 40, lk, **kw), lambda p, j: (p - 40 < j) & (j <= p)),
    "local_2sided_w3": (lambda lq, lk, **kw: P.local(lq, 3, lk, causal=False, **kw),
                        lambda p, j: (p - 3 <= j) & (j <= p + 3)),
    "local_2sided_w0_r7": (lambda lq, lk, **kw: P.local(lq, 0, lk, causal=False, window_right=7, **kw),
                           lambda p, j: (p <= j) & (j <= p + 7)),
    "local_2sided_w20_r2": (lambda lq, lk, **kw: P.local(lq, 20, lk, causal=False, window_right=2, **kw),
                            lambda p, j: (p - 20 <= j) & (j <= p + 2)),
    "streaming_5_3": (lambda lq, lk, **kw: P.streaming(lq, 5, 3, lk, **kw),
                      lambda p, j: ((p - 5 < j) & (j <= p)) | ((j < 3) & (j <= p))),
    "streaming_33_1": (lambda lq, lk, **kw: P.streaming(lq, 33, 1, lk, **kw),
                       lambda p, j: ((p - 33 < j) & (j <= p)) | ((j < 1) & (j <= p))),
    "streaming_1_20": (lambda lq, lk, **kw: P.streaming(lq, 1, 20, lk, **kw),
                       lambda p, j: ((p - 1 < j) & (j <= p)) | ((j < 20) & (j <= p))),
    "streaming_2sided_4_6": (lambda lq, lk, **kw: P.streaming(lq, 4, 6, lk, causal=False, **kw),
                             lambda p, j: ((p - 4 <= j) & (j <= p + 4)) | (j < 6)),
    "blockdiag_1": (lambda lq, lk, **kw: P.block_diagonal(lq, 1, lk, **kw), lambda p, j: p // 1 == j // 1),
    "blockdiag_7": (lambda lq, lk, **kw: P.block_diagonal(lq, 7, lk, **kw), lambda p, j: p // 7 == j // 7),
    "blockdiag_50": (lambda lq, lk, **kw: P.block_diagonal(lq, 50, lk, **kw), lambda p, j: p // 50 == j // 50),
    "blockdiag_16_causal": (lambda lq, lk, **kw: P.block_diagonal(lq, 16, lk, causal=True, **kw),
                            lambda p, j: (p // 16 == j // 16) & (j <= p)),
    "blockdiag_23_causal": (lambda lq, lk, **kw: P.block_diagonal(lq, 23, lk, causal=True, **kw),
                            lambda p, j: (p // 23 == j // 23) & (j <= p)),
}


@pytest.mark.parametrize("name", list(TOKEN_PATTERNS))
@pytest.mark.parametrize("lq,lk,bq,bk", SIZE_BLOCKS)
def test_token_exact_pattern(name, lq, lk, bq, bk):
    build = TOKEN_PATTERNS[name][0]
    layout = build(lq, lk, block_q=bq, block_k=bk)
    assert (layout.batch, layout.heads) == (1, 1)
    assert_exact(layout, _token_oracle(name, lq, lk))


@functools.lru_cache(maxsize=None)
def _token_oracle(name, lq, lk):  # shared by the block shapes of one size (read-only)
    return token_mask(TOKEN_PATTERNS[name][1], lq, lk)


@pytest.mark.parametrize("lq,lk", SMALL + [(300, 1000)])
@pytest.mark.parametrize("bq,bk", [(16, 16), (64, 128), (48, 32)])
def test_dense_and_causal_match_from_mask(lq, lk, bq, bk):
    """dense/causal take a closed-form path; it must equal the general from_mask path exactly."""
    kw = dict(q_len=lq, kv_len=lk, block_q=bq, block_k=bk)
    same_layout(P.causal(lq, lk, block_q=bq, block_k=bk),
                BlockLayout.from_mask(ElementMask((MaskTerm(right=0),)), **kw))
    same_layout(P.dense(lq, lk, block_q=bq, block_k=bk), BlockLayout.from_mask(ElementMask((MaskTerm(),)), **kw))


def _block_range_counts(lq, lk, bq, bk, lo_fn, hi_fn, causal):
    """Expected kv_counts for single-interval rules lo(p) <= j <= hi(p), lo/hi non-decreasing in p:
    per query block, key blocks lo(first row)//bk .. hi(last row)//bk (rows with p < 0 see nothing if causal)."""
    out = []
    for qb in range(math.ceil(lq / bq)):
        pf, pl = row_pos(qb, lq, lk, bq)
        if causal:
            pf = max(pf, 0)
        lo, hi = max(lo_fn(pf), 0), min(hi_fn(pl), lk - 1)
        out.append(hi // bk - lo // bk + 1 if hi >= lo and pl >= pf else 0)
    return out


@pytest.mark.parametrize("lq,lk", [(4097, 4097), (4097, 5000), (5000, 4097)])
def test_long_counts(lq, lk):
    """At L=4097 (no L^2 oracle): per-row block counts of causal / local from interval arithmetic."""
    bq, bk = 64, 128
    lay = P.causal(lq, lk, block_q=bq, block_k=bk).validate()
    assert lay.kv_counts[0, 0].tolist() == _block_range_counts(lq, lk, bq, bk, lambda p: 0, lambda p: p, True)
    lay = P.local(lq, 300, lk, block_q=bq, block_k=bk).validate()
    assert lay.kv_counts[0, 0].tolist() == _block_range_counts(lq, lk, bq, bk, lambda p: p - 299, lambda p: p, True)
    lay = P.local(lq, 300, lk, causal=False, window_right=50, block_q=bq, block_k=bk).validate()
    want = _block_range_counts(lq, lk, bq, bk, lambda p: p - 300, lambda p: p + 50, False)
    assert lay.kv_counts[0, 0].tolist() == want
    lay = P.streaming(lq, 256, 4, lk, block_q=bq, block_k=bk).validate()
    window = _block_range_counts(lq, lk, bq, bk, lambda p: p - 255, lambda p: p, True)
    sink_adds = [int(c > 0 and max(row_pos(q, lq, lk, bq)[0], 0) - 255 >= bk) for q, c in enumerate(window)]
    assert lay.kv_counts[0, 0].tolist() == [c + s for c, s in zip(window, sink_adds)]
    assert P.dense(lq, lk, block_q=bq, block_k=bk).validate().density == 1.0
    assert P.block_diagonal(lq, 1000, lk, block_q=bq, block_k=bk).validate().num_blocks > 0


def test_argument_errors():
    with pytest.raises(ValueError, match="window"):
        P.local(100, 0)
    with pytest.raises(ValueError, match="window_right"):
        P.local(100, 4, window_right=2)
    with pytest.raises(ValueError, match="block_size"):
        P.block_diagonal(100, 0)
    with pytest.raises(LayoutError, match="block_q"):
        P.causal(100, block_q=40)
    with pytest.raises(TypeError, match="seq_len"):
        P.dense(10.0)
    with pytest.raises(ValueError, match="exactly one"):
        P.random(100, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="density"):
        P.random(100, density=1.5, block_q=16, block_k=16)


# ----------------------------------------------------------------------------- strided / dilated
def strided_oracle(lq, lk, bq, bk, stride, local_blocks, causal):
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    blocks = np.zeros((nq, nk), dtype=bool)
    for qb in range(nq):
        pf, pl = row_pos(qb, lq, lk, bq)
        d_lo, d = pf // bk, pl // bk
        hi = d if causal else d + local_blocks - 1
        for kb in range(nk):
            local = d_lo - (local_blocks - 1) <= kb <= hi
            summary = kb % stride == stride - 1 and (not causal or kb <= d)
            blocks[qb, kb] = local or summary
    tok = expand(blocks, lq, lk, bq, bk)
    return tok & token_mask(causal_rule, lq, lk) if causal else tok


def dilated_oracle(lq, lk, bq, bk, window_blocks, dilation, causal, exponential=False):
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    offsets = [(dilation * 2 ** (r - 1) if r else 0) if exponential else r * dilation for r in range(window_blocks)]
    blocks = np.zeros((nq, nk), dtype=bool)
    for qb in range(nq):
        d = row_pos(qb, lq, lk, bq)[1] // bk
        for kb in range(nk):
            blocks[qb, kb] = any(kb == d - o or (not causal and kb == d + o) for o in offsets)
    tok = expand(blocks, lq, lk, bq, bk)
    return tok & token_mask(causal_rule, lq, lk) if causal else tok


@pytest.mark.parametrize("lq,lk,bq,bk", BLOCK_SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stride,local_blocks", [(1, 1), (3, 1), (4, 2)])
def test_strided(lq, lk, bq, bk, causal, stride, local_blocks):
    lay = P.strided(lq, stride, lk, local_blocks=local_blocks, causal=causal, block_q=bq, block_k=bk)
    assert_exact(lay, strided_oracle(lq, lk, bq, bk, stride, local_blocks, causal))
    if causal:  # the closed-form causal cut equals intersecting with the token-exact causal layout
        same_layout(lay, P.strided(lq, stride, lk, local_blocks=local_blocks, block_q=bq, block_k=bk)
                    & P.causal(lq, lk, block_q=bq, block_k=bk))


@pytest.mark.parametrize("lq,lk,bq,bk", BLOCK_SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_blocks,dilation", [(1, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("exponential", [False, True])
def test_dilated(lq, lk, bq, bk, causal, window_blocks, dilation, exponential):
    lay = P.dilated(lq, window_blocks, dilation, lk, causal=causal, exponential=exponential, block_q=bq, block_k=bk)
    assert_exact(lay, dilated_oracle(lq, lk, bq, bk, window_blocks, dilation, causal, exponential))
    if causal:
        same_layout(lay, P.dilated(lq, window_blocks, dilation, lk, exponential=exponential, block_q=bq, block_k=bk)
                    & P.causal(lq, lk, block_q=bq, block_k=bk))


def test_dilated_exponential_offsets_and_huge_windows():
    """Offsets 0, 1, 2, 4, 8 around the diagonal (the seed's exponentially growing strides); a window
    far beyond the grid stops growing instead of overflowing."""
    lay = P.dilated(16 * 64, 5, 1, exponential=True, causal=False, block_q=64, block_k=64)
    row = lay.kv_indices[0, 0, 15, :int(lay.kv_counts[0, 0, 15])].tolist()
    assert row == [7, 11, 13, 14, 15]
    assert lay.kv_indices[0, 0, 0, :int(lay.kv_counts[0, 0, 0])].tolist() == [0, 1, 2, 4, 8]
    big = P.dilated(16 * 64, 200, 1, exponential=True, block_q=64, block_k=64)
    same_layout(big, P.dilated(16 * 64, 6, 1, exponential=True, block_q=64, block_k=64))
    with pytest.raises(TypeError, match="exponential must be True or False"):
        P.dilated(1024, 3, 1, exponential="yes")



@pytest.mark.parametrize("lq,lk,bq,bk", [(64, 16, 16, 16), (1000, 100, 16, 16), (640, 64, 64, 16), (300, 100, 48, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_blocks,dilation", [(3, 1), (6, 2), (9, 1)])
def test_dilated_exponential_when_queries_outnumber_keys(lq, lk, bq, bk, causal, window_blocks, dilation):
    """Lq > Lk puts early query blocks' diagonal before the first key block (d < 0), where d + o still
    reaches the grid for offsets up to Kb - 1 - d: the exponential offsets used to stop at Kb and drop
    those blocks (dilated(64, 3, 1, kv_len=16, exponential=True) missed key block 0 of query block 1)."""
    lay = P.dilated(lq, window_blocks, dilation, lk, causal=causal, exponential=True, block_q=bq, block_k=bk)
    assert_exact(lay, dilated_oracle(lq, lk, bq, bk, window_blocks, dilation, causal, exponential=True))
    if window_blocks == 3 and dilation == 1:  # offsets 0, 1, 2 both ways
        same_layout(lay, P.dilated(lq, 3, 1, lk, causal=causal, block_q=bq, block_k=bk))

# ----------------------------------------------------------------------------- random
@pytest.mark.parametrize("lq,lk,bq,bk", [(17, 17, 16, 16), (100, 100, 64, 128), (1000, 1000, 16, 16),
                                         (100, 300, 48, 32), (300, 100, 16, 16), (300, 100, 48, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [dict(top_k=3), dict(density=0.3), dict(top_k=2, include_diagonal=False)])
def test_random(lq, lk, bq, bk, causal, kw):
    lay = P.random(lq, kv_len=lk, batch=2, heads=3, seed=5, causal=causal, block_q=bq, block_k=bk, **kw)
    assert (lay.batch, lay.heads) == (2, 3)
    listed, _ = listed_and_full(lay)
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    for qb in range(nq):
        p_first, p_last = row_pos(qb, lq, lk, bq)
        d = p_last // bk
        n = min(max(d + 1, 0), nk) if causal else nk
        k = min(kw["top_k"], n) if "top_k" in kw else math.ceil(round(kw["density"] * n, 9))
        own = []  # the blocks of the rows' own keys (not causal: at least the nearest block)
        if kw.get("include_diagonal", True) and n:
            last = d if causal else min(max(d, 0), nk - 1)
            own = list(range(min(max(p_first, 0) // bk, last), last + 1))
            k = max(k, len(own))
        for b in range(2):
            for h in range(3):
                row = listed[b, h, qb]
                assert row.sum() == k, (b, h, qb)
                assert not row[n:].any()  # only candidate blocks
                assert all(row[o] for o in own), (b, h, qb, own)
    want = expand(listed, lq, lk, bq, bk)
    if causal:
        want = want & token_mask(causal_rule, lq, lk)
    assert_exact(lay, want)


def test_random_seeding():
    kw = dict(density=0.2, batch=2, heads=4, block_q=16, block_k=16)
    a, b = P.random(1000, seed=3, **kw), P.random(1000, seed=3, **kw)
    same_layout(a, b)
    assert not torch.equal(a.kv_indices, P.random(1000, seed=4, **kw).kv_indices)
    bm = a.to_block_mask()
    assert not torch.equal(bm[0, 0], bm[0, 1]) and not torch.equal(bm[0, 0], bm[1, 0])
    full = P.random(100, density=1.0, block_q=16, block_k=16)
    assert full.to_token_mask().all()
    same_layout(P.random(100, kv_len=70, top_k=100, causal=True, block_q=16, block_k=32),
                P.causal(100, 70, block_q=16, block_k=32))


# ----------------------------------------------------------------------------- bigbird
def bigbird_fixed(lq, lk, bq, bk, g, w):
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    fixed = np.zeros((nq, nk), dtype=bool)
    for qb in range(nq):
        d = row_pos(qb, lq, lk, bq)[1] // bk
        for kb in range(nk):
            fixed[qb, kb] = qb < g or kb < g or (w > 0 and d - (w - 1) // 2 <= kb <= d + w // 2)
    return fixed


@pytest.mark.parametrize("lq,lk,bq,bk", [(17, 17, 16, 16), (100, 100, 16, 16), (1000, 1000, 64, 128),
                                         (1000, 700, 48, 32), (300, 1000, 16, 16)])
@pytest.mark.parametrize("g,w,r", [(1, 3, 2), (2, 4, 1), (0, 0, 3)])
def test_bigbird(lq, lk, bq, bk, g, w, r):
    lay = P.bigbird(lq, kv_len=lk, num_global_blocks=g, window_blocks=w, num_random_blocks=r, heads=2, seed=1,
                    block_q=bq, block_k=bk)
    listed, full = listed_and_full(lay)
    fixed = bigbird_fixed(lq, lk, bq, bk, g, w)
    assert (listed >= fixed).all()
    extra = listed & ~fixed
    nk = fixed.shape[1]
    for qb in range(fixed.shape[0]):
        want = 0 if qb < g else min(r, nk - int(fixed[qb].sum()))
        assert (extra[0, :, qb].sum(-1) == want).all(), qb
    assert full[listed].all()
    assert_exact(lay, expand(listed, lq, lk, bq, bk))
    # bigbird is the OR of its parts: global rows/columns, window, random blocks
    part = lambda m: P.from_block_mask(torch.from_numpy(np.ascontiguousarray(m)), seq_len=lq, kv_len=lk,
                                       block_q=bq, block_k=bk)
    rows = np.zeros_like(fixed)
    rows[:g] = True
    cols = np.zeros_like(fixed)
    cols[:, :g] = True
    window = fixed & ~rows & ~cols
    union = part(rows[None, None]) | part(cols[None, None]) | part(window[None, None]) | part(extra)
    assert torch.equal(union.to_token_mask(), lay.to_token_mask())


# ----------------------------------------------------------------------------- composition
@pytest.mark.parametrize("lq,lk,bq,bk", [(100, 100, 16, 16), (1000, 1000, 64, 128), (300, 1000, 48, 32)])
def test_composition(lq, lk, bq, bk):
    kw = dict(block_q=bq, block_k=bk)
    loc = P.local(lq, 50, lk, **kw)
    rnd = P.random(lq, kv_len=lk, top_k=2, heads=3, seed=2, **kw)
    both = (loc | rnd).validate()
    assert torch.equal(both.to_token_mask(), loc.to_token_mask() | rnd.to_token_mask())
    want = token_mask(lambda p, j: (p - 50 < j) & (j <= p), lq, lk) | rnd.to_token_mask().numpy()
    assert torch.equal(both.to_token_mask(), torch.from_numpy(want))
    inter = loc & rnd
    assert_exact(inter, loc.to_token_mask().numpy() & rnd.to_token_mask().numpy())
    sinks = BlockLayout.from_mask(ElementMask((MaskTerm(k_lo=0, k_hi=3, right=0),)), q_len=lq, kv_len=lk, **kw)
    assert torch.equal((P.local(lq, 50, lk, **kw) | sinks).to_token_mask(),
                       P.streaming(lq, 50, 4, lk, **kw).to_token_mask())


# ----------------------------------------------------------------------------- topk
@pytest.mark.parametrize("lq,lk,bq,bk", [(17, 17, 16, 16), (100, 100, 16, 32), (1000, 1000, 64, 128),
                                         (300, 100, 48, 32), (100, 300, 16, 16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [dict(k=1), dict(k=3), dict(ratio=0.25)])
def test_topk(lq, lk, bq, bk, causal, kw):
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    scores = torch.randn(2, 3, nq, nk, generator=torch.Generator().manual_seed(0))
    lay = P.topk(scores, seq_len=lq, kv_len=lk, block_q=bq, block_k=bk, causal=causal, **kw)
    k = kw["k"] if "k" in kw else math.ceil(kw["ratio"] * nk)
    listed, _ = listed_and_full(lay)
    expect = np.zeros_like(listed)
    for b in range(2):
        for h in range(3):
            for qb in range(nq):
                p_first, p_last = row_pos(qb, lq, lk, bq)
                d = p_last // bk
                cand = [kb for kb in range(nk) if not causal or kb <= d]
                # the blocks of the rows' own keys (the diagonal block, and an earlier one where the rows
                # straddle a key-block edge) are always kept, one more than k if need be
                forced = list(range(max(p_first, 0) // bk, d + 1)) if causal else []
                rest = sorted((kb for kb in cand if kb not in forced), key=lambda kb: -float(scores[b, h, qb, kb]))
                for kb in (forced + rest)[:max(k, len(forced))]:
                    expect[b, h, qb, kb] = True
    assert (listed == expect).all()
    want = expand(expect, lq, lk, bq, bk)
    assert_exact(lay, want & token_mask(causal_rule, lq, lk) if causal else want)


def test_topk_edge_cases():
    nq, nk = 7, 7
    neg = torch.full((1, 1, nq, nk), float("-inf"))  # candidates still rank above excluded blocks
    lay = P.topk(neg, k=2, seq_len=100, block_q=16, block_k=16, causal=True)
    listed, _ = listed_and_full(lay)
    assert listed.sum(-1).tolist() == [[[1, 2, 2, 2, 2, 2, 2]]]
    assert not np.triu(listed[0, 0], 1).any()
    bad = torch.zeros(1, 1, nq, nk)
    bad[0, 0, 3, 5] = float("nan")
    with pytest.raises(LayoutError, match=r"scores\[0,0,3,5\] is NaN"):
        P.topk(bad, k=1, seq_len=100, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match=r"need \(7, 4\)"):
        P.topk(torch.zeros(1, 1, 7, 7), k=1, seq_len=100, block_q=16, block_k=32)
    with pytest.raises(ValueError, match="exactly one"):
        P.topk(torch.zeros(1, 1, 7, 7), seq_len=100, block_q=16, block_k=16)
    for ratio, exc in ((True, TypeError), ("0.5", TypeError), (0.0, ValueError), (1.5, ValueError)):
        with pytest.raises(exc, match="ratio must be"):  # True kept every block; "0.5" passed as a string
            P.topk(torch.zeros(1, 1, 7, 7), ratio=ratio, seq_len=100, block_q=16, block_k=16)


# ----------------------------------------------------------------------------- block index / CSR
def test_from_block_index_basic():
    bi = torch.tensor([[[[3, -1, 0], [-1, -1, -1], [2, 1, -1]]]])  # unsorted, -1 anywhere
    lay = P.from_block_index(bi, seq_len=40, kv_len=60, block_q=16, block_k=16).validate()
    assert lay.kv_counts.tolist() == [[[2, 0, 2]]]
    assert P.to_block_index(lay).tolist() == [[[[0, 3], [-1, -1], [1, 2]]]]
    assert P.to_block_index(lay).dtype == torch.int32
    want = np.zeros((3, 4), dtype=bool)
    want[0, [0, 3]] = want[2, [1, 2]] = True
    assert_exact(lay, expand(want, 40, 60, 16, 16))


def test_from_block_index_errors():
    bi = torch.full((1, 4, 256, 4), -1, dtype=torch.int32)
    bi[0, 3, 7, 2] = 130
    msg = ("block_index[0,3,7,2] = 130 is out of range: valid key-block indices are 0..127 "
           "(kv_len=16384, block_k=128), or -1 for padding")
    with pytest.raises(LayoutError) as e:
        P.from_block_index(bi, seq_len=16384, block_q=64, block_k=128)
    assert str(e.value) == msg
    bi[0, 3, 7, 2] = -2
    with pytest.raises(LayoutError, match=r"block_index\[0,3,7,2\] = -2 is out of range"):
        P.from_block_index(bi, seq_len=16384, block_q=64, block_k=128)
    bi[0, 3, 7, 2], bi[0, 3, 7, 0] = 5, 5
    with pytest.raises(LayoutError, match=r"block_index\[0,3,7\] lists key block 5 twice \(slots 0 and 2\)"):
        P.from_block_index(bi, seq_len=16384, block_q=64, block_k=128)
    with pytest.raises(LayoutError, match="256 query-block rows .* needs 128"):
        P.from_block_index(torch.full((1, 1, 256, 2), -1), seq_len=16384, block_q=128, block_k=128)
    with pytest.raises(LayoutError, match="4-D"):
        P.from_block_index(torch.zeros(256, 2, dtype=torch.long), seq_len=16384)
    with pytest.raises(LayoutError, match="integer dtype"):
        P.from_block_index(torch.zeros(1, 1, 256, 2), seq_len=16384)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_csr_round_trip_and_errors():
    lay = P.random(300, kv_len=200, top_k=3, batch=2, heads=2, seed=0, block_q=16, block_k=16)
    crow, col = P.to_csr(lay)
    assert crow.shape == (2, 2, lay.num_q_blocks + 1) and crow.dtype == col.dtype == torch.int32
    back = P.from_csr(crow, col, seq_len=300, kv_len=200, block_q=16, block_k=16)
    same_layout(back, lay)
    sp = torch.sparse_csr_tensor(crow[0, 0].long(), col[0, 0, :int(crow[0, 0, -1])].long(),
                                 torch.ones(int(crow[0, 0, -1])), size=(lay.num_q_blocks, lay.num_kv_blocks),
                                 check_invariants=True)
    assert torch.equal(sp.to_dense().bool(), lay.to_block_mask()[0, 0])
    bad = col.clone()
    bad[1, 0, 4] = 99
    with pytest.raises(LayoutError, match=r"col\[1,0,4\] = 99 .* out of range: valid key-block indices are 0..12"):
        P.from_csr(crow, bad, seq_len=300, kv_len=200, block_q=16, block_k=16)
    bad = col.clone()
    bad[0, 0, 1] = bad[0, 0, 0]
    with pytest.raises(LayoutError, match="both list key block"):
        P.from_csr(crow, bad, seq_len=300, kv_len=200, block_q=16, block_k=16)
    bad = crow.clone()
    bad[0, 1, 3] = 0
    with pytest.raises(LayoutError, match=r"crow\[0,1\]"):
        P.from_csr(bad, col, seq_len=300, kv_len=200, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match="crow needs 11"):
        P.from_csr(crow, col, seq_len=300, kv_len=200, block_q=32, block_k=16)


# ----------------------------------------------------------------------------- property tests
@st.composite
def grids(draw):
    bq, bk = draw(st.sampled_from([16, 32, 48])), draw(st.sampled_from([16, 32, 48]))
    nq, nk = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    lq = draw(st.integers((nq - 1) * bq + 1, nq * bq))
    lk = draw(st.integers((nk - 1) * bk + 1, nk * bk))
    return dict(bq=bq, bk=bk, nq=nq, nk=nk, lq=lq, lk=lk, doc=draw(st.integers(1, 40)))


def _block_mask(draw, g, batch=None, heads=None):
    b = batch or draw(st.sampled_from([1, 2]))
    h = heads or draw(st.sampled_from([1, 3]))
    bits = draw(st.lists(st.booleans(), min_size=b * h * g["nq"] * g["nk"], max_size=b * h * g["nq"] * g["nk"]))
    return torch.tensor(bits, dtype=torch.bool).view(b, h, g["nq"], g["nk"])


@st.composite
def layouts(draw, g):
    kw = dict(block_q=g["bq"], block_k=g["bk"])
    lq, lk = g["lq"], g["lk"]
    kind = draw(st.sampled_from(["blocks", "blocks_causal", "causal", "local", "local2", "streaming", "doc"]))
    if kind.startswith("blocks"):
        lay = P.from_block_mask(_block_mask(draw, g), seq_len=lq, kv_len=lk, **kw)
        return lay & P.causal(lq, lk, **kw) if kind == "blocks_causal" else lay
    if kind == "causal":
        return P.causal(lq, lk, **kw)
    w = draw(st.integers(1, 60))
    if kind == "local":
        return P.local(lq, w, lk, **kw)
    if kind == "local2":
        return P.local(lq, w, lk, causal=False, window_right=draw(st.integers(0, 60)), **kw)
    if kind == "streaming":
        return P.streaming(lq, w, draw(st.integers(0, 20)), lk, causal=draw(st.booleans()), **kw)
    return P.block_diagonal(lq, g["doc"], lk, causal=draw(st.booleans()), **kw)


@FAST
@given(data=st.data())
def test_block_index_round_trip(data):
    g = data.draw(grids())
    mask = _block_mask(data.draw, g)
    lay = P.from_block_mask(mask, seq_len=g["lq"], kv_len=g["lk"], block_q=g["bq"], block_k=g["bk"])
    bi = P.to_block_index(lay)
    pad = data.draw(st.integers(0, 3))  # extra -1 slots, then shuffle each row
    bi = torch.cat([bi, torch.full(bi.shape[:3] + (pad,), -1, dtype=bi.dtype)], -1)
    perm = torch.argsort(torch.rand(bi.shape, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))), -1)
    back = P.from_block_index(torch.gather(bi, -1, perm).long(), seq_len=g["lq"], kv_len=g["lk"],
                              block_q=g["bq"], block_k=g["bk"])
    assert torch.equal(back.to_block_mask(), mask)
    same_layout(back, lay)
    crow, col = P.to_csr(back)
    same_layout(P.from_csr(crow, col, seq_len=g["lq"], kv_len=g["lk"], block_q=g["bq"], block_k=g["bk"]), lay)


@FAST
@given(data=st.data())
def test_union_and_intersection_are_or_and_of_token_masks(data):
    g = data.draw(grids())
    a, b = data.draw(layouts(g)), data.draw(layouts(g))
    ta, tb = a.to_token_mask(), b.to_token_mask()
    union = (a | b).validate()
    assert torch.equal(union.to_token_mask(), torch.broadcast_tensors(ta | tb, union.to_token_mask())[0])
    listed, _ = listed_and_full(union)  # no listed block is empty at token level
    tok = union.to_token_mask().numpy()
    pad = np.zeros(tok.shape[:2] + (g["nq"] * g["bq"], g["nk"] * g["bk"]), dtype=bool)
    pad[..., :g["lq"], :g["lk"]] = tok
    nonempty = pad.reshape(tok.shape[:2] + (g["nq"], g["bq"], g["nk"], g["bk"])).any((3, 5))
    assert (listed == nonempty).all()
    assert_exact(a & b, (ta & tb).numpy())


@FAST
@given(data=st.data())
def test_transpose_twice_is_identity(data):
    g = data.draw(grids())
    lay = data.draw(layouts(g))
    t = lay.transpose().validate()
    assert torch.equal(t.to_block_mask(), lay.to_block_mask().transpose(-1, -2))
    fresh = BlockLayout(t.block_q, t.block_k, t.q_len, t.kv_len, t.kv_counts, t.kv_indices, t.kv_mask_ids, t.masks)
    same_layout(fresh.transpose(), lay)


def test_random_sampling_in_row_chunks_is_the_one_draw_and_bounded(monkeypatch):
    """sample_blocks draws a chunk of rows at a time; the CPU generator fills them in the order of one
    [Qb, Kb] draw, so layouts do not change with the chunking (seeded layouts stay the same), and the
    builder no longer holds Qb x Kb scores (2.3 GiB at 1M tokens in 64-blocks)."""
    from sparse_attn.patterns import _common
    kw = dict(density=0.3, heads=3, seed=11, causal=True, block_q=32, block_k=32)
    whole = P.random(2000, **kw)
    monkeypatch.setattr(_common, "SAMPLE_CHUNK", 100)  # a few rows per chunk
    chunked = P.random(2000, **kw)
    assert torch.equal(whole.kv_indices, chunked.kv_indices) and torch.equal(whole.kv_counts, chunked.kv_counts)
    bb = (P.bigbird(2000, heads=2, seed=3, block_q=32, block_k=32).kv_indices,)
    monkeypatch.setattr(_common, "SAMPLE_CHUNK", 1 << 22)
    assert torch.equal(bb[0], P.bigbird(2000, heads=2, seed=3, block_q=32, block_k=32).kv_indices)
    monkeypatch.setattr(_common, "SAMPLE_CHUNK", 1 << 16)
    seen = []
    real_rand = torch.rand

    def spy(*shape, **kw_):
        out = real_rand(*shape, **kw_)
        seen.append(out.numel())
        return out
    monkeypatch.setattr(torch, "rand", spy)
    P.random(64 * 1024, top_k=4, block_q=64, block_k=64)  # Qb = Kb = 1024
    assert seen and max(seen) <= 1 << 16


def test_bigbird_without_global_rows_builds_no_block_grid(monkeypatch):
    """Without global rows a BigBird layout holds Qb * (window + random) entries (the docstring's advice
    at long lengths), but the builder made several [Qb, Kb] masks to find them: 2.8 GB peak at 1M tokens
    in 64-blocks for a 0.7 MiB layout. Now the fixed blocks come from row ranges and the random draw
    reads its eligible rows a chunk at a time; the layout (and its random draws) are unchanged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparse_attn.patterns import _common

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out
    kw = dict(num_global_blocks=0, window_blocks=3, num_random_blocks=2, heads=2, seed=5, block_q=16, block_k=16)
    monkeypatch.setattr(_common, "SAMPLE_CHUNK", 1 << 16)
    with Largest():
        lay = P.bigbird(16 * 1024, **kw)  # Qb = Kb = 1024
    assert Largest.numel <= 1 << 16
    listed, _ = listed_and_full(lay)
    fixed = bigbird_fixed(16 * 1024, 16 * 1024, 16, 16, 0, 3)
    assert (listed >= fixed).all() and ((listed & ~fixed).sum(-1) == 2).all()
    for g, w, r, lq, lk in ((0, 3, 2, 1000, 700), (1, 2, 3, 700, 1000), (2, 0, 1, 500, 500), (0, 5, 40, 300, 200)):
        small = dict(kw, num_global_blocks=g, window_blocks=w, num_random_blocks=r, block_q=32, block_k=16)
        layouts = []
        for chunk in (37, 1 << 22):  # the draws do not depend on the chunking
            monkeypatch.setattr(_common, "SAMPLE_CHUNK", chunk)
            layouts.append(P.bigbird(lq, kv_len=lk, **small))
        a, b = layouts
        assert torch.equal(a.kv_indices, b.kv_indices) and torch.equal(a.kv_counts, b.kv_counts)


def test_random_density_count_is_exact_where_float_products_round_up():
    """k = ceil(density * n) of the row's n candidates: 0.28 * 25 is 7.000000000000001 in floating
    point and must keep 7 key blocks per row, not 8 (likewise 0.14 * 50 -> 7)."""
    for density, n, want in ((0.28, 25, 7), (0.14, 50, 7)):
        lay = P.random(16 * n, density=density, block_q=16, block_k=16, heads=2, seed=3)
        assert torch.all(lay.kv_counts == want), (density, n, lay.kv_counts.unique().tolist())


def test_block_index_refuses_the_first_index_past_the_grid():
    """Key-block indices run 0 .. Kb - 1: Kb itself (one past the last block) is out of range."""
    ok = torch.tensor([[[[0, 1], [2, -1]]]])  # 2 query blocks, Kb = 3 (kv_len 48, block_k 16)
    lay = P.from_block_index(ok, seq_len=32, kv_len=48, block_q=16, block_k=16)
    assert lay.to_block_mask()[0, 0].tolist() == [[True, True, False], [False, False, True]]
    with pytest.raises(LayoutError, match=r"block_index\[0,0,1,0\] = 3 is out of range"):
        P.from_block_index(torch.tensor([[[[0, 1], [3, -1]]]]), seq_len=32, kv_len=48, block_q=16,
                                  block_k=16)


def test_csr_refuses_offsets_that_end_past_col():
    """crow[..., -1] may be at most col.shape[2]: one past it must be a LayoutError, not an IndexError."""
    col = torch.tensor([[[0, 1]]])
    lay = P.from_csr(torch.tensor([[[0, 1, 2]]]), col, seq_len=32, block_q=16, block_k=16)
    assert lay.to_block_mask()[0, 0].tolist() == [[True, False], [False, True]]
    with pytest.raises(LayoutError, match="not a valid offset array"):
        P.from_csr(torch.tensor([[[0, 1, 3]]]), col, seq_len=32, block_q=16, block_k=16)


def test_csr_refuses_decreasing_offsets():
    """crow must never decrease: [0, 2, 1, 2] (a row of -1 blocks) is an error, not a silently skipped row."""
    col = torch.tensor([[[0, 1]]])
    with pytest.raises(LayoutError, match="not a valid offset array"):
        P.from_csr(torch.tensor([[[0, 2, 1, 2]]]), col, seq_len=48, block_q=16, block_k=16)


@pytest.mark.parametrize("build", [
    lambda c: P.local(64, 8, causal=c, block_q=16, block_k=16),
    lambda c: P.streaming(64, 8, 4, causal=c, block_q=16, block_k=16),
    lambda c: P.random(64, density=0.5, causal=c, block_q=16, block_k=16),
    lambda c: P.strided(64, 2, causal=c, block_q=16, block_k=16),
    lambda c: P.dilated(64, 2, 1, causal=c, block_q=16, block_k=16),
    lambda c: P.block_diagonal(64, 16, causal=c, block_q=16, block_k=16),
    lambda c: P.topk(torch.randn(1, 1, 4, 4), k=1, seq_len=64, causal=c, block_q=16, block_k=16),
    lambda c: P.random(64, density=0.5, include_diagonal=c, block_q=16, block_k=16),
])
def test_builders_refuse_flags_that_are_not_bools(build):
    """causal="False" (a config file's string) is truthy: every builder ran it causal."""
    assert isinstance(build(False), BlockLayout)
    with pytest.raises(TypeError, match="must be True or False, got str 'False'"):
        build("False")


def test_a_tiny_fraction_keeps_one_block_a_row():
    """density / ratio 1e-11 rounded every row to no block, against ceil(density * n) >= 1."""
    assert P.random(256, density=1e-11, block_q=16, block_k=16).kv_counts.eq(1).all()
    assert P.random(256, density=1e-11, causal=True, block_q=16, block_k=16).kv_counts.eq(1).all()
    assert P.topk(torch.randn(1, 1, 16, 16), ratio=1e-11, seq_len=256, block_q=16, block_k=16).kv_counts.eq(1).all()


def test_empty_batch_or_heads_are_refused():
    """A [0, ...] block mask, score map or CSR made a layout that '|' then failed on in a broadcast."""
    with pytest.raises(LayoutError, match="batch >= 1 and heads >= 1.*batch=0"):
        P.from_block_mask(torch.ones(0, 1, 2, 2, dtype=torch.bool), block_q=16, block_k=16)
    with pytest.raises(LayoutError, match="heads=0"):
        P.topk(torch.randn(1, 0, 2, 2), k=1, seq_len=32, block_q=16, block_k=16)


def test_linear_dilated_windows_beyond_the_grid_cost_nothing():
    """window_blocks=300000 on a 256-block grid built 300000 offsets per row (4.3 GB)."""
    big = P.dilated(4096, 300_000, 3, block_q=16, block_k=16)
    assert torch.equal(big.to_block_mask(), P.dilated(4096, 256, 3, block_q=16, block_k=16).to_block_mask())


@pytest.mark.parametrize("lq,lk,bq,bk", [(512, 1000, 128, 128), (256, 256, 128, 64), (100, 300, 16, 16),
                                         (300, 100, 48, 32), (97, 97, 32, 16)])
def test_causal_random_and_topk_keep_every_rows_own_key(lq, lk, bq, bk):
    """Under causal every query row that may see a key sees its own (``j = i + Lk - Lq``), also where a query
    block's rows straddle a key-block edge (an offset KV cache, block_q > block_k): forcing the diagonal
    block alone left those rows with no key at all (output 0; 96 of 512 rows at 512 x 1000, k=1)."""
    nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
    scores = torch.randn(1, 2, nq, nk, generator=torch.Generator().manual_seed(3))
    layouts = [P.topk(scores, k=1, seq_len=lq, kv_len=lk, block_q=bq, block_k=bk, causal=True),
               P.random(lq, top_k=1, kv_len=lk, heads=2, seed=1, causal=True, block_q=bq, block_k=bk),
               P.random(lq, density=0.01, kv_len=lk, heads=2, seed=1, causal=True, block_q=bq, block_k=bk)]
    rows = torch.arange(lq)
    p = rows + lk - lq
    for lay in layouts:
        m = lay.to_token_mask()  # [B, H, Lq, Lk]
        assert m[..., rows[p >= 0], p[p >= 0]].all()
        assert lay.kv_counts.max() <= 2  # k = 1, and one more only for rows straddling an edge
