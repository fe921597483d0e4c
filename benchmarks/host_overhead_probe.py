"""Host time per call: what an eager caller (a decoder, a small prefill) pays on the CPU before the GPU
has anything to do. Where a call's kernels take tens of microseconds, the host is the step's bound.

    python benchmarks/host_overhead_probe.py --out $OUT/host.json [--profile $OUT/host-profile.txt]

Cases (32 query heads, head dim 128, bf16, no grad):
- ``decode``: attention(q [1, 32, 1, D], K/V cache [1, 8, 32768, D], causal=True);
- ``decode-growing``: ``decode`` with the cache one token longer each call, as a decoder calls it (a
  view of a preallocated cache; every call a new shape, so no plan is reused); ``decode-growing-4-layers``: one
  token longer every 4 calls, as a 4-layer model's step calls it (read the A/B rows' mean: the median is one
  kind of call of the four);
- ``decode-local``: the same with a prepared local-4096 layout;
- ``prefill-1k``: attention(q, k, v [1, 32, 1024, D], causal=True) (``-grad``: inputs require grad);
- ``varlen-decode``: varlen_attention of 8 sequences x 1 query row, caches 1K-32K, causal (the same
  lengths every call, so the plan is cached: the call's own cost); ``varlen-decode-growing``: the same
  with every cache one token longer each call (continuous batching); ``-host-offsets``: both with
  ``cu_seqlens`` given on the CPU (no sync to read them);
- ``padded-decode``: one layer's decoding step of a left-padded batch as the transformers integration runs it
  (``integrations._unpad.in_place``: 8 rows, real lengths 513-4097 in a 4097-key cache, the batch's Packing found
  once a forward and shared by its layers, so built once here); ``sdpa-padded-decode`` what transformers' sdpa does
  there (K/V repeated for the grouped heads, a bool mask);
- ``sdpa-decode`` / ``sdpa-prefill-1k``: torch's scaled_dot_product_attention on the same inputs.
Per case: ``host_us``, the host clock around each call (median of CALLS, after WARMUP calls; the stream
is synchronized every 50 calls so the launch queue never fills, which would make the host wait);
``wall_us``, CALLS calls back to back synchronized at the end (max of host and GPU time a call);
``gpu_us``, the same call graph-captured where it can be (the kernels alone). ``--profile`` writes
cProfile's top functions (by own time and by cumulative time) over PROFILE_CALLS calls of each of our
cases. ``decode-no-launch``: ``decode`` with Triton's launches made no-ops (our own Python; since
ops.fast_launch keeps no kernel from a no-op launch, there it also pays the launch key every call);
``decode-launch.forward``: launch.forward on ``decode``'s prepared arguments (no API, no autograd).
``--ab-replay``: each case's host_us with ops.block_sparse.replay off and on, alternated in one process.
Also ``launch-empty`` / ``launch-empty-1-arg``: Triton kernels with 30 arguments / 1 and no work,
Triton's own launch cost.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import sparse_attn
from sparse_attn import api, patterns
from sparse_attn.ops.block_sparse import launch, layout_inputs
from sparse_attn.bench.results import make_header
from sparse_attn.testing import capture_graph

H, HKV, D = 32, 8, 128
CALLS, WARMUP, PROFILE_CALLS = 400, 20, 300
GROW_STEPS = 2048  # decode-growing cycles through this many cache lengths (more than DEFAULT_LAYOUTS_KEPT)


@triton.jit
def _empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                  a20, a21, a22, a23, a24, a25, a26, a27, C0: tl.constexpr, C1: tl.constexpr):
    pass


@triton.jit
def _empty_kernel_1(a0):
    pass


def _cases():
    """name -> zero-argument callable (inputs made once)."""
    dev, dt = "cuda", torch.bfloat16
    qd = torch.randn(1, H, 1, D, device=dev, dtype=dt)
    kd, vd = (torch.randn(1, HKV, 32768, D, device=dev, dtype=dt) for _ in range(2))
    local = sparse_attn.prepare(patterns.local(1, 4096, kv_len=32768, device=dev), backward=False)
    qp, kp, vp = (torch.randn(1, H, 1024, D, device=dev, dtype=dt) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (qp, kp, vp))
    k_lens = [1024 + i * (32768 - 1024) // 7 for i in range(8)]
    cu_q = torch.arange(9, dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    qv = torch.randn(8, H, D, device=dev, dtype=dt)
    kv_, vv = (torch.randn(sum(k_lens), HKV, D, device=dev, dtype=dt) for _ in range(2))
    ptrs = [torch.empty(1, device=dev) for _ in range(14)]
    decode = lambda: sparse_attn.attention(qd, kd, vd, causal=True)  # noqa: E731
    cache_k, cache_v = (torch.randn(1, HKV, 32768 + GROW_STEPS, D, device=dev, dtype=dt) for _ in range(2))
    step = [0]

    def decode_growing():  # a decoder's cache, one token longer each call
        step[0] = step[0] % GROW_STEPS + 1
        n = 32768 + step[0]
        return sparse_attn.attention(qd, cache_k[:, :, :n], cache_v[:, :, :n], causal=True)
    layer = [0]

    def decode_growing_layers():  # the same cache read by a 4-layer model: one token longer every 4 calls
        layer[0] = (layer[0] + 1) % 4
        n = 32768 + step[0] % GROW_STEPS + 1
        if layer[0] == 0:
            step[0] = step[0] % GROW_STEPS + 1
        return sparse_attn.attention(qd, cache_k[:, :, :n], cache_v[:, :, :n], causal=True)
    # continuous batching: the 8 caches of varlen-decode, each a token longer every call (cu_seqlens made
    # in advance: a server builds them every step too, but that copy is not ours)
    kv_grow, vv_grow = (torch.randn(sum(k_lens) + 8 * GROW_STEPS, HKV, D, device=dev, dtype=dt) for _ in range(2))
    cu_grow = [torch.tensor([0] + torch.tensor([n + s for n in k_lens]).cumsum(0).tolist(), dtype=torch.int32,
                            device=dev) for s in range(GROW_STEPS + 1)]
    cu_grow_host = [cu.cpu() for cu in cu_grow]  # the -host-offsets cases: cu_seqlens given on the CPU
    cu_q_host, cu_k_host = cu_q.cpu(), cu_k.cpu()
    vstep = [0]

    def varlen_growing(host: bool = False):
        vstep[0] = s = vstep[0] % GROW_STEPS + 1
        t = sum(k_lens) + 8 * s
        cus = (cu_q_host, cu_grow_host[s]) if host else (cu_q, cu_grow[s])
        return sparse_attn.varlen_attention(qv, kv_grow[:t], vv_grow[:t], *cus, 1, max(k_lens) + s, causal=True)
    layout = api._kernel_layout(None, True, 1, 32768, qd.device)
    rows = layout_inputs(layout, False)
    fwd_args = (qd, kd, vd, *rows[:6], *rows[-2:], None, None, 128, 128, D ** -0.5, 1, 32768)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    padded = _padded_decode(dev, dt)
    return {
        "padded-decode": padded["ours"],
        "sdpa-padded-decode": padded["sdpa"],
        "decode": decode,
        "decode-growing": decode_growing,
        "decode-growing-4-layers": decode_growing_layers,
        "decode-no-launch": lambda: _launches_skipped(decode),
        "decode-launch.forward": lambda: launch.forward(*fwd_args),
        "decode-local": lambda: sparse_attn.attention(qd, kd, vd, local),
        "prefill-1k": lambda: sparse_attn.attention(qp, kp, vp, causal=True),
        "prefill-1k-grad": lambda: sparse_attn.attention(qg, kg, vg, causal=True),
        "varlen-decode": lambda: sparse_attn.varlen_attention(qv, kv_, vv, cu_q, cu_k, 1, max(k_lens), causal=True),
        "varlen-decode-growing": varlen_growing,
        "varlen-decode-host-offsets": lambda: sparse_attn.varlen_attention(qv, kv_, vv, cu_q_host, cu_k_host, 1,
                                                                           max(k_lens), causal=True),
        "varlen-decode-growing-host-offsets": lambda: varlen_growing(host=True),
        "sdpa-decode": lambda: sdpa(qd, kd, vd, enable_gqa=True),
        "sdpa-prefill-1k": lambda: sdpa(qp, kp, vp, is_causal=True),
        "launch-empty": lambda: _empty_kernel[(1,)](*ptrs, *range(14), C0=1, C1=2),
        "launch-empty-1-arg": lambda: _empty_kernel_1[(1,)](ptrs[0]),
    }


def _padded_decode(dev, dt) -> dict:
    """The padded-decode cases' calls (see the module docstring)."""
    from sparse_attn.integrations import _unpad
    lengths = [4096, 3500, 3000, 2500, 2000, 1500, 1000, 512]
    lk = max(lengths) + 1  # the prompts and one generated token
    mask = torch.zeros(len(lengths), lk, dtype=torch.bool, device=dev)
    for row, n in enumerate(lengths):
        mask[row, lk - n - 1:] = True  # left padding
    packing = _unpad.from_padding(mask, 1)
    q = torch.randn(len(lengths), H, 1, D, device=dev, dtype=dt)
    k, v = (torch.randn(len(lengths), HKV, lk, D, device=dev, dtype=dt) for _ in range(2))
    sdpa_mask = mask[:, None, None, :]

    def sdpa_layer():  # transformers' sdpa_attention_forward with a mask: repeat_kv, then SDPA
        kr, vr = (t[:, :, None].expand(-1, -1, H // HKV, -1, -1).reshape(len(lengths), H, lk, D) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=sdpa_mask).transpose(1, 2)
    return {"ours": lambda: _unpad.in_place(packing, q, k, v, causal=True), "sdpa": sdpa_layer}


def _launches_skipped(fn):
    """``fn`` with every Triton launch a no-op (JITFunction.run): the host time of our own Python."""
    saved = JITFunction.run
    JITFunction.run = lambda self, *args, **kw: None
    try:
        return fn()
    finally:
        JITFunction.run = saved


def host_us(fn) -> float:
    return statistics.median(host_times(fn)) * 1e6


def host_times(fn, calls: int = CALLS) -> list[float]:
    """Seconds of host time of each of ``calls`` calls (the stream synchronized every 50: the queue never fills)."""
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return times


def wall_us(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / CALLS * 1e6


def gpu_us(fn) -> float | str:
    try:
        graph, _ = capture_graph(fn)
    except Exception as e:  # varlen plans on the host and refuses capture
        return f"not captured: {type(e).__name__}"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1e3


def profile_text(fn, name: str) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE_CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"==== {name}: {PROFILE_CALLS} calls, by own time\n")
    stats.sort_stats("tottime").print_stats(25)
    out.write(f"==== {name}: by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def _replay_ab(name: str, fn, rounds: int = 3) -> dict:
    """host_us of ``fn`` with replays off and on, alternated, ``rounds`` times each (one process, one host state)."""
    from sparse_attn.ops.block_sparse import replay
    times: dict = {"off": [], "on": []}
    means: dict = {"off": [], "on": []}
    for _ in range(rounds):
        for state in ("off", "on"):
            replay.ENABLED = state == "on"
            for _ in range(WARMUP):
                fn()
            calls = host_times(fn)
            times[state].append(round(statistics.median(calls) * 1e6, 2))
            means[state].append(round(statistics.mean(calls) * 1e6, 2))
    replay.ENABLED = True
    # the mean as well: where calls differ by kind (a 4-layer step's recording and replays) the median is one kind's
    return {"case": name, "host_us_replay_off": times["off"], "host_us_replay_on": times["on"],
            "median_off": statistics.median(times["off"]), "median_on": statistics.median(times["on"]),
            "mean_us_replay_off": means["off"], "mean_us_replay_on": means["on"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile")
    ap.add_argument("--cases", nargs="+")
    ap.add_argument("--ab-replay", action="store_true",
                    help="time each case with ops.block_sparse.replay off and on, alternated in ROUNDS rounds")
    a = ap.parse_args()
    cases = _cases()
    rows, texts = [], []
    for name in a.cases or list(cases):
        fn = cases[name]
        # the growing cases warm up over all their lengths: each class of key length (16 divides it or not)
        # and of block count compiles its own kernel variant once, which a timed call must not include
        for _ in range(GROW_STEPS if "growing" in name else WARMUP):
            fn()
        torch.cuda.synchronize()
        if a.ab_replay:
            rows.append(_replay_ab(name, fn))
            print(json.dumps(rows[-1]), flush=True)
            continue
        row = {"case": name, "host_us": host_us(fn), "wall_us": wall_us(fn),
               "gpu_us": None if "no-launch" in name else gpu_us(fn)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if a.profile and not name.startswith(("sdpa", "launch")):
            texts.append(profile_text(fn, name))
    Path(a.out).write_text(json.dumps({"header": make_header("cuda", "host-overhead"), "rows": rows}, indent=1))
    if a.profile:
        Path(a.profile).write_text("\n".join(texts))


if __name__ == "__main__":
    main()
