"""Our dK/dV kernel alone against the stripped dK/dV kernel of bwd_ws_probe.py, timed the same way.

Backward item 17 (NOTES.md) found the stripped kernel (dense, flat loop, no masks, no index walk)
14% faster than ours, then 9% after item 18; but ours was timed inside a whole backward with
torch.profiler and the stripped one alone with do_bench, under different power states. Here both run
as single launches in one ``time_interleaved`` rotation on the same inputs:
  - "toy": bwd_ws_probe.dkdv_toy at its shipped-like config (64 x 128 tiles, 8 warps, 3 stages);
  - "ours": ``launch.backward`` with the dQ kernel skipped (row-terms pre-pass + dK/dV kernel);
  - "prepass": ``launch.backward`` with both kernels skipped (row-terms pre-pass and allocations),
    so ours' kernel time is ours - prepass.
Dense layouts, H=32, D=128, bf16, one kv head per query head.

    python benchmarks/dkdv_alone_probe.py --lens 16384 --out $OUT/dkdv-alone-h100.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bwd_ws_probe as toy  # noqa: E402
from bwd_probe import case_inputs  # noqa: E402

from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.bench.timing import time_interleaved  # noqa: E402
from sparse_attn.ops.block_sparse import kernels, launch  # noqa: E402


class _Skip:
    """Stands in for a tuned kernel: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


# our variants: launch attributes set for the call (the others at their defaults). The measurements
# of 2026-11-23 (dkdv-alone-variants / -acc) also ran variants whose code was not kept (NOTES.md,
# backward 23): K/V loads and dK/dV stores through TMA, the masked pass compiled out, the LSE through
# S's accumulator.
VARIANTS = {"ours": {}, "ours-delta-acc": {"BWD_DKDV_DELTA_ACC": "1"}, "ours-no-delta-acc": {"BWD_DKDV_DELTA_ACC": "0"}}
DEFAULTS = {"BWD_DKDV_DELTA_ACC": "auto"}


def backward_without(skip: tuple, c, attrs=None):
    """launch.backward on case c with the kernels in ``skip`` not launched."""
    real = launch._tuned

    def fn():
        saved = {name: getattr(launch, name) for name in DEFAULTS}
        for name, value in {**DEFAULTS, **(attrs or {})}.items():
            setattr(launch, name, value)
        launch._tuned = lambda kernel, *a, **kw: _Skip() if kernel in skip else real(kernel, *a, **kw)
        try:
            (counts, n_full, _, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids,
             t_contiguous, terms, n_terms) = c.ins
            return launch.backward(c.do, c.q, c.k, c.v, c.out, c.lse, counts, n_full, indices, mask_ids, t_counts,
                                   t_n_full, t_indices, t_mask_ids, terms, n_terms, None, None, c.layout.block_q,
                                   c.layout.block_k, c.scale, c.L, c.L, contiguous=contiguous,
                                   t_contiguous=t_contiguous)
        finally:
            launch._tuned = real
            for name, value in saved.items():
                setattr(launch, name, value)
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", nargs="+", type=int, default=[16384])
    ap.add_argument("--only", nargs="+", help="keep these of toy, prepass and VARIANTS")
    ap.add_argument("--profile", action="store_true", help="one call of each inside cudaProfilerStart/Stop")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for L in a.lens:
        c = case_inputs(f"dense:{L}", 32)
        B, H, _, D = c.q.shape
        # the toy's row terms in its layout ([B * H * L], log2 units), from our forward's LSE
        lse2 = (c.lse.float() * toy.LOG2E).contiguous()
        delta = (c.out.float() * c.do.float()).sum(-1).contiguous()
        dk_toy, dv_toy = torch.empty_like(c.k), torch.empty_like(c.v)
        fns = {
            "toy": lambda: toy.run_toy("plain-64x128-w8-s3", c.q, c.k, c.v, c.do, lse2, delta, c.scale, dk_toy,
                                       dv_toy),
            **{name: backward_without((kernels.bwd_dq_kernel,), c, attrs) for name, attrs in VARIANTS.items()},
            "prepass": backward_without((kernels.bwd_dq_kernel, kernels.bwd_dkdv_kernel), c),
        }
        fns["toy"]()
        err = {}
        for name in VARIANTS:  # each variant against the toy (dK's scale is applied at another point)
            _, dk, dv = fns[name]()
            torch.cuda.synchronize()
            err[name] = {n: ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                         for n, x, y in (("dk", dk_toy, dk), ("dv", dv_toy, dv))}
        if a.profile:  # for ncu --profile-from-start off: one call each, after the warm-up above
            torch.cuda.profiler.start()
            for name, fn in fns.items():
                if not a.only or name in a.only:
                    fn()
                    torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        flops = 4 * 2 * H * L * L * D
        kernel_ms = {"toy": ms["toy"], **{n: ms[n] - ms["prepass"] for n in VARIANTS}}
        row = dict(L=L, heads=H, ms=ms, max_rel_diff_to_toy=err, kernel_ms=kernel_ms,
                   tflops={n: flops / t / 1e9 for n, t in kernel_ms.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/dkdv_alone_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
