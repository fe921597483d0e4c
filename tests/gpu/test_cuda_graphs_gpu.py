"""CUDA graph capture of the kernels' calls: what replays, bit for bit, and what refuses by name.

Each case follows PyTorch's recipe: a few eager calls on a side stream (kernel compiles, autotuning,
layout caches), one capture, then a replay on fresh inputs copied into the captured ones. The
replay's outputs (and gradients) must equal an eager call on those fresh inputs bitwise: the graph
holds the same launches, so any difference means a launch argument froze at capture time (a host-side
value that should have followed the inputs). Replayed calls cost the host one graph launch: at 1K
tokens (B=4, H=32) the 8-bit call went from 0.73 ms a call eager to 0.175 ms replayed on the H200
(benchmarks/cuda_graph_probe.py, results/cuda-graphs-h200/).
"""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import Group, patterns
from sparse_attn.grouped import groups_from_cu_seqlens
from sparse_attn.ops.block_sparse import launch
from sparse_attn.testing import attention_runner, capture_graph

pytestmark = pytest.mark.gpu
DEV = "cuda"
L, H, HKV, D = 1000, 8, 2, 128  # an odd length: the last block is partial


def _randn(*shape, grad=False, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def _replay_matches_eager(make, fn_of, warmup: int = 3):
    """Capture ``fn_of(inputs)``, replay it on fresh inputs, compare with an eager call on them."""
    static = make()
    graph, outs = capture_graph(fn_of(static), warmup)
    for _ in range(2):  # two replays on two input sets: nothing carried over from the first
        fresh = make()
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        eager = fn_of(fresh)()
        assert len(eager) == len(outs)
        for i, (r, e) in enumerate(zip(outs, eager)):
            assert torch.isfinite(e.float()).all(), f"output {i}: eager result not finite"
            assert torch.equal(r, e), f"output {i}: replay differs from eager by {(r.float() - e.float()).abs().max()}"


def _qkv(hkv=H, grad=False):
    def make():
        return [_randn(2, H, L, D, grad=grad), _randn(2, hkv, L, D, grad=grad), _randn(2, hkv, L, D, grad=grad)]
    return make


FORWARD_CASES = {
    "causal, default layout": dict(causal=True),
    "random 0.3, LSE": dict(layout="random", return_lse=True),
    "window 256, GQA": dict(layout="window", hkv=HKV),
    "int8-fp8, random 0.3": dict(layout="random", quant="int8-fp8"),
    "int8 per_thread, causal": dict(causal=True, quant="int8", quant_granularity="per_thread"),
    "pv_threshold": dict(layout="random", pv_threshold=1e-3),
    "adaptive (predicted per call)": dict(layout="adaptive", causal=True),
}


def _layout(name):
    if name == "random":
        return patterns.random(L, density=0.3, heads=H, seed=1, device=DEV)
    if name == "window":
        return patterns.local(L, 256, device=DEV)
    return name


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_replays_bitwise(case):
    kw = dict(FORWARD_CASES[case])
    layout, hkv = _layout(kw.pop("layout", None)), kw.pop("hkv", H)
    _replay_matches_eager(_qkv(hkv), attention_runner(layout, **kw))


@pytest.mark.parametrize("case", ["random 0.3", "causal, GQA", "int8-fp8 forward, gradient through bf16"])
def test_forward_and_backward_replay_bitwise(case):
    """The backward too: its dQ kernel runs on a side stream forked from and joined into the captured one."""
    if case == "random 0.3":
        _replay_matches_eager(_qkv(grad=True), attention_runner(_layout("random"), backward=True))
    elif case == "causal, GQA":
        _replay_matches_eager(_qkv(HKV, grad=True), attention_runner(causal=True, backward=True))
    else:
        _replay_matches_eager(_qkv(grad=True), attention_runner(causal=True, quant="int8-fp8", backward=True))


def test_gqa_backward_first_seen_inside_a_capture_sorts_its_tiles_there():
    """GQA on random blocks takes its key tiles longest walk first (launch.BWD_TILE_ORDER "auto"), in an
    order cached per layout, but never from inside a capture (a tensor made there holds values only after
    a replay): a prepared layout whose first backward is captured sorts inside the graph, replays
    bitwise, and is cached by the next eager call."""
    from sparse_attn.ops.block_sparse import layout_inputs
    make = _qkv(HKV, grad=True)
    attention_runner(_layout("random"), backward=True)(make())()  # these sizes compiled and tuned
    layout = sparse_attn.prepare(patterns.random(L, density=0.3, heads=H, seed=2, device=DEV))
    t_counts = layout_inputs(layout, True)[6]
    assert launch.longest_walks_first(True, False, False, H, HKV) and t_counts not in launch._TILE_ORDERS
    static = make()
    graph, outs = capture_graph(attention_runner(layout, backward=True)(static), 0)
    assert t_counts not in launch._TILE_ORDERS
    fresh = make()
    with torch.no_grad():
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
    graph.replay()
    eager = attention_runner(layout, backward=True)(fresh)()
    for i, (r, e) in enumerate(zip(outs, eager, strict=True)):
        assert torch.equal(r, e), f"output {i}: replay differs from eager by {(r.float() - e.float()).abs().max()}"
    assert t_counts in launch._TILE_ORDERS


def test_a_layout_first_used_inside_the_capture_needs_prepare():
    """Warm-up on one layout, capture on another of the same sizes (no autotuning: the sizes were
    seen). The second's schedule would be built inside the capture, reading it on the host: a named
    error; after sparse_attn.prepare(layout) it captures and replays bitwise with no warm-up call."""
    make = _qkv()
    attention_runner(patterns.random(L, density=0.3, heads=H, seed=1, device=DEV))(make())()
    fresh_layout = patterns.random(L, density=0.3, heads=H, seed=2, device=DEV)
    q, k, v = make()
    with pytest.raises(RuntimeError, match=r"cannot run inside CUDA graph capture; call sparse_attn.prepare"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            sparse_attn.attention(q, k, v, fresh_layout)
    sparse_attn.prepare(fresh_layout, backward=False)
    _replay_matches_eager(make, attention_runner(fresh_layout), warmup=0)


def test_grouped_attention_replays_bitwise():
    groups = [Group(0, 300, 0, 300), Group(300, 1000, 0, 1000), Group(1000, 1500, 900, 1500)]

    def make():
        return [_randn(1500, H, D), _randn(1500, HKV, D), _randn(1500, HKV, D)]

    def fn_of(t):
        return lambda: [sparse_attn.grouped_attention(t[0], t[1], t[2], groups, causal=True)]
    _replay_matches_eager(make, fn_of)


def test_reduce_overhead_compile_uses_cuda_graphs_and_matches_eager():
    """torch.compile(mode="reduce-overhead") captures the custom op in its CUDA graphs (a graph skipped
    for an unsafe op would count in cudagraph_skips) and replays give eager's outputs."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    layout = sparse_attn.prepare(_layout("random"), backward=False)  # as torch.compile needs anyway

    def f(q, k, v):
        return sparse_attn.attention(q, k, v, layout) * 2

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    make = _qkv()
    for _ in range(4):  # warm-up runs, the recording, then replays
        q, k, v = make()
        out = compiled(q, k, v)
        assert torch.equal(out, f(q, k, v))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_varlen_refuses_capture_by_name_and_leaves_cuda_usable():
    """A varlen call whose plan the host builds (here: one that needs gradients; also layouts, pattern,
    quant) cannot be captured; forward-only dense / causal calls can (tests/gpu/test_device_plan_gpu.py)."""
    lens = [300, 1000, 724]
    cu = torch.tensor([0, 300, 1300, 2024], device=DEV, dtype=torch.int32)
    q, k, v = _randn(2024, H, D, grad=True), _randn(2024, HKV, D), _randn(2024, HKV, D)
    sparse_attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)  # eager: fine
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="varlen_attention cannot run inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            sparse_attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    with pytest.raises(RuntimeError, match="groups_from_cu_seqlens cannot run inside CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            groups_from_cu_seqlens(cu, cu)
    out = sparse_attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def test_first_call_of_new_sizes_inside_capture_refuses_by_name(monkeypatch):
    """With no autotuned pick for the call's sizes (the launch table emptied for this test, after an
    eager call built the layout caches), a call captured without warm-up gets the named error, and
    CUDA stays usable for the eager call after it."""
    q, k, v = _qkv()()
    sparse_attn.attention(q, k, v, causal=True)
    monkeypatch.setattr(launch, "_TUNED", {})
    with pytest.raises(RuntimeError, match="captured in a CUDA graph before it ran at these sizes"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            sparse_attn.attention(q, k, v, causal=True)
    out = sparse_attn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def test_a_default_layout_first_built_inside_the_capture_refuses_by_name():
    """attention() without a layout, for a call that needs gradients, builds its plan per shape on the host and
    copies it asynchronously; inside a capture the replay would re-read a host buffer long reused, so a first
    call of new lengths there gets a named error (the autotuner's picks exist: an eager call of the same
    length class ran), CUDA stays usable, and the same call after an eager one captures and replays bitwise,
    its layout kept past the default layouts' eviction. (Forward-only calls build no layout: the next test.)"""
    from sparse_attn import api
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, 64, device=DEV, dtype=torch.float16) for n in (1, 3001, 3001))
    q.requires_grad_()
    sparse_attn.attention(q, k, v, causal=True)
    k2, v2 = k[:, :, :3000], v[:, :, :3000]
    with pytest.raises(RuntimeError, match="without a layout builds its plan on first use per shape"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            sparse_attn.attention(q, k2, v2, causal=True)
    eager = sparse_attn.attention(q, k2, v2, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = sparse_attn.attention(q, k2, v2, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    for n in range(100, 100 + api.DEFAULT_LAYOUTS_KEPT + 2):  # evict it from the default layouts
        sparse_attn.attention(q, k[:, :, :n], v[:, :, :n], causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_a_forward_only_call_of_new_lengths_captures_without_a_plan():
    """Forward-only, attention() without a layout builds no plan (the kernels' device plan): a decoding call of
    lengths never run eagerly (its short-query kernel has one config: no autotuning; an eager call at other
    lengths compiled it) captures, and replays bitwise what the eager call gives, on fresh inputs too."""
    from sparse_attn import api
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, H, n, 64, device=DEV, dtype=torch.float16) for n in (1, 2777, 2777))
    sparse_attn.attention(q, k[:, :, :2000], v[:, :, :2000], causal=True)
    assert not any(key[1:3] == (1, 2777) for key in api._DEFAULT_LAYOUTS)
    graph, out = capture_graph(lambda: sparse_attn.attention(q, k, v, causal=True), warmup=0)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sparse_attn.attention(q, k, v, causal=True))
