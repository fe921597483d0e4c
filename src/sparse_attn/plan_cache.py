"""Small caches: an LRU for per-shape plans (varlen and grouped attention build theirs once per batch
signature, so a training loop does not rebuild them every step), and :class:`LastOne` for what every layer of
a forward would otherwise rebuild from the same tensors."""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Hashable


class PlanCache:
    """The ``max_size`` most recently used plans, keyed by any hashable signature."""

    def __init__(self, max_size: int = 16):
        self.max_size = max_size
        self._plans: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, build: Callable[[], object]):
        """The plan for ``key``, built with ``build()`` on a miss (the oldest entry is then dropped)."""
        plan = self.find(key)
        if plan is None:
            plan = build()
            self.put(key, plan)
        return plan

    def find(self, key: Hashable):
        """The plan for ``key`` (now the most recently used), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key: Hashable, plan) -> None:
        """Keep ``plan`` for ``key`` as the most recently used (the oldest entry is dropped past max_size)."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        if len(self._plans) > self.max_size:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


class LastOne:
    """The value built for the last key object(s) seen (a mask, offsets tensors), while those same objects,
    unchanged in place (their version counters), come back with the same signature: every layer of a forward
    gets the same mask and offsets, so they are read or copied once a forward, not once a layer. ``objs``: one
    tensor or a tuple of them. Inference tensors have no version counter: never remembered."""

    def __init__(self):
        self._entry: tuple | None = None  # (weakrefs to the objects, signature, value)

    def get(self, objs, signature: tuple, build: Callable[[], object]):
        objs = objs if isinstance(objs, tuple) else (objs,)
        try:
            sig = signature + tuple(obj._version for obj in objs)
        except RuntimeError:
            return build()
        entry = self._entry
        if (entry is not None and entry[1] == sig and len(entry[0]) == len(objs)
                and all(ref() is obj for ref, obj in zip(entry[0], objs))):
            return entry[2]
        value = build()
        self._entry = (tuple(weakref.ref(obj) for obj in objs), sig, value)
        return value
