"""BigBird layout (global + window + random blocks), all blocks full, not causal."""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from . import _common
from ._common import (check_int, generator, grid, lengths, layout_from_entries, ranges_to_entries, row_positions,
                      sample_blocks)


def bigbird(seq_len: int, *, num_global_blocks: int = 1, window_blocks: int = 3, num_random_blocks: int = 2,
            kv_len: int | None = None, heads: int = 1, seed: int = 0, block_q: int = 128, block_k: int = 128,
            device=None) -> BlockLayout:
    """BigBird (ITC) block pattern, bidirectional, every listed block full.

    With ``g = num_global_blocks``, ``w = window_blocks`` and ``d = p_last // block_k`` the
    diagonal key block of query block ``qb`` (``p_last`` = key-frame position ``i + Lk - Lq`` of
    its last real row; ``d = qb`` when ``Lq == Lk`` and ``block_q == block_k``), ``qb`` visits:
        global rows:    every key block, when ``qb < g``;
        global columns: key blocks ``kb < g``;
        window:         ``d - (w - 1) // 2 <= kb <= d + w // 2`` (``w = 3``: ``d-1, d, d+1``);
        random:         ``num_random_blocks`` key blocks drawn uniformly from those not already
                        visited (all of them if fewer remain), for rows ``qb >= g``, different
                        per head, seeded by ``seed`` (CPU generator, same on every device).
    Global blocks count in blocks, so with ``block_q != block_k`` the global rows and columns
    cover different token counts. Returns a BlockLayout with batch 1 and ``heads`` rows.

    Memory: layout rows are padded to the longest, and a global row lists every key block, so with
    ``num_global_blocks >= 1`` the layout holds ``heads * Qb * Kb`` entries however sparse it is
    (1 GiB for 8 heads at 256K tokens in 64-blocks, density 0.002; 1.4 MB with ``num_global_blocks=0``).
    At long lengths use larger blocks (the entries fall with ``block_q * block_k``) or no global rows.
    Building it holds no ``[Qb, Kb]`` mask (the random draw reads a chunk of rows at a time).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    g = check_int("num_global_blocks", num_global_blocks, 0)
    w = check_int("window_blocks", window_blocks, 0)
    r = check_int("num_random_blocks", num_random_blocks, 0)
    check_int("heads", heads, 1)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    qb = torch.arange(nq)
    _, p_last = row_positions(qb, q_len, kv_len, block_q)
    d = torch.div(p_last, block_k, rounding_mode="floor")
    w_lo, w_hi = d - (w - 1) // 2, d + w // 2
    # the fixed blocks as row ranges (duplicates are fine: layout_from_entries drops them), and the
    # random draw's eligible blocks a chunk of rows at a time: no [Qb, Kb] mask (with no global rows
    # the layout is Qb * (w + r) entries, but [Qb, Kb] masks took 2.8 GB at 1M tokens in 64-blocks)
    top = torch.full_like(qb, nk - 1)
    ranges = [(qb, torch.zeros_like(qb), torch.where(qb < g, top, min(g, nk) - 1))]  # global rows / columns
    if w:
        ranges.append((qb, w_lo.clamp(min=0), w_hi.clamp(max=nk - 1)))
    q_fix, k_fix = (torch.cat(x) for x in zip(*(ranges_to_entries(*rg) for rg in ranges)))

    def eligible(r0: int, r1: int) -> torch.Tensor:  # rows r0..r1-1: bool [r1 - r0, Kb], not fixed
        kb = torch.arange(nk)[None, :]
        fixed = (qb[r0:r1, None] < g) | (kb < g)
        if w:
            fixed |= (kb >= w_lo[r0:r1, None]) & (kb <= w_hi[r0:r1, None])
        return ~fixed
    step = max(1, _common.SAMPLE_CHUNK // max(nk, 1))
    n_eligible = [eligible(r0, min(r0 + step, nq)).sum(1) for r0 in range(0, nq, step)]
    k_row = torch.clamp(torch.cat(n_eligible) if n_eligible else torch.zeros(0, dtype=torch.long), max=r)
    gen = generator(seed)
    parts = []
    for h in range(heads):
        q_r, k_r = sample_blocks(eligible, k_row, gen)
        q_e, k_e = torch.cat([q_fix, q_r]), torch.cat([k_fix, k_r])
        parts.append((torch.full_like(q_e, h), q_e, k_e))
    h_e, q_e, k_e = (torch.cat(x).to(device) for x in zip(*parts))
    return layout_from_entries(torch.zeros_like(h_e), h_e, q_e, k_e, batch=1, heads=heads, q_len=q_len,
                               kv_len=kv_len, block_q=block_q, block_k=block_k, causal=False)
