"""PyTorch twin of the 8-bit path: the same quantization, then the reference attention.

Q and K are quantized to int8 per scale group (K first smoothed: its per-head mean over tokens is
subtracted, which shifts every score of a query row by the same amount and so leaves softmax
unchanged), then dequantized; with FP8, V is rounded per channel to e4m3 and the probabilities
(relative to the row maximum, times 448) are rounded to e4m3 before P.V, as the kernel does
(the kernel rounds them against its running maximum, so the two differ by rounding noise only).
"""
from __future__ import annotations

import torch

from ... import reference
from ...layout import BlockLayout
from .granularity import FP8_MAX, GRANULARITY, INT8_MAX, check_quant


def group_amax(amax: torch.Tensor, span: int, period: int) -> torch.Tensor:
    """Per-row ``amax [..., L]`` -> the max over each row's scale group, per row."""
    n = amax.shape[-1]
    pad = (-n) % span
    a = torch.nn.functional.pad(amax, (0, pad)).unflatten(-1, (-1, span // period, period))
    return a.amax(-2, keepdim=True).expand_as(a).flatten(-3)[..., :n]


def quantize_rows(x: torch.Tensor, span: int, period: int, mean: torch.Tensor | None = None):
    """``x [..., L, D]`` (minus ``mean [..., D]``) -> (int8 values, fp32 scale per row ``[..., L]``)."""
    xf = x.float()
    if mean is not None:
        xf = xf - mean[..., None, :]
    # a NaN or inf once went silently into its group's scale (NaN -> scale 1; inf -> every value 0);
    # now the group's scale is NaN, so what the group touches comes out NaN (the whole group, so more rows
    # than without quantization: README), and the other groups' scales come from finite values only (as
    # quant_rows_kernel does)
    finite = torch.isfinite(xf)
    xf = torch.where(finite, xf, 0.0)
    amax = group_amax(xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1]), span, period)
    bad = group_amax((~finite).any(-1).float(), span, period) > 0
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    xs = xf * (1.0 / scale)[..., None]  # a reciprocal a row, as the kernel (one multiply an element)
    scale = torch.where(bad, float("nan"), scale)
    q = torch.trunc(xs + torch.where(xs >= 0, 0.5, -0.5)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """Round to float8 e4m3fn and back (fp32)."""
    return x.float().to(torch.float8_e4m3fn).float()


def quantize_v_fp8(v: torch.Tensor):
    """``v [..., L, D]`` -> (dequantized fp32 V after e4m3 rounding, fp32 scale per channel ``[..., D]``)."""
    vf = v.float()
    # no key at all: scale 1 (amax over an empty token axis raised)
    amax = vf.abs().amax(-2) if v.shape[-2] else vf.new_zeros(v.shape[:-2] + v.shape[-1:])
    scale = v_channel_scale(amax)
    return fp8_round(vf / scale[..., None, :]) * scale[..., None, :], scale


def v_channel_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP8 scale per V channel from its amax: NaN for a channel holding a NaN or inf, so the channel
    comes out NaN (a NaN amax once gave scale 1: the channel's finite values rounded at the wrong
    scale, silently), 1 for an all-zero one."""
    # times the reciprocal on every device: torch's CUDA division by a scalar multiplies by the
    # reciprocal while its CPU one divides, so the twin differed by an ulp between the two
    return torch.where(torch.isfinite(amax), torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax)),
                       torch.full_like(amax, float("nan")))


def smoothing_mean(mean: torch.Tensor) -> torch.Tensor:
    """K's per-head mean over tokens (fp32 ``[..., D]``) as smoothing subtracts it: a channel whose mean
    is not finite (some token holds a NaN or inf there) is not smoothed (0). Subtracting a NaN mean
    made every key of the head NaN, so one bad token turned all the head's rows NaN; unsmoothed, the
    bad value stays in its own scale group and reaches only the rows that see that key, as without
    quantization. Any mean is exact under softmax, 0 included."""
    return torch.where(torch.isfinite(mean), mean, torch.zeros_like(mean))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout | None = None, *,
              causal: bool = False, scale: float | None = None, return_lse: bool = False, quant: str = "int8",
              granularity: str = "per_warp", smooth_k: bool = True):
    """8-bit attention, emulated: same arguments and result as :func:`sparse_attn.attention` with
    ``quant``. ``q [B, Hq, Lq, D]``, ``k/v [B, Hkv, Lk, D]``; the LSE is that of the unsmoothed scores."""
    mode = check_quant(quant, granularity)
    (qs, qp), (ks, kp) = GRANULARITY[granularity]
    mean = smoothing_mean(k.float().mean(-2)) if smooth_k and k.shape[-2] > 0 else None
    q8, q_scale = quantize_rows(q, qs, qp)
    k8, k_scale = quantize_rows(k, ks, kp, mean)
    qd = q8.float() * q_scale[..., None]
    kd = k8.float() * k_scale[..., None]
    vd = quantize_v_fp8(v)[0] if mode == 2 else v.float()
    round_p = (lambda p: fp8_round(p * FP8_MAX) / FP8_MAX) if mode == 2 else None
    out, lse = reference.attention(qd, kd, vd, layout, causal=causal, scale=scale, return_lse=True, _round_p=round_p)
    out = out.to(q.dtype)
    if not return_lse:
        return out
    return out, lse + lse_shift(q, mean, scale)


def lse_shift(q: torch.Tensor, mean: torch.Tensor | None, scale: float | None) -> torch.Tensor | float:
    """What smoothing K removed from each row's scores: ``scale * q . mean_k``, fp32 ``[B, Hq, Lq]``."""
    if mean is None:
        return 0.0
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // mean.shape[1]
    with torch.autocast(q.device.type, enabled=False):  # under autocast the einsum ran in bf16: LSE off by 0.1
        return torch.einsum("bhld,bhd->bhl", q.float(), mean.float().repeat_interleave(group, 1)) * scale


def packed_lse_shift(q: torch.Tensor, mean: torch.Tensor, cu_q: torch.Tensor, scale: float | None) -> torch.Tensor:
    """lse_shift for packed rows, ``[H, T]`` (the varlen LSE layout): each query token's
    ``scale * q . mean_k`` with its own sequence's K mean (``mean [S, Hkv, D]``). No host sync."""
    T, H, D = q.shape
    S, hkv = mean.shape[:2]
    seq = torch.repeat_interleave(torch.arange(S, device=q.device), cu_q[1:] - cu_q[:-1], output_size=T)
    scale = D ** -0.5 if scale is None else scale
    qg = q.float().view(T, hkv, H // hkv, D)
    with torch.autocast(q.device.type, enabled=False):  # as lse_shift: fp32, not autocast's bf16
        return torch.einsum("tkgd,tkd->kgt", qg, mean[seq].float()).reshape(H, T) * scale
