"""Random block-sparse layout: per (batch, head, query block) seeded random key blocks."""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from ..validation import check_flag
from ._common import (check_fraction, check_int, generator, grid, lengths, layout_from_entries, own_key_blocks,
                      sample_blocks)


def random(seq_len: int, *, density: float | None = None, top_k: int | None = None, kv_len: int | None = None,
           batch: int = 1, heads: int = 1, seed: int = 0, causal: bool = False, include_diagonal: bool = True,
           block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Uniformly random key blocks per query-block row, different for every (batch, head).

    Candidates of query block ``qb``: every key block when not causal; with ``causal`` the
    blocks ``kb <= d`` where ``d = p_last // block_k`` is the diagonal block (``p_last`` the
    key-frame position ``i + Lk - Lq`` of the block's last real row), i.e. those holding at
    least one key the block may see. Each row keeps ``k`` of its ``n`` candidates:
    ``k = min(top_k, n)`` or ``k = ceil(density * n)`` (exactly one of ``top_k >= 1`` and
    ``0 < density <= 1``). With ``include_diagonal`` the blocks holding the rows' own key positions
    ``p >= 0`` are always among the ``k``: the diagonal block ``clamp(d, 0, Kb-1)`` alone when ``Lk - Lq``
    is a multiple of ``block_k`` and ``block_k`` of ``block_q``; where the rows straddle a key-block
    edge (an offset KV cache, ``block_q > block_k``) the earlier one too, and such a row may keep one
    more than ``k`` (with the diagonal block alone its first rows had no key). Chosen blocks are full;
    with ``causal`` tokens are then cut to ``j <= p`` (diagonal blocks partial, causal mask).

    Sampling uses a CPU ``torch.Generator`` seeded with ``seed``, so the layout is the same on
    every device. Returns a BlockLayout with ``batch`` x ``heads`` rows
    (``kv_indices [batch, heads, Qb, max_k]``). Sampling draws scores a chunk of rows at a time
    (``_common.sample_blocks``): memory O(entries), not O(Qb * Kb).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("batch", batch, 1)
    check_int("heads", heads, 1)
    check_flag("causal", causal)  # "no" is truthy: it ran causal
    check_flag("include_diagonal", include_diagonal)
    if (density is None) == (top_k is None):
        raise ValueError(f"pass exactly one of density= (fraction of key blocks per row) and top_k= "
                         f"(key blocks per row); got density={density}, top_k={top_k}")
    if top_k is not None:
        check_int("top_k", top_k, 1)
    else:
        density = check_fraction("density", density)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    qb = torch.arange(nq)
    first, d = own_key_blocks(qb, q_len, kv_len, block_q, block_k)
    n_cand = torch.clamp(d + 1, 0, nk) if causal else torch.full((nq,), nk)
    if top_k is not None:
        k_row = torch.clamp(n_cand, max=top_k)
    else:  # the epsilon keeps e.g. 0.3 * 10 from rounding up to 4; a row with candidates keeps one at least
        k_row = torch.ceil(n_cand.double() * float(density) - 1e-9).long().clamp(min=1).minimum(n_cand)
    def eligible(r0: int, r1: int) -> torch.Tensor:  # rows r0..r1-1: their candidate prefix of key blocks
        return torch.arange(nk)[None, :] < n_cand[r0:r1, None]
    forced = None
    if include_diagonal:  # the blocks of the rows' own keys (not causal: at least the nearest block)
        last = torch.where(n_cand > 0, d if causal else d.clamp(0, max(nk - 1, 0)), -1)
        first = first.minimum(last.clamp(min=0))
        forced = (first, last)
        k_row = torch.maximum(k_row, (last - first + 1).clamp(min=0))
    gen = generator(seed)
    parts = []
    for b in range(batch):
        for h in range(heads):
            q_e, k_e = sample_blocks(eligible, k_row, gen, forced)
            parts.append((torch.full_like(q_e, b), torch.full_like(q_e, h), q_e, k_e))
    b_e, h_e, q_e, k_e = (torch.cat(x).to(device) for x in zip(*parts))
    return layout_from_entries(b_e, h_e, q_e, k_e, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len,
                               block_q=block_q, block_k=block_k, causal=causal)
