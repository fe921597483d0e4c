"""``patterns.causal_cut`` computed over the layout's own blocks, against the full intersection.

``causal_cut(layout)`` is defined as ``layout & causal(Lq, Lk)``. It now intersects with the causal
layout restricted to the layout's blocks, so it must equal that definition block for block, mask
for mask, on every kind of layout (partial blocks of its own, per-head rows, Lq != Lk both ways),
and must not build the Qb x Kb causal layout.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_attn import BlockLayout, ElementMask, MaskTerm, accuracy
from sparse_attn import patterns as P
from sparse_attn.patterns import basic

from test_patterns import same_layout


BUILDERS = {
    "local_bidir": lambda lq, lk, bq, bk: P.local(lq, 37, lk, causal=False, block_q=bq, block_k=bk),
    "local_right": lambda lq, lk, bq, bk: P.local(lq, 20, lk, causal=False, window_right=9, block_q=bq, block_k=bk),
    "streaming_bidir": lambda lq, lk, bq, bk: P.streaming(lq, 30, 5, lk, causal=False, block_q=bq, block_k=bk),
    "random_heads": lambda lq, lk, bq, bk: P.random(lq, kv_len=lk, density=0.4, heads=3, batch=2, seed=7,
                                                    block_q=bq, block_k=bk),
    "bigbird": lambda lq, lk, bq, bk: P.bigbird(lq, kv_len=lk, heads=2, seed=3, block_q=bq, block_k=bk),
    "dilated": lambda lq, lk, bq, bk: P.dilated(lq, 2, 2, lk, block_q=bq, block_k=bk),
    "documents": lambda lq, lk, bq, bk: P.block_diagonal(lq, max(1, lq // 3), lk, block_q=bq, block_k=bk),
    "dense": lambda lq, lk, bq, bk: P.dense(lq, lk, block_q=bq, block_k=bk),
    "union": lambda lq, lk, bq, bk: (P.local(lq, 11, lk, causal=False, block_q=bq, block_k=bk)
                                     | P.strided(lq, 3, lk, block_q=bq, block_k=bk)),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(BUILDERS)), lq=st.integers(1, 300), lk=st.integers(1, 300),
       bq=st.sampled_from([16, 32, 64]), bk=st.sampled_from([16, 32, 64]))
def test_equals_intersection_with_causal(name, lq, lk, bq, bk):
    layout = BUILDERS[name](lq, lk, bq, bk)
    want = layout & P.causal(lq, lk, block_q=bq, block_k=bk)
    got = P.causal_cut(layout)
    same_layout(got, want)
    # and token by token: the layout's own tokens with j <= i + Lk - Lq
    p = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    assert torch.equal(got.to_token_mask(), layout.to_token_mask() & (j <= p))


def test_random_element_masks():
    # a block mask whose partial blocks carry arbitrary (non-causal) element masks
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lq, lk = (int(x) for x in torch.randint(20, 200, (2,), generator=g))
        nq, nk = -(-lq // 32), -(-lk // 16)
        bm = torch.rand(nq, nk, generator=g) < 0.5
        partial = bm & (torch.rand(nq, nk, generator=g) < 0.5)
        band = ElementMask((MaskTerm(left=int(torch.randint(0, 40, (), generator=g)),
                                     right=int(torch.randint(-5, 40, (), generator=g))),))
        layout = BlockLayout.from_block_mask(bm, block_q=32, block_k=16, q_len=lq, kv_len=lk, partial=partial,
                                             mask=band)
        same_layout(P.causal_cut(layout), layout & P.causal(lq, lk, block_q=32, block_k=16))


def test_does_not_build_the_causal_layout(monkeypatch):
    layout = P.local(4096, 300, causal=False, block_q=64, block_k=64)
    want = layout & P.causal(4096, block_q=64, block_k=64)

    def refuse(*args, **kwargs):
        raise AssertionError("causal_cut built the Qb x Kb causal layout")

    monkeypatch.setattr(basic, "causal", refuse)
    same_layout(P.causal_cut(layout), want)
    assert accuracy.baseline_blocks(layout, causal=True) == P.causal_block_count(4096, block_q=64, block_k=64)


def test_long_band_is_cheap():
    # 1M tokens in 64-blocks: the causal layout would list 134M blocks; the band cut lists ~1M
    layout = P.local(1 << 20, 4096, causal=False, block_q=64, block_k=64)
    cut = P.causal_cut(layout)
    assert cut.num_blocks == P.local(1 << 20, 4096, block_q=64, block_k=64).num_blocks
    assert cut.kv_indices.numel() <= layout.kv_indices.numel()


@pytest.mark.parametrize("lq,lk,bq,bk", [(1, 1, 16, 16), (100, 37, 32, 16), (37, 100, 16, 64), (256, 256, 64, 64),
                                         (1000, 999, 128, 64), (513, 2049, 64, 128), (3000, 17, 16, 16)])
def test_causal_block_count(lq, lk, bq, bk):
    assert P.causal_block_count(lq, lk, block_q=bq, block_k=bk) == P.causal(lq, lk, block_q=bq, block_k=bk).num_blocks


def test_causal_block_count_random_shapes():
    """The closed form against the layout it counts on random shapes: Lq above and below Lk (rows before key 0),
    lengths that blocks do not divide, block_q unlike block_k, empty grids."""
    g = random.Random(7)
    for _ in range(150):
        lq, lk = g.choice([0, 1, g.randint(1, 700)]), g.choice([0, 1, g.randint(1, 700)])
        bq, bk = g.choice([16, 32, 64, 128]), g.choice([16, 32, 64, 128])
        want = P.causal(lq, lk, block_q=bq, block_k=bk).num_blocks if lq and lk else 0
        assert P.causal_block_count(lq, lk, block_q=bq, block_k=bk) == want, (lq, lk, bq, bk)


def test_clipped_floor_sum_matches_its_definition():
    """The sum of floors under the count, against its docstring's sum, on terms that start negative, reach the cap
    or do neither."""
    from sparse_attn.patterns.basic import _clipped_floor_sum
    g = random.Random(3)
    for _ in range(3000):
        n, a, b, m, cap = g.randint(0, 60), g.randint(1, 50), g.randint(-900, 900), g.randint(1, 50), g.randint(1, 40)
        want = sum(min(max((a * i + b) // m + 1, 0), cap) for i in range(n))
        assert _clipped_floor_sum(n, a, b, m, cap) == want, (n, a, b, m, cap)


def test_local_block_count():
    """The closed forms (used for the device plan's stats) against the layouts they stand for, on random shapes:
    windows of one key to longer than the keys, sinks of one key to more than the keys, Lq above and below Lk,
    odd block shapes."""
    import random
    rnd = random.Random(0)
    for _ in range(300):
        lq, lk = rnd.choice([0, 1, 2, 5, 127, 128, 129, 300, 700]), rnd.choice([0, 1, 3, 127, 128, 129, 400, 1000])
        window, bq, bk = rnd.choice([1, 2, 50, 127, 128, 129, 300, 2000]), rnd.choice([16, 64, 128]), rnd.choice(
            [16, 32, 128, 256])
        want = P.local(lq, window, kv_len=lk, block_q=bq, block_k=bk).num_blocks
        assert P.local_block_count(lq, window, lk, block_q=bq, block_k=bk) == want, (lq, lk, window, bq, bk)
        sinks = rnd.choice([1, 15, 16, 17, 127, 128, 129, 500, 3000])
        want = P.streaming(lq, window, sinks, kv_len=lk, block_q=bq, block_k=bk).num_blocks
        got = P.streaming_block_count(lq, window, sinks, lk, block_q=bq, block_k=bk)
        assert got == want, (lq, lk, window, sinks, bq, bk)
