"""Batched CSR (compressed rows of key blocks) <-> BlockLayout."""
from __future__ import annotations

import torch

from ..layout import BlockLayout, LayoutError, _Coo
from ._common import grid, lengths
from .block_index import _check_int_tensor


def to_csr(layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's block structure as batched CSR.

    Returns:
        crow: int32 ``[Bl, Hl, Qb + 1]``, row offsets per (b, h), ``crow[..., 0] == 0``;
        col:  int32 ``[Bl, Hl, nnz_max]``, key-block indices of row ``qb`` at
              ``col[b, h, crow[b, h, qb]:crow[b, h, qb + 1]]`` (ascending), padded with -1 after
              ``crow[b, h, -1]`` (``nnz_max`` = the largest per-(b, h) block count).
    Partial-block marks are not represented (like :func:`to_block_index`).
    """
    counts = layout.kv_counts.long()
    # (zeros of the row-less shape, not counts[..., :1]: with no query block that slice is empty)
    crow = torch.cat([counts.new_zeros(*counts.shape[:-1], 1), torch.cumsum(counts, -1)], -1)
    nnz = crow[..., -1]
    nnz_max = int(nnz.max()) if nnz.numel() else 0
    col = torch.full((layout.batch, layout.heads, nnz_max), -1, dtype=torch.int32, device=layout.device)
    valid = torch.arange(layout.max_k, device=layout.device) < counts[..., None]
    b, h, q, s = valid.nonzero(as_tuple=True)
    col[b, h, crow[b, h, q] + s] = layout.kv_indices[b, h, q, s]
    return crow.to(torch.int32), col


def from_csr(crow: torch.Tensor, col: torch.Tensor, *, seq_len: int, kv_len: int | None = None,
             block_q: int, block_k: int) -> BlockLayout:
    """A layout (every block full) from batched CSR ``crow [B, H, Qb + 1]``, ``col [B, H, N]``.

    Row ``qb`` of (b, h) visits ``col[b, h, crow[b, h, qb]:crow[b, h, qb + 1]]`` (any order, no
    duplicates); entries of ``col`` past ``crow[b, h, -1]`` are ignored. ``Qb`` must equal
    ``ceil(seq_len / block_q)``; key blocks must be in ``0 .. ceil(kv_len / block_k) - 1``.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    nq, nk = grid(q_len, kv_len, block_q, block_k)
    _check_int_tensor("crow", crow, 3, "[batch, heads, q_blocks + 1]")
    _check_int_tensor("col", col, 3, "[batch, heads, nnz]")
    B, H = crow.shape[:2]
    if col.shape[:2] != crow.shape[:2]:
        raise LayoutError(f"crow {tuple(crow.shape)} and col {tuple(col.shape)} must share (batch, heads)")
    if crow.shape[2] != nq + 1:
        raise LayoutError(f"crow has {crow.shape[2]} offsets per (b, h) but seq_len={q_len} with block_q={block_q} "
                          f"has {nq} query blocks: crow needs {nq + 1}")
    crow = crow.long()
    counts = crow[..., 1:] - crow[..., :-1]
    bad = torch.cat([(crow[..., :1] != 0), counts < 0, (crow[..., -1:] > col.shape[2])], -1)
    if bad.any():
        b, h, n = (int(x) for x in bad.nonzero()[0])
        n = min(n, nq)  # bad's columns: the start (crow index 0), each count (its end index), the end (index nq)
        raise LayoutError(f"crow[{b},{h}] = {crow[b, h].tolist()} is not a valid offset array: it must start at 0, "
                          f"never decrease, and end at most at col.shape[2] = {col.shape[2]} (first problem at {n})")
    b, h, q = torch.nonzero(counts > 0, as_tuple=True)
    width = counts[b, h, q]
    rep = [torch.repeat_interleave(x, width) for x in (b, h, q)]
    pos = torch.arange(rep[0].numel(), device=crow.device) - torch.repeat_interleave(torch.cumsum(width, 0) - width,
                                                                                     width)
    n = crow[rep[0], rep[1], rep[2]] + pos
    kb = col.long()[rep[0], rep[1], n]
    bad_kb = (kb < 0) | (kb >= nk)
    if bad_kb.any():
        e = int(bad_kb.nonzero()[0])
        raise LayoutError(f"col[{int(rep[0][e])},{int(rep[1][e])},{int(n[e])}] = {int(kb[e])} (query block "
                          f"{int(rep[2][e])}) is out of range: valid key-block indices are 0..{nk - 1} "
                          f"(kv_len={kv_len}, block_k={block_k})")
    key = ((rep[0] * H + rep[1]) * nq + rep[2]) * max(nk, 1) + kb
    srt, order = torch.sort(key, stable=True)
    dup = srt[1:] == srt[:-1]
    if dup.any():
        e = int(dup.nonzero()[0])
        e1, e2 = int(order[e]), int(order[e + 1])
        raise LayoutError(f"col[{int(rep[0][e1])},{int(rep[1][e1])},{int(n[e1])}] and col[..,{int(n[e2])}] both list "
                          f"key block {int(kb[e1])} in query block {int(rep[2][e1])}: each key block at most once per row")
    coo = _Coo(rep[0], rep[1], rep[2], kb, torch.full_like(kb, -1))
    return BlockLayout._from_coo(coo, batch=B, heads=H, block_q=block_q, block_k=block_k, q_len=q_len,
                                 kv_len=kv_len, masks=())
