"""Our forward and backward against FlexAttention's on the same inputs, for an A/B of two source trees.

Each process times ours (forward through the op, backward through ``launch.backward``) and Flex's
(forward, and backward of its compiled forward's output), all interleaved (``timing.time_interleaved``),
so the ratio ours / Flex of one process is free of the board's drift between processes. Run it with
``PYTHONPATH`` pointing at each tree in turn (A B A B), then compare the ratios: written for the grid
change that put heads and sequences on grid axes 1 and 2 (benchmarks/NOTES.md, "Grid axes").

    PYTHONPATH=old/src python benchmarks/grid_axes_ab.py --tag old --out $OUT/ab-old-1.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_probe import case_inputs  # noqa: E402

import sparse_attn  # noqa: E402
from sparse_attn.bench.providers import _flex_fn  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.bench.timing import time_interleaved  # noqa: E402
from sparse_attn.ops.block_sparse import launch  # noqa: E402
from sparse_attn.ops.block_sparse.function import block_sparse_fwd  # noqa: E402
from sparse_attn.patterns import to_flex  # noqa: E402


def timed_case(case: str, hkv: int) -> dict:
    """{name: median ms} of our forward / backward and Flex's, one case (bwd_probe.case_inputs)."""
    c = case_inputs(case, hkv)
    layout, L, q, k, v, do, scale, out, lse = c.layout, c.L, c.q, c.k, c.v, c.do, c.scale, c.out, c.lse
    (counts, n_full, _, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, t_contiguous, terms,
     n_terms) = c.ins

    def ours_fwd():
        return block_sparse_fwd(q, k, v, *c.ins, None, None, layout.block_q, layout.block_k, scale, L, L)

    def ours_bwd():
        return launch.backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                               t_indices, t_mask_ids, terms, n_terms, None, None, layout.block_q, layout.block_k,
                               scale, L, L, contiguous=contiguous, t_contiguous=t_contiguous)

    torch._functorch.config.donated_buffer = False  # retain_graph on Flex's compiled backward
    flex = _flex_fn("cuda")
    mask = to_flex(layout)
    qf, kf, vf = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    flex_out = flex(qf, kf, vf, block_mask=mask, scale=scale, enable_gqa=hkv != c.H)

    def flex_fwd():
        with torch.no_grad():
            return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=hkv != c.H)

    def flex_bwd():
        return torch.autograd.grad(flex_out, (qf, kf, vf), do, retain_graph=True)

    fns = {"ours_fwd": ours_fwd, "ours_bwd": ours_bwd, "flex_fwd": flex_fwd, "flex_bwd": flex_bwd}
    # sanity before timing: our forward agrees with Flex's to bf16 rounding
    got, want = ours_fwd()[0].float(), flex_fwd().float()
    assert (got - want).abs().max().item() < 2e-2, f"{case}: forward differs from Flex"
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    return dict(zip(fns, time_interleaved(list(fns.values()), "cuda")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "random0.25:16384", "causal:16384"])
    ap.add_argument("--hkv", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--tag", required=True, help="which source tree this process runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for hkv in a.hkv:
        for case in a.cases:
            ms = timed_case(case, hkv)
            row = {"case": case, "hkv": hkv, **{k: round(v, 4) for k, v in ms.items()},
                   "fwd_vs_flex": round(ms["flex_fwd"] / ms["ours_fwd"], 4),
                   "bwd_vs_flex": round(ms["flex_bwd"] / ms["ours_bwd"], 4)}
            print(a.tag, row, flush=True)
            rows.append(row)
    header = make_header("cuda", "grid-axes-ab", tag=a.tag, sparse_attn_file=sparse_attn.__file__)
    Path(a.out).write_text(json.dumps({"header": header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
