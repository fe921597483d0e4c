"""The PyTorch reference as an opaque custom op, for ``torch.compile`` off CUDA.

:func:`sparse_attn.reference.attention` walks only the keys each query block visits, which it
finds by reading the layout's tensors on the host (``visited_keys``): shapes that depend on data,
which Dynamo cannot trace, so ``torch.compile(fullgraph=True)`` of a module calling
``sparse_attn.attention`` with a layout failed on the CPU while it compiled on CUDA (there the
kernels are custom ops). While compiling, the CPU path goes through the ops below instead: the
layout travels as its three tensors plus its element masks packed as the kernels' term table (a
custom op takes no Python objects), the forward runs the reference as is, and the backward is the
reference's explicit one (:func:`sparse_attn.reference.attention_backward`; memory as the eager
reference's, O(rows x visited keys) per query block).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import reference
from .layout import BlockLayout
from .masks import ElementMask, MaskTerm


def masks_from_table(terms: Tensor, term_counts: Tensor, n_masks: int) -> tuple[ElementMask, ...]:
    """The element masks packed by :func:`sparse_attn.masks.mask_table` (``terms`` int32
    ``[n, max_terms, 7]``, ``term_counts`` int32 ``[n]``), of which the first ``n_masks`` are the
    layout's (an empty tuple packs as one empty row)."""
    rows, counts = terms.tolist(), term_counts.tolist()
    return tuple(ElementMask(tuple(MaskTerm(*rows[m][t]) for t in range(counts[m]))) for m in range(n_masks))


def _layout(q, k, kv_counts, kv_indices, kv_mask_ids, terms, term_counts, n_masks, block_q,
            block_k) -> BlockLayout:
    return BlockLayout(block_q, block_k, q.shape[2], k.shape[2], kv_counts, kv_indices, kv_mask_ids,
                       masks_from_table(terms, term_counts, n_masks))


@torch.library.custom_op("sparse_attn::reference_fwd", mutates_args=())
def reference_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, kv_indices: Tensor, kv_mask_ids: Tensor,
                  terms: Tensor, term_counts: Tensor, n_masks: int, block_q: int, block_k: int, causal: bool,
                  scale: float) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Lq, Dv] in q's dtype, lse [B, Hq, Lq])`` of the reference on this layout; the LSE
    in the accumulation dtype (:func:`reference.acc_dtype`), since the backward recomputes P from it."""
    layout = _layout(q, k, kv_counts, kv_indices, kv_mask_ids, terms, term_counts, n_masks, block_q, block_k)
    out, lse = reference.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True, _acc_lse=True)
    return out.contiguous(), lse.contiguous()


@reference_fwd.register_fake
def _(q, k, v, *args):
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    return out, q.new_empty(q.shape[:3], dtype=reference.acc_dtype(q.dtype))


@torch.library.custom_op("sparse_attn::reference_bwd", mutates_args=())
def reference_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, lse: Tensor,
                  kv_counts: Tensor, kv_indices: Tensor, kv_mask_ids: Tensor, terms: Tensor, term_counts: Tensor,
                  n_masks: int, block_q: int, block_k: int, causal: bool,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from the output's and the LSE's gradients (``dlse`` None: the loss did not
    use the LSE), by :func:`sparse_attn.reference.attention_backward`: explicit, since autograd does
    not record inside a custom op's kernel."""
    layout = _layout(q, k, kv_counts, kv_indices, kv_mask_ids, terms, term_counts, n_masks, block_q, block_k)
    return reference.attention_backward(do, dlse, q, k, v, lse, layout, causal=causal, scale=scale)


@reference_bwd.register_fake
def _(do, dlse, q, k, v, *args):
    # contiguous, as attention_backward returns them (q's strides made inductor fail on transposed inputs)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_counts, kv_indices, kv_mask_ids, terms, term_counts, n_masks, block_q, block_k, causal, scale = inputs
    ctx.save_for_backward(q, k, v, output[1], kv_counts, kv_indices, kv_mask_ids, terms, term_counts)
    ctx.meta = (n_masks, block_q, block_k, causal, scale)


def _backward(ctx, do, dlse):
    dq, dk, dv = reference_bwd(do.contiguous(), dlse, *ctx.saved_tensors, *ctx.meta)
    return (dq, dk, dv) + (None,) * 10


reference_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, layout: BlockLayout, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False):
    """:func:`sparse_attn.reference.attention` (same arguments, a validated layout on q's device)
    through the custom op, so that torch.compile traces it as one opaque, differentiable call. The
    op's LSE is cast to fp32 here, as the eager reference returns it (the op keeps float64 inputs' own
    for its backward)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)  # as reference.attention
    terms, term_counts = layout.mask_table()
    out, lse = reference_fwd(q, k, v, layout.kv_counts, layout.kv_indices, layout.kv_mask_ids, terms, term_counts,
                             len(layout.masks), layout.block_q, layout.block_k, causal, scale)
    return (out, lse.float()) if return_lse else out


@torch.library.custom_op("sparse_attn::sage_reference_fwd", mutates_args=())
def sage_reference_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, kv_indices: Tensor, kv_mask_ids: Tensor,
                       terms: Tensor, term_counts: Tensor, n_masks: int, block_q: int, block_k: int, causal: bool,
                       scale: Optional[float], quant: str, granularity: str,
                       smooth_k: bool) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Lq, Dv] in q's dtype, lse fp32 [B, Hq, Lq])`` of the 8-bit PyTorch twin
    (:func:`sparse_attn.ops.sage.reference.attention`) on this layout. No autograd: the 8-bit forward
    has no gradient of its own (sparse_attn.quantized routes it through the fp16/bf16 path)."""
    from .ops.sage import reference as sage_ref
    layout = _layout(q, k, kv_counts, kv_indices, kv_mask_ids, terms, term_counts, n_masks, block_q, block_k)
    out, lse = sage_ref.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True, quant=quant,
                                  granularity=granularity, smooth_k=smooth_k)
    return out.contiguous(), lse.float().contiguous()


@sage_reference_fwd.register_fake
def _(q, k, v, *args):
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


def sage_attention(q, k, v, layout: BlockLayout, *, causal: bool, scale: float | None, quant: str,
                   granularity: str, smooth_k: bool):
    """``(out, lse)`` of the 8-bit twin through :func:`sage_reference_fwd`, so torch.compile traces the
    CPU 8-bit path with a layout as one opaque call (its key walk reads the layout on the host)."""
    terms, term_counts = layout.mask_table()
    return sage_reference_fwd(q, k, v, layout.kv_counts, layout.kv_indices, layout.kv_mask_ids, terms, term_counts,
                              len(layout.masks), layout.block_q, layout.block_k, causal, scale, quant, granularity,
                              smooth_k)
