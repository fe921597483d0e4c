"""The split-KV forward's tile and split count on decoding shapes: every variant of --variants
(BLOCK_N:stages:warps:waves[:min_tiles], launch.SPLIT_CONFIG_OVERRIDE, KV_SPLIT_WAVES and
KV_SPLIT_MIN_TILES) captured in a CUDA graph
and the graphs replayed interleaved, as decode_probe.py times its providers (L2 flushed, K/V copies
cycled). Microseconds a call on the GPU, and each variant's largest output difference from the first.

    python benchmarks/decode_config_probe.py --out $OUT/decode-configs.json \\
        --variants 128:3:4:1 64:3:4:2 --cases dense:1:1:8:32768
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

import sparse_attn
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.ops.block_sparse import launch
from sparse_attn.testing import capture_graph, launch_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import CALLS, D, H, layout_for, probe_parser, save_rows  # noqa: E402


def main():
    ap = probe_parser(["dense:1:1:8:32768", "dense:1:1:8:131072", "local:1:1:8:131072", "dense:8:1:8:32768",
                       "dense:1:1:32:32768"])
    ap.add_argument("--variants", nargs="+", default=["128:3:4:1", "128:2:4:1", "64:3:4:1", "64:4:4:1",
                                                      "64:3:4:2", "64:4:4:2", "128:2:4:2"])
    a = ap.parse_args()
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for spec in a.cases:
        kind, B, lq, hkv, lk = spec.split(":")
        B, lq, hkv, lk = int(B), int(lq), int(hkv), int(lk)
        torch.manual_seed(0)
        layout = sparse_attn.prepare(layout_for(kind, lq, lk), backward=False)
        sets = max(2, min(CALLS, math.ceil(3 * l2 / (2 * B * hkv * lk * D * 2))))
        qs = [torch.randn(B, H, lq, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        kvs = [tuple(torch.randn(B, hkv, lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
               for _ in range(sets)]
        graphs, diffs, splits, first = {}, {}, {}, None
        for variant in a.variants:
            bn, stages, warps, waves, min_tiles = (list(map(int, variant.split(":"))) + [launch.KV_SPLIT_MIN_TILES])[:5]
            settings = dict(SPLIT_CONFIG_OVERRIDE=dict(BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps),
                            KV_SPLIT_WAVES=waves, KV_SPLIT_MIN_TILES=min_tiles)

            def call(i, settings=settings):
                with launch_settings(**settings):
                    return sparse_attn.attention(qs[i], *kvs[i], layout)
            try:
                out = call(0).float()
                first = out if first is None else first
                diffs[variant] = (out - first).abs().max().item()
                graphs[variant], _ = capture_graph(lambda call=call: [call(j % sets) for j in range(CALLS)])
                with launch_settings(**settings):
                    plan = launch.layout_query_plan(layout, B, H, hkv, lq, D, torch.device("cuda"))
                splits[variant] = None if plan is None else plan.parts
            except Exception as e:  # noqa: BLE001
                diffs[variant] = f"{type(e).__name__}: {str(e)[:200]}"
        names = list(graphs)
        ms = time_interleaved([graphs[n].replay for n in names], "cuda")
        row = dict(case=spec, us_per_call={n: 1e3 * t / CALLS for n, t in zip(names, ms)}, max_abs_diff=diffs,
                   splits=splits)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del graphs
        torch.cuda.empty_cache()
        save_rows(a.out, "decode-config-probe", rows)


if __name__ == "__main__":
    main()
