"""Context parallelism over torch.distributed (zigzag llama3 style).

Each sequence of length L (divisible by 2W for W ranks) is cut into 2W chunks of C = L / (2W) tokens;
rank r holds chunks r and 2W-1-r (zigzag), so causal work is balanced across ranks. K/V are
all-gathered (llama3 style), each local query chunk attends the prefix of the full K/V up to its own
end, and dK/dV are reduce-scattered back in the backward pass.

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
from .zigzag import zigzag_llama3_attention

__all__ = [
    "all_gather_zigzag",
    "check_consistent_shapes",
    "reduce_scatter_zigzag",
    "zigzag_chunk_ids",
    "zigzag_cu_seqlens",
    "zigzag_gather",
    "zigzag_llama3_attention",
    "zigzag_merge",
    "zigzag_merge_varlen",
    "zigzag_split",
    "zigzag_split_varlen",
]
