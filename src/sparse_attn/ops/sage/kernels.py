"""Quantization kernels of the 8-bit attention path (the attention itself is the block-sparse
forward kernel with its QUANT flag). @triton.jit only.

Symbol legend
    i_b, i_h     program's batch and head (the grid is (row tiles, B * H))   o_m, o_d   row / head-dim offsets
                 (with SPLIT_GRID (row tiles, H, B): block_sparse.kernels' legend)
    b_*          on-chip blocks                              m_*        masks
    SPAN, PERIOD a scale group: rows of one SPAN-row span that are equal modulo PERIOD
                 (PERIOD 1: SPAN contiguous rows; SageAttention's per-block / per-warp groups;
                 PERIOD 8: the rows one MMA thread holds, its per-thread groups)
Varlen (IS_VARLEN): packed [T, H, D] inputs, sequence b spans tokens [CU[b], CU[b + 1]) and i_b is the
sequence; row offsets count from its first token, so scale groups start at every sequence's start
(as on a dense batch row) and never straddle two sequences.
"""
import triton
import triton.language as tl

from ..block_sparse.kernels import _batch_head, vt_column0
from .granularity import FP8_MAX as _FP8_MAX

INT8_MAX = tl.constexpr(127.0)
FP8_MAX = tl.constexpr(_FP8_MAX)


@triton.jit
def _max_nan(a, b):
    """max that keeps a NaN (the hardware max drops it), so one reduction finds a row's or a channel's
    largest magnitude and whether it holds a NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sequence(CU, H, L, IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr):
    """(batch or sequence, head, its first token, its length) of a (tiles, batch * head) program
    (SPLIT_GRID: block_sparse.kernels' legend)."""
    i_b, i_h = _batch_head(H, SPLIT_GRID)
    if IS_VARLEN:
        s0 = tl.load(CU + i_b)
        n = tl.load(CU + i_b + 1) - s0
    else:
        s0 = 0
        n = L
    return i_b, i_h, s0, n


@triton.jit
def _row_tile(CU, H, L, TILE: tl.constexpr, D_PAD: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr):
    """(batch or sequence, head, row offsets within it, head-dim offsets, its first token, its
    length) of a (row tile, batch * head) program."""
    i_b, i_h, s0, n = _sequence(CU, H, L, IS_VARLEN, SPLIT_GRID)
    return i_b, i_h, tl.program_id(0) * TILE + tl.arange(0, TILE), tl.arange(0, D_PAD), s0, n


@triton.jit
def quant_rows_kernel(
    X, MEAN, XQ, SCALE, CU,
    stride_xb, stride_xh, stride_xm,
    stride_mb, stride_mh,
    stride_qb, stride_qh, stride_qm,
    stride_sb, stride_sh,
    H, L,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, SPAN: tl.constexpr,
    PERIOD: tl.constexpr, SMOOTH: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr,
):
    """Grid (row tiles, B * H), B the sequences when IS_VARLEN. int8 rows of X (minus MEAN [.., D]
    when SMOOTH) with one fp32 scale per group, written per row to SCALE (token stride 1) so the
    attention kernel needs no group logic."""
    i_b, i_h, o_m, o_d, s0, n = _row_tile(CU, H, L, TILE, D_PAD, IS_VARLEN, SPLIT_GRID)
    if tl.program_id(0) * TILE >= n:
        return
    m_m = o_m < n
    m_md = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    o_t = s0 + o_m  # token index (the row within a dense batch row)
    p_x = X + i_b.to(tl.int64) * stride_xb + i_h.to(tl.int64) * stride_xh + o_t.to(tl.int64)[:, None] * stride_xm + o_d[None, :]
    b_x = tl.load(p_x, mask=m_md, other=0.0).to(tl.float32)  # [TILE, D]
    if SMOOTH:  # (padded head-dim columns load 0 and subtract a 0 mean)
        b_mean = tl.load(MEAN + i_b * stride_mb + i_h * stride_mh + o_d, mask=o_d < HEAD_DIM, other=0.0)
        b_x = b_x - b_mean[None, :]
    # The kernel is instruction-bound at H200 copy rates, so the per-element work is kept to a minimum
    # (sage_stats_probe / quant_shape_probe, NOTES 8-bit): one NaN-keeping max of |x| a row finds both the
    # row's scale and whether it holds a NaN or inf; rows past the end are dropped per row, not per element.
    b_amax = tl.reduce(tl.abs(b_x), 1, _max_nan)  # [TILE]
    # a group holding a NaN or inf gets a NaN scale (what it touches comes out NaN, as without
    # quantization; its int8 values are then never used); the others scale from their finite values.
    # (The hardware max drops NaN, and an inf amax rounded the whole group to 0: either way a
    # non-finite input vanished silently.)
    b_bad = tl.where(m_m & ~(b_amax < float("inf")), 1.0, 0.0)
    b_amax = tl.where(m_m & (b_amax < float("inf")), b_amax, 0.0)
    b_g = tl.max(tl.reshape(b_amax, [TILE // SPAN, SPAN // PERIOD, PERIOD]), 1)  # [TILE // SPAN, PERIOD]
    b_amax = tl.reshape(tl.broadcast_to(b_g[:, None, :], [TILE // SPAN, SPAN // PERIOD, PERIOD]), [TILE])
    b_gb = tl.max(tl.reshape(b_bad, [TILE // SPAN, SPAN // PERIOD, PERIOD]), 1)
    b_bad = tl.reshape(tl.broadcast_to(b_gb[:, None, :], [TILE // SPAN, SPAN // PERIOD, PERIOD]), [TILE])
    b_scale = tl.where(b_amax > 0, b_amax / INT8_MAX, 1.0)
    # one correctly rounded reciprocal a row, then a multiply an element (the twin does the same; `/`
    # compiles to an approximate division per element)
    b_xs = b_x * tl.math.div_rn(tl.full([TILE], 1.0, tl.float32), b_scale)[:, None]
    b_q = (b_xs + tl.where(b_xs >= 0, 0.5, -0.5)).to(tl.int8)  # round half away from zero
    p_q = XQ + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + o_t.to(tl.int64)[:, None] * stride_qm + o_d[None, :]
    tl.store(p_q, b_q, mask=m_md)
    tl.store(SCALE + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + o_t,
             tl.where(b_bad > 0, float("nan"), b_scale), mask=m_m)


@triton.jit
def quant_v_fp8_kernel(
    V, SCALE, VT, CU,
    stride_vb, stride_vh, stride_vm,
    stride_sb, stride_sh,
    stride_tb, stride_th, stride_td,
    H, L,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, IS_VARLEN: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
):
    """Grid (row tiles, B * H), B the sequences when IS_VARLEN. V / SCALE (one scale per channel) as
    FP8 e4m3, stored transposed [.., D, L] (token stride 1) so P.V reads V K-major, as FP8
    tensor-core MMAs want it. Varlen: sequence b's columns start at vt_column0(CU[b], b), a multiple of
    16 (TMA needs 16-byte aligned starts), and its columns up to the next multiple of 16 are zeros."""
    i_b, i_h, o_m, o_d, s0, n = _row_tile(CU, H, L, TILE, D_PAD, IS_VARLEN, SPLIT_GRID)
    if tl.program_id(0) * TILE >= n:
        return
    m_d = o_d < HEAD_DIM
    m_md = (o_m < n)[:, None] & m_d[None, :]
    p_v = V + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh + (s0 + o_m).to(tl.int64)[:, None] * stride_vm + o_d[None, :]
    b_v = tl.load(p_v, mask=m_md, other=0.0).to(tl.float32)  # [TILE, D]
    b_s = tl.load(SCALE + i_b * stride_sb + i_h * stride_sh + o_d, mask=m_d, other=1.0)
    b_v8 = tl.trans((b_v / b_s[None, :]).to(VT.dtype.element_ty))  # [D, TILE]
    if IS_VARLEN:
        c0 = vt_column0(s0, i_b)
        m_t = (o_m < (n + 15) // 16 * 16)[:, None] & m_d[None, :]  # zeros up to the aligned end
    else:
        c0 = 0
        m_t = m_md
    p_t = VT + i_b.to(tl.int64) * stride_tb + i_h.to(tl.int64) * stride_th + o_d.to(tl.int64)[:, None] * stride_td + (c0 + o_m)[None, :]
    tl.store(p_t, b_v8, mask=tl.trans(m_t))


@triton.jit
def kv_partials_kernel(
    K, V, KPART, VPART, CU,
    stride_kb, stride_kh, stride_km,
    stride_vb, stride_vh, stride_vm,
    stride_pb, stride_ph, stride_pc,
    H, L,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
    K_SUM: tl.constexpr, V_AMAX: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr,
):
    """Grid (chunks, B * H; SPLIT_GRID: H, B), B the sequences when IS_VARLEN: per (batch row or
    sequence, head, CHUNK-token chunk) the fp32 sum of K's rows (K_SUM) and the max of |V| (V_AMAX,
    NaN kept) into KPART / VPART [B, H, chunks, D] (the same strides). One launch reads K and V once
    each; chunks past a sequence's end write zeros, neutral for both, so the caller reduces over all
    chunks in a fixed order (deterministic, no atomics)."""
    i_c = tl.program_id(0)
    i_b, i_h, s0, n = _sequence(CU, H, L, IS_VARLEN, SPLIT_GRID)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    # elementwise over [ROWS, D] tiles, one cross-row reduction at the end (not one per tile)
    b_ks = tl.zeros([ROWS, D_PAD], tl.float32)
    b_va = tl.zeros([ROWS, D_PAD], tl.float32)
    hi = tl.minimum((i_c + 1) * CHUNK, n)
    for r0 in range(i_c * CHUNK, hi, ROWS):
        o_m = r0 + tl.arange(0, ROWS)
        o_t = (s0 + o_m).to(tl.int64)[:, None]
        m_md = (o_m < hi)[:, None] & m_d[None, :]
        if K_SUM:  # (the pointer of an input not asked for is None: touched only under its flag)
            p_k = K + i_b.to(tl.int64) * stride_kb + i_h.to(tl.int64) * stride_kh + o_t * stride_km + o_d[None, :]
            b_ks += tl.load(p_k, mask=m_md, other=0.0).to(tl.float32)
        if V_AMAX:
            p_v = V + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh + o_t * stride_vm + o_d[None, :]
            b_va = _max_nan(b_va, tl.abs(tl.load(p_v, mask=m_md, other=0.0).to(tl.float32)))
    p_out = i_b.to(tl.int64) * stride_pb + i_h * stride_ph + i_c * stride_pc + o_d
    if K_SUM:
        tl.store(KPART + p_out, tl.sum(b_ks, 0), mask=m_d)
    if V_AMAX:
        tl.store(VPART + p_out, tl.reduce(b_va, 0, _max_nan), mask=m_d)


@triton.jit
def kv_finish_kernel(
    KPART, VPART, MEAN, VSCALE, CU,
    stride_pb, stride_ph, stride_pc,
    stride_ob, stride_oh,
    H, L, CHUNKS,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, K_SUM: tl.constexpr, V_AMAX: tl.constexpr,
    IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr,
):
    """Grid (1, B * H; SPLIT_GRID: 1, H, B): kv_partials_kernel's chunks reduced in order into K's
    smoothing mean (the sum over the sequence's tokens / their count, at least 1; a non-finite
    channel 0, as reference.smoothing_mean) and V's FP8 channel scale (amax / FP8_MAX, 1 for an
    all-zero channel, NaN for one holding a NaN or inf, as reference.v_channel_scale), each
    [B, H, D] at MEAN / VSCALE (the same strides). One launch instead of a dozen small torch ops:
    the host time of a short 8-bit call (benchmarks/launch_overhead.py --quant)."""
    i_b, i_h, s0, n = _sequence(CU, H, L, IS_VARLEN, SPLIT_GRID)
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    p_part = i_b.to(tl.int64) * stride_pb + i_h * stride_ph + o_d
    p_out = i_b.to(tl.int64) * stride_ob + i_h * stride_oh + o_d
    if K_SUM:
        b_sum = tl.zeros([D_PAD], tl.float32)
        for c in range(CHUNKS):
            b_sum += tl.load(KPART + p_part + c * stride_pc, mask=m_d, other=0.0)
        b_mean = tl.math.div_rn(b_sum, tl.full([D_PAD], 1.0, tl.float32) * tl.maximum(n, 1).to(tl.float32))
        tl.store(MEAN + p_out, tl.where(tl.abs(b_mean) < float("inf"), b_mean, 0.0), mask=m_d)  # NaN: 0 too
    if V_AMAX:
        b_amax = tl.zeros([D_PAD], tl.float32)
        for c in range(CHUNKS):
            b_amax = _max_nan(b_amax, tl.load(VPART + p_part + c * stride_pc, mask=m_d, other=0.0))
        # times the fp32 reciprocal, as torch's CUDA division by a scalar computes amax / 448 (the twin on
        # a GPU): the exact quotient differed from it by an ulp in some channels, and every dequantized
        # value of those channels with it (test_quantization_kernels_match_the_twin_exactly on the H200)
        b_scale = tl.where(b_amax > 0, b_amax * (1.0 / FP8_MAX), 1.0)
        tl.store(VSCALE + p_out, tl.where(b_amax < float("inf"), b_scale, float("nan")), mask=m_d)  # NaN: NaN
