"""Is the forward on long random layouts limited by L2 misses on K/V? A test without kernel changes.

At 128K one head's K and V (64 MB in bf16 at D=128) no longer fit the H100's 50 MB L2, and the query
tiles running at once (one head's, by the grid order) each read a random quarter or half of them. If
K/V re-reads then miss L2, attending the key range in P parts one after another (each part a layout
holding only the blocks whose key block lies in that part; P launches, every part's K/V working set
64/P MB) takes less time than one launch over the whole layout, although it does the same block
products. The parts' outputs are not combined here (a real split would merge them by their LSE, a
few ms of extra traffic at 128K): this only times the products.

    python benchmarks/kv_split_probe.py --out $OUT/kv-split-h100.json [--cases random0.25:131072 ...]
    ncu ... --profile-from-start off python benchmarks/kv_split_probe.py --profile --parts --out /dev/null
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import sparse_attn
from sparse_attn.bench.providers import _flex_fn
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.layout import BlockLayout
from sparse_attn.patterns import to_flex


def random_mask(L: int, density: float) -> torch.Tensor:
    """The kernels suite's random layout shape: [1, 32, n, n] blocks of 128, the diagonal always in."""
    g = torch.Generator().manual_seed(0)
    n = math.ceil(L / 128)
    bm = torch.rand(1, 32, n, n, generator=g) < density
    return bm | torch.eye(n, dtype=torch.bool)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["random0.25:32768", "random0.1:131072", "random0.25:131072",
                                                    "random0.5:131072"])
    ap.add_argument("--parts", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true",
                    help="run each case's whole-layout forward once inside cudaProfilerStart/Stop (for ncu)")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        which, L = case.split(":")
        L, density = int(L), float(which[len("random"):])
        bm = random_mask(L, density)
        n = bm.shape[-1]
        full = BlockLayout.from_block_mask(bm, block_q=128, block_k=128).to("cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        fns = {"whole": lambda: sparse_attn.attention(q, k, v, full)}
        for p in a.parts:
            cols = torch.arange(n)
            parts = [BlockLayout.from_block_mask(bm & ((cols >= i * n // p) & (cols < (i + 1) * n // p)),
                                                 block_q=128, block_k=128).to("cuda") for i in range(p)]
            assert sum(x.num_blocks for x in parts) == full.num_blocks
            fns[f"{p}-parts"] = lambda parts=parts: [sparse_attn.attention(q, k, v, x) for x in parts]
        for fn in fns.values():  # compile, autotune, build the schedules
            fn()
        torch.cuda.synchronize()
        if a.profile:  # ours and Flex's forward on the whole layout, once each
            flex = _flex_fn("cuda")
            block_mask = to_flex(full)
            flex(q, k, v, block_mask=block_mask)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            fns["whole"]()
            flex(q, k, v, block_mask=block_mask)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        ms = dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))
        row = dict(case=case, density=full.density, ms=ms, whole_over_parts={k: ms["whole"] / t for k, t in ms.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(a.out).write_text(json.dumps({**make_header("cuda", "probe", script="benchmarks/kv_split_probe.py"),
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
