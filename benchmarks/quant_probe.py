"""Where the 8-bit path's quantization time goes, on the GPU: each step timed alone against the
time its bytes take at the device copy rate (shared/anchors: 2.97 TB/s on the H100).

Steps: Q rows -> int8 (per_warp groups), K's per-head mean, K rows -> int8, V's per-channel amax,
V -> FP8 transposed. The mean and amax are each timed in two forms (an fp32 / abs copy first, as the
launcher did, and a reduction that reads the input once), and the row kernel at two tile sizes and
warp counts, so one run says which form to keep.

    python benchmarks/quant_probe.py --out $OUT/quant-probe-h100.json [--lens 16384 32768]
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
from sparse_attn.ops.sage.granularity import GRANULARITY

COPY_RATE = 2.97e12  # bytes/s, H100 device-to-device copy (shared/anchors)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def row_kernel(x: torch.Tensor, mean, tile: int, warps: int):
    """quantize_rows with an explicit tile and warp count (per_warp groups: span 16 divides both tiles)."""
    B, H, L, D = x.shape
    xq = torch.empty_like(x, dtype=torch.int8)
    scale = torch.empty(B, H, L, device=x.device, dtype=torch.float32)
    smb, smh = (mean.stride(0), mean.stride(1)) if mean is not None else (0, 0)
    return lambda: kernels.quant_rows_kernel[(triton.cdiv(L, tile), B * H)](
        x, mean, xq, scale, None, *x.stride()[:3], smb, smh, *xq.stride()[:3], scale.stride(0), scale.stride(1), H, L,
        HEAD_DIM=D, D_PAD=bs_launch._d_pad(D), TILE=tile, SPAN=16, PERIOD=1, SMOOTH=mean is not None,
        IS_VARLEN=False, SPLIT_GRID=False, num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    (qs, qp), _ = GRANULARITY["per_warp"]
    for L in a.lens:
        B, H, D = 1, 32, 128
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        n = q.numel()
        mean = k.mean(2, dtype=torch.float32)
        assert torch.equal(mean, k.float().mean(2)), "the one-read mean must equal the fp32-copy mean"
        mn, mx = torch.aminmax(v, dim=2)
        assert torch.equal(torch.maximum(mx, -mn).float(), v.abs().amax(2).float())
        steps = {
            # name: (fn, bytes moved at best)
            "q_rows_launcher": (lambda: launch.quantize_rows(q, qs, qp, None, False), 3 * n),
            "k_mean_fp32_copy": (lambda: k.float().mean(2), 2 * n),
            "k_mean_one_read": (lambda: k.mean(2, dtype=torch.float32), 2 * n),
            "k_rows_launcher": (lambda: launch.quantize_rows(k, qs, qp, mean, False), 3 * n),
            "v_amax_abs_copy": (lambda: v.abs().amax(2), 2 * n),
            "v_amax_aminmax": (lambda: torch.aminmax(v, dim=2), 2 * n),
            "v_fp8_launcher": (lambda: launch.quantize_v_fp8(v, False), 3 * n),
            "k_mean_launcher": (lambda: launch.k_mean(k, False), 2 * n),
        }
        for tile in (64, 128):
            for warps in (4, 8):
                steps[f"q_rows_kernel_t{tile}_w{warps}"] = (row_kernel(q, None, tile, warps), 3 * n)
        row = {"seq_len": L, "heads": H, "head_dim": D}
        for name, (fn, nbytes) in steps.items():
            t = ms(fn)
            row[name] = {"ms": round(t, 4), "copy_floor_ms": round(nbytes / COPY_RATE * 1e3, 4)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    header = make_header("cuda", "probe", script="benchmarks/quant_probe.py")
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
