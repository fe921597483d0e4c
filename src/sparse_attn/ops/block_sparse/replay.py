"""Short forwards launched again without :func:`launch.forward`'s host work.

A decoding step calls the forward once a layer with inputs of one geometry: every layer's query, cache and
offsets have the same shapes, strides, dtypes and alignment, so ``launch.forward`` decides the same plan, the
same grids and the same scalar arguments each time, and only the tensors differ. Those decisions (plan, config,
strides, split-KV parts, two fast-launch keys over ~90 arguments) took 110-190 us of host time a call on the
H200's host, against a GPU time of 35-45 us (benchmarks/host_overhead_probe.py; benchmarks/NOTES.md, "Where a
decoding step's time goes, and replayed launches").

So the short-query path is recorded the first time a geometry is seen (:func:`find` says when): the fast
launches it makes (ops.fast_launch.recording) and the tensors it allocates become a :class:`Recipe`, whose
arguments are the recorded ones with each tensor replaced by its slot (an input of the call, by position, or a
fresh allocation). Later calls with the same :func:`key` allocate the same buffers, put their own tensors in the
slots and call the kept kernels' launchers directly (:func:`run`): the same kernels on the same arguments, so
the same bits. The key holds everything the recorded path read: every input tensor's shape, strides, dtype,
device, 16-byte alignment and which inputs are one tensor; the call's other arguments by value; the launch
module's settings (``launch._replay_settings``) and the current device. A call whose recording is incomplete
(a tensor that is neither an input nor an allocation; a launch that took Triton's path twice, as a kernel's
first launch does once) is never replayed. ``SPARSE_ATTN_REPLAY=0`` turns this off.

On the CI machine a call on the path takes 39 us of host time, a replayed one 17-20 us, and a new geometry's first
call, keyed and recorded, 59-60 us. A growing cache makes a new geometry every step, which pays off from the step's
second layer on; a cache growing under one call a step never does. So after MISS_STREAK new geometries
in a row a new one is only marked :data:`SEEN` and recorded when it comes back, as the first build did always
(benchmarks/NOTES.md, "Replay, recorded at first sight"). Calls through ``sparse_attn.attention`` do better at a
new length: ops.block_sparse.entry derives its recipe from the previous length's (launch.derive_for_length, from the
:class:`Recipe`'s ``length_spec``), so a step's first layer, and a cache growing under one call a step, replay too.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ...plan_cache import PlanCache
from .. import fast_launch

ENABLED = os.environ.get("SPARSE_ATTN_REPLAY", "1") != "0"
MAX_KEPT = 64  # geometries remembered (a growing cache makes one a step: each is used by that step's layers)
MISS_STREAK = 16  # new geometries in a row after which a new one is recorded only when seen again
RECORD = "record"  # find's answer: record this call
SEEN = "seen"  # a geometry seen once during a streak of new ones, not recorded yet
RETRY = "retry"  # a geometry whose recording had a launch take Triton's path (a kernel's first launch)
NEVER = "never"  # a geometry whose recording was incomplete (for good)
_cache = PlanCache(MAX_KEPT)  # key -> Recipe, SEEN, RETRY or NEVER, least recently used dropped
_kept = _cache._plans  # the table itself (tests read it)
_misses = [0]  # new geometries in a row (one count for all threads: a heuristic, races only blur it)
_generation = [0]  # moved by clear(): a recipe a caller kept from an earlier generation is not run (fresh())
MAX_SCRATCH = 8  # a few geometries' (a model's full and sliding-window layers alternate)
# (device, stream, slot, shape, dtype) -> a buffer a recipe's launches use and nothing returns (split-KV parts, an LSE
# the caller drops): launches on one stream run in order, so each call on that stream may reuse it
_scratch = PlanCache(MAX_SCRATCH)


class Recipe(NamedTuple):
    """A recorded short forward: ``allocs`` the (shape, dtype) of each buffer it allocated (contiguous), in
    slots after the inputs'; ``launches`` (fast_launch.Launch, arguments with None at each tensor, (position,
    slot) of each tensor); ``out`` / ``lse`` the slots of the results; ``length_spec``: what launch.forward decided
    from the key length (launch.LengthSpec, for launch.derive_for_length), where it recorded that."""
    allocs: tuple
    launches: tuple
    out: int
    lse: int
    length_spec: object = None


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
            parts.append(geometry(t))
        else:
            return None
    # fast launches keep their kernels per current device (CPU tensors: the interpreter, no device)
    return tuple(parts), scalars, fast_launch._device() if inputs[0].is_cuda else None


def geometry(t: torch.Tensor) -> tuple:
    """What a key holds of a tensor: shape, strides, dtype, device and 16-byte alignment."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def find(k: tuple):
    """What to do with a call of key ``k``: run its :class:`Recipe`; :data:`RECORD` it (the caller then calls
    :func:`keep`); or, for :data:`NEVER` or None, take the path unrecorded (None: a new geometry after a streak
    of new ones, now :data:`SEEN`)."""
    found = _cache.find(k)
    if found is None:
        _misses[0] += 1
        if _misses[0] <= MISS_STREAK:
            return RECORD
        _cache.put(k, SEEN)
        return None
    _misses[0] = 0
    return RECORD if found is SEEN or found is RETRY else found


def kept(k: tuple) -> Recipe | None:
    """The :class:`Recipe` kept for key ``k`` (a hit, as :func:`find` counts one), or None without a side effect: for
    a caller that takes the path otherwise, which then finds the key itself (ops.block_sparse.entry)."""
    found = _cache._plans.get(k)
    if type(found) is not Recipe:
        return None
    _cache.find(k)  # now the most recently used
    _misses[0] = 0
    return found


def streaking() -> bool:
    """Whether new geometries came :data:`MISS_STREAK` times in a row (a cache growing under one call a step):
    nothing is recorded at first sight then, and nothing replays."""
    return _misses[0] >= MISS_STREAK


def keep(k: tuple, inputs: tuple, allocs: list, launches: list, expected: int, result: tuple,
         length_spec=None) -> None:
    """Keep the recipe of a call recorded under key ``k``: its ``inputs``, the buffers it allocated (``allocs``), the
    fast launches it made (``launches``, of which it meant to make ``expected``), its ``result`` (out, lse), two
    of its buffers, and ``length_spec`` (Recipe). An incomplete recording is kept as :data:`NEVER`, or as
    :data:`RETRY` where the only gap is a launch that took Triton's path (None in ``launches``) and the key was not
    already RETRY."""
    # plain loops, no generator expressions: this runs on a decoding call's host path (9.5 us with them on the
    # CI machine, of a 39 us call)
    slot = {}
    for i, t in enumerate(inputs):
        if t is not None and id(t) not in slot:
            slot[id(t)] = i
    for j, t in enumerate(allocs):
        slot[id(t)] = len(inputs) + j
    through_triton = None in launches
    complete = len(launches) == expected and not through_triton and id(result[0]) in slot and id(result[1]) in slot
    for t in allocs:
        complete = complete and t.is_contiguous()
    recorded = []
    for launch in launches if complete else ():
        values, positions = launch.values, launch.tensors
        tensors = tuple([(pos, slot.get(id(values[pos]))) for pos in positions])
        # no tensor kept (in the template, or in the recorded launch): it would hold a layer's cache alive
        template = list(values)
        for pos, s in tensors:
            complete = complete and s is not None
            template[pos] = None
        bare = fast_launch.Launch(launch.run, launch.function, launch.metadata, launch.grid, ())
        recorded.append((bare, tuple(template), tensors))
    recipe = None
    if complete:
        recipe = Recipe(tuple([(tuple(t.shape), t.dtype) for t in allocs]), tuple(recorded), slot[id(result[0])],
                        slot[id(result[1])], length_spec)
    elif through_triton and _cache.find(k) is not RETRY:
        recipe = RETRY  # whether the rest was complete shows on the next try
    _cache.put(k, recipe if recipe is not None else NEVER)


def usable() -> bool:
    """Whether a kept recipe may run now: the fast path on and no launch hook set (a profiler sees every
    launch through Triton's path)."""
    return ENABLED and fast_launch.ENABLED and not fast_launch._hooked()


def run(recipe: Recipe, inputs: tuple, device: torch.device, lse_wanted: bool = True
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``recipe`` on this call's ``inputs`` (those of its key): (out, lse). The buffers the call does not
    return (the split-KV parts; the LSE where not ``lse_wanted``, whose value is then scratch) are the stream's
    scratch (:data:`_scratch`), except while a CUDA graph is captured: one allocation a call, not four (3 us each on
    the H200's host, a quarter of a served decoding call; benchmarks/NOTES.md, "Eager decoding's host path")."""
    table = list(inputs)
    stream = fast_launch._stream(fast_launch._device())
    fresh_only = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    for j, (shape, dtype) in enumerate(recipe.allocs):
        slot = len(inputs) + j
        if fresh_only or slot == recipe.out or (lse_wanted and slot == recipe.lse):
            table.append(torch.empty(shape, dtype=dtype, device=device))
        else:
            table.append(_scratch.get((device, stream, j, shape, dtype),
                                      lambda s=shape, d=dtype: torch.empty(s, dtype=d, device=device)))
    for launch, template, tensors in recipe.launches:
        values = list(template)
        for pos, s in tensors:
            values[pos] = table[s]
        launch(stream, values)
    return table[recipe.out], table[recipe.lse]


def fresh(generation: int) -> bool:
    """Whether a recipe taken at ``generation`` (:func:`generation`) may still run: no clear() since."""
    return generation == _generation[0]


def generation() -> int:
    """How many times :func:`clear` has run: what a caller holding a recipe checks with :func:`fresh`."""
    return _generation[0]


def hit() -> None:
    """A kept recipe ran for a caller that holds it (ops.block_sparse.entry): the streak of new geometries ends, as a
    hit in :func:`find` ends it."""
    _misses[0] = 0


def clear() -> None:
    """Forget every kept recipe (and the streak of new geometries, and the scratch buffers); recipes callers hold
    are no longer :func:`fresh`."""
    _cache.clear()
    _scratch.clear()
    _misses[0] = 0
    _generation[0] += 1
