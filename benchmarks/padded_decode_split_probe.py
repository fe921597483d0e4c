"""A padded batch's decoding step read in place from a static cache (the traced integration's op: row_spans +
in_place_spans), with the key walk cut into 1, 2, 4 ... parts (launch.FWD_KV_SPLIT forced), against the
split-KV rule's own choice ("auto"; "one-wave": the rule before uneven rows took two waves) and SDPA over the
whole cache with the padding mask.

    python benchmarks/padded_decode_split_probe.py --out $OUT/padded-split.json [--cases 8:32:16384:left ...]

A case is B:Hkv:Lk:rows (32 query heads, head dim 128, bf16, one query a row; a static cache of Lk + 64 slots):
``left`` gives row b the real keys of hf_decode_ab.py's prompts (4096 ... 512 times Lk / 4096, left-padded), ``equal``
every row Lk real keys. Why: one program a row's part (the one-wave rule) leaves the SMs of short rows idle
while the long rows finish. Each provider's CALLS calls are captured in a CUDA graph and the graphs
replayed interleaved (bench.timing.time_interleaved): microseconds a call, and the real keys' K/V bytes over that
(GB/s). Outputs are compared with the unsplit call's.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from sparse_attn.bench.timing import time_interleaved
from sparse_attn.integrations import _unpad
from sparse_attn.ops.block_sparse import launch
from sparse_attn.testing import capture_graph, launch_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import probe_parser, save_rows  # noqa: E402

H, D = 32, 128
CALLS = 10
SLACK = 64  # unwritten static-cache slots after the last query
PARTS = ("auto", "1", "2", "3", "4", "8")
# "one-wave": the auto rule before uneven rows took two waves (launch.KV_SPLIT_LONG_WAVES 0)
DEFAULT_CASES = ["8:32:16384:left", "8:8:16384:left", "8:32:16384:equal", "16:32:4096:left", "4:32:32768:left"]


def real_lengths(B: int, lk: int, rows: str) -> list[int]:
    if rows == "equal":
        return [lk] * B
    base = (4096, 3500, 3000, 2500, 2000, 1500, 1000, 512)
    return [base[b % len(base)] * lk // 4096 for b in range(B)]


def main():
    a = probe_parser(DEFAULT_CASES).parse_args()
    rows_out = []
    for spec in a.cases:
        B, hkv, lk, kind = spec.split(":")
        B, hkv, lk = int(B), int(hkv), int(lk)
        lens = real_lengths(B, lk, kind)
        row = dict(case=spec, batch=B, heads=H, kv_heads=hkv, cache_slots=lk + SLACK, real_keys=lens, head_dim=D)
        print(spec, flush=True)
        try:
            torch.manual_seed(0)
            slots = lk + SLACK
            q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, hkv, slots, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            pad = torch.zeros(B, slots, dtype=torch.bool, device="cuda")
            for b, n in enumerate(lens):  # left padding: the real keys end at the last written slot (lk)
                pad[b, lk - n:lk] = True
            mask = _unpad.key_states(pad, B, slots, lk, "cuda")
            spans, drop, fill = _unpad.row_spans(mask, 1, q.dtype)

            def ours(parts, **settings):
                def call():
                    with launch_settings(FWD_KV_SPLIT=parts, **settings):
                        return _unpad.in_place_spans(q, k, v, spans, drop, fill, causal=True)
                return call
            sdpa_mask = pad[:, None, None, :]
            rep = H // hkv

            def sdpa():  # transformers' sdpa with a padding mask: grouped K/V repeated, the whole cache masked
                kk, vv = (t.repeat_interleave(rep, 1) if rep > 1 else t for t in (k, v))
                return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=sdpa_mask)
            providers = {f"parts-{p}": ours(p) for p in PARTS}
            providers["one-wave"] = ours("auto", KV_SPLIT_LONG_WAVES=0)
            providers["sdpa-mask"] = sdpa
            ref = providers["parts-1"]().float()
            seen = []  # the plan "auto" makes, recorded from the launcher's own call
            planner = launch.short_query_plan
            launch.short_query_plan = lambda *args: seen.append(planner(*args)) or seen[-1]
            try:
                providers["parts-auto"]()
            finally:
                launch.short_query_plan = planner
            row["auto_plan"] = [None if p is None else dict(parts=p.parts, pack=p.pack, heads=p.heads) for p in seen]
            diffs, graphs = {}, {}
            for name, call in providers.items():
                out = call()
                out = out.transpose(1, 2) if name == "sdpa-mask" else out  # [B, H, 1, D] -> [B, 1, H, D]
                diffs[name] = (out.float() - ref).abs().max().item()
                graphs[name], _ = capture_graph(lambda call=call: [call() for _ in range(CALLS)])
            names = list(graphs)
            ms = time_interleaved([graphs[n].replay for n in names], "cuda")
            us = {n: 1e3 * t / CALLS for n, t in zip(names, ms)}
            real_bytes = 2 * sum(lens) * hkv * D * 2
            row.update(us_per_call=us, real_kv_gb_per_s={n: real_bytes / (t * 1e3) for n, t in us.items()},
                       max_abs_diff_vs_unsplit=diffs)
            print(json.dumps({n: round(t, 1) for n, t in us.items()}), json.dumps(row["auto_plan"]), flush=True)
        except Exception:  # noqa: BLE001 - recorded, the rest still runs
            row["error"] = traceback.format_exc()[-1500:]
            print(row["error"], file=sys.stderr, flush=True)
        rows_out.append(row)
        torch.cuda.empty_cache()
        save_rows(a.out, "padded-decode-split-probe", rows_out)


if __name__ == "__main__":
    main()
