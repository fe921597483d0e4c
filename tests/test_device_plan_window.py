"""varlen_attention(..., causal=True, window=W[, num_sink=S]): a bottom-right causal sliding window per sequence,
with attention sinks or not. Forward-only CUDA calls plan it in the kernel (DEVICE_PLAN 3,
kernels._device_window_row); the rest run the host's plan of ``patterns.local`` (``patterns.streaming``) layouts.
Under TRITON_INTERPRET=1 (conftest.py) on small fp16 cases: the kernel's plan must give the host plan's bits, both
must be the window's attention (an fp64 oracle written from the definition), and a call with the window must be
refused where it has no meaning."""
from __future__ import annotations

import os
import random

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, varlen
from sparse_attn.ops.block_sparse import launch, varlen_attention_op, varlen_device_plan_op
from test_attention_window import window_oracle
from test_device_plan import _cu, _packed

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests run only without a GPU")


def _host_plan(q, k, v, q_lens, k_lens, window, max_q, max_k, num_sink=0):
    """The same call on the host's plan of patterns.local (patterns.streaming) layouts (what a call with gradients
    runs)."""
    build = ((lambda lq, lk: patterns.streaming(lq, window, num_sink, kv_len=lk)) if num_sink else
             (lambda lq, lk: patterns.local(lq, window, kv_len=lk)))
    per_seq = varlen.build_layouts(q_lens, k_lens, None, build, True)
    stacked = varlen.stack(per_seq, max_q, max_k, q.shape[1])
    return varlen_attention_op(q, k, v, stacked, _cu(q_lens), _cu(k_lens), max_q, max_k, tuple(k_lens),
                               return_lse=True)


def _oracle(q, k, v, q_lens, k_lens, window, num_sink=0):
    """test_attention_window's fp64 oracle on each packed sequence alone: (out [Tq, Hq, D], lse [Hq, Tq])."""
    outs, lses = [], []
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    for i in range(len(q_lens)):
        qs, ks, vs = (t[c[i]:c[i + 1]].transpose(0, 1)[None] for t, c in ((q, cq), (k, ck), (v, ck)))
        out, lse = window_oracle(qs, ks, vs, window, num_sink)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, -1)


def _cases(rnd: random.Random, trials: int):
    """Random batches over the window row's cases: windows shorter than, equal to and longer than a block,
    one key, longer than the sequence; empty sequences; more queries than keys; cut last blocks; several
    query blocks; max_seqlen above the longest sequence. First a fixed batch whose rows have masked blocks on
    both sides of their unmasked run (sequence 0, query block 0: blocks 3-4 masked, 5 unmasked, 6-7 masked)."""
    yield -1, [130, 1], [900, 700], 300, 130, 900
    for trial in range(trials):
        n_seqs = rnd.randint(1, 3)
        q_lens = [rnd.choice([0, 1, 2, 17, 128, 130, 260]) for _ in range(n_seqs)]
        k_lens = [rnd.choice([0, 1, 5, 127, 128, 129, 300, 520, 900]) for _ in range(n_seqs)]
        window = rnd.choice([1, 2, 100, 127, 128, 129, 200, 256, 383, 1000])
        yield trial, q_lens, k_lens, window, max(q_lens) + rnd.choice([0, 5]), max(k_lens) + rnd.choice([0, 9])


def test_the_window_device_plan_gives_the_host_plan_s_bits(monkeypatch):
    """Unsplit rows (the host plan's split count follows its own longest row, so splits could differ):
    the same blocks in the same order with the same masks as patterns.local's host plan, bit for bit."""
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "1")
    for trial, q_lens, k_lens, window, max_q, max_k in _cases(random.Random(0), 12):
        q, k, v = _packed(q_lens, k_lens, 100 + trial)
        got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, True, return_lse=True,
                                    window=window)
        want = _host_plan(q, k, v, q_lens, k_lens, window, max_q, max_k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (q_lens, k_lens, window)


def test_the_window_is_the_definition_s_attention_split_or_not(monkeypatch):
    """Against the fp64 oracle, with the key walk unsplit and split in 3 parts (decoding's split-KV path,
    whose parts may get no tile of a short window): a wrong edge, slot or block shows here even where the
    host plan would share the error."""
    for split in ("1", "3"):
        monkeypatch.setattr(launch, "FWD_KV_SPLIT", split)
        for trial, q_lens, k_lens, window, max_q, max_k in _cases(random.Random(1), 6):
            q, k, v = _packed(q_lens, k_lens, 50 + trial)
            out, lse = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, True, return_lse=True,
                                             window=window)
            want, want_lse = _oracle(q, k, v, q_lens, k_lens, window)
            assert torch.allclose(out.double(), want, atol=2e-3), (split, q_lens, k_lens, window)
            finite = torch.isfinite(want_lse)
            assert torch.equal(finite, torch.isfinite(lse)), (split, q_lens, k_lens, window)
            assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-3), (split, q_lens, k_lens, window)


def _check_every_path(monkeypatch, q_lens, k_lens, window, num_sink, seed, grad_seed):
    """The public call on the CPU (reference on the host's layouts per sequence), as on CUDA forward-only on the
    kernels' device plan (no plan built), and with gradients (the host plan; gradients against the oracle's)."""
    q, k, v = _packed(q_lens, k_lens, seed)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    want, want_lse = _oracle(q, k, v, q_lens, k_lens, window, num_sink)
    call = lambda q, k, v, **kw: sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),  # noqa: E731
                                                              causal=True, window=window, num_sink=num_sink, **kw)
    out, lse = call(q.float(), k.float(), v.float(), return_lse=True)
    assert torch.allclose(out.double(), want, atol=1e-4) and torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    from sparse_attn import api
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    monkeypatch.setattr(api, "_plans_on_host", lambda device: True)
    monkeypatch.setattr(api, "_VARLEN_PLANS", api.PlanCache(16))
    assert torch.allclose(call(q, k, v).double(), want, atol=2e-3)
    assert len(api._VARLEN_PLANS) == 0  # planned in the kernel
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = call(*leaves)
    assert len(api._VARLEN_PLANS) == 1  # the host's plan, which the backward reads
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    (out * dout).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    (_oracle(*ref_leaves, q_lens, k_lens, window, num_sink)[0] * dout.double()).sum().backward()
    for got_leaf, ref_leaf in zip(leaves, ref_leaves):
        assert torch.allclose(got_leaf.grad.double(), ref_leaf.grad, atol=2e-3)


def test_varlen_attention_s_window_on_every_path(monkeypatch):
    """The public call: on the CPU (reference, patterns.local per sequence), with gradients (the host plan;
    the gradients against the oracle's) and, as on CUDA, forward-only on the kernels' device plan."""
    _check_every_path(monkeypatch, [3, 130, 0], [300, 130, 4], 100, 0, seed=5, grad_seed=3)


def test_a_window_is_refused_where_it_means_nothing():
    q, k, v = _packed([2], [9], 0)
    cu_q, cu_k = _cu([2]), _cu([9])
    call = lambda **kw: sparse_attn.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 2, 9, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="causal sliding window .* pass causal=True"):
        call(window=4)
    with pytest.raises(ValueError, match="window=4 with pattern=: build the window into them"):
        call(window=4, causal=True, pattern=lambda lq, lk: patterns.causal(lq, lk))
    with pytest.raises(ValueError, match="window=4 with layouts="):
        call(window=4, causal=True, layouts=[patterns.causal(2, 9)])
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        call(window=0, causal=True)
    with pytest.raises(TypeError, match="window must be an int"):
        call(window=True, causal=True)
    with pytest.raises(ValueError, match="a causal window of at least one key"):
        launch.forward(q, k, v, cu_q, None, None, None, None, True, None, 0, cu_q, cu_k, 128, 128, 0.1, 2, 9,
                       device_plan=3)


def _sink_cases(rnd: random.Random, trials: int):
    """(trial, q_lens, k_lens, window, num_sink, max_q, max_k): fixed batches first, over the row's shapes with
    sinks: (1) masked blocks in all three places, before the sinks' end, between the sinks and the window's
    unmasked run and after it (sequence 0, query block 0: blocks 0 and 5 unmasked, 1, 3-4 and 6-7 masked);
    (2) the sinks' blocks touching the window's (one kept run); (3) the sinks reaching the last row's window
    (every causal block unmasked); (4) more sinks than keys, and sinks of one key; (5) a block unmasked only by
    the sinks and the window together; then random batches."""
    yield -1, [130, 1], [900, 700], 300, 200, 130, 900
    yield -2, [128, 40], [228, 300], 100, 64, 128, 300
    yield -3, [130, 7], [900, 130], 400, 600, 130, 900
    yield -4, [260, 5], [300, 129], 10, 1000, 260, 300
    yield -5, [130, 130], [700, 520], 1, 1, 130, 700
    yield -6, [130], [900], 840, 100, 130, 900  # block 0 unmasked by sinks (keys < 100) and window (>= 60) together
    for trial in range(trials):
        n_seqs = rnd.randint(1, 3)
        q_lens = [rnd.choice([0, 1, 17, 128, 130, 260]) for _ in range(n_seqs)]
        k_lens = [rnd.choice([0, 1, 127, 129, 300, 520, 900]) for _ in range(n_seqs)]
        window = rnd.choice([1, 100, 128, 129, 256, 383])
        num_sink = rnd.choice([1, 4, 127, 128, 129, 200, 256, 600])
        max_q, max_k = max(q_lens) + rnd.choice([0, 5]), max(k_lens) + rnd.choice([0, 9])
        yield trial, q_lens, k_lens, window, num_sink, max_q, max_k


def test_the_sink_device_plan_gives_the_host_plan_s_bits(monkeypatch):
    """With sinks the kept blocks are up to two runs and the unmasked ones too: the kernel's slots must still
    hold patterns.streaming's host plan's blocks in its order, bit for bit (unsplit, as above)."""
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "1")
    for trial, q_lens, k_lens, window, num_sink, max_q, max_k in _sink_cases(random.Random(2), 10):
        q, k, v = _packed(q_lens, k_lens, 200 + trial)
        got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, True, return_lse=True,
                                    window=window, num_sink=num_sink)
        want = _host_plan(q, k, v, q_lens, k_lens, window, max_q, max_k, num_sink)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (q_lens, k_lens, window, num_sink)


def test_the_sinks_are_the_definition_s_attention_split_or_not(monkeypatch):
    """Against the fp64 oracle with sinks, unsplit and split in 3 parts."""
    for split in ("1", "3"):
        monkeypatch.setattr(launch, "FWD_KV_SPLIT", split)
        for trial, q_lens, k_lens, window, num_sink, max_q, max_k in _sink_cases(random.Random(3), 4):
            q, k, v = _packed(q_lens, k_lens, 70 + trial)
            out, lse = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, True, return_lse=True,
                                             window=window, num_sink=num_sink)
            want, want_lse = _oracle(q, k, v, q_lens, k_lens, window, num_sink)
            case = (split, q_lens, k_lens, window, num_sink)
            assert torch.allclose(out.double(), want, atol=2e-3), case
            finite = torch.isfinite(want_lse)
            assert torch.equal(finite, torch.isfinite(lse)), case
            assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-3), case


def test_varlen_attention_s_sinks_on_every_path(monkeypatch):
    """The public call with num_sink: the CPU (patterns.streaming per sequence), gradients (the host plan) and the
    kernels' device plan, each against the oracle; the sinks change the result."""
    q_lens, k_lens, window, num_sink = [3, 130, 0], [300, 260, 4], 100, 70
    q, k, v = _packed(q_lens, k_lens, 6)
    assert not torch.allclose(_oracle(q, k, v, q_lens, k_lens, window, num_sink)[0],
                              _oracle(q, k, v, q_lens, k_lens, window)[0], atol=1e-2)
    _check_every_path(monkeypatch, q_lens, k_lens, window, num_sink, seed=6, grad_seed=4)


def test_sinks_are_refused_without_a_window():
    q, k, v = _packed([2], [9], 0)
    cu_q, cu_k = _cu([2]), _cu([9])
    call = lambda **kw: sparse_attn.varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 2, 9, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="num_sink=4 are the attention sinks of a sliding window .*: pass window="):
        call(num_sink=4, causal=True)
    with pytest.raises(ValueError, match="num_sink must be >= 0, got -1"):
        call(num_sink=-1, window=3, causal=True)
    with pytest.raises(TypeError, match="num_sink must be an int"):
        call(num_sink=True, window=3, causal=True)
    with pytest.raises(ValueError, match="sinks=5"):
        launch.forward(q, k, v, cu_q, None, None, None, None, True, None, 0, cu_q, cu_k, 128, 128, 0.1, 2, 9,
                       device_plan=2, sinks=5)
