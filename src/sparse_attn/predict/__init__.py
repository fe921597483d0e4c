"""Adaptive layout prediction: pooled Q/K similarity -> a BlockLayout (CDF or top-k per row).

    from sparse_attn import predict
    layout = predict.meansim(q, k, simthreshd1=0.6, cdfthreshd=0.98, causal=True)
    out, layout = predict.adaptive_attention(q, k, v, causal=True, **predict.level_params("medium"))
"""
from .adaptive import SPARSE_LEVELS, adaptive_attention, level_params
from .meansim import meansim

__all__ = ["meansim", "adaptive_attention", "SPARSE_LEVELS", "level_params"]
