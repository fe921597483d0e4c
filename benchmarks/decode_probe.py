"""Decoding steps (a few query rows against a long KV cache): the short-query forward (split-KV, GQA's
rows packed) against the same without packing, our forward before it (the autotuned tile, unsplit),
FlexAttention (whose flex_decoding kernel splits the keys below 128 query rows) and SDPA.

    python benchmarks/decode_probe.py --out $OUT/decode.json [--cases dense:1:1:8:32768 ...]

A case is pattern:B:Lq:Hkv:Lk (32 query heads, head dim 128, bf16); patterns dense (the whole cache,
what causal decoding sees), local (a 4096-token window), streaming (128 sinks + 4096 window), random
(10% of the key blocks, per head). Each provider's calls are captured in a CUDA graph, CALLS of them
cycling through enough K/V copies to overflow the L2 (a decoder's next call reads another layer's
cache), and the graphs are replayed interleaved (bench.timing.time_interleaved, L2 flushed before each
replay): microseconds a call on the GPU, without the host's issue time, which a graph-captured decoder
does not pay either. The JSON records each case's plan (launch.short_query_plan), the K/V bytes a
query row's blocks hold over all kv heads (what a call must read at least when its heads share the
layout) and the rate that makes, and the largest difference of each provider's output from the
unsplit kernel's on the same inputs.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.providers import _flex_fn
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.ops.block_sparse import launch
from sparse_attn.testing import capture_graph, launch_settings

H, D = 32, 128
CALLS = 20
DEFAULT_CASES = [f"{p}:1:1:8:{lk}" for lk in (8192, 32768, 131072) for p in ("dense", "local", "streaming", "random")]
DEFAULT_CASES += ["dense:8:1:8:32768", "local:8:1:8:32768", "dense:4:1:8:131072", "dense:1:1:32:32768",
                  "dense:1:16:8:32768", "local:1:16:8:32768"]


def layout_for(kind: str, lq: int, lk: int):
    if kind == "dense":
        return patterns.causal(lq, lk, device="cuda")  # bottom-right: every row sees (almost) the whole cache
    if kind == "local":
        return patterns.local(lq, 4096, kv_len=lk, device="cuda")
    if kind == "streaming":
        return patterns.streaming(lq, 4096, 128, kv_len=lk, device="cuda")
    if kind == "random":
        return patterns.random(lq, kv_len=lk, density=0.1, heads=H, seed=1, device="cuda")
    raise ValueError(f"unknown pattern {kind!r}")


def visited_kv_bytes(layout, B: int, hkv: int, lk: int) -> int:
    """K and V bytes of the blocks a query row visits (the longest row, averaged over the layout's heads),
    once per kv head: the least a call reads where GQA's query heads share the layout."""
    per_row = layout.to_block_mask().float().mean(dim=-1)  # [Bl, Hl, Qb]: share of key blocks a row visits
    return int(2 * B * hkv * lk * D * 2 * per_row.max(dim=-1).values.mean().item())


def probe_parser(default_cases: list[str]) -> argparse.ArgumentParser:
    """The decode probes' command line: --cases (default ``default_cases``) and --out (the JSON)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=default_cases)
    ap.add_argument("--out", required=True)
    return ap


def save_rows(out: str, suite: str, rows: list[dict]) -> None:
    """The rows so far under the GPU's header. The probes call it after every case: a later case that
    runs past the device call's time limit keeps the earlier ones."""
    Path(out).write_text(json.dumps({"header": make_header("cuda", suite), "rows": rows}, indent=1))


def main():
    a = probe_parser(DEFAULT_CASES).parse_args()
    rows = []
    flex = _flex_fn("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for spec in a.cases:
        kind, B, lq, hkv, lk = spec.split(":")
        B, lq, hkv, lk = int(B), int(lq), int(hkv), int(lk)
        row = dict(case=spec, pattern=kind, batch=B, q_len=lq, heads=H, kv_heads=hkv, kv_len=lk, head_dim=D)
        print(spec, flush=True)
        try:
            torch.manual_seed(0)
            layout = sparse_attn.prepare(layout_for(kind, lq, lk), backward=False)  # schedule built before capture
            kv_bytes = 2 * B * hkv * lk * D * 2
            sets = max(2, min(CALLS, math.ceil(3 * l2 / kv_bytes)))
            qs = [torch.randn(B, H, lq, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
            kvs = [(torch.randn(B, hkv, lk, D, device="cuda", dtype=torch.bfloat16),
                    torch.randn(B, hkv, lk, D, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
            block_mask = patterns.to_flex(layout)

            def ours(**settings):
                def call(i):
                    with launch_settings(**settings):
                        return sparse_attn.attention(qs[i], *kvs[i], layout)
                return call

            providers = {
                "sparse_attn": ours(),
                "sparse_attn-unpacked": ours(PACK_GQA=False),
                # the forward before short_query_plan: the autotuned tile, no split
                "sparse_attn-unsplit": ours(FWD_KV_SPLIT="0", PACK_GQA=False, SMALL_Q_ROWS=0),
                "flex": lambda i: flex(qs[i], *kvs[i], block_mask=block_mask, enable_gqa=hkv != H),
            }
            if kind == "dense":  # SDPA takes no block layout: the whole cache only
                def sdpa(backend):
                    def call(i):
                        with torch.nn.attention.sdpa_kernel([backend]):
                            return torch.nn.functional.scaled_dot_product_attention(qs[i], *kvs[i],
                                                                                    enable_gqa=hkv != H)
                    return call
                providers["sdpa-flash"] = sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
                providers["sdpa-cudnn"] = sdpa(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
            plain = providers["sparse_attn-unsplit"](0).float()
            graphs, errors, diffs = {}, {}, {}
            for name, call in providers.items():
                try:
                    diffs[name] = (call(0).float() - plain).abs().max().item()
                    graphs[name], _ = capture_graph(lambda call=call: [call(j % sets) for j in range(CALLS)])
                except Exception as e:  # noqa: BLE001 - a provider that cannot run this case is recorded
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            names = list(graphs)
            ms = time_interleaved([graphs[n].replay for n in names], "cuda")
            plan = launch.layout_query_plan(layout, B, H, hkv, lq, D, torch.device("cuda"))
            row.update(
                plan=None if plan is None else dict(block_m=plan.config.kwargs["BLOCK_M"],
                                                    block_n=plan.config.kwargs["BLOCK_N"], heads=plan.heads,
                                                    tiles=plan.tiles, parts=plan.parts, pack=plan.pack),
                visited_kv_bytes=visited_kv_bytes(layout, B, hkv, lk),
                us_per_call={n: 1e3 * t / CALLS for n, t in zip(names, ms)},
                max_abs_diff_vs_unsplit=diffs, errors=errors, kv_sets=sets)
            row["gb_per_s"] = {n: row["visited_kv_bytes"] / (us * 1e-6) / 1e9 for n, us in row["us_per_call"].items()}
            print(json.dumps(row), flush=True)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-1500:]
            print(row["error"], file=sys.stderr, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
        save_rows(a.out, "decode-probe", rows)


if __name__ == "__main__":
    main()
