"""Context parallelism over torch.distributed (zigzag llama3 style).

Each sequence of length L (divisible by 2W for W ranks) is cut into 2W chunks of C = L / (2W) tokens;
rank r holds chunks r and 2W-1-r (zigzag), so causal work is balanced across ranks. K/V are
all-gathered (llama3 style) in head chunks, each local query chunk attends the prefix of the full K/V
up to its own end, and dK/dV are reduce-scattered back in the backward pass.

Dense batches ``[B, H, L, D]``: :func:`zigzag_split` then :func:`zigzag_llama3_attention`. Packed
varlen batches ``[T, H, D]`` with global ``cu_seqlens``: :func:`zigzag_split_varlen`, then
:func:`zigzag_llama3_varlen_attention`; :func:`zigzag_plan` gives the per-rank ``cu_seqlens_local()``,
``max_seqlen_local`` and RoPE ``position_ids()``. Failure behaviour (mismatched shapes, missing
peers, timeouts): see :mod:`sparse_attn.parallel.comm`.

Not exported from ``sparse_attn`` itself: ``import sparse_attn.parallel``.
"""
from .chunks import (
    zigzag_chunk_ids,
    zigzag_cu_seqlens,
    zigzag_merge,
    zigzag_merge_varlen,
    zigzag_split,
    zigzag_split_varlen,
)
from .comm import (
    all_gather_zigzag,
    check_consistent_shapes,
    reduce_scatter_zigzag,
    zigzag_gather,
)
from .plan import ZigzagPlan, zigzag_plan
from .zigzag import zigzag_llama3_attention, zigzag_llama3_varlen_attention

__all__ = [
    "ZigzagPlan",
    "all_gather_zigzag",
    "check_consistent_shapes",
    "reduce_scatter_zigzag",
    "zigzag_chunk_ids",
    "zigzag_cu_seqlens",
    "zigzag_gather",
    "zigzag_llama3_attention",
    "zigzag_llama3_varlen_attention",
    "zigzag_merge",
    "zigzag_merge_varlen",
    "zigzag_plan",
    "zigzag_split",
    "zigzag_split_varlen",
]
