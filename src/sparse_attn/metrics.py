"""Accuracy and sparsity metrics, shared by the tests and the accuracy CLI.

Every error metric compares ``a`` (the output under test) with ``b`` (the reference), both of any
shape (they must broadcast to one shape; usually ``[B, H, L, D]``), and is computed in float64
whatever the input dtypes. Each returns a Python ``float``.

NaN policy: a non-finite value (NaN or +-inf) in either input makes every error metric return
``nan``, so a broken output can never pass a ``<=`` threshold (``nan <= x`` is False) nor a
``>=`` one (cosine similarity). Check with ``math.isnan`` or ``not (err <= tol)``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["cosine_similarity", "relative_l1", "rmse", "max_abs_error", "sparsity", "compare"]


def _pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both as float64 on one device, broadcast together; None when either holds a NaN or inf."""
    a = torch.as_tensor(a)
    b = torch.as_tensor(b, device=a.device)
    a, b = torch.broadcast_tensors(a.detach().to(torch.float64), b.detach().to(torch.float64))
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None
    return a, b


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the angle between ``a`` and ``b`` flattened (any equal/broadcastable shapes).

    1.0 is a perfect match. Both all-zero -> 1.0 (identical); exactly one all-zero -> 0.0.
    Empty inputs -> 1.0. ``nan`` when either input holds a NaN or inf (never "good").
    """
    pair = _pair(a, b)
    if pair is None:
        return math.nan
    a, b = pair
    # each side scaled by its largest magnitude first, so squares neither underflow (|x| ~ 1e-170 read
    # as all-zero) nor overflow (1e200 gave nan) in float64
    sa, sb = float(a.abs().max()) if a.numel() else 0.0, float(b.abs().max()) if b.numel() else 0.0
    if sa == 0.0 and sb == 0.0:
        return 1.0
    if sa == 0.0 or sb == 0.0:
        return 0.0
    a, b = a / sa, b / sb
    return max(-1.0, min(1.0, float((a * b).sum() / (a.norm() * b.norm()))))


def relative_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum|a - b| / sum|b|`` over all elements; ``b`` is the reference.

    If ``sum|b| == 0``: 0.0 when ``a`` is also all zero, else ``inf``. Empty inputs -> 0.0.
    ``nan`` when either input holds a NaN or inf.
    """
    pair = _pair(a, b)
    if pair is None:
        return math.nan
    a, b = pair
    num, den = float((a - b).abs().sum()), float(b.abs().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _reduce_diff(a: torch.Tensor, b: torch.Tensor, reduce) -> float:
    """``reduce(a - b)`` in float64; 0.0 for empty inputs; ``nan`` on NaN/inf in either input."""
    pair = _pair(a, b)
    if pair is None:
        return math.nan
    a, b = pair
    if a.numel() == 0:
        return 0.0
    return float(reduce(a - b))


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root mean square of ``a - b``; 0.0 for empty inputs; ``nan`` on NaN/inf in either input."""
    return _reduce_diff(a, b, _scaled_rms)


def _scaled_rms(d: torch.Tensor) -> torch.Tensor:
    """sqrt(mean(d^2)) with d scaled by max|d| first: no underflow or overflow of the squares."""
    s = d.abs().max()
    return s * (d / s).square().mean().sqrt() if s > 0 else s


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|``; 0.0 for empty inputs; ``nan`` on NaN/inf in either input."""
    return _reduce_diff(a, b, lambda d: d.abs().max())


def sparsity(layout_or_mask) -> float:
    """Fraction skipped: a :class:`~sparse_attn.BlockLayout` -> ``layout.sparsity`` (whole blocks);
    a bool tensor (block or token mask, any shape) -> ``1 - mean(mask)`` (0.0 for an empty tensor)."""
    from .layout import BlockLayout

    if isinstance(layout_or_mask, BlockLayout):
        return float(layout_or_mask.sparsity)
    if isinstance(layout_or_mask, torch.Tensor):
        if layout_or_mask.dtype != torch.bool:
            raise TypeError(f"sparsity() takes a BlockLayout or a bool tensor, got a {layout_or_mask.dtype} tensor")
        if layout_or_mask.numel() == 0:
            return 0.0
        return 1.0 - float(layout_or_mask.to(torch.float64).mean())
    raise TypeError(f"sparsity() takes a BlockLayout or a bool tensor, got {type(layout_or_mask).__name__}")


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float | bool]:
    """All error metrics of ``out`` against the reference ``ref``, plus a NaN flag:
    ``{cosine, relative_l1, rmse, max_abs_error, finite}`` (``finite`` False when ``out`` or ``ref``
    holds a NaN/inf, in which case every metric is ``nan``)."""
    return {
        "cosine": cosine_similarity(out, ref),
        "relative_l1": relative_l1(out, ref),
        "rmse": rmse(out, ref),
        "max_abs_error": max_abs_error(out, ref),
        "finite": _pair(out, ref) is not None,
    }
