"""Backward kernels on contiguous schedules: walk each row's run of unmasked blocks by arithmetic
(kernels' CONTIGUOUS) or through the register index chunks every layout uses (the old path)?

`bwd_ws_probe.py` found a stripped dK/dV kernel (dense, flat loop, no index bookkeeping) 16% faster
than ours on a dense 16K backward (13.8 vs 16.0 ms). This probe calls `launch.backward` directly on
the same inputs with both paths, checks that their gradients are bitwise equal (same blocks, same
order), and times each kernel (torch.profiler, dQ on the main stream so each kernel's time is its
own), alternating the two paths over several rounds.

    python benchmarks/bwd_contig_probe.py --out $OUT/bwd-contig-h100.json [--len 16384] [--hkv 32 8]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_profile import kernel_ms  # noqa: E402

from sparse_attn import patterns  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import launch, layout_inputs  # noqa: E402

CASES = {
    "dense": lambda L: patterns.dense(L),
    "causal": lambda L: patterns.causal(L),
    "window4096": lambda L: patterns.local(L, 4096),
    "block-diagonal4096": lambda L: patterns.block_diagonal(L, 4096),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--hkv", nargs="+", type=int, default=[32, 8])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    L, H, D = a.len, 32, 128
    scale = D ** -0.5
    saved, launch.BWD_DQ_SIDE_STREAM = launch.BWD_DQ_SIDE_STREAM, False
    rows = []
    for hkv in a.hkv:
        g = torch.Generator(device=dev).manual_seed(hkv)
        q, do = (torch.randn(1, H, L, D, generator=g, device=dev).bfloat16() for _ in range(2))
        k, v = (torch.randn(1, hkv, L, D, generator=g, device=dev).bfloat16() for _ in range(2))
        for case in a.cases:
            layout = CASES[case](L).to(dev)
            (counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids,
             t_contiguous, terms, n_terms) = layout_inputs(layout, True)
            out, lse = launch.forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms,
                                      n_terms, None, None, 128, 128, scale, L, L)

            def step(flag):
                return launch.backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                                       t_indices, t_mask_ids, terms, n_terms, None, None, 128, 128, scale, L, L,
                                       contiguous=flag and contiguous, t_contiguous=flag and t_contiguous)
            grads = {flag: [t.clone() for t in step(flag)] for flag in (False, True)}
            equal = all(torch.equal(x, y) for x, y in zip(grads[False], grads[True]))
            finite = all(bool(t.isfinite().all()) for t in grads[True])
            times = {"indexed": [], "contiguous": []}
            for _ in range(a.rounds):
                for name, flag in (("indexed", False), ("contiguous", True)):
                    times[name].append(kernel_ms(lambda flag=flag: step(flag), a.reps))
            med = {name: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0] if "bwd_" in k}
                   for name, rs in times.items()}
            row = dict(case=case, hkv=hkv, L=L, fwd_contiguous=contiguous, t_contiguous=t_contiguous,
                       bitwise_equal=equal, finite=finite, median_kernel_ms=med, rounds=times)
            print(json.dumps({k: row[k] for k in row if k != "rounds"}), flush=True)
            rows.append(row)
    launch.BWD_DQ_SIDE_STREAM = saved
    if a.out:
        header = make_header(dev, "probe", script="benchmarks/bwd_contig_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
