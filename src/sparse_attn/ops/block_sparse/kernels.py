"""Block-sparse FlashAttention kernels (forward, backward delta, dK/dV and dQ). @triton.jit only.

Symbol legend
    i_m, i_n   program's query / key tile       i_b, i_h, i_hk   batch, query head, kv head
    o_m, o_n   token offsets of the tile        o_d              head-dim offsets
    m_*        boolean masks                    p_*              pointers
    b_*        on-chip blocks                   BLOCK_Q/BLOCK_K  the layout's blocks
    BLOCK_M/BLOCK_N  the kernel's tiles (divide BLOCK_Q / BLOCK_K)
    count, slot      a layout row's length and position in it
Positions: query row i has position p = i + (k_len - q_len) (bottom-right alignment); masks are
evaluated on (p, j) from the int32 term table (see sparse_attn.masks).
Varlen: sequence b spans tokens [BOUNDS[b * SEQ_STEP], BOUNDS[b * SEQ_STEP + 1]): SEQ_STEP 1 reads
cu_seqlens (adjacent sequences), 2 reads (start, end) pairs (grouped attention: K/V slices may overlap).
SPLIT_GRID: grid axis 1 holds batch * H + head (H the kernel's heads: query heads, or kv heads for
dK/dV) while that fits CUDA's 65535; past it (batch 2048 x 32 heads failed at launch) axis 1 holds the
head and axis 2 the batch (_batch_head). A constexpr, so the usual grid keeps the code it had: written
for both at once, the dK/dV kernel's dense backward ran 9% slower on the H100 (ptxas scheduled its
loop differently; benchmarks/NOTES.md, "Grid axes").
TUNE_CLASS (the launched kernels): unused in the body; the autotune key's length class (launch._tune_class),
an argument because Triton's autotuner keys on arguments only; not specialized, so it never recompiles.
QUANT (forward only): 0 fp16/bf16 inputs; 1 int8 Q/K with per-row fp32 scales (SageAttention's
per-block/warp/thread groups expanded to rows); 2 as 1 plus FP8 e4m3 P.V with V transposed
[.., D, L] and scaled per channel (packed: [H, D, columns], sequence b from column vt_column0).
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
N_FIELDS = tl.constexpr(7)
# the pieces of a dK/dV walk in the backward's wave order (_dkdv_head's seg), s0 the row's start slot
SEG_ROUND = tl.constexpr(0)   # the whole row, from s0 round to it
SEG_FROM_S0 = tl.constexpr(1)  # from s0 to the row's end
SEG_WHOLE = tl.constexpr(2)   # the whole row from slot 0
SEG_TO_S0 = tl.constexpr(3)   # from slot 0 to s0
SEG_NONE = tl.constexpr(4)    # nothing (the masked pass's extra step)


@triton.jit
def _allowed(p, j, TERMS, mid, N_TERMS: tl.constexpr, PER_KEY: tl.constexpr):
    """OR over the mask's terms of its interval constraints. p: query positions, j: key positions, one
    along each axis of the tile (broadcastable int32 blocks).
    Each term allows, for each query p, one interval of keys: [max(k_lo, p - left, doc start), min(k_hi,
    p + right, doc end)], empty where p is outside [q_lo, q_hi]; and, the same constraints read the
    other way, for each key j one interval of queries: [max(q_lo, j - right, doc start), min(q_hi,
    j + left, doc end)], empty where j is outside [k_lo, k_hi]. The bounds are formed along the tile's
    first axis (the queries, or with PER_KEY the keys: the transposed dK/dV tiles), whose vectors cost a
    thread a couple of registers where the other axis's cost it 16 in a wgmma accumulator's layout;
    each score then pays two compares a term. Written elementwise (six compares, five ANDs, and for
    documents a division per score and term) a masked tile cost as much as three unmasked ones
    (benchmarks/NOTES.md, backward item 30, "Masks as intervals"). Fields stay within +-2**30
    (masks.INF), so a position +- a field and a document's end fit int32."""
    for t in tl.static_range(N_TERMS):
        p_t = TERMS + (mid * N_TERMS + t) * N_FIELDS
        q_lo = tl.load(p_t + 0)
        q_hi = tl.load(p_t + 1)
        k_lo = tl.load(p_t + 2)
        k_hi = tl.load(p_t + 3)
        left = tl.load(p_t + 4)
        right = tl.load(p_t + 5)
        doc = tl.load(p_t + 6)
        if PER_KEY:  # the queries each key j allows: p - left <= j <= p + right
            x, y, x_lo, x_hi, y_lo, y_hi, below, above = j, p, k_lo, k_hi, q_lo, q_hi, right, left
        else:  # the keys each query p allows
            x, y, x_lo, x_hi, y_lo, y_hi, below, above = p, j, q_lo, q_hi, k_lo, k_hi, left, right
        lo = tl.maximum(x - below, y_lo)
        hi = tl.minimum(x + above, y_hi)
        if doc > 0:
            # x's document: floor(x / doc) with truncating integer division, valid for negative x
            d0 = (tl.where(x >= 0, x, x - doc + 1) // doc) * doc
            lo = tl.maximum(lo, d0)
            hi = tl.minimum(hi, d0 + doc - 1)
        hi = tl.where((x >= x_lo) & (x <= x_hi), hi, lo - 1)  # x outside the term's range: nothing
        ok_t = (y >= lo) & (y <= hi)
        if t == 0:
            ok = ok_t
        else:
            ok = ok | ok_t
    return ok


@triton.jit
def _seq_bounds(CU_Q, CU_K, i_b, Lq, Lk, SEQ_STEP, IS_VARLEN: tl.constexpr):
    """(first q token, q_len, first k token, k_len) of sequence i_b (see the legend for SEQ_STEP)."""
    if IS_VARLEN:
        q0 = tl.load(CU_Q + i_b * SEQ_STEP)
        q_len = tl.load(CU_Q + i_b * SEQ_STEP + 1) - q0
        k0 = tl.load(CU_K + i_b * SEQ_STEP)
        k_len = tl.load(CU_K + i_b * SEQ_STEP + 1) - k0
    else:
        q0 = 0
        q_len = Lq
        k0 = 0
        k_len = Lk
    return q0, q_len, k0, k_len


@triton.jit
def _clamped_bounds(q0, q_len, k0, k_len, T_Q, T_K):
    """A sequence's bounds cut to the packed tensors (T_Q query, T_K key tokens): offsets the host never
    read (a device plan inside CUDA graph capture) can then make a sequence shorter or empty, but never
    send a load or store outside q, k, v, out or lse."""
    q_end = tl.minimum(tl.maximum(q0 + q_len, 0), T_Q)
    q0 = tl.minimum(tl.maximum(q0, 0), q_end)
    k_end = tl.minimum(tl.maximum(k0 + k_len, 0), T_K)
    k0 = tl.minimum(tl.maximum(k0, 0), k_end)
    return q0, q_end - q0, k0, k_end - k0


@triton.jit
def _device_row(q_len, k_len, qb, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr):
    """A dense (or bottom-right causal) row's plan from the sequence's lengths, as varlen._row_by_arithmetic
    builds it on the host: (kept blocks, unmasked blocks). The kept blocks are key blocks 0 .. count - 1
    in slot order, the causal edge's partial blocks a suffix of them, and a cut last block (k_len not a
    multiple of BLOCK_K) is walked with the masked ones. Query block qb holds a row (qb * BLOCK_Q < q_len:
    the caller returned otherwise)."""
    nk = (k_len + BLOCK_K - 1) // BLOCK_K
    count = nk
    partial = nk
    if CAUSAL:
        offset = k_len - q_len
        p_first = qb * BLOCK_Q + offset
        p_last = tl.minimum((qb + 1) * BLOCK_Q, q_len) - 1 + offset
        count = tl.where(p_last >= 0, tl.minimum(nk, tl.maximum(p_last, 0) // BLOCK_K + 1), 0)
        first = tl.maximum(tl.maximum(p_first + 1, 0) // BLOCK_K, 0)  # the first block whose last key is past p_first
        first_partial = (first < count) & (tl.minimum((first + 1) * BLOCK_K, k_len) - 1 > p_first)
        partial = tl.where(first_partial, first, count)
    cut = ((k_len % BLOCK_K) != 0) & (count == nk) & (nk - 1 < partial)  # the cut last block, kept, not partial
    return count, partial - cut.to(tl.int32)


@triton.jit
def _device_window_row(q_len, k_len, qb, window, sinks, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """A bottom-right causal sliding window's row (DEVICE_PLAN 3: query at position p sees keys
    p - window < j <= p, and with ``sinks`` > 0 also j < sinks, j <= p: patterns.local, or patterns.streaming's
    attention sinks) from the sequence's lengths, as the host plan of those layouts schedules it. Returns
    (kept blocks, unmasked blocks, f1, u2, e1, k2, c_hi): the unmasked blocks are the runs [0, f1) (sink blocks)
    and [u2, c_hi) (the window's), walked first in that order; the masked ones, walked after them in
    ascending order, are [f1, e1), [k2, u2) and [c_hi, kept run's end) (the window's blocks before and after its
    unmasked run; the cut last block, k_len not a multiple of BLOCK_K, is masked). Without sinks f1 = e1 = 0
    and the kept blocks are one run from k2. Query block qb holds a row."""
    offset = k_len - q_len
    p_first = qb * BLOCK_Q + offset
    p_last = tl.minimum((qb + 1) * BLOCK_Q, q_len) - 1 + offset
    # the keys some row sees: [max(p_first - window + 1, 0), p_last] (consecutive rows' windows overlap) and
    # the sinks [0, min(sinks, p_last + 1))
    b_hi = tl.where(p_last >= 0, tl.maximum(p_last, 0) // BLOCK_K + 1, 0)
    b_lo = tl.minimum(tl.maximum(p_first - window + 1, 0) // BLOCK_K, b_hi)
    s_hi = (tl.minimum(sinks, tl.maximum(p_last + 1, 0)) + BLOCK_K - 1) // BLOCK_K
    # every row sees every key of block b iff (b + 1) * BLOCK_K - 1 <= p_first (b < c_hi; a cut block never)
    # and the block misses the keys the last row sees neither as sink nor in its window, [sinks, p_last - window]
    c_hi = tl.minimum(tl.maximum(p_first + 1, 0) // BLOCK_K, k_len // BLOCK_K)
    f1 = tl.minimum(sinks // BLOCK_K, c_hi)
    gap = sinks <= p_last - window
    u2 = tl.maximum(tl.where(gap, (tl.maximum(p_last - window + 1, 0) + BLOCK_K - 1) // BLOCK_K, 0), f1)
    n_full = f1 + tl.maximum(c_hi - u2, 0)
    # the kept runs [0, s_hi) and [b_lo, b_hi), as [0, e1) and [k2, b_hi): one run [0, b_hi) when they touch
    merged = s_hi >= b_lo
    e1 = tl.where(merged, f1, s_hi)
    k2 = tl.where(merged, f1, b_lo)
    empty = u2 >= c_hi  # no window run: its masked slots all come after k2
    u2 = tl.where(empty, b_hi, u2)
    c_hi = tl.where(empty, b_hi, c_hi)
    return e1 + b_hi - k2, n_full, f1, u2, e1, k2, c_hi


@triton.jit
def _batch_head(H, SPLIT_GRID: tl.constexpr):
    """(batch or sequence, head) of a program of a (tiles, B * H) grid, or with SPLIT_GRID of a
    (tiles, H, B) grid (see the legend)."""
    if SPLIT_GRID:
        i_b = tl.program_id(2)
        i_h = tl.program_id(1)
    else:
        i_bh = tl.program_id(1)
        i_b = i_bh // H
        i_h = i_bh % H
    return i_b, i_h


@triton.jit
def _query_tile(CU_Q, CU_K, H, G, Lq, Lk, SEQ_STEP, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
                BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT_GRID: tl.constexpr,
                REVERSE: tl.constexpr, N_SPLIT, KV_SPLIT: tl.constexpr):
    """Where a (query tile, batch * head) program of the forward / dQ grid stands: its ids, its
    sequence's bounds, and the offsets of its layout row (counts at p_cnt, slots from p_row). The
    caller returns early when i_m * BLOCK_M >= q_len (a helper cannot end its caller).
    REVERSE: the grid's first program takes the last query tile (launch.ROW_ORDER), so on causal rows,
    longest last, the long tiles start first and the short ones fill the final wave.
    KV_SPLIT (forward): axis 0 holds N_SPLIT programs per query tile (tile * N_SPLIT + part)."""
    pid = tl.program_id(0)
    n_tiles = tl.num_programs(0)
    if KV_SPLIT:
        pid = pid // N_SPLIT
        n_tiles = n_tiles // N_SPLIT
    i_m = n_tiles - 1 - pid if REVERSE else pid
    i_b, i_h = _batch_head(H, SPLIT_GRID)
    i_hk = i_h // G
    q0, q_len, k0, k_len = _seq_bounds(CU_Q, CU_K, i_b, Lq, Lk, SEQ_STEP, IS_VARLEN)
    qb = (i_m * BLOCK_M) // BLOCK_Q
    p_cnt = i_b * stride_cb + i_h * stride_ch + qb
    p_row = i_b * stride_ib + i_h * stride_ih + qb * stride_iq
    return i_m, i_b, i_h, i_hk, q0, q_len, k0, k_len, p_cnt, p_row


@triton.jit
def vt_column0(s0, i_b):
    """First column of packed sequence i_b (first token s0) in a varlen FP8 V^T [H, D, columns]: the
    least multiple of 16 at or above s0 + 16 * i_b, so its TMA descriptor starts 16-byte aligned.
    Sequence b's columns, rounded up to 16, end at or before sequence b + 1's first, and the last
    end within round_up(T + 16 * B, 16) (sparse_attn.ops.sage.launch.vt_columns)."""
    return (s0 + 16 * i_b + 15) // 16 * 16


@triton.jit
def _rows_desc(P, offset, n_rows, stride_row, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr, USE_TMA: tl.constexpr):
    """A TMA descriptor over one head's ``[n_rows, HEAD_DIM]`` rows at ``P + offset`` (row stride
    ``stride_row``, unit column stride), read ``[BLOCK_ROWS, D_PAD]`` at a time: rows past n_rows
    and head-dim padding read as zeros. Without USE_TMA, ``P`` itself (the callers then use pointer
    loads). P must be a tensor: triton 3.6 cannot pass None through a helper."""
    if USE_TMA:
        return tl.make_tensor_descriptor(P + offset, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[BLOCK_ROWS, D_PAD])
    else:
        return P


@triton.jit
def _terms_desc(P, offset, q_len, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """A 1-D TMA descriptor over one head's padded row terms (LSE2 or DELTA of bwd_delta_kernel) at
    ``P + offset``, ``roundup(q_len, BLOCK_Q)`` floats read ``BLOCK_M`` at a time; without USE_TMA,
    ``P`` itself (pointer loads)."""
    if USE_TMA:
        return tl.make_tensor_descriptor(P + offset, shape=[(q_len + BLOCK_Q - 1) // BLOCK_Q * BLOCK_Q], strides=[1],
                                         block_shape=[BLOCK_M])
    else:
        return P


@triton.jit
def _load_kv_tile(K, V, desc_k, desc_v, kv_base, vv_base, start_n, o_d, k_len, stride_kn, stride_vn, stride_vd,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  USE_TMA: tl.constexpr, BOUND: tl.constexpr, V_TRANS: tl.constexpr):
    """K^T [D, BN] and V [BN, D] of the key tile at start_n. TMA zero-fills rows past k_len;
    pointer loads mask them only when BOUND (the tile may cross the sequence end). V_TRANS: V is
    stored [D, L] (FP8 P.V wants V K-major), its descriptor's block is [D, BN]."""
    if USE_TMA:
        b_k = tl.trans(desc_k.load([start_n, 0]))
        if V_TRANS:
            b_v = tl.trans(desc_v.load([0, start_n]))
        else:
            b_v = desc_v.load([start_n, 0])
    else:
        o_n = start_n + tl.arange(0, BLOCK_N)
        p_k = K + kv_base + o_n.to(tl.int64)[None, :] * stride_kn + o_d[:, None]
        p_v = V + vv_base + o_n.to(tl.int64)[:, None] * stride_vn + o_d[None, :] * stride_vd
        if BOUND or HEAD_DIM != D_PAD:
            m_n = o_n < k_len
            m_d = o_d < HEAD_DIM
            b_k = tl.load(p_k, mask=m_n[None, :] & m_d[:, None], other=0.0)
            b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)
        else:
            b_k = tl.load(p_k)
            b_v = tl.load(p_v)
    return b_k, b_v


@triton.jit
def _scores(b_q, b_k, b_rs, K_SCALE, desc_ks, ks_base, ks_row, k0, start_n, k_len, BLOCK_N: tl.constexpr,
            QUANT: tl.constexpr, KS_TMA: tl.constexpr, KS_PER_TILE: tl.constexpr):
    """Scores of one tile [BM, BN] and the factor taking them to log2 units (b_rs, see _softmax_step):
    the raw q.k product, or for int8 inputs the int32 product. Per-key K scales multiply the scores,
    unless KS_PER_TILE (one K scale covers the whole tile): then it joins the per-row factor, which
    _softmax_step applies in the exponent's FMA, and the tile costs BM scale multiplies, not BM * BN.
    That one scalar load is pipelined (cp.async, like the index loads). The per-key K scales come by
    TMA when K does: their masked pointer load was not pipelined, and its latency stalled every
    iteration (benchmarks/NOTES.md, 8-bit v1 -> v2); KS_TMA says when (see fwd_kernel)."""
    if QUANT == 0:
        b_s = tl.dot(b_q, b_k)
        b_rs_t = b_rs
    elif KS_PER_TILE:
        b_s = tl.dot(b_q, b_k).to(tl.float32)
        # a layout block crossing the sequence end may have tiles wholly past it (all scores masked):
        # read the last key's scale there, never past the row (scales are > 0: no 0 * -inf)
        b_rs_t = b_rs * tl.load(K_SCALE + ks_base + tl.minimum(start_n, k_len - 1))
    else:
        if KS_TMA:
            b_ks = desc_ks.load([ks_row, k0 + start_n])  # [1, BN]; zeros past the sequence end
        else:
            o_n = start_n + tl.arange(0, BLOCK_N)
            b_ks = tl.load(K_SCALE + ks_base + o_n, mask=o_n < k_len, other=0.0)[None, :]
        b_s = tl.dot(b_q, b_k).to(tl.float32) * b_ks
        b_rs_t = b_rs
    return b_s, b_rs_t


@triton.jit
def _softmax_step(b_s, b_v, b_m, b_l, b_acc, b_rs, pv_log2, MAY_BE_EMPTY: tl.constexpr, LOG2_P_SCALE: tl.constexpr,
                  PV_SKIP: tl.constexpr, ROW_SCALE: tl.constexpr):
    """One online-softmax update with raw scores b_s [BM, BN]; b_m is the running max in log2 units.
    b_rs: the factor taking scores to log2 units, sm_scale * log2 e (a scalar), or with ROW_SCALE one
    per row [BM] (8-bit inputs: the Q scales folded in), so each score costs one FMA either way.
    MAY_BE_EMPTY: rows may have seen only -inf so far (masked tiles), which must not give NaN.
    LOG2_P_SCALE: probabilities come out times 2**LOG2_P_SCALE (448 spreads [0, 1] over FP8 e4m3's
    range) by lowering the exponent's bias, not by a multiply; the row sum b_l carries the same
    factor, so it cancels in acc / l, and the caller subtracts it from the LSE.
    PV_SKIP: a tile whose every probability, relative to its row's running max, is below
    ``2**pv_log2`` is dropped (no exp, no P.V): as if the layout had left it out for these rows. Such a
    tile never raises a row max, so the running state is unchanged."""
    b_rmax = tl.max(b_s, 1) * b_rs  # scales are > 0, so the max commutes with them
    m_new = tl.maximum(b_m, b_rmax)
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_use = m_new
    if PV_SKIP:
        update = tl.max(b_rmax - m_use, 0) >= pv_log2
    else:
        update = True  # a constant: the branch below compiles away
    if update:
        bias = m_use - LOG2_P_SCALE
        if ROW_SCALE:
            b_p = tl.math.exp2(b_s * b_rs[:, None] - bias[:, None])  # one FMA per score
        else:
            b_p = tl.math.exp2(b_s * b_rs - bias[:, None])
        alpha = tl.math.exp2(b_m - m_use)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * alpha[:, None])
        b_m = m_new
    return b_m, b_l, b_acc


@triton.jit
def _globaltimer_ns(BLOCK: tl.constexpr):
    """The GPU's nanosecond clock (PTX %globaltimer, the same on every SM) as one int64 that every
    thread of the program agrees on. Each thread reads the clock at its own moment, while Triton
    takes a scalar to be the same in all threads: read as a plain scalar, two warps could disagree,
    and the two warps that each issue half of a K/V tile's TMA copy (64 head-dim columns each)
    then addressed different key blocks, so one tile held half of each (H100: a causal 128K LSE off
    by 0.017 in about one run in four). So every thread reads the clock into a [BLOCK] tensor, and
    the program's max over them, a cross-warp reduction, is the one value all use."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([BLOCK], tl.int32)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit
def _wave_place(i_tile, period, SPLIT_GRID: tl.constexpr):
    """The wave order's phase numerator (fwd_kernel's WAVE): the program's place in the grid's order
    (tile i_tile of axis 0, fastest; then axis 1, then axis 2 with SPLIT_GRID), modulo the period P of
    programs resident at once."""
    if SPLIT_GRID:  # in int64: tiles x heads x batch may pass 2^31
        row = tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        return ((row * tl.num_programs(0) + i_tile) % period).to(tl.int32)
    else:
        return (tl.program_id(1) * tl.num_programs(0) + i_tile) % period


@triton.jit
def _resident_per_sm(Q, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    """Forward programs one SM holds at once (sm_90): by registers, 128-row tiles run 8 warps at
    more than 128 registers a thread (one program), smaller tiles 4 warps at up to 255 (two); by shared
    memory, the Q tile and NUM_STAGES K/V tiles plus 1 KB, and 1 KB per program reserved, out of
    228 KB; element sizes from Q (K alike) and V, so 8-bit inputs count 1 byte. tools/compile_sm90.py
    checks this against ptxas for the configs of the spaces."""
    E_Q: tl.constexpr = Q.dtype.element_ty.primitive_bitwidth // 8
    E_V: tl.constexpr = V.dtype.element_ty.primitive_bitwidth // 8
    SMEM: tl.constexpr = BLOCK_M * D_PAD * E_Q + NUM_STAGES * BLOCK_N * D_PAD * (E_Q + E_V) + 2048
    BY_REGS: tl.constexpr = 1 if BLOCK_M >= 128 else 2
    BY_SMEM: tl.constexpr = 233472 // SMEM
    return BY_REGS if BY_REGS < BY_SMEM else BY_SMEM


@triton.jit(do_not_specialize=["TUNE_CLASS", "WAVE_NS", "N_SPLIT", "T_Q", "T_K"])
def fwd_kernel(
    Q, K, V, O, LSE,
    COUNTS, N_FULL, FULL_START, INDICES, MASK_IDS, TERMS, CU_Q, CU_K, Q_SCALE, K_SCALE, V_SCALE,
    sm_scale, pv_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_lm,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    H, G, Lq, Lk, SEQ_STEP, TUNE_CLASS, N_SM, WAVE_NS, N_SPLIT, stride_os, stride_ls, T_Q, T_K, WINDOW, SINKS,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    N_TERMS: tl.constexpr, CONTIGUOUS: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_TMA: tl.constexpr, QUANT: tl.constexpr, PV_SKIP: tl.constexpr, K_SCALE_SPAN: tl.constexpr,
    WAVE: tl.constexpr, SPLIT_GRID: tl.constexpr, REVERSE: tl.constexpr, KV_SPLIT: tl.constexpr,
    PACK_GQA: tl.constexpr, DEVICE_PLAN: tl.constexpr,
):
    """Grid (query tiles, B * H; SPLIT_GRID: H, B; REVERSE: _query_tile). Phase 1 visits the row's
    unmasked blocks, phase 2 the masked ones. Q_SCALE [.., Lq] / K_SCALE [.., Lk] (token stride 1) and
    V_SCALE [.., D] are read only when QUANT. PV_SKIP: drop tiles whose probabilities are all below
    ``2**pv_log2`` (see _softmax_step).
    K_SCALE_SPAN: K_SCALE is constant over aligned runs of this many keys (0: no such promise). Key
    tiles start at multiples of BLOCK_N from the sequence's first key, so where BLOCK_N divides the
    span each tile sees one K scale (the quantization kernels start the runs at every packed sequence's
    first key too). WAVE (indexed rows): program t of the grid's order starts its row's walk at the fraction
    (t mod P) / P of the row and wraps around, P being the programs resident at once (N_SM SMs times
    _resident_per_sm). Programs start in grid order at a rate of P per row duration once the first
    waves have drifted apart, so the ones running at once then stand at the same fraction of their
    walks: on random layouts, at the same stretch of keys, which stays in L2 (at 128K one head's K/V
    outgrow it; H100, benchmarks/NOTES.md "The wave order").
    WAVE_NS > 0 (launch.fwd_wave_clock): the phase comes from the GPU clock instead, (globaltimer mod
    WAVE_NS) / WAVE_NS, WAVE_NS being about one row's duration, so the programs running at once stand
    at one fraction of their walks however dispatch went (on rows of equal length the grid's waves
    start together and then drift, which the grid-position phase cannot follow). With CONTIGUOUS,
    WAVE rotates the run by that phase (the launcher sets it only with WAVE_NS > 0). The start slot
    then depends on timing, so the summation order, and the output's last bits, vary run to run.
    KV_SPLIT (split-KV, for grids too small to fill the GPU, e.g. decoding; launch.kv_splits): part
    i_split of N_SPLIT walks its share of each phase's tiles and writes its own normalized output
    (fp32) and LSE at O + i_split * stride_os, LSE + i_split * stride_ls; split_merge_kernel combines
    the parts. A part with no tiles writes zeros and LSE -inf, which the merge weighs 0.
    PACK_GQA (decoding with GQA on a layout shared by all heads; launch.short_query_plan): the grid's heads
    (H) are kv heads and one tile holds the q_len rows of each of the G query heads that share one,
    so the K/V tiles are read once for the G heads (one layout row: every query in the first block).
    DEVICE_PLAN (launch.forward's ``device_plan``: 1 dense, 2 bottom-right causal, 3 bottom-right causal
    sliding window of WINDOW keys, with SINKS > 0 attention sinks too; 128 x 128 blocks): no schedule or term
    table is read; each row's plan comes from its sequence's lengths (_device_row, _device_window_row) and the
    causal edge is the compare key <= position (and key > position - WINDOW or key < SINKS), which is what the
    causal term of the host's plan (varlen.stack_dense_or_causal) or the terms of patterns.local /
    patterns.streaming allow: the same blocks in the same order and the same masks, so the same bits. (Rows
    with whole sink blocks have two unmasked runs, which the host walks as indexed rows: a padded call's wave
    order and tile pick may then differ, and so the last bits; benchmarks/NOTES.md.) N_TERMS is the host plan's
    (0 dense, 1 causal or window, 2 with sinks) only so that both share an autotune key, and so a config.
    Packed offsets are cut to T_Q / T_K tokens (_clamped_bounds): the host may not have read them."""
    i_m, i_b, i_h, i_hk, q0, q_len, k0, k_len, p_cnt, p_row = _query_tile(
        CU_Q, CU_K, H, G, Lq, Lk, SEQ_STEP, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
        BLOCK_Q, BLOCK_M, IS_VARLEN, SPLIT_GRID, REVERSE, N_SPLIT, KV_SPLIT)
    if DEVICE_PLAN and IS_VARLEN:
        q0, q_len, k0, k_len = _clamped_bounds(q0, q_len, k0, k_len, T_Q, T_K)
    if i_m * BLOCK_M >= q_len:
        return
    offset = k_len - q_len
    SUB: tl.constexpr = BLOCK_K // BLOCK_N
    if DEVICE_PLAN:
        tl.static_assert(CONTIGUOUS, "a device plan's rows are runs of key blocks")
        tl.static_assert((N_TERMS == 0) == (DEVICE_PLAN == 1), "N_TERMS: the host plan's (0 dense, else 1 or 2)")
        if DEVICE_PLAN == 3:  # unmasked runs [0, f1) and [u2, c_hi); masked [f1, e1), [k2, u2), [c_hi, ...)
            count, n_full, f1, u2, e1, k2, c_hi = _device_window_row(q_len, k_len, (i_m * BLOCK_M) // BLOCK_Q,
                                                                     WINDOW, SINKS, BLOCK_Q, BLOCK_K)
        else:
            count, n_full = _device_row(q_len, k_len, (i_m * BLOCK_M) // BLOCK_Q, BLOCK_Q, BLOCK_K, DEVICE_PLAN == 2)
    else:
        count = tl.load(COUNTS + p_cnt)
        n_full = tl.load(N_FULL + p_cnt)
    # each phase's tile range, [lo1, hi1) unmasked and [lo2, hi2) masked: the whole row, or a part's share
    lo1 = 0
    hi1 = n_full * SUB
    lo2 = n_full * SUB
    hi2 = count * SUB
    if KV_SPLIT:
        i_split = tl.program_id(0) % N_SPLIT
        lo1 = hi1 * i_split // N_SPLIT
        hi1 = hi1 * (i_split + 1) // N_SPLIT
        n2 = hi2 - lo2
        hi2 = lo2 + n2 * (i_split + 1) // N_SPLIT
        lo2 = lo2 + n2 * i_split // N_SPLIT
        O += i_split.to(tl.int64) * stride_os
        LSE += i_split.to(tl.int64) * stride_ls

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:  # row g * q_len + i: query i of query head i_hk * G + g (the grid's heads are kv heads)
        tl.static_assert(QUANT == 0, "PACK_GQA is for 16-bit inputs")
        i_hk = i_h
        g_m = o_m // q_len
        o_m = o_m % q_len
        m_m = g_m < G
        h_l = i_hk * G + g_m  # [BM] each row's query head
        h_q = h_l[:, None]
    else:
        m_m = o_m < q_len
        h_l = i_h
        h_q = i_h
    o_d = tl.arange(0, D_PAD)
    m_d = o_d < HEAD_DIM
    p_q = Q + i_b.to(tl.int64) * stride_qb + h_q.to(tl.int64) * stride_qh + (q0 + o_m.to(tl.int64))[:, None] * stride_qm + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BM, D]
    kv_base = i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh + k0.to(tl.int64) * stride_kn
    V_TRANS: tl.constexpr = QUANT == 2
    if V_TRANS and IS_VARLEN:  # packed FP8 V^T: each sequence's columns start 16-byte aligned
        v0 = vt_column0(k0, i_b)
    else:
        v0 = k0
    vv_base = i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh + v0.to(tl.int64) * stride_vn
    pos_q = (o_m + offset)[:, None]
    # per-head descriptors (USE_TMA): rows past k_len (and head-dim padding) read as zeros
    desc_k = _rows_desc(K, kv_base, k_len, stride_kn, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)
    if USE_TMA and V_TRANS:  # FP8 V stored [D, L]: its rows are channels
        desc_v = tl.make_tensor_descriptor(V + vv_base, shape=[HEAD_DIM, k_len], strides=[stride_vd, 1],
                                           block_shape=[D_PAD, BLOCK_N])
    else:
        desc_v = _rows_desc(V, vv_base, k_len, stride_vn, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA)

    qk_scale = sm_scale * LOG2E
    LOG2_P_SCALE: tl.constexpr = 8.807354922057604 if QUANT == 2 else 0.0  # log2(448), FP8 e4m3's max
    KS_PER_TILE: tl.constexpr = QUANT != 0 and K_SCALE_SPAN > 0 and K_SCALE_SPAN % BLOCK_N == 0
    # Per-key K scales through one descriptor over all K-scale rows (row stride padded to 16 bytes by
    # the launcher). Not on packed inputs: a TMA read must start 16-byte aligned (else an illegal
    # instruction on the H100), and a sequence's first key k0 may be any token. Not for 16-key tiles:
    # their 64-byte [1, 16] fp32 box faulted with "misaligned address" on the H100 (triton 3.6; the
    # 128-byte box of 32-key tiles runs; tests/gpu/test_fuzz_gpu.py found it).
    KS_TMA: tl.constexpr = USE_TMA and QUANT != 0 and not KS_PER_TILE and not IS_VARLEN and BLOCK_N >= 32
    if QUANT != 0:
        ks_base = i_b.to(tl.int64) * stride_ksb + i_hk.to(tl.int64) * stride_ksh + k0
        ks_row = (i_b * stride_ksb + i_hk * stride_ksh) // stride_ksh
        if KS_TMA:
            desc_ks = tl.make_tensor_descriptor(K_SCALE, shape=[ks_row + 1, k0 + k_len], strides=[stride_ksh, 1],
                                                block_shape=[1, BLOCK_N])
        else:
            desc_ks = K_SCALE
        # per-row Q scale folded with the softmax scale (1 past the end: no 0 * -inf)
        b_rs = tl.load(Q_SCALE + i_b.to(tl.int64) * stride_qsb + i_h.to(tl.int64) * stride_qsh + q0 + o_m,
                       mask=m_m, other=1.0) * qk_scale
    else:  # unused placeholders: _scores takes the plain q.k product
        ks_base = 0
        ks_row = 0
        desc_ks = K_SCALE
        b_rs = qk_scale
    ROW_SCALE: tl.constexpr = QUANT != 0
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # phase 1: blocks that need no mask. A contiguous run is walked by arithmetic, no index loads.
    # Indexed rows get 2 * NUM_STAGES - 1 stages: the pipeliner splits a loop's stages between the
    # index load and the K/V loads it addresses, and this keeps K/V as many tiles ahead as on
    # contiguous rows (H100: random layouts +10-21%, benchmarks/NOTES.md v4).
    n_it = hi1 - lo1
    if CONTIGUOUS:
        if DEVICE_PLAN:  # slot s holds block s (a window's: below f1, else u2 - f1 + s, added below)
            run0 = lo1 * BLOCK_N
        else:
            run0 = tl.load(FULL_START + p_cnt) * BLOCK_K + lo1 * BLOCK_N
    rot = 0
    if WAVE:  # contiguous runs take only the clock's phase (the launcher sets WAVE_NS > 0 there)
        if WAVE_NS > 0:
            rot = (_globaltimer_ns(BLOCK_M) % WAVE_NS * n_it // WAVE_NS).to(tl.int32)
        else:
            period = N_SM * _resident_per_sm(Q, V, BLOCK_M, BLOCK_N, D_PAD, NUM_STAGES)
            rot = _wave_place(tl.program_id(0), period, SPLIT_GRID) * n_it // period  # dispatch order
    for it in tl.range(0, n_it, num_stages=NUM_STAGES if CONTIGUOUS else 2 * NUM_STAGES - 1):
        j = _rotated(it, rot, n_it, WAVE)  # the walk's step, wrapped from its start slot
        if CONTIGUOUS:
            start_n = run0 + j * BLOCK_N
            if DEVICE_PLAN == 3:
                start_n += tl.where((lo1 + j) // SUB < f1, 0, u2 - f1) * BLOCK_K
        else:
            j += lo1
            start_n = tl.load(INDICES + p_row + j // SUB) * BLOCK_K + (j % SUB) * BLOCK_N
        b_k, b_v = _load_kv_tile(K, V, desc_k, desc_v, kv_base, vv_base, start_n, o_d, k_len, stride_kn, stride_vn,
                                 stride_vd, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA, False, V_TRANS)
        b_s, b_rs_t = _scores(b_q, b_k, b_rs, K_SCALE, desc_ks, ks_base, ks_row, k0, start_n, k_len, BLOCK_N, QUANT,
                              KS_TMA, KS_PER_TILE)
        b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_m, b_l, b_acc, b_rs_t, pv_log2, False, LOG2_P_SCALE, PV_SKIP,
                                        ROW_SCALE)
    # phase 2: blocks with an element mask or crossing the sequence end
    for it in tl.range(lo2, hi2, num_stages=NUM_STAGES):
        slot = it // SUB
        if DEVICE_PLAN == 3:  # masked slot n_full + m: the m-th block of [f1, e1), [k2, u2), [c_hi, ...)
            m = slot - n_full
            m_a = e1 - f1
            m_b = m_a + u2 - k2
            start_n = (tl.where(m < m_a, f1, tl.where(m < m_b, k2 - m_a, c_hi - m_b)) - n_full) * BLOCK_K + it * BLOCK_N
        elif DEVICE_PLAN:  # slot s holds key block s
            start_n = it * BLOCK_N
        else:
            start_n = tl.load(INDICES + p_row + slot) * BLOCK_K + (it % SUB) * BLOCK_N
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_k, b_v = _load_kv_tile(K, V, desc_k, desc_v, kv_base, vv_base, start_n, o_d, k_len, stride_kn, stride_vn,
                                 stride_vd, BLOCK_N, HEAD_DIM, D_PAD, USE_TMA, True, V_TRANS)
        b_s, b_rs_t = _scores(b_q, b_k, b_rs, K_SCALE, desc_ks, ks_base, ks_row, k0, start_n, k_len, BLOCK_N, QUANT,
                              KS_TMA, KS_PER_TILE)
        b_s = tl.where((o_n < k_len)[None, :], b_s, float("-inf"))  # [BM, BN]
        if DEVICE_PLAN == 2:  # the causal edge; on a cut last block before it the compare holds everywhere
            b_s = tl.where(pos_q >= o_n[None, :], b_s, float("-inf"))
        elif DEVICE_PLAN == 3:  # the window's two edges, and the sinks before the window
            b_s = tl.where((pos_q >= o_n[None, :]) & ((pos_q - WINDOW < o_n[None, :]) | (o_n[None, :] < SINKS)), b_s,
                           float("-inf"))
        elif N_TERMS > 0:
            mid = tl.load(MASK_IDS + p_row + slot)
            if mid >= 0:
                b_s = tl.where(_allowed(pos_q, o_n[None, :], TERMS, mid, N_TERMS, False), b_s, float("-inf"))
        b_m, b_l, b_acc = _softmax_step(b_s, b_v, b_m, b_l, b_acc, b_rs_t, pv_log2, True, LOG2_P_SCALE, PV_SKIP,
                                        ROW_SCALE)

    has = b_l > 0
    b_o = b_acc / tl.where(has, b_l, 1.0)[:, None]
    if QUANT == 2:
        b_vs = tl.load(V_SCALE + i_b.to(tl.int64) * stride_vsb + i_hk.to(tl.int64) * stride_vsh + o_d, mask=m_d,
                       other=0.0)
        b_o = b_o * b_vs[None, :]
    p_o = O + i_b.to(tl.int64) * stride_ob + h_q.to(tl.int64) * stride_oh + (q0 + o_m.to(tl.int64))[:, None] * stride_om + o_d[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    b_lse = tl.where(has, (b_m + tl.math.log2(tl.where(has, b_l, 1.0)) - LOG2_P_SCALE) * LN2, float("-inf"))
    tl.store(LSE + i_b.to(tl.int64) * stride_lb + h_l.to(tl.int64) * stride_lh + (q0 + o_m) * stride_lm, b_lse, mask=m_m)


@triton.jit
def split_merge_kernel(O_PART, LSE_PART, O, LSE, N_SPLIT,
                       stride_ps, stride_pb, stride_ph, stride_pm, stride_lps, stride_lpb, stride_lph,
                       stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_lm, H, Lq,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (row tiles, B * H): combines the N_SPLIT parts of a split-KV forward (fwd_kernel KV_SPLIT),
    each a normalized fp32 output O_PART [N_SPLIT, B, H, Lq, HEAD_DIM] with its LSE (natural log)
    LSE_PART [N_SPLIT, B, H, Lq] (contiguous rows), into O (O's dtype) and LSE, weighing part s by
    exp(LSE_s - max_s LSE_s). Rows whose parts all hold LSE -inf (no key allowed) get zeros and -inf,
    as the unsplit kernel gives. Packed (varlen) results merge as B = 1 and Lq = T: [N_SPLIT, T, H, D]
    through the strides, LSE_PART [N_SPLIT, H, T]."""
    i_r = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, D_PAD)
    m_r = o_r < Lq
    m_rd = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    p_l = LSE_PART + i_b.to(tl.int64) * stride_lpb + i_h.to(tl.int64) * stride_lph + o_r
    p_o = (O_PART + i_b.to(tl.int64) * stride_pb + i_h.to(tl.int64) * stride_ph
           + o_r.to(tl.int64)[:, None] * stride_pm + o_d[None, :])
    # int32 part offsets: launch.kv_splits splits only grids of at most as many programs as SMs, whose
    # parts hold a few million values at most
    b_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, N_SPLIT):
        b_m = tl.maximum(b_m, tl.load(p_l + s * stride_lps, mask=m_r, other=float("-inf")))
    b_m = tl.where(b_m == float("-inf"), 0.0, b_m)  # every part empty: weights exp(-inf) = 0, not NaN
    b_w_sum = tl.zeros([BLOCK_R], tl.float32)
    b_acc = tl.zeros([BLOCK_R, D_PAD], tl.float32)
    for s in range(0, N_SPLIT):
        b_w = tl.exp(tl.load(p_l + s * stride_lps, mask=m_r, other=float("-inf")) - b_m)
        b_acc += b_w[:, None] * tl.load(p_o + s * stride_ps, mask=m_rd, other=0.0)
        b_w_sum += b_w
    has = b_w_sum > 0
    b_o = b_acc / tl.where(has, b_w_sum, 1.0)[:, None]
    tl.store(O + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh + o_r.to(tl.int64)[:, None] * stride_om
             + o_d[None, :], b_o.to(O.dtype.element_ty), mask=m_rd)
    b_lse = tl.where(has, b_m + tl.log(tl.where(has, b_w_sum, 1.0)), float("-inf"))
    tl.store(LSE + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + o_r * stride_lm, b_lse, mask=m_r)


@triton.jit
def _rows_start(CU_L, i_b, IS_VARLEN: tl.constexpr):
    """First row of sequence i_b in the padded row terms (bwd_delta_kernel): a multiple of 16."""
    if IS_VARLEN:
        l0 = tl.multiple_of(tl.load(CU_L + i_b), 16)
    else:
        l0 = 0
    return l0


@triton.jit
def bwd_delta_kernel(O, DO, LSE, DELTA, LSE2, CU_Q, CU_L, DLSE, stride_ob, stride_oh, stride_om, stride_dob,
                     stride_doh, stride_dom, stride_sb, stride_sh, stride_sm, stride_lb, stride_lh, stride_gb,
                     stride_gh, stride_gm, H, L, SEQ_STEP, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
                     SPLIT_GRID: tl.constexpr):
    """Grid (row tiles of the longest sequence, B * H; SPLIT_GRID: H, B): the per-row terms both backward kernels read,
    fp32: DELTA = rowsum(O * dO) (one read of O and dO; the PyTorch expression made three fp32
    copies), and LSE2 = LSE (strides stride_s*) in log2 units with -inf (a row with no key) as +inf,
    so that row's probabilities come out 0 without a select per score element.

    The terms are written padded: each sequence's rows fill a whole number of layout query blocks
    (BLOCK_Q) starting at CU_L[b] (packed; 0 dense), and rows past its end get DELTA 0 and LSE2 +inf.
    So the dK/dV loop reads its query tile's terms with no mask (see _dkdv_step).

    HAS_DLSE: the LSE output's gradient DLSE (strides stride_g*, laid out as LSE) is subtracted from
    DELTA: d LSE / d s = P, so dS = P * (dP - DELTA + dLSE), which both kernels compute unchanged."""
    i_m = tl.program_id(0)
    i_b, i_h = _batch_head(H, SPLIT_GRID)
    q0, q_len, _, _ = _seq_bounds(CU_Q, CU_Q, i_b, L, L, SEQ_STEP, IS_VARLEN)  # (the key side is unused)
    l0 = _rows_start(CU_L, i_b, IS_VARLEN)
    n_rows = tl.cdiv(q_len, BLOCK_Q) * BLOCK_Q
    if i_m * BLOCK_M >= n_rows:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D_PAD)
    m_m = o_m < q_len
    m_md = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    o_t = (q0 + o_m).to(tl.int64)
    b_o = tl.load(O + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh + o_t[:, None] * stride_om
                  + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(DO + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh + o_t[:, None] * stride_dom
                   + o_d[None, :], mask=m_md, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), axis=1)  # 0 past the end
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + i_b.to(tl.int64) * stride_gb + i_h.to(tl.int64) * stride_gh + o_t * stride_gm,
                           mask=m_m, other=0.0).to(tl.float32)
    b_lse = tl.load(LSE + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh + o_t * stride_sm, mask=m_m,
                    other=float("-inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    p_l = i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + l0 + o_m
    m_l = o_m < n_rows
    tl.store(DELTA + p_l, b_delta, mask=m_l)
    tl.store(LSE2 + p_l, b_lse, mask=m_l)


@triton.jit
def _pick(values, o_c, slot):
    """values[slot] for a chunk held in registers (o_c = its arange): a dynamic index into a register
    tensor, as a masked sum."""
    return tl.sum(tl.where(o_c == slot, values, 0))


@triton.jit
def _run_start(INDICES, p_row, n_full, BLOCK: tl.constexpr):
    """First token of a contiguous row's run of unmasked blocks (its first slot; 0 for an empty run),
    for the backward kernels' arithmetic walk (CONTIGUOUS)."""
    return tl.load(INDICES + p_row, mask=n_full > 0, other=0) * BLOCK


@triton.jit
def _rotated(step, rot, n, ROTATE: tl.constexpr):
    """The slot of a walk's step: with ROTATE (the wave order: fwd_kernel's WAVE, _bwd_wave) the walk
    starts at slot rot and wraps around the row's n slots; else the step itself."""
    if ROTATE:
        s = step + rot
        return tl.where(s >= n, s - n, s)
    else:
        return step


@triton.jit
def _index_chunk(INDICES, MASK_IDS, p_row, c0, hi, o_c, rot, n, ROTATE: tl.constexpr):
    """The block indices and mask ids of a layout row's slots c0 + o_c (those at or past hi: block 0,
    mask -1), read into registers at once for the backward loops (see bwd_dkdv_kernel). ROTATE (the
    wave order, _bwd_wave): the walk's steps c0 + o_c are the slots from rot on, modulo the row's n."""
    m_c = c0 + o_c < hi
    s = _rotated(c0 + o_c, rot, n, ROTATE)
    return (tl.load(INDICES + p_row + s, mask=m_c, other=0),
            tl.load(MASK_IDS + p_row + s, mask=m_c, other=-1))


@triton.jit
def _bwd_resident_per_sm(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """Backward programs (dK/dV or dQ) one SM holds at once (sm_90): the 8-warp tiles of the backward
    spaces from 64 x 128 up, and every d256 tile, one (registers, shared memory); 64 x 64 tiles two,
    which holds for 4 warps (8 warps: one or two by kernel and head dim). tools/compile_sm90.py
    checks this against ptxas for the configs of the spaces."""
    return 1 if BLOCK_M * BLOCK_N >= 8192 or D_PAD >= 256 else 2


@triton.jit
def _bwd_wave(i_tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, N_SM, WAVE: tl.constexpr,
              SPLIT_GRID: tl.constexpr):
    """(t, P) of the backward's wave order (fwd_kernel's WAVE): the program's place t among the P
    programs resident at once (N_SM SMs times _bwd_resident_per_sm), counted in grid order.
    (0, 1) without WAVE."""
    if WAVE:
        period = N_SM * _bwd_resident_per_sm(BLOCK_M, BLOCK_N, D_PAD)
        t = _wave_place(i_tile, period, SPLIT_GRID)
    else:
        period = 1
        t = 0
    return t, period


@triton.jit
def _dp_product(b_v, b_do, b_delta, BLOCK_M: tl.constexpr, DELTA_ACC: tl.constexpr):
    """The dK/dV kernel's dP^T = V dO^T ([BN, BM]); with DELTA_ACC, dP^T - delta: delta seeds the
    product's accumulator, so its registers are free once the product is issued instead of once dS
    is formed. At 255 registers a thread that decides whether ptxas spills in the loop: the MHA
    dense loop went from 15 spill loads per iteration to 3 and the kernel ran 12% faster
    (benchmarks/NOTES.md, backward 23). fp32 either way; the sum is rounded in another order."""
    if DELTA_ACC:
        return tl.dot(b_v, tl.trans(b_do), tl.broadcast_to(-b_delta[None, :], [b_v.shape[0], BLOCK_M]))
    else:
        return tl.dot(b_v, tl.trans(b_do))


@triton.jit
def _dkdv_step(b_k, b_v, b_dk, b_dv, Q, DO, LSE2, DELTA, DQA, desc_q, desc_do, desc_dq, desc_lse, desc_delta, q_base,
               do_base, l_base, dq_base, start_m, q_len, k_len, offset, o_d, pos_k, stride_qm, stride_dom, stride_dqm,
               qk_scale, sm_scale, TERMS, mid, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, N_TERMS: tl.constexpr,
               MASKED: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr, QDO_TMA: tl.constexpr,
               DP_FIRST: tl.constexpr, DELTA_ACC: tl.constexpr, TERMS_TMA: tl.constexpr):
    """Accumulate one query tile's contribution to dK, dV of the key tile (transposed products).
    FUSED_DQ: also add the tile's dQ share, sm_scale * dS @ K, into the fp32 accumulator DQA (TMA
    reduce-add with DQ_TMA, else pointer atomics); rows past q_len carry dS = 0, and so do keys past
    k_len (their zero K rows give P = 2**-lse2, inf for rows with an LSE below -88, and inf * 0 would
    put NaN in dQ; without FUSED_DQ those keys' dK/dV rows are never stored). LSE2 / DELTA: the rows'
    terms from bwd_delta_kernel, padded, at l_base. DELTA_ACC: delta enters through dP's accumulator
    (_dp_product)."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    m_m = o_m < q_len
    m_md = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    if QDO_TMA:  # no per-element addresses or masks; rows past q_len read as zeros
        b_q = desc_q.load([start_m, 0])
        b_do = desc_do.load([start_m, 0])
    else:
        b_q = tl.load(Q + q_base + o_m.to(tl.int64)[:, None] * stride_qm + o_d[None, :], mask=m_md, other=0.0)
        b_do = tl.load(DO + do_base + o_m.to(tl.int64)[:, None] * stride_dom + o_d[None, :], mask=m_md, other=0.0)
    # No mask: the row terms are padded to whole query blocks, LSE2 +inf and DELTA 0 past q_len (whose
    # Q and dO rows read as 0), so those rows get P = 0 and add nothing. A mask on these loads cost a
    # compare and select per element per iteration, and on packed inputs (q_len not known to be a
    # multiple of 16) 4-byte instead of 16-byte copies: 23% more instructions in the loop.
    if TERMS_TMA:  # (_terms_desc) by TMA, as Q/dO: no per-thread address from the tile's block index
        b_lse = desc_lse.load([start_m])
        b_delta = desc_delta.load([start_m])
    else:
        b_lse = tl.load(LSE2 + l_base + o_m)
        b_delta = tl.load(DELTA + l_base + o_m)
    b_pt = tl.math.exp2(tl.dot(b_k, tl.trans(b_q)) * qk_scale - b_lse[None, :])  # [BN, BM]
    if FUSED_DQ:
        b_pt = tl.where(pos_k < k_len, b_pt, 0.0)
    if MASKED:
        if mid >= 0:
            b_pt = tl.where(_allowed((o_m + offset)[None, :], pos_k, TERMS, mid, N_TERMS, True), b_pt, 0.0)
    if DP_FIRST:
        # dP first: Triton 3.6 waits for a non-accumulator product right after issuing it but leaves the
        # accumulating dV product in flight, so dS below is computed while dV runs on the tensor cores
        # (issued the other way round, one wait drains both and dS overlaps nothing)
        b_dpt = _dp_product(b_v, b_do, b_delta, BLOCK_M, DELTA_ACC)  # [BN, BM]
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
    else:
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
        b_dpt = _dp_product(b_v, b_do, b_delta, BLOCK_M, DELTA_ACC)
    if not DELTA_ACC:
        b_dpt = b_dpt - b_delta[None, :]
    b_dst = (b_pt * b_dpt).to(b_q.dtype)  # [BN, BM]
    b_dk = tl.dot(b_dst, b_q, b_dk)
    if FUSED_DQ:
        b_dq = tl.dot(tl.trans(b_dst), b_k) * sm_scale  # [BM, D]
        if DQ_TMA:
            desc_dq.atomic_add([start_m, 0], b_dq)
        else:
            tl.atomic_add(DQA + dq_base + o_m.to(tl.int64)[:, None] * stride_dqm + o_d[None, :], b_dq, mask=m_md,
                          sem="relaxed")
    return b_dk, b_dv


@triton.jit
def _dkdv_head(b_dk, b_dv, i_h, b_k, b_v, Q, DO, LSE2, DELTA, DQA, T_COUNTS, T_N_FULL, T_INDICES, T_MASK_IDS, TERMS,
               i_b, kb, q0, q_len, k_len, l0, offset, o_d, pos_k, qk_scale, sm_scale,
               stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, stride_lb, stride_lh,
               stride_dqab, stride_dqah, stride_dqam, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
               N_TERMS: tl.constexpr, NUM_STAGES: tl.constexpr, FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
               QDO_TMA: tl.constexpr, IDX_CHUNK: tl.constexpr, DP_FIRST: tl.constexpr, PHASE_LO: tl.constexpr,
               PHASE_HI: tl.constexpr, CONTIGUOUS: tl.constexpr, wave_r, period, seg, WAVE: tl.constexpr,
               DELTA_ACC: tl.constexpr, IDX_DEEP: tl.constexpr, MASKED_ONE_STAGE: tl.constexpr,
               TERMS_TMA: tl.constexpr):
    """bwd_dkdv_kernel's work for query head i_h: phases PHASE_LO until PHASE_HI of the transposed
    layout row of key block kb (phase 0: unmasked query blocks, 1: masked ones), added to b_dk, b_dv.
    WAVE (indexed walks only): phase 0 walks the piece seg (SEG_*) of the row, with its start slot
    s0 = wave_r * n_full // period (bwd_dkdv_kernel's order over several heads); phase 1 walks nothing
    for SEG_NONE. MASKED_ONE_STAGE (CONTIGUOUS): phase 1 loads one index per iteration and is not
    software-pipelined (launch.BWD_DKDV_MASKED)."""
    tl.static_assert(not WAVE or not CONTIGUOUS, "the wave order rotates indexed walks only")
    tl.static_assert(not IDX_DEEP or IDX_CHUNK == 0, "deep index loads replace the register chunks")
    SUB: tl.constexpr = BLOCK_Q // BLOCK_M
    p_cnt = i_b * stride_cb + i_h * stride_ch + kb
    count = tl.load(T_COUNTS + p_cnt)
    n_full = tl.load(T_N_FULL + p_cnt)
    p_row = i_b * stride_ib + i_h * stride_ih + kb * stride_iq
    q_base = i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + q0.to(tl.int64) * stride_qm
    do_base = i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh + q0.to(tl.int64) * stride_dom
    l_base = i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + l0
    dq_base = i_b.to(tl.int64) * stride_dqab + i_h.to(tl.int64) * stride_dqah + q0.to(tl.int64) * stride_dqam
    if DQ_TMA:  # this head's rows of the sequence; the reduce-add clips rows past q_len
        desc_dq = _rows_desc(DQA, dq_base, q_len, stride_dqam, BLOCK_M, HEAD_DIM, D_PAD, True)
    else:  # DQA is None outside the fused schedule
        desc_dq = DQA
    # this head's rows of the sequence, [q_len, D]
    desc_q = _rows_desc(Q, q_base, q_len, stride_qm, BLOCK_M, HEAD_DIM, D_PAD, QDO_TMA)
    desc_do = _rows_desc(DO, do_base, q_len, stride_dom, BLOCK_M, HEAD_DIM, D_PAD, QDO_TMA)
    desc_lse = _terms_desc(LSE2, l_base, q_len, BLOCK_Q, BLOCK_M, TERMS_TMA)
    desc_delta = _terms_desc(DELTA, l_base, q_len, BLOCK_Q, BLOCK_M, TERMS_TMA)
    # phase 0: the query blocks no element mask touches; phase 1: masked ones or crossing the end.
    # (In phase 0 the mask ids are never used: their loads are dead code and compile away.)
    for phase in tl.static_range(PHASE_LO, PHASE_HI):
        lo = 0 if phase == 0 else n_full
        hi = n_full if phase == 0 else count
        if WAVE and phase == 1:
            hi = tl.where(seg == SEG_NONE, lo, hi)
        rot = 0
        if WAVE and phase == 0:  # (indexed walks) the piece seg: its start slot rot and its steps
            s0 = wave_r * hi // period
            rot = tl.where((seg == SEG_ROUND) | (seg == SEG_FROM_S0), s0, 0)
            hi = tl.where(seg == SEG_FROM_S0, hi - s0, tl.where(seg == SEG_TO_S0, s0, hi))
        if CONTIGUOUS and phase == 0:
            # every row's unmasked query blocks are one ascending run from slot 0: walked by arithmetic,
            # with no index chunk and no per-iteration pick (a cross-warp reduction each)
            run0 = _run_start(T_INDICES, p_row, n_full, BLOCK_Q)
            for it in tl.range(0, n_full * SUB, num_stages=NUM_STAGES):
                b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, Q, DO, LSE2, DELTA, DQA, desc_q, desc_do, desc_dq,
                                        desc_lse, desc_delta, q_base, do_base, l_base, dq_base, run0 + it * BLOCK_M,
                                        q_len, k_len, offset, o_d, pos_k, stride_qm, stride_dom, stride_dqam, qk_scale,
                                        sm_scale, TERMS, -1, BLOCK_M, HEAD_DIM, N_TERMS, False, FUSED_DQ, DQ_TMA, QDO_TMA,
                                        DP_FIRST, DELTA_ACC, TERMS_TMA)
        elif IDX_CHUNK > 0 and not (CONTIGUOUS and MASKED_ONE_STAGE):
            # Indices come from registers, one chunk at a time: an index load inside the pipelined
            # loop makes the Q/dO loads indirect, and the pipeliner then issued them only at the end
            # of the iteration before their use, exposing their latency every iteration.
            o_c = tl.arange(0, IDX_CHUNK)
            for c0 in range(lo, hi, IDX_CHUNK):
                blocks, mids = _index_chunk(T_INDICES, T_MASK_IDS, p_row, c0, hi, o_c, rot, n_full,
                                            WAVE and phase == 0)
                for it in tl.range(0, tl.minimum(hi - c0, IDX_CHUNK) * SUB, num_stages=NUM_STAGES):
                    start_m = _pick(blocks, o_c, it // SUB) * BLOCK_Q + (it % SUB) * BLOCK_M
                    b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, Q, DO, LSE2, DELTA, DQA, desc_q, desc_do,
                                            desc_dq, desc_lse, desc_delta, q_base, do_base, l_base, dq_base, start_m,
                                            q_len, k_len, offset, o_d, pos_k, stride_qm, stride_dom, stride_dqam, qk_scale,
                                            sm_scale, TERMS, _pick(mids, o_c, it // SUB), BLOCK_M, HEAD_DIM,
                                            N_TERMS, phase == 1 and N_TERMS > 0, FUSED_DQ, DQ_TMA, QDO_TMA,
                                            DP_FIRST, DELTA_ACC, TERMS_TMA)
        else:
            # One index load per iteration. IDX_DEEP (the unmasked pass): pipelined as the forward's
            # indexed rows, with 2 * NUM_STAGES - 1 stages the index goes two iterations ahead and
            # Q/dO as many tiles ahead as with indices from registers, with no per-iteration pick
            # (_pick: a cross-warp reduction). Not the masked pass, whose rows are a block or two.
            # MASKED_ONE_STAGE: the masked pass of a contiguous schedule (this branch has no phase 0
            # there) unpipelined: its multi-buffered loads and chunk picks raised the register
            # pressure of the whole kernel, and ptxas spilled in the arithmetic walk of phase 0 (13
            # spill loads an iteration on causal, none without them; triton 3.6 SASS, NOTES backward 32)
            for it in tl.range(lo * SUB, hi * SUB,
                               num_stages=2 * NUM_STAGES - 1 if IDX_DEEP and phase == 0 else
                               (1 if CONTIGUOUS and MASKED_ONE_STAGE else NUM_STAGES)):
                slot = _rotated(it // SUB, rot, n_full, WAVE and phase == 0)
                start_m = tl.load(T_INDICES + p_row + slot) * BLOCK_Q + (it % SUB) * BLOCK_M
                b_dk, b_dv = _dkdv_step(b_k, b_v, b_dk, b_dv, Q, DO, LSE2, DELTA, DQA, desc_q, desc_do, desc_dq,
                                        desc_lse, desc_delta, q_base, do_base, l_base, dq_base, start_m, q_len, k_len,
                                        offset, o_d, pos_k, stride_qm, stride_dom, stride_dqam, qk_scale, sm_scale, TERMS,
                                        tl.load(T_MASK_IDS + p_row + slot), BLOCK_M, HEAD_DIM, N_TERMS,
                                        phase == 1 and N_TERMS > 0, FUSED_DQ, DQ_TMA, QDO_TMA, DP_FIRST, DELTA_ACC,
                                        TERMS_TMA)
    return b_dk, b_dv


@triton.jit(do_not_specialize=["TUNE_CLASS"])
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQA,
    T_COUNTS, T_N_FULL, T_INDICES, T_MASK_IDS, TERMS, CU_Q, CU_K, CU_DK, CU_L, T_ORDER,
    sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqab, stride_dqah, stride_dqam,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    stride_ob, stride_oh,
    HKV, G, Lq, Lk, SEQ_STEP, TUNE_CLASS, N_SM,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    N_TERMS: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr,
    FUSED_DQ: tl.constexpr, DQ_TMA: tl.constexpr, QDO_TMA: tl.constexpr, IDX_CHUNK: tl.constexpr,
    DP_FIRST: tl.constexpr, HEADS_INSIDE: tl.constexpr, CONTIGUOUS: tl.constexpr, WAVE: tl.constexpr,
    DELTA_ACC: tl.constexpr, IDX_DEEP: tl.constexpr, SPLIT_GRID: tl.constexpr, MASKED_ONE_STAGE: tl.constexpr,
    TERMS_TMA: tl.constexpr, TILE_ORDER: tl.constexpr,
):
    """Grid (key tiles, B * Hkv; SPLIT_GRID: Hkv, B): one key tile of one kv head, looping over the G query heads that
    share it and over the transposed layout's query blocks, so dK/dV need no atomics. Varlen: dK/dV
    rows of sequence b start at CU_DK[b * SEQ_STEP] (CU_K itself, or a scratch buffer's offsets
    when key slices overlap), its row terms (LSE2, DELTA, padded: bwd_delta_kernel) at CU_L[b].
    FUSED_DQ: dQ is accumulated here too, into the zeroed fp32 DQA (same row layout as Q), by atomic
    adds, and the dQ kernel is not run (FA2/FA3's schedule: five matmuls per block pair instead of
    seven).
    IDX_CHUNK > 0: indexed walks read the query-block indices IDX_CHUNK at a time into registers; else one
    index load per iteration, which IDX_DEEP pipelines two levels deep in the unmasked pass (_dkdv_head;
    MASKED_ONE_STAGE: how a contiguous schedule's masked pass is walked). TERMS_TMA (with QDO_TMA): the row
    terms LSE2 / DELTA by TMA (_terms_desc) instead of pointer loads. TILE_ORDER: program i of a (batch,
    kv head) row takes the key tiles of block T_ORDER[b, h, i // (BLOCK_K // BLOCK_N)] (launch.tile_order:
    the row's key blocks, longest walk first; the grid then has whole blocks of tiles, those past k_len
    return at once). WAVE (indexed rows): the wave order
    of fwd_kernel, here over the query blocks of the transposed rows, so the programs running at once read
    one stretch of Q / dO (_bwd_wave). With G query heads a program's unmasked walks are one walk of G rows,
    started at the fraction t / P of it: head h0 = floor(G t / P) from slot s0 on, the other heads in turn,
    then h0 up to s0. (Rotating each head's row on its own put the programs running at once on different
    heads: 4x the Q / dO, and GQA's 32K random 0.5 backward 12% slower than in grid order, H100.)"""
    i_slot = tl.program_id(0)  # the program's place in the dispatch order (the wave order's clock)
    i_b, i_hk = _batch_head(HKV, SPLIT_GRID)
    if TILE_ORDER:  # the key tile this place takes: the row's longest walks go first (launch.tile_order)
        SUBK: tl.constexpr = BLOCK_K // BLOCK_N
        i_n = tl.load(T_ORDER + i_b * stride_ob + i_hk * stride_oh + i_slot // SUBK) * SUBK + i_slot % SUBK
    else:
        i_n = i_slot
    q0, q_len, k0, k_len = _seq_bounds(CU_Q, CU_K, i_b, Lq, Lk, SEQ_STEP, IS_VARLEN)
    if i_n * BLOCK_N >= k_len:
        return
    offset = k_len - q_len
    kb = (i_n * BLOCK_N) // BLOCK_K
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    m_nd = (o_n < k_len)[:, None] & (o_d < HEAD_DIM)[None, :]
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh + (k0 + o_n.to(tl.int64))[:, None] * stride_kn + o_d[None, :]
    p_v = V + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh + (k0 + o_n.to(tl.int64))[:, None] * stride_vn + o_d[None, :]
    b_k = tl.load(p_k, mask=m_nd, other=0.0)  # [BN, D]
    b_v = tl.load(p_v, mask=m_nd, other=0.0)  # [BN, D]
    qk_scale = sm_scale * LOG2E
    b_dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    b_dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    pos_k = o_n[:, None]
    l0 = _rows_start(CU_L, i_b, IS_VARLEN)
    # HEADS_INSIDE: one pass per phase, each over all heads; else one pass over both phases per head.
    # Heads inside because with the head loop outside (heads, then phases) ptxas (CUDA 13, sm_90)
    # waited for every wgmma right after issuing it whenever G > 1 (the JIT specializes G == 1 away),
    # with no warning: GQA's dK/dV kernel ran 9-20% slower (NOTES.md, backward 16)
    PASSES: tl.constexpr = 2 if HEADS_INSIDE else 1
    wave_t, period = _bwd_wave(i_slot, BLOCK_M, BLOCK_N, D_PAD, N_SM, WAVE, SPLIT_GRID)
    # the wave order over G heads (heads inside): pass 0 walks G + 1 pieces, h0's row split in two.
    # Pass 1 then takes G + 1 steps too, the last one empty: with G + 1 steps in pass 0 and G in pass
    # 1, ptxas (triton 3.6, sm_90) waited for every wgmma right after issuing it
    SPLIT: tl.constexpr = WAVE and HEADS_INSIDE
    h0 = wave_t * G // period
    for p in tl.static_range(PASSES):
        for g in range(0, G + 1 if SPLIT else G):
            if SPLIT and p == 0:
                h = h0 + g
                h = tl.where(h >= G, h - G, h)
                seg = tl.where(g == 0, SEG_FROM_S0, tl.where(g == G, SEG_TO_S0, SEG_WHOLE))
            elif SPLIT:
                h = tl.minimum(g, G - 1)
                seg = tl.where(g == G, SEG_NONE, SEG_ROUND)
            else:
                h = g
                seg = SEG_ROUND
            b_dk, b_dv = _dkdv_head(b_dk, b_dv, i_hk * G + h, b_k, b_v, Q, DO, LSE2, DELTA, DQA, T_COUNTS, T_N_FULL,
                                    T_INDICES, T_MASK_IDS, TERMS, i_b, kb, q0, q_len, k_len, l0, offset, o_d, pos_k,
                                    qk_scale, sm_scale, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh,
                                    stride_dom, stride_lb, stride_lh, stride_dqab, stride_dqah, stride_dqam,
                                    stride_cb, stride_ch, stride_ib, stride_ih, stride_iq, HEAD_DIM, D_PAD, BLOCK_Q,
                                    BLOCK_M, N_TERMS, NUM_STAGES, FUSED_DQ, DQ_TMA, QDO_TMA, IDX_CHUNK, DP_FIRST,
                                    p if HEADS_INSIDE else 0, p + 1 if HEADS_INSIDE else 2, CONTIGUOUS,
                                    wave_t * G % period if SPLIT else wave_t, period, seg, WAVE, DELTA_ACC,
                                    IDX_DEEP, MASKED_ONE_STAGE, TERMS_TMA)
    b_dk = b_dk * sm_scale
    if IS_VARLEN:
        dk0 = tl.load(CU_DK + i_b * SEQ_STEP)
    else:
        dk0 = 0
    p_dk = DK + i_b.to(tl.int64) * stride_dkb + i_hk.to(tl.int64) * stride_dkh + (dk0 + o_n.to(tl.int64))[:, None] * stride_dkn + o_d[None, :]
    p_dv = DV + i_b.to(tl.int64) * stride_dvb + i_hk.to(tl.int64) * stride_dvh + (dk0 + o_n.to(tl.int64))[:, None] * stride_dvn + o_d[None, :]
    tl.store(p_dk, b_dk.to(DK.dtype.element_ty), mask=m_nd)
    tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=m_nd)


@triton.jit
def _dq_step(b_q, b_do, b_lse, b_delta, b_dq, K, V, desc_k, desc_v, kv_base, vv_base, start_n, k_len, o_d, pos_q,
             stride_kn, stride_vn, qk_scale, TERMS, mid,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, N_TERMS: tl.constexpr, MASKED_PHASE: tl.constexpr,
             KV_TMA: tl.constexpr):
    """Accumulate one key tile's contribution to dQ. MASKED_PHASE: the tile is one of the row's masked
    blocks or crosses the sequence end (the loop's second phase): element masks apply, and keys past
    the end (loaded as 0) get P = 0. Their score 0 gave P = 2**-lse2, which overflows to inf for rows
    whose LSE is below -88 (all their keys' scores very negative), and inf * 0 made NaN in dQ
    (tests/gpu/test_fuzz_gpu.py found it). KV_TMA: K/V tiles through the per-head descriptors."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    if KV_TMA:  # no per-element addresses or masks (on packed inputs k_len is not known to be a multiple
        # of 16, and the masked pointer loads fall back to narrow copies)
        b_k = desc_k.load([start_n, 0])  # [BN, D]
        b_v = desc_v.load([start_n, 0])  # [BN, D]
    else:
        m_nd = (o_n < k_len)[:, None] & (o_d < HEAD_DIM)[None, :]
        b_k = tl.load(K + kv_base + o_n.to(tl.int64)[:, None] * stride_kn + o_d[None, :], mask=m_nd, other=0.0)
        b_v = tl.load(V + vv_base + o_n.to(tl.int64)[:, None] * stride_vn + o_d[None, :], mask=m_nd, other=0.0)
    b_p = tl.math.exp2(tl.dot(b_q, tl.trans(b_k)) * qk_scale - b_lse[:, None])  # [BM, BN]
    if MASKED_PHASE:
        b_p = tl.where((o_n < k_len)[None, :], b_p, 0.0)
        if N_TERMS > 0:
            if mid >= 0:
                b_p = tl.where(_allowed(pos_q, o_n[None, :], TERMS, mid, N_TERMS, False), b_p, 0.0)
    b_ds = b_p * (tl.dot(b_do, tl.trans(b_v)) - b_delta[:, None])
    return tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)


@triton.jit(do_not_specialize=["TUNE_CLASS"])
def bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    COUNTS, N_FULL, INDICES, MASK_IDS, TERMS, CU_Q, CU_K, CU_L,
    sm_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqm,
    stride_cb, stride_ch,
    stride_ib, stride_ih, stride_iq,
    H, G, Lq, Lk, SEQ_STEP, TUNE_CLASS, N_SM,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    N_TERMS: tl.constexpr, IS_VARLEN: tl.constexpr, NUM_STAGES: tl.constexpr, IDX_CHUNK: tl.constexpr,
    KV_TMA: tl.constexpr, CONTIGUOUS: tl.constexpr, WAVE: tl.constexpr, IDX_DEEP: tl.constexpr,
    SPLIT_GRID: tl.constexpr, REVERSE: tl.constexpr,
):
    """Grid (query tiles, B * H; SPLIT_GRID: H, B; REVERSE: _query_tile), visiting the same schedule
    as the forward. KV_TMA: K/V tiles through TMA descriptors (Hopper+, 16-byte aligned rows), else
    pointer loads. WAVE: the unmasked blocks' indexed walk in the wave order; IDX_CHUNK, IDX_DEEP: how
    indexed walks read the block indices; both as in bwd_dkdv_kernel."""
    i_m, i_b, i_h, i_hk, q0, q_len, k0, k_len, p_cnt, p_row = _query_tile(
        CU_Q, CU_K, H, G, Lq, Lk, SEQ_STEP, stride_cb, stride_ch, stride_ib, stride_ih, stride_iq,
        BLOCK_Q, BLOCK_M, IS_VARLEN, SPLIT_GRID, REVERSE, 1, False)
    if i_m * BLOCK_M >= q_len:
        return
    offset = k_len - q_len
    SUB: tl.constexpr = BLOCK_K // BLOCK_N
    count = tl.load(COUNTS + p_cnt)
    n_full = tl.load(N_FULL + p_cnt)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, D_PAD)
    m_m = o_m < q_len
    m_md = m_m[:, None] & (o_d < HEAD_DIM)[None, :]
    b_q = tl.load(Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + (q0 + o_m.to(tl.int64))[:, None] * stride_qm + o_d[None, :], mask=m_md, other=0.0)
    b_do = tl.load(DO + i_b.to(tl.int64) * stride_dob + i_h.to(tl.int64) * stride_doh + (q0 + o_m.to(tl.int64))[:, None] * stride_dom + o_d[None, :], mask=m_md, other=0.0)
    l_off = i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + _rows_start(CU_L, i_b, IS_VARLEN) + o_m
    b_lse = tl.load(LSE2 + l_off, mask=m_m, other=float("inf"))  # once per program: the mask costs nothing
    b_delta = tl.load(DELTA + l_off, mask=m_m, other=0.0)
    kv_base = i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh + k0.to(tl.int64) * stride_kn
    vv_base = i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh + k0.to(tl.int64) * stride_vn
    # this kv head's keys of the sequence (KV_TMA): rows past k_len read as 0
    desc_k = _rows_desc(K, kv_base, k_len, stride_kn, BLOCK_N, HEAD_DIM, D_PAD, KV_TMA)
    desc_v = _rows_desc(V, vv_base, k_len, stride_vn, BLOCK_N, HEAD_DIM, D_PAD, KV_TMA)
    pos_q = (o_m + offset)[:, None]
    qk_scale = sm_scale * LOG2E
    b_dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    tl.static_assert(not IDX_DEEP or IDX_CHUNK == 0, "deep index loads replace the register chunks")
    wave_t, period = _bwd_wave(tl.program_id(0), BLOCK_M, BLOCK_N, D_PAD, N_SM, WAVE, SPLIT_GRID)
    for phase in tl.static_range(2):  # as in bwd_dkdv_kernel: unmasked blocks, then masked ones
        lo = 0 if phase == 0 else n_full
        hi = n_full if phase == 0 else count
        rot = wave_t * hi // period  # the wave order's start slot (used only where WAVE and phase == 0)
        if CONTIGUOUS and phase == 0:  # one run from slot 0, walked by arithmetic (bwd_dkdv_kernel)
            run0 = _run_start(INDICES, p_row, n_full, BLOCK_K)
            for it in tl.range(0, n_full * SUB, num_stages=NUM_STAGES):
                b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_dq, K, V, desc_k, desc_v, kv_base, vv_base,
                                run0 + it * BLOCK_N, k_len, o_d, pos_q, stride_kn, stride_vn, qk_scale, TERMS, -1,
                                BLOCK_N, HEAD_DIM, N_TERMS, False, KV_TMA)
        elif IDX_CHUNK > 0:  # key-block indices from registers, as in bwd_dkdv_kernel
            o_c = tl.arange(0, IDX_CHUNK)
            for c0 in range(lo, hi, IDX_CHUNK):
                blocks, mids = _index_chunk(INDICES, MASK_IDS, p_row, c0, hi, o_c, rot, hi, WAVE and phase == 0)
                for it in tl.range(0, tl.minimum(hi - c0, IDX_CHUNK) * SUB, num_stages=NUM_STAGES):
                    start_n = _pick(blocks, o_c, it // SUB) * BLOCK_K + (it % SUB) * BLOCK_N
                    b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_dq, K, V, desc_k, desc_v, kv_base, vv_base,
                                    start_n, k_len, o_d, pos_q, stride_kn, stride_vn, qk_scale, TERMS,
                                    _pick(mids, o_c, it // SUB), BLOCK_N, HEAD_DIM, N_TERMS,
                                    phase == 1, KV_TMA)
        else:  # one index load per iteration; IDX_DEEP: two levels of stages (bwd_dkdv_kernel)
            for it in tl.range(lo * SUB, hi * SUB,
                               num_stages=2 * NUM_STAGES - 1 if IDX_DEEP and phase == 0 else NUM_STAGES):
                slot = _rotated(it // SUB, rot, hi, WAVE and phase == 0)
                start_n = tl.load(INDICES + p_row + slot) * BLOCK_K + (it % SUB) * BLOCK_N
                b_dq = _dq_step(b_q, b_do, b_lse, b_delta, b_dq, K, V, desc_k, desc_v, kv_base, vv_base, start_n,
                                k_len, o_d, pos_q, stride_kn, stride_vn, qk_scale, TERMS,
                                tl.load(MASK_IDS + p_row + slot), BLOCK_N, HEAD_DIM, N_TERMS,
                                phase == 1, KV_TMA)
    b_dq = b_dq * sm_scale
    p_dq = DQ + i_b.to(tl.int64) * stride_dqb + i_h.to(tl.int64) * stride_dqh + (q0 + o_m.to(tl.int64))[:, None] * stride_dqm + o_d[None, :]
    tl.store(p_dq, b_dq.to(DQ.dtype.element_ty), mask=m_md)
