"""Public entry points: validate, pick a path, call an op."""
from __future__ import annotations

import torch

from . import reference
from .layout import BlockLayout
from .validation import check_layout, check_qkv, check_scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout | None = None, *,
              causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """Block-sparse attention.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``, one dtype and device;
            GQA/MQA when ``Hq`` is a multiple of ``Hkv`` (K/V are never repeated in memory).
        layout: which ``block_q x block_k`` blocks each query block visits
            (:class:`sparse_attn.BlockLayout`, built for exactly ``(Lq, Lk)``, batch in {1, B},
            heads in {1, Hq}); None attends every key.
        causal: also mask keys after the query, bottom-right aligned: query i sees key j iff
            ``j <= i + Lk - Lq`` (FlashAttention's convention for ``Lq != Lk``).
        scale: softmax scale; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp (natural log) of the scaled, masked scores,
            fp32 ``[B, Hq, Lq]``.

    Returns:
        ``out [B, Hq, Lq, Dv]`` in q's dtype, or ``(out, lse)``. A query row that may see no key
        gets output 0 and LSE ``-inf``.
    """
    check_qkv(q, k, v)
    check_scale(scale)
    if layout is not None:
        layout = check_layout(layout, q, k)
    return reference.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse)
