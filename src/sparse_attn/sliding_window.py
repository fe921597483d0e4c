"""The ``window=`` and ``num_sink=`` arguments of :func:`sparse_attn.attention` and
:func:`sparse_attn.varlen_attention`: a bottom-right causal sliding window, with attention sinks or not, without a
layout. Their checks, and the layouts of the calls that run one (gradients, 8-bit, the CPU): ``patterns.local``, or
``patterns.streaming`` with sinks; forward-only CUDA calls plan the window in the kernel instead
(kernels.fwd_kernel DEVICE_PLAN 3)."""
from __future__ import annotations

import functools

import torch

from . import patterns
from .layout import BlockLayout
from .patterns._common import check_int
from .plan_cache import PlanCache


def check_window(window, causal: bool, given, given_name: str) -> int | None:
    """attention's / varlen_attention's ``window`` as an int >= 1 (or None), refused by name where it has no
    meaning: without ``causal``, or beside ``given`` (the call's ``given_name``: layout, layouts, pattern)."""
    if window is None:
        return None
    if isinstance(window, bool):
        raise TypeError(f"window must be an int (keys), got {window!r}")
    window = check_int("window", window, 1)
    if not causal:
        raise ValueError(f"window={window} is a causal sliding window (query at position p sees keys "
                         f"p - {window} < j <= p): pass causal=True, or for a two-sided window a layout "
                         f"patterns.local(q_len, {window}, kv_len=kv_len, causal=False)")
    if given is not None:
        shown = f"={given!r}" if isinstance(given, str) else "="
        into = "it" if given_name == "layout" else "them"
        raise ValueError(f"window={window} with {given_name}{shown}: build the window into {into} (your layout & "
                         f"patterns.local(q_len, {window}, kv_len=kv_len)), or drop window=")
    return window


def check_num_sink(num_sink, window: int | None) -> int:
    """attention's / varlen_attention's ``num_sink`` (checked ``window``) as an int >= 0: sinks are the first keys,
    seen by every query at or after them beside its window, so they need a window."""
    if isinstance(num_sink, bool):
        raise TypeError(f"num_sink must be an int (keys), got {num_sink!r}")
    num_sink = check_int("num_sink", num_sink, 0)
    if num_sink and window is None:
        raise ValueError(f"num_sink={num_sink} are the attention sinks of a sliding window (query at position p sees "
                         f"keys j < {num_sink} and p - window < j <= p): pass window= and causal=True too; without a "
                         "window every earlier key is seen anyway")
    return num_sink


def window_builder(window: int, num_sink: int):
    """``(lq, lk, device) -> BlockLayout``: the layout of the window's rule, ``patterns.local``, or
    ``patterns.streaming`` with sinks (the same masks and blocks the kernels' device plan walks)."""
    if num_sink:
        return lambda lq, lk, device=None: patterns.streaming(lq, window, num_sink, kv_len=lk, device=device)
    return lambda lq, lk, device=None: patterns.local(lq, window, kv_len=lk, device=device)


# (window, num_sink, lq, lk, device) -> patterns.local / streaming, for the attention(window=) calls that run a layout
_WINDOW_LAYOUTS = PlanCache(16)


def window_layout(window: int, lq: int, lk: int, device, num_sink: int = 0) -> BlockLayout:
    """The window's layout (:func:`window_builder`) for ``(lq, lk)`` on ``device``, cached per shape (a training
    loop's calls repeat it). Not built while torch.compile traces (its block counting is data-dependent)."""
    key = (window, num_sink, lq, lk, str(device))
    layout = _WINDOW_LAYOUTS.find(key)
    if layout is None and torch.compiler.is_compiling():
        built = (f"patterns.streaming({lq}, {window}, {num_sink}, kv_len={lk}, device=...)" if num_sink else
                 f"patterns.local({lq}, {window}, kv_len={lk}, device=...)")
        raise RuntimeError(f"sparse_attn: attention(window={window}) with gradients (or quant=, or on the CPU) runs "
                           f"a layout built on first use per shape (Lq={lq}, Lk={lk}), which cannot be traced; pass "
                           f"layout=sparse_attn.prepare({built}, causal=True) with causal=True instead of window=")
    return layout if layout is not None else _WINDOW_LAYOUTS.get(
        key, lambda: window_builder(window, num_sink)(lq, lk, device))


@functools.lru_cache(maxsize=16)
def window_pattern(window: int, num_sink: int = 0):
    """``pattern=`` for varlen_attention's ``window`` on the host plan: one function object per window and sink
    count, so the plan cache (keyed by the pattern's identity) finds it again."""
    build = window_builder(window, num_sink)
    return lambda q_len, kv_len: build(q_len, kv_len)
