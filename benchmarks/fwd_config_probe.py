"""The bf16 forward with each tile config of its autotune space pinned, timed interleaved with Flex on the
kernels suite's own layouts and inputs: which config is best at each length, and does the autotuner
(now keyed by a length class, launch._tune_class) find it? The kernels suite at 128K recorded picks of
128 x 64 tiles or 2 stages there, where every shorter class picked 128 x 128 tiles with 3 stages, and
some 128K rows ran 5-11% slower than with the 32K pick the day before.

Each pinned callable sets ``launch.fwd_configs`` to its one config before calling (no recompile: the
kernel's own JIT cache holds each variant). The "auto" column is the shipped autotuner, tuned afresh at
the row's class in this process (its pick is recorded). Rounds alternate, each timed with
``time_interleaved`` (the suite's interleaved timer), so every column meets the same clocks.

    python benchmarks/fwd_config_probe.py --out $OUT/fwd-config-probe-h100.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton

from sparse_attn.bench.registry import get_provider
from sparse_attn.bench.results import make_header
from sparse_attn.bench.suites import get_suite
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.ops.block_sparse import launch

FAMILY = ("fwd", 128, 128, 128, "tma", False)  # launch._TUNED's key of the bf16 TMA forward at these sizes


def label(cfg: triton.Config) -> str:
    return f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}s{cfg.kwargs['NUM_STAGES']}"


def pinned(run, cfg, shipped):
    """``run`` with the forward's config space pinned to ``cfg`` (None: the shipped autotuned space).
    Each callable keeps its own tuned-kernel object in ``launch._TUNED`` across calls, so the pinned
    ones never see each other's config and the auto one tunes once and keeps its pick."""
    space = shipped if cfg is None else (lambda *a, **kw: [cfg])
    own = []

    def fn():
        launch.fwd_configs = space
        if own:
            launch._TUNED[FAMILY] = own[0]
        else:
            launch._TUNED.pop(FAMILY, None)
        out = run()
        if not own:
            own.append(launch._TUNED[FAMILY])
        return out
    fn.tuned = own
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--patterns", nargs="+", default=["local-4096", "streaming-128+4096", "block_diagonal-4096",
                                                      "random-0.1", "random-0.5"])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases = {c.pattern.name: c for c in get_suite("kernels").cases if c.modes == ("fwd",) and c.head_dim == 128}
    shipped = launch.fwd_configs
    configs = shipped(*FAMILY[1:5])  # the space being probed: 128 x 128 layout blocks, head dim 128, TMA
    ours, flex = get_provider("sparse_attn"), get_provider("flex")
    rows = []
    for L in a.seq_lens:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 32, L, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in a.patterns:
            c = cases[name]
            layout = c.pattern.build(L, heads=32, block_q=128, block_k=128, device="cuda")
            run = ours.make_run(q, k, v, layout, c.pattern.causal, "fwd").fn
            labels = ["auto", *map(label, configs), "flex"]
            fns = [pinned(run, None, shipped), *[pinned(run, cfg, shipped) for cfg in configs],
                   flex.make_run(q, k, v, layout, c.pattern.causal, "fwd").fn]
            # the auto column first: it tunes (at this row's class) before any pinned config runs
            for fn in fns:
                fn()
            launch._TUNED[FAMILY] = fns[0].tuned[0]  # the auto column's autotuner, for its pick
            pick = launch.autotune_picks("fwd")
            per = {lab: [] for lab in labels}
            for _ in range(a.rounds):
                for lab, t in zip(labels, time_interleaved(fns, "cuda")):
                    per[lab].append(t)
            med = {lab: statistics.median(ts) for lab, ts in per.items()}
            best = min(labels[1:-1], key=med.get)
            row = {"pattern": name, "seq_len": L, "ms": med, "ms_rounds": per, "best_pinned": best,
                   "auto_over_best": med["auto"] / med[best], "flex_over_best": med["flex"] / med[best],
                   "flex_over_auto": med["flex"] / med["auto"], "autotune_picks": pick}
            print(json.dumps({k: row[k] for k in ("pattern", "seq_len", "best_pinned", "auto_over_best",
                                                   "flex_over_best", "flex_over_auto")}),
                  {k: round(t, 3) for k, t in med.items()}, flush=True)
            rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    launch.fwd_configs = shipped
    header = make_header("cuda", "probe", script="benchmarks/fwd_config_probe.py")
    Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
