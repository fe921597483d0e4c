"""Which calls can be captured in a CUDA graph, and what replaying one saves the host.

    python benchmarks/cuda_graph_probe.py --out $OUT/cuda-graphs.json

Part 1, capture: each case is warmed up eagerly on a side stream (PyTorch's recipe: compiles,
autotuning and layout caches happen there), captured once into a ``torch.cuda.CUDAGraph``, then
replayed on fresh inputs copied into the captured ones; the replay's outputs (and gradients, where the
case runs a backward) are compared with an eager call on the same fresh inputs. A case that fails to
capture records the exception's first line (results/cuda-graphs-h200/ was recorded before varlen
refused capture by name: its varlen rows hold torch's pinned-memory error).

Part 2, host time: the 8-bit sparse call and the bf16 one at the sage-test's benchmark shape (B=4,
H=32, D=128, random top-k 0.5 at q block 64 / k block 128), 1K and 4K tokens: milliseconds a call
over 50 back-to-back eager calls against 50 back-to-back replays, and the GPU time of one call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.bench.results import make_header
from sparse_attn.patterns import from_block_index
from sparse_attn.sage_suite import block_grid, random_block_index, top_k_for
from sparse_attn.testing import attention_runner, capture_graph

DEV = "cuda"


def _randn(*shape, dtype=torch.bfloat16, grad=False):
    t = torch.randn(*shape, device=DEV, dtype=dtype)
    return t.requires_grad_(grad)


def check_case(name, make, fn_of):
    """``make()`` -> list of input tensors; ``fn_of(inputs)`` -> a function returning the tensors to
    compare (outputs, then gradients)."""
    torch.manual_seed(0)
    static = make()
    fn = fn_of(static)
    try:
        g, outs = capture_graph(fn)
    except Exception as e:  # noqa: BLE001 - the point is to record what breaks
        torch.cuda.synchronize()
        return dict(case=name, captured=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                    where=traceback.format_exc().splitlines()[-6:])
    fresh = make()
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    for t in static:
        t.grad = None
    g.replay()
    torch.cuda.synchronize()
    replayed = [o.detach().clone() for o in outs]
    eager = [o.detach().clone() for o in fn_of(fresh)()]
    diffs = [(r.float() - e.float()).abs().max().item() for r, e in zip(replayed, eager)]
    bitwise = all(torch.equal(r, e) for r, e in zip(replayed, eager))
    return dict(case=name, captured=True, bitwise_equal=bitwise, max_abs_diff=diffs)


def cases(L=1024, H=8, HKV=2, D=128):
    rnd = patterns.random(L, density=0.3, heads=H, seed=1, device=DEV)
    win = patterns.local(L, 256, device=DEV)

    def qkv(grad=False, hkv=H):
        return [_randn(2, H, L, D, grad=grad), _randn(2, hkv, L, D, grad=grad), _randn(2, hkv, L, D, grad=grad)]

    fwd = attention_runner

    def fwd_bwd(layout=None, **kw):
        return attention_runner(layout, backward=True, **kw)

    yield "bf16 fwd causal (default layout)", qkv, fwd(causal=True)
    yield "bf16 fwd random 0.3, return_lse", qkv, fwd(rnd, return_lse=True)
    yield "bf16 fwd window 256, GQA 8/2", lambda: qkv(hkv=HKV), fwd(win)
    yield "int8-fp8 fwd random 0.3", qkv, fwd(rnd, quant="int8-fp8")
    yield "int8 fwd causal per_thread", qkv, fwd(causal=True, quant="int8", quant_granularity="per_thread")
    yield "bf16 fwd pv_threshold", qkv, fwd(rnd, pv_threshold=1e-3)
    yield "bf16 fwd adaptive", qkv, fwd("adaptive", causal=True)
    yield "bf16 fwd+bwd random 0.3", lambda: qkv(grad=True), fwd_bwd(rnd)
    yield "bf16 fwd+bwd causal GQA 8/2", lambda: qkv(grad=True, hkv=HKV), fwd_bwd(causal=True)
    yield "int8-fp8 fwd+bwd causal (grad via bf16)", lambda: qkv(grad=True), fwd_bwd(causal=True, quant="int8-fp8")

    lens = [300, 1000, 724]
    cu = torch.tensor([0, 300, 1300, 2024], device=DEV, dtype=torch.int32)

    def packed():
        return [_randn(2024, H, D), _randn(2024, HKV, D), _randn(2024, HKV, D)]

    def varlen(cu_t, **kw):
        def fn_of(t):
            def run():
                return [sparse_attn.varlen_attention(t[0], t[1], t[2], cu_t, cu_t, max(lens), max(lens), causal=True,
                                                     **kw)]
            return run
        return fn_of

    yield "varlen fwd causal, cu_seqlens on the GPU", packed, varlen(cu)
    yield "varlen fwd causal, cu_seqlens on the CPU", packed, varlen(cu.cpu())
    yield "varlen int8-fp8 fwd causal, cu_seqlens on the GPU", packed, varlen(cu, quant="int8-fp8")


def host_times(reps: int = 50) -> list[dict]:
    B, H, D = 4, 32, 128
    rows = []
    for L in (1024, 4096):
        q, k, v = (_randn(B, H, L, D) for _ in range(3))
        nk = block_grid(L)[1]
        layout = from_block_index(random_block_index(B, H, L, top_k_for(0.5, nk), device=DEV), seq_len=L)
        for name, kw in (("int8-fp8", dict(quant="int8-fp8")), ("bf16", {})):
            def fn():
                return [sparse_attn.attention(q, k, v, layout, **kw)]
            g, _ = capture_graph(fn)
            res = {}
            for mode, call in (("eager", fn), ("graph", g.replay)):
                per = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        call()
                    torch.cuda.synchronize()
                    per.append((time.perf_counter() - t0) * 1e3 / reps)
                res[f"{mode}_ms_per_call"] = statistics.median(per)
            # GPU time of one replay: events around a replay queued behind a long sleep
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gpu = []
            for _ in range(9):
                torch.cuda._sleep(2_000_000)
                start.record()
                g.replay()
                end.record()
                torch.cuda.synchronize()
                gpu.append(start.elapsed_time(end))
            res["graph_gpu_ms"] = statistics.median(gpu)
            row = dict(seq_len=L, batch=B, heads=H, head_dim=D, ratio=0.5, call=name, **res)
            print(row, flush=True)
            rows.append(row)
            del g
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--case", type=int, help="run only this case and print its result as JSON (a failed capture "
                                             "can leave the process's CUDA context unusable, so each case runs "
                                             "in its own process)")
    a = ap.parse_args()
    all_cases = list(cases())
    if a.case is not None:
        print("RESULT " + json.dumps(check_case(*all_cases[a.case])), flush=True)
        return
    results = []
    for i, (name, _, _) in enumerate(all_cases):
        p = subprocess.run([sys.executable, __file__, "--case", str(i)], capture_output=True, text=True, timeout=300)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else dict(case=name, captured=False, error=f"exit {p.returncode}",
                                                         where=p.stderr.splitlines()[-8:])
        print(r, flush=True)
        results.append(r)
    timings = host_times()
    Path(a.out).write_text(json.dumps(dict(header=make_header(DEV, "cuda-graph-probe"), capture=results,
                                           host=timings), indent=1))


if __name__ == "__main__":
    main()
