"""Profile one context-parallel forward against the same local work (torch.profiler, CUDA activity).

    torchrun --standalone --nproc_per_node=N benchmarks/cp_profile.py --out-dir $OUT

For each case (dense B=1 and a packed batch of 4 sequences, --tokens-per-gpu per rank) rank 0 prints
the profiler's per-op table (self CUDA time and CPU time over --reps calls) for the local work alone
and for the CP call, and the GPU-busy fraction of each call's span (the union of kernel intervals on
all streams over the span from the first to the last event of the call), and writes Chrome traces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import sparse_attn
from sparse_attn.parallel import zigzag_llama3_attention, zigzag_llama3_varlen_attention, zigzag_plan
from sparse_attn.parallel.plan import dense_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_run import Timer  # noqa: E402  the CP benchmark's timing: barrier, sync, CUDA-event median


def busy_fraction(prof) -> tuple[float, float]:
    """(GPU-busy ms, span ms) of the kernels the profiler saw: union of intervals / first start to last end."""
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    if not iv:
        return 0.0, 0.0
    busy, cur_s, cur_e = 0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / 1e3, (iv[-1][1] - iv[0][0]) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, world = dist.get_rank(), dist.get_world_size()
    H, Hkv, D, dt = 32, 8, 128, torch.bfloat16
    tokens, L = a.tokens_per_gpu, a.tokens_per_gpu * world
    g = torch.Generator(device="cuda").manual_seed(rank)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    cases = {}
    q, k, v = rnd(1, H, tokens, D), rnd(1, Hkv, tokens, D), rnd(1, Hkv, tokens, D)
    kf, vf = rnd(1, Hkv, L, D), rnd(1, Hkv, L, D)
    plan = dense_plan(L, world, rank)
    cases["dense"] = (plan, q, kf, vf, lambda: zigzag_llama3_attention(q, k, v, causal=True))
    cu = [i * L // 4 for i in range(5)]
    vplan = zigzag_plan(cu, world, rank)
    qp, kp, vp = rnd(tokens, H, D), rnd(tokens, Hkv, D), rnd(tokens, Hkv, D)
    kfp, vfp = rnd(L, Hkv, D), rnd(L, Hkv, D)
    as4 = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    cases["varlen4"] = (vplan, as4(qp), as4(kfp), as4(vfp),
                        lambda: zigzag_llama3_varlen_attention(qp, kp, vp, cu, causal=True))
    timer, summary = Timer(torch.device("cuda")), {}
    for name, (pl, lq, lk, lv, cp) in cases.items():
        groups = pl.groups(True)

        def local():
            for gr in groups:
                sparse_attn.attention(lq[:, :, gr.q_start:gr.q_end], lk[:, :, gr.k_start:gr.k_end],
                                      lv[:, :, gr.k_start:gr.k_end], causal=True)

        for fn_name, fn in (("local", local), ("cp", cp)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                event_ms = timer.median_ms(fn, a.reps, warmup=0, barrier=True)
            busy, span = busy_fraction(prof)
            summary[f"{name}/{fn_name}"] = {"event_ms": event_ms, "busy_ms_total": busy, "span_ms_total": span}
            if rank == 0:
                print(f"\n===== {name} / {fn_name}: event median {event_ms:.3f} ms; kernels "
                      f"busy {busy / a.reps:.3f} ms per call", flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
                prof.export_chrome_trace(str(Path(a.out_dir) / f"trace-{name}-{fn_name}.json"))
    got = [None] * world
    dist.all_gather_object(got, summary)
    if rank == 0:
        Path(a.out_dir, "cp-profile.json").write_text(json.dumps(got, indent=1))
        print(json.dumps(got, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
