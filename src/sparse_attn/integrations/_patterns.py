"""Pattern specs for model integrations: a named pattern (or expression) plus its options, checked
once, turned into a causal-ready BlockLayout per (q_len, kv_len, device), and cached.

A spec is independent of the framework: :mod:`.transformers` maps layers to specs and calls
:func:`PatternSpec.layout`. Positions follow the library's convention: query row ``i`` sits at key
position ``i + Lk - Lq`` (bottom-right alignment), which is what a KV-cached decoder needs.
"""
from __future__ import annotations

import functools
import inspect
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import BlockLayout
from ..patterns.expr import builder_parameters

ADAPTIVE = "adaptive"
# options the integration fills in itself; a user never passes them in pattern_kwargs
_FILLED = {"seq_len", "kv_len", "device"}
# builders whose layout sits relative to the diagonal, token by token: the same whatever token key 0 of a call is
_RELATIVE = {"dense", "causal", "local"}


def _split(expr: str) -> tuple[list[str], list[str]]:
    """``"local|random"`` -> (["local", "random"], ["|"])."""
    tokens = re.split(r"\s*([|&])\s*", expr.strip())
    return tokens[0::2], tokens[1::2]


def _builder(name: str):
    from .. import patterns
    from ..viz import NOT_BUILDERS, pattern_names
    fn = getattr(patterns, name, None) if not name.startswith("_") else None
    if fn is None or not callable(fn) or name in NOT_BUILDERS:
        raise ValueError(f"unknown pattern {name!r}; choose from {', '.join(pattern_names() + [ADAPTIVE])} "
                         "(or join builders with '|' / '&', or pass a callable)")
    return fn


def _frozen(value: Any):
    """A hashable stand-in for an option value (cache keys)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


@dataclass(frozen=True)
class PatternSpec:
    """One pattern and its options.

    ``pattern``: a builder name of :mod:`sparse_attn.patterns` (``"dense"``, ``"local"``,
    ``"streaming"``, ``"random"``, ...), several joined by ``|`` (union) / ``&`` (intersection),
    ``"adaptive"`` (:func:`sparse_attn.predict.meansim` on each forward's q/k), or a callable
    ``fn(q_len, kv_len, device) -> BlockLayout``. ``kwargs``: the builders' options (``window``,
    ``num_sink``, ``density``, ``block_q``, ...); each builder gets those its signature accepts, and an
    option none of them takes (adaptive: that the predictor does not take) is an error.
    Required options must be given (no length-dependent defaults: the same spec serves prefill
    and every decoding step).
    """

    pattern: Any = "dense"
    kwargs: tuple = ()  # sorted (name, value) pairs; use PatternSpec.make

    @classmethod
    def make(cls, pattern, kwargs: dict | None = None) -> PatternSpec:
        kwargs = dict(kwargs or {})
        bad = sorted(set(kwargs) & _FILLED)
        if bad:
            raise ValueError(f"pattern_kwargs may not set {', '.join(bad)}: the integration passes the lengths "
                             "and device of each call")
        spec = cls(pattern, tuple(sorted(kwargs.items())))
        spec.check()
        return spec

    @property
    def options(self) -> dict:
        return dict(self.kwargs)

    @property
    def name(self) -> str:
        if callable(self.pattern):
            return getattr(self.pattern, "__name__", "custom")
        return str(self.pattern)

    @property
    def is_adaptive(self) -> bool:
        return self.pattern == ADAPTIVE

    @property
    def is_dense(self) -> bool:
        return isinstance(self.pattern, str) and self.pattern.strip() in ("dense", "causal")

    @functools.cached_property  # (in the instance's __dict__, which a frozen dataclass still has: asked every call)
    def keys_by_position(self) -> bool:
        """Whether the layout places keys by their position in the call (streaming's sinks, bigbird's global
        and random blocks, strides, block diagonals, a callable's own rule, adaptive's ``attention_sink``):
        right only while key 0 of the call is token 0 of the sequence. dense and local sit relative to the
        diagonal."""
        if callable(self.pattern):
            return True
        if self.is_adaptive:
            return bool(self.options.get("attention_sink"))
        return any(name not in _RELATIVE for name in _split(self.pattern)[0])

    def key(self):
        return (self.pattern if isinstance(self.pattern, str) else ("callable", id(self.pattern)),
                _frozen(self.kwargs))

    def describe(self) -> str:
        return self._described

    @functools.cached_property
    def _described(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.kwargs)
        return f"{self.name}({opts})" if opts else self.name

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Fail early: unknown builders, missing required options, adaptive predictor unavailable."""
        if callable(self.pattern):
            return
        if not isinstance(self.pattern, str):
            raise TypeError(f"pattern must be a builder name, an expression or a callable, got "
                            f"{type(self.pattern).__name__}")
        opts = self.options
        if self.is_adaptive:  # the integration passes q, k and causal itself
            taken = set(inspect.signature(adaptive_predictor()).parameters) - {"q", "k", "causal"}
            _refuse_unused(self.pattern, opts, taken)
            return
        names, _ = _split(self.pattern)
        taken = set()
        for name in names:
            params = inspect.signature(_builder(name)).parameters
            taken |= set(params) - _FILLED
            missing = [p for p, par in params.items() if par.default is inspect.Parameter.empty
                       and par.kind not in (par.VAR_POSITIONAL, par.VAR_KEYWORD) and p not in _FILLED
                       and p not in opts]
            if missing:
                raise ValueError(f"pattern {name!r} needs {', '.join(f'{m}=...' for m in missing)} in pattern_kwargs "
                                 f"(e.g. pattern_kwargs={{{', '.join(repr(m) + ': ...' for m in missing)}}})")
        if "random" in names and "density" not in opts and "top_k" not in opts:
            raise ValueError("pattern 'random' needs density=... or top_k=... in pattern_kwargs")
        _refuse_unused(self.pattern, opts, taken)

    # ------------------------------------------------------------------ building
    def layout(self, q_len: int, kv_len: int, device, causal: bool) -> BlockLayout:
        """The layout for one (q_len, kv_len) call, already cut to causal when ``causal`` (so its
        sparsity is what actually runs). Not for adaptive specs (see :func:`adaptive_layout`)."""
        if callable(self.pattern):
            layout = self.pattern(q_len, kv_len, device)
            if not isinstance(layout, BlockLayout):
                raise TypeError(f"pattern callable {self.name} returned {type(layout).__name__}, not a BlockLayout")
            return _causal_cut(layout, causal)
        from .. import patterns
        from ..patterns.expr import build_pattern
        opts = self.options
        names, _ = _split(self.pattern)
        if self.is_dense:  # the causal layout itself, so stats count only what runs
            # "causal" is causal on a bidirectional module too (an encoder's "causal" ran dense); "dense" is
            # the module's own attention
            build = patterns.causal if causal or self.pattern.strip() == "causal" else patterns.dense
            return build(q_len, kv_len, block_q=opts.get("block_q", 128), block_k=opts.get("block_k", 128),
                         device=device)
        already_causal = False
        if "causal" not in opts:
            # the call's causality, a bidirectional one too: local's and streaming's builders default to
            # causal=True, so an encoder's "local" attended no key after the query (a window wider than
            # the sequence differed from dense attention)
            opts["causal"] = causal
            already_causal = causal and len(names) == 1 and "causal" in builder_parameters(_builder(names[0]))
        layout = build_pattern(self.pattern, q_len, kv_len=kv_len, device=device, **opts)
        return layout if already_causal else _causal_cut(layout, causal)


def _refuse_unused(pattern: str, opts: dict, taken: set) -> None:
    """ValueError for options that none of ``pattern``'s builders takes: each builder gets only those its
    signature accepts, so they were dropped without a word (and still named in the stats), or failed inside
    the first forward (a misspelt name, an option adaptive's predictor does not take)."""
    unused = sorted(set(opts) - taken)
    if unused:
        hint = " (causal is set per call: SparseAttnConfig(causal=...))" if "causal" in unused else ""
        raise ValueError(f"pattern_kwargs {', '.join(unused)} apply to no builder of pattern {pattern!r}{hint}; "
                         f"it takes {', '.join(sorted(taken))}")


def _causal_cut(layout: BlockLayout, causal: bool) -> BlockLayout:
    if not causal:
        return layout
    from .. import patterns
    return patterns.causal_cut(layout)


def adaptive_predictor() -> Callable:
    """``sparse_attn.predict.meansim``, imported lazily; a clear error when it is not there."""
    try:
        from ..predict import meansim
    except ImportError as e:
        raise ImportError(
            "pattern='adaptive' needs the adaptive predictor sparse_attn.predict.meansim, which this installation "
            f"of sparse_attn does not have ({e}); use a fixed pattern such as 'local' or 'streaming' instead") from e
    return meansim


def adaptive_layout(spec: PatternSpec, q: torch.Tensor, k: torch.Tensor, causal: bool,
                    scale: float | None = None) -> BlockLayout:
    """Predict a layout from this call's q/k (``meansim(q, k, causal=..., **options)``; the
    attention's own ``scale`` unless the options set one); never cached. The predictor cuts its
    layout to causal itself."""
    predictor = adaptive_predictor()
    opts = spec.options
    if scale is not None and "scale" not in opts and "scale" in inspect.signature(predictor).parameters:
        opts["scale"] = scale
    return predictor(q, k, causal=causal, **opts)


def causal_blocks(layout: BlockLayout) -> int:
    """Blocks the causal-dense layout of the same grid visits, summed over the layout's
    (batch, head) row sets: the denominator of "sparsity relative to causal"."""
    offset = layout.kv_len - layout.q_len
    total = 0
    for qb in range(layout.num_q_blocks):  # key blocks up to the diagonal of the block's last row
        p_last = min((qb + 1) * layout.block_q, layout.q_len) - 1 + offset
        if p_last >= 0:
            total += min(p_last // layout.block_k + 1, layout.num_kv_blocks)
    return total * layout.batch * layout.heads


class LayoutCache:
    """LRU of built layouts keyed by (spec, q_len, kv_len, device, extra), shared by every layer
    that uses the same spec, with the stats the integration reports."""

    def __init__(self, maxsize: int = 64):
        self.maxsize = maxsize
        self._items: OrderedDict = OrderedDict()

    def get(self, key, build: Callable[[], Any]):
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = build()
        self._items[key] = value
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
