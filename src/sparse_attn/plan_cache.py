"""A small LRU cache for per-shape plans (varlen and grouped attention build theirs once per batch
signature, so a training loop does not rebuild them every step)."""
from __future__ import annotations

import collections
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
