"""ops.fast_launch: a kept kernel serves exactly the calls Triton would have served with it. On the CPU with
a stand-in JIT function (the launches themselves run on the GPU, tests/gpu)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparse_attn.ops import fast_launch


class JITFunction:  # the type name launcher() accepts
    """Stand-in for triton.jit: kernel(a, b, n, BLOCK: constexpr, flag=False). Slow launches are recorded in
    ``slow``; the kept kernel's launches in ``fast`` as (grid, values)."""

    def __init__(self):
        p = lambda name, constexpr=False, default=None: SimpleNamespace(  # noqa: E731
            name=name, is_constexpr=constexpr, has_default=default is not None, default=default)
        self.params = [p("a"), p("b"), p("n"), p("BLOCK", True), p("flag", default=False)]
        self.run = None
        self.slow, self.fast = [], []
        outer = self

        def run(g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *values):
            assert (stream, function, metadata, launch_metadata, enter_hook, exit_hook) == (7, "fn", "md", None, None,
                                                                                           None)
            outer.fast.append(((g0, g1, g2), values))
        self.compiled = SimpleNamespace(run=run, function="fn", packed_metadata="md")

    def __getitem__(self, grid):
        def slow(*args, **kw):
            self.slow.append((grid, args, kw))
            return self.compiled
        return slow


@pytest.fixture
def fn(monkeypatch):
    monkeypatch.setattr(fast_launch, "_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_stream", lambda device: 7)
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    f = JITFunction()
    fast_launch._LAUNCHERS.pop(f, None)
    return f


def _t(offset=0, dtype=torch.float16):
    return torch.empty(64, dtype=dtype)[offset:]


def test_a_repeated_call_launches_the_kept_kernel_with_every_argument(fn):
    a, b = _t(), _t()
    launch = fast_launch.launcher(fn)
    launch[(4,)](a, b, 32, BLOCK=16)
    assert len(fn.slow) == 1 and not fn.fast
    launch[(4, 2)](a, b, 32, BLOCK=16)
    assert len(fn.slow) == 1
    assert fn.fast == [((4, 2, 1), (a, b, 32, 16, False))]  # signature order, the default filled in
    launch[lambda meta: (meta["n"] // meta["BLOCK"],)](a, b, 32, BLOCK=16, flag=False)  # a grid function
    assert len(fn.slow) == 2  # flag passed by keyword: another key
    launch[lambda meta: (meta["n"] // meta["BLOCK"],)](a, b, 32, BLOCK=16, flag=False)
    assert fn.fast[-1] == ((2, 1, 1), (a, b, 32, 16, False))


def test_a_recording_lists_each_fast_launch_with_its_tensors_positions(fn):
    """recording() lists a first launch (Triton's path) as None and a fast one with its values and where its tensors
    are among them (replay replaces exactly those): None in a tensor's place is no tensor."""
    a, b = _t(), _t()
    launch = fast_launch.launcher(fn)
    with fast_launch.recording() as launches:
        launch[(4,)](a, b, 32, BLOCK=16)
        launch[(4,)](a, b, 48, BLOCK=16)  # the same key (16 divides both)
        launch[(4,)](a, None, 32, BLOCK=16)  # another key (b's type): Triton's path
        launch[(4,)](a, None, 32, BLOCK=16)
    assert launches[0] is None and launches[2] is None
    assert launches[1].values == (a, b, 48, 16, False) and launches[1].tensors == (0, 1)
    assert launches[3].values == (a, None, 32, 16, False) and launches[3].tensors == (0,)
    with fast_launch.recording() as outside:
        pass
    launch[(4,)](a, b, 32, BLOCK=16)
    assert outside == [] and len(launches) == 4  # nothing listed once closed


@pytest.mark.parametrize("other", [
    dict(n=33),                      # 16 no longer divides it
    dict(n=1),                       # Triton makes 1 a constant
    dict(n=1 << 31),                 # int64
    dict(n=True),                    # a bool, not an int
    dict(a=_t(1)),                   # an unaligned address
    dict(a=_t(dtype=torch.bfloat16)),
    dict(b=1.0),                     # a float where a tensor was
    dict(BLOCK=32),                  # a constexpr
    dict(flag=True),
])
def test_any_difference_triton_specializes_on_takes_triton_s_path(fn, other):
    base = dict(a=_t(), b=_t(), n=32, BLOCK=16, flag=False)
    launch = fast_launch.launcher(fn)
    launch[(1,)](base["a"], base["b"], base["n"], BLOCK=16, flag=False)
    call = {**base, **other}
    launch[(1,)](call["a"], call["b"], call["n"], BLOCK=call["BLOCK"], flag=call["flag"])
    assert len(fn.slow) == 2 and not fn.fast


def test_what_triton_does_not_specialize_on_shares_the_kernel(fn):
    """Other integers of the same class, other tensors of the same dtype and alignment, other floats."""
    launch = fast_launch.launcher(fn)
    launch[(1,)](_t(), _t(), 32, BLOCK=16)
    launch[(1,)](_t(8), _t(), 48, BLOCK=16)  # 8 halves: 16 bytes
    launch[(1,)](_t(), _t(), 4096 + 16, BLOCK=16)
    launch[(1,)](_t(), 0.125, 32, BLOCK=16)  # a float argument (a softmax scale): keyed by its type
    launch[(1,)](_t(), 0.5, 32, BLOCK=16)
    assert len(fn.slow) == 2 and len(fn.fast) == 3
    assert fn.fast[-1][1][1] == 0.5  # the call's own value reaches the kernel


def test_positional_constexpr_is_keyed_by_value(fn):
    launch = fast_launch.launcher(fn)
    launch[(1,)](_t(), _t(), 32, 16)
    launch[(1,)](_t(), _t(), 32, 32)  # BLOCK positionally: 16 and 32 would be one int class
    assert len(fn.slow) == 2


def test_hooks_uncovered_types_and_the_switch_take_triton_s_path(fn, monkeypatch):
    from triton import knobs
    launch = fast_launch.launcher(fn)
    launch[(1,)](_t(), _t(), 32, BLOCK=16)
    launch[(1,)](_t(), object(), 32, BLOCK=16)  # a type the key does not cover
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)  # a profiler's
    try:
        launch[(1,)](_t(), _t(), 32, BLOCK=16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    launch[(1,)](_t(), _t(), 32, BLOCK=16)
    assert len(fn.slow) == 4 and not fn.fast


def test_the_inlined_integer_class_is_int_class():
    values = [0, 1, 2, 15, 16, 17, -1, -16, -17, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, 1 << 40,
              (1 << 63) - 1, 1 << 63]
    key = fast_launch.call_key(tuple(values), {}, (False,) * len(values), 0)
    assert list(key[1]) == [fast_launch._int_class(v) for v in values]


def test_the_key_is_checked_against_the_installed_triton(monkeypatch):
    """The installed Triton passes the check; one that also specialized on 8 | n would not."""
    import triton._C.libtriton as libtriton
    monkeypatch.setattr(fast_launch, "_checked", [])
    assert fast_launch._matches_triton()
    real = libtriton.native_specialize_impl
    finer = lambda backend, x, *a: (real(backend, x, *a), isinstance(x, int) and x % 8 == 0)  # noqa: E731
    monkeypatch.setattr(libtriton, "native_specialize_impl", finer)
    monkeypatch.setattr(fast_launch, "_checked", [])
    assert not fast_launch._matches_triton()
