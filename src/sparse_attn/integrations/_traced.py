"""The transformers integration while torch.compile traces a model (``generate(cache_implementation="static")``
compiles the decoding step by itself on CUDA, with CUDA graphs).

The eager attention and mask functions keep host-side state that a trace would freeze (the last mask's
sequences found again by identity, a padding mask read on the host), so traced they are graph breaks. The
calls that need no such state are traced instead, so that a decoding step can replay whole as one CUDA graph:

- the mask function, for causal or bidirectional masks with keys from token 0, returns None (no padding, keys
  ending at the last query) or the int8 key states of :func:`_unpad.key_states` (padding, and a static cache's
  slots after the last query, whose position is a tensor there); for a sliding-window layer's buffer that its
  window holds whole (a decoding step on a static cache), key states too (:func:`_sliding_window`);
- the attention function, for forward-only dense / causal / one-causal-window layers with no mask or such a
  ``[B, Lk]`` one, reads the rows' spans off the mask with traced tensor ops (:func:`_unpad.row_spans`, computed
  once a step for every layer) and calls :func:`spans_attention`, a custom op that runs the kernels over them in
  place (a few kernels a layer, no host read); off the kernels (the CPU), :func:`padded_attention` reads the mask
  on the host inside the op, as the eager function does.

Everything else goes to the eager functions, as before. Traced calls do not update ``SparseAttnConfig.stats``:
the sequences' lengths are known only on the device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _unpad


def mask(batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, mask_function, attention_mask,
         device, kwargs: dict | None = None) -> tuple[bool, Tensor | None]:
    """(handled, what the mask interface returns) for a traced call: handled for a causal or bidirectional mask
    function over keys from token 0, and for a causal sliding window whose window holds the whole buffer
    (:func:`_sliding_window`)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    causal = mask_function is None or mask_function is causal_mask_function
    if not (causal or mask_function is bidirectional_mask_function):
        return _sliding_window(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                               device, kwargs or {})
    if isinstance(kv_offset, Tensor) or kv_offset:
        return False, None
    if causal and not isinstance(q_offset, Tensor) and q_offset + q_length > kv_length:
        return False, None  # queries past the keys: the eager function says what is wrong
    ends_at_keys = not causal or (not isinstance(q_offset, Tensor) and q_offset + q_length == kv_length)
    if attention_mask is None and ends_at_keys:
        return True, None  # plain: sparse_attn applies causal itself
    padding = None if attention_mask is None else _unpad.call_padding(attention_mask, kv_length, 0)
    device = device or (attention_mask.device if attention_mask is not None else "cpu")
    q_end = kv_length if ends_at_keys else q_offset + q_length
    return True, _unpad.key_states(padding, batch_size, kv_length, q_end, device)


def _sliding_window(batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset, mask_function,
                    attention_mask, device, kwargs: dict) -> tuple[bool, Tensor | None]:
    """The traced mask of a causal sliding-window layer of a cache: key states (:func:`_unpad.key_states`,
    :data:`_unpad.SHIFTED` once the buffer dropped keys) when the window, ``local_size`` keys, holds every key of the
    buffer, so that the mask is the causal one over it. That is a decoding step's on transformers'
    ``StaticSlidingWindowLayer`` (``local_size`` slots, or fewer, filled from token 0 and then rolled), whose mask
    otherwise broke the graph at every step (and, its offsets read on the host, compiled the step again at every
    step). generate() makes a replayed step's masks outside the graph (the eager interface's 4-D key states, which
    models pass through), so this serves masks made inside it: a decoding forward compiled by hand, fed a 2-D mask
    (the cache's int offsets are then values in the graph). Taken where transformers' causal sliding-window mask is made without extra mask functions (no
    ``allow_is_bidirectional_skip``, ``use_vmap`` off) and queries do not equal keys from token 0 (packed
    sequences, which are made so, run eagerly). The mask function is still evaluated over the call (a few small
    kernels once a step): rows where it allows other keys than the causal ones are :data:`_unpad.REFUSED` (NaN
    outputs; read on the host, an error), since nothing can raise while traced."""
    from transformers.masking_utils import sdpa_mask
    window = kwargs.get("local_size")
    if (window is None or "allow_is_bidirectional_skip" in kwargs or kwargs.get("use_vmap")
            or isinstance(kv_offset, Tensor) or kv_length > window):
        return False, None
    if not isinstance(q_offset, Tensor) and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return False, None  # no cache (packed sequences are made so): the eager function reads the mask function
    if attention_mask is not None:
        device = device or attention_mask.device
    device = device or "cpu"
    q_end = q_offset + q_length - kv_offset  # one past the last query, among the call's keys
    got = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                    kv_offset=kv_offset, mask_function=mask_function, allow_is_causal_skip=False, use_vmap=False,
                    device=device)
    i = torch.arange(q_length, device=device)[:, None] + (q_end - q_length)
    want = torch.arange(kv_length, device=device)[None, :] <= i  # causal over the buffer's slots
    # compared as int8: inductor's value ranges fail on != between bool tensors (torch 2.11 and 2.13)
    refused = (got[:, 0].to(torch.int8) != want.to(torch.int8)).flatten(1).any(1).expand(batch_size)
    padding = None if attention_mask is None else _unpad.call_padding(attention_mask, kv_length, kv_offset)
    return True, _unpad.key_states(padding, batch_size, kv_length, q_end, device, shifted=kv_offset > 0,
                                   refused=refused)


def forward(cfg, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling, dropout,
            kwargs: dict) -> Tensor | None:
    """The attention function's output ``[B, Lq, Hq, Dv]`` for a traced call, or None where the eager function
    must run it (what it refuses, gradients, layouts, band / packed markers, cu_seq_lens)."""
    from .. import api
    from ..validation import needs_grad
    from . import transformers as t
    if cfg is None or dropout or kwargs.get("output_attentions") or needs_grad(query, key, value):
        return None
    if any(kwargs.get(name) is not None for name in (*t.UNSUPPORTED_KWARGS, "cu_seq_lens_q", "cu_seq_lens_k")):
        return None
    lq, lk = query.shape[2], key.shape[2]
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 4:
        attention_mask = _unpad.key_states_of(attention_mask)  # a sliding-window step's key states, else None
        if attention_mask is None:
            return None
    if attention_mask is not None and not (isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
                                           and attention_mask.shape[1] == lk
                                           and not attention_mask.is_floating_point()):
        return None
    causal = cfg.causal_for(module, kwargs.get("is_causal"))
    window = kwargs.get("sliding_window")
    spec = cfg.spec_for(t._layer_index(module))
    planned = t._planned(spec, window, t._causal_window(spec, window, causal), lq, lk, causal)
    if planned is None:
        return None
    run_causal, run_window, num_sink = planned
    args = run_causal, int(run_window or 0), int(num_sink), None if scaling is None else float(scaling)
    if attention_mask is not None and api._use_kernels(query):
        # the rows' spans traced here (the same ops on the same mask in every layer, which the compiler computes
        # once), numbered in the token views inside the op
        spans, drop, fill = _unpad.row_spans(attention_mask, lq, query.dtype)
        return spans_attention(query, key, value, spans, drop, fill, *args)
    return padded_attention(query, key, value, attention_mask, *args)


@torch.library.custom_op("sparse_attn::padded_attention", mutates_args=())
def padded_attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], causal: bool, window: int,
                     num_sink: int, scale: Optional[float]) -> Tensor:
    """Dense, causal or causal-window (``window`` > 0 keys, ``num_sink`` sinks) attention of a padded batch:
    query ``[B, Hq, Lq, D]``, key / value ``[B, Hkv, Lk, D]``, ``mask`` None (no padding) or ``[B, Lk]`` as
    :func:`_unpad.from_padding` takes it -> ``[B, Lq, Hq, Dv]``, zeros at padded queries, each row's real tokens
    as if called alone (the eager attention function's result). The mask is read on the host, as the eager
    function does: traced calls on the kernels run :func:`spans_attention` instead (None: the kernels' device
    plan, no read)."""
    from .. import api
    w = window or None
    packing = None if mask is None else _unpad.from_padding(mask, query.shape[2])
    if packing is None:
        out = api.attention(query, key, value, causal=causal, window=w, num_sink=num_sink, scale=scale)
        return out.transpose(1, 2).contiguous()
    if not packing.q_lens:  # every row is padding
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    q, k, v = packing.pack(query, False), packing.pack(key, True), packing.pack(value, True)
    return packing.unpack(api.varlen_attention(q, k, v, packing.cu_q, packing.cu_k, packing.max_q, packing.max_k,
                                               causal=causal, window=w, num_sink=num_sink, scale=scale))


@padded_attention.register_fake
def _(query, key, value, mask, causal, window, num_sink, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


@torch.library.custom_op("sparse_attn::spans_attention", mutates_args=())
def spans_attention(query: Tensor, key: Tensor, value: Tensor, spans: Tensor, drop: Tensor, fill: Tensor,
                    causal: bool, window: int, num_sink: int, scale: Optional[float]) -> Tensor:
    """:func:`padded_attention` on the kernels (CUDA, forward-only) with the rows' spans already read off the mask
    on the device (:func:`_unpad.row_spans`): :func:`_unpad.in_place_spans`, a few kernels and no host read, so a
    compiled step replays as one CUDA graph."""
    return _unpad.in_place_spans(query, key, value, spans, drop, fill, causal=causal, window=window or None,
                                 num_sink=num_sink, scale=scale)


@spans_attention.register_fake
def _(query, key, value, spans, drop, fill, causal, window, num_sink, scale):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
