"""Pattern expressions: builder names joined by ``|`` / ``&`` with options matched to each builder's
signature (``build_pattern("local|random", 8192, window=512, density=0.1)``). Used by the CLI, the
gallery and the transformers integration."""
from __future__ import annotations

import functools
import inspect
import re

DEFAULTS = {"window": lambda L: max(L // 8, 16), "num_sink": lambda L: 64, "block_size": lambda L: max(L // 8, 16),
            "stride": lambda L: 4, "window_blocks": lambda L: 3, "dilation": lambda L: 2}


def build_pattern(expr: str, seq_len: int, **options):
    """A layout from a pattern expression: builder names joined by ``|`` (union) or ``&`` (intersection),
    evaluated left to right, e.g. ``"local|random"``.

    Each builder in :mod:`sparse_attn.patterns` gets the ``options`` its signature accepts (None
    values dropped); a required argument not given takes a value from :data:`DEFAULTS`.
    ``random`` with neither ``density`` nor ``top_k`` uses ``density=0.2``.
    """
    tokens = re.split(r"\s*([|&])\s*", expr.strip())
    if "" in tokens[::2]:  # "local|", "|local", "local||random"
        raise ValueError(f"pattern expression {expr!r} has an empty name: builder names joined by | or &, "
                         "e.g. 'local|random'")
    known = _option_set()
    unknown = sorted(k for k, v in options.items() if v is not None and k not in known)
    if unknown:  # a typo would otherwise fall back to a default silently
        raise ValueError(f"unknown pattern option(s) {unknown}; the builders take {', '.join(option_names())}")
    layout = _build_one(tokens[0], seq_len, options)
    for op, name in zip(tokens[1::2], tokens[2::2]):
        other = _build_one(name, seq_len, options)
        layout = layout | other if op == "|" else layout & other
    return layout


def _builder(name: str):
    """The pattern builder called ``name``, or None when there is none of that name."""
    from .. import patterns
    fn = getattr(patterns, name, None) if not name.startswith("_") else None
    return fn if callable(fn) and name not in NOT_BUILDERS else None


def _build_one(name: str, seq_len: int, options: dict):
    fn = _builder(name)
    if fn is None:
        raise ValueError(f"unknown pattern {name!r}; choose from {', '.join(pattern_names())}")
    params = builder_parameters(fn)
    kw = {k: v for k, v in options.items() if v is not None and k in params}
    for pname, p in params.items():
        if pname == "seq_len" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty and pname not in kw and pname in DEFAULTS:
            kw[pname] = DEFAULTS[pname](seq_len)
    if name == "random" and kw.get("density") is None and kw.get("top_k") is None:
        kw["density"] = 0.2
    if "seq_len" in params and params["seq_len"].kind == params["seq_len"].KEYWORD_ONLY:
        return fn(seq_len=seq_len, **kw)
    return fn(seq_len, **kw)


def unused_options(exprs, options: dict) -> list[str]:
    """The names in ``options`` (None values left out) that no builder of any expression in ``exprs``
    takes. :func:`build_pattern` gives each builder only the options its signature accepts, so such an
    option (``viz dense --window 5``, ``eval-model --patterns local --density 0.5``) was dropped without
    a word; the CLI refuses it, as ``bench`` does. [] when a name is not a builder (build_pattern says so)."""
    taken: set[str] = set()
    for expr in [exprs] if isinstance(exprs, str) else exprs:
        for name in re.split(r"\s*[|&]\s*", expr.strip()):
            fn = _builder(name)
            if fn is None:
                return []  # build_pattern's "unknown pattern" error says more
            taken |= set(builder_parameters(fn))
    return sorted(k for k, v in options.items() if v is not None and k not in taken)


NOT_BUILDERS = {"causal_cut", "causal_block_count", "local_block_count", "streaming_block_count", "to_flex", "from_block_index", "from_block_mask", "from_csr", "to_csr", "to_block_index",
                "from_flex", "topk"}


@functools.cache
def builder_parameters(fn) -> dict:
    """``inspect.signature(fn).parameters``, read once per builder: a decoding step builds a layout per
    sequence, and build_pattern's option check read every builder's signature for each option of each
    build (~70 signature reads a layout: 0.42 s of 1.78 s in a profiled 16-step batched decode)."""
    return dict(inspect.signature(fn).parameters)


@functools.cache
def _option_set() -> frozenset:
    from .. import patterns
    names = set()
    for name in pattern_names():
        names |= set(builder_parameters(getattr(patterns, name)))
    return frozenset(names - {"seq_len"})


def option_names() -> list[str]:
    """Every option some builder of :func:`pattern_names` accepts."""
    return sorted(_option_set())


def pattern_names() -> list[str]:
    """Builders in :mod:`sparse_attn.patterns` that take ``seq_len`` (the CLI's PATTERN choices)."""
    return list(_pattern_names())


@functools.cache
def _pattern_names() -> tuple[str, ...]:
    from .. import patterns
    names = []
    for name in getattr(patterns, "__all__", dir(patterns)):
        fn = getattr(patterns, name, None)
        if name.startswith("_") or name in NOT_BUILDERS or not inspect.isfunction(fn):
            continue
        if "seq_len" in builder_parameters(fn):
            names.append(name)
    return tuple(names)
