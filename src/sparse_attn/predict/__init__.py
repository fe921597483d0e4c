"""Adaptive layout prediction: pooled Q/K similarity -> a BlockLayout (CDF or top-k per row).

    from sparse_attn import predict
    layout = predict.meansim(q, k, simthreshd1=0.6, cdfthreshd=0.98, causal=True)
    out, layout = predict.adaptive_attention(q, k, v, causal=True, **predict.level_params("medium"))
    out, layout = sparse_attn.attention(q, k, v, "adaptive:high", causal=True, return_layout=True)
"""
from .adaptive import LAYOUT_CHOICES, SPARSE_LEVELS, adaptive_attention, level_params, predicted_layout
from .meansim import meansim

__all__ = ["meansim", "adaptive_attention", "predicted_layout", "SPARSE_LEVELS", "LAYOUT_CHOICES", "level_params"]
