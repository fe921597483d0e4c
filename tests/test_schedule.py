"""The kernels' visiting order (ops/block_sparse/schedule.py) against an independent per-row recomputation.

Pure torch, no kernels run: every row's schedule must be a permutation of the row's listed blocks with
the blocks needing no mask (mask id -1 and not the key block cut by the sequence end) first, each group
ascending, mask ids travelling with their blocks, and ``contiguous`` true iff every row's unmasked
blocks form one run.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_attn import patterns, varlen
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term
from sparse_attn.ops.block_sparse.schedule import schedule


# ----------------------------------------------------------------------------- independent expectation
def _expected(layout: BlockLayout, kv_lens=None, bound_tail: bool = True) -> dict:
    """Per (b, h, qb) row, with plain Python lists: (unmasked blocks, their mask ids, masked blocks, theirs)."""
    rows = {}
    lens = [layout.kv_len] * layout.batch if kv_lens is None else [int(x) for x in kv_lens]
    for b in range(layout.batch):
        n_tok = lens[b]
        tail = math.ceil(n_tok / layout.block_k) - 1 if n_tok % layout.block_k else None
        for h in range(layout.heads):
            for qb in range(layout.kv_counts.shape[2]):
                cnt = int(layout.kv_counts[b, h, qb])
                blocks = layout.kv_indices[b, h, qb, :cnt].tolist()
                mids = layout.kv_mask_ids[b, h, qb, :cnt].tolist()
                free = [(kb, m) for kb, m in zip(blocks, mids) if m == -1 and not (bound_tail and kb == tail)]
                bound = [(kb, m) for kb, m in zip(blocks, mids) if (kb, m) not in free]
                rows[b, h, qb] = (sorted(free), sorted(bound))
    return rows


def _expected_contiguous(rows: dict) -> bool:
    for free, _ in rows.values():
        kbs = [kb for kb, _ in free]
        if kbs and kbs != list(range(kbs[0], kbs[0] + len(kbs))):
            return False
    return True


def check_schedule(layout: BlockLayout, kv_lens=None, bound_tail: bool = True):
    s = schedule(layout, kv_lens, bound_tail=bound_tail)
    rows = _expected(layout, kv_lens, bound_tail)
    Bl, Hl, Qb = layout.kv_counts.shape
    assert s.n_full.shape == (Bl, Hl, Qb) and s.full_start.shape == (Bl, Hl, Qb)
    assert s.indices.shape == layout.kv_indices.shape and s.mask_ids.shape == layout.kv_mask_ids.shape
    assert s.n_full.dtype == s.full_start.dtype == s.indices.dtype == s.mask_ids.dtype == torch.int32
    for (b, h, qb), (free, bound) in rows.items():
        cnt = int(layout.kv_counts[b, h, qb])
        got_idx = s.indices[b, h, qb, :cnt].tolist()
        got_mid = s.mask_ids[b, h, qb, :cnt].tolist()
        # same multiset as the layout's row
        assert sorted(got_idx) == layout.kv_indices[b, h, qb, :cnt].tolist(), (b, h, qb)
        # unmasked first, then masked, each ascending, mask ids following their blocks
        assert list(zip(got_idx, got_mid)) == free + bound, (b, h, qb, got_idx, got_mid, free, bound)
        assert int(s.n_full[b, h, qb]) == len(free), (b, h, qb)
        if free:
            assert int(s.full_start[b, h, qb]) == free[0][0], (b, h, qb)
    assert s.contiguous is _expected_contiguous(rows)
    return s


# ----------------------------------------------------------------------------- layouts
def _layouts():
    p = patterns
    # (id, builder): builders are lambdas so each test builds a fresh layout (fresh cache)
    cases = [
        ("dense-17", lambda: p.dense(17, block_q=16, block_k=16)),
        ("dense-1", lambda: p.dense(1, block_q=16, block_k=16)),
        ("dense-100x37-bq64-bk16", lambda: p.dense(100, 37, block_q=64, block_k=16)),
        ("dense-1000-bk256", lambda: p.dense(1000, block_q=128, block_k=256)),
        ("causal-1", lambda: p.causal(1, block_q=16, block_k=16)),
        ("causal-17", lambda: p.causal(17, block_q=16, block_k=16)),
        ("causal-100-bq32-bk16", lambda: p.causal(100, block_q=32, block_k=16)),
        ("causal-100x250-bq16-bk48", lambda: p.causal(100, 250, block_q=16, block_k=48)),
        ("causal-250x100", lambda: p.causal(250, 100, block_q=32, block_k=32)),   # leading rows empty
        ("causal-1000-bq256-bk64", lambda: p.causal(1000, block_q=256, block_k=64)),
        ("local-1000-w100", lambda: p.local(1000, 100, block_q=64, block_k=32)),
        ("local-2sided-100x130", lambda: p.local(100, 20, kv_len=130, causal=False, window_right=7,
                                                  block_q=16, block_k=16)),
        ("streaming-1000", lambda: p.streaming(1000, 120, 5, block_q=64, block_k=64)),
        ("streaming-noncausal-100", lambda: p.streaming(100, 10, 3, causal=False, block_q=16, block_k=32)),
        ("block_diag-100-d30", lambda: p.block_diagonal(100, 30, block_q=16, block_k=16)),
        ("block_diag-causal-1000x900", lambda: p.block_diagonal(1000, 128, kv_len=900, causal=True,
                                                                block_q=128, block_k=64)),
        ("random-heads-100", lambda: p.random(100, density=0.3, heads=3, block_q=16, block_k=16)),
        ("random-batch-heads-causal", lambda: p.random(1000, density=0.3, batch=2, heads=2, causal=True,
                                                       block_q=64, block_k=32, seed=5)),
        ("random-topk-17x1000", lambda: p.random(17, top_k=3, kv_len=1000, heads=2, block_q=16, block_k=128)),
        ("bigbird-1000", lambda: p.bigbird(1000, heads=2, block_q=64, block_k=64)),
        ("bigbird-100x230", lambda: p.bigbird(100, kv_len=230, block_q=32, block_k=16, seed=3)),
        ("local|streaming", lambda: p.local(300, 40, block_q=32, block_k=32)
         | p.streaming(300, 10, 20, block_q=32, block_k=32)),
        ("random&causal", lambda: p.random(300, density=0.5, heads=2, block_q=16, block_k=16)
         & p.causal(300, block_q=16, block_k=16)),
        ("block_diag|bigbird", lambda: p.block_diagonal(257, 50, block_q=32, block_k=16)
         | p.bigbird(257, heads=2, block_q=32, block_k=16)),
        ("local&block_diag-odd", lambda: p.local(301, 64, kv_len=333, block_q=16, block_k=32)
         & p.block_diagonal(301, 77, kv_len=333, block_q=16, block_k=32)),
    ]
    return [pytest.param(f, id=name) for name, f in cases]


@pytest.mark.parametrize("build", _layouts())
@pytest.mark.parametrize("bound_tail", [True, False])
def test_schedule_matches_independent_reordering(build, bound_tail):
    check_schedule(build(), bound_tail=bound_tail)


@pytest.mark.parametrize("build", _layouts())
def test_transposed_schedule(build):
    # the backward pass schedules the transpose without the tail bound
    layout = build()
    check_schedule(layout.transpose(), bound_tail=False)


def test_schedule_of_empty_rows_and_empty_layouts():
    for layout in (patterns.dense(0, 17, block_q=16, block_k=16), patterns.dense(17, 0, block_q=16, block_k=16),
                   BlockLayout.from_mask(ElementMask(()), q_len=40, block_q=16, block_k=16)):
        s = check_schedule(layout)
        assert s.contiguous and int(s.n_full.sum()) == 0


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 5), nk=st.integers(1, 7), bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 48]),
       heads=st.integers(1, 2), seed=st.integers(0, 2**16), q_cut=st.integers(0, 15), k_cut=st.integers(0, 47))
def test_schedule_random_block_masks(nq, nk, bq, bk, heads, seed, q_cut, k_cut):
    g = torch.Generator().manual_seed(seed)
    bm = torch.rand(1, heads, nq, nk, generator=g) < 0.6
    part = torch.rand(1, heads, nq, nk, generator=g) < 0.4
    q_len = max(1, nq * bq - q_cut % bq)
    kv_len = max(1, nk * bk - k_cut % bk)
    layout = BlockLayout.from_block_mask(bm, block_q=bq, block_k=bk, q_len=q_len, kv_len=kv_len,
                                         partial=part, mask=ElementMask((causal_term(),)))
    check_schedule(layout)
    check_schedule(layout, bound_tail=False)


# ----------------------------------------------------------------------------- the tail block
def test_tail_block_goes_last_only_when_cut():
    cut = patterns.dense(20, 40, block_q=16, block_k=16)   # 40 = 2*16 + 8: block 2 is cut
    s = check_schedule(cut)
    assert s.n_full.tolist() == [[[2, 2]]]
    assert s.indices[0, 0, :, :3].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert s.mask_ids[0, 0, :, :3].tolist() == [[-1, -1, -1], [-1, -1, -1]]   # the bound is not a mask id
    whole = patterns.dense(20, 48, block_q=16, block_k=16)
    assert check_schedule(whole).n_full.tolist() == [[[3, 3]]]
    # without the bound the cut block stays in the unmasked group
    assert check_schedule(cut, bound_tail=False).n_full.tolist() == [[[3, 3]]]


def test_tail_block_in_the_middle_of_the_order():
    # causal 97x100, bq=16: the last query block is the single row at p = 99, so key blocks 0, 1, 2 are full
    # in the layout; block 2 is cut (100 = 2*48 + 4) and must still go last
    layout = patterns.causal(97, 100, block_q=16, block_k=48)
    s = check_schedule(layout)
    last = layout.num_q_blocks - 1
    assert layout.kv_mask_ids[0, 0, last, :3].tolist() == [-1, -1, -1]
    assert int(s.n_full[0, 0, last]) == 2 and s.indices[0, 0, last, :3].tolist() == [0, 1, 2]


def _stacked_dense(q_lens, k_lens, block=16):
    per_seq = [patterns.dense(lq, lk, block_q=block, block_k=block) for lq, lk in zip(q_lens, k_lens)]
    return varlen.stack(per_seq, max(q_lens), max(k_lens), 1)


def test_kv_lens_choose_the_tail_per_batch_row():
    q_lens, k_lens = [20, 20, 20], [33, 48, 20]
    stacked = _stacked_dense(q_lens, k_lens)
    assert stacked.kv_len == 48                     # a whole number of blocks: no tail by default
    default = check_schedule(stacked)
    assert default.n_full[:, 0, 0].tolist() == [3, 3, 2]
    kv_lens = torch.tensor(k_lens)
    s = check_schedule(stacked, kv_lens)
    # seq 0: 33 = 2*16 + 1 -> block 2 bound; seq 1: 48 -> none; seq 2: 20 = 16 + 4 -> block 1 bound
    assert s.n_full[:, 0, 0].tolist() == [2, 3, 1]
    assert s.indices[0, 0, 0, :3].tolist() == [0, 1, 2] and s.indices[2, 0, 0, :2].tolist() == [0, 1]
    assert s.contiguous


def test_bounding_the_tail_changes_contiguity():
    # blocks 0 (full), 1 (partial), 2 (full in the layout, but cut: 40 = 2*16 + 8)
    bm = torch.tensor([[[[True, True, True]]]])
    part = torch.tensor([[[[False, True, False]]]])
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=16, kv_len=40, partial=part,
                                         mask=ElementMask((causal_term(),)))
    assert layout.kv_mask_ids[0, 0, 0].tolist() == [-1, 0, -1]
    s = check_schedule(layout)
    assert s.indices[0, 0, 0].tolist() == [0, 1, 2] and s.mask_ids[0, 0, 0].tolist() == [-1, 0, -1]
    assert int(s.n_full[0, 0, 0]) == 1 and s.contiguous
    loose = check_schedule(layout, bound_tail=False)        # unmasked 0 and 2: not one run
    assert loose.indices[0, 0, 0].tolist() == [0, 2, 1] and loose.mask_ids[0, 0, 0].tolist() == [-1, -1, 0]
    assert int(loose.n_full[0, 0, 0]) == 2 and not loose.contiguous
    # varlen: the same layout stacked as a 48-key sequence has no tail, so block 2 is unmasked
    whole = check_schedule(layout, torch.tensor([48]))
    assert int(whole.n_full[0, 0, 0]) == 2 and not whole.contiguous


# ----------------------------------------------------------------------------- contiguity
@pytest.mark.parametrize("build", [
    lambda: patterns.dense(1000, 777, block_q=64, block_k=32),
    lambda: patterns.causal(1000, block_q=64, block_k=32),
    lambda: patterns.causal(333, 1000, block_q=16, block_k=48),
    lambda: patterns.local(1000, 200, block_q=32, block_k=64),
    lambda: patterns.local(1000, 50, kv_len=1200, causal=False, block_q=16, block_k=16),
    lambda: patterns.block_diagonal(1000, 100, block_q=32, block_k=32),
], ids=["dense", "causal", "causal-lq<lk", "local", "local-2sided", "block_diag"])
def test_run_patterns_are_contiguous(build):
    assert check_schedule(build()).contiguous


def test_random_per_head_layout_is_not_contiguous():
    layout = patterns.random(1000, density=0.3, heads=4, block_q=32, block_k=32, seed=0)
    assert not check_schedule(layout).contiguous
    # "usually": most seeds give at least one row with a gap
    runs = [schedule(patterns.random(200, density=0.3, heads=2, block_q=16, block_k=16, seed=s)).contiguous
            for s in range(8)]
    assert sum(runs) <= 2, runs
    # streaming: whole sink blocks plus a far window are two runs
    assert not check_schedule(patterns.streaming(1000, 200, 64, block_q=32, block_k=32)).contiguous


# ----------------------------------------------------------------------------- caching
def test_schedule_is_cached_on_the_layout():
    layout = _stacked_dense([20, 20], [33, 48])
    s = schedule(layout)
    assert ("schedule", True, None) in layout._derived
    assert schedule(layout) is s
    no_bound = schedule(layout, bound_tail=False)
    assert no_bound is not s and ("schedule", False, None) in layout._derived
    a = schedule(layout, torch.tensor([33, 48]))
    assert a is not s and schedule(layout, torch.tensor([33, 48])) is a
    assert a.n_full[:, 0, 0].tolist() == [2, 3] and s.n_full[:, 0, 0].tolist() == [3, 3]
    b = schedule(layout, torch.tensor([48, 40]))             # different lengths: recomputed, not the cached one
    assert b is not a and b.n_full[:, 0, 0].tolist() == [3, 2]
    assert a.n_full[:, 0, 0].tolist() == [2, 3]              # the first entry is untouched
    # a fresh layout with the same content has its own cache
    assert schedule(_stacked_dense([20, 20], [33, 48])) is not s
