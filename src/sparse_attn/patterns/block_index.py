"""Top-k block indices ``block_index [B, H, Qb, K]`` (-1 padded) and dense block masks <-> BlockLayout."""
from __future__ import annotations

import torch

from ..layout import BlockLayout, LayoutError, _Coo
from ._common import grid, lengths


def _check_int_tensor(name: str, t, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise LayoutError(f"{name} must have an integer dtype (int32 or int64), got {t.dtype}")
    if t.dim() != dims:
        raise LayoutError(f"{name} must be {dims}-D {what}, got shape {tuple(t.shape)}")


def from_block_index(block_index: torch.Tensor, *, seq_len: int, kv_len: int | None = None, block_q: int = 64,
                     block_k: int = 128) -> BlockLayout:
    """A layout from per-row key-block indices, every listed block full.

    Args:
        block_index: integer ``[B, H, Qb, K]``: the key blocks query block ``qb`` of (b, h) visits,
            in any order, ``-1`` for an unused slot (anywhere in the row). ``Qb`` must equal
            ``ceil(seq_len / block_q)``; B or H of 1 broadcast. Each key block at most once per row.
        seq_len: ``Lq``; kv_len: ``Lk`` (default ``Lq``); indices must be in ``0 .. ceil(Lk/block_k) - 1``.
    Returns: a BlockLayout with batch B and heads H, rows sorted ascending.
    Raises: LayoutError naming the first offending entry ``block_index[b,h,qb,slot]``.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    _check_int_tensor("block_index", block_index, 4, "[batch, heads, q_blocks, top_k]")
    B, H, rows, _ = block_index.shape
    if B < 1 or H < 1:
        raise LayoutError(f"block_index has shape {tuple(block_index.shape)}: batch and heads must be >= 1")
    if rows != nq:
        raise LayoutError(f"block_index has {rows} query-block rows (dim 2) but seq_len={q_len} with "
                          f"block_q={block_q} needs {nq}: pass the seq_len/block_q the indices were made for")
    bi = block_index.long()
    bad = (bi < -1) | (bi >= nk)
    if bad.any():
        b, h, q, s = (int(x) for x in bad.nonzero()[0])
        raise LayoutError(f"block_index[{b},{h},{q},{s}] = {int(bi[b, h, q, s])} is out of range: valid key-block "
                          f"indices are 0..{nk - 1} (kv_len={kv_len}, block_k={block_k}), or -1 for padding")
    vals, order = torch.sort(bi, dim=-1, stable=True)
    dup = (vals[..., 1:] == vals[..., :-1]) & (vals[..., 1:] >= 0)
    if dup.any():
        b, h, q, s = (int(x) for x in dup.nonzero()[0])
        s1, s2 = int(order[b, h, q, s]), int(order[b, h, q, s + 1])
        raise LayoutError(f"block_index[{b},{h},{q}] lists key block {int(vals[b, h, q, s])} twice (slots {s1} and "
                          f"{s2}): each key block may appear at most once per row; use -1 for unused slots")
    b, h, q, s = (bi >= 0).nonzero(as_tuple=True)
    coo = _Coo(b, h, q, bi[b, h, q, s], torch.full_like(b, -1))
    return BlockLayout._from_coo(coo, batch=B, heads=H, block_q=block_q, block_k=block_k, q_len=q_len,
                                 kv_len=kv_len, masks=())


def to_block_index(layout: BlockLayout) -> torch.Tensor:
    """int32 ``[Bl, Hl, Qb, max_k]``: each row's key blocks ascending, then -1 padding.

    The inverse of :func:`from_block_index` for the block structure; which blocks are partial
    (and their element masks) is not represented, so keep the layout for a token-exact round trip.
    """
    valid = torch.arange(layout.max_k, device=layout.device) < layout.kv_counts[..., None]
    return torch.where(valid, layout.kv_indices, -1).to(torch.int32)


def from_block_mask(block_mask: torch.Tensor, *, seq_len: int | None = None, kv_len: int | None = None,
                    block_q: int, block_k: int) -> BlockLayout:
    """A layout from a dense bool block mask ``[Qb, Kb]`` or ``[B, H, Qb, Kb]``, every listed block full.

    ``seq_len`` defaults to ``Qb * block_q``; ``kv_len`` defaults to ``seq_len`` when that is
    given, else to ``Kb * block_k``. Both must round up to the mask's block counts.
    """
    if seq_len is not None and kv_len is None:
        kv_len = seq_len
    return BlockLayout.from_block_mask(block_mask, block_q=block_q, block_k=block_k, q_len=seq_len, kv_len=kv_len)
