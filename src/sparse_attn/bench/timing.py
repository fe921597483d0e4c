"""Timers: median of repetitions after warm-up; peak memory of one call.

CUDA: one ``torch.cuda.Event`` pair per repetition, the L2 cache flushed (a 256 MB write) and the
``.grad`` of the inputs reset before each, neither inside the timed span (as
``triton.testing.do_bench``). CPU: ``time.perf_counter`` around each repetition.
:func:`time_interleaved` times several functions with their repetitions interleaved (the suite runner
uses it for the providers of one row, so their ratio is taken under the same clock and power states).

``reps=None`` picks the count from a first estimate: enough to fill ~``target_ms`` (at least 3,
at most 100 on CUDA / 20 on CPU); warm-up fills ~25 ms (1..10 calls). The first call, which
compiles/autotunes, is never timed.

``hide_host=True`` (CUDA): each timed call is queued behind a GPU sleep a little longer than the
host's time to issue one call, so the events time the GPU's work alone, not the host's: without it a
call whose host side outlasts its kernels (the 8-bit path at 1K-4K tokens) times the host.
:func:`host_issue_ms` measures that host side.

Peak memory (CUDA only; ``None`` on CPU, where torch allocations are invisible to tracemalloc):
``torch.cuda.max_memory_allocated()`` during one call minus ``torch.cuda.memory_allocated()``
just before it, i.e. the extra memory the call needs beyond its inputs (and, in ``bwd`` mode,
beyond the saved forward graph that is alive throughout).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

_L2_FLUSH_BYTES = 256 << 20
_flush_buf: dict[str, torch.Tensor] = {}


def _flush() -> torch.Tensor:
    """The current device's L2 flush buffer (written before each timed call)."""
    dev = str(torch.cuda.current_device())
    if dev not in _flush_buf:
        _flush_buf[dev] = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    return _flush_buf[dev]


def reset_grads(grad_to_none: Sequence[torch.Tensor]) -> None:
    """``.grad = None`` on each tensor: a backward being timed must not accumulate into old grads."""
    for t in grad_to_none:
        t.grad = None


def _counts(est_ms: float, reps: int | None, warmup: int | None, target_ms: float, max_reps: int):
    est_ms = max(est_ms, 1e-3)
    if reps is None:
        reps = int(min(max(target_ms / est_ms, 3), max_reps))
    if warmup is None:
        warmup = int(min(max(25.0 / est_ms, 1), 10))
    return reps, warmup


# GPU clock cycles per millisecond assumed when sizing the sleep of hide_host: 2 GHz, above the boost
# clock of the GPUs measured (H100 / H200 1.98 GHz), so the sleep lasts at least as long as asked
_SLEEP_CYCLES_PER_MS = 2_000_000
_SLEEP_MAX_MS = 50.0


def host_issue_ms(fn: Callable[[], object], reps: int = 7, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    """Median wall milliseconds the host takes to issue one call of ``fn`` on CUDA, with the GPU idle
    before each call (synchronized) and not waited for after it: what an eager caller pays per call
    on the host. Where it exceeds the call's GPU time, back-to-back calls are bound by the host."""
    fn()
    times = []
    for _ in range(reps):
        reset_grads(grad_to_none)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def time_cuda(fn: Callable[[], object], *, reps: int | None = None, warmup: int | None = None,
              grad_to_none: Sequence[torch.Tensor] = (), target_ms: float = 200.0, hide_host: bool = False) -> float:
    """Median milliseconds of ``fn`` on the current CUDA device. ``hide_host``: the GPU's time alone
    (module docstring)."""
    flush = _flush()
    reset_grads(grad_to_none)
    fn()  # compile / autotune / first-touch
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(2):
        reset_grads(grad_to_none)
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / 2  # at least the host's issue time of one call
    end.record()
    torch.cuda.synchronize()
    est_ms = start.elapsed_time(end) / 2
    reps, warmup = _counts(est_ms, reps, warmup, target_ms, 100)
    for _ in range(warmup):
        reset_grads(grad_to_none)
        fn()
    # a sleep 1.5x the host's issue time ahead of each timed call: the host then queues the call while
    # the GPU sleeps, and the calls' events hold no wait for the host. Calls whose GPU time clearly
    # exceeds the host's need none: the unsynchronized loop below keeps the host ahead by itself.
    hide = hide_host and host_ms > 0.5 * est_ms
    sleep_cycles = int(min(1.5 * host_ms, _SLEEP_MAX_MS) * _SLEEP_CYCLES_PER_MS) if hide else 0
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        reset_grads(grad_to_none)
        flush.zero_()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_interleaved(fns: Sequence[Callable[[], object]], device, *, reps: int | None = None,
                     warmup: int | None = None, grad_to_none: Sequence[Sequence[torch.Tensor]] | None = None,
                     target_ms: float = 200.0) -> list[float]:
    """Median milliseconds of each of ``fns`` (already called once: compiled, autotuned), their
    repetitions interleaved A B C A B C ... so that every fn meets the same spread of clock and power
    states. The lent H100 sits at its power cap under attention kernels and its SM clock moved between
    1.4 and 2.0 GHz within seconds (benchmarks/results/gqa-spread-power-h100.json): timed back to back
    in blocks, two providers' ratio picked up whatever the board did in between. A kernel also inherits
    its predecessor's power state, so the calls follow :func:`balanced_order`: each fn follows every
    other exactly equally often, and never itself. Every fn gets the same number of repetitions, chosen
    from the slowest one's estimate (rounded up to whole cycles of that order: multiples of n - 1).
    CUDA: events and an L2 flush before each call, as :func:`time_cuda`; CPU:
    ``time.perf_counter``."""
    grads = list(grad_to_none) if grad_to_none is not None else [()] * len(fns)
    if len(grads) != len(fns):
        raise ValueError(f"grad_to_none has {len(grads)} entries for {len(fns)} functions")
    cuda = torch.device(device).type == "cuda"

    def once(i: int) -> float:
        reset_grads(grads[i])
        if not cuda:
            t0 = time.perf_counter()
            fns[i]()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i]()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    n = len(fns)
    est = max(max(once(i), once(i)) for i in range(n))
    asked = warmup
    reps, warmup = _counts(est, reps, warmup, target_ms, 100 if cuda else 20)
    if not cuda and asked is None:  # as time_cpu: the CPU reference is slow (--warmup's help says so)
        warmup = min(warmup, 2)
    cycle = balanced_order(n)
    per_cycle = len(cycle) // n  # calls of each fn in one cycle
    reps = -(-reps // per_cycle) * per_cycle
    # warm-up: each fn's first `warmup` calls in the cycle's order (the cycle's first warmup * n calls gave
    # some fns more and some none: with four fns and warmup 1, fn 1 had no warm-up call)
    left = [warmup] * n
    for i in cycle * -(-warmup // per_cycle):
        if left[i]:
            left[i] -= 1
            reset_grads(grads[i])
            fns[i]()
    calls = cycle * (reps // per_cycle)
    if not cuda:
        times = [[] for _ in fns]
        for i in calls:
            times[i].append(once(i))
        return [statistics.median(t) for t in times]
    flush = _flush()
    events = [[] for _ in fns]
    for i in calls:
        reset_grads(grads[i])
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i]()
        end.record()
        events[i].append((start, end))
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in ev) for ev in events]


def balanced_order(n: int) -> list[int]:
    """A cyclic call order of ``n`` fns in which every ordered pair of different fns is adjacent exactly
    once (an Eulerian circuit of the complete directed graph, so also across the wrap from the last
    call back to the first) and no fn follows itself: ``n * (n - 1)`` calls, each fn ``n - 1`` times
    (``[0]`` for one fn). Rotating one order by a place per round (the earlier scheme) left each fn the
    same predecessor in most rounds with three or more fns: with four, one fn never ran after another."""
    if n <= 1:
        return [0] * n
    unused = {a: [b for b in range(n) if b != a] for a in range(n)}  # edges a -> b not yet walked
    stack, circuit = [0], []
    while stack:  # Hierholzer
        a = stack[-1]
        if unused[a]:
            stack.append(unused[a].pop())
        else:
            circuit.append(stack.pop())
    circuit.reverse()
    return circuit[:-1]  # the circuit returns to its start: that last edge is the wrap


def time_cpu(fn: Callable[[], object], *, reps: int | None = None, warmup: int | None = None,
             grad_to_none: Sequence[torch.Tensor] = (), target_ms: float = 200.0, hide_host: bool = False) -> float:
    """Median milliseconds of ``fn`` by ``time.perf_counter`` (``hide_host`` has no meaning on a CPU,
    where the call is the host's work: accepted and ignored)."""
    reset_grads(grad_to_none)
    t0 = time.perf_counter()
    fn()  # first call: lazy imports, allocator warm-up
    first_ms = (time.perf_counter() - t0) * 1e3
    asked = warmup
    reps, warmup = _counts(first_ms, reps, warmup, target_ms, 20)
    # the CPU reference is slow: at most 2 default warm-up calls, but a warmup the caller gave is kept
    for _ in range(warmup if asked is not None else min(warmup, 2)):
        reset_grads(grad_to_none)
        fn()
    times = []
    for _ in range(reps):
        reset_grads(grad_to_none)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_fn(fn, device: torch.device, **kw) -> float:
    return time_cuda(fn, **kw) if torch.device(device).type == "cuda" else time_cpu(fn, **kw)


def peak_memory(fn: Callable[[], object], device: torch.device,
                grad_to_none: Sequence[torch.Tensor] = ()) -> int | None:
    """Extra bytes one call of ``fn`` allocates at its peak (CUDA); None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    reset_grads(grad_to_none)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    reset_grads(grad_to_none)
    return int(peak)
