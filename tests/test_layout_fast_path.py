"""BlockLayout.from_mask's plain-integer path for few query rows (a decoding step's layout) against the
tensor path: the same entries, mask ids, masks and order on random element masks."""
import random

import pytest
import torch

from sparse_attn import patterns
from sparse_attn.layout import _FEW_ROWS, BlockLayout
from sparse_attn.masks import INF, ElementMask, MaskTerm


def _random_term(rng: random.Random, kv_len: int) -> MaskTerm:
    def bound(lo, hi):
        return rng.choice([-INF, INF, rng.randint(lo, hi)])
    q_lo, q_hi = sorted((bound(-20, kv_len + 20), bound(-20, kv_len + 20)))
    k_lo, k_hi = sorted((bound(-20, kv_len + 20), bound(-20, kv_len + 20)))
    return MaskTerm(q_lo=q_lo, q_hi=q_hi, k_lo=k_lo, k_hi=k_hi,
                    left=rng.choice([INF, rng.randint(0, 300), rng.randint(-5, 5)]),
                    right=rng.choice([INF, 0, rng.randint(0, 300), rng.randint(-5, 5)]),
                    doc=rng.choice([0, 0, rng.randint(1, 200)]))


def _same(fast: BlockLayout, slow: BlockLayout, what: str) -> None:
    assert (fast.q_len, fast.kv_len, fast.block_q, fast.block_k) == (slow.q_len, slow.kv_len, slow.block_q,
                                                                     slow.block_k), what
    for name in ("kv_counts", "kv_indices", "kv_mask_ids"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, name, a, b)
    assert tuple(fast.masks) == tuple(slow.masks), what


def test_few_rows_path_equals_the_tensor_path_on_random_masks():
    rng = random.Random(20261130)
    for case in range(600):
        kv_len = rng.choice([1, 2, 17, 128, 129, 300, rng.randint(1, 700), 5000])
        q_len = rng.randint(1, _FEW_ROWS)
        block_q = rng.choice([16, 32, 64, 128, 256])
        block_k = rng.choice([16, 32, 64, 128, 256])
        mask = ElementMask(tuple(_random_term(rng, kv_len) for _ in range(rng.randint(1, 3))))
        fast = BlockLayout.from_mask(mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k)
        slow = BlockLayout._from_mask_blocks(mask, q_len, kv_len, block_q, block_k, None)
        _same(fast, slow, (case, q_len, kv_len, block_q, block_k, mask))


@pytest.mark.parametrize("q_len", [1, 3, 16])
def test_decoding_layouts_of_the_builders_match(q_len):
    """The builders a decoding step calls, at lengths around block edges, sinks and windows, against the
    tensor path on the same element mask."""
    sinks = MaskTerm(k_lo=0, k_hi=3, right=0)
    for kv_len in (q_len, 127, 128, 129, 1000, 4097):
        built = [
            (patterns.local(q_len, 100, kv_len=kv_len, block_q=64, block_k=32), (MaskTerm(left=99, right=0),)),
            (patterns.local(q_len, 40, kv_len=kv_len, causal=False), (MaskTerm(left=40, right=40),)),
            (patterns.streaming(q_len, 256, 4, kv_len=kv_len), (MaskTerm(left=255, right=0), sinks)),
        ]
        for lay, terms in built:
            slow = BlockLayout._from_mask_blocks(ElementMask(terms), q_len, kv_len, lay.block_q, lay.block_k, None)
            _same(lay, slow, (terms, q_len, kv_len))


def test_a_one_row_window_is_exact():
    """One query row at position 999 with a 100-key window on 32-key blocks: keys 900..999, blocks 28..31;
    block 28 (keys 896..927) partial, the last one (992..999, cut by the sequence's end) full."""
    lay = patterns.local(1, 100, kv_len=1000, block_q=16, block_k=32)
    assert lay.kv_indices.flatten().tolist() == [28, 29, 30, 31]
    assert lay.kv_mask_ids.flatten().tolist() == [0, -1, -1, -1]
    token = lay.to_token_mask().reshape(-1, 1000)[0]
    assert token.sum().item() == 100 and bool(token[900:].all())
