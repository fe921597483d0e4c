"""ops.block_sparse.entry: a decoding call of a geometry seen before runs its kept launches straight from
sparse_attn.attention, above the checks and op layers, with the bits of the path, and never where anything those
steps read has changed.

On the CPU the kernels run in Triton's interpreter behind test_replay's stand-in, with ``api._use_kernels`` forced so
that CPU tensors take the kernels' path (tests/gpu/test_replay_gpu.py runs the real one)."""
from __future__ import annotations

import pytest
import torch
from test_replay import compiled, interpreted  # noqa: F401 -- the fixture, used by name

import sparse_attn
from sparse_attn import api
from sparse_attn.integrations import _unpad
from sparse_attn.ops.block_sparse import entry, launch, replay
from sparse_attn.testing import count_op_calls, without_replays


@pytest.fixture
def ops(compiled, monkeypatch):  # noqa: F811
    """test_replay's stand-in, CPU tensors on the kernels' path, a clean entry table, and a count of the calls that
    reached the op layers (``ops["n"]``: not served by the entry)."""
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    entry.clear()
    yield count_op_calls(monkeypatch)
    entry.clear()


def _qkv(g, b=1, h=4, hkv=2, lq=1, lk=300):
    return (torch.randn(b, h, lq, 32, generator=g).half(), torch.randn(b, hkv, lk, 32, generator=g).half(),
            torch.randn(b, hkv, lk, 32, generator=g).half())


CALLS = {
    "causal decode": dict(causal=True),
    "dense, 3 query rows, lse": dict(return_lse=True),
    "window with sinks, scale": dict(causal=True, window=100, num_sink=20, scale=0.2),
}


@interpreted
@pytest.mark.parametrize("name", list(CALLS))
def test_the_entry_gives_the_bits_of_the_path(ops, name):
    """Calls 1-2 take the path (the second records: the first was its kernels' first launch); from the third on the
    entry serves them (no op call) with fresh random tensors, each result equal bit for bit to the path's."""
    kw = CALLS[name]
    g = torch.Generator().manual_seed(1)
    lq = 3 if "3 query" in name else 1
    for i in range(5):
        q, k, v = _qkv(g, lq=lq)
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, **kw)
        served = ops["n"] == before
        want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))
        got, want = (got, want) if kw.get("return_lse") else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, i)
        assert served == (i >= 2), (name, i)


@interpreted
@pytest.mark.parametrize("change", ["unaligned", "strides", "dtype", "scale", "causal", "window", "sinks",
                                    "return_lse", "aliasing", "setting", "deterministic"])
def test_anything_the_skipped_steps_read_makes_another_key(ops, monkeypatch, change):
    """After a geometry is served by the entry, a call that differs in anything the checks, the op layers or the
    path read reaches the op again, and gives the path's bits."""
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        sparse_attn.attention(*_qkv(g), causal=True, window=200)
    (q, k, v), kw = _qkv(g), dict(causal=True, window=200)
    before = ops["n"]
    sparse_attn.attention(q, k, v, **kw)
    assert ops["n"] == before  # served
    if change == "unaligned":
        k = torch.randn(2 * 300 * 32 + 1, generator=g).half()[1:].view(1, 2, 300, 32)
    elif change == "strides":
        k = torch.randn(1, 300, 2, 32, generator=g).half().transpose(1, 2)
    elif change == "dtype":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    elif change in ("scale", "causal", "window", "sinks", "return_lse"):
        kw.update({"scale": {"scale": 0.5}, "causal": {"causal": False, "window": None}, "window": {"window": 64},
                   "sinks": {"num_sink": 4}, "return_lse": {"return_lse": True}}[change])
    elif change == "aliasing":
        v = k
    elif change == "setting":
        monkeypatch.setattr(launch, "KV_SPLIT_MIN_TILES", 1)
    if change == "dtype":  # the interpreter's bf16 dot is garbage (README): the entry's refusal is the point here
        key = api._decode_entry_key(q, k, v, True, None, False, 200, 0)
        assert key is not None and entry._keys.find(key) is None
        return
    before = ops["n"]
    if change == "deterministic":
        from sparse_attn.testing import deterministic_algorithms
        with deterministic_algorithms():
            got = sparse_attn.attention(q, k, v, **kw)
            want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))
    else:
        got = sparse_attn.attention(q, k, v, **kw)
        want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))
    assert ops["n"] == before + 2, change  # the call and its reference both reached the op
    got, want = (got, want) if kw.get("return_lse") else ((got,), (want,))
    assert all(torch.equal(a, b) for a, b in zip(got, want)), change


@interpreted
def test_the_entry_serves_no_call_the_path_would_refuse_or_treat_otherwise(ops, monkeypatch):
    """Calls with gradients, a layout, 8-bit, bad arguments, tensor subclasses or while replay is unusable go through
    the checks and the path as before: a served geometry's call that needs gradients records a graph, one with a bad
    argument raises, and one under a launch hook reaches the op."""
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        sparse_attn.attention(*_qkv(g), causal=True)
    q, k, v = _qkv(g)
    assert api._decode_entry_key(q, k, v, True, None, False, None, 0) is not None
    qg = q.clone().requires_grad_()
    assert api._decode_entry_key(qg, k, v, True, None, False, None, 0) is None
    assert api._decode_entry_key(q.as_subclass(torch.nn.Parameter), k, v, True, None, False, None, 0) is None
    assert api._decode_entry_key(q, k, v, 1, None, False, None, 0) is None  # causal=1: the checks say what they take
    assert api._decode_entry_key(q, k, v, True, torch.tensor(0.5), False, None, 0) is None
    with pytest.raises(ValueError):
        sparse_attn.attention(q, k, v, causal=True, scale=-1.0)
    with pytest.raises(ValueError):
        sparse_attn.attention(q, k, v, causal=True, quant_granularity="per_nothing")
    with pytest.raises(TypeError):
        sparse_attn.attention(q, k, v, causal=True, return_lse="yes")
    before = ops["n"]
    monkeypatch.setattr(replay, "usable", lambda: False)  # (a launch hook set: a profiler sees every launch)
    sparse_attn.attention(q, k, v, causal=True)
    assert ops["n"] == before + 1


@interpreted
def test_no_key_during_a_streak_of_new_geometries(ops, monkeypatch):
    """A cache growing under one call a step whose new lengths do not derive (every split count changing, say; a new
    length derives from the last as a rule: test_length_derivation.py) never replays: after replay's streak of new
    geometries the entry computes no key (nothing to find), and a geometry that comes back ends the streak."""
    monkeypatch.setattr(launch, "derive_for_length", lambda *a, **kw: None)
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g, lk=400)
    for n in range(200, 200 + replay.MISS_STREAK + 1):
        sparse_attn.attention(q, k[:, :, :n], v[:, :, :n], causal=True)
    assert replay.streaking()
    assert api._decode_entry_key(q, k[:, :, :300], v[:, :, :300], True, None, False, None, 0) is None
    for _ in range(3):  # seen, recorded at its second sight, then replayed: the streak ends
        sparse_attn.attention(q, k[:, :, :250], v[:, :, :250], causal=True)
    assert not replay.streaking()


@interpreted
def test_a_call_whose_inputs_the_prologue_copies_is_never_served(ops):
    """K and V whose head dim is not unit-stride are copied by the op's prologue, so the path's launches read the
    copies: the entry does not learn such a geometry (its kept launches would read the originals with the copies'
    strides), and every call reaches the op with the path's bits."""
    g = torch.Generator().manual_seed(6)
    for i in range(4):
        q = torch.randn(1, 4, 1, 32, generator=g).half()
        k, v = (torch.randn(1, 2, 300, 64, generator=g).half()[..., ::2] for _ in range(2))
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, causal=True)
        assert ops["n"] == before + 1, i
        assert torch.equal(got, without_replays(lambda: sparse_attn.attention(q, k, v, causal=True))), i


@interpreted
def test_only_the_device_plans_inputs_are_learnt(ops, monkeypatch):
    """run() hands a recipe the inputs the device plan passes (one int32 stand-in in the six schedule places, no
    offsets): a replay key recorded over other inputs is not learnt, and the call then always reaches the op."""
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(g)
    sparse_attn.attention(q, k, v, causal=True)
    assert len(entry._keys) == 1
    entry.clear()
    real = launch.take_replay_key

    def other_inputs():
        last = real()
        if last is None:
            return None
        (parts, *rest), ids = last
        return (parts[:9] + (parts[3], None), *rest), ids  # as if offsets had been passed
    monkeypatch.setattr(launch, "take_replay_key", other_inputs)
    for _ in range(3):
        sparse_attn.attention(*_qkv(g), causal=True)
    assert len(entry._keys) == 0


def _padded_step(g, lengths, h=4, hkv=2, d=32, free_row=False):
    """A left-padded decoding step as the transformers integration runs it: (packing, q, k, v); ``free_row``: the
    last row's newest slot is padding (a row that has stopped), so its query is free."""
    lk = max(lengths) + 1
    mask = torch.zeros(len(lengths), lk, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, lk - n - 1:] = True
    if free_row:
        mask[-1, -1] = False
    b = len(lengths)
    q = torch.randn(b, 1, h, d, generator=g).half().transpose(1, 2)  # as models make queries
    k, v = (torch.randn(b, hkv, lk, d, generator=g).half() for _ in range(2))
    return _unpad.from_padding(mask, 1), q, k, v


@pytest.fixture
def varlen_ops(compiled, monkeypatch):  # noqa: F811
    """As ``ops``, for a padded batch's in-place calls: the count of those that reached the varlen device-plan op."""
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    return count_op_calls(monkeypatch, "varlen_device_plan_op")


@interpreted
@pytest.mark.parametrize("kw,free_row", [(dict(causal=True), False), (dict(causal=True), True),
                                         (dict(causal=True, window=100, num_sink=20, scale=0.2), False)])
def test_a_padded_step_s_later_layers_are_served_with_the_path_s_bits(varlen_ops, kw, free_row):
    """integrations._unpad.in_place: a decoding step's layers share one Packing and one geometry; from the call after
    the one that recorded, the entry runs the kept launches (the varlen op is not reached), each result equal bit for
    bit to the path's on fresh random tensors, zeros at a free query."""
    ops = varlen_ops
    g = torch.Generator().manual_seed(21)
    packing = _padded_step(g, [250, 120, 33], free_row=free_row)[0]
    for i in range(5):
        q, k, v = _padded_step(g, [250, 120, 33], free_row=free_row)[1:]
        before = ops["n"]
        got = _unpad.in_place(packing, q, k, v, **kw)
        served = ops["n"] == before
        want = without_replays(lambda: _unpad.in_place(packing, q, k, v, **kw))
        assert torch.equal(got, want), (kw, i)
        assert served == (i >= 2), (kw, i)
        assert free_row == (got[-1] == 0).all().item()


@interpreted
def test_what_a_padded_step_learnt_stays_with_its_batch(varlen_ops):
    """The entry keeps what it learnt on the Packing, and the batch's pairs are inputs of the launches: the next step's
    batch (other lengths, the same tensor geometry) runs the launches derived for it on its own pairs (served, with
    the path's bits: the previous batch's pairs would give other bits), and a call of another geometry on the same
    batch reaches the op again."""
    ops = varlen_ops
    g = torch.Generator().manual_seed(22)
    packing, q, k, v = _padded_step(g, [250, 120, 33])
    for _ in range(3):
        _unpad.in_place(packing, q, k, v, causal=True)
    before = ops["n"]
    _unpad.in_place(packing, q, k, v, causal=True)
    assert ops["n"] == before  # served
    other, q2, k2, v2 = _padded_step(g, [250, 100, 53])  # the same geometry, other sequences
    mha = _padded_step(g, [250, 120, 33], hkv=4)[1:]  # four kv heads: another geometry on this batch
    for p, inputs, served in ((other, (q2, k2, v2), True), (packing, mha, False)):
        before = ops["n"]
        got = _unpad.in_place(p, *inputs, causal=True)
        assert (ops["n"] == before) == served
        assert torch.equal(got, without_replays(lambda: _unpad.in_place(p, *inputs, causal=True)))


@interpreted
def test_a_padded_step_whose_views_are_copies_is_never_served(varlen_ops):
    """A key / value that token_view cannot place is copied first, so the path's launches read the copies: the
    entry learns nothing there, and every call reaches the op with the path's bits."""
    ops = varlen_ops
    g = torch.Generator().manual_seed(23)
    packing, q, k, v = _padded_step(g, [250, 120, 33])
    lk = k.shape[2]
    for i in range(4):
        # rows 8 elements apart beyond their tokens: a batch stride of no whole number of token strides
        k, v = (torch.randn(3, lk * 64 + 8, generator=g).half()[:, :lk * 64].unflatten(1, (2, lk, 32))
                for _ in range(2))
        assert _unpad.token_view(k) is None
        before = ops["n"]
        got = _unpad.in_place(packing, q, k, v, causal=True)
        assert ops["n"] == before + 1, i
        assert torch.equal(got, without_replays(lambda: _unpad.in_place(packing, q, k, v, causal=True))), i


@interpreted
@pytest.mark.parametrize("return_lse", [False, True])
def test_served_results_are_never_scratch(ops, monkeypatch, return_lse):
    """replay.run reuses the stream's scratch for what a call does not return (split-KV parts; the LSE where it is
    dropped): results kept from earlier served calls stay as they were after later ones, with the path's bits. The
    key walk is split in three (the interpreter has no SMs for the automatic count)."""
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "3")
    g = torch.Generator().manual_seed(8)
    kept, served = [], []
    for i in range(6):
        q, k, v = _qkv(g, lk=1000)
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, causal=True, return_lse=return_lse)
        served.append(ops["n"] == before)
        want = without_replays(lambda: sparse_attn.attention(q, k, v, causal=True, return_lse=return_lse))
        kept.append((got, want))
    assert served == [False, False, True, True, True, True]
    assert any(len(r.allocs) == 4 for r in replay._kept.values() if isinstance(r, replay.Recipe))  # split
    for got, want in kept:
        got, want = (got, want) if return_lse else ((got,), (want,))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(replay._scratch) == (2 if return_lse else 3)


@interpreted
def test_replay_clear_forgets_the_recipes_the_entry_holds(ops):
    """The entry holds its recipes (no replay key hashed a served call); replay.clear() still makes the next call of
    a served geometry reach the op."""
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        sparse_attn.attention(*_qkv(g), causal=True)
    before = ops["n"]
    sparse_attn.attention(*_qkv(g), causal=True)
    assert ops["n"] == before
    replay.clear()
    q, k, v = _qkv(g)
    got = sparse_attn.attention(q, k, v, causal=True)
    assert ops["n"] == before + 1
    assert torch.equal(got, without_replays(lambda: sparse_attn.attention(q, k, v, causal=True)))
