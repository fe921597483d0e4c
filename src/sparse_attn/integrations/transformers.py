"""Hugging Face ``transformers`` attention implementation ``"sparse_attn"``.

    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    cfg = SparseAttnConfig(pattern="streaming", pattern_kwargs={"window": 1024, "num_sink": 64},
                           per_layer={0: "dense"})             # layer 0 stays dense
    enable(model, cfg)                   # registers "sparse_attn" and switches the model to it
    logits = model(input_ids).logits     # prefill: one layout per (pattern, q_len, kv_len, device), cached
    model.generate(input_ids, max_new_tokens=32)   # decoding with a KV cache works (q_len=1 < kv_len)
    cfg.sparsity                         # {layer_idx: layout.sparsity} of each layer's last call
    disable(model)                       # back to the implementation the model had

or ``register(SparseAttnConfig(...))`` then ``from_pretrained(..., attn_implementation="sparse_attn")``
(the registered config serves every model without one of its own; importing this module registers
the name with a dense default).

Each attention call gets ``query [B, Hq, Lq, D]``, ``key/value [B, Hkv, Lk, D]`` (GQA: passed to
:func:`sparse_attn.attention` as they are, never repeated), and runs the layer's pattern
intersected with causal (bottom-right aligned: query ``i`` sits at key position ``i + Lk - Lq``,
which is how a KV-cached decoding step lines up). Returns ``([B, Lq, Hq, D], None)``.

Masks: a plain causal (or bidirectional) mask is never materialised. Padded batches (the model's
``[B, Lk]`` attention_mask, left or right padding: ``generate()`` on prompts of several lengths, padded
training batches) and packed ones (several sequences in a row: ``position_ids`` restarting at 0, or
FlashAttention's ``cu_seq_lens_q`` / ``cu_seq_lens_k``) run as one :func:`sparse_attn.varlen_attention`
call over the real sequences, each as if it were called alone (its pattern, window and causal alignment
counted from its own first token; zeros at padded queries). The packed mask is read off the mask function
and checked a chunk at a time, never materialised. A static cache's key buffer (``cache_implementation=
"static"``) runs past the last query: on full-attention layers its unwritten slots count as padding, and so
on sliding-window layers while the window holds every written key (:func:`_window_holds_every_key`). A row
with padding between real tokens, or any other custom mask, raises ``NotImplementedError`` rather than being
silently ignored (a copy of a band marker, which ``generate()`` makes with a static cache, is taken for the
latest marker: :func:`_adopt_marker_copy`).
Sliding-window layers (``sliding_window=`` from the model) are honoured by intersecting with
:func:`sparse_attn.patterns.local`: causal ones attend the last ``sliding_window`` keys (self included),
bidirectional ones (encoders such as ModernBERT) the keys less than ``sliding_window`` away on either side,
FlashAttention's reading of that argument. Once a causal layer's cache has dropped its oldest keys
(decoding past the window), a pattern that places keys by position (all but ``dense`` and ``local``: sinks,
global / random / strided blocks) raises ``NotImplementedError``, as it would count from the oldest key kept
instead of token 0. Attention dropout > 0, softcap
and attention sinks (``s_aux``) are not supported (``NotImplementedError``).
"""
from __future__ import annotations

import functools
import operator
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import api as _api
from ..device_guard import on_inputs_device
from ..plan_cache import LastOne
from ..validation import autocast_inputs
from . import _traced, _unpad
from ._patterns import LayoutCache, PatternSpec, adaptive_layout, causal_blocks

NAME = "sparse_attn"
_ATTR = "_sparse_attn_config"        # set on each attention module by enable()
_PREVIOUS = "_sparse_attn_previous"  # the model's implementation before enable()
_NAME_ATTR = "_sparse_attn_name"     # each attention module's name in the model, set by enable()

# a materialised mask that is not one sparse_attn applies itself (causal / bidirectional, the layer's sliding
# window, left / right padding, sequences packed in a row)
CUSTOM_MASK_MESSAGE = ("sparse_attn: got a padded or custom mask: a materialised attention mask that is neither the "
                       "plain causal / bidirectional one nor a sliding window. sparse_attn runs padding given as the "
                       "model's [B, Lk] attention_mask (left or right) and sequences packed in a row (position_ids "
                       "restarting at 0, or cu_seq_lens_q / cu_seq_lens_k), but not 4-D masks with padding written in, "
                       "chunked attention (Llama 4) or other custom mask functions: use attn_implementation='sdpa'")


@dataclass
class LayerStats:
    """What one layer's last call ran. For a padded or packed batch: the call's padded ``q_len`` / ``kv_len``,
    and the fractions and block count over its sequences' own layouts together."""

    pattern: str
    q_len: int
    kv_len: int
    sparsity: float          # layout.sparsity: skipped fraction of the whole block grid (whole blocks)
    causal_sparsity: float   # skipped fraction of the blocks the dense attention it replaces visits: causal-dense
    #                          for a causal call (a sliding-window layer: its causal window), every block for a
    #                          bidirectional one (then equal to sparsity)
    blocks: int              # blocks visited, summed over the layout's (batch, head) row sets


_READ_ONCE = ("is read when the config is made; changing it later had no effect: build a new SparseAttnConfig and "
              "call enable(model, config) again")


class _ReadOnlyDict(dict):
    """A dict that refuses changes (a SparseAttnConfig's options are read when it is made) and still
    copies, deep-copies and pickles, as a model holding the config may be."""

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"this SparseAttnConfig option {_READ_ONCE}")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return _ReadOnlyDict, (dict(self),)


@dataclass
class SparseAttnConfig:
    """Which pattern each layer runs.

    Args:
        pattern: builder name (``"dense"``, ``"local"``, ``"streaming"``, ``"random"``, ``"bigbird"``, ...),
            an expression (``"local|random"``), ``"adaptive"`` (``sparse_attn.predict.meansim``), or a
            callable ``fn(q_len, kv_len, device) -> BlockLayout``.
        pattern_kwargs: the builder options (``window``, ``num_sink``, ``density``, ``block_q``, ...; for
            adaptive the predictor's ``simthreshd1``, ``cdfthreshd``, ``topk``, ...).
        layers: layer indices that run ``pattern``; None = all. Other layers run dense (causal) attention.
            Read on every call, so it may be set later (checked as here, and against the model's layers
            once :func:`enable` has seen it).
        per_layer: ``{layer_idx: pattern}`` or ``{layer_idx: (pattern, kwargs)}``, overriding both.
        causal: intersect layouts with causal (bottom-right aligned). None (default): what each
            attention module says (``is_causal`` passed by the model, else ``module.is_causal``, else
            True), as transformers' sdpa does: causal self-attention in decoders, bidirectional
            encoders and cross-attention. True / False forces it on every layer.
        cache_size: layouts kept (LRU), shared by layers with the same pattern.

    After a forward, :attr:`stats` holds each layer's :class:`LayerStats`, :attr:`sparsity` the
    ``{layer_idx: layout.sparsity}`` view of it. Keyed by ``layer_idx``, they keep one module per index:
    in encoder-decoder models the encoder's self-attention, the decoder's and its cross-attention share
    index i (the last call wins), and modules without one share None. :attr:`module_stats` keys the same
    :class:`LayerStats` by module name (``model.named_modules()``), one entry per attention module.

    ``pattern``, ``pattern_kwargs``, ``per_layer`` and ``cache_size`` are read once, here: changing them
    later raises (build a new config and ``enable(model, config)`` again); ``pattern_kwargs`` and
    ``per_layer`` become read-only dicts. A callable pattern's layouts are cached per shape, so it
    must be a pure function of its arguments.
    """

    _READ_AT_INIT = ("pattern", "pattern_kwargs", "per_layer", "cache_size")

    pattern: Any = "dense"
    pattern_kwargs: dict = field(default_factory=dict)
    layers: Iterable[int] | None = None
    per_layer: dict = field(default_factory=dict)
    causal: bool | None = None
    cache_size: int = 64
    stats: dict = field(default_factory=dict, repr=False)
    module_stats: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._default = PatternSpec.make(self.pattern, self.pattern_kwargs)
        self._dense = PatternSpec.make("dense", {k: v for k, v in self.pattern_kwargs.items()
                                                 if k in ("block_q", "block_k")})
        self._per_layer = {}
        for idx, value in dict(self.per_layer).items():
            pattern, kwargs = tuple(value) if isinstance(value, (tuple, list)) else (value, {})
            self._per_layer[int(idx)] = PatternSpec.make(pattern, kwargs)
        self._cache = LayoutCache(self.cache_size)
        # edits after this point were ignored silently (the specs above are built from them)
        object.__setattr__(self, "pattern_kwargs", _ReadOnlyDict(self.pattern_kwargs))
        object.__setattr__(self, "per_layer", _ReadOnlyDict(self.per_layer))
        object.__setattr__(self, "_initialised", True)

    def __setattr__(self, name, value):
        if name in self._READ_AT_INIT and getattr(self, "_initialised", False):
            raise AttributeError(f"SparseAttnConfig.{name} {_READ_ONCE}")
        if name == "layers":  # a later value skipped these checks: ["1"] or [5] of 2 layers ran every layer dense
            value = _layer_set(value)
            if value and getattr(self, "_num_layers", None) is not None:
                self._check_range(value, self._num_layers)
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ lookup
    def spec_for(self, layer_idx: int | None) -> PatternSpec:
        """The pattern layer ``layer_idx`` runs (None: a module without ``layer_idx`` -> ``pattern``)."""
        if layer_idx in self._per_layer:
            return self._per_layer[layer_idx]
        if self.layers is None or layer_idx is None or layer_idx in self.layers:
            return self._default
        return self._dense

    def check_layers(self, num_layers: int) -> None:
        """ValueError for ``layers`` / ``per_layer`` indices past ``num_layers``; later ``layers`` are checked
        against it too."""
        self._check_range(set(self._per_layer) | set(self.layers or ()), num_layers)
        object.__setattr__(self, "_num_layers", num_layers)

    @staticmethod
    def _check_range(named, num_layers: int) -> None:
        bad = sorted(i for i in named if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"layer indices {bad} are out of range: the model has {num_layers} attention layers")

    def causal_for(self, module, is_causal: bool | None = None) -> bool:
        """Whether a call of ``module`` is causal: :attr:`causal` when set, else the model's
        ``is_causal`` argument, else ``module.is_causal``, else True."""
        if self.causal is not None:
            return bool(self.causal)
        return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))

    def layout_for(self, layer_idx: int | None, q: torch.Tensor, k: torch.Tensor, sliding_window: int | None = None,
                   scale: float | None = None, causal: bool = True):
        """(layout, LayerStats) for one call; built once per (pattern, Lq, Lk, device, window, causal)
        and cached (adaptive: predicted from q/k on every call)."""
        spec = self.spec_for(layer_idx)
        if spec.is_adaptive:
            layout = adaptive_layout(spec, q, k, causal, scale)
            return self._with_stats(spec, _window_cut(layout, sliding_window, causal), causal, sliding_window)
        return self.layout_for_lengths(layer_idx, q.shape[2], k.shape[2], q.device, sliding_window, causal)

    def layout_for_lengths(self, layer_idx: int | None, lq: int, lk: int, device, sliding_window: int | None = None,
                           causal: bool = True):
        """:meth:`layout_for` of a fixed (not adaptive) pattern, from the call's lengths."""
        spec = self.spec_for(layer_idx)
        key = (spec.key(), lq, lk, str(device), sliding_window, causal)
        return self._cache.get(key, lambda: self._with_stats(
            spec, _window_cut(spec.layout(lq, lk, device, causal), sliding_window, causal), causal, sliding_window))

    @staticmethod
    def _with_stats(spec: PatternSpec, layout, causal: bool, sliding_window: int | None = None):
        """The layout and its LayerStats, measured against the dense attention the layer would run. A
        bidirectional call's baseline is every block (against causal-dense, a bidirectional BERT layer came
        out -0.333 "sparse"); a sliding-window layer's is its window (against causal-dense, pattern
        ``dense`` on a Mistral-style layer read 67% "sparse": blocks the dense window skips too)."""
        visited = layout.num_blocks
        if sliding_window or causal:
            baseline = SparseAttnConfig.baseline_blocks(layout, causal, sliding_window)
            vs_baseline = 1.0 - visited / baseline if baseline else 0.0
        else:
            vs_baseline = float(layout.sparsity)
        stats = LayerStats(spec.describe(), layout.q_len, layout.kv_len, float(layout.sparsity), vs_baseline, visited)
        return layout, stats

    @staticmethod
    def baseline_blocks(layout, causal: bool, sliding_window: int | None = None) -> int:
        """Blocks of ``layout``'s grid that the dense attention it replaces visits (its (batch, head) row sets
        summed): the model's window, else causal-dense, else every block."""
        if sliding_window:
            return _window_blocks(layout.q_len, layout.kv_len, int(sliding_window), layout.block_q,
                                  layout.block_k, causal) * layout.batch * layout.heads
        if causal:
            return causal_blocks(layout)
        return layout._grid_blocks()

    # ------------------------------------------------------------------ reporting
    @property
    def sparsity(self) -> dict[int, float]:
        """``{layer_idx: layout.sparsity}`` of each layer's last call."""
        return {i: s.sparsity for i, s in sorted(self.stats.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}

    @property
    def causal_sparsity(self) -> dict[int, float]:
        """``{layer_idx: fraction of the causal blocks skipped}`` of each layer's last call (for a
        bidirectional call, of every block: then equal to :attr:`sparsity`)."""
        return {i: s.causal_sparsity for i, s in sorted(self.stats.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}

    def reset_stats(self) -> None:
        self.stats.clear()
        self.module_stats.clear()

    def clear_cache(self) -> None:
        self._cache.clear()

    def describe(self) -> str:
        parts = [self._default.describe() + ("" if self.layers is None else f" on layers {sorted(self.layers)}")]
        parts += [f"layer {i}: {s.describe()}" for i, s in sorted(self._per_layer.items())]
        return "; ".join(parts)


def _layer_set(value) -> frozenset | None:
    """None, or ``value``'s layer indices (ints, numpy integers or digit strings) as a frozenset of ints."""
    def index(i) -> int:
        if isinstance(i, str) and i.strip().isdigit():
            return int(i)
        if isinstance(i, bool):
            raise TypeError
        return operator.index(i)
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes)):  # "12" would be layers 1 and 2
            raise TypeError
        return frozenset(index(i) for i in value)
    except TypeError:
        raise TypeError(f"SparseAttnConfig.layers must be None or layer indices (ints), got {value!r}") from None


@functools.lru_cache(maxsize=64)
def _window_blocks(q_len: int, kv_len: int, window: int, block_q: int, block_k: int, causal: bool) -> int:
    """Blocks the model's sliding window (:func:`_window_layout`) visits on this grid (one (batch, head) row
    set): the dense baseline of a sliding-window layer, cached (adaptive layers measure it every call)."""
    if causal:
        from .. import patterns
        return patterns.local_block_count(q_len, window, kv_len, block_q=block_q, block_k=block_k)
    return _window_layout(q_len, kv_len, window, block_q, block_k, causal, None).num_blocks


def _window_layout(q_len: int, kv_len: int, window: int, block_q: int, block_k: int, causal: bool, device):
    """The model's own sliding window as a layout, transformers' ``sliding_window`` read as FlashAttention
    reads it (``window_size = (sliding_window - 1, sliding_window - 1)``): keys less than ``window`` away
    on either side of the query's position. Causal: the last ``window`` keys, self included. Bidirectional
    (ModernBERT-style encoders, whose mask allows ``|i - j| <= half``, pass ``sliding_window = half + 1``):
    ``window - 1`` keys on each side."""
    from .. import patterns
    if causal:
        return patterns.local(q_len, window, kv_len=kv_len, block_q=block_q, block_k=block_k, device=device)
    return patterns.local(q_len, window - 1, kv_len=kv_len, causal=False, block_q=block_q, block_k=block_k,
                          device=device)


def _window_cut(layout, sliding_window: int | None, causal: bool):
    """Intersect with the model's own sliding window (:func:`_window_layout`), for sliding-window layers.
    (A bidirectional layer was cut to the causal window: it attended no key after its own.)"""
    if not sliding_window:
        return layout
    return layout & _window_layout(layout.q_len, layout.kv_len, int(sliding_window), layout.block_q, layout.block_k,
                                   causal, layout.device)


# ---------------------------------------------------------------------- the attention function
_DEFAULT_CONFIG: SparseAttnConfig | None = None


def config_for(module) -> SparseAttnConfig:
    """The config enable() attached to ``module``, else the one given to register(), else dense."""
    global _DEFAULT_CONFIG
    cfg = getattr(module, _ATTR, None)
    if cfg is None:
        if _DEFAULT_CONFIG is None:
            _DEFAULT_CONFIG = SparseAttnConfig()
        cfg = _DEFAULT_CONFIG
    return cfg


# keyword arguments of transformers' attention functions that change the scores or the key sets: each
# would be dropped without a word (T5's position_bias cost its logits 0.28)
UNSUPPORTED_KWARGS = {
    "softcap": "tanh soft-capping of the scores",
    "s_aux": "learned attention sinks",
    "sinks": "learned attention sinks",
    "position_bias": "an additive relative-position bias (T5 family)",
    "indices": "unpadded token indices",
    "block_indices": "a model-side block selection",
}


def _eager_under_compile(fn):
    """Run ``fn`` eagerly when torch.compile traces its caller (a graph break around it). The eager attention and
    mask functions keep host-side state a trace would freeze: the last mask's Packing found again by object
    identity and version counter, markers registered by object, the padding read with a sync. Traced, those
    became constants of the graph: ``generate(cache_implementation="static")``, which compiles the decoding step
    on CUDA by itself, gave other tokens than without compiling (a tiny Llama on the CPU with the compile
    forced). The calls that need none of it are traced instead (:mod:`._traced`). Eager calls are unaffected."""
    return functools.wraps(fn)(torch.compiler.disable(fn, recursive=True))


@on_inputs_device("query", 1)
def sparse_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[B, Hq, Lq, D]``, key/value ``[B, Hkv, Lk, D]``
    -> (``[B, Lq, Hq, D]``, None). While torch.compile traces the model, the calls that need no host-side state
    are traced (:mod:`._traced`), the rest run eagerly (a graph break). Inside ``torch.autocast("cuda")`` the inputs
    are cast as SDPA's are (an fp32 model's rotary q / k next to a bf16 v), before either path: the padded
    batches' path launches the kernels without going through :func:`sparse_attn.attention`."""
    query, key, value = autocast_inputs(query, key, value)
    if torch.compiler.is_compiling():
        out = _traced.forward(getattr(module, _ATTR, None) or _DEFAULT_CONFIG, module, query, key, value,
                              attention_mask, scaling, dropout, kwargs)
        if out is not None:
            return out, None
    return _eager_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


@_eager_under_compile
def _eager_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """:func:`sparse_attention_forward`, eagerly."""
    if dropout:
        raise NotImplementedError(f"sparse_attn: attention dropout ({dropout}) is not supported; call model.eval() "
                                  "or set attention_dropout=0")
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"sparse_attn: {name} is not supported (this model passes {name}=...: "
                                      f"{UNSUPPORTED_KWARGS[name]}); use attn_implementation='sdpa' or 'eager'")
    if kwargs.get("output_attentions"):
        _warn_once("sparse_attn does not return attention weights (output_attentions=True): the model's "
                   "attentions come back empty; use attn_implementation='eager' for them")
    cfg = config_for(module)
    causal = cfg.causal_for(module, kwargs.get("is_causal"))
    window = kwargs.get("sliding_window")
    if attention_mask is not None:
        check_mask(attention_mask, query.shape[2], key.shape[2], causal, window)
    layer_idx = _layer_index(module)
    offset = _key_offset(attention_mask)
    run_window = _causal_window(cfg.spec_for(layer_idx), window, causal)
    # (a streaming pattern under a model window no wider than its own is that window alone: no sinks to place)
    if (cfg.spec_for(layer_idx).keys_by_position and (run_window is None or run_window[1])
            and (offset or (_band_of(attention_mask) is None and _unpad.shifted(attention_mask)))):
        lk = key.shape[2]
        held = (f"only keys {offset}..{offset + lk - 1} (the first {offset} were dropped)" if offset else
                f"only its last {lk} keys (the first were dropped)")  # key states made while traced: no offset
        raise NotImplementedError(
            f"sparse_attn: layer {layer_idx}'s pattern {cfg.spec_for(layer_idx).describe()} places keys by position "
            f"(from token 0: sinks, global / random / strided blocks), but this sliding-window layer's cache holds "
            f"{held}, so it would attend to other keys than a forward over the whole sequence; run 'local' or "
            "'dense' on sliding-window layers (per_layer=...), or decode without a cache (use_cache=False)")
    packing = _packing_for(attention_mask, query, key, kwargs)
    spec, lq, lk = cfg.spec_for(layer_idx), query.shape[2], key.shape[2]
    if packing is not None:
        out, stats = _packed_forward(cfg, layer_idx, query, key, value, packing, causal, window, run_window, scaling)
    elif spec.is_dense and _reach(window, lq, lk, causal) is None:
        # dense / causal without a layout: forward-only calls plan it in the kernel (a decoding step's
        # lengths are new every step), training calls build attention()'s default layout
        run_causal = causal or spec.pattern.strip() == "causal"
        out = _api.attention(query, key, value, causal=run_causal, scale=scaling).transpose(1, 2).contiguous()
        stats = _dense_stats(spec, (lq,), (lk,), (lq, lk), run_causal, causal)
    elif run_window is not None:  # one causal sliding window: planned by attention too
        out = _api.attention(query, key, value, causal=True, window=run_window[0], num_sink=run_window[1],
                             scale=scaling)
        out = out.transpose(1, 2).contiguous()
        stats = _window_stats(spec, (lq,), (lk,), (lq, lk), run_window, window)
    else:
        layout, stats = cfg.layout_for(layer_idx, query, key, window, scaling, causal)
        out = _api.attention(query, key, value, layout, causal=causal, scale=scaling).transpose(1, 2).contiguous()
    cfg.stats[layer_idx] = stats
    cfg.module_stats[getattr(module, _NAME_ATTR, type(module).__name__)] = stats
    return out, None


SMALL_GRID = 4096  # query x key blocks (of 128 tokens) up to which a sequence's layout is built on the CPU


def _build_device(q_len: int, kv_len: int, device):
    """Where to build one sequence's layout for varlen_attention (which moves it): on the CPU when its block
    grid is small (a decoding step's rows, each a new length every step: about a hundred small tensor ops, a
    few of them reading back, which a profiled batched decode put at ~3.8 ms a row on the GPU), else on
    ``device``. (Not measured apart from dropping varlen's second causal cut, which landed with it; for a
    single sequence's attention() call, building on the CPU measured no faster on the H200, so that path
    builds on q's device.)"""
    blocks = ((q_len + 127) // 128) * ((kv_len + 127) // 128)
    return torch.device("cpu") if blocks <= SMALL_GRID else device


def _dense_stats(spec: PatternSpec, q_lens: tuple, k_lens: tuple, padded: tuple, run_causal: bool,
                 causal: bool) -> LayerStats:
    """LayerStats of a dense / causal call over sequences of ``q_lens`` / ``k_lens`` tokens in a call of
    ``padded`` (q_len, kv_len), counted without building layouts."""
    bq, bk = spec.options.get("block_q", 128), spec.options.get("block_k", 128)
    return _counted_stats(spec, padded, *_dense_counts(q_lens, k_lens, bq, bk, run_causal, causal))


def _counted_stats(spec: PatternSpec, padded: tuple, visited: int, grid: int, baseline: int) -> LayerStats:
    """LayerStats of a call of ``padded`` (q_len, kv_len) from its block counts: ``visited`` of the ``grid``'s
    blocks, against the ``baseline`` blocks of the attention it replaces."""
    return LayerStats(spec.describe(), *padded, 1.0 - visited / grid if grid else 0.0,
                      1.0 - visited / baseline if baseline else 0.0, visited)


@functools.lru_cache(maxsize=64)
def _dense_counts(q_lens: tuple, k_lens: tuple, bq: int, bk: int, run_causal: bool, causal: bool) -> tuple:
    """(blocks visited, blocks in the grids, blocks of the dense attention replaced) over the sequences:
    the same for every layer of a forward, so counted once."""
    from .. import patterns
    visited = grid = baseline = 0
    for nq, nk in zip(q_lens, k_lens):
        every = ((nq + bq - 1) // bq) * ((nk + bk - 1) // bk)
        mine = patterns.causal_block_count(nq, nk, block_q=bq, block_k=bk) if run_causal else every
        visited, grid = visited + mine, grid + every
        baseline += mine if causal else every
    return visited, grid, baseline


def _causal_window(spec: PatternSpec, model_window: int | None, causal: bool) -> tuple | None:
    """The one causal sliding window, as ``(window, num_sink)`` (patterns.local's / patterns.streaming's keys), that
    a causal layer's pattern and the model's window amount to, on 128-token blocks: ``local`` (its window, or the
    model's where smaller), ``streaming`` (its window and sinks; under a model window no wider than its own, the
    model's window alone, which holds whatever sinks it reaches), or dense / causal under the model's window.
    attention(window=, num_sink=) / varlen_attention(window=, num_sink=) run it (per sequence) without a layout,
    with those patterns' blocks and masks, so what layout_for_lengths would build; None for anything else."""
    if not causal or not isinstance(spec.pattern, str):
        return None
    name, opts = spec.pattern.strip(), spec.options
    if opts.get("block_q", 128) != 128 or opts.get("block_k", 128) != 128:
        return None
    model_window = int(model_window) if model_window else None
    if name in ("dense", "causal"):
        return None if model_window is None else (model_window, 0)
    if opts.get("causal", True) is not True:
        return None
    if name == "local" and not opts.get("window_right"):
        return min(int(opts["window"]), model_window or int(opts["window"])), 0
    if name == "streaming":
        window, num_sink = int(opts["window"]), int(opts.get("num_sink", 0))
        if model_window is None:
            return window, num_sink
        if model_window <= window:  # p - model_window < j already puts j inside the pattern's window
            return model_window, 0
    return None


def _window_stats(spec: PatternSpec, q_lens: tuple, k_lens: tuple, padded: tuple, run_window: tuple,
                  model_window: int | None) -> LayerStats:
    """LayerStats of a causal sliding-window call (``run_window``: _causal_window's (window, num_sink)) over
    sequences of ``q_lens`` / ``k_lens`` tokens in a call of ``padded`` (q_len, kv_len), counted without building
    layouts."""
    return _counted_stats(spec, padded, *_window_counts(q_lens, k_lens, run_window,
                                                         int(model_window) if model_window else None))


@functools.lru_cache(maxsize=64)
def _window_counts(q_lens: tuple, k_lens: tuple, run_window: tuple, model_window: int | None) -> tuple:
    """(blocks visited, blocks in the grids, blocks of the attention replaced: the model's window, else
    causal) over the sequences on 128-token blocks, as _dense_counts: once a forward."""
    from .. import patterns
    visited = grid = baseline = 0
    for nq, nk in zip(q_lens, k_lens):
        visited += patterns.streaming_block_count(nq, *run_window, nk)
        grid += ((nq + 127) // 128) * ((nk + 127) // 128)
        baseline += (_window_blocks(nq, nk, model_window, 128, 128, True) if model_window
                     else patterns.causal_block_count(nq, nk))
    return visited, grid, baseline


_MASK_PACKINGS = LastOne()     # the last mask's sequences (every layer of a forward gets the same mask)
_OFFSET_PACKINGS = LastOne()   # the last cu_seq_lens_q's


def _packing_for(mask, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> _unpad.Packing | None:
    """The real sequences of a padded batch (a ``[B, Lk]`` padding mask), a packed one (a packed-batch
    marker, or FlashAttention's ``cu_seq_lens_q`` / ``cu_seq_lens_k``), else None (plain rows)."""
    lq, lk = query.shape[2], key.shape[2]
    packing = None
    if isinstance(mask, torch.Tensor):
        packing = _MASK_PACKINGS.get(mask, (lq, lk), lambda: _mask_packing(mask, lq, lk))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return packing
    if cu_q is None or cu_k is None:
        raise ValueError("sparse_attn: got only one of cu_seq_lens_q / cu_seq_lens_k; packed sequences need both")
    if query.shape[0] != 1:
        raise ValueError(f"sparse_attn: cu_seq_lens_q / cu_seq_lens_k name sequences packed in one row, but the batch "
                         f"has {query.shape[0]} rows")
    given = _OFFSET_PACKINGS.get(cu_q, (id(cu_k), lq, lk), lambda: _unpad.from_offsets(cu_q, cu_k, lq, lk))
    if packing is not None and (packing.rows is not None or (packing.q_lens, packing.k_lens) !=
                                (given.q_lens, given.k_lens)):
        raise ValueError(f"sparse_attn: cu_seq_lens_q / cu_seq_lens_k name sequences of {list(given.q_lens)} query "
                         f"tokens, but the attention mask (padding / position_ids) gives {list(packing.q_lens)}")
    return given


def _mask_packing(mask: torch.Tensor, lq: int, lk: int) -> _unpad.Packing | None:
    for ref, bounds in _PACKED:
        if ref() is mask:
            return _unpad.from_segments(bounds, lq)
    mask = _unpad.key_states_of(mask) if mask.dim() == 4 else mask  # key states in their 4-D container
    if mask is not None and mask.dim() == 2:  # a padding mask: ours (the mask interface's) or one a model passes
        if mask.shape[1] != lk:
            raise NotImplementedError(f"sparse_attn: got a [B, Lk] padding mask of shape {tuple(mask.shape)} for "
                                      f"kv_len={lk}")
        return _marker_packing(mask, lq) or _unpad.from_padding(mask, lq)
    return None


def _planned(spec: PatternSpec, window, run_window: tuple | None, lq: int, lk: int, causal: bool) -> tuple | None:
    """``(causal, window, num_sink)`` of a layer the kernels plan without a layout (dense / causal, or the one causal
    window ``run_window`` that :func:`_causal_window` found), else None (a layout is needed)."""
    if spec.is_dense and _reach(window, lq, lk, causal) is None:
        return causal or spec.pattern.strip() == "causal", None, 0  # ("causal" is causal on a bidirectional module)
    if run_window is not None:
        return True, *run_window
    return None


def _packed_forward(cfg: SparseAttnConfig, layer_idx, query, key, value, packing: _unpad.Packing, causal: bool,
                    window, run_window: tuple | None, scaling):
    """One varlen_attention call over the batch's real sequences (``packing``), each with the layer's
    pattern and window built for its own lengths (``run_window``: the layer's _causal_window, run without
    layouts); ``[B, Lq, Hq, Dv]`` with zeros at padded queries, and the call's LayerStats summed over the
    sequences."""
    spec = cfg.spec_for(layer_idx)
    batch, lq, lk = query.shape[0], query.shape[2], key.shape[2]
    if not packing.q_lens:  # every row is padding
        out = query.new_zeros(batch, lq, query.shape[1], value.shape[-1])
        return out, LayerStats(spec.describe(), lq, lk, 1.0, 1.0, 0)
    planned = _planned(spec, window, run_window, lq, lk, causal)
    if planned is not None:
        # varlen plans these itself (on CUDA without gradients, in the kernel), so no layout is built: a decoding
        # step's sequences have new lengths every step; a padded batch is then read and written in place
        run_causal, run_w, run_sinks = planned
        out = _unpad.in_place(packing, query, key, value, causal=run_causal, window=run_w, num_sink=run_sinks,
                              scale=scaling)
        if out is None:
            q, k, v = packing.pack(query, False), packing.pack(key, True), packing.pack(value, True)
            out = packing.unpack(_api.varlen_attention(q, k, v, packing.cu_q, packing.cu_k, packing.max_q,
                                                       packing.max_k, causal=run_causal, window=run_w,
                                                       num_sink=run_sinks, scale=scaling))
        shape = (packing.q_len, packing.kv_len)
        if run_w is None:
            return out, _dense_stats(spec, packing.q_lens, packing.k_lens, shape, run_causal, causal)
        return out, _window_stats(spec, packing.q_lens, packing.k_lens, shape, run_window, window)
    q, k, v = packing.pack(query, False), packing.pack(key, True), packing.pack(value, True)
    cq, ck = packing.cu_q.tolist(), packing.cu_k.tolist()  # CPU tensors: no sync
    per_seq = []
    for i, (nq, nk) in enumerate(zip(packing.q_lens, packing.k_lens)):
        if spec.is_adaptive:  # predicted from the sequence's own q / k, [1, H, n, D]
            qs, ks = q[cq[i]:cq[i + 1]].transpose(0, 1)[None], k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
            per_seq.append(cfg.layout_for(layer_idx, qs, ks, window, scaling, causal))
        else:
            per_seq.append(cfg.layout_for_lengths(layer_idx, nq, nk, _build_device(nq, nk, query.device), window,
                                                  causal))
    # the layouts are already cut to causal (layout_for): varlen's own cut would build each one again
    out = _api.varlen_attention(q, k, v, packing.cu_q, packing.cu_k, packing.max_q, packing.max_k,
                                layouts=[lay for lay, _ in per_seq], causal=False, scale=scaling)
    visited = sum(st.blocks for _, st in per_seq)
    grid = sum(lay._grid_blocks() for lay, _ in per_seq)
    baseline = sum(cfg.baseline_blocks(lay, causal, window) for lay, _ in per_seq)
    return packing.unpack(out), _counted_stats(spec, (lq, lk), visited, grid, baseline)


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


_CHECKED = LastOne()  # the last mask found plain: not re-checked in every layer


def _band_rule(p: torch.Tensor, j: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Which keys ``j`` the query positions ``p`` attend under the rule sparse_attn applies itself: causal
    or all keys, cut to the layer's sliding window (:func:`_window_layout`: less than ``window`` away)."""
    allowed = (j <= p) if causal else torch.ones(torch.broadcast_shapes(p.shape, j.shape), dtype=torch.bool,
                                                  device=p.device)
    if window:
        allowed = allowed & (j > p - int(window))
        if not causal:
            allowed = allowed & (j < p + int(window))
    return allowed


def check_mask(mask: torch.Tensor, lq: int, lk: int, causal: bool, window: int | None = None) -> None:
    """Accept only a mask equal to what sparse_attn applies anyway (causal bottom-right and the
    sliding window, or all-allowed); raise NotImplementedError for padding or anything custom."""
    if not isinstance(mask, torch.Tensor):
        raise NotImplementedError(f"sparse_attn: attention masks of type {type(mask).__name__} are not supported")
    if _check_band(mask, lq, lk, causal, window):
        return
    if mask.dim() == 2 or _unpad.key_states_of(mask) is not None:
        return  # a raw [B, Lk] padding mask, or key states: the attention function runs the rows' real tokens
    _CHECKED.get(mask, (tuple(mask.shape), lq, lk, causal, window),
                 lambda: _check_materialised(mask, lq, lk, causal, window))


def _adopt_marker_copy(mask: torch.Tensor, lq: int, lk: int, causal: bool, window: int | None) -> bool:
    """Whether ``mask``, a 4-D mask that allows no key at all (which no plain mask does), is a copy of the latest
    one-element band marker, and if so register it with that marker's band: with a static cache, transformers 5.24's
    generate() makes the masks ``.contiguous()``, which turns a marker (one False element seen as [B, 1, Lq, Lk])
    into a real mask that allows nothing. The latest marker made, by the shape and band recorded when it was made
    (the copy is made at once and the marker itself dropped), when that band fits this call (q_len, kv_len,
    causality and the reach of ``sliding_window``). The copy then carries the marker's ``kv_offset`` too
    (:func:`_key_offset`), so patterns placed by position still refuse on a cache that dropped keys."""
    if mask.dtype != torch.bool or not _LAST_BAND_MARKER:
        return False
    shape, band = _LAST_BAND_MARKER[0]
    q_len, kv_len, band_window, _, band_causal = band
    if (shape != tuple(mask.shape) or (q_len, kv_len, band_causal) != (lq, lk, causal)
            or _reach(window, lq, lk, causal) != _reach(band_window, lq, lk, causal)):
        return False
    _registered(mask, band)
    return True


def _check_materialised(mask: torch.Tensor, lq: int, lk: int, causal: bool, window: int | None) -> bool:
    """check_mask of a 4-D mask: True, or NotImplementedError when it is not the band sparse_attn applies."""
    if mask.dim() != 4 or mask.shape[-2] != lq or mask.shape[-1] != lk:
        raise NotImplementedError(
            f"sparse_attn: got an attention mask of shape {tuple(mask.shape)} for q_len={lq}, kv_len={lk}; only "
            "[B, 1|H, q_len, kv_len] masks equal to the causal mask are accepted (padding, and a static cache's "
            "unwritten slots, come through sparse_attn's mask interface as [B, Lk] masks)")
    if mask.dtype == torch.bool:
        allowed = mask
    else:  # additive: 0 where allowed, a large negative number where masked; anything else is a bias
        allowed = mask == 0
        masked_ok = mask <= torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else ~allowed
        if not bool((allowed | masked_ok).all()):
            raise NotImplementedError("sparse_attn: additive attention biases (values other than 0 / -inf) are not "
                                      "supported")
    p = torch.arange(lq, device=mask.device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=mask.device)[None, :]
    if not torch.equal(allowed, _band_rule(p, j, causal, window).expand_as(allowed)):
        if not bool(allowed.any()):  # no plain mask is empty: the usual source is a copy of a band marker
            if _adopt_marker_copy(mask, lq, lk, causal, window):
                return True
            raise NotImplementedError(
                f"sparse_attn: got an attention mask of shape {tuple(mask.shape)} that allows no key at all: a copy of "
                "the one-element marker sparse_attn's mask interface returns for a sliding-window mask, which "
                "generate() makes with a static cache (cache_implementation='static'), but not of the latest "
                "marker or not for this call (its shape, causality or sliding window differ), so sparse_attn cannot "
                "tell which band it stood for: use the default DynamicCache for this model")
        raise NotImplementedError(CUSTOM_MASK_MESSAGE)
    return True


def sparse_attn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                     mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                     **kwargs) -> torch.Tensor | None:
    """transformers mask interface for ``"sparse_attn"``: None for the plain causal/bidirectional
    case (sparse_attn applies causal itself); padding as a registered ``[B, Lk]`` padding mask
    (:func:`_padding_marker`), and a static cache's slots after the last query (full-attention layers; other key
    ranges that do not end at the last query raise) as int8 key states (:func:`_unpad.key_states`); a packed row
    as a marker (:func:`_packed_marker`). While torch.compile traces the model, causal and bidirectional masks over
    keys from token 0 are traced (:func:`._traced.mask`: None or key states), the rest run eagerly."""
    if torch.compiler.is_compiling():
        handled, mask = _traced.mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                     attention_mask, kwargs.get("device"), kwargs)
        if handled:
            return mask
    return _eager_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


@_eager_under_compile
def _eager_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | None:
    """:func:`sparse_attn_mask`, eagerly.
    A mask function found (chunk by chunk) to be a sliding-window layer's mask gives a zero-memory marker that :func:`check_mask` accepts only on a call with that causality
    and ``sliding_window``: causal within ``local_size`` keys (``sliding_window = local_size``), or
    bidirectional within ``|i - j| <= local_size`` (ModernBERT's: ``sliding_window = local_size + 1``).
    Other mask functions (packed sequences, ...) are materialised so the attention function can check them."""
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        sdpa_mask,
    )
    q_offset = int(q_offset)
    q_end = q_offset + q_length - kv_offset  # one past the last query, in the call's keys
    band = _band_of(attention_mask) if int(kv_offset) else None
    if band is not None and attention_mask.dim() == 2 and band[:2] == (q_length, kv_length) \
            and band[3] == int(kv_offset):
        # our own [B, Lk] answer for this call, given back as the padding mask: generate() makes a static cache's
        # masks, and a model's forward then makes them again from what it got. Read as padding it would be cut
        # again at kv_offset, one slot off a rolled sliding-window buffer: it already is this call's answer
        return attention_mask
    # A step transformers asks a mask it can replay for (a compileable cache, one query) gets key states on a
    # sliding-window buffer its window holds whole, rolled (keys from kv_offset > 0: SHIFTED keeps the dropped keys
    # known) or not (also when the buffer is exactly full): a compiled step reads them on the device, and gets one
    # kind of mask at every step (a None at one step was one more graph). Elsewhere a rolled buffer keeps its band or
    # padding marker (below), with no second look at its mask function.
    replayable = not kwargs.get("allow_is_causal_skip", True)
    if (not int(kv_offset) or replayable) and _window_holds_every_key(batch_size, q_length, q_end, q_offset,
                                                                      kv_offset, mask_function, kwargs):
        if replayable:
            padding = None if attention_mask is None else _unpad.call_padding(attention_mask, kv_length, kv_offset)
            states = _unpad.key_states(padding, batch_size, kv_length, q_end, padding.device if padding is not None
                                       else kwargs.get("device") or "cpu", shifted=bool(kv_offset))
            # in the 4-D container (_unpad.key_states_of), which the model's own mask call passes through
            return _registered(states[:, None, None], (q_length, kv_length, kwargs.get("local_size"), int(kv_offset),
                                                       True))
        mask_function = causal_mask_function
    # a causal mask lines queries up with the end of the keys; a bidirectional one (encoders,
    # cross-attention over encoder states) has no such alignment to keep. A static cache's key buffer runs
    # past the last query: its slots after it are not written yet, which a full-attention layer (keys from
    # token 0) treats as padding; a sliding-window one (its own buffer layout) is refused, unless its window
    # still holds every written key (above: then it is the causal mask).
    static = mask_function is not bidirectional_mask_function and q_end != kv_length
    if static and not (mask_function in (None, causal_mask_function) and kv_offset == 0 and 0 < q_end < kv_length):
        raise NotImplementedError(
            f"sparse_attn: the keys (positions {kv_offset}..{kv_offset + kv_length - 1}) do not end at the last query "
            f"(position {q_offset + q_length - 1}); pre-allocated caches are supported on full-attention layers "
            "only (keys from token 0, the query inside the buffer), and on sliding-window layers while the window "
            "holds every written key: use the default DynamicCache")
    # key states: the slots after the last query are not written yet; at a replayed step (above) key states even when
    # the buffer is exactly full, so that the compiled step gets one kind of mask at every step (None was a recompile)
    as_states = static or (replayable and mask_function in (None, causal_mask_function))
    padding = None  # [B, kv_length] bool where some row has padding among the call's keys
    packing = None  # its sequences as the attention function runs them, read here once (_padding_packing)
    if attention_mask is not None:
        padding = _unpad.call_padding(attention_mask, kv_length, kv_offset)
        if as_states:
            padding = None if bool(padding.all()) else padding
        else:
            packing = _padding_packing(padding, q_length)
            padding = None if packing is None else padding
    if as_states:
        device = padding.device if padding is not None else kwargs.get("device") or "cpu"
        states = _unpad.key_states(padding, batch_size, kv_length, q_end, device)
        return _registered(states, (q_length, kv_length, None, int(kv_offset), True))
    if mask_function is None or mask_function in (causal_mask_function, bidirectional_mask_function):
        if padding is None:
            return None
        return _padding_marker(padding, q_length, kv_length, None, kv_offset,
                               mask_function is not bidirectional_mask_function, packing)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    window, device = kwargs.get("local_size"), kwargs.get("device") or "cpu"
    use_vmap = bool(kwargs.get("use_vmap"))
    bounds = None  # the sequences of a packed batch (training without padding or cache: Lq = Lk, no offsets)
    if padding is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        bounds = _unpad.segments(batch_size, q_length, mask_function, device)
    if bounds is not None and any(len(row) > 2 for row in bounds):  # several sequences in a row
        packed = _packed_marker(batch_size, q_length, mask_function, window, device, use_vmap, bounds)
        if packed is not None:
            return packed
    else:
        for causal in (True, False):
            # the attention call's sliding_window for this mask (bidirectional: half-width + 1, FlashAttention's)
            layer_window = window if causal or window is None else int(window) + 1
            if _is_band(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, layer_window, causal,
                        device, use_vmap):
                if padding is not None:
                    return _padding_marker(padding, q_length, kv_length, layer_window, kv_offset, causal, packing)
                return _band_marker(batch_size, q_length, kv_length, layer_window, device, kv_offset, causal)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, **{k: v for k, v in kwargs.items() if k in ("local_size", "use_vmap",
                                                                                             "device")})


def _window_holds_every_key(batch_size: int, q_length: int, q_end: int, q_offset: int, kv_offset: int,
                            mask_function: Callable | None, kwargs: dict) -> bool:
    """Whether ``mask_function`` is a causal sliding window (``local_size`` keys, self included) so wide that every
    query sees every key written so far (the call's keys before ``q_end``): the last query sees the first key,
    ``q_end <= local_size``. Then it is the causal mask over the call's keys. That serves a static cache's
    sliding-window buffer (transformers' ``StaticSlidingWindowLayer``: ``local_size`` slots filled from token 0, then
    rolled so that the last query sits at its end), which was refused until it filled: with keys from token 0 the
    mask interface answers as for a causal mask (key states). Rolled (keys from ``kv_offset`` > 0) it answers with
    :data:`_unpad.SHIFTED` key states at a step transformers replays (a compiled decoding step), else with its band
    or padding marker; both tell the attention function that the first keys were dropped (patterns placed by
    position refuse then). The function is evaluated over those keys (:func:`_is_band`), so a window in name only
    is not taken on trust; the attention call's own ``sliding_window`` then cuts nothing."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    window = kwargs.get("local_size")
    if window is None or mask_function in (None, causal_mask_function, bidirectional_mask_function):
        return False
    if not 0 < q_end <= int(window) or q_length > q_end:
        return False
    return _is_band(batch_size, q_length, q_end, q_offset, kv_offset, mask_function, int(window), True,
                    kwargs.get("device") or "cpu", bool(kwargs.get("use_vmap")))


MASK_CHUNK = 1 << 24  # mask entries evaluated at a time when checking a mask function (16 MiB of bool)
_BANDS: list = []     # (weakref to a band marker, (q_len, kv_len, window, kv_offset, causal)) of the latest markers


def _is_band(batch_size: int, q_length: int, kv_length: int, q_offset: int, kv_offset: int,
             mask_function: Callable, window: int | None, causal: bool, device, use_vmap: bool = False,
             spans: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Whether ``mask_function`` allows exactly what sparse_attn applies itself for a layer with this
    causality and ``sliding_window = window`` (:func:`_band_rule`; None: no window) for every batch row;
    with ``spans`` (each token's sequence ``[first, end)``, int ``[B, Lk]``: a packed batch, Lq = Lk), that
    band within each sequence and nothing across sequences. Either allows each query one interval of keys
    (:func:`_band_bounds`), so each row of the evaluated mask is checked by its count and its first and
    last allowed key, not against a second [rows, Lk] tensor. Evaluated a chunk of query rows at a time
    (:data:`MASK_CHUNK` entries), so no ``[B, 1, Lq, Lk]`` mask exists; stops at the first row chunk that
    differs."""
    from transformers.masking_utils import sdpa_mask
    rows = max(1, MASK_CHUNK // max(1, batch_size * kv_length))
    agree = None  # the chunks' verdicts after the first, kept on the device: one sync at the end, not one a chunk
    for r0 in range(0, q_length, rows):
        r1 = min(q_length, r0 + rows)
        got = sdpa_mask(batch_size=batch_size, q_length=r1 - r0, kv_length=kv_length, q_offset=q_offset + r0,
                        kv_offset=kv_offset, mask_function=mask_function, allow_is_causal_skip=False,
                        use_vmap=use_vmap, device=device)
        if got is None or got.dtype != torch.bool or got.dim() != 4 or got.shape[1] != 1:
            return False
        p = torch.arange(r0, r1, device=device) + (kv_length - q_length)
        lo, hi = _band_bounds(p, kv_length, causal, window)
        if spans is not None:
            lo = torch.maximum(lo, spans[0][:, r0:r1])
            hi = torch.minimum(hi, spans[1][:, r0:r1] - 1)
        ok = _rows_are_intervals(got[:, 0], lo, hi)
        if agree is None:  # most masks that differ do so in the first chunk: stop there
            if not bool(ok):
                return False
            agree = ok
        else:
            agree = agree & ok
    return agree is None or bool(agree)


def _band_bounds(p: torch.Tensor, kv_length: int, causal: bool, window: int | None):
    """The first and last key (int64, inclusive; empty when last < first) that :func:`_band_rule` allows the
    query positions ``p``."""
    lo = torch.zeros_like(p)
    hi = p.clamp(max=kv_length - 1) if causal else torch.full_like(p, kv_length - 1)
    if window:
        lo = (p - int(window) + 1).clamp(min=0)
        if not causal:
            hi = torch.minimum(hi, p + int(window) - 1)
    return lo, hi


def _rows_are_intervals(mask: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Whether each row of the bool ``mask [B, R, Lk]`` allows exactly the keys ``lo..hi`` (``[B or 1, R]``,
    inclusive; none when hi < lo), as a 0-dim bool tensor on the mask's device: every row's count equals
    its interval's length and, when that is not zero, its first and last allowed keys are lo and hi (then
    nothing else fits)."""
    want = (hi - lo + 1).clamp(min=0)
    bytes_ = mask.view(torch.uint8)  # argmax returns the first maximal index
    first = bytes_.argmax(-1)
    last = mask.shape[-1] - 1 - bytes_.flip(-1).argmax(-1)
    ok = (mask.sum(-1) == want) & ((want == 0) | ((first == lo) & (last == hi)))
    return ok.all()


_PACKED: list = []  # (weakref to a packed-batch marker, its rows' sequence bounds) of the latest markers


def _packed_marker(batch_size: int, length: int, mask_function: Callable, window: int | None, device,
                   use_vmap: bool, bounds: list[list[int]]) -> torch.Tensor | None:
    """A zero-memory marker (as :func:`_band_marker`) for a packed batch: rows holding several sequences
    (transformers' padding-free format, ``position_ids`` restarting at 0), each attending causally or
    bidirectionally, within the layer's window, to its own tokens only. ``bounds``: the sequences as read off
    the mask function (:func:`_unpad.segments`); the whole mask is checked against them. None when it is not
    such a mask (then it is materialised and refused as custom)."""
    spans = _unpad.token_spans(bounds, length, device)
    for causal in (True, False):
        layer_window = window if causal or window is None else int(window) + 1
        if _is_band(batch_size, length, length, 0, 0, mask_function, layer_window, causal, device, use_vmap, spans):
            marker = _band_marker(batch_size, length, length, layer_window, device, 0, causal)
            _PACKED[:] = [(weakref.ref(marker), bounds)] + [e for e in _PACKED if e[0]() is not None][:3]
            return marker
    return None


def _padding_marker(padding: torch.Tensor, q_length: int, kv_length: int, window: int | None, kv_offset: int,
                    causal: bool, packing) -> torch.Tensor:
    """What the mask interface returns for a padded batch whose mask is otherwise plain (causal /
    bidirectional, or a sliding window verified by :func:`_is_band`): the ``[B, kv_length]`` bool padding
    mask of the call's keys, registered with the band like a band marker, so :func:`check_mask` accepts it
    only on a call with that causality and window. The attention function runs the rows' real tokens:
    ``packing`` (:func:`_padding_packing`), kept with the marker, so that it does not read them again."""
    padding = padding.clone()  # our own object: the registry's weakref must not see the caller's tensor
    if isinstance(packing, _unpad.Packing):
        _PADDING_PACKINGS[:] = [(weakref.ref(padding), padding._version, q_length, packing)] + \
            [e for e in _PADDING_PACKINGS if e[0]() is not None][:3]
    return _registered(padding, (q_length, kv_length, window, int(kv_offset), bool(causal)))


# (weakref to a padding marker, its version, q_len, its Packing) of the latest markers: a model with full-attention
# and sliding-window layers makes two masks a forward, and its layers alternate between them
_PADDING_PACKINGS: list = []
_UNREAD = object()  # _padding_packing's answer for a padding the attention function refuses (reads and raises there)


def _padding_packing(padding: torch.Tensor, q_length: int):
    """The sequences of the call's ``[B, kv_length]`` padding as :func:`_unpad.from_padding` reads them (one host
    read, once a forward: it also tells whether any row is padded at all): a Packing, None when no row has padding,
    or :data:`_UNREAD` when from_padding refuses the padding (real tokens not one run), which the attention function
    then reads again and refuses by name: a mask no layer uses raises nothing, as before."""
    try:
        return _unpad.from_padding(padding, q_length)
    except NotImplementedError:
        return _UNREAD


def _marker_packing(mask: torch.Tensor, lq: int):
    """The Packing the mask interface read for the padding marker ``mask`` on ``lq`` queries (unchanged since), or
    None."""
    for ref, version, q_len, packing in _PADDING_PACKINGS:
        if ref() is mask:
            return packing if (q_len == lq and mask._version == version) else None
    return None


def _registered(marker: torch.Tensor, band: tuple) -> torch.Tensor:
    """``marker``, registered (weakly, the latest four) with its ``(q_len, kv_len, window, kv_offset, causal)``."""
    _BANDS[:] = [(weakref.ref(marker), band)] + [b for b in _BANDS if b[0]() is not None][:3]
    return marker


def _band_marker(batch_size: int, q_length: int, kv_length: int, window: int | None, device,
                 kv_offset: int = 0, causal: bool = True) -> torch.Tensor:
    """What the mask interface returns for a verified sliding-window mask (:func:`_is_band`): a
    ``[B, 1, Lq, Lk]`` all-False bool view of one element (no O(Lq * Lk) memory; anything else that
    read it as a mask would mask everything, not attend silently), recognised by :func:`check_mask`.
    ``kv_offset``: the token the call's first key is (> 0 once a sliding-window cache dropped keys)."""
    marker = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device).expand(batch_size, 1, q_length, kv_length)
    band = (q_length, kv_length, window, int(kv_offset), bool(causal))
    _LAST_BAND_MARKER[:] = [(tuple(marker.shape), band)]  # kept past the marker's life: a copy may outlive it
    return _registered(marker, band)


_LAST_BAND_MARKER: list = []  # (shape, band) of the latest band marker made (:func:`_adopt_marker_copy`)


def _band_of(mask) -> tuple | None:
    """``(q_len, kv_len, window, kv_offset, causal)`` of the band marker ``mask`` is, or None for any other
    mask."""
    for ref, band in _BANDS:
        if mask is not None and ref() is mask:
            return band
    return None


def _key_offset(mask) -> int:
    """The token that key 0 of the call is, as the mask interface saw it (a band marker's ``kv_offset``);
    0 for any other mask: only sliding-window caches drop keys, and their masks are band markers."""
    band = _band_of(mask)
    return 0 if band is None else band[3]


def _reach(window: int | None, q_len: int, kv_len: int, causal: bool) -> int | None:
    """A sliding window's effective size (:func:`_band_rule`): None when every row's window holds all the
    keys the row could see without it (causal: every earlier key; bidirectional: every key)."""
    span = kv_len if causal else max(q_len, kv_len)
    return int(window) if window and int(window) < span else None


def _check_band(mask: torch.Tensor, lq: int, lk: int, causal: bool, window: int | None) -> bool:
    """True when ``mask`` is a band marker that matches this call; raises when it does not."""
    band = _band_of(mask)
    if band is None:
        return False
    q_len, kv_len, band_window, _, band_causal = band
    if ((q_len, kv_len, band_causal) != (lq, lk, causal)
            or _reach(window, lq, lk, causal) != _reach(band_window, lq, lk, causal)):
        shape = (f"causal with a sliding window of {band_window} keys" if band_causal else
                 f"bidirectional with a sliding window of {band_window} (keys less than {band_window} away)")
        raise NotImplementedError(
            f"sparse_attn: the model's mask is {shape} over "
            f"q_len={q_len}, kv_len={kv_len}, but this layer runs causal={causal}, sliding_window={window} over "
            f"q_len={lq}, kv_len={lk}; sparse_attn applies only the layer's own window, so it would not "
            "honour that mask")
    return True


# ---------------------------------------------------------------------- install
def register(default: SparseAttnConfig | None = None) -> None:
    """Register ``"sparse_attn"`` with transformers' attention and mask interfaces (idempotent).
    ``default``: the config for models switched to ``"sparse_attn"`` without :func:`enable`."""
    global _DEFAULT_CONFIG
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, sparse_attention_forward)
    AttentionMaskInterface.register(NAME, sparse_attn_mask)
    if default is not None:
        _DEFAULT_CONFIG = default


def _layer_index(module) -> int | None:
    idx = getattr(module, "layer_idx", None)
    return idx if isinstance(idx, int) and not isinstance(idx, bool) else None


def attention_modules(model) -> list:
    """The modules the attention function may receive: those that own projections (q_proj/qkv_proj/...)
    or whose class name says attention, with or without an integer ``layer_idx``. (Only indexed ones
    were taken: Whisper's encoder and a CLIP vision tower, whose attention has no ``layer_idx``, ran
    through "sparse_attn" with the module-global default, dense, instead of the pattern enabled.)"""
    return [m for m in model.modules()
            if "attention" in type(m).__name__.lower() or any(hasattr(m, n) for n in ("q_proj", "qkv_proj", "c_attn"))]


def enable(model, config: SparseAttnConfig | None = None, **config_kwargs) -> SparseAttnConfig:
    """Register ``"sparse_attn"``, attach ``config`` (or ``SparseAttnConfig(**config_kwargs)``) to the
    model's attention modules and switch the model to it. Returns the config (its ``stats`` /
    ``sparsity`` fill in on each forward)."""
    if config is None:
        config = SparseAttnConfig(**config_kwargs)
    elif config_kwargs:
        raise TypeError("pass either a SparseAttnConfig or its keyword arguments, not both")
    register()
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"found no attention modules in {type(model).__name__}: sparse_attn supports transformers "
                         "models whose attention goes through AttentionInterface")
    indexed = [i for i in map(_layer_index, modules) if i is not None]
    if indexed:
        config.check_layers(1 + max(indexed))
    elif config.layers is not None or config._per_layer:
        raise ValueError(f"{type(model).__name__}'s attention modules have no layer_idx, so layers= / per_layer= "
                         "select none of them: give one pattern for all layers")
    for m in modules:
        setattr(m, _ATTR, config)
    names = {id(m): name for name, m in model.named_modules()}
    for m in modules:
        setattr(m, _NAME_ATTR, names[id(m)])
    current = getattr(model.config, "_attn_implementation", None)
    if current != NAME and not hasattr(model, _PREVIOUS):
        setattr(model, _PREVIOUS, current)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise RuntimeError(f"{type(model).__name__} did not switch to attn_implementation={NAME!r} (it does not "
                           "dispatch its attention through transformers' AttentionInterface)")
    _switch_module_configs(modules, NAME)
    config.reset_stats()
    return config


def _switch_module_configs(modules: list, name: str) -> None:
    """Set ``name`` on the configs of attention modules that ``set_attn_implementation`` did not reach: the
    modules dispatch on their own ``config``, and some models hold copies of the model's (T5's stacks,
    deep-copied: under transformers 5.17 ``enable`` reported the switch while every T5 attention ran eager)."""
    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", name) != name:
            cfg._attn_implementation = name


def disable(model, attn_implementation: str | None = None) -> None:
    """Switch back (to ``attn_implementation``, else what the model ran before :func:`enable`, else
    ``"sdpa"``) and detach the configs."""
    previous = getattr(model, _PREVIOUS, None)
    target = attn_implementation or previous or "sdpa"
    model.set_attn_implementation(target)
    _switch_module_configs(attention_modules(model), target)
    for m in model.modules():
        for attr in (_ATTR, _NAME_ATTR):
            if hasattr(m, attr):
                delattr(m, attr)
    if hasattr(model, _PREVIOUS):
        delattr(model, _PREVIOUS)


def get_config(model) -> SparseAttnConfig | None:
    """The config :func:`enable` attached to ``model`` (None if none)."""
    for m in model.modules():
        cfg = getattr(m, _ATTR, None)
        if cfg is not None:
            return cfg
    return None


__all__ = [
    "NAME",
    "LayerStats",
    "SparseAttnConfig",
    "check_mask",
    "disable",
    "enable",
    "get_config",
    "register",
    "sparse_attention_forward",
    "sparse_attn_mask",
]


try:  # importing this module makes attn_implementation="sparse_attn" available
    register()
except ImportError:  # transformers is not installed: enable()/register() will say so when called
    pass
