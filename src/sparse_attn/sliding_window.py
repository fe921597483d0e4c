"""The ``window=`` argument of :func:`sparse_attn.attention` and :func:`sparse_attn.varlen_attention`: a bottom-right
causal sliding window without a layout. Its checks, and the layouts of the calls that run one (gradients, 8-bit,
the CPU); forward-only CUDA calls plan the window in the kernel instead (kernels.fwd_kernel DEVICE_PLAN 3)."""
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


# (window, lq, lk, device) -> patterns.local, for the attention(window=) calls that run a layout
_WINDOW_LAYOUTS = PlanCache(16)


def window_layout(window: int, lq: int, lk: int, device) -> BlockLayout:
    """``patterns.local(lq, window, kv_len=lk)`` on ``device``, cached per shape (a training loop's calls
    repeat it). Not built while torch.compile traces (its block counting is data-dependent)."""
    key = (window, lq, lk, str(device))
    layout = _WINDOW_LAYOUTS.find(key)
    if layout is None and torch.compiler.is_compiling():
        raise RuntimeError(f"sparse_attn: attention(window={window}) with gradients (or quant=, or on the CPU) runs "
                           f"patterns.local's layout, built on first use per shape (Lq={lq}, Lk={lk}), which cannot be "
                           f"traced; pass layout=sparse_attn.prepare(patterns.local({lq}, {window}, kv_len={lk}, "
                           "device=...), causal=True) with causal=True instead of window=")
    return layout if layout is not None else _WINDOW_LAYOUTS.get(
        key, lambda: patterns.local(lq, window, kv_len=lk, device=device))


@functools.lru_cache(maxsize=16)
def window_pattern(window: int):
    """``pattern=`` for varlen_attention's ``window`` on the host plan: one function object per window, so
    the plan cache (keyed by the pattern's identity) finds it again."""
    return lambda q_len, kv_len: patterns.local(q_len, window, kv_len=kv_len)
