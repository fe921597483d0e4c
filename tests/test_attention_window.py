"""attention(q, k, v, causal=True, window=W): a bottom-right causal sliding window without a layout. Forward-only
CUDA calls run the kernels' device plan (DEVICE_PLAN 3, no layout built); calls with gradients, 8-bit calls and
the CPU run ``patterns.local(Lq, W, kv_len=Lk)``. Under TRITON_INTERPRET=1 (conftest.py) on small fp16 cases for the
kernels; the CPU reference otherwise. The oracle is written from the definition, in fp64."""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import api, patterns, sliding_window

SHAPES = [(1, 300, 100), (130, 300, 1), (257, 130, 64), (200, 200, 129), (3, 129, 1000)]  # (Lq, Lk, window)


def _qkv(lq, lk, seed, dtype=torch.float16, hq=4, hkv=2, d=32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, hq, lq, d, generator=g).to(dtype),
            *(torch.randn(2, hkv, lk, d, generator=g).to(dtype) for _ in range(2)))


def window_oracle(q, k, v, window, num_sink=0):
    """fp64 attention of ``[B, Hq, Lq, D]`` / ``[B, Hkv, Lk, D]`` inputs under ``p - window < j <= p`` or
    ``j < num_sink, j <= p``, p = i + Lk - Lq, as (out, lse); rows without a key give 0 and LSE -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lq, lk = q.shape[2], k.shape[2]
    p = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    allowed = (j <= p) & ((j > p - window) | (j < num_sink))
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    w = torch.where(allowed, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return w @ v, lse


def _oracle(q, k, v, window):
    return window_oracle(q, k, v, window)[0]


def test_the_cpu_call_is_the_window_s_attention():
    for lq, lk, window in SHAPES:
        q, k, v = (t.float() for t in _qkv(lq, lk, lq + lk))
        got = sparse_attn.attention(q, k, v, causal=True, window=window)
        assert torch.allclose(got.double(), _oracle(q, k, v, window), atol=1e-5), (lq, lk, window)
        same = sparse_attn.attention(q, k, v, patterns.local(lq, window, kv_len=lk), causal=True)
        assert torch.equal(got, same), (lq, lk, window)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")
def test_the_kernels_plan_the_window_without_a_layout_and_train_through_patterns_local(monkeypatch):
    """As on CUDA (the kernels interpreted): forward-only calls build no layout and give the bits of the same
    call on patterns.local's layout (the host plan); a call with gradients runs that layout, and its gradients
    match the oracle's."""
    from sparse_attn.ops.block_sparse import attention_op
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    monkeypatch.setattr(api, "_DEFAULT_LAYOUTS", {})
    monkeypatch.setattr(sliding_window, "_WINDOW_LAYOUTS", api.PlanCache(8))
    for lq, lk, window in SHAPES:
        q, k, v = _qkv(lq, lk, 7 * lq + lk)
        got = sparse_attn.attention(q, k, v, causal=True, window=window, return_lse=True)
        assert api._DEFAULT_LAYOUTS == {} and len(sliding_window._WINDOW_LAYOUTS) == 0, (lq, lk, window)
        want = attention_op(q, k, v, patterns.local(lq, window, kv_len=lk), return_lse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lq, lk, window)
        assert torch.allclose(got[0].double(), _oracle(q, k, v, window), atol=2e-3), (lq, lk, window)
    lq, lk, window = 130, 300, 100
    leaves = [t.float().requires_grad_() for t in _qkv(lq, lk, 3)]
    out = sparse_attn.attention(*leaves, causal=True, window=window)
    assert len(sliding_window._WINDOW_LAYOUTS) == 1
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * dout).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    (_oracle(*ref, window) * dout.double()).sum().backward()
    for got_leaf, ref_leaf in zip(leaves, ref):
        assert torch.allclose(got_leaf.grad.double(), ref_leaf.grad, atol=2e-3)


def test_a_window_is_refused_where_it_means_nothing():
    q, k, v = (t.float() for t in _qkv(4, 9, 0))
    with pytest.raises(ValueError, match="causal sliding window .* pass causal=True"):
        sparse_attn.attention(q, k, v, window=4)
    with pytest.raises(ValueError, match="window=4 with layout=: build the window into it"):
        sparse_attn.attention(q, k, v, patterns.causal(4, 9), causal=True, window=4)
    with pytest.raises(ValueError, match="window=4 with layout='adaptive'"):
        sparse_attn.attention(q, k, v, "adaptive", causal=True, window=4)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        sparse_attn.attention(q, k, v, causal=True, window=0)


def test_8_bit_calls_with_a_window_run_patterns_local():
    """quant= runs a layout: with window= it is patterns.local's, for attention and varlen_attention alike (CPU)."""
    q, k, v = _qkv(40, 70, 9)
    layout = patterns.local(40, 24, kv_len=70)
    got = sparse_attn.attention(q, k, v, causal=True, window=24, quant="int8")
    assert torch.equal(got, sparse_attn.attention(q, k, v, layout, causal=True, quant="int8"))
    pq, pk, pv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # one sequence, packed [T, H, D]
    cu_q, cu_k = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32)
    got = sparse_attn.varlen_attention(pq, pk, pv, cu_q, cu_k, 40, 70, causal=True, window=24, quant="int8")
    want = sparse_attn.varlen_attention(pq, pk, pv, cu_q, cu_k, 40, 70, causal=True, quant="int8",
                                        pattern=lambda lq, lk: patterns.local(lq, 24, kv_len=lk))
    assert torch.equal(got, want)
    assert not torch.equal(got, sparse_attn.varlen_attention(pq, pk, pv, cu_q, cu_k, 40, 70, causal=True, quant="int8"))


def test_a_window_call_compiles_once_its_layout_is_built(monkeypatch):
    """On the CPU the call runs patterns.local's layout: torch.compile(fullgraph=True) traces it once an eager
    call at those lengths built it, and refuses by name before that (the layout cannot be built while tracing)."""
    monkeypatch.setattr(sliding_window, "_WINDOW_LAYOUTS", api.PlanCache(8))
    torch._dynamo.reset()
    q, k, v = (t.float() for t in _qkv(40, 56, 11))

    def fn(q, k, v):
        return sparse_attn.attention(q, k, v, causal=True, window=8)

    with pytest.raises(Exception, match=r"attention\(window=8\) .* cannot be traced"):
        torch.compile(fn, fullgraph=True)(q, k, v)
    eager = fn(q, k, v)
    torch._dynamo.reset()
    assert torch.allclose(torch.compile(fn, fullgraph=True)(q, k, v), eager, atol=1e-6)


SINK_SHAPES = [(1, 300, 100, 70), (130, 300, 1, 129), (257, 130, 64, 1), (200, 200, 129, 500)]  # + num_sink


def test_the_cpu_call_with_sinks_is_their_attention():
    """num_sink adds the first keys to every later query's window: patterns.streaming's layout, the oracle."""
    for lq, lk, window, num_sink in SINK_SHAPES:
        q, k, v = (t.float() for t in _qkv(lq, lk, lq + lk + num_sink))
        got = sparse_attn.attention(q, k, v, causal=True, window=window, num_sink=num_sink)
        want = window_oracle(q, k, v, window, num_sink)[0]
        assert torch.allclose(got.double(), want, atol=1e-5), (lq, lk, window, num_sink)
        same = sparse_attn.attention(q, k, v, patterns.streaming(lq, window, num_sink, kv_len=lk), causal=True)
        assert torch.equal(got, same), (lq, lk, window, num_sink)
    q, k, v = (t.float() for t in _qkv(1, 300, 0))
    assert not torch.allclose(sparse_attn.attention(q, k, v, causal=True, window=100, num_sink=70),
                              sparse_attn.attention(q, k, v, causal=True, window=100), atol=1e-2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")
def test_the_kernels_plan_sinks_without_a_layout(monkeypatch):
    """As on CUDA: forward-only calls with sinks build no layout and give the bits of patterns.streaming's host
    plan; return_layout returns the layout the call ran (before, a window call with return_layout ran causal
    attention without the window)."""
    from sparse_attn.ops.block_sparse import attention_op
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    monkeypatch.setattr(api, "_DEFAULT_LAYOUTS", {})
    monkeypatch.setattr(sliding_window, "_WINDOW_LAYOUTS", api.PlanCache(8))
    for lq, lk, window, num_sink in SINK_SHAPES:
        q, k, v = _qkv(lq, lk, 5 * lq + lk)
        got = sparse_attn.attention(q, k, v, causal=True, window=window, num_sink=num_sink, return_lse=True)
        assert api._DEFAULT_LAYOUTS == {} and len(sliding_window._WINDOW_LAYOUTS) == 0
        want = attention_op(q, k, v, patterns.streaming(lq, window, num_sink, kv_len=lk), return_lse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lq, lk, window, num_sink)
    lq, lk, window = 130, 300, 100
    q, k, v = _qkv(lq, lk, 8)
    for num_sink in (0, 70):
        out, layout = sparse_attn.attention(q, k, v, causal=True, window=window, num_sink=num_sink,
                                            return_layout=True)
        want = patterns.streaming(lq, window, num_sink, kv_len=lk)
        assert torch.equal(layout.to_token_mask(), want.to_token_mask())
        assert torch.equal(out, sparse_attn.attention(q, k, v, causal=True, window=window, num_sink=num_sink))


def test_sinks_are_refused_without_a_window():
    q, k, v = (t.float() for t in _qkv(4, 9, 0))
    with pytest.raises(ValueError, match="num_sink=2 are the attention sinks of a sliding window .*: pass window="):
        sparse_attn.attention(q, k, v, causal=True, num_sink=2)
    with pytest.raises(ValueError, match="num_sink must be >= 0, got -3"):
        sparse_attn.attention(q, k, v, causal=True, window=2, num_sink=-3)
