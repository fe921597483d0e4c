"""Which of our dK/dV kernel's features cost the 9-12% it runs behind the stripped kernel of
bwd_ws_probe.py (dkdv_alone_probe.py)? A probe, not library code: the stripped kernel with switches
that each add one feature of kernels.bwd_dkdv_kernel, all timed in one interleaved rotation on one
dense case (H=32, D=128, bf16, one kv head per query head), each checked against the plain one.

  PER_HEAD  Q/dO descriptors over one head's rows (base pointer moved to the head), row terms from
            an int64 per-head base, as _dkdv_head does (plain: one descriptor over all heads' rows)
  FROM_MEM  the walk's first block and length read from the layout's arrays (_run_start, n_full)
  KV_PTR    K/V read by masked pointer loads (plain: a TMA descriptor)
  ST_PTR    dK/dV written by masked pointer stores (plain: a TMA descriptor)
  LOOP2     a second, indexed loop after the first (the masked pass over register index chunks),
            which runs zero times on this layout

    python benchmarks/dkdv_bisect_probe.py --lens 16384 --out $OUT/dkdv-bisect-h100.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.ops.block_sparse import launch

LOG2E = 1.4426950408889634
SWITCHES = ("PER_HEAD", "FROM_MEM", "KV_PTR", "ST_PTR", "LOOP2")


@triton.jit
def _step(b_k, b_v, b_dk, b_dv, desc_q, desc_do, LSE2, DELTA, l_base, q_row0, start_m, qk_scale,
          BM: tl.constexpr):
    o_m = start_m + tl.arange(0, BM)
    b_q = desc_q.load([q_row0 + start_m, 0])
    b_do = desc_do.load([q_row0 + start_m, 0])
    b_lse = tl.load(LSE2 + l_base + o_m)
    b_delta = tl.load(DELTA + l_base + o_m)
    b_pt = tl.math.exp2(tl.dot(b_k, tl.trans(b_q)) * qk_scale - b_lse[None, :])  # [BN, BM]
    b_dpt = tl.dot(b_v, tl.trans(b_do))
    b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
    b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(b_q.dtype)
    b_dk = tl.dot(b_dst, b_q, b_dk)
    return b_dk, b_dv


@triton.jit
def dkdv_bisect(Q, K, V, DO, LSE2, DELTA, DK, DV, N_FULL, COUNT, IDX, L, n_rows, qk_scale, sm_scale,
                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr,
                PER_HEAD: tl.constexpr, FROM_MEM: tl.constexpr, KV_PTR: tl.constexpr, ST_PTR: tl.constexpr,
                LOOP2: tl.constexpr):
    """Grid (L // BN, B * H): dK, dV of one key tile. Q, K, V, DO, DK, DV: [B * H * L, D] bf16; LSE2
    (log2 units), DELTA: [B * H * L] fp32; N_FULL, COUNT: [B * H, L // BN] int32 (the transposed
    layout's unmasked / all slots per key block), IDX: [B * H, L // BN, L // 128] int32 (its query
    blocks, 128 rows each)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    r0 = i_h * L
    n_kb = L // BN
    n_qb = L // 128
    SUB: tl.constexpr = 128 // BM
    if PER_HEAD:
        h64 = i_h.to(tl.int64) * L
        desc_q = tl.make_tensor_descriptor(Q + h64 * D, [L, D], [D, 1], [BM, D])
        desc_do = tl.make_tensor_descriptor(DO + h64 * D, [L, D], [D, 1], [BM, D])
        l_base = h64
        q_row0 = 0
    else:
        desc_q = tl.make_tensor_descriptor(Q, [n_rows, D], [D, 1], [BM, D])
        desc_do = tl.make_tensor_descriptor(DO, [n_rows, D], [D, 1], [BM, D])
        l_base = r0
        q_row0 = r0
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, D)
    if KV_PTR:
        m_nd = (o_n < L)[:, None] & (o_d < D)[None, :]
        kv0 = i_h.to(tl.int64) * L * D
        b_k = tl.load(K + kv0 + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_nd, other=0.0)
        b_v = tl.load(V + kv0 + o_n.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_nd, other=0.0)
    else:
        b_k = tl.make_tensor_descriptor(K, [n_rows, D], [D, 1], [BN, D]).load([r0 + i_n * BN, 0])
        b_v = tl.make_tensor_descriptor(V, [n_rows, D], [D, 1], [BN, D]).load([r0 + i_n * BN, 0])
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    p_cnt = i_h * n_kb + i_n
    p_row = p_cnt * n_qb
    if FROM_MEM:
        n_full = tl.load(N_FULL + p_cnt)
        run0 = tl.load(IDX + p_row, mask=n_full > 0, other=0) * 128
        n_it = n_full * SUB
    else:
        n_full = n_qb
        run0 = 0
        n_it = L // BM
    for j in tl.range(0, n_it, num_stages=STAGES):
        b_dk, b_dv = _step(b_k, b_v, b_dk, b_dv, desc_q, desc_do, LSE2, DELTA, l_base, q_row0, run0 + j * BM,
                           qk_scale, BM)
    if LOOP2:
        count = tl.load(COUNT + p_cnt)
        o_c = tl.arange(0, 64)
        for c0 in range(n_full, count, 64):
            blocks = tl.load(IDX + p_row + c0 + o_c, mask=c0 + o_c < count, other=0)
            for it in tl.range(0, tl.minimum(count - c0, 64) * SUB, num_stages=STAGES):
                start_m = tl.sum(tl.where(o_c == it // SUB, blocks, 0)) * 128 + (it % SUB) * BM
                b_dk, b_dv = _step(b_k, b_v, b_dk, b_dv, desc_q, desc_do, LSE2, DELTA, l_base, q_row0, start_m,
                                   qk_scale, BM)
    b_dk = b_dk * sm_scale
    if ST_PTR:
        m_nd = (o_n < L)[:, None] & (o_d < D)[None, :]
        kv0 = i_h.to(tl.int64) * L * D
        tl.store(DK + kv0 + o_n.to(tl.int64)[:, None] * D + o_d[None, :], b_dk.to(DK.dtype.element_ty), mask=m_nd)
        tl.store(DV + kv0 + o_n.to(tl.int64)[:, None] * D + o_d[None, :], b_dv.to(DV.dtype.element_ty), mask=m_nd)
    else:
        tl.make_tensor_descriptor(DK, [n_rows, D], [D, 1], [BN, D]).store([r0 + i_n * BN, 0],
                                                                          b_dk.to(DK.dtype.element_ty))
        tl.make_tensor_descriptor(DV, [n_rows, D], [D, 1], [BN, D]).store([r0 + i_n * BN, 0],
                                                                          b_dv.to(DV.dtype.element_ty))


def variants():
    """plain, each switch alone, all switches, and all but each one."""
    out = {"plain": {}}
    for s in SWITCHES:
        out[s.lower()] = {s: True}
    out["all"] = {s: True for s in SWITCHES}
    for s in SWITCHES:
        out[f"all-but-{s.lower()}"] = {t: t != s for t in SWITCHES}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", nargs="+", type=int, default=[16384])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    BM, BN, D, H = 64, 128, 128, a.heads
    rows = []
    for L in a.lens:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(H * L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        lse2 = (torch.randn(H * L, device="cuda", generator=g) + math.log2(L)).contiguous()  # any finite terms
        delta = torch.randn(H * L, device="cuda", generator=g)
        n_kb, n_qb = L // BN, L // 128
        n_full = torch.full((H, n_kb), n_qb, device="cuda", dtype=torch.int32)
        count = n_full.clone()
        idx = torch.arange(n_qb, device="cuda", dtype=torch.int32).expand(H, n_kb, n_qb).contiguous()
        scale = 1 / math.sqrt(D)
        launch._ensure_allocator()
        outs, fns = {}, {}
        for name, sw in variants().items():
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            outs[name] = (dk, dv)
            consts = {s: sw.get(s, False) for s in SWITCHES}

            def fn(dk=dk, dv=dv, consts=consts):
                dkdv_bisect[(n_kb, H)](q, k, v, do, lse2, delta, dk, dv, n_full, count, idx, L, H * L,
                                       scale * LOG2E, scale, BM=BM, BN=BN, D=D, STAGES=3, num_warps=8,
                                       num_stages=3, **consts)
            fns[name] = fn
            fn()
        torch.cuda.synchronize()
        ref = outs["plain"]
        same = {n: bool(torch.equal(o[0], ref[0]) and torch.equal(o[1], ref[1])) for n, o in outs.items()}
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        row = dict(L=L, heads=H, ms=ms, bitwise_equal_to_plain=same,
                   over_plain={n: t / ms["plain"] for n, t in ms.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/dkdv_bisect_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
