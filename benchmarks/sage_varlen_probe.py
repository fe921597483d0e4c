"""8-bit attention on packed (varlen) sequences, H100: the K/V loads (pointer vs TMA) and the K scales
(one per key vs one per 128-key tile) that packed inputs may now use, end to end (quantization
included), against our bf16 varlen kernel on the same inputs.

Variants, and our bf16 varlen kernel, timed in alternating rounds (triton do_bench medians):
    ptr-key   pointer K/V loads, per-key K-scale multiplies: the only path packed 8-bit inputs had
              before their quantization groups started at each sequence (the kernel cost is the same)
    ptr-tile  pointer loads, one K scale per tile
    tma-key   TMA K/V, per-key K scales
    tma-tile  TMA K/V, one K scale per tile: the default now (per_block / per_warp)

    python benchmarks/sage_varlen_probe.py --out $OUT/sage-varlen-h100.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

import sparse_attn
from sparse_attn import metrics
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import launch

VARIANTS = {"ptr-key": ("ptr", True), "ptr-tile": ("ptr", False), "tma-key": ("tma", True), "tma-tile": ("tma", False)}
_forward = launch.forward


def _set(variant: str):
    """Point the launcher at one variant: its K/V loads, and per-key K scales forced or not."""
    loads, per_key = VARIANTS[variant]
    launch.FWD_VARIANT = loads
    if per_key:
        launch.forward = lambda *a, **kw: _forward(*a, **{**kw, "k_scale_span": 0})
    else:
        launch.forward = _forward


def run_case(lens: list[int], quant: str, rounds: int, rows: list):
    H, D = 32, 128
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    call = lambda qt=quant: sparse_attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True,  # noqa: E731
                                                        quant=qt)
    flops = sum(4 * H * D * n * n / 2 for n in lens)  # causal: half of each sequence's square
    bf16 = call(None)
    outs, times = {}, {name: [] for name in VARIANTS}
    for name in VARIANTS:
        _set(name)
        outs[name] = call()  # compiles / autotunes
    times["bf16"] = []
    for _ in range(rounds):  # bf16 in the rotation too: the board's clocks drift between rounds
        for name in times:
            _set("tma-tile" if name == "bf16" else name)
            fn = (lambda: call(None)) if name == "bf16" else call
            times[name].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    _set("tma-tile")
    t_bf16 = statistics.median(times["bf16"])
    row = dict(lens=lens if len(set(lens)) > 1 else f"{len(lens)} x {lens[0]}", quant=quant, bf16_ms=t_bf16,
               bf16_tflops=flops / t_bf16 * 1e-9, bf16_rounds=times["bf16"])
    for name in VARIANTS:
        ms = statistics.median(times[name])
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms * 1e-9
        row[f"{name}_rounds"] = times[name]
        row[f"{name}_max_abs_diff_vs_tma_tile"] = (outs[name].float() - outs["tma-tile"].float()).abs().max().item()
    row["tma_tile_vs_ptr_key"] = row["ptr-key_ms"] / row["tma-tile_ms"]
    row["tma_tile_vs_bf16"] = t_bf16 / row["tma-tile_ms"]
    row["cosine_vs_bf16"] = metrics.cosine_similarity(outs["tma-tile"], bf16)
    row["rel_l1_vs_bf16"] = metrics.relative_l1(outs["tma-tile"], bf16)
    print(json.dumps({k_: round(v_, 4) if isinstance(v_, float) else v_ for k_, v_ in row.items()
                      if not k_.endswith("rounds")}), flush=True)
    rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="+", default=["8x4096", "16x2048", "1000,7000,300,12000,4000,1,8000"],
                    help="NxL (N sequences of L tokens) or comma-separated lengths")
    ap.add_argument("--quants", nargs="+", default=["int8", "int8-fp8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows: list = []
    for spec in a.batches:
        if "x" in spec:
            n, length = map(int, spec.split("x"))
            lens = [length] * n
        else:
            lens = [int(x) for x in spec.split(",")]
        for quant in a.quants:
            run_case(lens, quant, a.rounds, rows)
    if a.out:
        json.dump({**make_header("cuda", "sage-varlen-probe"), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
