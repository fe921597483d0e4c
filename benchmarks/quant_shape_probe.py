"""Launch shapes of the 8-bit path's three quantization kernels, each timed alone on the GPU against
the time its bytes take at this device's own copy rate (a bf16 ``copy_`` of the same size, measured
first). On the H200 the row kernel (Q and K to int8) ran at about half the copy rate while the V
kernel, with twice the programs per SM, ran at it (sage_stats_probe.py): a memory-bound kernel that
loads its whole tile at once needs enough programs resident to keep the bytes in flight.

- ``rows``: quant_rows_kernel on Q (per_warp, 16-row groups) and on K (128-row groups, minus K's mean)
  at TILE x warps (x ``maxnreg``: a register cap, so more programs fit an SM);
- ``stats``: kv_partials_kernel on K and V at CHUNK x ROWS x warps;
- ``v``: quant_v_fp8_kernel at TILE x warps.

    python benchmarks/quant_shape_probe.py --lens 32768 131072 --out $OUT/quant-shapes-h200.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import launch as bs_launch
from sparse_attn.ops.sage import kernels, launch


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rows_fn(x, mean, span, tile, warps, maxnreg):
    B, H, L, D = x.shape
    xq = torch.empty_like(x, dtype=torch.int8)
    scale = torch.empty(B, H, L, device=x.device, dtype=torch.float32)
    smb, smh = (mean.stride(0), mean.stride(1)) if mean is not None else (0, 0)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    return lambda: kernels.quant_rows_kernel[(triton.cdiv(L, tile), B * H)](
        x, mean, xq, scale, None, *x.stride()[:3], smb, smh, *xq.stride()[:3], scale.stride(0), scale.stride(1), H, L,
        HEAD_DIM=D, D_PAD=D, TILE=tile, SPAN=span, PERIOD=1, SMOOTH=mean is not None,
        IS_VARLEN=False, SPLIT_GRID=False, num_warps=warps, enable_fp_fusion=False, **extra)


def stats_fn(k, v, chunk, rows, warps):
    B, H, L, D = k.shape
    chunks = triton.cdiv(L, chunk)
    kp, vp = (torch.empty(B, H, chunks, D, device=k.device, dtype=torch.float32) for _ in range(2))
    return lambda: kernels.kv_partials_kernel[(chunks, B * H)](
        k, v, kp, vp, None, *k.stride()[:3], *v.stride()[:3], *kp.stride()[:3], H, L,
        HEAD_DIM=D, D_PAD=D, CHUNK=chunk, ROWS=rows, K_SUM=True, V_AMAX=True, IS_VARLEN=False, SPLIT_GRID=False,
        num_warps=warps)


def v_fn(v, scale, tile, warps):
    B, H, L, D = v.shape
    vt = torch.empty(B, H, D, L, device=v.device, dtype=torch.float8_e4m3fn)
    return lambda: kernels.quant_v_fp8_kernel[(triton.cdiv(L, tile), B * H)](
        v, scale, vt, None, *v.stride()[:3], scale.stride(0), scale.stride(1), *vt.stride()[:3], H, L,
        HEAD_DIM=D, D_PAD=D, TILE=tile, IS_VARLEN=False, SPLIT_GRID=False, num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--kernels", nargs="+", default=["rows", "stats", "v"], choices=["rows", "stats", "v"])
    ap.add_argument("--caps", type=int, nargs="*", default=[64, 96], help="maxnreg values tried on the row kernel")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for L in a.lens:
        q, k, v = (torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        n = q.numel() * 2  # bytes of one bf16 input
        dst = torch.empty_like(q)
        rate = n * 2 / (ms(lambda: dst.copy_(q)) * 1e-3)  # bytes/s, read + write
        mean, vscale = launch.kv_stats(k, v, False)
        row = {"seq_len": L, "copy_rate_tb_s": rate / 1e12, "rows_q": {}, "rows_k": {}, "stats": {}, "v": {}}
        floor = lambda nbytes: nbytes / rate * 1e3  # noqa: E731
        row["floor_ms"] = {"rows": floor(1.5 * n), "stats": floor(2 * n), "v": floor(1.5 * n)}
        for tile in (32, 64, 128) if "rows" in a.kernels else ():
            for warps in (2, 4, 8, 16):
                for cap in (None, *a.caps):
                    if tile * 128 // (32 * warps) > 128 or (cap and warps < 4):
                        continue  # over 128 elements a thread, or a cap on a shape that needs no help
                    tag = f"t{tile}_w{warps}" + (f"_r{cap}" if cap else "")
                    row["rows_q"][tag] = ms(rows_fn(q, None, 16, tile, warps, cap))
                    if tile == 128:
                        row["rows_k"][tag] = ms(rows_fn(k, mean, 128, tile, warps, cap))
        for chunk in (512, 1024, 2048) if "stats" in a.kernels else ():
            for r in (32, 64):
                for warps in (4, 8):
                    row["stats"][f"c{chunk}_r{r}_w{warps}"] = ms(stats_fn(k, v, chunk, r, warps))
        for tile in (64, 128) if "v" in a.kernels else ():
            for warps in (4, 8):
                row["v"][f"t{tile}_w{warps}"] = ms(v_fn(v, vscale, tile, warps))
        print(json.dumps(row), flush=True)
        rows.append(row)
    header = make_header("cuda", "probe", script="benchmarks/quant_shape_probe.py")
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
