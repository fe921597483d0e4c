"""Host time of the forward launch with launch._Picked (the autotuner's pick launched directly) and with
Triton's autotuner itself, alternated in one process (the host's speed moved by a third between
processes of one machine: results/sage-host-time-h200/), on tiny inputs where the host bounds the call.

    python benchmarks/picked_launch_ab.py --rounds 7 --out $OUT/picked-launch-ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from sparse_attn import patterns
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import forward_layout_inputs, launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_overhead import per_call_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    q, k, v = (torch.randn(1, 32, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lay = patterns.causal(256, 256, block_q=128, block_k=128, device="cuda")
    args = forward_layout_inputs(lay)

    def call():
        launch.forward(q, k, v, *args, None, None, lay.block_q, lay.block_k, 128 ** -0.5, 256, 256)

    call()
    family = next(f for f, t in launch._TUNED.items() if f[0] == "fwd" and isinstance(t, launch._Picked))
    picked = launch._TUNED[family]
    kinds = {"picked": picked, "autotuner": picked.autotuner}
    times = {name: [] for name in kinds}
    for _ in range(a.rounds):
        for name, tuned in kinds.items():
            launch._TUNED[family] = tuned
            times[name].append(per_call_us(call, n=200, runs=3))
    launch._TUNED[family] = picked
    med = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"median_us": med, "rounds_us": times}), flush=True)
    header = make_header("cuda", "probe", script="benchmarks/picked_launch_ab.py")
    Path(a.out).write_text(json.dumps({**header, "family": str(family), "median_us": med, "rounds_us": times}, indent=1))


if __name__ == "__main__":
    main()
