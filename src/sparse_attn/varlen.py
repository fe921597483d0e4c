"""Variable-length (packed) attention: validation, per-sequence layouts, the reference path.

Packed tensors are ``[total_tokens, H, D]``; sequence b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]``.
Each sequence gets its own layout, built for its own lengths (so causal and window masks stay
bottom-right aligned per sequence); the kernels see them stacked along the batch dimension.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import patterns
from .layout import BlockLayout, LayoutError, _Coo

PatternFn = Callable[[int, int], BlockLayout]


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, device) -> list[int]:
    """Return the per-sequence lengths after checking ``cu`` (int32 [B + 1], 0 .. total, non-decreasing)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D int32 tensor [num_seqs + 1], got {got}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    vals = cu.tolist()
    if len(vals) < 2 or vals[0] != 0 or vals[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the number of packed tokens ({total}), got "
                         f"{vals[:3]}...{vals[-2:]}")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if min(lens) < 0:
        i = min(range(len(lens)), key=lens.__getitem__)
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={vals[i]} > {name}[{i + 1}]={vals[i + 1]}")
    if max(lens) > max_seqlen:
        raise ValueError(f"max_seqlen for {name} is {max_seqlen} but a sequence has {max(lens)} tokens")
    return lens


def build_layouts(q_lens: Sequence[int], k_lens: Sequence[int], layouts: Sequence[BlockLayout] | None,
                  pattern: PatternFn | None, causal: bool, block: int = 128, *,
                  heads: int | None = None) -> list[BlockLayout]:
    """One layout per sequence: given, produced by ``pattern(q_len, kv_len)``, or dense/causal.
    ``heads`` (the query heads) is checked against each layout's heads (1 or heads)."""
    if layouts is not None and pattern is not None:
        raise ValueError("give either layouts= or pattern=, not both")
    if pattern is not None and not callable(pattern):
        # a name ("local") or one BlockLayout is the usual slip: a layout is built per sequence length
        hint = ("pass layouts=[one BlockLayout per sequence]" if isinstance(pattern, BlockLayout) else
                "e.g. pattern=lambda lq, lk: patterns.local(lq, 256, kv_len=lk)")
        raise TypeError(f"pattern must be a function (q_len, kv_len) -> BlockLayout, called once per sequence, "
                        f"got {type(pattern).__name__} {pattern!r:.60}: {hint}")
    if layouts is None:
        if pattern is None:
            builder = patterns.causal if causal else patterns.dense
            pattern = lambda lq, lk: builder(lq, lk, block_q=block, block_k=block)  # noqa: E731
            causal = False
        layouts = [pattern(lq, lk) for lq, lk in zip(q_lens, k_lens)]
    if len(layouts) != len(q_lens):
        raise LayoutError(f"got {len(layouts)} layouts for {len(q_lens)} sequences")
    out = []
    for i, (lay, lq, lk) in enumerate(zip(layouts, q_lens, k_lens)):
        if not isinstance(lay, BlockLayout):
            raise TypeError(f"layout {i} must be a BlockLayout, got {type(lay).__name__}")
        if (lay.q_len, lay.kv_len) != (lq, lk):
            raise LayoutError(f"layout {i} was built for q_len={lay.q_len}, kv_len={lay.kv_len} but sequence {i} "
                              f"has {lq} query and {lk} key tokens")
        if heads is not None and lay.heads not in (1, heads):
            raise LayoutError(f"layout {i} has {lay.heads} heads; q has {heads}: use 1 (broadcast) or {heads} "
                              "(one per query head)")
        if lay.batch != 1:
            raise LayoutError(f"layout {i} has batch {lay.batch}; per-sequence layouts must have batch 1")
        if not lay._validated:
            lay.validate()
            lay._validated = True
        if causal:
            lay = patterns.causal_cut(lay)
        out.append(lay)
    return out


def stack(layouts: Sequence[BlockLayout], max_q: int, max_k: int, heads: int) -> BlockLayout:
    """Per-sequence layouts as one layout with batch = number of sequences (rows past a sequence's
    own length are empty). Masks keep their meaning: the kernels align them per sequence."""
    bq, bk = layouts[0].block_q, layouts[0].block_k
    if any((lay.block_q, lay.block_k) != (bq, bk) for lay in layouts):
        raise LayoutError("all per-sequence layouts must share block_q and block_k")
    hl = max(lay.heads for lay in layouts)
    if any(lay.heads not in (1, hl) for lay in layouts) or hl not in (1, heads):
        raise LayoutError(f"per-sequence layouts must have 1 or {heads} heads")
    parts, masks = [], []
    for b, lay in enumerate(layouts):
        coo = lay._to_coo(1, hl)
        mid = torch.where(coo.mask_id >= 0, coo.mask_id + len(masks), -1)
        parts.append(_Coo(torch.full_like(coo.b, b), coo.h, coo.qb, coo.kb, mid))
        masks.extend(lay.masks)
    device = layouts[0].device
    cat = _Coo(*(torch.cat([getattr(p, f) for p in parts]).to(device) for f in ("b", "h", "qb", "kb", "mask_id")))
    return BlockLayout._from_coo(cat, batch=len(layouts), heads=hl, block_q=bq, block_k=bk,
                                 q_len=max_q, kv_len=max_k, masks=tuple(masks))
