"""Triton launches without ``JITFunction.run``'s per-call work.

Every launch through ``kernel[grid](*args, **kw)`` binds the arguments, specializes each one (dtype and
16-byte alignment of a tensor; of an integer, its width, whether it is 1 and whether 16 divides it),
builds a cache key from that and looks the compiled kernel up, in Python, about 0.4 us an argument on
the H200's host (an empty kernel of 30 arguments took 22-25 us to launch, one of 1 argument 11-12 us);
the forward takes ~90. A decoding step, whose kernels run for tens of microseconds, waits on that
(benchmarks/host_overhead_probe.py, NOTES.md "Host time of a call").

:func:`launcher` wraps a JIT function. The first call with a given key goes through Triton (which
compiles or finds the kernel and launches it) and keeps the ``CompiledKernel`` it returns; later calls
with that key launch the kept kernel directly. The key holds the current device and, per argument:
for a tensor its dtype and whether its address is 16-byte aligned; for a runtime integer whether it
is 1, whether 16 divides it and its width (int32, int64, uint64); for a runtime float nothing but its
type; any other value (constexprs, bools, None) itself, with every argument's type. Keys by class, not
by value, so that a decoding loop (a new cache length each call) or a changing scale reuses the kernel
and the table stays small. That is what Triton specializes on, or finer, so a
kept kernel is the one Triton would pick; :func:`_matches_triton` checks this against the installed
Triton's own specialization at first use, and turns the fast path off if it disagrees. Not seen by
the key: Triton settings changed at run time (``knobs``' debug and instrumentation modes). With a
launch-enter hook set (a profiler such as proton) every call takes Triton's path.
``SPARSE_ATTN_FAST_LAUNCH=0`` turns it off. A fast launch returns None (Triton's returns the kernel).

:func:`recording` lists the fast launches made while it is open, each with everything its kernel's launcher was
given, so that a caller can launch the same kernels again with other tensors (ops/block_sparse/replay.py); a launch
that took Triton's path is listed as None.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

ENABLED = os.environ.get("SPARSE_ATTN_FAST_LAUNCH", "1") != "0"
_BY_VALUE = frozenset((float, bool, str, type(None), torch.dtype))  # keyed by the value itself
_COVERED = _BY_VALUE | {int, torch.Tensor}  # exact types: a tensor subclass takes Triton's path
_LAUNCHERS: dict = {}
_checked: list = []  # [verdict of _matches_triton] once computed
_recorder = threading.local()  # .launches: the open recording's list, or None


class Launch:
    """One fast launch as :func:`recording` lists it: the kept kernel's launcher, function handle and packed
    metadata, the grid (three axes), every argument in signature order, and ``tensors``: the positions in
    ``values`` of the tensors (every one: the launch's key holds each argument's type)."""
    __slots__ = ("run", "function", "metadata", "grid", "values", "tensors")

    def __init__(self, run, function, metadata, grid: tuple, values: tuple, tensors: tuple = ()):
        self.run, self.function, self.metadata, self.grid, self.values = run, function, metadata, grid, values
        self.tensors = tensors

    def __call__(self, stream: int, values: tuple) -> None:
        """Launch this kernel again on ``stream`` with ``values`` in place of the recorded arguments."""
        self.run(*self.grid, stream, self.function, self.metadata, None, None, None, *values)


@contextlib.contextmanager
def recording():
    """Yields the list of the launches made through fast launchers on this thread while open (:class:`Launch`,
    or None for one that took Triton's path: a first launch, hooks set, the fast path off)."""
    outer = getattr(_recorder, "launches", None)
    _recorder.launches = launches = []
    try:
        yield launches
    finally:
        _recorder.launches = outer


def _record(launch) -> None:
    launches = getattr(_recorder, "launches", None)
    if launches is not None:
        launches.append(launch)


def launcher(fn):
    """``fn`` (a ``triton.jit`` function) behind a :class:`FastLauncher`, one per function; anything else
    (the interpreter's functions, a test's stand-in) as it is."""
    if type(fn).__name__ != "JITFunction" or not hasattr(fn, "params"):
        return fn
    if fn not in _LAUNCHERS:
        _LAUNCHERS[fn] = FastLauncher(fn)
    return _LAUNCHERS[fn]


def _int_class(x: int):
    """A runtime integer as Triton specializes it, or finer: for an int32 other than 1, whether 16 divides
    it; else (is 1, 16 divides it, int32, uint64). call_key inlines the first case."""
    if -0x80000000 <= x <= 0x7FFFFFFF and x != 1:
        return x & 15 == 0
    return x == 1, x % 16 == 0, -0x80000000 <= x <= 0x7FFFFFFF, x >= 0x8000000000000000


def call_key(args: tuple, kw: dict, constexpr: tuple, device: int):
    """The key of one launch (module docstring); ``constexpr[i]``: positional argument i is a constexpr
    (keyed by its value). None where an argument's type is not covered: the call takes Triton's path.
    One comprehension, no helper call per argument: a helper per argument cost 57 us a forward launch on
    the CI machine, this about 15."""
    types, kw_types = tuple(map(type, args)), tuple(map(type, kw.values()))
    if not (_COVERED.issuperset(types) and _BY_VALUE.union((int,)).issuperset(kw_types)):
        return None
    tensor = torch.Tensor
    parts = tuple([(a.dtype, a.data_ptr() % 16 == 0) if t is tensor else a if c or (t is not int and t is not float)
                   else None if t is float  # its type (in ``types``) is all Triton keys a float on
                   else a & 15 == 0 if -0x80000000 <= a <= 0x7FFFFFFF and a != 1 else _int_class(a)
                   for a, t, c in zip(args, types, constexpr)])
    return device, parts, types, tuple(kw.items()), kw_types


def _matches_triton() -> bool:
    """Whether the installed Triton specializes integers and tensors on nothing that call_key leaves out:
    sample values with equal keys must get equal specializations from Triton's own function. False
    (fast path off) where they do not, or where that function cannot be called as expected."""
    if not _checked:
        try:
            from triton._C.libtriton import native_specialize_impl
            from triton.backends.compiler import BaseBackend

            def spec(x):
                return native_specialize_impl(BaseBackend, x, False, True, True)
            steps = (-17, -16, -8, -1, 0, 1, 2, 4, 8, 15, 16, 24)  # every residue class a Triton might key on
            ints = [s * (b + d) for b in (0, 16, 1 << 31, 1 << 32, 1 << 62) for d in steps for s in (1, -1)]
            ints += [(1 << 63) + d for d in (-16, -1, 0, 1, 16)] + [(1 << 64) - 16, (1 << 64) - 1]
            ints = [x for x in ints if -(1 << 63) <= x < 1 << 64]
            base = torch.empty(64, dtype=torch.float32)
            tensors = [t[o:] for o in (0, 1, 4) for t in (base, base.half(), base.to(torch.int32))]
            seen: dict = {}
            ok = all(seen.setdefault(_int_class(x), spec(x)) == spec(x) for x in ints)
            floats = [0.0, 1.0, -1.0, 0.5, 16.0, 1e30, float("inf"), float("nan")]
            ok = ok and all(spec(x) == spec(floats[0]) for x in floats)  # one key for every float
            ok = ok and all(seen.setdefault((t.dtype, t.data_ptr() % 16 == 0), spec(t)) == spec(t) for t in tensors)
        except Exception:  # another Triton's signature: no fast path
            ok = False
        _checked.append(ok)
    return _checked[0]


def _device() -> int:
    """The current CUDA device, where Triton launches (and loads a kernel's binary). Asked only once CUDA
    tensors exist, so without torch.cuda.current_device's lazy-init check (0.12 of its 0.25 us on the H200's
    host, asked two to three times a decoding call)."""
    return torch._C._cuda_getDevice()


def _stream(device: int) -> int:
    """The current stream of ``device`` as Triton's NVIDIA driver reads it."""
    return torch._C._cuda_getCurrentRawStream(device)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton keeps them in a HookChain, empty by default; older ones None)."""
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """``launcher(fn)[grid](*args, **kw)`` launches as ``fn[grid](*args, **kw)`` would (module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.names = tuple(p.name for p in fn.params)
        self.constexpr = tuple(bool(p.is_constexpr) for p in fn.params)
        self.defaults = {p.name: p.default for p in fn.params if p.has_default}
        # call_key -> (names of the parameters after the positional ones, and the kept kernel's launcher,
        # function handle and packed metadata: what Triton's own launch passes to it; the positions of the
        # tensors among the arguments in signature order, for recordings)
        self.kernels: dict = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _tensor_positions(self, types: tuple, rest: tuple) -> tuple:
        """Where the tensors are among a launch's values (positional arguments of ``types``, then the parameters
        ``rest`` by keyword or default): keyword values are never tensors (call_key), defaults may be."""
        return (tuple(i for i, t in enumerate(types) if t is torch.Tensor)
                + tuple(len(types) + j for j, n in enumerate(rest) if isinstance(self.defaults.get(n), torch.Tensor)))

    def _launch(self, grid, *args, **kw):
        if not ENABLED or _hooked() or not _matches_triton():
            _record(None)
            return self.fn[grid](*args, **kw)
        device = _device()
        key = call_key(args, kw, self.constexpr, device)
        kept = self.kernels.get(key) if key is not None else None
        if kept is None:
            _record(None)
            kernel = self.fn[grid](*args, **kw)
            if key is not None and kernel is not None:
                kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an async compile
                # after a launch its handles are loaded: run is the launcher, function the CUfunction
                rest = self.names[len(args):]
                self.kernels[key] = (rest, kernel.run, kernel.function, kernel.packed_metadata,
                                     self._tensor_positions(key[2], rest))
            return kernel
        rest, run, function, metadata, tensors = kept
        values = args + tuple(kw[n] if n in kw else self.defaults[n] for n in rest)  # the signature's order
        if callable(grid):  # Triton hands a grid function the bound arguments by name
            grid = grid(dict(zip(self.names, values)))
        n = len(grid)
        grid = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        if getattr(_recorder, "launches", None) is not None:
            _recorder.launches.append(Launch(run, function, metadata, grid, values, tensors))
        # CompiledKernel.run's arguments as JITFunction.run passes them, without launch metadata or hooks
        run(*grid, _stream(device), function, metadata, None, None, None, *values)
        return None
