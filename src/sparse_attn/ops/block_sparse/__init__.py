"""Block-sparse FlashAttention op: the public wrapper over the custom ops."""
from __future__ import annotations

import math

import torch

from ...layout import BlockLayout
from .function import block_sparse_fwd

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def check_kernel_inputs(q: torch.Tensor, v: torch.Tensor) -> None:
    """What the Triton kernels support beyond the general validation."""
    if q.dtype not in KERNEL_DTYPES and q.device.type == "cuda":
        raise TypeError(f"the Triton kernels take float16 or bfloat16, got {q.dtype}: cast q/k/v (e.g. .bfloat16()), "
                        "or call sparse_attn.reference.attention for an fp32 result")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[-1]} is above the kernels' limit of {MAX_HEAD_DIM}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the Triton kernels need v's head_dim ({v.shape[-1]}) equal to q/k's ({q.shape[-1]})")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def layout_inputs(layout: BlockLayout, needs_grad: bool) -> tuple:
    """The layout as the ops' tensor arguments: rows, transpose (only for backward), term table."""
    terms, _ = layout.mask_table()
    n_terms = terms.shape[1] if layout.masks else 0
    if needs_grad:
        t = layout.transpose()
        trans = (t.kv_counts, t.kv_indices, t.kv_mask_ids)
    else:
        trans = (None, None, None)
    return (layout.kv_counts, layout.kv_indices, layout.kv_mask_ids) + trans + (terms, n_terms)


def attention_op(q, k, v, layout: BlockLayout, *, scale: float | None = None, return_lse: bool = False):
    """Run the kernels on validated ``[B, H, L, D]`` inputs with a validated layout on q's device."""
    check_kernel_inputs(q, v)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, lse = block_sparse_fwd(q, k, v, *layout_inputs(layout, needs_grad), None, None,
                                layout.block_q, layout.block_k, scale, q.shape[2], k.shape[2])
    return (out, lse) if return_lse else out
