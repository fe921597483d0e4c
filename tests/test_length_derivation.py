"""A decoding call at a key length never seen (a growing cache's next step) is served by the entry with a recipe
derived from its family's latest length (launch.derive_for_length, ops.block_sparse.entry._derive): the launches
the path would make, so the path's bits, and never where the length changes anything but the length arguments.

On the CPU the kernels run in Triton's interpreter behind test_replay's stand-in, with ``api._use_kernels`` forced so
that CPU tensors take the kernels' path (tests/gpu/test_replay_gpu.py runs the real one)."""
from __future__ import annotations

import pytest
import torch
from test_decode_entry import _padded_step
from test_replay import compiled, interpreted  # noqa: F401 -- the fixture, used by name

import sparse_attn
from sparse_attn import api
from sparse_attn.ops.block_sparse import entry, launch, replay
from sparse_attn.testing import count_op_calls, without_replays

CALLS = {
    "causal decode, GQA": dict(causal=True),
    "dense, 3 query rows, lse": dict(return_lse=True),
    "window with sinks, scale": dict(causal=True, window=100, num_sink=20, scale=0.2),
}


@pytest.fixture
def ops(compiled, monkeypatch):  # noqa: F811
    """test_decode_entry's: the stand-in, CPU tensors on the kernels' path, a clean entry table, and a count of the
    calls that reached the op layers (``ops["n"]``: not served by the entry)."""
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    entry.clear()
    yield count_op_calls(monkeypatch)
    entry.clear()


def _step(g, lk, lq=1, h=4, hkv=2):
    """One decoding step's inputs at cache length ``lk``: fresh contiguous K/V, as a cache's torch.cat makes them."""
    return (torch.randn(1, h, lq, 32, generator=g).half(), torch.randn(1, hkv, lk, 32, generator=g).half(),
            torch.randn(1, hkv, lk, 32, generator=g).half())


def _outputs(x):
    return x if isinstance(x, tuple) else (x,)


@interpreted
@pytest.mark.parametrize("name", list(CALLS))
def test_a_growing_cache_is_served_at_new_lengths_with_the_paths_bits(ops, name):
    """One call a step, the cache one token longer each step, over a stretch holding a length 16 divides: the first
    two calls take the path (a kernel's first launch, then the recording), and so does the first length of the other
    specialization class (304: nothing of its class to derive from, and its kernel's first launch); every other call
    is served, its result equal bit for bit to the path's."""
    kw = CALLS[name]
    g = torch.Generator().manual_seed(11)
    lq = 3 if "3 query" in name else 1
    path_taken = []
    for lk in range(296, 312):
        q, k, v = _step(g, lk, lq)
        before = ops["n"]
        got = sparse_attn.attention(q, k, v, **kw)
        if ops["n"] != before:
            path_taken.append(lk)
        want = without_replays(lambda: sparse_attn.attention(q, k, v, **kw))  # noqa: B023 -- called at once
        assert all(torch.equal(a, b) for a, b in zip(_outputs(got), _outputs(want), strict=True)), (name, lk)
    assert path_taken == [296, 297, 304], name


def _recorded(q, k, v, kw) -> replay.Recipe:
    """The recipe launch.forward records for this call (the path twice: a kernel's first launch is never kept)."""
    for _ in range(2):
        sparse_attn.attention(q, k, v, **kw)
    key, _ = launch.take_replay_key()
    recipe = replay._kept.get(key)
    assert isinstance(recipe, replay.Recipe)
    return recipe


def _same(a: replay.Recipe, b: replay.Recipe) -> bool:
    """Whether two recipes launch the same kernels with the same arguments, grids and allocations."""
    if (a.allocs, a.out, a.lse, len(a.launches)) != (b.allocs, b.out, b.lse, len(b.launches)):
        return False
    for (la, ta, xa), (lb, tb, xb) in zip(a.launches, b.launches, strict=True):
        if (la.run, la.function, la.metadata, la.grid, ta, xa) != (lb.run, lb.function, lb.metadata, lb.grid, tb, xb):
            return False
    return True


@interpreted
@pytest.mark.parametrize("name", list(CALLS))
def test_a_derived_recipe_is_the_one_the_path_records(ops, monkeypatch, name):
    """Across a change of the autotune key's length class (255 -> 258: 8 -> 9), of the split-KV count (383 -> 386:
    one part, then two, with one kv head: the interpreter stands in 3 SMs) and of the length's specialization class
    (400, which 16 divides, and back at 401): the recipe derived from the previous length's is equal, launch by
    launch (the split's merge included), to the one the path records at this length, and it is refused exactly where
    the split count or the specialization class changed."""
    monkeypatch.setattr(api, "_decode_entry_key", lambda *a: None)  # every call on the path, each recording
    kw = CALLS[name]
    g = torch.Generator().manual_seed(12)
    lq = 3 if "3 query" in name else 1
    previous, refused, parts = None, [], []
    for lk in (254, 255, 258, 259, 300, 383, 386, 387, 400, 401):
        q, k, v = _step(g, lk, lq, hkv=1)
        recipe = _recorded(q, k, v, kw)
        parts.append(len(recipe.launches))
        if previous is not None:
            derived = launch.derive_for_length(previous, q, k, v)
            if derived is None:
                refused.append(lk)
            else:
                assert _same(derived, recipe), (name, lk)
        previous = recipe
    assert parts == [1] * 6 + [2] * 4, name  # the split (its merge a second launch) from 386 on
    assert refused == [386, 400, 401], name


@interpreted
def test_no_derivation_where_anything_but_the_length_differs(ops):
    """A call whose K/V differ from the family's latest in anything besides their length and the strides it scales
    (head strides, dtype of q, query rows, heads) makes another family: it takes the path."""
    g = torch.Generator().manual_seed(13)
    for lk in (300, 301, 302):
        sparse_attn.attention(*_step(g, lk), causal=True)
    q, k, v = _step(g, 303)
    variants = {
        "transposed K": (q, torch.randn(1, 303, 2, 32, generator=g).half().transpose(1, 2), v),
        "two query rows": _step(g, 303, lq=2),
        "eight query heads": _step(g, 303, h=8),
        "one kv head": _step(g, 303, hkv=1),
    }
    for label, (q2, k2, v2) in variants.items():
        before = ops["n"]
        got = sparse_attn.attention(q2, k2, v2, causal=True)
        assert ops["n"] == before + 1, label
        want = without_replays(lambda: sparse_attn.attention(q2, k2, v2, causal=True))  # noqa: B023
        assert torch.equal(got, want), label
    before = ops["n"]
    sparse_attn.attention(q, k, v, causal=True)  # the family's next length: derived
    assert ops["n"] == before


@interpreted
def test_replay_clear_forgets_derived_recipes(ops):
    """A recipe derived for a length holds no replay key: after replay.clear() neither it nor its family's latest
    (itself) runs, so the next new length and the derived length take the path, and derivation resumes from what that
    path records."""
    g = torch.Generator().manual_seed(14)
    for lk in (300, 301, 302):
        sparse_attn.attention(*_step(g, lk), causal=True)
    derived = _step(g, 303)
    before = ops["n"]
    sparse_attn.attention(*derived, causal=True)
    assert ops["n"] == before  # derived
    replay.clear()
    for args, path in ((_step(g, 305), True), (derived, True), (_step(g, 306), False)):
        before = ops["n"]
        got = sparse_attn.attention(*args, causal=True)
        assert ops["n"] == before + path, args[1].shape[2]
        assert torch.equal(got, without_replays(lambda: sparse_attn.attention(*args, causal=True)))  # noqa: B023


@pytest.fixture
def varlen_ops(compiled, monkeypatch):  # noqa: F811
    """As ``ops``, for a padded batch's in-place calls (test_decode_entry's ``_padded_step``): the count of those that
    reached the varlen device-plan op."""
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    entry.clear()
    yield count_op_calls(monkeypatch, "varlen_device_plan_op")
    entry.clear()


@interpreted
@pytest.mark.parametrize("kw,free_row", [(dict(causal=True), False), (dict(causal=True), True),
                                         (dict(causal=True, window=100, num_sink=20, scale=0.2), False)])
def test_a_padded_decoding_loop_derives_each_step_s_first_layer(varlen_ops, kw, free_row):
    """A padded batch's decoding steps (a new Packing each step, every row one token longer, two layers a step, the
    longest row crossing 256 keys): from the second step on the first layer runs the previous step's launches
    derived for its cache length, except at the first length 16 divides (its layers record, the first through a
    kernel's first launch); every result has the path's bits, zeros at a free query."""
    from sparse_attn.integrations import _unpad
    ops = varlen_ops
    g = torch.Generator().manual_seed(31)
    path = []
    for step in range(8):
        lengths = [250 + step, 120 + step, 33 + step]  # keys: 251 + step
        packing = _padded_step(g, lengths, free_row=free_row)[0]
        for layer in range(2):
            q, k, v = _padded_step(g, lengths, free_row=free_row)[1:]
            before = ops["n"]
            got = _unpad.in_place(packing, q, k, v, **kw)
            if ops["n"] != before:
                path.append((step, layer))
            want = without_replays(lambda: _unpad.in_place(packing, q, k, v, **kw))  # noqa: B023
            assert torch.equal(got, want), (kw, step, layer)
            assert free_row == (got[-1] == 0).all().item()
    assert path == [(0, 0), (0, 1), (5, 0), (5, 1)], path  # step 5: 256 keys


@interpreted
@pytest.mark.parametrize("name", list(CALLS))
def test_a_padded_step_s_derived_recipe_is_the_one_the_path_records(varlen_ops, monkeypatch, name):
    """As test_a_derived_recipe_is_the_one_the_path_records, for a padded batch's in-place call (token views, the
    pairs as inputs, the longest row's keys as the length): a derived recipe equals the path's recording launch by
    launch, and exactly the split step (384 -> 385 keys: one part, then two, on 12 stand-in SMs) and the lengths of
    the other specialization class are refused."""
    from sparse_attn.integrations import _unpad
    monkeypatch.setattr(launch, "_sm_count", lambda device: 12)
    kw = dict(CALLS[name])
    kw.pop("return_lse", None)
    causal = kw.pop("causal", False)
    g = torch.Generator().manual_seed(32)
    previous, refused, parts = None, [], []
    for lk in (254, 255, 258, 259, 300, 383, 386, 387, 400, 401):
        packing, q, k, v = _padded_step(g, [lk - 1, 120, 33], hkv=1)
        views = _unpad._token_views(q, k, v)
        q_pairs, k_pairs = packing.pairs_on(q.device, views[1], views[3])
        for _ in range(2):  # the path (a kernel's first launch is never kept), recorded
            _unpad._run_pairs(q, views, q_pairs, k_pairs, packing.max_q, packing.max_k, None, causal,
                              kw.get("window"), kw.get("num_sink", 0), kw.get("scale"))
        key, _ = launch.take_replay_key()
        recipe = replay._kept.get(key)
        assert isinstance(recipe, replay.Recipe) and packing.max_k == lk
        parts.append(len(recipe.launches))
        if previous is not None:
            derived = launch.derive_for_length(previous, views[0], views[2], views[4], max_k=lk)
            if derived is None:
                refused.append(lk)
            else:
                assert _same(derived, recipe), (name, lk)
        previous = recipe
    assert parts == [1] * 6 + [2] * 4, name  # (a window of 100 keys after 20 sinks spans 4 key blocks too)
    assert refused == [386, 400, 401], name
