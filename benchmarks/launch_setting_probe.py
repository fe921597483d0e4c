"""Per-kernel times of one training step (``attention(...).backward(grad)``) under values of one
launcher setting (``--setting NAME --values A B ...``: ``ops.block_sparse.launch.NAME``, alternated step
by step in this process), or under the process's own settings (``--label``: what row_order_ab.sh runs
under an older source tree and under this one). Medians of profiled steps, as mask_cost_probe.py takes
them.

    python benchmarks/launch_setting_probe.py --setting ROW_ORDER --values grid reverse-dq --rounds 9 \
        --cases causal:16384:32 dense:16384:32 causal:32768:8 --out $OUT/x.json
    # cases are case:seq_len:kv_heads (32 query heads, d128, bf16; cases of fwdbwd_timeline_probe.py);
    # --batch B puts B rows under one layout
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fwdbwd_timeline_probe import layout_for  # noqa: E402
from mask_cost_probe import alternated_kernel_times, kernel_times  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["causal:16384:32", "dense:16384:32", "random0.25:16384:32",
                                                   "streaming:16384:32", "causal:32768:32", "causal:16384:8"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="batch rows (the layout broadcast over them)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="default")
    ap.add_argument("--setting", default="ROW_ORDER", help="the launch attribute that --values sets")
    ap.add_argument("--values", nargs="+", help="values of --setting, alternated step by step")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for spec in a.cases:
        case, seq_len, kv_heads = spec.split(":")
        seq_len, kv_heads = int(seq_len), int(kv_heads)
        torch.manual_seed(0)
        q = torch.randn(a.batch, a.heads, seq_len, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(a.batch, kv_heads, seq_len, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        grad = torch.randn_like(q)
        layout = layout_for(case, seq_len, a.heads)
        step = lambda: sparse_attn.attention(q, k, v, layout).backward(grad)  # noqa: E731
        if not a.values:
            times = {a.label: kernel_times(step, (q, k, v), a.rounds)}
        else:
            saved = getattr(launch, a.setting)
            setups = {o: (lambda o=o: setattr(launch, a.setting, o)) for o in a.values}
            try:
                times = alternated_kernel_times(step, (q, k, v), a.rounds, setups)
            finally:
                setattr(launch, a.setting, saved)
        for label, med in times.items():
            row = dict(case=case, seq_len=seq_len, kv_heads=kv_heads, batch=a.batch, label=label,
                       setting=a.setting if a.values else None, median_ms=med)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/launch_setting_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
