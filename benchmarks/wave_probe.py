"""Does the wave forward (launch.WAVE_CTAS) win back the L2 hits, and with them the clock, that long
random layouts lose?

At 128K one head's K/V (64 MB in bf16, D=128) outgrow the H100's 50 MB L2. The shipped grid starts a
program per query tile; once the programs have drifted apart, the ones running at once stand at
uniformly spread points of their key walks, so together they touch the whole head's K/V between two
visits of a block (ncu: L2 hit 41% at 128K random 0.5 against 97.7% at 32K, and the SM clock under the
power cap 1.50 GHz against 1.83). The wave forward runs persistent programs that start each row's
walk at the key position their finished work has reached in a sweep of the key range, so the
programs running at once walk the same stretch of keys (kernels.fwd_kernel, WAVE).

Times shipped, wave and FlexAttention interleaved on the kernels suite's random layouts, checks the
wave's output and LSE against the shipped kernel's (both written into NaN-poisoned buffers), and
samples the SM clock and power while each provider runs alone (nvidia-smi, when present).

    python benchmarks/wave_probe.py --out $OUT/wave-probe-h100.json [--cases random0.25:131072 ...] [--modes 1 2]
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
from sparse_attn.bench.providers import _flex_fn
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.layout import BlockLayout
from sparse_attn.ops.block_sparse import forward_layout_inputs, launch
from sparse_attn.patterns import to_flex


def ours(q, k, v, layout, mode: int, out=None, lse=None, rotate: bool = True):
    """The forward launch itself (no autograd wrapper) in wave mode ``mode`` (0: shipped, see
    launch.WAVE_MODE); ``rotate`` False keeps mode 1's persistent programs but starts every row's walk
    at its first block."""
    launch.WAVE_MODE, launch.WAVE_ROTATE = mode, rotate
    try:
        return launch.forward(q, k, v, *forward_layout_inputs(layout), None, None, 128, 128, q.shape[-1] ** -0.5,
                              q.shape[2], k.shape[2], out=out, lse=lse)
    finally:
        launch.WAVE_MODE, launch.WAVE_ROTATE = 0, True


def static_imbalance(layout, programs: int) -> float:
    """Largest over mean work of persistent programs that take tiles t, t + programs, ... (rows in
    the grid's order: query tile fastest, then head)."""
    work = layout.kv_counts.expand(1, 32, -1).reshape(-1).double()
    per = torch.zeros(programs, dtype=torch.float64).index_add_(0, torch.arange(work.numel()) % programs, work.cpu())
    return float(per.max() / per.mean())


def clocks_while(fn, seconds: float = 4.0) -> dict | None:
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
    ap.add_argument("--cases", nargs="+", default=["random0.25:32768", "random0.1:131072", "random0.25:131072",
                                                    "random0.5:131072"])
    ap.add_argument("--modes", nargs="+", type=int, default=[1, 2], help="wave modes to time (launch.WAVE_MODE)")
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--no-rotate", action="store_true", help="also time persistent programs without the rotation")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: run shipped and the wave modes once each inside cudaProfilerStart/Stop (for ncu)")
    ap.add_argument("--no-clocks", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    flex = _flex_fn("cuda")
    for case in a.cases:
        which, L = case.split(":")
        L, density = int(L), float(which[len("random"):])
        layout = BlockLayout.from_block_mask(random_mask(L, density), block_q=128, block_k=128).to("cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, a.hkv, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        block_mask = to_flex(layout)
        fns = {"shipped": lambda: ours(q, k, v, layout, 0)}
        for w in a.modes:
            fns[f"wave{w}"] = lambda w=w: ours(q, k, v, layout, w)
        if a.no_rotate:
            fns["persistent"] = lambda: ours(q, k, v, layout, 1, rotate=False)
        fns["flex"] = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=a.hkv != 32)
        for fn in fns.values():  # compile, autotune, build the schedule
            fn()
        torch.cuda.synchronize()
        if a.profile:  # shipped and each wave mode once, for ncu
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for name in fns:
                if name != "flex":
                    fns[name]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        # correctness: each wave run against the shipped kernel, outputs in NaN-poisoned buffers
        ref_o, ref_l = (torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda"))
        ours(q, k, v, layout, 0, out=ref_o, lse=ref_l)
        check = {}
        for w in a.modes:
            o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
            ours(q, k, v, layout, w, out=o, lse=lse)
            check[f"wave{w}"] = {"nan": bool(o.isnan().any() or lse.isnan().any()),
                                 "out_max_abs_diff": float((o.float() - ref_o.float()).abs().max()),
                                 "lse_max_abs_diff": float((lse - ref_l).abs().max())}
        del ref_o, ref_l
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        flops = 4 * 128 * 128 * 128 * layout.num_blocks * (32 // layout.heads)
        row = dict(case=case, hkv=a.hkv, density=layout.density, ms=ms,
                   tflops={k: flops / t / 1e9 for k, t in ms.items()},
                   over_flex={k: ms["flex"] / t for k, t in ms.items()},
                   check=check, imbalance=static_imbalance(layout, torch.cuda.get_device_properties(0).multi_processor_count),
                   clocks=None if a.no_clocks else {k: clocks_while(f) for k, f in fns.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(a.out).write_text(json.dumps({**make_header("cuda", "probe", script="benchmarks/wave_probe.py"),
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
