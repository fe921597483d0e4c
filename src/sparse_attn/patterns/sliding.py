"""Sliding-window (local) and streaming (attention sinks + window) layouts, token-exact.

Positions are in the key frame: query row ``i`` has ``p = i + Lk - Lq``.
"""
from __future__ import annotations

from ..layout import BlockLayout
from ..masks import INF, ElementMask, MaskTerm
from ..validation import check_flag
from ._common import check_int, grid, lengths


def _window_term(window: int, window_right: int | None, causal: bool) -> MaskTerm:
    if check_flag("causal", causal):  # "False" is truthy: it ran causal
        check_int("window", window, 1)
        if window_right not in (None, 0):
            raise ValueError(f"window_right={window_right} was given with causal=True; a causal window has no "
                             "keys to the right: drop window_right or pass causal=False")
        return MaskTerm(left=window - 1, right=0)
    check_int("window", window, 0)
    right = window if window_right is None else check_int("window_right", window_right, 0)
    return MaskTerm(left=window, right=right)


def local(seq_len: int, window: int, kv_len: int | None = None, *, causal: bool = True,
          window_right: int | None = None, block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Token-exact sliding window.

    Masking rule (``p = i + Lk - Lq``):
        causal=True:  key ``j`` allowed iff ``p - window < j <= p`` (``window`` keys, self included;
                      ``window >= 1``). ``window_right`` must be None or 0.
        causal=False: key ``j`` allowed iff ``p - window <= j <= p + window_right``
                      (``window_right`` defaults to ``window``; both >= 0).

    Args:
        seq_len: ``Lq``; kv_len: ``Lk`` (default ``Lq``); block sizes multiples of 16 in [16, 256].
    Returns: a BlockLayout (batch = heads = 1); interior blocks full, band edges partial.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    mask = ElementMask((_window_term(window, window_right, causal),))
    return BlockLayout.from_mask(mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k,
                                 device=device)


def local_block_count(seq_len: int, window: int, kv_len: int | None = None, *, block_q: int = 128,
                      block_k: int = 128) -> int:
    """``local(seq_len, window, kv_len, block_q=, block_k=).num_blocks`` (causal) without building the layout:
    :func:`streaming_block_count` without sinks."""
    return streaming_block_count(seq_len, window, 0, kv_len, block_q=block_q, block_k=block_k)


def streaming_block_count(seq_len: int, window: int, num_sink: int, kv_len: int | None = None, *,
                          block_q: int = 128, block_k: int = 128) -> int:
    """``streaming(seq_len, window, num_sink, kv_len, block_q=, block_k=).num_blocks`` (causal) in O(Qb) integer
    steps, without building the layout: per query block, the key blocks from the one holding its first row's
    earliest key through its last row's position (consecutive rows' windows overlap, so every block in between
    holds an allowed key), and the sink blocks before those up to the last row's position. The kernels' device
    plan walks the same blocks (kernels._device_window_row)."""
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("window", window, 1)
    num_sink = check_int("num_sink", num_sink, 0)
    nq, _ = grid(q_len, kv_len, block_q, block_k)
    total = 0
    for qb in range(nq):
        p_first = qb * block_q + kv_len - q_len
        p_last = min((qb + 1) * block_q, q_len) - 1 + kv_len - q_len
        if p_last >= 0:  # p_last < kv_len always: the last query sits at the last key
            b_lo = max(p_first - window + 1, 0) // block_k
            sink_blocks = (min(num_sink, p_last + 1) + block_k - 1) // block_k
            total += p_last // block_k + 1 - b_lo + min(sink_blocks, b_lo)
    return total


def streaming(seq_len: int, window: int, num_sink: int, kv_len: int | None = None, *, causal: bool = True,
              block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Attention sinks plus a sliding window (StreamingLLM), token-exact.

    Masking rule (``p = i + Lk - Lq``):
        causal=True:  key ``j`` allowed iff ``p - window < j <= p`` (window, self included) or
                      ``j < num_sink and j <= p`` (sinks are still causal: a query never sees a
                      sink key after its own position).
        causal=False: key ``j`` allowed iff ``p - window <= j <= p + window`` or ``j < num_sink``.

    ``num_sink = 0`` gives :func:`local`. Returns a BlockLayout (batch = heads = 1).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("num_sink", num_sink, 0)
    terms = [_window_term(window, None, causal)]
    if num_sink:
        terms.append(MaskTerm(k_lo=0, k_hi=num_sink - 1, right=0 if causal else INF))
    return BlockLayout.from_mask(ElementMask(tuple(terms)), q_len=q_len, kv_len=kv_len, block_q=block_q,
                                 block_k=block_k, device=device)
