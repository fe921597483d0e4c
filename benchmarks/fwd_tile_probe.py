"""Forward tile configs one at a time on the GPU, bf16 and 8-bit: does a one-warpgroup tile (64 query
rows, 4 warps), which leaves room for several CTAs per SM whose softmax and MMAs the warp scheduler can
interleave, beat the autotuned two-warpgroup 128-row tile?

Each row pins ``launch.fwd_configs`` to one config (autotuning off), times the forward (triton
do_bench median; the 8-bit rows time the kernel alone on inputs quantized beforehand) and checks the
output against the first config's. With ``--rounds R`` the configs take turns R times and each row
gives the median of its rounds (and every round's time).

    python benchmarks/fwd_tile_probe.py --out $OUT/fwd-tile-probe-h100.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import layouts  # noqa: E402

from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import forward_layout_inputs, launch  # noqa: E402
from sparse_attn.ops.sage import launch as sage_launch  # noqa: E402
from sparse_attn.ops.sage.granularity import GRANULARITY  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages[, register cap per thread: with 4 warps, 168 lets three CTAs share an SM])
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 4)]
CAPPED = [(64, 128, 4, 3), (64, 128, 4, 2, 168), (64, 128, 4, 2, 128), (64, 64, 4, 2, 168), (64, 64, 4, 3, 168)]


def run_case(case: str, quant: int, rows: list, configs: list, rounds: int = 1):
    which, L = case.split(":")
    L = int(L)
    layout, _ = layouts(L, which)
    H, D = 32, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    args = forward_layout_inputs(layout)
    scale = 1 / math.sqrt(D)
    scales = None
    if quant:
        (qs, qp), (ks, kp) = GRANULARITY["per_warp"]
        q, q_s = sage_launch.quantize_rows(q, qs, qp, None, False)
        k, k_s = sage_launch.quantize_rows(k, ks, kp, sage_launch.k_mean(k, False), False)
        v, v_s = sage_launch.quantize_v_fp8(v, False) if quant == 2 else (v, None)
        scales = (q_s, k_s, v_s)
    flops = 4 * D * 128 * 128 * layout.num_blocks * (H // layout.heads)  # as benchmarks/probe.py
    first = None
    # rounds > 1: every config once per round, in turn, so the board's clock drifts over all alike
    configs = [tuple(c) for c in configs]  # dictionary keys
    times: dict = {c: [] for c in configs}
    errors: dict = {}
    diffs: dict = {}
    for _ in range(rounds):
        for c in configs:
            if c in errors:
                continue
            m, n, w, s = c[:4]
            cap = c[4] if len(c) > 4 else None
            cfg = triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": s, "USE_TMA": True}, num_warps=w,
                                num_stages=s, maxnreg=cap)
            launch.fwd_configs = lambda *a, _c=cfg, **kw: [_c]
            launch._TUNED.clear()

            def fwd():
                return launch.forward(q, k, v, *args, None, None, layout.block_q, layout.block_k, scale, L, L, 1,
                                      scales, quant, torch.bfloat16)[0]
            try:
                out = fwd()
                first = out if first is None else first
                diff = (out.float() - first.float()).abs().max().item()
                if not math.isfinite(diff):
                    raise RuntimeError(f"non-finite output difference {diff}")
                diffs[c] = max(diff, diffs.get(c, 0.0))
                times[c].append(triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median"))
            except Exception as e:  # noqa: BLE001 - a config that does not compile must not hide the others
                errors[c] = f"{type(e).__name__}: {str(e)[-200:]}"
    for c in configs:
        if c in errors:
            row = dict(case=case, quant=quant, config=list(c), error=errors[c])
        else:
            ms = sorted(times[c])[len(times[c]) // 2]
            row = dict(case=case, quant=quant, config=list(c), ms=ms, tflops=flops / ms * 1e-9,
                       max_abs_diff_vs_first=diffs[c], rounds_ms=times[c])
        print(json.dumps(row), flush=True)
        rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "window4096:32768"])
    ap.add_argument("--quants", nargs="+", type=int, default=[0, 2])
    ap.add_argument("--capped", action="store_true", help="the register-capped one-warpgroup configs instead")
    ap.add_argument("--configs", nargs="+", help="configs instead of the built-in lists: M,N,WARPS,STAGES[,MAXNREG]")
    ap.add_argument("--rounds", type=int, default=1, help="time the configs in turn this many times (median)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    configs = ([tuple(map(int, c.split(","))) for c in a.configs] if a.configs else CAPPED if a.capped else CONFIGS)
    rows: list = []
    for case in a.cases:
        for quant in a.quants:
            run_case(case, quant, rows, configs, a.rounds)
    header = make_header("cuda", "probe", script="benchmarks/fwd_tile_probe.py", configs=configs)
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
