"""Shared plumbing for the pattern builders: argument checks, the diagonal anchor, and packing
block-level entries into a BlockLayout (with the token-exact causal cut when asked).

Positions are in the key frame, as everywhere in the package: query row ``i`` sits at
``p = i + kv_len - q_len`` (bottom-right alignment).
"""
from __future__ import annotations

import math
import numbers

import torch

from ..layout import BlockLayout, _Coo, as_int, check_block_size
from ..masks import ElementMask, causal_term

CAUSAL = ElementMask((causal_term(),))


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError/TypeError naming it."""
    v = as_int(value)  # numpy / torch integer scalars too
    if v is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def lengths(seq_len: int, kv_len: int | None) -> tuple[int, int]:
    """(q_len, kv_len) with ``kv_len`` defaulting to ``seq_len``; both ints >= 0."""
    q_len = check_int("seq_len", seq_len, 0)
    return q_len, check_int("kv_len", q_len if kv_len is None else kv_len, 0)


def grid(q_len: int, kv_len: int, block_q: int, block_k: int) -> tuple[int, int]:
    """Number of query blocks and key blocks (block sizes checked)."""
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    return math.ceil(q_len / block_q), math.ceil(kv_len / block_k)


def row_positions(qb: torch.Tensor, q_len: int, kv_len: int, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-frame positions (p_first, p_last) of the first and last real row of query blocks ``qb``."""
    offset = kv_len - q_len
    p_first = qb * block_q + offset
    p_last = torch.clamp((qb + 1) * block_q, max=q_len) - 1 + offset
    return p_first, p_last


def own_key_blocks(qb: torch.Tensor, q_len: int, kv_len: int, block_q: int, block_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) key blocks of each query block holding its real rows' own key positions
    ``p = i + Lk - Lq >= 0`` (bottom-right causal: the last key a row may see). ``last`` is the diagonal
    block (:func:`diagonal_block`); ``first`` equals it when ``Lk - Lq`` is a multiple of ``block_k``
    and ``block_k`` of ``block_q``, and is earlier when the rows straddle a key-block edge (a KV cache's
    offset, ``block_q > block_k``): forcing the diagonal block alone left those earlier rows without
    their own key. An empty range (``first > last``) where no row has ``p >= 0``."""
    p_first, p_last = row_positions(qb, q_len, kv_len, block_q)
    return (torch.div(p_first.clamp(min=0), block_k, rounding_mode="floor"),
            torch.div(p_last, block_k, rounding_mode="floor"))


def diagonal_block(qb: torch.Tensor, q_len: int, kv_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """The *diagonal* key block of each query block: the one holding its last row's position.

    ``floor(p_last / block_k)`` with ``p_last = min((qb+1)*block_q, q_len) - 1 + kv_len - q_len``;
    negative when the whole query block lies before key 0 (possible only when q_len > kv_len).
    For ``Lq == Lk`` and ``block_q == block_k`` this is ``qb``.
    """
    _, p_last = row_positions(qb, q_len, kv_len, block_q)
    return torch.div(p_last, block_k, rounding_mode="floor")


def layout_from_entries(b: torch.Tensor, h: torch.Tensor, qb: torch.Tensor, kb: torch.Tensor, *,
                        batch: int, heads: int, q_len: int, kv_len: int, block_q: int, block_k: int,
                        causal: bool) -> BlockLayout:
    """Pack block entries (int64 [N] each, duplicates and out-of-grid key blocks allowed) into a layout.

    Without ``causal`` every kept block is full. With ``causal`` the result equals the same
    layout intersected (``&``) with the token-exact causal layout, computed per entry in O(N):
    a block is dropped when its first key lies after its last row's position, full when its
    last real key is at or before its first row's position, otherwise partial with the causal
    mask (``j <= p``).
    """
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    ok = (kb >= 0) & (kb < nk) & (qb >= 0) & (qb < nq)
    key = ((b[ok] * heads + h[ok]) * max(nq, 1) + qb[ok]) * max(nk, 1) + kb[ok]
    key = torch.unique(key)
    kb_u = key % max(nk, 1)
    row = key // max(nk, 1)
    qb_u = row % max(nq, 1)
    bh = row // max(nq, 1)
    b_u, h_u = bh // heads, bh % heads
    mask_id = torch.full_like(key, -1)
    masks: tuple[ElementMask, ...] = ()
    if causal:
        p_first, p_last = row_positions(qb_u, q_len, kv_len, block_q)
        k_first = kb_u * block_k
        k_last = torch.clamp((kb_u + 1) * block_k, max=kv_len) - 1
        keep = k_first <= p_last
        partial = k_last > p_first
        b_u, h_u, qb_u, kb_u = b_u[keep], h_u[keep], qb_u[keep], kb_u[keep]
        mask_id = torch.where(partial[keep], 0, -1)
        if bool(partial[keep].any()):
            masks = (CAUSAL,)
    coo = _Coo(b_u, h_u, qb_u, kb_u, mask_id)
    return BlockLayout._from_coo(coo, batch=batch, heads=heads, block_q=block_q, block_k=block_k,
                                 q_len=q_len, kv_len=kv_len, masks=masks)


def ranges_to_entries(qb: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand per-row inclusive key-block ranges ``[lo, hi]`` (empty when lo > hi) into (qb, kb) entries."""
    width = torch.clamp(hi - lo + 1, min=0)
    rows = torch.repeat_interleave(qb, width)
    first = torch.repeat_interleave(lo, width)
    pos = torch.arange(rows.numel(), device=qb.device) - torch.repeat_interleave(torch.cumsum(width, 0) - width, width)
    return rows, first + pos


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: samples are the same on every device."""
    seed = check_int("seed", seed, 0)
    if seed >= 1 << 64:
        raise ValueError(f"seed must be < 2**64 (a torch.Generator seed), got {seed}")
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def check_fraction(name: str, value) -> float:
    """``value`` as a float in (0, 1], or a TypeError/ValueError naming it (a string or a bool is not a
    fraction: ``density=True`` read as 1.0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in (0, 1], got {type(value).__name__} {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return float(value)


SAMPLE_CHUNK = 1 << 22  # scores drawn per chunk of rows in sample_blocks (16 MiB of fp32)


def sample_blocks(eligible, k_row: torch.Tensor, gen: torch.Generator,
                  forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, ``k_row[r]`` key blocks drawn uniformly without replacement from ``eligible[r]``.

    eligible: bool [Qb, Kb] (on the CPU, where ``gen`` lives), or a function ``(r0, r1) -> bool
    [r1 - r0, Kb]`` giving rows r0..r1-1 (so no [Qb, Kb] mask need exist); k_row: int64 [Qb], at most
    the row's eligible count; forced: optional (first, last) int64 [Qb] each, a range of eligible blocks
    each row takes first (empty where first > last; they count toward ``k_row``, which must hold them).
    Returns (qb, kb) int64 entries, row-major.
    Rows are drawn in chunks of about :data:`SAMPLE_CHUNK` scores: the CPU generator fills them in
    the same order as one [Qb, Kb] draw, so the result does not depend on the chunking, and memory
    is O(SAMPLE_CHUNK + entries) instead of O(Qb * Kb) (2.3 GiB at 1M tokens in 64-blocks).
    """
    rows_of = eligible if callable(eligible) else (lambda r0, r1: eligible[r0:r1])
    nq = k_row.numel()
    k_max = int(k_row.max()) if nq else 0
    nk = rows_of(0, 1).shape[1] if nq else 0
    step = max(1, SAMPLE_CHUNK // max(nk, 1))
    q_out, k_out = [], []
    for r0 in range(0, nq, step):
        r1 = min(r0 + step, nq)
        ok = rows_of(r0, r1)
        score = torch.where(ok, torch.rand(ok.shape, generator=gen), -1.0)
        if forced is not None:  # ranked above every drawn score; the draw itself is unchanged
            kb = torch.arange(ok.shape[1])[None, :]
            score = torch.where(ok & (kb >= forced[0][r0:r1, None]) & (kb <= forced[1][r0:r1, None]), 2.0, score)
        picked = torch.topk(score, k_max, dim=1).indices if k_max else torch.zeros(r1 - r0, 0, dtype=torch.long)
        keep = torch.arange(k_max)[None, :] < k_row[r0:r1, None]
        q_out.append((torch.arange(r0, r1)[:, None].expand(r1 - r0, k_max))[keep])
        k_out.append(picked[keep])
    empty = torch.zeros(0, dtype=torch.long)
    return (torch.cat(q_out) if q_out else empty), (torch.cat(k_out) if k_out else empty)
