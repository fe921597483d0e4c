"""Host time of a decoding call's Python with replays off and on, on any machine (no GPU): the kernels of Triton's
interpreter stand behind a no-op "compiled kernel", so ops.fast_launch keeps them and every launch costs nothing,
and what is timed is the host path of ``device_plan_attention_op`` on a 32K cache (1 x 32 query heads, 8 kv heads,
d128): ``fixed`` one geometry every call (a model's layers within a step), ``growing`` the cache one key longer each
call (one call a step), ``pairs`` / ``fours`` one key longer every 2 / 4 calls (a 2- / 4-layer model's steps: the
median is then one kind of call, the replays' for ``fours``). Medians of 600 calls, three rounds.

    PYTHONPATH=src python benchmarks/replay_cpu_probe.py
"""
from __future__ import annotations

import inspect
import os
import statistics
import time
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from sparse_attn.ops import fast_launch  # noqa: E402
from sparse_attn.ops.block_sparse import device_plan_attention_op, launch, replay  # noqa: E402


class JITFunction:  # the type name fast_launch.launcher() accepts
    """An interpreted kernel as fast_launch sees a triton.jit one, whose kept kernel launches nothing."""

    def __init__(self, interpreted_fn):
        sig = inspect.signature(interpreted_fn.fn)
        self.params = [SimpleNamespace(name=n, is_constexpr=p.annotation is tl.constexpr,
                                       has_default=p.default is not inspect.Parameter.empty, default=p.default)
                       for n, p in sig.parameters.items()]

    def __getitem__(self, grid):
        return lambda *args, **kw: SimpleNamespace(run=lambda *values: None, function="f", packed_metadata="m")


def install_stand_in() -> None:
    """Every interpreted kernel launched through ``launch.launcher`` becomes a :class:`JITFunction` stand-in that
    ops.fast_launch keeps and whose launches do nothing (on device 0, stream 0)."""
    shims: dict = {}

    def shimmed(fn):
        if type(fn).__name__ == "InterpretedFunction":
            if fn not in shims:  # built once: its signature is not part of what a launch costs
                shims[fn] = JITFunction(fn)
            fn = shims[fn]
        return fast_launch.launcher(fn)
    launch.launcher = shimmed
    fast_launch._device = lambda: 0
    fast_launch._stream = lambda device: 0
    fast_launch._checked[:] = [True]
    fast_launch.ENABLED = True


def main() -> None:
    install_stand_in()
    q = torch.randn(1, 32, 1, 128).half()
    k = torch.randn(1, 8, 40000, 128).half()
    v = k.clone()

    def median_us(lengths, enabled: bool) -> float:
        replay.ENABLED = enabled
        times = []
        for n in lengths:
            t0 = time.perf_counter()
            device_plan_attention_op(q, k[:, :, :n], v[:, :, :n], True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    for rnd in range(3):
        for label, lengths in (("fixed", [32768] * 600), ("growing", list(range(32768, 33368))),
                               ("pairs", [n for n in range(32768, 33068) for _ in range(2)]),
                               ("fours", [n for n in range(32768, 32918) for _ in range(4)])):
            print(f"round {rnd} {label}: off {median_us(lengths, False):.1f} us, on {median_us(lengths, True):.1f} us")


if __name__ == "__main__":
    main()
