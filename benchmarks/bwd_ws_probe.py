"""Would Triton's Hopper warp specialization make the dK/dV kernel faster? A probe, not library code.

Our dK/dV kernel cannot take `tl.range(warp_specialize=True)` as it is: under triton 3.6 the Hopper
pass asserts on its nested loops (TaskIdPropagation, N_TERMS 0) or leaves them alone (N_TERMS 2). So
this file holds a stripped dK/dV kernel: dense layout, no masks, one kv head per query head, a flat
loop over the query tiles, Q/dO through TMA descriptors, the same products in the same order as
kernels._dkdv_step (dP first). It runs
  - plain: 8 warps, as the shipped kernel;
  - ws: `warp_specialize=True` at num_warps 4, which the Hopper pass turns into one producer warpgroup
    (TMA) and two consumer warpgroups splitting the key tile's rows (12 warps in all);
and checks both against a float32 PyTorch backward on a small case before timing anything. The
shipped kernel's own time (torch.profiler, dQ on the main stream) is printed beside them.

    python benchmarks/bwd_ws_probe.py --out $OUT/bwd-ws-probe-h100.json [--lens 8192 16384]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from sparse_attn.ops.block_sparse import launch

LOG2E = 1.4426950408889634


@triton.jit
def dkdv_toy(Q, K, V, DO, LSE2, DELTA, DK, DV, L, n_rows, qk_scale, sm_scale,
             BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """Grid (L // BN, B * H): dK, dV of one key tile over all L // BM query tiles of its head.
    Q, K, V, DO, DK, DV: [B * H * L, D] bf16; LSE2 (log2 units), DELTA: [B * H * L] fp32."""
    i_n = tl.program_id(0)
    r0 = tl.program_id(1) * L
    desc_q = tl.make_tensor_descriptor(Q, [n_rows, D], [D, 1], [BM, D])
    desc_do = tl.make_tensor_descriptor(DO, [n_rows, D], [D, 1], [BM, D])
    desc_k = tl.make_tensor_descriptor(K, [n_rows, D], [D, 1], [BN, D])
    desc_v = tl.make_tensor_descriptor(V, [n_rows, D], [D, 1], [BN, D])
    b_k = desc_k.load([r0 + i_n * BN, 0])
    b_v = desc_v.load([r0 + i_n * BN, 0])
    b_dk = tl.zeros([BN, D], tl.float32)
    b_dv = tl.zeros([BN, D], tl.float32)
    o_m = tl.arange(0, BM)
    for j in tl.range(0, L // BM, num_stages=STAGES, warp_specialize=WS):
        m0 = r0 + j * BM
        b_q = desc_q.load([m0, 0])
        b_do = desc_do.load([m0, 0])
        b_lse = tl.load(LSE2 + m0 + o_m)
        b_delta = tl.load(DELTA + m0 + o_m)
        b_pt = tl.math.exp2(tl.dot(b_k, tl.trans(b_q)) * qk_scale - b_lse[None, :])  # [BN, BM]
        b_dpt = tl.dot(b_v, tl.trans(b_do))
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
        b_dst = (b_pt * (b_dpt - b_delta[None, :])).to(b_q.dtype)
        b_dk = tl.dot(b_dst, b_q, b_dk)
    desc_dk = tl.make_tensor_descriptor(DK, [n_rows, D], [D, 1], [BN, D])
    desc_dv = tl.make_tensor_descriptor(DV, [n_rows, D], [D, 1], [BN, D])
    desc_dk.store([r0 + i_n * BN, 0], (b_dk * sm_scale).to(DK.dtype.element_ty))
    desc_dv.store([r0 + i_n * BN, 0], b_dv.to(DV.dtype.element_ty))


VARIANTS = {  # name: (BM, BN, num_warps, stages, warp_specialize)
    "plain-64x128-w8-s3": (64, 128, 8, 3, False),
    "ws-64x128-w4-s2": (64, 128, 4, 2, True),
    "ws-64x128-w4-s3": (64, 128, 4, 3, True),
}


def inputs(B, H, L, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def row_terms(q, k, v, do, scale):
    """LSE (log2 units) and delta = rowsum(O * dO), from a float32 forward (chunked over heads)."""
    lse2 = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse2)
    for h in range(q.shape[1]):
        s = (q[:, h].float() @ k[:, h].float().transpose(-1, -2)) * scale
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ v[:, h].float()
        lse2[:, h] = lse * LOG2E
        delta[:, h] = (o.to(q.dtype).float() * do[:, h].float()).sum(-1)
    return lse2, delta


def run_toy(name, q, k, v, do, lse2, delta, scale, dk, dv):
    BM, BN, warps, stages, ws = VARIANTS[name]
    B, H, L, D = q.shape
    n = B * H * L
    grid = (L // BN, B * H)
    launch._ensure_allocator()  # the device-side TMA descriptors' scratch
    dkdv_toy[grid](q.view(n, D), k.view(n, D), v.view(n, D), do.view(n, D), lse2.view(n), delta.view(n),
                   dk.view(n, D), dv.view(n, D), L, n, scale * LOG2E, scale, BM=BM, BN=BN, D=D, WS=ws,
                   STAGES=stages, num_warps=warps, num_stages=stages)


def check(names, B=1, H=2, L=1024, D=128):
    """Each variant against a float32 PyTorch backward; output poisoned before the run."""
    q, k, v, do = inputs(B, H, L, D, seed=1)
    scale = 1 / math.sqrt(D)
    lse2, delta = row_terms(q, k, v, do, scale)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    o = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, -1) @ vf
    o.backward(do.float())
    out = {}
    for name in names:
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        try:
            run_toy(name, q, k, v, do, lse2, delta, scale, dk, dv)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
            out[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        err = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()  # noqa: E731
        out[name] = dict(dk_rel_err=err(dk, kf.grad), dv_rel_err=err(dv, vf.grad))
    return out


def shipped_dkdv_ms(q, k, v, do):
    """Our dK/dV kernel's own time in one dense backward (dQ kernel on the main stream)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grouped_profile import kernel_ms

    import sparse_attn
    from sparse_attn.patterns import dense

    saved, launch.BWD_DQ_SIDE_STREAM = launch.BWD_DQ_SIDE_STREAM, False
    B, H, L, D = q.shape
    layout = dense(L, device="cuda")
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = sparse_attn.attention(qq, kk, vv, layout)

    def fn():
        qq.grad = kk.grad = vv.grad = None
        o.backward(do, retain_graph=True)

    try:
        return kernel_ms(fn, 5)
    finally:
        launch.BWD_DQ_SIDE_STREAM = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", nargs="+", type=int, default=[16384])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    names = list(VARIANTS)
    checks = check(names)
    print(json.dumps(dict(check=checks)), flush=True)
    ok = [n for n in names if "error" not in checks[n] and max(checks[n].values()) < 2e-2]
    rows = []
    for L in a.lens:
        q, k, v, do = inputs(1, a.heads, L, 128)
        scale = 1 / math.sqrt(128)
        lse2 = torch.randn(q.shape[:-1], device="cuda") + math.log2(L)  # timing only: any finite terms
        delta = torch.randn(q.shape[:-1], device="cuda")
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        fns = {n: (lambda n=n: run_toy(n, q, k, v, do, lse2, delta, scale, dk, dv)) for n in ok}
        for fn in fns.values():
            fn()
        times = {n: [] for n in fns}
        for _ in range(a.reps):  # interleaved: each repetition runs every variant once
            for n, fn in fns.items():
                times[n].append(triton.testing.do_bench(fn, warmup=5, rep=50))
        flops = 4 * 2 * a.heads * L * L * 128  # the dK/dV kernel's four products
        row = dict(L=L, heads=a.heads, ms={n: sorted(t)[len(t) // 2] for n, t in times.items()},
                   all_ms=times)
        row["tflops"] = {n: flops / ms / 1e9 for n, ms in row["ms"].items()}
        try:
            row["shipped_kernels_ms"] = shipped_dkdv_ms(q, k, v, do)
        except Exception as e:  # noqa: BLE001 - context only
            row["shipped_kernels_ms"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        from sparse_attn.bench.results import make_header

        header = make_header("cuda", "probe", script="benchmarks/bwd_ws_probe.py")
        Path(a.out).write_text(json.dumps({**header, "check": checks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
