"""Public entry points: validate, pick a path, call an op."""
from __future__ import annotations

import dataclasses
import functools
import numbers
import operator

import torch

from . import patterns, reference
from .device_guard import on_inputs_device
from .layout import BlockLayout, layout_key
from .patterns import causal_cut
from .patterns.basic import mark_causal
from .plan_cache import PlanCache
from .sliding_window import check_num_sink, check_window, window_layout, window_pattern
from .validation import (autocast_inputs, capturing, check_causal, check_flags, check_is_layout, check_layout,
                         check_packed_qkv, check_qkv, check_scale, needs_grad)

DEFAULT_BLOCK = 128


def _use_kernels(q: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; everything else the PyTorch reference."""
    return q.is_cuda


def _kernel_layout(layout: BlockLayout | None, causal: bool, lq: int, lk: int, device,
                   exact: bool = True) -> BlockLayout:
    """The layout the kernels run: dense/causal when none is given (``exact`` False: a forward-only call,
    which may share a plan built for other lengths, see _default_layout); causal folded in by intersection
    (cached on the layout), so the kernels only ever apply a layout's own element masks."""
    if layout is None:
        return _default_layout(causal, lq, lk, str(device), exact)
    if not causal:
        return layout
    key = ("causal", torch.device(device))
    caches = layout._caches()
    if key not in caches:
        caches[key] = causal_cut(layout)
    return caches[key]


_DEFAULT_LAYOUTS: dict = {}  # (causal, lq, lk, device) -> BlockLayout, the last DEFAULT_LAYOUTS_KEPT used
DEFAULT_LAYOUTS_KEPT = 32
# id -> a default layout a CUDA graph was captured on, kept past its eviction (by id, not shape: one shape's
# entry may be replaced, a shared layout by one built for a call that needs gradients, and each graph keeps its own)
_CAPTURED_DEFAULTS: dict = {}
# (varlen.plan_key, device) -> a CUDA default layout that 8-bit calls (forward-only) of every shape with
# that plan share: a decoding loop's cache grows a token a call, and for Lq <= 128 one plan serves a whole
# key block's worth of lengths (benchmarks/NOTES.md, "Shared plans for growing caches"). 16-bit calls that
# need no gradient plan in the kernel instead (ops.block_sparse.device_plan_attention_op)
_SHARED_PLANS = PlanCache(DEFAULT_LAYOUTS_KEPT)


def _default_layout(causal: bool, lq: int, lk: int, device: str, exact: bool = True) -> BlockLayout:
    """Dense or causal layout with 128x128 blocks, cached per shape (the last 32 used; their schedules are
    cached on them at first use). A plain dict, which Dynamo reads: it ignores a functools.lru_cache and
    traced the builder, whose block counting is data-dependent, so torch.compile(fullgraph=True) of
    attention() without a layout failed on CUDA even after an eager call. While compiling it is only read.

    ``exact`` False (a call no gradient will flow through: the 8-bit path; 16-bit calls without gradients
    take the kernels' device plan and no layout) accepts a CUDA layout built for other lengths with the
    same plan (_shared_plan): the forward kernels take the lengths from the tensors and read only the
    plan, while the backward's transpose reads the layout's own q_len / kv_len, so calls that need
    gradients replace such an entry with one built for their lengths."""
    key = (causal, lq, lk, device)
    layout = _DEFAULT_LAYOUTS.get(key)
    usable = layout is not None and (not exact or (layout.q_len, layout.kv_len) == (lq, lk))
    if torch.compiler.is_compiling():
        if not usable:
            kind = "causal" if causal else "dense"
            raise RuntimeError(f"sparse_attn: attention() without a layout runs a default {kind} layout built on "
                               f"first use per shape (Lq={lq}, Lk={lk}), which cannot be traced; call attention once "
                               "eagerly with these lengths (with grad enabled if the compiled code trains) before "
                               f"torch.compile, or pass layout=sparse_attn.prepare(patterns.{kind}(Lq, Lk, "
                               "device=...))")
        return layout
    if capturing(torch.device(device)):
        if not usable:  # its plan would be copied from host memory the replay cannot trust
            raise RuntimeError(f"sparse_attn: attention() without a layout builds its plan on first use per shape "
                               f"(Lq={lq}, Lk={lk}), which cannot run inside CUDA graph capture; call attention once "
                               "eagerly with these lengths (with grad enabled if the captured code trains) before "
                               "capturing (PyTorch's recipe warms up on a side stream)")
        _CAPTURED_DEFAULTS[id(layout)] = layout  # a graph replays on its tensors: never freed
    _DEFAULT_LAYOUTS.pop(key, None)
    if not usable and _plans_on_host(device):
        layout = None if exact else _shared_plan(causal, lq, lk, device)
        if layout is None:
            layout = _one_sequence_layout(causal, lq, lk, device)
    elif not usable:
        builder = patterns.causal if causal else patterns.dense  # entries built directly, no per-block counting
        layout = builder(lq, lk, block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK, device=device)
    _DEFAULT_LAYOUTS[key] = layout  # (re)inserted last: the first key is the least recently used
    if len(_DEFAULT_LAYOUTS) > DEFAULT_LAYOUTS_KEPT:
        del _DEFAULT_LAYOUTS[next(iter(_DEFAULT_LAYOUTS))]
    return layout


def _plans_on_host(device: str) -> bool:
    """Whether default layouts are built as one-sequence plans (on CUDA; the CPU runs the reference, which
    takes the patterns' layouts; tests of the plans' sharing patch this)."""
    return torch.device(device).type == "cuda"


def _shared_plan(causal: bool, lq: int, lk: int, device: str) -> BlockLayout | None:
    """A forward-only call's CUDA default layout, shared with every (lq, lk) of the same plan (built for the
    first of them; varlen.plan_key says why that gives the same bits), or None when the plan is too long
    to key cheaply."""
    from .varlen import plan_key
    key = plan_key([lq], [lk], causal, lq, DEFAULT_BLOCK)
    if key is None:
        return None
    return _SHARED_PLANS.get(key + (device,), lambda: _one_sequence_layout(causal, lq, lk, device))


def _one_sequence_layout(causal: bool, lq: int, lk: int, device: str) -> BlockLayout:
    """The blocks of ``patterns.dense`` / ``patterns.causal`` (lq, lk) with their forward schedule seeded, for
    a CUDA call: varlen's one-shot plan of one sequence (varlen.stack_dense_or_causal), built on the host
    and copied asynchronously. A decoding loop's growing cache makes every call a new shape: through the
    patterns and the schedule's reordering (~60 small CUDA ops and a sync) each step took 3-4 ms of host time
    on an H200's host, this way 0.5-0.8 ms, and with forward-only steps sharing it (_shared_plan) what a call
    on a fixed cache takes (benchmarks/host_overhead_probe.py, ``decode-growing``)."""
    from .ops.block_sparse.schedule import schedule_key
    from .varlen import stack_dense_or_causal
    layout = stack_dense_or_causal([lq], [lk], causal, lq, lk, device, DEFAULT_BLOCK)
    caches = layout._caches()
    caches[schedule_key(None)] = caches[schedule_key([lk])]  # one sequence of lk keys: the call's own rows
    return mark_causal(layout) if causal else layout


@on_inputs_device()
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout | str | None = None, *,
              causal: bool = False, scale: float | None = None, return_lse: bool = False,
              quant: str | None = None, quant_granularity: str = "per_warp", smooth_k: bool = True,
              adaptive: dict | None = None, return_layout: bool = False, pv_threshold: float | None = None,
              window: int | None = None, num_sink: int = 0):
    """Block-sparse attention.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``, one dtype and device;
            GQA/MQA when ``Hq`` is a multiple of ``Hkv`` (K/V are never repeated in memory). The CUDA
            kernels need ``Dv == D``; the reference path (CPU) takes any ``Dv``.
        layout: which ``block_q x block_k`` blocks each query block visits
            (:class:`sparse_attn.BlockLayout`, built for exactly ``(Lq, Lk)``, batch in {1, B},
            heads in {1, Hq}); None attends every key; ``"adaptive"`` or ``"adaptive:low|medium|high"``
            predicts one from these q/k (:func:`sparse_attn.predict.meansim`, with this call's
            ``causal`` and ``scale``).
        causal: also mask keys after the query, bottom-right aligned: query i sees key j iff
            ``j <= i + Lk - Lq`` (FlashAttention's convention for ``Lq != Lk``).
        scale: softmax scale; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp (natural log) of the scaled, masked scores,
            fp32 ``[B, Hq, Lq]``, differentiable (a loss may use it, e.g. to merge partial
            attentions); with ``quant`` it is the 8-bit forward's and carries no gradient.
        quant: ``None`` (fp16/bf16 products), ``"int8"`` (Q.K in INT8, P.V in q's dtype) or
            ``"int8-fp8"`` (also P.V in FP8 e4m3; GPUs with compute capability 8.9+). Head dim a
            multiple of 16 from 32 to 256; ``"int8-fp8"`` also needs the layout's ``block_k`` a multiple of 32.
            Gradients flow through the fp16/bf16 path (sparse_attn.quantized).
        quant_granularity: Q/K scale groups, ``"per_block"``, ``"per_warp"`` or ``"per_thread"``
            (sparse_attn.ops.sage.granularity).
        smooth_k: subtract K's per-head mean over tokens before quantizing (exact under softmax).
        adaptive: meansim options for ``layout="adaptive"`` (``simthreshd1``, ``cdfthreshd``,
            ``topk``, ``block_q``/``block_k``/``block``, ``attention_sink``), over the level's.
        return_layout: also return the layout that ran (predicted, given, or None), last:
            ``(out, layout)`` or ``(out, lse, layout)``; ``layout.sparsity`` is the fraction skipped.
        pv_threshold: in (0, 1), inference only (CUDA kernels, no grad, no quant): inside the kernel,
            a key tile whose probabilities are all below it for every query row of the tile,
            relative to the row's running max, is dropped (no exp, no P.V), as if the layout had
            left it out for those rows (SpargeAttn's second stage, ``pvthreshd``, as a probability).
            Each dropped probability is < pv_threshold of its row's total.
        window: with ``causal`` and no layout, a sliding window of this many keys: query i sees key j iff
            ``p - window < j <= p``, ``p = i + Lk - Lq`` (``patterns.local``; FlashAttention's
            ``window_size=(window - 1, 0)``). Forward-only fp16/bf16 calls on CUDA plan it in the kernel (no
            layout built, nothing to warm up for torch.compile or CUDA graphs); calls with gradients, 8-bit
            calls and the CPU run ``patterns.local(Lq, window, kv_len=Lk)`` (cached per shape; under
            torch.compile with gradients pass that layout, prepared, instead).
        num_sink: with ``window``, attention sinks (StreamingLLM): query i also sees keys ``j < num_sink``,
            ``j <= p``. Planned like the window alone; the calls that run a layout run
            ``patterns.streaming(Lq, window, num_sink, kv_len=Lk)``.

    Returns:
        ``out [B, Hq, Lq, Dv]`` in q's dtype (autocast's, below), or ``(out, lse)``. A query row that may see no key
        gets output 0 and LSE ``-inf``.

    Inside ``torch.autocast("cuda")`` CUDA inputs are cast to autocast's dtype first, as for
    ``scaled_dot_product_attention`` (fp32 q/k from a rotary embedding next to a bf16 v run in bf16).
    """
    q, k, v = autocast_inputs(q, k, v)
    entry_key = None
    if (layout is None and quant is None and adaptive is None and pv_threshold is None and return_layout is False
            and smooth_k is True and quant_granularity == "per_warp" and type(return_lse) is bool):
        entry_key = _decode_entry_key(q, k, v, causal, scale, return_lse, window, num_sink)
        if entry_key is not None:  # a decoding call of a geometry seen before: its kept launches, nothing else
            from .ops.block_sparse import entry
            out = entry.run(entry_key, q, k, v, return_lse)
            if out is not None:
                return out
    check_qkv(q, k, v)
    scale, causal = check_scale(scale), check_causal(causal)
    check_flags(return_lse=return_lse, return_layout=return_layout, smooth_k=smooth_k)
    _check_unused_granularity(quant, quant_granularity)
    if pv_threshold is not None:
        pv_threshold = _check_pv_threshold(pv_threshold, q, k, v, quant)
    num_sink = check_num_sink(num_sink, window)
    if window is not None:
        window = check_window(window, causal, layout if adaptive is None else layout or "adaptive", "layout")
        # these run a layout; return_layout returns the one that ran (the device plan's blocks, as a layout)
        if quant is not None or not _use_kernels(q) or needs_grad(q, k, v) or return_layout:
            layout = window_layout(window, q.shape[2], k.shape[2], q.device, num_sink)
    if isinstance(layout, str) or adaptive is not None:
        from .predict.adaptive import predicted_layout
        layout = predicted_layout(layout, q, k, causal=causal, scale=scale, options=adaptive)
    if return_layout:  # this same call (every keyword forwarded) without return_layout, then the layout
        out = attention(q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse, quant=quant,
                        quant_granularity=quant_granularity, smooth_k=smooth_k, pv_threshold=pv_threshold)
        return (*out, layout) if return_lse else (out, layout)
    if layout is not None:
        layout = check_layout(layout, q, k)
    if quant is not None:
        from . import quantized
        return quantized.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse, quant=quant,
                                   granularity=quant_granularity, smooth_k=smooth_k)
    if not _use_kernels(q):
        if layout is not None and torch.compiler.is_compiling():  # the reference's key walk is data-dependent
            from . import reference_op
            return reference_op.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse)
        return reference.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=return_lse)
    from .ops.block_sparse import attention_op, device_plan_attention_op
    grad = needs_grad(q, k, v)
    if layout is None and not grad:  # the kernel plans the default layout's (or the window's) rows itself
        result = device_plan_attention_op(q, k, v, causal, scale=scale, return_lse=return_lse,
                                          pv_threshold=pv_threshold or 0.0, window=window, num_sink=num_sink)
        if entry_key is not None:
            from .ops.block_sparse import entry
            entry.learn(entry_key, q, k, v)
        return result
    kernel_layout = _kernel_layout(layout, causal, q.shape[2], k.shape[2], q.device, exact=grad)
    return attention_op(q, k, v, kernel_layout, scale=scale, return_lse=return_lse, pv_threshold=pv_threshold or 0.0)


def _decode_entry_key(q, k, v, causal, scale, return_lse, window, num_sink) -> tuple | None:
    """The key of ops.block_sparse.entry for a forward-only call on the kernels without a layout (a decoding step's),
    or None (any other call: it takes the checks and the path below)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None  # (a subclass may behave otherwise; anything else fails the checks below)
    if not _use_kernels(q) or needs_grad(q, k, v):
        return None
    from .ops.block_sparse import entry
    return entry.key(q, k, v, causal, scale, return_lse, window, num_sink)


def _check_unused_granularity(quant, granularity) -> None:
    """Without quant, a granularity other than the default is still checked, so a typo surfaces before
    quant= is added (with quant, the 8-bit path checks it). The default skips the import: ops.sage
    loads Triton, which a CPU-only call does not otherwise need."""
    if quant is None and granularity != "per_warp":
        from .ops.sage.granularity import check_granularity
        check_granularity(granularity)


def _check_pv_threshold(value, q, k, v, quant) -> float:
    """``value`` as a Python float (numpy scalars too, as scale= takes them) once it may run."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value < 1.0:
        raise ValueError(f"pv_threshold must be a number in (0, 1) (a probability), got {value!r}")
    if quant is not None:
        raise ValueError("pv_threshold runs in the fp16/bf16 kernels; drop quant= or pv_threshold=")
    if not _use_kernels(q):
        raise ValueError(f"pv_threshold runs inside the CUDA kernels (the skip is decided per kernel tile); "
                         f"got inputs on {q.device}: leave it None there")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("pv_threshold is for inference: the output drops tiles that exact gradients need; run under "
                         "torch.no_grad() or drop pv_threshold=")
    return float(value)


@on_inputs_device("layout")
def prepare(layout: BlockLayout, backward: bool = True, causal: bool = False) -> BlockLayout:
    """Precompute what the GPU kernels derive from ``layout`` (its visiting schedule; for ``backward``
    the transposed one; with ``causal`` the layout's intersection with causal, as
    ``attention(..., causal=True)`` uses it). Optional in eager mode; call it once, on the device the
    layout will be used on, before ``torch.compile`` so nothing data-dependent is traced, and before
    capturing a CUDA graph with a layout not used yet (building the schedule reads it on the host).
    Returns the layout."""
    from .ops.block_sparse import prepare as _prepare
    check_is_layout(layout)  # prepare(None) failed on None.q_len
    check_flags(backward=backward, causal=causal)  # causal="no" prepared the causal schedule
    _prepare(_kernel_layout(layout, causal, layout.q_len, layout.kv_len, layout.device), backward)
    return layout


@on_inputs_device()
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     layouts=None, pattern=None, causal: bool = False, scale: float | None = None,
                     return_lse: bool = False, quant: str | None = None, quant_granularity: str = "per_warp",
                     smooth_k: bool = True, window: int | None = None, num_sink: int = 0):
    """Block-sparse attention over packed variable-length sequences.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (packed); ``Hq % Hkv == 0``.
        cu_seqlens_q / cu_seqlens_k: int32 ``[num_seqs + 1]`` token offsets (start 0, end at T), on q's
            device or on the CPU. The call reads them on the host to plan its blocks: offsets on the GPU
            cost a sync (the host waits for the kernels queued before), offsets on the CPU (which a server
            building them from Python lists has anyway) none; the kernels then get one asynchronous copy.
        max_seqlen_q / max_seqlen_k: upper bounds on the per-sequence lengths.
        layouts: one :class:`BlockLayout` per sequence, each built for that sequence's
            ``(q_len, kv_len)``; or
        pattern: ``pattern(q_len, kv_len) -> BlockLayout``, called per sequence (e.g.
            ``lambda lq, lk: patterns.local(lq, 256, kv_len=lk)``); neither = dense. The layouts
            are cached per batch shape and pattern object (the last 16), so a training loop builds
            them once: the pattern must be a pure function of its arguments; to change what it
            returns, pass another function object. With neither (dense, or ``causal``) a CUDA
            call builds its plan in one pass over all sequences, cheap enough for decoding steps,
            whose growing caches make every shape new (README, "Decoding").
        causal: bottom-right aligned per sequence (query i of a sequence sees key j iff
            ``j <= i + kv_len - q_len``), combined with the layout by intersection.
        window: with ``causal``, a sliding window of this many keys per sequence (query at position
            ``p = i + kv_len - q_len`` sees ``p - window < j <= p``, self included: ``patterns.local``, or
            FlashAttention's ``window_size=(window - 1, 0)``). Not with ``layouts`` / ``pattern`` (build the
            window into them). Forward-only CUDA calls plan it in the kernel like dense / causal (below).
        num_sink: with ``window``, attention sinks per sequence: query i also sees the sequence's keys
            ``j < num_sink``, ``j <= p`` (``patterns.streaming``). Planned like the window alone.
        quant, quant_granularity, smooth_k: 8-bit attention as in :func:`attention`; each packed
            sequence is quantized as if it were called alone (its own scale groups, K mean and V
            channel scales), so its result does not depend on what else is packed with it.

    Returns: out ``[Tq, Hq, Dv]`` (and lse fp32 ``[Hq, Tq]``).

    Forward-only calls without layouts, pattern or quant (dense, causal or window, nothing requiring grad) on CUDA
    plan each row in the kernel from the offsets (the device plan): no plan is built on the host, and the
    call can be captured in a CUDA graph whose replays follow whatever lengths ``cu_seqlens`` then hold.
    Capture it on the whole K/V buffers with the offsets on q's device, after eager warm-up calls; inside
    the capture the offsets are not checked (a replay reads them on the GPU): the kernels keep every access
    inside the packed tensors, but the lengths must stay within ``max_seqlen_q`` / ``max_seqlen_k`` (rows of
    a longer sequence past them are not written). Other calls read the offsets on the host and refuse capture.

    Under ``torch.compile`` the call is a graph break (``fullgraph=False``): ``cu_seqlens`` are read
    on the host to build the per-sequence layouts. :func:`attention` compiles with ``fullgraph=True``.
    """
    from . import varlen
    q, k, v = autocast_inputs(q, k, v)  # as attention() does inside torch.autocast("cuda")
    scale, causal = check_scale(scale), check_causal(causal)
    check_flags(return_lse=return_lse, smooth_k=smooth_k)
    _check_unused_granularity(quant, quant_granularity)
    check_packed_qkv(q, k, v, "varlen_attention")
    num_sink = check_num_sink(num_sink, window)
    window = check_window(window, causal, layouts if pattern is None else pattern,
                           "layouts" if pattern is None else "pattern")
    device_plan = _varlen_device_plan(q, k, v, layouts, pattern, quant)
    q_lens = varlen.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device, device_plan)
    k_lens = varlen.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device, device_plan)
    n_q, n_k = (cu.numel() - 1 for cu in (cu_seqlens_q, cu_seqlens_k))
    if n_q != n_k:
        raise ValueError(f"cu_seqlens_q has {n_q} sequences, cu_seqlens_k has {n_k}")
    max_seqlen_q, max_seqlen_k = operator.index(max_seqlen_q), operator.index(max_seqlen_k)  # numpy ints too
    if device_plan:
        from .ops.block_sparse import varlen_device_plan_op
        cu_seqlens_q, cu_seqlens_k = varlen.offsets_on(q.device, cu_seqlens_q, cu_seqlens_k)  # given on the CPU
        return varlen_device_plan_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     scale=scale, return_lse=return_lse, window=window, num_sink=num_sink)
    if window is not None:  # the host plans it as patterns.local / streaming, one cached function per window
        pattern = window_pattern(window, num_sink)
    varlen.check_layout_args(layouts, pattern, len(q_lens))  # before the plan cache hashes them
    plan = _varlen_plan(q_lens, k_lens, layouts, pattern, causal, q.shape[1], max_seqlen_q, max_seqlen_k, q.device,
                        exact=needs_grad(q, k, v))
    hp_args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # as given: hp_call re-validates
    cu_seqlens_q, cu_seqlens_k = varlen.offsets_on(q.device, cu_seqlens_q, cu_seqlens_k)  # offsets given on the CPU
    if quant is not None:
        from . import quantized
        hp_call = functools.partial(varlen_attention, *hp_args, layouts=layouts, pattern=pattern, causal=causal,
                                    scale=scale)
        return quantized.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, plan,
                                          scale=scale, return_lse=return_lse, quant=quant,
                                          granularity=quant_granularity, smooth_k=smooth_k, hp_call=hp_call)
    if not _use_kernels(q):
        return _varlen_reference(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), plan.per_seq, scale,
                                 return_lse)
    from .ops.block_sparse import varlen_attention_op
    return varlen_attention_op(q, k, v, plan.stacked, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               plan.kv_lens, scale=scale, return_lse=return_lse)


def _varlen_device_plan(q, k, v, layouts, pattern, quant) -> bool:
    """Whether a varlen call runs the kernels' device plan (launch.forward ``device_plan``): dense, causal or a
    causal window (no layouts, pattern or quant) on the kernels, forward-only, eager or inside a CUDA graph capture (not
    while torch.compile traces: the custom op takes a schedule). The kernels then plan every row from the
    offsets on the GPU: no plan is built, cached or copied, and the call captures (README, "CUDA graphs").
    Calls that need gradients keep the host's exact plan, whose transpose the backward reads."""
    return (layouts is None and pattern is None and quant is None and _use_kernels(q) and not needs_grad(q, k, v)
            and not torch.compiler.is_compiling())


_VARLEN_PLANS = PlanCache(16)
# (varlen.plan_key, device) -> a CUDA dense / causal plan that forward-only calls of every batch shape with
# that key share: continuous batching makes every cache one token longer each step (as _SHARED_PLANS)
_SHARED_VARLEN_PLANS = PlanCache(16)


def _varlen_plan(q_lens, k_lens, layouts, pattern, causal, heads, max_q, max_k, device, exact: bool = True):
    """Per-sequence layouts (and, on CUDA, their stacked form) for one batch shape, cached so a
    training loop does not rebuild them every step. The key holds the pattern / layout objects by
    identity, and the entry keeps them alive so an id cannot be reused while it is cached. ``exact``
    False (forward-only): a dense / causal plan may have been built for other lengths with the same
    varlen.plan_key; a call that needs gradients replaces such an entry (the backward's transpose reads
    the plan's own lengths)."""
    from . import varlen
    lengths = (tuple(q_lens), tuple(k_lens), max_q, max_k)
    key = lengths + (causal, heads, str(device), id(pattern),
                     None if layouts is None else tuple(layout_key(lay) for lay in layouts))
    plan = _VARLEN_PLANS.find(key)
    if plan is not None and (not exact or plan.lengths == lengths):
        return plan
    on_host = _plans_on_host(device)

    def build():
        if on_host and layouts is None and pattern is None:  # dense / causal: no per-sequence layouts to build
            stacked = varlen.stack_dense_or_causal(q_lens, k_lens, causal, max_q, max_k, device)
            return _VarlenPlan((None, None), None, stacked, tuple(k_lens), lengths)
        per_seq = varlen.build_layouts(q_lens, k_lens, layouts, pattern, causal, heads=heads)
        stacked = kv_lens = None
        if on_host:
            stacked = varlen.stack([lay.to(device) for lay in per_seq], max_q, max_k, heads)
            kv_lens = tuple(k_lens)
        # a tuple: pinning the caller's list would let it replace an entry, freeing the layout whose id
        # is in the key for a new object to take
        return _VarlenPlan((pattern, None if layouts is None else tuple(layouts)), per_seq, stacked, kv_lens,
                           lengths)
    shared = None
    if not exact and on_host and layouts is None and pattern is None:
        shared = varlen.plan_key(q_lens, k_lens, causal, max_q)
    plan = build() if shared is None else _SHARED_VARLEN_PLANS.get(shared + (str(device),), build)
    _VARLEN_PLANS.put(key, plan)
    return plan


@dataclasses.dataclass
class _VarlenPlan:
    pinned: tuple  # the pattern / layouts whose ids are in the key
    per_seq: list | None  # one layout per sequence (None: dense / causal on CUDA, stacked at once)
    stacked: BlockLayout | None
    kv_lens: tuple | None  # per-sequence key lengths its schedule was made for (Python ints: lookups never sync)
    lengths: tuple  # (q_lens, k_lens, max_q, max_k) it was built for (a shared plan serves others, forward only)

    @property
    def block_k(self) -> int:
        return (self.stacked if self.per_seq is None else self.per_seq[0]).block_k


def _varlen_reference(q, k, v, cq, ck, per_seq, scale, return_lse):
    """Per-sequence reference calls, concatenated back to the packed layout."""
    outs, lses = [], []
    for b, lay in enumerate(per_seq):
        qs, ks, vs = (t[a:e].transpose(0, 1)[None] for t, a, e in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                                  (v, ck[b], ck[b + 1])))
        o, lse = reference.attention(qs, ks, vs, lay.to(q.device), scale=scale, return_lse=True)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0)
    return (out, torch.cat(lses, 1)) if return_lse else out
