"""The Gluon five-product backward (benchmarks/gluon_bwd.py) against our shipped split backward and
Flex's backward: gradients first, then time.

Correctness: dense and causal at 1024 (and 384) tokens, H=32, D=128, bf16 and fp16: each kernel's
max error against a float32 autograd backward on the same inputs, gluon's beside split's (DESIGN.md
rule 3: the same-dtype error of the shipped kernel is the yardstick). dQ/dK/dV outputs are fresh
tensors each call (gluon's dK/dV poisoned with NaN there), the fp32 dQ accumulator is zeroed by the
launcher.

Timing: ``timing.time_interleaved`` (rotating order, L2 flushed, medians), each backward including
its own row-terms pre-pass (and gluon its dQ zero-fill and fp32 -> bf16 conversion).

    python benchmarks/gluon_bwd_probe.py --out $OUT/gluon-bwd-h100.json [--cases dense:16384 causal:16384]
    python benchmarks/gluon_bwd_probe.py --checks --cases dense:8192 --profile split-regs gluon-C   # under ncu

GLUON's variants are fused_backward's keyword arguments (defaults: 3 slots, ORDER C, delta in dP's
accumulator, row terms by TMA, dense walks rotated).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_flex_probe import VARIANTS, backwards_on as flex_probe_backwards  # noqa: E402
from bwd_probe import case_inputs  # noqa: E402
from gluon_bwd import fused_backward  # noqa: E402

from sparse_attn.bench.flops import tflops  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.bench.timing import time_interleaved  # noqa: E402

# name -> fused_backward keyword arguments
GLUON = {
    "gluon-B": dict(order="B"),
    "gluon-C": dict(order="C"),
    "gluon-C-nodacc": dict(order="C", delta_acc=False),
    "gluon-C-norot": dict(order="C", rotate=False),
    # timing only, wrong dQ: where the time goes
    "gluon-C-store": dict(order="C", dq_out="store"),
    "gluon-A-skip": dict(order="A", dq_out="skip"),
}
TIMING_ONLY = ("-store", "-skip")
SPLIT = {"split-regs": VARIANTS["split-regs"]}  # our shipped backward: split schedule, its shipped tiles


def reference_grads(c, causal: bool):
    """float32 autograd gradients of softmax attention on the case's (rounded) inputs."""
    q, k, v = (t.detach().float().requires_grad_(True) for t in (c.q, c.k, c.v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * c.scale
    if causal:
        L = s.shape[-1]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)
    return torch.autograd.grad(o, (q, k, v), c.do.float())


def check(case: str, dtype: torch.dtype, rows: list):
    c = case_inputs(case, 32)
    causal = case.startswith("causal")
    if dtype != torch.bfloat16:  # same values in fp16 (case_inputs makes bf16); the forward re-run in fp16
        from sparse_attn.ops.block_sparse.function import block_sparse_fwd
        c.q, c.k, c.v, c.do = (t.to(dtype) for t in (c.q, c.k, c.v, c.do))
        c.out, c.lse = block_sparse_fwd(c.q, c.k, c.v, *c.ins, None, None, c.layout.block_q, c.layout.block_k,
                                        c.scale, c.L, c.L)
    ref = reference_grads(c, causal)
    fns, _ = backwards_on(c, case, flex=False, poison=True)
    for name, fn in fns.items():
        if name.endswith(TIMING_ONLY):
            continue
        grads = fn()
        torch.cuda.synchronize()
        err = [((g.float() - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, ref)]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        row = dict(check=case, dtype=str(dtype), kernel=name, rel_max_err_dq_dk_dv=err, finite=finite)
        print(json.dumps(row), flush=True)
        rows.append(row)


def backwards_on(c, case: str, flex: bool = True, poison: bool = False):
    """{name: zero-argument backward} for our split backward, Flex's (with ``flex``) and the gluon
    variants (``poison``: their dK/dV buffers start as NaN), all on case inputs ``c``."""
    causal = case.startswith("causal")
    fns, flops = flex_probe_backwards(c, 32, SPLIT, flex=flex)
    for name, kw in GLUON.items():
        fns[name] = (lambda kw=kw: fused_backward(c.q, c.k, c.v, c.out, c.do, c.lse, c.scale, causal, poison=poison,
                                                  **kw))
    return fns, flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", nargs="*", default=["dense:1024", "causal:1024", "dense:384", "causal:384"])
    ap.add_argument("--cases", nargs="*", default=["dense:16384", "causal:16384"])
    ap.add_argument("--profile", nargs="*", help="run these backwards once each inside cudaProfilerStart/Stop "
                    "(for ncu --profile-from-start off) instead of timing")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows: list = []
    for case in a.checks:
        for dtype in (torch.bfloat16, torch.float16):
            check(case, dtype, rows)
    for case in a.cases:
        c = case_inputs(case, 32)
        fns, flops = backwards_on(c, case)
        # the split backward (deterministic) is the yardstick: gluon's dq/dk/dv against it
        base = fns["split-regs"]()
        for name, fn in fns.items():
            grads = fn()
            torch.cuda.synchronize()
            diff = [((x.float() - y.float()).abs().max() / y.float().abs().max()).item() for x, y in zip(grads, base)]
            print(f"{case} {name}: max |diff| / max |split| (dq, dk, dv) = {diff}", flush=True)
        if a.profile:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for name in a.profile:
                fns[name]()
                torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        row = dict(case=case, hkv=32, ms=ms, tflops={n: tflops(flops, t) for n, t in ms.items()},
                   speedup_over_flex={n: ms["flex"] / t for n, t in ms.items() if n != "flex"},
                   speedup_over_split={n: ms["split-regs"] / t for n, t in ms.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/gluon_bwd_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
