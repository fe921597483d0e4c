"""Experiment: a five-product backward for sm_90 written in Gluon (Triton's lower-level dialect).

Why: our backward and Flex's both run seven matmul units per block pair (a dK/dV pass with S, dP,
dV, dK and a dQ pass that recomputes S and dP). The kernels issue's fwd+bwd target (1.3x Flex)
needs our backward ~1.3x Flex's, which at seven units would mean ~745 TFLOP/s per unit on a board
that holds 1.4-1.6 GHz under these kernels (benchmarks/NOTES.md, backward, "What limits it now").
Five units (FA2/FA3: dQ accumulated by atomics from the dK/dV pass) are the only way there. Our
Triton fused kernel (launch.BWD_VARIANT "fused") is 17% slower than split, because ``tl.dot`` waits
on every non-accumulator product right after issuing it and its dQ staging fills shared memory.
Here the wgmmas are issued asynchronously by hand.

One program per (key tile of BLOCK_N = 128 keys, head); two warpgroups, each 64 keys; it walks the
query tiles (BLOCK_M = 64) of its head, Q / dO and the LSE2 / delta row terms through TMA into
NUM_BUF slots. A step in ORDER "C", the fastest measured:

    S^T = K Q^T, dP^T = V dO^T - delta     (both issued; wait S only)
    P^T = exp2(S^T * qk_scale - lse2)      (dP^T still in flight; then wait it)
    dS^T = P^T * dP^T -> shared memory (two buffers);  CTA barrier;  refill the previous step's slot
    dQ_tile = dS K (each warpgroup half the head dim), dV += P^T dO, dK += dS^T Q   (all issued)
    wait dQ;  dQA[tile] += sm_scale * dQ_tile   (fp32 red.global.add.v2 while dV and dK run)

Measured on the H100 (benchmarks/NOTES.md, backward item 27): 4% faster than the shipped split
backward on causal 16K, 7% slower on dense; not shipped.

Probe scope: dense or causal (Lq == Lk), MHA, head dim 128, bf16/fp16, L a multiple of 128.
``python benchmarks/gluon_bwd.py`` compiles it for sm_90 without a GPU and prints registers,
spills and whether ptxas serialized the wgmmas.
"""
from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 8


@gluon.jit
def _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bars, i, n_iter,
               first, rot, head_row, t_row, BLOCK_M: gl.constexpr, NUM_BUF: gl.constexpr, TERMS_TMA: gl.constexpr):
    """TMA copies of walk step i's Q and dO tiles (head rows from ``head_row``) and, with TERMS_TMA, its
    LSE2 / delta row terms (row ``t_row`` of the [B * H, Lpad] terms) into slot i % NUM_BUF, all on
    that slot's barrier; nothing past the walk's end."""
    slot = i % NUM_BUF
    ok = i < n_iter
    start_m = _step_tile(i, first, n_iter, rot) * BLOCK_M
    if TERMS_TMA:
        mbarrier.expect(bars.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes +
                        lse_desc.block_type.nbytes + delta_desc.block_type.nbytes, ok)
    else:
        mbarrier.expect(bars.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes, ok)
    tma.async_copy_global_to_shared(q_desc, [head_row + start_m, 0], bars.index(slot), q_smem.index(slot), ok)
    tma.async_copy_global_to_shared(do_desc, [head_row + start_m, 0], bars.index(slot), do_smem.index(slot), ok)
    if TERMS_TMA:
        tma.async_copy_global_to_shared(lse_desc, [t_row, start_m], bars.index(slot), lse_smem.index(slot),
                                        ok)
        tma.async_copy_global_to_shared(delta_desc, [t_row, start_m], bars.index(slot),
                                        delta_smem.index(slot), ok)


@gluon.jit
def _step_tile(i, first, n_iter, rot):
    """The query tile walk step i visits: the walk covers tiles first .. first + n_iter - 1, from
    first + rot onwards, wrapping."""
    t = i + rot
    t = gl.where(t >= n_iter, t - n_iter, t)
    return first + t


@gluon.jit
def _issue_sdp(i, n_iter, start_m, k_smem, v_smem, q_smem, do_smem, delta_smem, qdo_bar, p_delta0, o_q, st_zero,
               st_layout: gl.constexpr, NUM_BUF: gl.constexpr, DELTA_ACC: gl.constexpr, TERMS_TMA: gl.constexpr):
    """Issue walk step i's (query tile at start_m) S^T = K Q^T and dP^T = V dO^T (minus delta with
    DELTA_ACC) once its Q/dO have landed (past the walk's end: no wait, the products of a stale slot,
    never read)."""
    slot = i % NUM_BUF
    mbarrier.wait(qdo_bar.index(slot), (i // NUM_BUF) & 1, pred=i < n_iter)
    q_s = q_smem.index(slot)
    do_s = do_smem.index(slot)
    b_st = hopper.warpgroup_mma(k_smem, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    if DELTA_ACC:  # delta through dP's accumulator (the Triton kernel's DELTA_ACC)
        b_delta = _row_term(delta_smem, slot, p_delta0 + start_m, o_q, st_layout, TERMS_TMA)
        b_dpt = hopper.warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero - b_delta, is_async=True)
    else:
        b_dpt = hopper.warpgroup_mma(v_smem, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    return b_st, b_dpt


@gluon.jit
def _ds(b_pt, b_dpt, b_delta, DELTA_ACC: gl.constexpr, dtype: gl.constexpr):
    """dS^T = P^T * (dP^T - delta), rounded to the inputs' dtype (delta already in dP^T with DELTA_ACC)."""
    if not DELTA_ACC:
        b_dpt = b_dpt - b_delta
    return (b_pt * b_dpt).to(dtype)


@gluon.jit
def _row_term(smem, slot, ptr, o_q, st_layout: gl.constexpr, TERMS_TMA: gl.constexpr):
    """A step's LSE2 or delta as a [1, BLOCK_M] row broadcastable over S^T: from its shared-memory
    slot (TERMS_TMA, landed with the step's Q/dO) or by a global load whose latency the step waits out."""
    if TERMS_TMA:
        return smem.index(slot).load(st_layout)
    else:
        return gl.load(ptr + o_q)[None, :]


@gluon.jit
def fused_bwd_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, LSE2, DELTA, DK, DV, DQA, qk_scale,
                     sm_scale, L, stride_lbh, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     NUM_BUF: gl.constexpr, CAUSAL: gl.constexpr, ORDER: gl.constexpr, DELTA_ACC: gl.constexpr,
                     DQ_OUT: gl.constexpr, TERMS_TMA: gl.constexpr, ROTATE: gl.constexpr,
                     num_warps: gl.constexpr):
    """Grid (L / BLOCK_N, B * H). Descriptors over [B * H * L, D] rows (blocks [BLOCK_M, D] for Q / dO,
    [BLOCK_N, D] for K / V). LSE2 / DELTA: launch._row_terms' [B * H, Lpad] (log2 units / rowsum(O dO)).
    DK, DV: [B * H * L, D] like K; DQA: fp32 [B * H * L, D], zeroed, gets sm_scale * dS K added.
    ORDER: where dV and dK are issued around dQ (see the step): "A" both before the barrier, dQ
    waited with dK; "B" dV before, dK after dQ, in flight while dQ is added; "C" dV and dK after dQ;
    "D" as C, and the next step's S^T / dP^T issued before dQ is added (in flight across the loop).
    DQ_OUT: "atomic" (right); for timing only, with wrong dQ: "store" (plain stores of the same
    bytes), "skip" (no dQ product either: the dK/dV pass alone; ORDER "A")."""
    i_n = gl.program_id(0)
    i_bh = gl.program_id(1)
    start_n = i_n * BLOCK_N
    n_tiles = L // BLOCK_M
    if CAUSAL:  # bottom-right = top-left here (Lq == Lk): query tiles before the key tile see none of it
        first = start_n // BLOCK_M
    else:
        first = 0
    n_iter = n_tiles - first
    if ROTATE and not CAUSAL:  # program n starts at its own diagonal and wraps: running programs add
        # into different dQ tiles at any moment (causal walks already start at their diagonals)
        rot = (i_n * (BLOCK_N // BLOCK_M)) % n_iter
    else:
        rot = 0
    head_row = i_bh * L

    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    WN: gl.constexpr = num_warps // 4
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN],
                                                        instr_shape=[16, HEAD_DIM // WN, 16])
    q_cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    k_rows: gl.constexpr = gl.SliceLayout(1, st_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF] + do_desc.block_type.shape, do_desc.layout)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_bar = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(NUM_BUF):
        mbarrier.init(qdo_bar.index(s), count=1)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [head_row + start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [head_row + start_n, 0], kv_bar, v_smem)
    for s in gl.static_range(NUM_BUF):
        _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, qdo_bar, s, n_iter,
                   first, rot, head_row, i_bh, BLOCK_M, NUM_BUF, TERMS_TMA)

    o_q = gl.arange(0, BLOCK_M, layout=q_cols)
    o_k = start_n + gl.arange(0, BLOCK_N, layout=k_rows)
    # scalar bases, moved per step: a [BLOCK_M] tensor of 64-bit offsets would hold 32 registers
    p_lse0 = LSE2 + i_bh.to(gl.int64) * stride_lbh
    p_delta0 = DELTA + i_bh.to(gl.int64) * stride_lbh
    dq_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    p_dq0 = DQA + head_row.to(gl.int64) * HEAD_DIM

    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
    b_dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    b_dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    if ORDER == "D":  # loop-carried in flight: the accumulators enter the loop as wgmma tokens
        b_dk = hopper.warpgroup_mma_init(b_dk)
        b_dv = hopper.warpgroup_mma_init(b_dv)
    mbarrier.wait(kv_bar, 0)
    if ORDER == "D":  # step 0's S^T and dP^T; each step then issues the next one's
        b_st, b_dpt = _issue_sdp(0, n_iter, _step_tile(0, first, n_iter, rot) * BLOCK_M, k_smem, v_smem, q_smem,
                                 do_smem, delta_smem, qdo_bar, p_delta0, o_q, st_zero, st_layout, NUM_BUF, DELTA_ACC,
                                 TERMS_TMA)
    for i in range(n_iter):
        slot = i % NUM_BUF
        start_m = _step_tile(i, first, n_iter, rot) * BLOCK_M
        q_s = q_smem.index(slot)
        do_s = do_smem.index(slot)
        if ORDER != "D":
            b_st, b_dpt = _issue_sdp(i, n_iter, start_m, k_smem, v_smem, q_smem, do_smem, delta_smem, qdo_bar,
                                     p_delta0, o_q, st_zero, st_layout, NUM_BUF, DELTA_ACC, TERMS_TMA)
        if DELTA_ACC:
            b_delta = st_zero  # unused
        else:  # loaded after the issues: the row terms' registers are live for less of the step
            b_delta = _row_term(delta_smem, slot, p_delta0 + start_m, o_q, st_layout, TERMS_TMA)
        b_lse = _row_term(lse_smem, slot, p_lse0 + start_m, o_q, st_layout, TERMS_TMA)
        if ORDER == "D":  # the previous step's dV and dK were issued before this step's S^T
            b_st, b_dv, b_dk = hopper.warpgroup_mma_wait(1, deps=(b_st, b_dv, b_dk))
        else:
            b_st = hopper.warpgroup_mma_wait(1, deps=(b_st, ))
        b_pt = gl.exp2(b_st * qk_scale - b_lse)
        if CAUSAL:
            if start_m < start_n + BLOCK_N:  # the tiles on the diagonal: keys after the query get nothing
                b_pt = gl.where(o_k[:, None] <= (start_m + o_q)[None, :], b_pt, 0.0)
        p_op = gl.convert_layout(b_pt.to(k_desc.dtype), a_layout)
        if ORDER == "C" or ORDER == "D":  # dP waited alone; every accumulation after the barrier
            b_dpt = hopper.warpgroup_mma_wait(0, deps=(b_dpt, ))
            b_dst = _ds(b_pt, b_dpt, b_delta, DELTA_ACC, k_desc.dtype)
        else:  # dV runs while dS is formed
            b_dv = hopper.warpgroup_mma(p_op, do_s, b_dv, is_async=True)
            b_dpt = hopper.warpgroup_mma_wait(1, deps=(b_dpt, ))
            b_dst = _ds(b_pt, b_dpt, b_delta, DELTA_ACC, k_desc.dtype)
        if ORDER == "A":  # dK before the barrier, dV retired (P^T's registers free for dQ's accumulator)
            ds_op = gl.convert_layout(b_dst, a_layout)
            b_dk = hopper.warpgroup_mma(ds_op, q_s, b_dk, is_async=True)
            b_dv, p_op = hopper.warpgroup_mma_wait(1, deps=(b_dv, p_op))
        ds_buf = ds_smem.index(i % 2)
        if DQ_OUT != "skip":
            ds_buf.store(b_dst)
            hopper.fence_async_shared()
        # every warpgroup's dS^T is in; every warpgroup has also finished step i - 1 (its products
        # waited for), so step i - 1's Q/dO slot and the other dS buffer are free
        gl.thread_barrier()
        if i > 0:
            _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, qdo_bar,
                       i - 1 + NUM_BUF, n_iter, first, rot, head_row, i_bh, BLOCK_M, NUM_BUF, TERMS_TMA)
        if DQ_OUT == "skip":  # (ORDER "A" only)
            b_dk, ds_op = hopper.warpgroup_mma_wait(0, deps=(b_dk, ds_op))
        else:
            b_dq = hopper.warpgroup_mma(ds_buf.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
            if ORDER == "A":
                b_dq, b_dk, ds_op = hopper.warpgroup_mma_wait(0, deps=(b_dq, b_dk, ds_op))
            elif ORDER == "B":  # dK in flight while dQ is added
                ds_op = gl.convert_layout(b_dst, a_layout)
                b_dk = hopper.warpgroup_mma(ds_op, q_s, b_dk, is_async=True)
                b_dq, b_dv, p_op = hopper.warpgroup_mma_wait(1, deps=(b_dq, b_dv, p_op))
            else:  # "C": dV and dK in flight while dQ is added; "D": also the next step's S^T and dP^T
                b_dv = hopper.warpgroup_mma(p_op, do_s, b_dv, is_async=True)
                ds_op = gl.convert_layout(b_dst, a_layout)
                b_dk = hopper.warpgroup_mma(ds_op, q_s, b_dk, is_async=True)
                if ORDER == "D":  # past the walk's end: an unused product of a stale slot
                    nxt_m = _step_tile(gl.minimum(i + 1, n_iter - 1), first, n_iter, rot) * BLOCK_M
                    b_st, b_dpt = _issue_sdp(i + 1, n_iter, nxt_m, k_smem, v_smem, q_smem, do_smem, delta_smem,
                                             qdo_bar, p_delta0, o_q, st_zero, st_layout, NUM_BUF, DELTA_ACC, TERMS_TMA)
                    b_dq = hopper.warpgroup_mma_wait(4, deps=(b_dq, ))
                else:
                    b_dq = hopper.warpgroup_mma_wait(2, deps=(b_dq, ))
            b_dq = b_dq * sm_scale
            p_dqt = p_dq0 + start_m * HEAD_DIM + dq_r[:, None] * HEAD_DIM + dq_c[None, :]
            if DQ_OUT == "atomic":  # Triton makes these red.global.add.v2.f32: two neighbouring columns each
                gl.atomic_add(p_dqt, b_dq, sem="relaxed")
            else:  # "store", timing only (wrong dQ): a plain store of the same bytes
                gl.store(p_dqt, b_dq)
            if ORDER == "B" or ORDER == "C":
                b_dv, b_dk, p_op, ds_op = hopper.warpgroup_mma_wait(0, deps=(b_dv, b_dk, p_op, ds_op))

    if ORDER == "D":
        b_dv, b_dk, b_st, b_dpt = hopper.warpgroup_mma_wait(0, deps=(b_dv, b_dk, b_st, b_dpt))
    for s in gl.static_range(NUM_BUF):
        mbarrier.invalidate(qdo_bar.index(s))
    mbarrier.invalidate(kv_bar)
    o_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    offs = (head_row + start_n + o_r).to(gl.int64)[:, None] * HEAD_DIM + o_d[None, :]
    gl.store(DK + offs, (b_dk * sm_scale).to(DK.dtype.element_ty))
    gl.store(DV + offs, b_dv.to(DV.dtype.element_ty))


def fused_backward(q, k, v, out, do, lse, sm_scale: float, causal: bool, num_buf: int = 3, order: str = "C",
                   delta_acc: bool = True, dq_out: str = "atomic", terms_tma: bool = True,
                   rotate: bool = True, poison: bool = False):
    """(dq, dk, dv) of attention over dense [B, H, L, D] q/k/v (MHA) through fused_bwd_kernel;
    ``lse`` the forward's natural-log LSE [B, H, L]. ``poison``: dk / dv start as NaN (checks: an
    unwritten element cannot pass for a right one)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from sparse_attn.ops.block_sparse import launch

    B, H, L, D = q.shape
    if k.shape != q.shape or v.shape != q.shape or D != 128 or L % BLOCK_N:
        raise ValueError(f"probe kernel: MHA, head dim 128, L a multiple of {BLOCK_N}; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    delta, lse2, _, _ = launch._row_terms(out, do, lse, BLOCK_N)
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t, rows):
        t2 = t.contiguous().view(B * H * L, D)
        return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [rows, D],
                                gl.NVMMASharedLayout.get_default_for([rows, D], dtype))

    def terms_desc(t):  # [B * H, Lpad] rows, one step's [1, BLOCK_M] block, unswizzled
        t2 = t.view(B * H, t.shape[-1])
        return TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [1, BLOCK_M],
                                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))

    dqa = torch.zeros(B, H, L, D, device=q.device, dtype=torch.float32)
    if poison:
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    else:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    fused_bwd_kernel[(L // BLOCK_N, B * H)](
        desc(q, BLOCK_M), desc(k, BLOCK_N), desc(v, BLOCK_N), desc(do, BLOCK_M), terms_desc(lse2),
        terms_desc(delta), lse2, delta, dk, dv, dqa,
        sm_scale * math.log2(math.e), sm_scale, L, delta.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HEAD_DIM=D, NUM_BUF=num_buf, CAUSAL=causal, ORDER=order, DELTA_ACC=delta_acc, DQ_OUT=dq_out,
        TERMS_TMA=terms_tma, ROTATE=rotate, num_warps=NUM_WARPS)
    return dqa.to(q.dtype), dk, dv


def _compile_sm90(causal: bool, num_buf: int, order: str, delta_acc: bool = False, dq_out: str = "atomic",
                  terms_tma: bool = True, rotate: bool = True):
    """Compile fused_bwd_kernel for sm_90 here (no GPU): registers, spills, serialized wgmmas."""
    import re
    import sys
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from compile_sm90 import ptxas_log, wgmma_serialized

    base = torch.empty(4096 * 128, dtype=torch.bfloat16).view(4096, 128)

    def dsig(rows):
        return mangle_type(TensorDescriptor(base, [4096, 128], [128, 1], [rows, 128],
                                            gl.NVMMASharedLayout.get_default_for([rows, 128], gl.bfloat16)))

    fn = fused_bwd_kernel
    terms = torch.empty(32, 4096, dtype=torch.float32)
    tsig = mangle_type(TensorDescriptor(terms, [32, 4096], [4096, 1], [1, BLOCK_M],
                                        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)))
    sig = {"q_desc": dsig(BLOCK_M), "k_desc": dsig(BLOCK_N), "v_desc": dsig(BLOCK_N), "do_desc": dsig(BLOCK_M),
           "lse_desc": tsig, "delta_desc": tsig,
           "LSE2": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "DQA": "*fp32", "qk_scale": "fp32",
           "sm_scale": "fp32", "L": "i32", "stride_lbh": "i32"}
    consts = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=128, NUM_BUF=num_buf, CAUSAL=causal, ORDER=order,
                  DELTA_ACC=delta_acc, DQ_OUT=dq_out, TERMS_TMA=terms_tma, ROTATE=rotate,
                  num_warps=NUM_WARPS)
    for name in consts:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("LSE2", "DELTA", "DK", "DV", "DQA")}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
    log = ptxas_log(k.asm["ptx"])
    usage = " ".join(re.findall(r"(Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads)", log))
    warn = "; ".join(line for line in log.splitlines() if "arning" in line)
    print(f"causal={causal} num_buf={num_buf} order={order} delta_acc={delta_acc} dq_out={dq_out} "
          f"terms_tma={terms_tma} rotate={rotate}: {usage}, shared {k.metadata.shared} B, "
          f"wgmma serialized: {wgmma_serialized(k.asm['cubin'])} {warn}")
    return k


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", help="write the SASS of the first variant here")
    a = ap.parse_args()
    variants = [dict(causal=c, num_buf=3, order=o, delta_acc=d) for o in ("C", "D") for c in (False, True)
                for d in (True, False)]
    for i, kw in enumerate(variants):
        kern = _compile_sm90(**kw)
        if a.sass and i == 0:
            from compile_sm90 import sass  # (tools/ is on sys.path once _compile_sm90 ran)
            open(a.sass, "w").write(sass(kern.asm["cubin"]))
