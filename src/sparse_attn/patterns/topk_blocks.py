"""Layout from block scores: keep the top-k key blocks of every query-block row."""
from __future__ import annotations

import math

import torch

from ..layout import BlockLayout, LayoutError
from ..validation import check_flag
from ._common import check_fraction, check_int, grid, lengths, layout_from_entries, own_key_blocks


def topk(scores: torch.Tensor, *, k: int | None = None, ratio: float | None = None, seq_len: int,
         kv_len: int | None = None, block_q: int = 128, block_k: int = 128, causal: bool = False) -> BlockLayout:
    """Keep each row's highest-scoring key blocks.

    Args:
        scores: float ``[B, H, Qb, Kb]`` (B, H of 1 broadcast), higher = more important, no NaN;
            ``Qb = ceil(seq_len / block_q)``, ``Kb = ceil(kv_len / block_k)``.
        k: key blocks kept per row (>= 1); or ratio: keep ``ceil(ratio * Kb)``, ``0 < ratio <= 1``.
            Exactly one of the two.
        causal: rank only the blocks ``kb <= d`` (``d = p_last // block_k``, the block holding the
            key-frame position ``i + Lk - Lq`` of the row's last real query); the blocks holding the
            rows' own positions ``p >= 0`` are always kept and count among the ``k`` (the diagonal
            block alone when ``Lk - Lq`` is a multiple of ``block_k`` and ``block_k`` of
            ``block_q``; where the rows straddle a key-block edge the earlier one too, which may make
            the row keep one more than ``k``), then tokens are cut to ``j <= p``.
    Rows with fewer candidates than ``k`` keep them all. Ties follow ``torch.topk``.
    Returns: a BlockLayout with batch B and heads H; blocks full except causal diagonal blocks.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.dim() != 4:
        got = f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise LayoutError(f"scores must be a float tensor [batch, heads, q_blocks, kv_blocks], got {got}")
    if tuple(scores.shape[2:]) != (nq, nk):
        raise LayoutError(f"scores has {tuple(scores.shape[2:])} (q_blocks, kv_blocks) but seq_len={q_len}, "
                          f"kv_len={kv_len} with blocks {block_q}x{block_k} need ({nq}, {nk})")
    if torch.isnan(scores).any():
        b, h, q, kb = (int(x) for x in torch.isnan(scores).nonzero()[0])
        raise LayoutError(f"scores[{b},{h},{q},{kb}] is NaN: scores must be numbers (use -inf to rank a block last)")
    if (k is None) == (ratio is None):
        raise ValueError(f"pass exactly one of k= and ratio=, got k={k}, ratio={ratio}")
    if k is not None:
        check_int("k", k, 1)
    else:
        ratio = check_fraction("ratio", ratio)  # ratio=True kept every block, "0.5" passed as a string
    check_flag("causal", causal)  # "no" is truthy: it ran causal
    # at least one block a row (as the docstring's ceil says): ratio 1e-11 rounded to none
    k_keep = min(k if k is not None else max(math.ceil(ratio * nk - 1e-9), 1), nk)
    B, H = scores.shape[:2]
    work = torch.float64 if scores.dtype == torch.float64 else torch.float32
    finfo = torch.finfo(work)
    # candidates rank above every non-candidate: clamp them to finite values, non-candidates -inf
    key = scores.to(work).clamp(finfo.min, finfo.max)
    per_row = torch.full((nq,), k_keep, device=scores.device)
    if causal:
        first, d = own_key_blocks(torch.arange(nq, device=scores.device), q_len, kv_len, block_q, block_k)
        kb = torch.arange(nk, device=scores.device)[None, :]
        key = torch.where(kb <= d[:, None], key, float("-inf"))  # [B, H, Qb, Kb]
        # the blocks of the rows' own keys rank first: with the diagonal block alone, the rows before its
        # first key (an offset KV cache, block_q > block_k) had no key at all
        own = (kb >= first[:, None]) & (kb <= d[:, None])
        key = torch.where(own, float("inf"), key)
        per_row = per_row.maximum(own.sum(-1))
    k_top = min(int(per_row.max()), nk) if nq else 0
    if k_top == 0:
        kept = torch.zeros(B, H, nq, 0, dtype=torch.bool, device=scores.device)
        top = torch.zeros(B, H, nq, 0, dtype=torch.long, device=scores.device)
    else:
        val, top = torch.topk(key, k_top, dim=-1)
        kept = (val > float("-inf")) & (torch.arange(k_top, device=scores.device) < per_row[:, None])
    b, h, q, s = kept.nonzero(as_tuple=True)
    return layout_from_entries(b, h, q, top[b, h, q, s], batch=B, heads=H, q_len=q_len, kv_len=kv_len,
                               block_q=block_q, block_k=block_k, causal=causal)
