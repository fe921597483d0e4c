"""What pv_threshold (the kernels' negligible-tile skip, SpargeAttn's second stage) saves on the GPU.

For causal attention and the adaptive (meansim "medium") layout on sparsifiable inputs
(``accuracy.structured_qkv``) and on plain random ones, times the forward at each threshold against
the same call without it (one run, medians of do_bench), and measures the output's cosine and
relative L1 against the threshold-free output.

    python benchmarks/pv_skip_probe.py --out $OUT/pv-skip-h100.json [--seq 32768]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import triton

import sparse_attn
from sparse_attn.accuracy import structured_qkv
from sparse_attn.metrics import compare

THRESHOLDS = (1e-6, 1e-4, 1e-3, 1e-2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    L, H, D = a.seq, a.heads, 128
    inputs = {"structured": structured_qkv(1, H, L, D, dtype=torch.bfloat16, device="cuda")}
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs["random"] = tuple(torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
                             for _ in range(3))
    rows = []
    with torch.no_grad():
        for data, (q, k, v) in inputs.items():
            for name in ("causal", "adaptive"):
                layout = sparse_attn.predict.meansim(q, k, causal=True) if name == "adaptive" else None
                run = lambda t=None: sparse_attn.attention(q, k, v, layout, causal=True, pv_threshold=t)  # noqa: E731
                base = run()
                t_base = triton.testing.do_bench(run, warmup=10, rep=200)
                for t in THRESHOLDS:
                    torch.full((base.numel() * 2,), float("nan"), dtype=base.dtype, device="cuda")  # freed to
                    out = run(t)  # the allocator's cache: the output starts as NaN unless the kernel writes it
                    m = compare(out, base)
                    ms = triton.testing.do_bench(lambda: run(t), warmup=10, rep=200)
                    row = {"inputs": data, "layout": name, "pv_threshold": t, "ms": round(ms, 4),
                           "ms_without": round(t_base, 4), "speedup": round(t_base / ms, 3),
                           "cosine": m["cosine"], "relative_l1": m["relative_l1"],
                           "finite": bool(torch.isfinite(out).all()),
                           "layout_sparsity": None if layout is None else round(float(layout.sparsity), 4)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    report = {"what": "pv_threshold: negligible-tile skip (benchmarks/pv_skip_probe.py)", "seq_len": L, "heads": H,
              "head_dim": D, "dtype": "bf16", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "results": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
