"""Short forwards launched again without :func:`launch.forward`'s host work.

A decoding step calls the forward once a layer with inputs of one geometry: every layer's query, cache and
offsets have the same shapes, strides, dtypes and alignment, so ``launch.forward`` decides the same plan, the
same grids and the same scalar arguments each time, and only the tensors differ. Those decisions (plan, config,
strides, split-KV parts, two fast-launch keys over ~90 arguments) took 110-190 us of host time a call on the
H200's host, against a GPU time of 35-45 us (benchmarks/host_overhead_probe.py; benchmarks/NOTES.md, "Where a
decoding step's time goes, and replayed launches").

So the short-query path is recorded once a geometry has been seen twice (:func:`find` says when): the fast
launches it makes (ops.fast_launch.recording) and the tensors it allocates become a :class:`Recipe`, whose
arguments are the recorded ones with each tensor replaced by its slot (an input of the call, by position, or a
fresh allocation). Later calls with the same :func:`key` allocate the same buffers, put their own tensors in the
slots and call the kept kernels' launchers directly (:func:`run`): the same kernels on the same arguments, so
the same bits. The key holds everything the recorded path read: every input tensor's shape, strides, dtype,
device, 16-byte alignment and which inputs are one tensor; the call's other arguments by value; the launch
module's settings (``launch._replay_settings``) and the current device. A call whose recording is incomplete
(a launch that took Triton's path, a tensor that is neither an input nor an allocation) is never replayed.
``SPARSE_ATTN_REPLAY=0`` turns this off.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ...plan_cache import PlanCache
from .. import fast_launch

ENABLED = os.environ.get("SPARSE_ATTN_REPLAY", "1") != "0"
MAX_KEPT = 64  # geometries remembered (a growing cache makes one a step: each is used by that step's layers)
SEEN = "seen"  # a geometry seen once, not recorded yet
NEVER = "never"  # a geometry whose recording was incomplete
_cache = PlanCache(MAX_KEPT)  # key -> Recipe, SEEN or NEVER, least recently used dropped
_kept = _cache._plans  # the table itself (tests read it)


class Recipe(NamedTuple):
    """A recorded short forward: ``allocs`` the (shape, dtype) of each buffer it allocated (contiguous), in
    slots after the inputs'; ``launches`` (fast_launch.Launch, arguments with None at each tensor, (position,
    slot) of each tensor); ``out`` / ``lse`` the slots of the results."""
    allocs: tuple
    launches: tuple
    out: int
    lse: int


def key(inputs: tuple, scalars: tuple) -> tuple | None:
    """The replay key of a call with tensors ``inputs`` (None allowed) and everything else in ``scalars``
    (hashable), or None where an input is no plain tensor (a subclass may behave otherwise)."""
    parts = []
    first: dict = {}
    for i, t in enumerate(inputs):
        if t is None:
            parts.append(None)
            continue
        j = first.setdefault(id(t), i)
        if j != i:  # the same tensor as input j (the device plan's stand-ins: five places, one tensor)
            parts.append(j)
        elif type(t) is torch.Tensor:
            parts.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0))
        else:
            return None
    # fast launches keep their kernels per current device (CPU tensors: the interpreter, no device)
    return tuple(parts), scalars, fast_launch._device() if inputs[0].is_cuda else None


def find(k: tuple):
    """What is kept for key ``k``: a :class:`Recipe`, :data:`SEEN`, :data:`NEVER`, or None (new: now SEEN)."""
    found = _cache.find(k)
    if found is None:
        _cache.put(k, SEEN)
    return found


def keep(k: tuple, inputs: tuple, allocs: list, launches: list, expected: int, result: tuple) -> None:
    """Keep the recipe of a call recorded under key ``k``: its ``inputs``, the buffers it allocated (``allocs``), the
    fast launches it made (``launches``, of which it meant to make ``expected``) and its ``result`` (out, lse), two
    of its buffers. An incomplete recording is kept as :data:`NEVER`."""
    slot = {}
    for i, t in enumerate(inputs):
        if t is not None:
            slot.setdefault(id(t), i)
    for j, t in enumerate(allocs):
        slot[id(t)] = len(inputs) + j
    recipe = None
    if (len(launches) == expected and all(launch is not None for launch in launches)
            and all(t.is_contiguous() for t in allocs) and all(id(t) in slot for t in result)):
        recorded = []
        for launch in launches:
            tensors = tuple((pos, slot.get(id(a))) for pos, a in enumerate(launch.values) if isinstance(a, torch.Tensor))
            if any(s is None for _, s in tensors):
                break
            # no tensor kept (in the template, or in the recorded launch): it would hold a layer's cache alive
            template = tuple(None if isinstance(a, torch.Tensor) else a for a in launch.values)
            bare = fast_launch.Launch(launch.run, launch.function, launch.metadata, launch.grid, ())
            recorded.append((bare, template, tensors))
        else:
            recipe = Recipe(tuple((tuple(t.shape), t.dtype) for t in allocs), tuple(recorded), slot[id(result[0])],
                            slot[id(result[1])])
    _cache.put(k, recipe if recipe is not None else NEVER)


def usable() -> bool:
    """Whether a kept recipe may run now: the fast path on and no launch hook set (a profiler sees every
    launch through Triton's path)."""
    return ENABLED and fast_launch.ENABLED and not fast_launch._hooked()


def run(recipe: Recipe, inputs: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``recipe`` on this call's ``inputs`` (those of its key): (out, lse)."""
    table = list(inputs)
    for shape, dtype in recipe.allocs:
        table.append(torch.empty(shape, dtype=dtype, device=device))
    stream = fast_launch._stream(fast_launch._device())
    for launch, template, tensors in recipe.launches:
        values = list(template)
        for pos, s in tensors:
            values[pos] = table[s]
        launch(stream, values)
    return table[recipe.out], table[recipe.lse]


def clear() -> None:
    """Forget every kept recipe."""
    _cache.clear()
