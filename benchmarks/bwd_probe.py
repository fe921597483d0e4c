"""Backward schedules and tile configs on the GPU: time the whole backward per variant and config.

Variants (``launch.BWD_VARIANT``): "split" (dK/dV kernel + dQ kernel), "fused" (dQ by TMA reduce-adds
inside the dK/dV kernel), "fused-ptr" (the same with per-element atomics). --qdo-only compares just
the dK/dV kernel's Q/dO loads (``launch.BWD_QDO``: pointer loads vs TMA), for split and fused.
With --split-sweep, one split kernel's config is varied while the other stays fixed, so differences
between those rows are that kernel's. Every row reports its gradients' distance from the first (split) row's and from its
own rerun (atomics make dQ's summation order vary). Also times the delta pre-pass (the fused kernel vs the
PyTorch expression it replaced). Effective TFLOP/s use the forward convention x2.5 (the backward
alone, ``bench.flops`` mode "bwd").

    python benchmarks/bwd_probe.py --out $OUT/bwd-probe-h100.json [--cases causal:16384 random0.25:16384]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import layouts  # noqa: E402

from sparse_attn.bench.flops import attention_flops, tflops  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import launch, layout_inputs  # noqa: E402
from sparse_attn.ops.block_sparse.function import block_sparse_fwd  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages). dK/dV: BLOCK_N is the key tile, BLOCK_M the inner query tile;
# dQ: the reverse. FlexAttention's sm90 d128 default is dkdv (64, 128), dq (128, 64), 8 warps, 3 stages.
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
DQ = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3)]
# the fused kernel (dQ by atomic adds inside the dK/dV kernel): its tile configs
# 5 stages: the pipeliner splits a loop's stages between the query-index load and the Q/dO loads it
# addresses, so only 5 (not 3) put Q/dO two iterations ahead (measured: no fit on causal, 3% slower
# on random 0.25; kept so the probe shows it)
FUSED = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 5), (128, 128, 8, 2), (64, 64, 4, 2)]


def cfg(m, n, w, s):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": s}, num_warps=w, num_stages=s)


def case_inputs(case: str, hkv: int) -> SimpleNamespace:
    """One case ("which:L", benchmarks/probe.py's layouts) at H=32, D=128, bf16: seeded q/k/v/dO, the
    layout's kernel arguments (ins), our forward's out and lse, and the backward's FLOP count."""
    which, L = case.split(":")
    L = int(L)
    layout, _ = layouts(L, which)
    H, D = 32, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    ins = layout_inputs(layout, True)
    scale = 1 / math.sqrt(D)
    out, lse = block_sparse_fwd(q, k, v, *ins, None, None, layout.block_q, layout.block_k, scale, L, L)
    return SimpleNamespace(layout=layout, L=L, H=H, q=q, k=k, v=v, do=do, ins=ins, scale=scale, out=out, lse=lse,
                           flops_bwd=attention_flops(layout, batch=1, heads=H, head_dim=D, mode="bwd"))


def run_case(case: str, hkv: int, rows: list, split_sweep: bool, qdo_only: bool = False, default_only: bool = False):
    c = case_inputs(case, hkv)
    layout, L, q, k, v, do, scale, out, lse, flops_bwd = c.layout, c.L, c.q, c.k, c.v, c.do, c.scale, c.out, c.lse, c.flops_bwd
    (counts, n_full, _, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, t_contiguous, terms,
     n_terms) = c.ins

    def bwd():
        return launch.backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                               t_indices, t_mask_ids, terms, n_terms, None, None, layout.block_q, layout.block_k,
                               scale, L, L, contiguous=contiguous, t_contiguous=t_contiguous)

    ref: dict = {}

    def timed(variant, label, dkdv, dq, qdo="tma"):
        launch.BWD_VARIANT = variant
        launch.BWD_QDO = qdo
        launch.BWD_SPACE_OVERRIDE.clear()
        launch.BWD_SPACE_OVERRIDE.update({"dkdv": [cfg(*dkdv)], "dkdv-fused": [cfg(*dkdv)], "dq": [cfg(*dq)]})
        launch._TUNED.clear()
        try:
            grads = bwd()
            ref.setdefault("grads", grads)  # the first row (split, deterministic) is the reference
            diff = [(a - b).abs().max().item() for a, b in zip(grads, ref["grads"])]
            again = bwd()
            rerun = [(a - b).abs().max().item() for a, b in zip(again, grads)]
            ms = triton.testing.do_bench(bwd, warmup=10, rep=100, return_mode="median")
            row = dict(case=case, hkv=hkv, variant=variant, vary=label, qdo=qdo, dkdv=dkdv,
                       dq=dq if variant == "split" else None, ms=ms, tflops=tflops(flops_bwd, ms),
                       max_abs_diff_dq_dk_dv_vs_split=diff, max_abs_diff_rerun=rerun,
                       dq_absmax=grads[0].abs().max().item())
        except Exception as e:  # noqa: BLE001 - one config failing to compile must not hide the others
            row = dict(case=case, hkv=hkv, variant=variant, vary=label, dkdv=dkdv, dq=dq,
                       error=f"{type(e).__name__}: {str(e)[-300:]}")
        print(json.dumps(row), flush=True)
        rows.append(row)

    timed("split", "both", DKDV[0], DQ[0])
    if default_only:  # the default schedule's first config only (A/B of kernel code across two checkouts)
        timed("fused", "dkdv", FUSED[0], DQ[0])
        return
    if qdo_only:  # the dK/dV kernel's Q / dO loads: pointer loads vs TMA descriptors, default tiles
        for variant in ("split", "fused"):
            for qdo in ("ptr", "tma"):
                timed(variant, "qdo", DKDV[0], DQ[0], qdo)
        return
    if split_sweep:
        for c in DKDV[1:]:
            timed("split", "dkdv", c, DQ[0])
        for c in DQ[1:]:
            timed("split", "dq", DKDV[0], c)
    for c in FUSED:
        timed("fused", "dkdv", c, DQ[0])
    timed("fused-ptr", "dkdv", FUSED[0], DQ[0])
    # the delta pre-pass alone: fused kernel vs the PyTorch expression it replaced
    # (the kernel now also writes the LSE in log2 units: launch._row_terms)
    t_new = triton.testing.do_bench(lambda: launch._row_terms(out, do, lse, 128), warmup=10, rep=100,
                                    return_mode="median")
    t_old = triton.testing.do_bench(lambda: (out.float() * do.float()).sum(-1), warmup=10, rep=100,
                                    return_mode="median")
    delta = launch._row_terms(out, do, lse, 128)[0][..., :out.shape[2]]  # rows padded to whole blocks
    err = (delta - (out.float() * do.float()).sum(-1)).abs().max().item()
    row = dict(case=case, hkv=hkv, vary="delta", fused_ms=t_new, torch_ms=t_old, max_abs_diff=err)
    print(json.dumps(row), flush=True)
    rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["causal:16384", "random0.25:16384"])
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--split-sweep", action="store_true", help="also sweep the split (two-kernel) configs")
    ap.add_argument("--qdo-only", action="store_true",
                    help="only compare the dK/dV kernel's Q/dO pointer loads with TMA loads")
    ap.add_argument("--default-only", action="store_true",
                    help="only the split and fused schedules at their first (default) configs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows: list = []
    for case in a.cases:
        run_case(case, a.hkv, rows, a.split_sweep, a.qdo_only, a.default_only)
    header = make_header("cuda", "probe", script="benchmarks/bwd_probe.py")
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
