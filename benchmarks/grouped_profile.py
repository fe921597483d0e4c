"""Where grouped attention's forward+backward spends its GPU time, against the loop of per-group calls.

Same zigzag shapes as grouped_bench.py (Llama3-8B heads, rank 0 of W=2). For each provider (the
one launch, the loop, or either over the last group alone), runs
``--reps`` forward+backward steps under torch.profiler (CUDA activity) after warm-up and prints, per
kernel name, the GPU ms per step; writes them all to JSON. Answers "which kernel makes the one-launch
backward slower than separate calls".

    python benchmarks/grouped_profile.py --seq-lens 16384 32768 --out /tmp/grouped-profile.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparse_attn  # noqa: E402
from grouped_bench import zigzag_groups  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.grouped import grouped_attention_loop  # noqa: E402
from sparse_attn.ops.block_sparse import launch  # noqa: E402


def kernel_ms(fn, reps: int) -> dict[str, float]:
    """GPU ms per call of each kernel name over ``reps`` calls of fn (after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:80]] += e.device_time / 1000 / reps
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[16384, 32768])
    ap.add_argument("--groups", nargs="+", type=int, default=[2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--providers", nargs="+", default=["grouped", "loop"],
                    choices=["grouped", "loop", "grouped-last-alone", "loop-last-alone"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for seq_len in a.seq_lens:
        for n_groups in a.groups:
            groups, tq = zigzag_groups(seq_len, n_groups, 2, 0)
            g = torch.Generator(device=dev).manual_seed(0)
            mk = lambda n, h: torch.randn(n, h, 128, generator=g, device=dev).bfloat16().requires_grad_()  # noqa: E731
            q, k, v = mk(tq, 32), mk(seq_len, 8), mk(seq_len, 8)
            do = torch.randn(tq, 32, 128, generator=g, device=dev).bfloat16()
            last = [groups[-1]]  # the group with the longest K/V slice, alone
            providers = {"grouped": (sparse_attn.grouped_attention, groups),
                         "loop": (grouped_attention_loop, groups),
                         "grouped-last-alone": (sparse_attn.grouped_attention, last),
                         "loop-last-alone": (grouped_attention_loop, last)}
            for name in a.providers:
                f, gs = providers[name]

                def step(f=f, gs=gs):
                    q.grad = k.grad = v.grad = None
                    f(q, k, v, gs, causal=True).backward(do)
                per = kernel_ms(step, a.reps)
                total = sum(per.values())
                print(f"S={seq_len} G={n_groups} {name}: {total:.3f} GPU ms per step", flush=True)
                for kname, ms in list(per.items())[:12]:
                    print(f"   {ms:8.3f}  {kname}")
                rows.append({"seq_len": seq_len, "groups": n_groups, "provider": name, "gpu_ms": total,
                             "dq_side_stream": launch.BWD_DQ_SIDE_STREAM, "kernels": per})
    if a.out:
        Path(a.out).write_text(json.dumps({**make_header(dev, "grouped-profile"), "config": vars(a),
                                           "rows": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
