"""8-bit forward for sm_90 in Gluon (Triton's lower-level dialect): FA3's intra-warpgroup overlap.

Triton's ``tl.dot`` waits on every wgmma right after issuing it unless the result is a loop-carried
accumulator, so the plain kernel (block_sparse/kernels.py, QUANT 1 / 2) runs Q.K, softmax and P.V
one after the other within a warpgroup. Here the wgmmas are issued asynchronously by hand:

    iteration j (scores S_j ready, P_{j-1}.V_{j-1} in flight):
        issue S_{j+1} = Q.K_{j+1}^T            (async)
        softmax of S_j -> P_j                  (ALUs, MUFU: overlaps both wgmmas in flight)
        wait for P_{j-1}.V_{j-1} and S_{j+1}; refill the K/V slot tile j-1 used; rescale O
        issue O += P_j.V_j                     (async, P_j from registers; runs during softmax j+1)

Dense rows only (every key tile of a row, no element mask): keys in whole ``BLOCK_N`` tiles, K
scales one per key tile (``KS_PER_TILE``, the per_block / per_warp K groups of 128 keys).
Symbols follow block_sparse/kernels.py.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, t, n_tiles, k_row, v_row, v_col0,
              BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, V_TRANS: gl.constexpr):
    """TMA copies of key tile t's K [BN, D] and V (V^T [D, BN] when V_TRANS) into slot t % NUM_BUF,
    each signalling its own barrier; nothing past the row's last tile."""
    slot = t % NUM_BUF
    ok = t < n_tiles
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, ok)
    tma.async_copy_global_to_shared(k_desc, [k_row + t * BLOCK_N, 0], k_bar.index(slot), k_smem.index(slot), ok)
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes, ok)
    if V_TRANS:
        tma.async_copy_global_to_shared(v_desc, [v_row, v_col0 + t * BLOCK_N], v_bar.index(slot), v_smem.index(slot),
                                        ok)
    else:
        tma.async_copy_global_to_shared(v_desc, [v_row + t * BLOCK_N, 0], v_bar.index(slot), v_smem.index(slot), ok)


@gluon.jit
def _tile_step(j, b_s, b_m, b_l, b_acc, ks_cur, b_rs, p_ks, s_zero, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc,
               v_desc, k_row, v_row, n_tiles, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, V_TRANS: gl.constexpr,
               LOG2_P_SCALE: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr, WAIT_BOTH: gl.constexpr):
    """Key tile j of dense_fwd_kernel's loop (S_j = b_s ready, P_{j-1}.V_{j-1} in flight); returns S_{j+1}
    and the updated softmax state, with P_j.V_j in flight.
    WAIT_BOTH: one wait(0) for P_{j-1}.V_{j-1} and S_{j+1} together. In a loop of one tile per
    iteration, waiting for P.V alone (wait(1), S_{j+1} still in flight) makes ptxas serialize every
    wgmma of the kernel (warning C7514, sm_90): S_{j+1} is copied into S_j's registers at the back
    edge. Without WAIT_BOTH the caller unrolls two steps, so no such copy exists."""
    slot = j % NUM_BUF
    # 1. the next tile's scores, in flight during this tile's softmax (past the last tile: an unused
    #    product of a stale slot, no wait on its barrier)
    nxt = j + 1
    n_slot = nxt % NUM_BUF
    mbarrier.wait(k_bar.index(n_slot), (nxt // NUM_BUF) & 1, pred=nxt < n_tiles)
    s_next = hopper.warpgroup_mma(q_smem, k_smem.index(n_slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
    ks_next = gl.load(p_ks + gl.minimum(nxt, n_tiles - 1) * BLOCK_N)
    # 2. online softmax of tile j (scales are > 0: the row max commutes with them)
    rs_t = b_rs * ks_cur
    s_f = b_s.to(gl.float32)
    m_new = gl.maximum(b_m, gl.max(s_f, 1) * rs_t)
    b_p = gl.exp2(s_f * rs_t[:, None] - (m_new - LOG2_P_SCALE)[:, None])
    alpha = gl.exp2(b_m - m_new)
    b_l = b_l * alpha + gl.sum(b_p, 1)
    p_lo = b_p.to(v_smem.dtype)  # narrowed now: 16 registers, not 64, stay live across the wait
    # 3. P_{j-1}.V_{j-1} done: tile j-1's slot is free, and so are the registers it read P_{j-1} from
    if WAIT_BOTH:
        b_acc, s_next = hopper.warpgroup_mma_wait(0, deps=(b_acc, s_next))
    else:
        b_acc = hopper.warpgroup_mma_wait(1, deps=(b_acc, ))
    p_op = gl.convert_layout(p_lo, p_layout)
    if j > 0:
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j - 1 + NUM_BUF, n_tiles, k_row, v_row, 0, BLOCK_N,
                  NUM_BUF, V_TRANS)
    b_acc = b_acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_bar.index(slot), (j // NUM_BUF) & 1)
    if V_TRANS:
        v_op = v_smem.index(slot).permute((1, 0))
    else:
        v_op = v_smem.index(slot)
    b_acc = hopper.warpgroup_mma(p_op, v_op, b_acc, is_async=True)  # in flight during the next softmax
    if not WAIT_BOTH:
        s_next = hopper.warpgroup_mma_wait(1, deps=(s_next, ))
    return s_next, m_new, b_l, b_acc, ks_next


@gluon.jit
def dense_fwd_kernel(
    q_desc, k_desc, v_desc, O, LSE, Q_SCALE, K_SCALE, V_SCALE, sm_scale,
    H, HKV, L,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr,
    QUANT: gl.constexpr, UNROLL2: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (L / BLOCK_M, B * H). q_desc over int8 Q as [B * H * L, D] rows, k_desc int8 K as
    [B * HKV * L, D]; QUANT 2: v_desc FP8 V^T as [B * HKV * D, Lp] (block [D, BN]); QUANT 1: v_desc
    V as [B * HKV * L, D]. Scales as in block_sparse/kernels.py (K scale read once per key tile).
    L must be a multiple of BLOCK_N and BLOCK_M."""
    V_TRANS: gl.constexpr = QUANT == 2
    LOG2_P_SCALE: gl.constexpr = 8.807354922057604 if QUANT == 2 else 0.0  # log2(448): FP8 e4m3's range
    G = H // HKV
    i_m = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hk = i_h // G
    i_bhk = i_b * HKV + i_hk
    n_tiles = L // BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    k_pv: gl.constexpr = 32 if QUANT == 2 else 16
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, k_pv])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // (8 if QUANT == 2 else 16))
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    k_row = i_bhk * L
    if V_TRANS:
        v_row = i_bhk * HEAD_DIM
    else:
        v_row = k_row
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [i_bh * L + i_m * BLOCK_M, 0], q_bar, q_smem)
    for t in gl.static_range(NUM_BUF):
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, t, n_tiles, k_row, v_row, 0, BLOCK_N, NUM_BUF,
                  V_TRANS)

    o_m = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    # per-row Q scale folded with the softmax scale: one FMA per score takes it to log2 units
    b_rs = gl.load(Q_SCALE + i_b.to(gl.int64) * stride_qsb + i_h.to(gl.int64) * stride_qsh + o_m) * (sm_scale * LOG2E)
    p_ks = K_SCALE + i_b.to(gl.int64) * stride_ksb + i_hk.to(gl.int64) * stride_ksh
    ks_cur = gl.load(p_ks)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    b_s = hopper.warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b_s = hopper.warpgroup_mma_wait(0, deps=(b_s, ))

    b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    b_l = gl.zeros([BLOCK_M], gl.float32, s_rows)
    b_acc = hopper.warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    if UNROLL2:  # two tiles per iteration: no register copies of S at the back edge (see _tile_step)
        for j0 in range(0, n_tiles, 2):
            b_s, b_m, b_l, b_acc, ks_cur = _tile_step(
                j0, b_s, b_m, b_l, b_acc, ks_cur, b_rs, p_ks, s_zero, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc,
                v_desc, k_row, v_row, n_tiles, BLOCK_N, NUM_BUF, V_TRANS, LOG2_P_SCALE, p_layout, o_rows, False)
            b_s, b_m, b_l, b_acc, ks_cur = _tile_step(
                j0 + 1, b_s, b_m, b_l, b_acc, ks_cur, b_rs, p_ks, s_zero, q_smem, k_smem, v_smem, k_bar, v_bar,
                k_desc, v_desc, k_row, v_row, n_tiles, BLOCK_N, NUM_BUF, V_TRANS, LOG2_P_SCALE, p_layout, o_rows,
                False)
    else:
        for j in range(n_tiles):
            b_s, b_m, b_l, b_acc, ks_cur = _tile_step(
                j, b_s, b_m, b_l, b_acc, ks_cur, b_rs, p_ks, s_zero, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc,
                v_desc, k_row, v_row, n_tiles, BLOCK_N, NUM_BUF, V_TRANS, LOG2_P_SCALE, p_layout, o_rows, True)
    b_acc = hopper.warpgroup_mma_wait(0, deps=(b_acc, ))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    o_d = gl.arange(0, HEAD_DIM, layout=o_cols)
    b_o = b_acc / gl.convert_layout(b_l, o_rows)[:, None]
    if V_TRANS:
        b_vs = gl.load(V_SCALE + i_b.to(gl.int64) * stride_vsb + i_hk.to(gl.int64) * stride_vsh + o_d)
        b_o = b_o * b_vs[None, :]
    o_mo = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
    p_o = O + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh + o_mo.to(gl.int64)[:, None] * stride_om + o_d[None, :]
    gl.store(p_o, b_o.to(O.dtype.element_ty))
    b_lse = (b_m + gl.log2(b_l) - LOG2_P_SCALE) * LN2
    gl.store(LSE + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + o_m, b_lse)


# ---- warp-specialized variant: FA3's producer warpgroup + two ping-ponged consumer warpgroups ----

@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, q_row, k_row, v_row,
               n_tiles, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, V_TRANS: gl.constexpr):
    """Producer: both consumers' Q tiles, then every key tile's K and V into NUM_BUF slots; a slot is
    refilled once both consumers released it (kv_free, count 2)."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * HALF, 0], q_bar.index(w), q_smem.index(w))
    for t in range(n_tiles):
        slot = t % NUM_BUF
        mbarrier.wait(kv_free.index(slot), ((t // NUM_BUF) - 1) & 1, pred=t >= NUM_BUF)
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, t, n_tiles, k_row, v_row, 0, BLOCK_N, NUM_BUF,
                  V_TRANS)


@gluon.jit
def _ws_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, turn, O, LSE, Q_SCALE,
                 K_SCALE, V_SCALE, sm_scale, i_b, i_h, i_hk, row0, n_tiles,
                 stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                 stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, QUANT: gl.constexpr,
                 PING_PONG: gl.constexpr):
    """One warpgroup's 64 query rows (row0 + 64 WG ...). Per key tile j (S_j ready):
        softmax of S_j                                   (the other warpgroup's wgmmas run meanwhile)
        [PING_PONG: wait for the other warpgroup's issue turn]
        issue S_{j+1}; wait P_{j-1}.V_{j-1} and release its slot; rescale O; issue O += P_j.V_j
        [PING_PONG: hand the turn over]
        wait S_{j+1}"""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    LOG2_P_SCALE: gl.constexpr = 8.807354922057604 if QUANT == 2 else 0.0
    V_TRANS: gl.constexpr = QUANT == 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    k_pv: gl.constexpr = 32 if QUANT == 2 else 16
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, k_pv])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // (8 if QUANT == 2 else 16))
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    q_tile = q_smem.index(WG)

    o_m = row0 + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    b_rs = gl.load(Q_SCALE + i_b.to(gl.int64) * stride_qsb + i_h.to(gl.int64) * stride_qsh + o_m) * (sm_scale * LOG2E)
    p_ks = K_SCALE + i_b.to(gl.int64) * stride_ksb + i_hk.to(gl.int64) * stride_ksh
    ks_cur = gl.load(p_ks)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s_layout)
    if PING_PONG and WG == 1:  # warpgroup 0 issues first
        mbarrier.wait(turn.index(1), 0)
    mbarrier.wait(q_bar.index(WG), 0)
    mbarrier.wait(k_bar.index(0), 0)
    b_s = hopper.warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PING_PONG:
        mbarrier.arrive(turn.index(1 - WG))
    b_s = hopper.warpgroup_mma_wait(0, deps=(b_s, ))

    b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, s_rows)
    b_l = gl.zeros([BLOCK_M], gl.float32, s_rows)
    b_acc = hopper.warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
    for j in range(n_tiles):
        slot = j % NUM_BUF
        nxt = j + 1
        n_slot = nxt % NUM_BUF
        ks_next = gl.load(p_ks + gl.minimum(nxt, n_tiles - 1) * BLOCK_N)
        rs_t = b_rs * ks_cur
        s_f = b_s.to(gl.float32)
        m_new = gl.maximum(b_m, gl.max(s_f, 1) * rs_t)
        b_p = gl.exp2(s_f * rs_t[:, None] - (m_new - LOG2_P_SCALE)[:, None])
        alpha = gl.exp2(b_m - m_new)
        b_l = b_l * alpha + gl.sum(b_p, 1)
        b_m = m_new
        p_lo = b_p.to(v_smem.dtype)
        if PING_PONG:  # turn k = j + 1 follows the other's turn k - 1 (WG 0) or k (WG 1): its (k + WG)-th arrive
            mbarrier.wait(turn.index(WG), (j + WG) & 1)
        mbarrier.wait(k_bar.index(n_slot), (nxt // NUM_BUF) & 1, pred=nxt < n_tiles)
        s_next = hopper.warpgroup_mma(q_tile, k_smem.index(n_slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
        b_acc, s_next = hopper.warpgroup_mma_wait(0, deps=(b_acc, s_next))  # see dense_fwd_kernel, step 3
        p_op = gl.convert_layout(p_lo, p_layout)
        if j > 0:
            mbarrier.arrive(kv_free.index((j - 1) % NUM_BUF))
        b_acc = b_acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_bar.index(slot), (j // NUM_BUF) & 1)
        if V_TRANS:
            v_op = v_smem.index(slot).permute((1, 0))
        else:
            v_op = v_smem.index(slot)
        b_acc = hopper.warpgroup_mma(p_op, v_op, b_acc, is_async=True)
        if PING_PONG:
            mbarrier.arrive(turn.index(1 - WG))
        b_s = s_next
        ks_cur = ks_next
    b_acc = hopper.warpgroup_mma_wait(0, deps=(b_acc, ))

    o_d = gl.arange(0, HEAD_DIM, layout=o_cols)
    b_o = b_acc / gl.convert_layout(b_l, o_rows)[:, None]
    if V_TRANS:
        b_vs = gl.load(V_SCALE + i_b.to(gl.int64) * stride_vsb + i_hk.to(gl.int64) * stride_vsh + o_d)
        b_o = b_o * b_vs[None, :]
    o_mo = row0 + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
    p_o = O + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh + o_mo.to(gl.int64)[:, None] * stride_om + o_d[None, :]
    gl.store(p_o, b_o.to(O.dtype.element_ty))
    b_lse = (b_m + gl.log2(b_l) - LOG2_P_SCALE) * LN2
    gl.store(LSE + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + o_m, b_lse)


@gluon.jit
def dense_fwd_ws_kernel(
    q_desc, k_desc, v_desc, O, LSE, Q_SCALE, K_SCALE, V_SCALE, sm_scale,
    H, HKV, L,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, QUANT: gl.constexpr,
    PING_PONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """dense_fwd_kernel's contract with a 128-row query tile per CTA (q_desc's block is [64, D]: one
    per consumer warpgroup). Launch with num_warps=4 (the default partition: consumer 0); consumer 1
    and the loader are 4-warp worker partitions."""
    V_TRANS: gl.constexpr = QUANT == 2
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    G = H // HKV
    i_m = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hk = i_h // G
    i_bhk = i_b * HKV + i_hk
    n_tiles = L // BLOCK_N
    row0 = i_m * (2 * HALF)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)

    k_row = i_bhk * L
    if V_TRANS:
        v_row = i_bhk * HEAD_DIM
    else:
        v_row = k_row
    q_row = i_bh * L + row0
    # the argument tuples are spelled out: tuple arithmetic in the frontend turns constexprs into tensors
    gl.warp_specialize([
        (_ws_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, turn, O, LSE, Q_SCALE, K_SCALE,
                        V_SCALE, sm_scale, i_b, i_h, i_hk, row0, n_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh, BLOCK_N,
                        HEAD_DIM, NUM_BUF, QUANT, PING_PONG)),
        (_ws_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, turn, O, LSE, Q_SCALE, K_SCALE,
                        V_SCALE, sm_scale, i_b, i_h, i_hk, row0, n_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh, BLOCK_N,
                        HEAD_DIM, NUM_BUF, QUANT, PING_PONG)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, kv_free, q_row, k_row,
                      v_row, n_tiles, BLOCK_N, NUM_BUF, V_TRANS)),
    ], [4, 4], [CONSUMER_REGS, LOADER_REGS])
