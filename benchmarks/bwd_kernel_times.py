"""Per-kernel GPU time of one backward, ours and Flex's, at 32 and 8 kv heads: which kernel changes
when the heads are grouped (GQA)?

Ours runs with the dQ kernel on the main stream (launch.BWD_DQ_SIDE_STREAM off), so each kernel's time
is its own and not shared with a concurrent one. torch.profiler records REPS backwards of each after
warm-up; the table gives each kernel's mean time per backward, in ms.

``--variants`` adds walk variants of ours (VARIANTS: contiguous schedules forced through the indexed
walk, the wave order off, register index chunks), ``--rounds`` repeats every variant in turn, so a
variant's time can be compared per unit of density across layouts (NOTES.md backward 26).

    python benchmarks/bwd_kernel_times.py --out $OUT/bwd-kernel-times-h100.json [--cases dense:16384 ...]
        [--hkv 32] [--variants indexed nowave] [--rounds 2] [--no-flex]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_flex_probe import backwards  # noqa: E402
from grouped_profile import kernel_ms  # noqa: E402

from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import launch  # noqa: E402

REPS = 5
ONE_STREAM = {"BWD_DQ_SIDE_STREAM": False}


def _split(**attrs):
    """The shipped split schedule's tiles, dQ on the main stream, with these launch attributes."""
    return ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {**ONE_STREAM, **attrs})


OURS = {"split-regs": _split()}
# --variants: which part of a walk costs the dK/dV kernel time per unit of density (NOTES backward 26)
VARIANTS = {
    # contiguous schedules (dense, block-diagonal) through the indexed walk: deep index loads, wave order
    "indexed": _split(BWD_CONTIGUOUS=False),
    "nowave": _split(BWD_WAVE="0"),
    "indexed-nowave": _split(BWD_CONTIGUOUS=False, BWD_WAVE="0"),
    "nodeep": _split(BWD_IDX_DEEP="0"),
    "nodeltaacc": _split(BWD_DKDV_DELTA_ACC="0"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "random0.25:16384"])
    ap.add_argument("--hkv", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="also time these variants of ours (VARIANTS)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, in turn")
    ap.add_argument("--out")
    a = ap.parse_args()
    ours = {**OURS, **{name: VARIANTS[name] for name in a.variants}}
    rows = []
    for case in a.cases:
        for hkv in a.hkv:
            fns, _ = backwards(case, hkv, ours)
            if a.no_flex:
                fns.pop("flex")
            for rnd, (name, fn) in ((r, nf) for r in range(a.rounds) for nf in fns.items()):
                ms = kernel_ms(fn, REPS)
                row = dict(case=case, hkv=hkv, provider=name, round=rnd, kernels_ms=ms, total_ms=sum(ms.values()))
                print(json.dumps(row), flush=True)
                rows.append(row)
    launch.BWD_DQ_SIDE_STREAM = True
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/bwd_kernel_times.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
