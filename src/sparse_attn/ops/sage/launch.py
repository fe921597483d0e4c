"""Launchers of the 8-bit path: quantize Q/K (int8) and V (FP8, transposed), then run the
block-sparse forward kernel with its QUANT flag. No autograd here.

Dense inputs are ``[B, H, L, D]``; varlen inputs packed ``[T, H, D]`` with ``cu_seqlens``: every
statistic is then taken per sequence, as for a dense batch row: K's mean and V's channel scales
(``kv_stats``), and the scale groups, which start at every sequence's first token and never straddle
two sequences (so the attention kernel sees one K scale per key tile on packed inputs too). A packed
sequence is quantized as if it were called alone, as the CPU twin does.
"""
from __future__ import annotations

import torch
import triton

from ..block_sparse import launch as bs_launch
from . import kernels
from .granularity import GRANULARITY
from .reference import lse_shift, packed_lse_shift

TILE = 128  # rows per V program, and per row program whose group spans more than 32 rows
ROW_WARPS = 8


def row_shape(span: int) -> tuple:
    """(rows, warps) of a quant_rows_kernel program for groups of ``span`` rows: a multiple of the span.
    H200, 32 heads x d128 (results/sage-quant-h200/shapes-rows-after-h200.json), Q in 16-row groups
    at 32K / 128K tokens: 32 rows on 2 warps 0.102 / 0.382 ms (the copy rate: 0.097 / 0.382), 128 on
    8 warps 0.113 / 0.423; K's 128-key groups take 128 rows, fastest on 8 warps (0.118 / 0.448)."""
    return (32, 2) if span <= 32 else (TILE, ROW_WARPS)


def _as_bhld(x: torch.Tensor, varlen: bool) -> tuple:
    """(B, H, L, strides (b, h, l)) of a dense [B, H, L, D] or packed [T, H, D] tensor."""
    if varlen:
        return 1, x.shape[1], x.shape[0], (0, x.stride(1), x.stride(0))
    return x.shape[0], x.shape[1], x.shape[2], (x.stride(0), x.stride(1), x.stride(2))


def _check_packed(cu: torch.Tensor | None, max_len: int | None) -> None:
    if cu is None or max_len is None:
        raise ValueError("packed 8-bit quantization needs cu_seqlens and the longest sequence's length")


def _grid(varlen: bool, cu: torch.Tensor | None, B: int, H: int, L: int, max_len: int | None,
          tile: int = TILE) -> tuple:
    """(grid, SPLIT_GRID): (row tiles of ``tile`` rows, B * H) over dense rows, or over the packed
    sequences of ``cu`` (int32 [S + 1], the longest ``max_len``); past 65535 (sequence, head) pairs
    (row tiles, H, B) (bs_launch.grid_rows)."""
    if not varlen:
        rows, split = bs_launch.grid_rows(B, H)
        return (triton.cdiv(L, tile), *rows), split
    _check_packed(cu, max_len)
    rows, split = bs_launch.grid_rows(cu.numel() - 1, H)
    return (triton.cdiv(max(max_len, 1), tile), *rows), split


def vt_columns(total: int, num_seqs: int) -> int:
    """Columns of the packed FP8 V^T: sequence b starts at kernels.vt_column0 (16-aligned, after
    sequence b - 1's columns rounded up to 16), so T + 16 * S rounded up to 16 hold them all."""
    return bs_launch._round_up(total + 16 * num_seqs, 16)


def quantize_rows(x: torch.Tensor, span: int, period: int, mean: torch.Tensor | None, varlen: bool,
                  cu: torch.Tensor | None = None, max_len: int | None = None):
    """int8 copy of x (same shape, contiguous) and fp32 scales per row: dense ``[B, H, L]``,
    varlen ``[H, T]``. ``mean`` (fp32 ``[B, H, D]``, varlen ``[S, H, D]``: k_mean) is subtracted
    first when given.
    Varlen: ``cu`` (int32 cu_seqlens, on x's device) and ``max_len`` (its longest sequence): the
    groups start at each sequence."""
    B, H, L, (sxb, sxh, sxm) = _as_bhld(x, varlen)
    D = x.shape[-1]
    xq = torch.empty(x.shape, device=x.device, dtype=torch.int8)
    _, _, _, (sqb, sqh, sqm) = _as_bhld(xq, varlen)
    # rows padded to 16 bytes: the attention kernel reads K scales through a TMA descriptor
    lp = bs_launch._round_up(max(L, 1), 4)
    scale = torch.empty((H, lp) if varlen else (B, H, lp), device=x.device, dtype=torch.float32)[..., :L]
    ssb, ssh = (0, scale.stride(0)) if varlen else (scale.stride(0), scale.stride(1))
    smb, smh = (mean.stride(0), mean.stride(1)) if mean is not None else (0, 0)  # [B or S, H, D]
    tile, warps = row_shape(span)
    grid, split = _grid(varlen, cu, B, H, L, max_len, tile)
    kernels.quant_rows_kernel[grid](
        x, mean, xq, scale, cu, sxb, sxh, sxm, smb, smh, sqb, sqh, sqm, ssb, ssh, H, L,
        HEAD_DIM=D, D_PAD=bs_launch._d_pad(D), TILE=tile, SPAN=span, PERIOD=period, SMOOTH=mean is not None,
        IS_VARLEN=varlen, SPLIT_GRID=split, num_warps=warps,
        enable_fp_fusion=False)  # x * (1 / scale) + 0.5 rounded twice, as the twin does: no FMA
    return xq, scale


def quantize_v_fp8(v: torch.Tensor, varlen: bool, cu: torch.Tensor | None = None, max_len: int | None = None,
                   scale: torch.Tensor | None = None):
    """(FP8 e4m3 V^T, fp32 per-channel scale ``[B, H, D]``, varlen per sequence ``[S, H, D]``). V^T is dense ``[B, H, D, Lp]``
    (the token dim padded to a multiple of 16 for TMA, the pad zeroed); varlen ``[H, D, columns]``,
    with ``cu`` / ``max_len`` as in quantize_rows, each sequence from its own 16-aligned column
    (vt_columns; zeros up to its next multiple of 16, the rest of the gaps never read). ``scale``: V's
    channel scales when kv_stats already took them (else taken here)."""
    B, H, L, (svb, svh, svm) = _as_bhld(v, varlen)
    D = v.shape[-1]
    grid, split = _grid(varlen, cu, B, H, L, max_len)
    if scale is None:
        scale = kv_stats(None, v, varlen, cu, max_len)[1]
    lp = vt_columns(L, cu.numel() - 1) if varlen else bs_launch._round_up(max(L, 1), 16)
    vt = torch.empty(((H, D, lp) if varlen else (B, H, D, lp)), device=v.device, dtype=torch.float8_e4m3fn)
    if lp > L and not varlen:
        vt[..., L:].zero_()
    stb, sth, std = (0, vt.stride(0), vt.stride(1)) if varlen else (vt.stride(0), vt.stride(1), vt.stride(2))
    kernels.quant_v_fp8_kernel[grid](
        v, scale, vt, cu, svb, svh, svm, scale.stride(0), scale.stride(1), stb, sth, std, H, L,
        HEAD_DIM=D, D_PAD=bs_launch._d_pad(D), TILE=TILE, IS_VARLEN=varlen, SPLIT_GRID=split, num_warps=4)
    return vt, scale


# tokens per kv_partials program, rows per load, warps. H200, K and V of 32 heads x d128
# (results/sage-quant-h200/shapes-before-h200.json): 64 rows on 4 warps 0.141 ms at 32K tokens (92% of
# the copy rate), 0.512 at 128K (at it); 32 rows, fewer registers but half the loads in flight a
# thread, 0.247 / 0.835
STAT_CHUNK, STAT_ROWS, STAT_WARPS = 1024, 64, 4


def kv_stats(k: torch.Tensor | None, v: torch.Tensor | None, varlen: bool, cu: torch.Tensor | None = None,
             max_len: int | None = None) -> tuple:
    """(K's smoothing mean, V's FP8 channel scale), each fp32 ``[B, H, D]`` (varlen: per sequence,
    ``[S, H, D]``), or None where that input is None: one launch reads K and V once each, a second
    reduces its chunks. The mean is :func:`reference.smoothing_mean` of K's mean over tokens (an empty
    sequence's: 0; no tokens at all: None); the scale is :func:`reference.v_channel_scale` of V's max
    of |v| over tokens (NaN kept: such a channel gets a NaN scale). ``cu`` / ``max_len`` as in
    quantize_rows. Deterministic: fixed chunks, reduced in order."""
    if k is not None and k.shape[0 if varlen else 2] == 0:  # no keys at all: nothing to smooth
        k = None
    x = k if k is not None else v
    if x is None:
        return None, None
    B, H, L, _ = _as_bhld(x, varlen)
    D = x.shape[-1]
    if varlen:
        _check_packed(cu, max_len)
        B, span = cu.numel() - 1, max_len
    else:
        span = L
    chunks = triton.cdiv(max(span, 1), STAT_CHUNK)
    part = torch.empty(2, B, H, chunks, D, device=x.device, dtype=torch.float32)  # [K sums, V amaxes]
    _, _, _, (skb, skh, skm) = _as_bhld(k, varlen) if k is not None else (0, 0, 0, (0, 0, 0))
    _, _, _, (svb, svh, svm) = _as_bhld(v, varlen) if v is not None else (0, 0, 0, (0, 0, 0))
    rows, split = bs_launch.grid_rows(B, H)
    flags = dict(HEAD_DIM=D, D_PAD=bs_launch._d_pad(D), K_SUM=k is not None, V_AMAX=v is not None, IS_VARLEN=varlen,
                 SPLIT_GRID=split)
    kernels.kv_partials_kernel[(chunks, *rows)](
        k, v, part[0], part[1], cu, skb, skh, skm, svb, svh, svm, *part.stride()[1:4], H, L,
        CHUNK=STAT_CHUNK, ROWS=STAT_ROWS, **flags, num_warps=STAT_WARPS)
    out = torch.empty(2, B, H, D, device=x.device, dtype=torch.float32)  # [mean, V scale]
    kernels.kv_finish_kernel[(1, *rows)](
        part[0], part[1], out[0], out[1], cu, *part.stride()[1:4], *out.stride()[1:3], H, L, chunks, **flags,
        num_warps=1)
    return (out[0] if k is not None else None), (out[1] if v is not None else None)


def k_mean(k: torch.Tensor, varlen: bool, cu: torch.Tensor | None = None,
           max_len: int | None = None) -> torch.Tensor | None:
    """fp32 per-head mean of K over tokens, dense ``[B, Hkv, D]``, varlen per sequence ``[S, Hkv, D]``
    (``cu`` / ``max_len`` as in quantize_rows; an empty sequence's mean is 0; no tokens at all: None):
    subtracting it changes every score of a query row by the same amount, which softmax ignores.
    Non-finite channels are not smoothed (:func:`reference.smoothing_mean`). kv_stats without V."""
    return kv_stats(k, None, varlen, cu, max_len)[0]


def forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous: bool, terms, n_terms: int,
            cu_q, cu_k, block_q: int, block_k: int, sm_scale: float, max_q: int, max_k: int, quant: int,
            granularity: str, smooth_k: bool, unsmoothed_lse: bool = False):
    """Returns (out in q's dtype, lse fp32). quant: 1 int8 Q.K, 2 also FP8 P.V. The kernel's LSE is that
    of the smoothed scores; ``unsmoothed_lse`` adds back what smoothing removed (``scale * q . mean_k``,
    with the K mean the quantization already took), giving the LSE of the scores as the caller wrote them."""
    varlen = cu_q is not None
    (qs, qp), (ks, kp) = GRANULARITY[granularity]
    q8, q_scale = quantize_rows(q, qs, qp, None, varlen, cu_q, max_q)
    # K's mean and V's FP8 channel scale from one pass over both
    mean, v_scale = kv_stats(k if smooth_k else None, v if quant == 2 else None, varlen, cu_k, max_k)
    k8, k_scale = quantize_rows(k, ks, kp, mean, varlen, cu_k, max_k)
    if quant == 2:
        vq, v_scale = quantize_v_fp8(v, varlen, cu_k, max_k, v_scale)
    else:
        vq, v_scale = v, None
    out, lse = bs_launch.forward(q8, k8, vq, counts, n_full, full_start, indices, mask_ids, contiguous, terms,
                                 n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, 1,
                                 (q_scale, k_scale, v_scale), quant, q.dtype, k_scale_span=ks if kp == 1 else 0)
    if unsmoothed_lse and mean is not None:  # (None: smoothing off, or no keys at all)
        lse = lse + (packed_lse_shift(q, mean, cu_q, sm_scale) if varlen else lse_shift(q, mean, sm_scale))
    return out, lse
