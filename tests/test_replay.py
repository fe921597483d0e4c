"""ops.block_sparse.replay: a short forward launched again from its recording gives the bits of the path it
skips, and is not launched where anything that path reads has changed.

On the CPU the kernels run in Triton's interpreter, where ops.fast_launch keeps no compiled kernel. A stand-in
(``_Compiled``) gives it one: a JIT-function shim whose "compiled kernel" launcher runs the interpreted kernel on
the arguments it is handed in signature order, exactly what a replay hands Triton's launcher on the GPU
(tests/gpu/test_replay_gpu.py runs the real one)."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl

from sparse_attn import patterns
from sparse_attn.ops import fast_launch
from sparse_attn.ops.block_sparse import (
    attention_op,
    device_plan_attention_op,
    launch,
    replay,
    varlen_device_plan_op,
)
from sparse_attn.testing import count_forward_paths, without_replays

interpreted = pytest.mark.skipif(not launch.INTERPRET, reason="the stand-in wraps Triton's interpreter")


class JITFunction:  # the type name fast_launch.launcher() accepts
    """An interpreted kernel behind the interface fast_launch expects of a ``triton.jit`` function; its kept
    "compiled kernel" runs the interpreted one (``fast`` counts those launches)."""

    def __init__(self, interpreted_fn):
        self.interpreted = interpreted_fn
        sig = inspect.signature(interpreted_fn.fn)
        self.params = [SimpleNamespace(name=n, is_constexpr=p.annotation is tl.constexpr,
                                       has_default=p.default is not inspect.Parameter.empty, default=p.default)
                       for n, p in sig.parameters.items()]
        self.fast = 0

    def __getitem__(self, grid):
        def slow(*args, **kw):
            self.interpreted[grid](*args, **kw)
            return SimpleNamespace(run=self._run, function="function", packed_metadata="metadata")
        return slow

    def _run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *values):
        assert (function, metadata, launch_metadata, enter_hook, exit_hook) == ("function", "metadata", None, None,
                                                                              None)
        self.fast += 1
        self.interpreted[(g0, g1, g2)](**{p.name: v for p, v in zip(self.params, values)})


@pytest.fixture
def compiled(monkeypatch):
    """The stand-in in place of Triton's compiled kernels, a clean replay table, and a count of the calls that
    took launch.forward's own path (``calls["path"]``)."""
    shims: dict = {}

    def shimmed_launcher(fn):
        if type(fn).__name__ == "InterpretedFunction":
            if fn not in shims:  # one stand-in a kernel (setdefault would build one every launch)
                shims[fn] = JITFunction(fn)
            fn = shims[fn]
        return fast_launch.launcher(fn)
    monkeypatch.setattr(launch, "launcher", shimmed_launcher)
    monkeypatch.setattr(fast_launch, "_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_stream", lambda device: 0)
    monkeypatch.setattr(fast_launch, "_checked", [True])
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    yield SimpleNamespace(calls=count_forward_paths(monkeypatch), shims=shims)
    replay.clear()


def _cases():
    """name -> (inputs maker, call): short forwards of each kind launch.forward replays."""
    def dense(b, h, hkv, lq, lk):
        def make(g):
            return (torch.randn(b, h, lq, 32, generator=g).half(), torch.randn(b, hkv, lk, 32, generator=g).half(),
                    torch.randn(b, hkv, lk, 32, generator=g).half())
        return make

    def packed(lens_q, lens_k, h, hkv):
        def make(g):
            cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
            cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
            return (torch.randn(sum(lens_q), h, 32, generator=g).half(),
                    torch.randn(sum(lens_k), hkv, 32, generator=g).half(),
                    torch.randn(sum(lens_k), hkv, 32, generator=g).half(), cu_q, cu_k)
        return make
    local = patterns.local(3, 40, kv_len=300, block_q=16, block_k=32)
    return {
        "causal GQA decode, packed heads": (dense(1, 4, 2, 1, 300),
                                            lambda q, k, v: device_plan_attention_op(q, k, v, True, return_lse=True)),
        "dense MHA, 3 query rows": (dense(2, 2, 2, 3, 257),
                                    lambda q, k, v: device_plan_attention_op(q, k, v, False, return_lse=True)),
        "causal window with sinks": (dense(1, 2, 1, 2, 290), lambda q, k, v: device_plan_attention_op(
            q, k, v, True, return_lse=True, window=100, num_sink=20)),
        "varlen decode": (packed([1, 1, 1], [40, 260, 130], 4, 2), lambda q, k, v, cq, ck: varlen_device_plan_op(
            q, k, v, cq, ck, 1, 260, True, return_lse=True)),
        "host-planned layout": (dense(1, 2, 2, 3, 300), lambda q, k, v: attention_op(q, k, v, local,
                                                                                      return_lse=True)),
    }


@interpreted
@pytest.mark.parametrize("split", ["auto", "2"])
@pytest.mark.parametrize("name", list(_cases()))
def test_replayed_short_forwards_give_the_bits_of_the_path_they_skip(compiled, monkeypatch, name, split):
    """The first call of a geometry takes launch.forward's path, and so does the second (recorded: the first was
    its kernels' first launch, through Triton), later ones replay it with their own (fresh random) tensors: each
    result equals the unreplayed call's bit for bit, with one or two parts (a split-KV forward and its merge), and
    the replays make the recorded number of launches without the path."""
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", split)
    make, call = _cases()[name]
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        inputs = make(g)
        fast_before, path_before = sum(s.fast for s in compiled.shims.values()), compiled.calls["path"]
        out, lse = call(*inputs)
        want_out, want_lse = without_replays(lambda: call(*inputs))
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), (name, split, i)
        if i >= 2:  # replayed: no pass through the path, its kernels launched from the recording
            (recipe,) = [r for r in replay._kept.values() if isinstance(r, replay.Recipe)]
            assert compiled.calls["path"] == path_before + 1, (name, i)  # the unreplayed reference's own call
            # the recipe's launches, and as many again for the reference (through the kept kernels too)
            assert sum(s.fast for s in compiled.shims.values()) - fast_before == 2 * len(recipe.launches), (name, i)
            assert len(recipe.launches) == 2 if split == "2" else (len(recipe.launches) in (1, 2))


@interpreted
def test_a_recipe_keeps_no_tensor_alive(compiled):
    """Nothing of the recorded call stays allocated (a layer's cache would): its inputs and outputs are freed
    once the caller drops them, while the recipe is kept."""
    import gc
    import weakref
    make, call = _cases()["causal GQA decode, packed heads"]
    g = torch.Generator().manual_seed(4)
    call(*make(g))
    recorded = make(g)
    refs = [weakref.ref(t) for t in (*recorded, *call(*recorded))]  # the second call: recorded
    del recorded
    gc.collect()
    assert [r for r in replay._kept.values() if isinstance(r, replay.Recipe)]
    assert all(ref() is None for ref in refs)
    call(*make(g))  # and the recipe still runs
    assert compiled.calls["path"] == 2


@interpreted
@pytest.mark.parametrize("change", ["length", "unaligned", "setting", "scale", "window", "aliasing"])
def test_anything_the_path_reads_makes_another_key(compiled, monkeypatch, change):
    """After a geometry is replayed, a call that differs in what the path reads takes the path again (and gives its
    bits): another key length, a 16-byte-unaligned input, a module setting, the scale, a sliding window (the kernel's
    device plan), which inputs are one tensor
    (recorded with one offsets tensor for queries and keys, then called with two)."""
    g = torch.Generator().manual_seed(5)

    def inputs(lk=300):
        return (torch.randn(2, 4, 32, generator=g).half(), torch.randn(lk, 2, 32, generator=g).half(),
                torch.randn(lk, 2, 32, generator=g).half())

    def offsets(*ends):
        return torch.tensor([0, *ends], dtype=torch.int32)

    def call(q, k, v, cu_q, cu_k, scale=None, window=None):
        return varlen_device_plan_op(q, k, v, cu_q, cu_k, 1, 150, True, return_lse=True, scale=scale, window=window)
    for _ in range(3):
        cu_q = offsets(1, 2)
        call(*inputs(), cu_q, cu_q if change == "aliasing" else offsets(150, 300))
    assert compiled.calls["path"] == 2
    (q, k, v), cu_q, cu_k, scale, window = inputs(), offsets(1, 2), offsets(150, 300), None, None
    if change == "length":
        k, v = inputs(301)[1:]
        cu_k = offsets(150, 301)
    elif change == "unaligned":
        k = torch.randn(301 * 64 + 1, generator=g).half()[1:].view(301, 2, 32)[:300]
    elif change == "setting":
        monkeypatch.setattr(launch, "KV_SPLIT_MIN_TILES", 1)
    elif change == "scale":
        scale = 0.25
    elif change == "window":
        window = 64
    path = compiled.calls["path"]
    out = call(q, k, v, cu_q, cu_k, scale, window)
    assert compiled.calls["path"] == path + 1, change
    want = without_replays(lambda: call(q, k, v, cu_q, cu_k, scale, window))
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), change


@interpreted
def test_no_replay_under_a_launch_hook_or_with_the_switch_off(compiled, monkeypatch):
    """A launch hook (a profiler) or the switch off sends a recorded geometry through the path again."""
    make, call = _cases()["dense MHA, 3 query rows"]
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        call(*make(g))
    path = compiled.calls["path"]
    monkeypatch.setattr(fast_launch, "_hooked", lambda: True)
    call(*make(g))
    assert compiled.calls["path"] == path + 1
    monkeypatch.setattr(fast_launch, "_hooked", lambda: False)
    monkeypatch.setattr(replay, "ENABLED", False)
    call(*make(g))
    assert compiled.calls["path"] == path + 2
    monkeypatch.setattr(replay, "ENABLED", True)
    call(*make(g))
    assert compiled.calls["path"] == path + 2  # replayed again


@interpreted
def test_an_incomplete_recording_is_never_replayed(monkeypatch):
    """Without kept kernels (Triton's interpreter as it is: its launches bypass fast_launch) the recording misses
    the launches, and the geometry is marked never to replay: every call takes the path."""
    monkeypatch.setattr(replay, "ENABLED", True)
    replay.clear()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).half() for n in (1, 200, 200))
    want = without_replays(lambda: device_plan_attention_op(q, k, v, True))
    for _ in range(3):
        assert torch.equal(device_plan_attention_op(q, k, v, True), want)
    assert list(replay._kept.values()) == [replay.NEVER]
    replay.clear()


def test_the_table_is_bounded():
    """A growing cache makes a key a step: only MAX_KEPT are remembered, the least recently used dropped."""
    replay.clear()
    t = torch.zeros(1)
    for i in range(replay.MAX_KEPT + 5):
        replay.keep(("key", i), (), [], [], 1, (t, t))  # (incomplete: kept as NEVER)
    assert len(replay._kept) == replay.MAX_KEPT and ("key", 0) not in replay._kept
    replay.find(("key", 5))  # seen again: now the most recent
    replay.keep(("key", "new"), (), [], [], 1, (t, t))
    assert ("key", 5) in replay._kept and ("key", 6) not in replay._kept
    replay.clear()


@interpreted
def test_a_new_geometry_is_recorded_at_first_sight_once_its_kernels_are_kept(compiled):
    """Each step of a growing cache is a new geometry. Once its kernels have launched before, its first call is
    recorded, and the step's second layer already replays it (with its bits)."""
    g = torch.Generator().manual_seed(8)

    def step(lk):
        q, k, v = (torch.randn(1, 4, n, 32, generator=g).half() for n in (1, lk, lk))
        paths = compiled.calls["path"]
        outs = [device_plan_attention_op(q, k, v, True) for _ in range(2)]  # two layers
        want = without_replays(lambda: device_plan_attention_op(q, k, v, True))
        assert all(torch.equal(out, want) for out in outs), lk
        return compiled.calls["path"] - paths - 1  # (less the unreplayed reference)
    assert step(300) == 2  # the kernels' first launch went through Triton: recorded on the second call
    assert step(316) == 1 and step(332) == 1  # later steps: the first layer recorded, the second replayed


def test_after_a_streak_of_new_geometries_a_new_one_is_recorded_when_it_comes_back():
    """One call a step on a growing cache never replays: past MISS_STREAK new keys in a row a new key is only marked
    SEEN (no recording), recorded on its second call; any key found ends the streak."""
    replay.clear()
    assert all(replay.find(("new", i)) is replay.RECORD for i in range(replay.MISS_STREAK))
    assert replay.find(("new", "a")) is None and replay._kept[("new", "a")] is replay.SEEN
    assert replay.find(("new", "b")) is None
    assert replay.find(("new", "a")) is replay.RECORD  # seen again: recorded, and the streak is over
    assert replay.find(("new", "c")) is replay.RECORD
    replay.clear()
    assert replay.find(("new", "d")) is replay.RECORD  # clear() ends a streak too
    replay.clear()


@interpreted
def test_a_recording_through_triton_is_tried_once_more_then_given_up(compiled, monkeypatch):
    """A launch that takes Triton's path leaves a hole in the recording: a kernel's first launch does that once (the
    next call records again), a launch the fast path never covers every time (after two tries, never replayed)."""
    make, call = _cases()["dense MHA, 3 query rows"]
    g = torch.Generator().manual_seed(9)
    call(*make(g))
    assert list(replay._kept.values()) == [replay.RETRY]
    replay.clear()
    monkeypatch.setattr(fast_launch, "call_key", lambda *a: None)  # no launch is ever fast
    for expected in (replay.RETRY, replay.NEVER, replay.NEVER):
        inputs = make(g)
        out = call(*inputs)
        assert list(replay._kept.values()) == [expected]
        assert all(torch.equal(a, b) for a, b in zip(out, without_replays(lambda: call(*inputs))))
    assert compiled.calls["path"] == 1 + 3 + 3  # (three unreplayed references)


@interpreted
def test_a_geometry_first_seen_under_a_launch_hook_replays_after_it(compiled, monkeypatch):
    """Under a launch hook (a profiler) nothing is recorded, so nothing is marked never to replay either."""
    make, call = _cases()["dense MHA, 3 query rows"]
    g = torch.Generator().manual_seed(10)
    monkeypatch.setattr(fast_launch, "_hooked", lambda: True)
    for _ in range(3):
        call(*make(g))
    assert not replay._kept
    monkeypatch.setattr(fast_launch, "_hooked", lambda: False)
    paths = compiled.calls["path"]
    for _ in range(3):
        call(*make(g))
    # their kernels' first fast launch (under the hook each went through Triton) and the recording: 2, not 3
    assert compiled.calls["path"] == paths + 2
    assert any(isinstance(r, replay.Recipe) for r in replay._kept.values())
