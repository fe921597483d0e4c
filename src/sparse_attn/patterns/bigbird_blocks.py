"""BigBird layout (global + window + random blocks), all blocks full, not causal."""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from ._common import check_int, generator, grid, lengths, layout_from_entries, row_positions, sample_blocks


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
    kb = torch.arange(nk)
    fixed = (qb[:, None] < g) | (kb[None, :] < g)  # [Qb, Kb]
    if w:
        fixed |= (kb[None, :] >= (d - (w - 1) // 2)[:, None]) & (kb[None, :] <= (d + w // 2)[:, None])
    q_fix, k_fix = fixed.nonzero(as_tuple=True)
    eligible = ~fixed
    k_row = torch.clamp(eligible.sum(1), max=r)
    gen = generator(seed)
    parts = []
    for h in range(heads):
        q_r, k_r = sample_blocks(eligible, k_row, gen)
        q_e, k_e = torch.cat([q_fix, q_r]), torch.cat([k_fix, k_r])
        parts.append((torch.full_like(q_e, h), q_e, k_e))
    h_e, q_e, k_e = (torch.cat(x).to(device) for x in zip(*parts))
    return layout_from_entries(torch.zeros_like(h_e), h_e, q_e, k_e, batch=1, heads=heads, q_len=q_len,
                               kv_len=kv_len, block_q=block_q, block_k=block_k, causal=False)
