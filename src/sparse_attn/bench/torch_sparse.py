"""The ``torch-sparse`` benchmark provider: the layout's attention through PyTorch's sparse tensors.

What a user without a sparse-attention kernel writes: the allowed (query, key) pairs as a token-level
CSR pattern (built once, untimed, from the layout and ``causal``), then per (batch, head)
``S = sampled_addmm(pattern, q, kᵀ)`` (only the allowed scores), a softmax over each CSR row (segment
max / sum on the values) and ``P @ v`` (sparse x dense). Exact, token for token, like the reference;
its memory is O(allowed pairs), i.e. density x Lq x Lk tokens, where the kernels stay O(L).
"""
from __future__ import annotations

import math

import torch

from ..layout import BlockLayout


def token_csr(layout: BlockLayout | None, b: int, h: int, lq: int, lk: int, causal: bool,
              device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(crow [lq + 1], col [nnz], row [nnz])`` int64: the keys query row i of (batch ``b``, head
    ``h``) may see, ascending, as CSR (``row`` repeats each row index per entry). Built block row by
    block row from the visited keys (``reference.chunk_keys``): never an lq x lk mask."""
    from ..reference import chunk_keys
    step = layout.block_q if layout is not None else 128
    rows, cols = [], []
    for r0 in range(0, lq, step):
        keys = chunk_keys(layout, r0, min(r0 + step, lq), lq, lk, causal, device)
        if keys is None:
            continue
        ok = keys.ok[min(b, keys.ok.shape[0] - 1), min(h, keys.ok.shape[1] - 1)]  # [R, K]
        r, c = ok.nonzero(as_tuple=True)
        rows.append(r + r0)
        cols.append(keys.j[c])
    empty = torch.zeros(0, dtype=torch.long, device=device)
    row = torch.cat(rows) if rows else empty
    col = torch.cat(cols) if cols else empty
    crow = torch.zeros(lq + 1, dtype=torch.long, device=device)
    crow[1:] = torch.bincount(row, minlength=lq).cumsum(0)
    return crow, col, row


def _row_softmax(values: torch.Tensor, row: torch.Tensor, lq: int) -> torch.Tensor:
    """Softmax of CSR ``values [nnz]`` within each row (``row [nnz]`` its row index), in fp32."""
    x = values.float()
    m = torch.full((lq,), float("-inf"), device=x.device).scatter_reduce(0, row, x, "amax")
    e = torch.exp(x - m[row])
    total = torch.zeros(lq, device=x.device).index_add(0, row, e)
    return (e / total[row]).to(values.dtype)


def torch_sparse_provider(q, k, v, layout, causal):
    """``build(q, k, v, layout, causal) -> forward`` for the registry (see the module docstring)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # torch 2.11 has no such sampled_addmm kernel
        raise ValueError(f"torch-sparse: torch.sparse.sampled_addmm has no {q.dtype} CUDA kernel; run this "
                         "provider in fp32 (--dtype fp32)")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group, scale = Hq // Hkv, 1.0 / math.sqrt(D)
    patterns = {}
    for b in range(B):
        for h in range(Hq):
            crow, col, row = token_csr(layout, b, h, Lq, Lk, causal, q.device)
            zeros = torch.zeros(col.numel(), dtype=q.dtype, device=q.device)
            patterns[b, h] = (torch.sparse_csr_tensor(crow, col, zeros, size=(Lq, Lk)), row)

    def forward():
        out = torch.empty(B, Hq, Lq, v.shape[-1], dtype=q.dtype, device=q.device)
        for (b, h), (pattern, row) in patterns.items():
            kh = h // group
            s = torch.sparse.sampled_addmm(pattern, q[b, h], k[b, kh].transpose(0, 1), beta=0.0, alpha=scale)
            p = torch.sparse_csr_tensor(s.crow_indices(), s.col_indices(), _row_softmax(s.values(), row, Lq),
                                        size=(Lq, Lk))
            out[b, h] = p @ v[b, kh]
        return out
    return forward
