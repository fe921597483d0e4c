"""Grouped forward (one launch, packed) vs the per-group loop with the forward's tile config pinned:
is the grouped forward's loss at 16K+ (grouped-h100.json) the config the autotuner picked, or the
kernel? Written when the autotune key left out the sequence length, so the config was tuned at
whatever length came first in a process (grouped_bench.py starts at 8K); the key now holds a
power-of-two length class (launch._tune_class), the fix this probe led to.

Each row pins ``launch.fwd_configs`` to one config (both paths use it; autotuning off for the forward)
and times grouped_attention and the loop as grouped_bench.py does (``run_row``, forward only).
"auto" rows use the autotuner as shipped, tuned at the row's own length.

    python benchmarks/grouped_fwd_config_probe.py --out $OUT/grouped-fwd-configs-h100.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_bench import MODELS, run_row  # noqa: E402

from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import launch  # noqa: E402

# (BLOCK_M, BLOCK_N, stages): the bf16 forward's space at 128 x 128 layout blocks, head dim 128
CONFIGS = [(128, 64, 2), (128, 64, 3), (128, 128, 2), (128, 128, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[16384, 32768])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    hq, hkv, d, _ = MODELS["llama3-8b"]
    shipped = launch.fwd_configs
    rows = []
    for seq_len in a.seq_lens:
        for c in [None, *CONFIGS]:
            if c is None:
                launch.fwd_configs = shipped
            else:
                m, n, s = c
                cfg = triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": s, "USE_TMA": True}, num_warps=8,
                                    num_stages=s)
                launch.fwd_configs = lambda *args, _c=cfg, **kw: [_c]
            launch._TUNED.clear()
            row = run_row("llama3-8b", hq, hkv, d, seq_len, a.groups, 2, 0, "fwd", torch.bfloat16, "cuda")
            row["config"] = "auto" if c is None else list(c)
            if c is None:
                row["autotune_picks"] = launch.autotune_picks("fwd")
            print(json.dumps({k: row[k] for k in ("seq_len", "config", "ms_grouped", "ms_loop", "speedup")}),
                  flush=True)
            rows.append(row)
    launch.fwd_configs = shipped
    header = make_header("cuda", "probe", script="benchmarks/grouped_fwd_config_probe.py")
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
