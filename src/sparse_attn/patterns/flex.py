"""Interop with ``torch.nn.attention.flex_attention.BlockMask`` (FlexAttention).

Flex splits a block mask the same way we do: *full* blocks (``full_kv_num_blocks`` /
``full_kv_indices``, no mask_mod) and *partial* blocks (``kv_num_blocks`` / ``kv_indices``,
mask_mod applied). Its ``BLOCK_SIZE`` is ``(block_q, block_k)`` and ``seq_lengths`` is
``(q_len, kv_len)``; its index tensors are ``[B, H, Qb, Kb]`` (all key blocks, listed ones first).
"""
from __future__ import annotations

import functools
import operator

import torch

from ..layout import BlockLayout, LayoutError, _Coo, check_block_size
from ..masks import INF, ElementMask, MaskTerm


def _flex():
    try:
        from torch.nn.attention import flex_attention
        flex_attention.BlockMask.from_kv_blocks  # noqa: B018 (present since torch 2.5)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"FlexAttention interop needs torch.nn.attention.flex_attention.BlockMask "
                          f"(torch >= 2.5); this torch is {torch.__version__}: upgrade torch to use "
                          f"to_flex/from_flex") from e
    return flex_attention


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., Qb, Kb] -> (counts int32 [..., Qb], indices int32 [..., Qb, Kb]) listed blocks first, ascending."""
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)


def _term_allows(term: MaskTerm, p: torch.Tensor, j: torch.Tensor) -> torch.Tensor | bool:
    """One MaskTerm at (p, j) with its bounds as Python constants; unbounded fields add no compare."""
    conds = []
    if term.q_lo > -INF:
        conds.append(p >= term.q_lo)
    if term.q_hi < INF:
        conds.append(p <= term.q_hi)
    if term.k_lo > -INF:
        conds.append(j >= term.k_lo)
    if term.k_hi < INF:
        conds.append(j <= term.k_hi)
    if term.left < INF:
        conds.append(j >= p - term.left)
    if term.right < INF:
        conds.append(j <= p + term.right)
    if term.doc:
        conds.append(torch.div(p, term.doc, rounding_mode="floor") == torch.div(j, term.doc, rounding_mode="floor"))
    return functools.reduce(operator.and_, conds) if conds else True


def layout_mask_mod(layout: BlockLayout):
    """A flex ``mask_mod(b, h, q_idx, kv_idx) -> bool`` evaluating the layout exactly, vmap-safe.

    Looks the block's state up in a dense int32 table ``[Bl, Hl, Qb, Kb]`` (-2 absent, -1 full,
    m = partial with ``layout.masks[m]``), then evaluates the masks' terms (the rows of
    ``layout.mask_table()``) with their bounds baked in as constants, skipping unbounded ones, so
    the only memory read is the table lookup. A table of term fields gathered per element
    instead made compiled flex kernels run out of shared memory once a mask had two terms.
    Only tensor ops, so it runs eagerly under vmap and compiles.
    """
    block_map = layout._block_map()
    if block_map.numel() == 0:
        block_map = torch.full((1, 1, 1, 1), -2, dtype=torch.int32, device=layout.device)
    nq, nk = max(layout.num_q_blocks, 1), max(layout.num_kv_blocks, 1)
    offset = layout.kv_len - layout.q_len
    bq, bk, q_len, kv_len = layout.block_q, layout.block_k, layout.q_len, layout.kv_len
    per_batch, per_head = block_map.shape[0] > 1, block_map.shape[1] > 1
    masks = layout.masks

    def mask_mod(b, h, q_idx, kv_idx):
        qb = torch.clamp(q_idx // bq, 0, nq - 1)
        kb = torch.clamp(kv_idx // bk, 0, nk - 1)
        bi = b if per_batch else torch.zeros_like(b)
        hi = h if per_head else torch.zeros_like(h)
        mid = block_map[bi, hi, qb, kb]
        p, j = q_idx.long() + offset, kv_idx.long()
        out = mid == -1
        for m, em in enumerate(masks):
            ok = functools.reduce(operator.or_, [_term_allows(t, p, j) for t in em.terms], False)
            out = out | ((mid == m) & ok)
        return out & (q_idx < q_len) & (kv_idx < kv_len)

    return mask_mod


def to_flex(layout: BlockLayout):
    """A FlexAttention ``BlockMask`` with the layout's exact pattern.

    Full blocks become ``full_kv_num_blocks``/``full_kv_indices``, partial blocks
    ``kv_num_blocks``/``kv_indices`` (shapes ``[Bl, Hl, Qb]`` / ``[Bl, Hl, Qb, Kb]``; B/H of 1
    broadcast in flex as here), ``BLOCK_SIZE=(block_q, block_k)``, ``seq_lengths=(q_len, kv_len)``,
    and ``mask_mod`` = :func:`layout_mask_mod` (exact on its own, so flex's eager path, which
    evaluates mask_mod everywhere, agrees too). O(Bl*Hl*Qb*Kb) memory, as flex itself needs.

    Compiled flex needs its kernel tiles to divide ``BLOCK_SIZE``; its default tiles can be 128,
    so for 64-wide blocks pass e.g. ``kernel_options={"BLOCK_M": 64, "BLOCK_N": 64}`` to
    ``flex_attention`` (otherwise: "Q and KV block size must be divisible by BLOCK_M and BLOCK_N").
    """
    layout.check_token_frame("to_flex")
    fa = _flex()
    bmap = layout._block_map()
    partial_n, partial_i = _ordered(bmap >= 0)
    full_n, full_i = _ordered(bmap == -1)
    return fa.BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i, BLOCK_SIZE=(layout.block_q, layout.block_k),
                                       mask_mod=layout_mask_mod(layout), seq_lengths=(layout.q_len, layout.kv_len))


def _rows3(num: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flex row tensors with leading (B, H) dims added when absent: [B, H, Qb], [B, H, Qb, K]."""
    while num.dim() < 3:
        num, idx = num[None], idx[None]
    return num, idx


def _entries(num: torch.Tensor, idx: torch.Tensor, nq: int, nk: int) -> tuple[torch.Tensor, ...]:
    """(b, h, qb, kb) of the listed blocks: slots below the row count, rows < nq, key blocks < nk."""
    num, idx = _rows3(num, idx)
    if num.shape[-1] < nq:  # a q-sliced mask (bm[:, :, 2:]) keeps its seq_lengths: rows 0.. would be misread
        raise LayoutError(f"the BlockMask has {num.shape[-1]} query-block rows, but its seq_lengths need {nq} "
                          "(q_len / BLOCK_SIZE): a mask sliced along the query blocks cannot be read; convert the "
                          "whole mask and slice the layout's rows instead, or rebuild it for the shorter query")
    num, idx = num[..., :nq].long(), idx[..., :nq, :].long()
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    b, h, q, s = valid.nonzero(as_tuple=True)
    kb = idx[b, h, q, s]
    keep = (kb >= 0) & (kb < nk)
    return b[keep], h[keep], q[keep], kb[keep]


def from_flex(block_mask, *, element_mask: ElementMask | None = None) -> BlockLayout:
    """A BlockLayout from a FlexAttention ``BlockMask``.

    Full blocks stay full. Partial blocks run flex's ``mask_mod``, which is code; a BlockLayout
    describes in-block masks as data, so pass ``element_mask`` (an :class:`~sparse_attn.ElementMask`
    equal to the mask_mod on those blocks, positions in the key frame ``p = i + Lk - Lq``).
    Partial blocks the element mask leaves empty are dropped; those it fully allows become full.
    ``BLOCK_SIZE`` must be multiples of 16 in [16, 256]. Returns a layout with the mask's (B, H).
    """
    _flex()
    if element_mask is not None and not isinstance(element_mask, ElementMask):
        raise TypeError(f"element_mask must be a sparse_attn.ElementMask or None, got {type(element_mask).__name__}")
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    try:
        check_block_size("block_q", bq)
        check_block_size("block_k", bk)
    except LayoutError as e:
        raise LayoutError(f"BlockMask has BLOCK_SIZE={(bq, bk)}: {e}; rebuild it with such a BLOCK_SIZE") from None
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    part = _entries(block_mask.kv_num_blocks, block_mask.kv_indices, nq, nk)
    if block_mask.full_kv_num_blocks is not None:
        full = _entries(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nq, nk)
    else:
        full = tuple(torch.zeros(0, dtype=torch.long, device=part[0].device) for _ in range(4))
    n_part = part[0].numel()
    if n_part and element_mask is None:
        raise LayoutError(f"the BlockMask has {n_part} partial blocks, where flex applies its mask_mod; a BlockLayout "
                          "needs that mask as data: pass element_mask=sparse_attn.ElementMask(...) equal to the "
                          "mask_mod (e.g. ElementMask((sparse_attn.masks.causal_term(),)) for bottom-right causal; "
                          "flex's usual 'q_idx >= kv_idx' is top-left aligned: MaskTerm(right=-(Lk - Lq)))")
    batch, heads = _rows3(block_mask.kv_num_blocks, block_mask.kv_indices)[0].shape[:2]
    b, h, q, kb = (torch.cat([f, p]) for f, p in zip(full, part))
    mid = torch.cat([torch.full_like(full[0], -1), torch.zeros_like(part[0])])
    # a block listed both as full and partial is full: keep the first (full) occurrence of each key
    key = ((b * heads + h) * max(nq, 1) + q) * max(nk, 1) + kb
    uniq, inv = torch.unique(key, return_inverse=True)
    first = torch.full_like(uniq, key.numel()).scatter_reduce(0, inv, torch.arange(key.numel(), device=key.device),
                                                              reduce="amin")
    coo = _Coo(b[first], h[first], q[first], kb[first], mid[first])
    masks = (element_mask,) if n_part else ()
    out = BlockLayout._from_coo(coo, batch=batch, heads=heads, block_q=bq, block_k=bk, q_len=q_len, kv_len=kv_len,
                                masks=masks)
    return out._classified()
