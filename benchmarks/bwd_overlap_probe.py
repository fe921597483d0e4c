"""When do the two backward grids run? One backward (dQ on its side stream) under torch.profiler:
each kernel's start and end relative to the first one's start, so the overlap of the dK/dV and dQ
grids can be read off (both spanning the whole backward: the block scheduler shares the SMs between
them; dQ starting near dK/dV's end: it only fills the last wave).

    python benchmarks/bwd_overlap_probe.py --hkv 8 --cases random0.5:32768 --out $OUT/bwd-overlap-h100.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_flex_probe import VARIANTS, backwards  # noqa: E402

from sparse_attn.bench.results import make_header  # noqa: E402


def spans(fn) -> list[dict]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and ("bwd" in e.name or "row" in e.name)]
    t0 = min(e.time_range.start for e in ev)
    return [dict(name=e.name, start_ms=(e.time_range.start - t0) / 1e3, end_ms=(e.time_range.end - t0) / 1e3)
            for e in sorted(ev, key=lambda e: e.time_range.start)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["random0.5:32768"])
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--only", nargs="+", default=["split-regs"])
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        fns, _ = backwards(case, a.hkv, {n: VARIANTS[n] for n in a.only})
        for name in a.only:
            row = dict(case=case, hkv=a.hkv, variant=name, kernels=spans(fns[name]))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/bwd_overlap_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
