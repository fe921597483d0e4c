"""Adaptive sparse attention: predict a layout with :func:`meansim`, then run it."""
from __future__ import annotations

import torch

from .meansim import meansim

# sparse level -> (simthreshd1, cdfthreshd), calibrated on sparse_attn.accuracy.structured_qkv (L 512-4096):
# low: cosine > 0.998, sparsity ~10-25%; medium: cosine > 0.99, ~15-45%; high: cosine > 0.97, ~25-75%.
# Lower simthreshd1 treats more blocks as self-similar (prunable); lower cdfthreshd keeps less mass per row.
SPARSE_LEVELS: dict[str, tuple[float, float]] = {
    "low": (0.65, 0.99),
    "medium": (0.6, 0.98),
    "high": (0.5, 0.96),
}


def level_params(level: str) -> dict[str, float]:
    """``meansim`` keyword arguments of a sparse level (``low`` / ``medium`` / ``high``)."""
    try:
        sim, cdf = SPARSE_LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown sparse level {level!r}; choose from {', '.join(SPARSE_LEVELS)}") from None
    return {"simthreshd1": sim, "cdfthreshd": cdf}


def adaptive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       scale: float | None = None, return_layout: bool = True, **meansim_kwargs):
    """Attention over the blocks :func:`~sparse_attn.predict.meansim` predicts for these q/k.

    Args:
        q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]`` as for
            :func:`sparse_attn.attention`; causal/scale as there (bottom-right aligned causal;
            ``scale`` also sets the temperature of the pooled scores).
        **meansim_kwargs: ``simthreshd1``, ``cdfthreshd``, ``topk``, ``block_q``, ``block_k``,
            ``block``, ``attention_sink`` (see :func:`meansim`).

    Returns: ``(out [B, Hq, Lq, Dv], layout)``, or ``out`` alone with ``return_layout=False``;
    ``layout.sparsity`` is the fraction of blocks skipped (batch B, heads Hq).
    """
    import sparse_attn
    layout = meansim(q, k, causal=causal, scale=scale, **meansim_kwargs)
    out = sparse_attn.attention(q, k, v, layout, causal=causal, scale=scale)
    return (out, layout) if return_layout else out
