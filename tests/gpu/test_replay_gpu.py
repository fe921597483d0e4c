"""Replayed decoding launches (ops.block_sparse.replay) on the GPU: calls of one geometry after the recorded one (the
first, or the second where the first was its kernels' first launch) are launched from the recording with Triton's
kept kernels, and give the bits of the path they skip; fresh random
inputs each call, outputs NaN-poisoned memory first, one case held against the fp64 oracle (DESIGN.md rule 3)."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.integrations import _unpad
from sparse_attn.ops.block_sparse import replay
from sparse_attn.testing import (
    assert_close_to_oracle,
    capture_graph,
    count_forward_paths,
    count_op_calls,
    oracle_attention,
    reference_attention,
    without_replays,
)

pytestmark = pytest.mark.gpu


def _randn(g, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def _padded(g, lengths, h, hkv, d, stopped=None):
    """A left-padded decoding step as the transformers integration runs it: (packing, q, k, v); row ``stopped``'s
    newest slot is padding (a row that has stopped), so its query is free."""
    lk = max(lengths) + 1
    mask = torch.zeros(len(lengths), lk, dtype=torch.bool, device="cuda")
    for row, n in enumerate(lengths):
        mask[row, lk - n - 1:] = True
    if stopped is not None:
        mask[stopped, -1] = False
    return (_unpad.from_padding(mask, 1), _randn(g, len(lengths), h, 1, d), _randn(g, len(lengths), hkv, lk, d),
            _randn(g, len(lengths), hkv, lk, d))


def _cases():
    """name -> (inputs maker taking a generator, call on them)."""
    k_lens = [40, 3000, 700, 12001]
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_q = torch.arange(len(k_lens) + 1, dtype=torch.int32, device="cuda")
    local = sparse_attn.prepare(patterns.local(1, 4096, kv_len=20000, device="cuda"), backward=False)
    return {
        "decode GQA 32K": (lambda g: (_randn(g, 1, 32, 1, 128), _randn(g, 1, 8, 32768 + 77, 128),
                                      _randn(g, 1, 8, 32768 + 77, 128)),
                           lambda q, k, v: sparse_attn.attention(q, k, v, causal=True, return_lse=True)),
        "decode MHA d64, 4 rows": (lambda g: (_randn(g, 3, 8, 4, 64, dtype=torch.float16),
                                              _randn(g, 3, 8, 999, 64, dtype=torch.float16),
                                              _randn(g, 3, 8, 999, 64, dtype=torch.float16)),
                                   lambda q, k, v: sparse_attn.attention(q, k, v, causal=True, return_lse=True)),
        "local layout": (lambda g: (_randn(g, 1, 16, 1, 128), _randn(g, 1, 4, 20000, 128),
                                    _randn(g, 1, 4, 20000, 128)),
                         lambda q, k, v: sparse_attn.attention(q, k, v, local, return_lse=True)),
        "varlen decode": (lambda g: (_randn(g, len(k_lens), 32, 128), _randn(g, sum(k_lens), 8, 128),
                                     _randn(g, sum(k_lens), 8, 128)),
                          lambda q, k, v: sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 1, max(k_lens),
                                                                       causal=True, return_lse=True)),
        "padded step in place": (lambda g: _padded(g, [4096, 3500, 1000, 512, 2], 32, 8, 128),
                                 lambda p, q, k, v: (_unpad.in_place(p, q, k, v, causal=True),)),
        "padded step in place, streaming": (lambda g: _padded(g, [5000, 300, 2000], 16, 16, 128),
                                            lambda p, q, k, v: (_unpad.in_place(p, q, k, v, causal=True, window=1024,
                                                                                num_sink=64),)),
    }


def _poison():
    """NaN in the caching allocator's free blocks of the sizes these calls allocate (its small and large pools), so
    that an output a kernel fails to write shows."""
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)]
    del junk


@pytest.mark.parametrize("name", ["decode GQA 32K", "decode MHA d64, 4 rows", "local layout", "varlen decode",
                                  "padded step in place", "padded step in place, streaming"])
def test_replayed_decoding_calls_give_the_bits_of_the_path(monkeypatch, name):
    make, call = _cases()[name]
    replay.clear()
    calls = count_forward_paths(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(11)
    replayed_at = []
    for i in range(5):
        inputs = make(g)
        _poison()
        before = calls["path"]
        got = call(*inputs)
        replayed = calls["path"] == before
        _poison()
        want = without_replays(lambda: call(*inputs))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, i)
        replayed_at.append(replayed)
    # the first call recorded or (its kernels' first launch) left for the second; every call after the recording
    assert replayed_at in ([False, True, True, True, True], [False, False, True, True, True]), (name, replayed_at)
    assert any(isinstance(r, replay.Recipe) for r in replay._kept.values())
    replay.clear()


def test_a_growing_cache_replays_from_each_step_s_second_layer(monkeypatch):
    """A dynamic cache, one key longer each step, is a new geometry each step: where its recipe does not derive from
    the previous length's (stubbed here: test_a_growing_cache_derives_each_new_length), recorded at the step's first
    layer, replayed by the second (bits of the path); with one layer a step, past replay.MISS_STREAK steps, recorded
    at a geometry's second call only, which never comes (every call takes the path, with its bits). The kernels are
    launched once beforehand: a kernel's first launch goes through Triton and leaves the recording to the next call."""
    from sparse_attn.ops.block_sparse import launch
    monkeypatch.setattr(launch, "derive_for_length", lambda *a, **kw: None)
    g = torch.Generator(device="cuda").manual_seed(15)
    k_all, v_all = _randn(g, 2, 8, 6000, 128), _randn(g, 2, 8, 6000, 128)
    steps = [(layers, step, 5000 + step + 40 * layers) for layers in (2, 1) for step in range(replay.MISS_STREAK + 4)]
    q = _randn(g, 2, 32, 1, 128)

    def attend(q, n):
        return sparse_attn.attention(q, k_all[:, :, :n], v_all[:, :, :n], causal=True, return_lse=True)
    for _, _, n in steps:  # every kernel variant launched once (a length 16 divides or not is one), so kept
        without_replays(lambda: attend(q, n))
    replay.clear()
    calls = count_forward_paths(monkeypatch)
    for layers, step, n in steps:
        for layer in range(layers):
            q = _randn(g, 2, 32, 1, 128)
            before = calls["path"]
            got = attend(q, n)
            replayed = calls["path"] == before
            want = without_replays(lambda: attend(q, n))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (layers, step, layer)
            assert replayed == (layer == 1), (layers, step, layer)
    replay.clear()


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=1000, num_sink=64, return_lse=True),
                                dict(causal=True, dtype=torch.float16, d=64)])
def test_a_growing_cache_derives_each_new_length(monkeypatch, kw):
    """One call a step, fresh contiguous K/V one token longer each step (as a cache's torch.cat makes them), across a
    length 16 divides (2944) and a change of the split-KV count (2945: 23 -> 24 key blocks, 2 -> 3 parts for 8 packed
    kv heads on 132 SMs; a window's rows keep their count): each new length's call is served by the entry with a
    recipe derived from the previous length's (ops.block_sparse.entry._derive), except the first, the first of the
    other specialization class and the split step; every result has the path's bits, on poisoned memory."""
    from sparse_attn.ops.block_sparse import entry
    kw = dict(kw)
    dtype, d = kw.pop("dtype", torch.bfloat16), kw.pop("d", 128)
    replay.clear()
    entry.clear()
    ops = count_op_calls(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(17)
    path = []
    for n in range(2936, 2956):
        q, k, v = _randn(g, 1, 32, 1, d, dtype=dtype), _randn(g, 1, 8, n, d, dtype=dtype), _randn(g, 1, 8, n, d,
                                                                                                    dtype=dtype)
        _poison()
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, **kw)
        if ops["n"] != before:
            path.append(n)
        _poison()
        want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))  # noqa: B023 -- called at once
        got, want = (got, want) if kw.get("return_lse") else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (kw, n)
    split_step = [] if "window" in kw else [2945]
    assert {2936, 2944, *split_step} <= set(path) <= {2936, 2937, 2944, 2945}, path
    replay.clear()
    entry.clear()


def test_a_replayed_decoding_step_meets_the_oracle():
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = _randn(g, 2, 16, 1, 128), _randn(g, 2, 4, 5000, 128), _randn(g, 2, 4, 5000, 128)
    replay.clear()
    for _ in range(3):
        out = sparse_attn.attention(q, k, v, causal=True)
    assert any(isinstance(r, replay.Recipe) for r in replay._kept.values())
    assert_close_to_oracle(out, reference_attention(q, k, v, causal=True), oracle_attention(q, k, v, causal=True))


def test_a_replayed_call_captures_in_a_cuda_graph():
    """Captured after its warm-up has recorded it, the call's graph replays the kept kernels on new inputs."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = _randn(g, 1, 32, 1, 128), _randn(g, 1, 8, 9000, 128), _randn(g, 1, 8, 9000, 128)
    replay.clear()
    graph, (out, lse) = capture_graph(lambda: sparse_attn.attention(q, k, v, causal=True, return_lse=True))
    for seed in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g.manual_seed(100 + seed)).to(t.dtype))
        graph.replay()
        want = without_replays(lambda: sparse_attn.attention(q, k, v, causal=True, return_lse=True))
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), seed


def test_replayed_calls_do_not_grow_memory():
    g = torch.Generator(device="cuda").manual_seed(14)
    packing, q, k, v = _padded(g, [4096, 3500, 1000, 512], 32, 8, 128)
    for _ in range(3):
        _unpad.in_place(packing, q, k, v, causal=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        _unpad.in_place(packing, q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=1000, num_sink=64, return_lse=True)])
def test_decoding_calls_served_at_the_api_give_the_bits_of_the_path(monkeypatch, kw):
    """ops.block_sparse.entry: from a geometry's third call at the latest, sparse_attn.attention runs the kept launches
    without reaching the op layers, with the path's bits (fresh inputs each call, poisoned memory)."""
    from sparse_attn.ops.block_sparse import entry
    replay.clear()
    entry.clear()
    ops = count_op_calls(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(16)
    served = []
    for i in range(5):
        q, k, v = _randn(g, 2, 32, 1, 128), _randn(g, 2, 8, 7000 + 3, 128), _randn(g, 2, 8, 7003, 128)
        _poison()
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, **kw)
        served.append(ops["n"] == before)
        _poison()
        want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))
        got, want = (got, want) if kw.get("return_lse") else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (kw, i)
    assert served in ([False, True, True, True, True], [False, False, True, True, True]), served
    replay.clear()
    entry.clear()


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=1000, num_sink=64)])
def test_a_padded_step_s_layers_served_by_the_entry_give_the_bits_of_the_path(monkeypatch, kw):
    """integrations._unpad.in_place through ops.block_sparse.entry: one Packing for a step's layers (a stopped row
    whose query is free among them); from the third call at the latest the kept launches run without reaching the
    varlen op, with the path's bits and zeros at the free query (fresh inputs each call, poisoned memory)."""
    from sparse_attn.ops.block_sparse import entry
    replay.clear()
    ops = count_op_calls(monkeypatch, "varlen_device_plan_op")
    g = torch.Generator(device="cuda").manual_seed(17)
    lengths = [4096, 3500, 1000, 512, 2]
    packing = _padded(g, lengths, 32, 8, 128, stopped=1)[0]
    served = []
    for i in range(5):
        q, k, v = _padded(g, lengths, 32, 8, 128)[1:]
        _poison()
        before = ops["n"]
        got = _unpad.in_place(packing, q, k, v, **kw)
        served.append(ops["n"] == before)
        _poison()
        want = without_replays(lambda: _unpad.in_place(packing, q, k, v, **kw))
        assert torch.equal(got, want), (kw, i)
        assert (got[1] == 0).all() and not got.isnan().any(), (kw, i)
    assert served in ([False, True, True, True, True], [False, False, True, True, True]), served
    replay.clear()
    entry.clear()


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=1000, num_sink=64)])
def test_a_padded_decoding_loop_derives_each_step_s_first_layer(monkeypatch, kw):
    """A padded batch's decoding steps (a new Packing each step, every row one token longer, a stopped row whose
    query is free, two layers a step) across 4096 keys (a length 16 divides, then back): every step's first layer
    but the first step's and the first of each specialization class runs the previous step's launches derived for
    its cache length (entry.derive_pairs), with the path's bits on poisoned memory and zeros at the free query."""
    from sparse_attn.ops.block_sparse import entry
    replay.clear()
    entry.clear()
    ops = count_op_calls(monkeypatch, "varlen_device_plan_op")
    g = torch.Generator(device="cuda").manual_seed(18)
    first_layer_path = []
    for step in range(8):
        lengths = [4090 + step, 3500 + step, 1000 + step, 512 + step, 2]  # keys: 4091 + step
        packing = _padded(g, lengths, 32, 8, 128, stopped=4)[0]
        for layer in range(2):
            q, k, v = _padded(g, lengths, 32, 8, 128)[1:]
            _poison()
            before = ops["n"]
            got = _unpad.in_place(packing, q, k, v, **kw)
            if layer == 0 and ops["n"] != before:
                first_layer_path.append(step)
            _poison()
            want = without_replays(lambda: _unpad.in_place(packing, q, k, v, **kw))  # noqa: B023
            assert torch.equal(got, want), (kw, step, layer)
            assert (got[4] == 0).all() and not got.isnan().any(), (kw, step, layer)
    assert first_layer_path == [0, 5], first_layer_path  # step 5: 4096 keys
    replay.clear()
    entry.clear()
