"""Per-kernel GPU time of one backward, ours and Flex's, at 32 and 8 kv heads: which kernel changes
when the heads are grouped (GQA)?

Ours runs with the dQ kernel on the main stream (launch.BWD_DQ_SIDE_STREAM off), so each kernel's time
is its own and not shared with a concurrent one. torch.profiler records REPS backwards of each after
warm-up; the table gives each kernel's mean time per backward, in ms.

    python benchmarks/bwd_kernel_times.py --out $OUT/bwd-kernel-times-h100.json [--cases dense:16384 ...]
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
OURS = {"split-regs": ("split", 64, (64, 128, 8, 3), (128, 64, 8, 3), {"BWD_DQ_SIDE_STREAM": False})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "random0.25:16384"])
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        for hkv in (32, 8):
            fns, _ = backwards(case, hkv, OURS)
            for name, fn in fns.items():
                ms = kernel_ms(fn, REPS)
                row = dict(case=case, hkv=hkv, provider=name, kernels_ms=ms, total_ms=sum(ms.values()))
                print(json.dumps(row), flush=True)
                rows.append(row)
    launch.BWD_DQ_SIDE_STREAM = True
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/bwd_kernel_times.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
