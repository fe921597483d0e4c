"""Strided (Sparse Transformer "fixed") and dilated layouts, at block granularity.

Both are defined on key-block indices relative to a query block's *diagonal*: with
``p_first``/``p_last`` the key-frame positions (``p = i + Lk - Lq``) of the block's first and
last real row, ``d_lo = p_first // block_k`` and ``d = p_last // block_k`` (floor division).
For ``Lq == Lk`` and ``block_q == block_k``, ``d_lo = d = qb``. Listed blocks are full; with
``causal=True`` the layout is cut to the token-exact causal pattern (``j <= p``): blocks above
the diagonal are dropped and diagonal blocks carry the causal element mask.
"""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from ..validation import check_flag
from ._common import check_int, grid, lengths, layout_from_entries, ranges_to_entries, row_positions


def _diagonals(nq: int, q_len: int, kv_len: int, block_q: int, block_k: int, device):
    qb = torch.arange(nq, device=device)
    p_first, p_last = row_positions(qb, q_len, kv_len, block_q)
    return qb, torch.div(p_first, block_k, rounding_mode="floor"), torch.div(p_last, block_k, rounding_mode="floor")


def strided(seq_len: int, stride: int, kv_len: int | None = None, *, local_blocks: int = 1, causal: bool = False,
            block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Sparse Transformer "fixed" pattern on blocks: a local band plus periodic summary blocks.

    Query block ``qb`` visits key block ``kb`` iff (with ``d_lo``, ``d`` as in the module docstring)
        local:   ``d_lo - (local_blocks - 1) <= kb <= d``                       (causal=True)
                 ``d_lo - (local_blocks - 1) <= kb <= d + (local_blocks - 1)``  (causal=False)
        summary: ``kb % stride == stride - 1`` (the last block of every group of ``stride``
                 key blocks; all of them when not causal, those ``<= d`` when causal).
    then, with ``causal``, tokens are cut to ``j <= p``. ``stride >= 1`` (1 = every block),
    ``local_blocks >= 1``. Cost O(Qb * (local_blocks + Kb / stride)).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("stride", stride, 1)
    check_int("local_blocks", local_blocks, 1)
    check_flag("causal", causal)  # "False" is truthy: it ran causal
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    qb, d_lo, d = _diagonals(nq, q_len, kv_len, block_q, block_k, device)
    hi = d if causal else d + local_blocks - 1
    q_loc, k_loc = ranges_to_entries(qb, torch.clamp(d_lo - local_blocks + 1, min=0), torch.clamp(hi, max=nk - 1))
    summary = torch.arange(stride - 1, max(nk, stride - 1), stride, device=device)
    q_sum, k_sum = qb.repeat_interleave(summary.numel()), summary.repeat(nq)
    if causal:
        keep = k_sum <= d.repeat_interleave(summary.numel())
        q_sum, k_sum = q_sum[keep], k_sum[keep]
    q_all, k_all = torch.cat([q_loc, q_sum]), torch.cat([k_loc, k_sum])
    zeros = torch.zeros_like(q_all)
    return layout_from_entries(zeros, zeros, q_all, k_all, batch=1, heads=1, q_len=q_len, kv_len=kv_len,
                               block_q=block_q, block_k=block_k, causal=causal)


def dilated(seq_len: int, window_blocks: int, dilation: int, kv_len: int | None = None, *, causal: bool = False,
            exponential: bool = False, block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Dilated block window: key blocks at growing offsets from the diagonal.

    Query block ``qb`` visits key blocks ``d - o_r`` for ``r = 0 .. window_blocks - 1`` and, when
    not causal, also ``d + o_r`` (``d`` as in the module docstring; blocks outside ``[0, Kb)`` are
    skipped), with offsets ``o_r = r * dilation`` (every ``dilation``-th block), or with
    ``exponential`` ``o_0 = 0`` and ``o_r = dilation * 2**(r - 1)`` (0, 1, 2, 4, 8, ... for
    ``dilation = 1``: exponentially growing strides, fine near the diagonal and coarse far away).
    With ``causal`` tokens are then cut to ``j <= p``. ``dilation = 1`` without ``exponential`` is
    a block-granular sliding window. Note that only the block holding the query block's *last* row
    is the anchor: when ``block_q > block_k`` earlier rows of the query block may see no key at
    ``r = 0``.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("window_blocks", window_blocks, 1)
    check_int("dilation", dilation, 1)
    check_flag("causal", causal)
    check_flag("exponential", exponential)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    qb, _, d = _diagonals(nq, q_len, kv_len, block_q, block_k, device)
    # the largest offset that can still land in [0, Kb): d may be negative (Lq > Lk), so d + o reaches
    # the grid for offsets up to Kb - 1 - min(d), not only Kb - 1
    reach = max(int(d.max()), nk - 1 - int(d.min())) if d.numel() else 0
    steps = _dilated_offsets(window_blocks, dilation, exponential, reach, device)
    if not causal:
        steps = torch.cat([-steps, steps[1:]])
    kb = (d[:, None] - steps[None, :]).reshape(-1)
    q_all = qb.repeat_interleave(steps.numel())
    zeros = torch.zeros_like(q_all)
    return layout_from_entries(zeros, zeros, q_all, kb, batch=1, heads=1, q_len=q_len, kv_len=kv_len,
                               block_q=block_q, block_k=block_k, causal=causal)


def _dilated_offsets(window_blocks: int, dilation: int, exponential: bool, reach: int, device) -> torch.Tensor:
    """int64 [n]: the offsets o_r of :func:`dilated`, ascending. Exponential offsets stop after the
    first one beyond ``reach``, the largest offset that can land in the key grid (later ones would only
    be skipped), which also keeps 2**r finite; linear ones likewise (window_blocks=300000 on a
    256-block grid took 4.3 GB)."""
    if not exponential:
        return torch.arange(min(window_blocks, reach // dilation + 2), device=device) * dilation
    offsets = [0]
    for r in range(1, window_blocks):
        offsets.append(dilation * 2 ** (r - 1))
        if offsets[-1] > reach:
            break
    return torch.tensor(offsets, dtype=torch.long, device=device)
