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

__all__ = ["cosine_similarity", "relative_l1", "rmse", "max_abs_error", "sparsity", "compare", "precision_metric"]


CHUNK = 1 << 22  # elements converted to float64 at a time (32 MiB a side): no float64 copy of whole outputs


def _flat_pair(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """Both broadcast together and flattened, in their own dtypes (a copy only where a view cannot do)."""
    a = torch.as_tensor(a).detach()
    b = torch.as_tensor(b, device=a.device).detach()
    if a.is_complex() or b.is_complex():  # float64 conversion would drop the imaginary part, with a warning
        raise TypeError(f"the metrics compare real tensors, got {a.dtype} and {b.dtype}: compare .real and .imag "
                        "(or torch.view_as_real) separately")
    a, b = torch.broadcast_tensors(a, b)
    return a.reshape(-1), b.reshape(-1)


def _chunks(a: torch.Tensor, b: torch.Tensor):
    for i in range(0, a.numel(), CHUNK):
        yield a[i:i + CHUNK].to(torch.float64), b[i:i + CHUNK].to(torch.float64)


def _all(a, b) -> dict[str, float]:
    """Every error metric of ``a`` against ``b`` in two float64 passes over chunks of :data:`CHUNK`
    elements: maxima and L1 sums first, then the squares, each side scaled by its largest magnitude
    so squares neither underflow (|x| ~ 1e-170 read as all-zero) nor overflow (1e200 gave nan).
    Memory: O(CHUNK), not four float64 copies of the inputs (16 GiB for two bf16 outputs of 1 GiB)."""
    a, b = _flat_pair(a, b)
    n = a.numel()
    if n == 0:
        return {"cosine": 1.0, "relative_l1": 0.0, "rmse": 0.0, "max_abs_error": 0.0}
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    finite = torch.ones((), dtype=torch.bool, device=a.device)
    max_a = max_b = max_d = l1_d = l1_b = zero
    for x, y in _chunks(a, b):
        finite = finite & torch.isfinite(x).all() & torch.isfinite(y).all()
        d = (x - y).abs()
        max_a, max_b = torch.maximum(max_a, x.abs().max()), torch.maximum(max_b, y.abs().max())
        max_d, l1_d, l1_b = torch.maximum(max_d, d.max()), l1_d + d.sum(), l1_b + y.abs().sum()
    if not bool(finite):
        return {"cosine": math.nan, "relative_l1": math.nan, "rmse": math.nan, "max_abs_error": math.nan}
    sa, sb, sd = float(max_a), float(max_b), float(max_d)
    dot = sq_a = sq_b = sq_d = zero
    for x, y in _chunks(a, b):
        if sa > 0.0 and sb > 0.0:
            x_s, y_s = x / sa, y / sb
            dot, sq_a, sq_b = dot + (x_s * y_s).sum(), sq_a + x_s.square().sum(), sq_b + y_s.square().sum()
        if sd > 0.0:
            sq_d = sq_d + ((x - y) / sd).square().sum()
    if sa == 0.0 and sb == 0.0:
        cosine = 1.0
    elif sa == 0.0 or sb == 0.0:
        cosine = 0.0
    else:
        cosine = max(-1.0, min(1.0, float(dot / (sq_a.sqrt() * sq_b.sqrt()))))
    num, den = float(l1_d), float(l1_b)
    rel = (0.0 if num == 0.0 else math.inf) if den == 0.0 else num / den
    rms = sd * math.sqrt(float(sq_d) / n) if sd > 0.0 else 0.0
    return {"cosine": cosine, "relative_l1": rel, "rmse": rms, "max_abs_error": sd}


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the angle between ``a`` and ``b`` flattened (any equal/broadcastable shapes).

    1.0 is a perfect match. Both all-zero -> 1.0 (identical); exactly one all-zero -> 0.0.
    Empty inputs -> 1.0. ``nan`` when either input holds a NaN or inf (never "good").
    """
    return _all(a, b)["cosine"]


def relative_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum|a - b| / sum|b|`` over all elements; ``b`` is the reference.

    If ``sum|b| == 0``: 0.0 when ``a`` is also all zero, else ``inf``. Empty inputs -> 0.0.
    ``nan`` when either input holds a NaN or inf.
    """
    return _all(a, b)["relative_l1"]


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root mean square of ``a - b``; 0.0 for empty inputs; ``nan`` on NaN/inf in either input."""
    return _all(a, b)["rmse"]


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|``; 0.0 for empty inputs; ``nan`` on NaN/inf in either input."""
    return _all(a, b)["max_abs_error"]


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
    m = _all(out, ref)
    # every metric is nan exactly when some input value is not finite (an empty pair is finite)
    return {**m, "finite": not math.isnan(m["max_abs_error"])}


def precision_metric(out: torch.Tensor, ref: torch.Tensor, verbose: bool = False,
                     round_num: int = 4) -> dict[str, float]:
    """SpargeAttn's names for three of :func:`compare`'s metrics, for tests ported from it:
    ``{"Cossim": cosine, "L1": relative L1, "RMSE": rmse}`` of ``out`` against ``ref`` (same
    definitions, float64, the NaN policy above). ``verbose`` prints them rounded to ``round_num``."""
    m = _all(out, ref)
    named = {"Cossim": m["cosine"], "L1": m["relative_l1"], "RMSE": m["rmse"]}
    if verbose:
        print(", ".join(f"{k}: {round(v, round_num)}" for k, v in named.items()))
    return named
