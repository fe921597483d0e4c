"""The backward alone, ours against FlexAttention's, on the same inputs and layout.

The kernels suite times forward+backward; this takes the forward out, so the two backwards can be
compared directly (same q/k/v/dO, ours through ``launch.backward`` after our forward, Flex through
``torch.autograd.grad`` on its compiled forward's output, each including its own delta pre-pass).
Timing: ``timing.time_interleaved`` (rotating order, L2 flushed, medians). Our variants: the fused
and split schedules, each with
the block indices loaded per iteration ("load") or read a chunk at a time into registers ("regs",
``launch.BWD_IDX_CHUNK``), at fixed tile configs (``VARIANTS``).

With ``--profile`` it instead runs each backward once inside ``cudaProfilerStart/Stop`` after
warm-up, for ``ncu --profile-from-start off`` (see benchmarks/NOTES.md for the command).

    python benchmarks/bwd_flex_probe.py --out $OUT/bwd-flex-h100.json [--cases dense:16384 ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_probe import case_inputs, cfg  # noqa: E402

from sparse_attn.bench.flops import tflops  # noqa: E402
from sparse_attn.bench.providers import _flex_fn  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.bench.timing import time_interleaved  # noqa: E402
from sparse_attn.ops.block_sparse import launch  # noqa: E402
from sparse_attn.patterns import to_flex  # noqa: E402


# name -> (schedule, IDX_CHUNK, dK/dV tile config, dQ tile config[, {launch attribute: value}]): configs
# (BLOCK_M, BLOCK_N, warps, stages); the attributes default to DEFAULTS
DEFAULTS = {"BWD_DQ_SIDE_STREAM": True, "BWD_DQ_KV": "tma", "BWD_DKDV_ORDER": "dp-first", "BWD_DKDV_HEADS": "auto",
            "BWD_CONTIGUOUS": True, "BWD_WAVE": "auto", "BWD_DKDV_DELTA_ACC": "auto", "BWD_IDX_DEEP": "auto"}
VARIANTS = {
    "fused-load": ("fused", 0, (64, 128, 8, 2), (128, 128, 8, 2)),
    "fused-regs": ("fused", 64, (64, 128, 8, 3), (128, 128, 8, 2)),
    "split-load": ("split", 0, (64, 128, 8, 2), (128, 128, 8, 2), {"BWD_IDX_DEEP": "0"}),
    # the unmasked pass of indexed walks from register chunks too (the default until backward item 24)
    "split-regs-no-deep": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_IDX_DEEP": "0"}),
    # no register chunks: the unmasked pass deep, the masked one one load per iteration at 3 stages
    "split-deep-load": ("split", 0, (64, 128, 8, 3), (128, 64, 8, 3)),
    "split-deep-load-delta-acc": ("split", 0, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_DELTA_ACC": "1"}),
    "split-regs-no-deep-delta-acc": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3),
                                     {"BWD_IDX_DEEP": "0", "BWD_DKDV_DELTA_ACC": "1"}),
    "split-regs": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3)),
    "split-regs-1stream": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DQ_SIDE_STREAM": False}),
    "split-regs-dqkvptr": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DQ_KV": "ptr"}),
    # the split default before the fourteenth session: dV issued before dP
    "split-regs-dvfirst": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_ORDER": "dv-first"}),
    # where the dK/dV kernel's loop over a kv head's query heads sits (launch.BWD_DKDV_HEADS; the
    # default "auto" is inside for GQA, outside without)
    "split-regs-heads-inside": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_HEADS": "inside"}),
    "split-regs-heads-outside": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_HEADS": "outside"}),
    # contiguous schedules through the register index chunks too (the default before the seventeenth session)
    "split-regs-indexed": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_CONTIGUOUS": False}),
    # indexed walks in grid order, not the wave order (the default before the twentieth session)
    "split-regs-nowave": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_WAVE": "0"}),
    # the wave order on every indexed walk (the default before backward item 26; "auto" keeps it for 128K)
    "split-regs-wave": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_WAVE": "1"}),
    "split-regs-nowave-1stream": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3),
                                  {"BWD_WAVE": "0", "BWD_DQ_SIDE_STREAM": False}),
    "split-regs-wave-dq": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_WAVE": "dq"}),
    "split-regs-wave-dkdv": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_WAVE": "dkdv"}),
    # delta through dP's accumulator in the dK/dV kernel everywhere / nowhere (launch.BWD_DKDV_DELTA_ACC;
    # the default "auto" picks by walk)
    "split-regs-delta-acc": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_DELTA_ACC": "1"}),
    "split-regs-no-delta-acc": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DKDV_DELTA_ACC": "0"}),
    # ... with a 4th dK/dV stage: does the seeded product wait for a late delta on random layouts?
    "split-regs-delta-acc-dkdv4": ("split", 64, (64, 128, 8, 4), (128, 64, 8, 3), {"BWD_DKDV_DELTA_ACC": "1"}),
}
# --sweep: tile configs of the split schedule with register indices
SWEEP = {
    "split-regs": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3)),
    "split-regs-dkdv4": ("split", 64, (64, 128, 8, 4), (128, 64, 8, 3)),
    "split-regs-dq4": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 4)),
    "split-regs-dq128": ("split", 64, (64, 128, 8, 3), (128, 128, 8, 2)),
    "fused-regs": ("fused", 64, (64, 128, 8, 3), (128, 128, 8, 2)),
    # one warpgroup per CTA, small enough for two CTAs per SM (the 8-bit forward's way of overlapping
    # one CTA's softmax with the other's MMAs)
    "split-regs-dkdv64w4": ("split", 64, (64, 64, 4, 3), (128, 64, 8, 3)),
    # 2 stages: 99 KB of shared memory and 255 registers on 128 threads, so two programs share an SM
    # (faster interleaved, not in the fwd+bwd suite: NOTES.md backward 25)
    "split-regs-dkdv64w4-2st": ("split", 64, (64, 64, 4, 2), (128, 64, 8, 3)),
    "split-regs-dq64w4": ("split", 64, (64, 128, 8, 3), (64, 64, 4, 3)),
    "split-regs-both64w4": ("split", 64, (64, 64, 4, 3), (64, 64, 4, 3)),
}


def backwards(case: str, hkv: int, variants: dict):
    """{name: zero-argument backward} on one case's inputs, and the case's backward FLOP count."""
    return backwards_on(case_inputs(case, hkv), hkv, variants)


def backwards_on(c, hkv: int, variants: dict, flex: bool = True):
    """backwards() on given case inputs ``c`` (bwd_probe.case_inputs' namespace); Flex's backward
    only with ``flex``."""
    layout, L, H, q, k, v, do, scale, out, lse = c.layout, c.L, c.H, c.q, c.k, c.v, c.do, c.scale, c.out, c.lse
    (counts, n_full, _, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, t_contiguous, terms,
     n_terms) = c.ins

    def ours(variant, chunk, dkdv, dq, attrs=None):
        space = {"dkdv": [cfg(*dkdv)], "dkdv-fused": [cfg(*dkdv)], "dq": [cfg(*dq)]}
        attrs = {**DEFAULTS, **(attrs or {})}

        def bwd():
            launch.BWD_VARIANT, launch.BWD_IDX_CHUNK = variant, chunk
            for name, value in attrs.items():
                setattr(launch, name, value)
            if space != launch.BWD_SPACE_OVERRIDE:
                launch.BWD_SPACE_OVERRIDE.clear()
                launch.BWD_SPACE_OVERRIDE.update(space)
                launch._TUNED.clear()
            return launch.backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                                   t_indices, t_mask_ids, terms, n_terms, None, None, layout.block_q,
                                   layout.block_k, scale, L, L, contiguous=contiguous, t_contiguous=t_contiguous)
        return bwd

    fns = {name: ours(*spec) for name, spec in variants.items()}
    if not flex:
        return fns, c.flops_bwd
    # a compiled backward with donated buffers refuses retain_graph (seen on Flex's causal graph)
    torch._functorch.config.donated_buffer = False
    qf, kf, vf = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    flex_out = _flex_fn("cuda")(qf, kf, vf, block_mask=to_flex(layout), scale=scale,
                                enable_gqa=hkv != H)

    def flex_bwd():  # retain_graph: the same graph's backward, timed again and again
        return torch.autograd.grad(flex_out, (qf, kf, vf), do, retain_graph=True)

    fns["flex"] = flex_bwd
    return fns, c.flops_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "random0.25:16384", "causal:16384"])
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--sweep", action="store_true", help="the SWEEP variants instead of VARIANTS")
    ap.add_argument("--only", nargs="+", help="keep these variants (names from VARIANTS or SWEEP)")
    ap.add_argument("--profile", action="store_true", help="one call of each inside cudaProfilerStart/Stop")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows: list = []
    for case in a.cases:
        variants = SWEEP if a.sweep else VARIANTS
        if a.only:
            variants = {n: spec for n, spec in {**VARIANTS, **SWEEP}.items() if n in a.only}
        fns, flops = backwards(case, a.hkv, variants)
        ref = None
        for name, fn in fns.items():  # compile, autotune, and check the three agree
            grads = fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = grads
            diff = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(grads, ref)]
            print(f"{case} {name}: max |diff| / max |ref| vs {next(iter(fns))} (dq, dk, dv) = {diff}", flush=True)
        if a.profile:
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for fn in fns.values():
                fn()
                torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        ms = time_interleaved(list(fns.values()), "cuda")
        ms = dict(zip(fns, ms))
        row = dict(case=case, hkv=a.hkv, ms=ms, tflops={n: tflops(flops, t) for n, t in ms.items()},
                   speedup_over_flex={n: ms["flex"] / t for n, t in ms.items() if n != "flex"})
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/bwd_flex_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
