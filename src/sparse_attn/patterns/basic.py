"""Dense and causal layouts (token-exact, any lengths).

Both are built from block entries with the closed-form causal cut of ``layout_from_entries``
(O(Qb * Kb) entries, nothing per token), not via ``BlockLayout.from_mask``, whose per-token block
classification costs O(blocks * block_q) and dominates at long lengths for these dense-ish patterns.
"""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from ._common import diagonal_block, grid, lengths, layout_from_entries, ranges_to_entries


def _rows(seq_len, kv_len, block_q, block_k, device, causal: bool) -> BlockLayout:
    q_len, kv_len = lengths(seq_len, kv_len)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    qb = torch.arange(nq, device=device)
    hi = torch.full_like(qb, nk - 1)
    if causal:
        hi = torch.clamp(diagonal_block(qb, q_len, kv_len, block_q, block_k), max=nk - 1)
    q_e, k_e = ranges_to_entries(qb, torch.zeros_like(qb), hi)
    zeros = torch.zeros_like(q_e)
    layout = layout_from_entries(zeros, zeros, q_e, k_e, batch=1, heads=1, q_len=q_len, kv_len=kv_len,
                                 block_q=block_q, block_k=block_k, causal=causal)
    return mark_causal(layout) if causal else layout


def dense(seq_len: int, kv_len: int | None = None, *, block_q: int = 128, block_k: int = 128,
          device=None) -> BlockLayout:
    """Every query sees every key: all ``ceil(Lq/block_q) x ceil(Lk/block_k)`` blocks, all full.

    Args:
        seq_len: query length ``Lq``; kv_len: key length ``Lk`` (default ``Lq``).
    Returns: a BlockLayout with batch = heads = 1 (broadcast).
    """
    return _rows(seq_len, kv_len, block_q, block_k, device, causal=False)


def causal(seq_len: int, kv_len: int | None = None, *, block_q: int = 128, block_k: int = 128,
           device=None) -> BlockLayout:
    """Causal, bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``.

    Blocks wholly at or below the diagonal are full, blocks crossing it are partial (causal
    element mask ``MaskTerm(right=0)``), blocks wholly above it are not listed. When ``Lq > Lk``
    the first ``Lq - Lk`` query rows see no key (their output is 0).
    """
    return _rows(seq_len, kv_len, block_q, block_k, device, causal=True)


_CUT = "causal_cut"  # key in BlockLayout._derived: the layout already equals its causal cut


def causal_cut(layout: BlockLayout) -> BlockLayout:
    """``layout`` restricted to causal (bottom-right aligned), token-exact: ``layout & causal(...)``
    with the layout's own lengths, blocks and device. What ``attention(..., causal=True)`` runs.
    A layout marked by :func:`mark_causal` is returned as it is."""
    layout.check_token_frame("causal_cut")
    if layout._caches().get(_CUT):
        return layout
    return mark_causal(layout & _causal_over(layout))


def _causal_over(layout: BlockLayout) -> BlockLayout:
    """The causal layout restricted to ``layout``'s own blocks (same batch/heads, lengths, blocks).

    An intersection keeps only blocks present on both sides, so ``layout & _causal_over(layout)``
    equals ``layout & causal(...)``, block for block and mask for mask; but it costs O(layout's
    blocks) where ``causal(...)`` lists Qb * Kb / 2 of them (8.4M at 256K tokens in 64-blocks, and
    over 12 GiB of host memory for the intersection at 1M).
    """
    coo = layout._to_coo()
    return layout_from_entries(coo.b, coo.h, coo.qb, coo.kb, batch=layout.batch, heads=layout.heads,
                               q_len=layout.q_len, kv_len=layout.kv_len, block_q=layout.block_q,
                               block_k=layout.block_k, causal=True)


def causal_block_count(q_len: int, kv_len: int | None = None, *, block_q: int = 128, block_k: int = 128) -> int:
    """``causal(q_len, kv_len, ...).num_blocks`` without building the layout: per query block, the key blocks
    from 0 through its diagonal block (clipped to the grid), summed in closed form on Python ints (O(log) steps:
    the transformers integration counts every sequence of every call, a decoding step's included)."""
    q_len, kv_len = lengths(q_len, kv_len)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    if nq == 0 or nk == 0:
        return 0
    # query block qb < nq - 1 ends at p = (qb + 1) * block_q - 1 + (kv_len - q_len), its diagonal key block
    # p // block_k; the last one ends at kv_len - 1 (bottom-right), so it visits every key block
    return _clipped_floor_sum(nq - 1, block_q, block_q - 1 + kv_len - q_len, block_k, nk) + nk


def _clipped_floor_sum(n: int, a: int, b: int, m: int, cap: int) -> int:
    """``sum(min(max((a * i + b) // m + 1, 0), cap) for i in range(n))`` for ``a, m > 0`` in O(log) steps: the
    terms grow with ``i``, so they are 0 (``a * i + b < 0``), then ``floor + 1``, then ``cap`` on three runs of
    ``i``."""
    if n <= 0:
        return 0
    lo = min(n, -(b // a)) if b < 0 else 0  # the first i with a * i + b >= 0
    need = (cap - 1) * m - b  # the first i whose term is cap: a * i + b >= (cap - 1) * m
    hi = min(n, max(lo, -(-need // a)))
    return _floor_sum(hi - lo, m, a, a * lo + b) + (hi - lo) + (n - hi) * cap


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum((a * i + b) // m for i in range(n))`` for ``n >= 0``, ``m > 0``, ``a, b >= 0`` (the Euclid-like
    reduction)."""
    total = 0
    while n > 0:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y = a * n + b
        if y < m:
            break
        n, b, m, a = y // m, y % m, a, m
    return total


def mark_causal(layout: BlockLayout) -> BlockLayout:
    """Record that ``layout`` already equals its causal cut (a builder that cut it token-exactly
    itself, e.g. ``predict.meansim(causal=True)``), so :func:`causal_cut` skips the intersection.
    The mark lives on this object only (copies, ``to``, ``expand`` do not carry it). Returns the layout."""
    layout._caches()[_CUT] = True
    return layout
