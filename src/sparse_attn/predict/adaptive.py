"""Adaptive sparse attention: predict a layout with :func:`meansim`, then run it."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..validation import check_flag
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


MEANSIM_OPTIONS = ("simthreshd1", "cdfthreshd", "topk", "block_q", "block_k", "block", "attention_sink")
LAYOUT_CHOICES = ("adaptive",) + tuple(f"adaptive:{level}" for level in SPARSE_LEVELS)


def predicted_layout(spec, q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                     options: dict | None = None):
    """The layout ``sparse_attn.attention(q, k, v, layout=spec, adaptive=options)`` runs.

    spec: ``"adaptive"`` (meansim's defaults, = ``"adaptive:medium"``) or ``"adaptive:<level>"``
        with a level of :data:`SPARSE_LEVELS`; None with ``options`` means ``"adaptive"``.
    options: :func:`meansim` keywords (``simthreshd1``, ``cdfthreshd``, ``topk``, ``block_q``,
        ``block_k``, ``block``, ``attention_sink``), applied over the level's thresholds.
    q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]`` (GQA when Hkv < Hq), the attention's own.
    causal / scale: the attention's own; ``scale`` is also the temperature of the pooled scores.
    Returns a :class:`~sparse_attn.BlockLayout` (batch B, heads Hq); ``.sparsity`` is the fraction skipped.
    """
    if spec is None:
        spec = "adaptive"
    if not isinstance(spec, str):
        raise TypeError(f"adaptive= options apply to layout='adaptive' (or 'adaptive:<level>'), not to a given "
                        f"{type(spec).__name__}: drop adaptive= or pass layout='adaptive'")
    name, colon, level = spec.partition(":")
    if name != "adaptive" or ((level or colon) and level not in SPARSE_LEVELS):
        raise ValueError(f"unknown layout {spec!r}: give a BlockLayout, None (dense), or one of "
                         f"{', '.join(repr(c) for c in LAYOUT_CHOICES)}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"adaptive= takes a dict of meansim options (e.g. {{'cdfthreshd': 0.9}}), got "
                        f"{type(options).__name__} {options!r}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(MEANSIM_OPTIONS))
    if unknown:
        raise ValueError(f"unknown adaptive= option(s) {', '.join(unknown)}: choose from {', '.join(MEANSIM_OPTIONS)} "
                         "(causal and scale come from attention's own arguments)")
    kwargs = {**(level_params(level) if level else {}), **options}
    return meansim(q, k, causal=causal, scale=scale, **kwargs)


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
    check_flag("return_layout", return_layout)  # 'False' is truthy: it returned (out, layout)
    layout = meansim(q, k, causal=causal, scale=scale, **meansim_kwargs)
    out = sparse_attn.attention(q, k, v, layout, causal=causal, scale=scale)
    return (out, layout) if return_layout else out
