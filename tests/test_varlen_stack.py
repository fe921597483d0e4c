"""varlen.stack_dense_or_causal: the dense / causal varlen plan built at once (api._varlen_plan on CUDA
with neither layouts= nor pattern=) must be the per-sequence path's stacked layout, block for block,
with the same forward schedule. Plain tensor code: checked on the CPU against the slow path."""
from __future__ import annotations

import random

import pytest
import torch

from sparse_attn import varlen
from sparse_attn.ops.block_sparse.schedule import schedule


def _in_count(t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``t`` [.., max_k] with the slots past each row's count set to -1 (they are padding)."""
    return torch.where(torch.arange(t.shape[-1]) < counts[..., None], t, -1)


def _lengths(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """Decoding rows, prefill chunks, empty sequences, key lengths on and off block edges."""
    q = [rng.choice([0, 1, 1, 2, rng.randint(0, 300)]) for _ in range(n)]
    k = [rng.choice([0, 1, rng.randint(0, 300), 16 * rng.randint(0, 20)]) for _ in range(n)]
    return q, k


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("site", ["arithmetic", "host-grid", "device-grid"])
def test_one_shot_stack_equals_the_per_sequence_stack(monkeypatch, seed, causal, site):
    """Plans of few rows are computed row by row in closed form (ARITHMETIC_PLAN_ROWS), small ones on the
    host's tensor grid and copied at once, large ones with the device's tensor ops (HOST_PLAN_ENTRIES;
    all on the CPU here): each way the per-sequence path's blocks."""
    monkeypatch.setattr(varlen, "ARITHMETIC_PLAN_ROWS", 1 << 30 if site == "arithmetic" else 0)
    monkeypatch.setattr(varlen, "HOST_PLAN_ENTRIES", 0 if site == "device-grid" else 1 << 30)
    rng = random.Random(seed * 2 + causal)
    for _ in range(25):
        q_lens, k_lens = _lengths(rng, rng.randint(1, 6))
        block = rng.choice([16, 32, 128])
        max_q, max_k = max(q_lens) + rng.randint(0, 3), max(k_lens) + rng.randint(0, 3)  # bounds may be loose
        per_seq = varlen.build_layouts(q_lens, k_lens, None, None, causal, block=block, heads=4)
        slow = varlen.stack(per_seq, max_q, max_k, 4)
        fast = varlen.stack_dense_or_causal(q_lens, k_lens, causal, max_q, max_k, "cpu", block)
        case = f"q_lens={q_lens} k_lens={k_lens} block={block}"
        assert (fast.batch, fast.heads, fast.q_len, fast.kv_len, fast.max_k) == \
               (slow.batch, slow.heads, slow.q_len, slow.kv_len, slow.max_k), case
        assert torch.equal(fast.kv_counts, slow.kv_counts), case
        assert torch.equal(_in_count(fast.kv_indices, fast.kv_counts), _in_count(slow.kv_indices, slow.kv_counts)), case
        partial = lambda lay: _in_count(lay.kv_mask_ids, lay.kv_counts) >= 0  # noqa: E731
        assert torch.equal(partial(fast), partial(slow)), case
        assert set(fast.masks) == set(slow.masks) or not partial(slow).any(), case  # the causal term, if any
        a, b = schedule(fast, k_lens), schedule(slow, k_lens)  # a: seeded, b: reordered from the layout
        assert a.contiguous and b.contiguous, case
        assert torch.equal(a.counts, b.counts) and torch.equal(a.n_full, b.n_full), case
        assert torch.equal(_in_count(a.indices, a.counts), _in_count(b.indices, b.counts)), case
        assert torch.equal(_in_count(a.mask_ids, a.counts) >= 0, _in_count(b.mask_ids, b.counts) >= 0), case
        assert torch.equal(torch.where(a.n_full > 0, a.full_start, 0), torch.where(b.n_full > 0, b.full_start, 0))


def test_one_shot_stack_is_a_schedule_for_its_own_key_lengths_only():
    """The seeded schedule belongs to the key lengths it was built for; other lengths rebuild theirs."""
    fast = varlen.stack_dense_or_causal([1, 1], [300, 40], True, 1, 300, "cpu", 32)
    seeded = schedule(fast, [300, 40])
    assert schedule(fast, (300, 40)) is seeded
    other = schedule(fast, [300, 64])  # 64: no cut last block for the second sequence
    assert other is not seeded and int(other.n_full[1].sum()) == int(seeded.n_full[1].sum()) + 1


@pytest.mark.parametrize("causal", [False, True])
def test_row_arithmetic_equals_the_grid_on_every_small_shape(causal):
    """The closed form of each row against the tensor grid on every (q_len, kv_len) up to a few blocks
    of 16: block edges, Lq > Lk, a query block's last position on a key block's edge."""
    block = 16
    shapes = [(lq, lk) for lq in range(0, 41) for lk in range(0, 61)]
    q_lens, k_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    n_q, max_count = -(-40 // block), -(-60 // block)
    rows, slots = varlen._rows_by_arithmetic(q_lens, k_lens, causal, n_q, max_count, block)
    want_rows, want_slots = varlen._rows_by_grid(q_lens, k_lens, causal, n_q, max_count, block, "cpu")
    differ = (rows != want_rows).any(0).any(-1) | (slots != want_slots).any(0).flatten(1).any(-1)  # per shape
    assert not differ.any(), [shapes[i] for i in differ.nonzero().flatten().tolist()][:5]
