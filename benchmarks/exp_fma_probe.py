"""A/B of the forward's exponentials on the FMA pipe (launch.EXP_FMA: 1 / N of each tile's exp2 by
polynomial, 0 none) on the GPU: bf16 end to end and 8-bit kernel alone (inputs quantized beforehand),
one process. The variants of a case are timed in rounds, their order rotating each round, so that the
board's power state drifts over all of them alike (benchmarks/NOTES.md); medians over rounds.

    python benchmarks/exp_fma_probe.py --parts 0 4 2 --out exp-fma.json
"""
import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

import sparse_attn
from sparse_attn.api import _kernel_layout
from sparse_attn.ops.block_sparse import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import layouts  # noqa: E402
from sage_probe import kernel_only  # noqa: E402


def case_fn(kind: str, L: int, quant: str):
    """(callable, effective FLOPs) for one case: bf16 end to end, or the 8-bit kernel alone."""
    B, H, D = 1, 32, 128
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    lay, causal = layouts(L, kind)
    kl = _kernel_layout(lay, False, L, L, "cuda")
    flops = 4 * B * H * L * L * D * kl.density
    if quant == "bf16":
        return (lambda: sparse_attn.attention(q, k, v, lay)), flops, (q, k, v, lay)
    return kernel_only(q, k, v, kl, {"int8": 1, "int8-fp8": 2}[quant], "per_warp"), flops, (q, k, v, lay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["bf16/dense:16384", "bf16/random0.25:32768",
                                                   "int8-fp8/dense:16384", "int8-fp8/window4096:32768"],
                    help="QUANT/LAYOUT:L with QUANT bf16, int8 or int8-fp8 and LAYOUT as probe.py's")
    ap.add_argument("--parts", nargs="+", type=int, default=[0, 4, 2])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    for case in a.cases:
        quant, rest = case.split("/")
        kind, L = rest.split(":")
        fn, flops, (q, k, v, lay) = case_fn(kind, int(L), quant)
        key = quant != "bf16"
        outs, times = {}, {p: [] for p in a.parts}
        for p in a.parts:  # compile (and autotune, under the first variant) outside the timing
            launch.EXP_FMA[key] = p
            o = fn()
            outs[p] = o[0] if isinstance(o, tuple) else o
        for r in range(a.rounds):
            order = a.parts[r % len(a.parts):] + a.parts[:r % len(a.parts)]
            for p in order:
                launch.EXP_FMA[key] = p
                times[p].append(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"))
        launch.EXP_FMA[key] = 0
        ref = outs[a.parts[0]].float()
        for p in a.parts:
            ms = statistics.median(times[p])
            row = dict(case=case, exp_fma=p, ms=ms, ms_rounds=times[p], tflops=flops / ms * 1e-9,
                       max_abs_diff_vs_first=(outs[p].float() - ref).abs().max().item(),
                       rel_l1_vs_first=((outs[p].float() - ref).abs().sum() / ref.abs().sum()).item())
            print(json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in row.items()}), flush=True)
            rows.append(row)
        del q, k, v, outs
    if a.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.date.today().isoformat(), "autotune": launch.autotune_picks("fwd"), "rows": rows},
                  open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
