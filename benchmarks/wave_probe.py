"""Does the wave order of indexed rows (launch.FWD_WAVE) win back the L2 hits, and with them the clock,
that long random layouts lose; and does it cost anything on other layouts?

At 128K one head's K/V (64 MB in bf16, D=128) outgrow the H100's 50 MB L2. Without the wave order a
program starts its row's walk at the first block; once the first waves of programs have drifted apart,
the ones running at once stand at uniformly spread points of their walks, and together touch the whole
head's K/V between two visits of a block (ncu: L2 hit 38-41% at 128K random against 97.7% at 32K; SM
clock under the power cap 1.50 GHz against 1.83). With it, program t starts at the fraction
(t mod P) / P of its row, P being the programs resident at once, so the running programs stand at the
same fraction of their walks (kernels.fwd_kernel WAVE).

Times plain order, wave order and FlexAttention interleaved, checks the wave's output and LSE against
the plain kernel's (both written into NaN-poisoned buffers), and samples the SM clock and power while
each provider runs alone (nvidia-smi, when present). Cases: ``random<d>:<L>`` (the kernels suite's
random blocks), ``crandom<d>:<L>`` (the same under the causal block triangle: row lengths grow with
the query block), ``bigbird:<L>``, ``strided<s>:<L>``, ``dilated<w>x<k>:<L>`` (causal); ``/hkv8`` for GQA.

    python benchmarks/wave_probe.py --out $OUT/wave-h100.json [--cases random0.25:131072 ...]
    ncu --profile-from-start off --metrics ... python benchmarks/wave_probe.py --profile --out /dev/null
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from kv_split_probe import random_mask
from sparse_attn import patterns
from sparse_attn.bench.providers import _flex_fn
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.layout import BlockLayout
from sparse_attn.ops.block_sparse import forward_layout_inputs, launch
from sparse_attn.patterns import to_flex


def ours(q, k, v, layout, wave: bool, out=None, lse=None):
    """The forward launch itself (no autograd wrapper), wave order on or off."""
    launch.FWD_WAVE = wave
    try:
        return launch.forward(q, k, v, *forward_layout_inputs(layout), None, None, 128, 128, q.shape[-1] ** -0.5,
                              q.shape[2], k.shape[2], out=out, lse=lse)
    finally:
        launch.FWD_WAVE = True


def make_layout(which: str, L: int) -> BlockLayout:
    """The layout a case names (module docstring), on the GPU."""
    if which.startswith("crandom"):
        bm = random_mask(L, float(which[len("crandom"):]))
        return BlockLayout.from_block_mask(bm & torch.ones(bm.shape[-2:], dtype=torch.bool).tril(), block_q=128,
                                           block_k=128).to("cuda")
    if which.startswith("random"):
        return BlockLayout.from_block_mask(random_mask(L, float(which[len("random"):])), block_q=128,
                                           block_k=128).to("cuda")
    if which == "bigbird":
        return patterns.bigbird(L, num_global_blocks=1, window_blocks=3, num_random_blocks=8, heads=32,
                                device="cuda")
    if which.startswith("strided"):
        return patterns.strided(L, int(which[len("strided"):]), device="cuda")
    if which.startswith("dilated"):
        w, k = which[len("dilated"):].split("x")
        return patterns.dilated(L, int(w), int(k), causal=True, device="cuda")
    raise ValueError(f"unknown case {which!r}")


def clocks_while(fn, seconds: float = 3.0) -> dict | None:
    """Median SM clock (MHz) and power (W) nvidia-smi samples while ``fn`` runs back to back."""
    try:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return None
    t0 = time.time()
    while time.time() - t0 < seconds:
        fn()
        torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    vals = sorted((float(a), float(b)) for a, b in rows[len(rows) // 4:])  # skip the ramp
    if not vals:
        return None
    return {"sm_mhz": sorted(v[0] for v in vals)[len(vals) // 2], "power_w": sorted(v[1] for v in vals)[len(vals) // 2],
            "samples": len(vals)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=[
        "random0.25:32768", "random0.1:131072", "random0.25:131072", "random0.5:131072", "random0.25:131072/hkv8",
        "crandom0.5:131072", "bigbird:131072", "strided8:131072", "dilated64x4:131072"])
    ap.add_argument("--profile", action="store_true",
                    help="no timing: run each case's plain and wave forward once inside cudaProfilerStart/Stop (ncu)")
    ap.add_argument("--no-clocks", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    flex = _flex_fn("cuda")
    for case in a.cases:
        spec, _, gqa = case.partition("/")
        which, L = spec.split(":")
        L, hkv = int(L), 8 if gqa == "hkv8" else 32
        layout = make_layout(which, L)
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, hkv, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        block_mask = to_flex(layout)
        fns = {"plain": lambda: ours(q, k, v, layout, False), "wave": lambda: ours(q, k, v, layout, True),
               "flex": lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=hkv != 32)}
        for fn in fns.values():  # compile, autotune, build the schedule
            fn()
        torch.cuda.synchronize()
        if a.profile:
            torch.cuda.profiler.start()
            fns["plain"]()
            fns["wave"]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        res = {}
        for wave in (False, True):  # NaN-poisoned outputs
            o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
            ours(q, k, v, layout, wave, out=o, lse=lse)
            res[wave] = o, lse
        (o0, l0), (o1, l1) = res[False], res[True]
        check = {"nan": bool(o1.isnan().any() or l1.isnan().any() or o0.isnan().any()),
                 "out_max_abs_diff": float((o1.float() - o0.float()).abs().max()),
                 "lse_max_abs_diff": float((l1 - l0).abs().max()),
                 "bitwise_equal": bool(torch.equal(o1, o0) and torch.equal(l1, l0))}
        del res, o0, l0, o1, l1
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        flops = 4 * 128 * 128 * 128 * layout.num_blocks * (32 // layout.heads)
        row = dict(case=case, hkv=hkv, density=layout.density, contiguous=forward_layout_inputs(layout)[5],
                   ms=ms, tflops={k: flops / t / 1e9 for k, t in ms.items()},
                   over_flex={k: ms["flex"] / t for k, t in ms.items()}, wave_over_plain=ms["plain"] / ms["wave"],
                   check=check, clocks=None if a.no_clocks else {k: clocks_while(f) for k, f in fns.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(a.out).write_text(json.dumps({**make_header("cuda", "probe", script="benchmarks/wave_probe.py"),
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
