"""Block-sparse FlashAttention op: the public wrapper over the custom ops."""
from __future__ import annotations

import math

import torch

from ...layout import BlockLayout
from ...validation import capturing
from . import launch
from .function import forward_op, needs_grad as _needs_grad
from .schedule import made_trainable, schedule, schedule_key, trainable

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def check_kernel_inputs(q: torch.Tensor, v: torch.Tensor) -> None:
    """What the Triton kernels support beyond the general validation."""
    if q.dtype not in KERNEL_DTYPES and q.device.type == "cuda":
        raise TypeError(f"the Triton kernels take float16 or bfloat16, got {q.dtype}: cast q/k/v (e.g. .bfloat16()), "
                        "or call sparse_attn.reference.attention for an fp32 result")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[-1]} is above the kernels' limit of {MAX_HEAD_DIM}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"the Triton kernels need v's head_dim ({v.shape[-1]}) equal to q/k's ({q.shape[-1]})")


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The softmax scale as a float: ``scale``, or ``1 / sqrt(D)`` for None."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_call_inputs(q, k, v, scale: float | None):
    """Every op's prologue: inputs checked, made unit-stride in the head dim, and the scale as a float."""
    check_kernel_inputs(q, v)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    return q, k, v, softmax_scale(q, scale)


def _offsets(cu):
    """Sequence offsets as the kernels read them, at unit stride (a strided view, e.g. every other entry
    of a pairs tensor, was read as if packed: other sequences' bounds, writes past the output)."""
    return None if cu is None else cu.contiguous()


def layout_inputs(layout: BlockLayout, needs_grad: bool, kv_lens=None) -> tuple:
    """The layout as the ops' arguments: the forward schedule (counts, n_full, full_start, indices,
    mask_ids, contiguous), the transposed schedule (t_counts, t_n_full, t_indices, t_mask_ids,
    t_contiguous; only for backward), and the term table (terms, n_terms). Schedules are cached on
    the layout: a layout used under torch.compile, or first used inside a CUDA graph capture, must
    have run once eagerly (or through :func:`prepare`): building a schedule reads the layout on the
    host, which can neither be traced nor captured."""
    compiling = torch.compiler.is_compiling()
    if (compiling or capturing(layout.device)) and not _prepared(layout, needs_grad, kv_lens):
        if compiling:
            raise RuntimeError("sparse_attn: this layout's kernel schedule is built on first use, which cannot be "
                               "traced; call sparse_attn.prepare(layout) (or run attention once) before torch.compile")
        raise RuntimeError("sparse_attn: this layout's kernel schedule is built on first use, which reads the layout "
                           "on the host and cannot run inside CUDA graph capture; call sparse_attn.prepare(layout) "
                           "(or run attention once with it) before capturing")
    terms, _ = layout.mask_table()
    n_terms = terms.shape[1] if layout.masks else 0
    fwd = schedule(layout, kv_lens)
    # what autograd saves must not be inference tensors (made_trainable); not while tracing, which cannot ask:
    # a layout compiled for training was prepared for backward (or ran with gradients) eagerly, which copied them
    if needs_grad and not compiling:
        made_trainable(fwd)
        if terms.is_inference():
            layout._table = tuple(map(trainable, layout._table))
            terms = layout._table[0]
    rows = (fwd.counts, fwd.n_full, fwd.full_start, fwd.indices, fwd.mask_ids, fwd.contiguous)
    if needs_grad:
        t = layout.transpose()
        ts = schedule(t, bound_tail=False)  # dK/dV: rows past the query end are zeroed by lse, not masks
        if not compiling:
            made_trainable(ts)
        trans = (ts.counts, ts.n_full, ts.indices, ts.mask_ids, ts.contiguous)
    else:
        trans = (None, None, None, None, False)
    return rows + trans + (terms, n_terms)


def forward_layout_inputs(layout: BlockLayout, kv_lens=None) -> tuple:
    """The arguments :func:`launch.forward` takes for the layout: the forward schedule (counts,
    n_full, full_start, indices, mask_ids, contiguous) and the term table (terms, n_terms)."""
    rows = layout_inputs(layout, False, kv_lens)
    return rows[:6] + rows[-2:]


def _prepared(layout: BlockLayout, needs_grad: bool, kv_lens) -> bool:
    if schedule_key(kv_lens) not in layout._derived:
        return False
    t = layout._transpose
    return not needs_grad or (t is not None and ("schedule", False, None) in t._derived)


def prepare(layout: BlockLayout, backward: bool = True) -> BlockLayout:
    """Build (and cache) what the kernels derive from a layout: its schedule and, for backward, its
    transposed schedule. Optional in eager mode; required once before torch.compile, and before a
    CUDA graph capture that uses the layout for the first time."""
    layout_inputs(layout, backward)
    return layout


def attention_op(q, k, v, layout: BlockLayout, *, scale: float | None = None, return_lse: bool = False,
                 pv_threshold: float = 0.0):
    """Run the kernels on validated ``[B, H, L, D]`` inputs with a validated layout on q's device
    (``pv_threshold`` > 0: drop negligible tiles, forward only; see ``sparse_attn.attention``)."""
    q, k, v, scale = _kernel_call_inputs(q, k, v, scale)
    needs_grad = _needs_grad(q, k, v)
    out, lse = forward_op(q, k, v, *layout_inputs(layout, needs_grad), None, None, layout.block_q, layout.block_k,
                          scale, q.shape[2], k.shape[2], pv_threshold=float(pv_threshold))
    return (out, lse) if return_lse else out


def forward_into(q, k, v, layout: BlockLayout, out: torch.Tensor, lse: torch.Tensor, *, scale: float | None = None,
                 cu_q=None, cu_k=None, max_q: int | None = None, max_k: int | None = None, kv_lens=None,
                 seq_step: int = 1) -> None:
    """Forward kernels writing into ``out`` / ``lse`` (views shaped as the op's results: ``lse`` of any
    strides, ``out`` with unit stride in its last dim), outside autograd: for callers that fill slices of
    their own buffers inside their own autograd.Function (context parallelism). Dense ``[B, H, L, D]``
    inputs, or packed ``[T, H, D]`` ones with ``cu_q`` / ``cu_k`` / ``max_q`` / ``max_k`` / ``kv_lens``
    as :func:`grouped_attention_op` (``seq_step`` 2) or :func:`varlen_attention_op` (1)."""
    q, k, v, scale = _kernel_call_inputs(q, k, v, scale)
    if out.shape != q.shape[:-1] + v.shape[-1:] or out.dtype != q.dtype or out.stride(-1) != 1:
        # the kernels store a row's channels contiguously: out[..., ::2] got its neighbours overwritten
        raise ValueError(f"forward_into needs out shaped {tuple(q.shape[:-1] + v.shape[-1:])} in {q.dtype} with unit "
                         f"stride in its last dim, got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    lse_shape = q.shape[:3] if cu_q is None else (q.shape[1], q.shape[0])  # dense [B, H, Lq], packed [H, T]
    if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != torch.float32:
        # the kernels store every row's LSE in fp32 at lse's strides: a shorter lse was written past its end
        raise ValueError(f"forward_into needs lse shaped {tuple(lse_shape)} in torch.float32 (any strides), got "
                         f"{tuple(lse.shape)} {lse.dtype}")
    cu_q, cu_k = _offsets(cu_q), _offsets(cu_k)
    if cu_q is None:
        max_q, max_k = q.shape[2], k.shape[2]
    launch.forward(q, k, v, *forward_layout_inputs(layout, kv_lens), cu_q, cu_k, layout.block_q, layout.block_k, scale,
                   max_q, max_k, seq_step, out=out, lse=lse)


def varlen_attention_op(q, k, v, stacked: BlockLayout, cu_q, cu_k, max_q: int, max_k: int, kv_lens, *,
                        scale: float | None = None, return_lse: bool = False):
    """Kernels on validated packed ``[T, H, D]`` inputs; ``stacked`` has one batch row per sequence and
    ``kv_lens`` (ints) the sequences' key lengths."""
    q, k, v, scale = _kernel_call_inputs(q, k, v, scale)
    needs_grad = _needs_grad(q, k, v)
    out, lse = forward_op(q, k, v, *layout_inputs(stacked, needs_grad, kv_lens), _offsets(cu_q), _offsets(cu_k),
                          stacked.block_q, stacked.block_k, scale, max_q, max_k)
    return (out, lse) if return_lse else out


def _device_plan_forward(q, k, v, causal: bool, cu_q, cu_k, max_q: int, max_k: int, scale, return_lse: bool,
                         pv_threshold: float = 0.0, window: int | None = None, num_sink: int = 0, seq_step: int = 1):
    """Dense, bottom-right causal or (``window``, with causal) causal sliding-window forward (with ``num_sink``
    attention sinks) whose rows the kernel plans itself (launch.forward ``device_plan``; 128 x 128 blocks, the
    bits of the default layout's, or patterns.local's / patterns.streaming's, host plan). An int32 stand-in
    (the offsets, or one int) rides in the schedule's and term table's places, never read: the custom op
    takes tensors there, and the autotune key, which holds their dtypes, is then the host plan's."""
    q, k, v, scale = _kernel_call_inputs(q, k, v, scale)
    cu_q, cu_k = _offsets(cu_q), _offsets(cu_k)
    stand_in = cu_q if cu_q is not None else torch.empty(1, dtype=torch.int32, device=q.device)
    schedule = (stand_in,) * 5 + (True, None, None, None, None, False, stand_in, 1 if causal else 0)
    plan = 3 if window else 2 if causal else 1
    out, lse = forward_op(q, k, v, *schedule, cu_q, cu_k, 128, 128, scale, max_q, max_k, seq_step,
                          pv_threshold=float(pv_threshold), device_plan=plan, window=int(window or 0),
                          sinks=int(num_sink))
    return (out, lse) if return_lse else out


def device_plan_attention_op(q, k, v, causal: bool, *, scale: float | None = None, return_lse: bool = False,
                             pv_threshold: float = 0.0, window: int | None = None, num_sink: int = 0):
    """Dense, bottom-right causal or (``window``, ``num_sink``) causal sliding-window attention on validated
    ``[B, H, L, D]`` inputs, forward only (nothing requires grad), its rows planned by the kernel from Lq / Lk
    (_device_plan_forward): no layout is built or looked up, so the call needs no eager warm-up before
    torch.compile or CUDA graph capture, and a growing cache costs what a fixed one does."""
    return _device_plan_forward(q, k, v, causal, None, None, q.shape[2], k.shape[2], scale, return_lse, pv_threshold,
                                window=window, num_sink=num_sink)


def varlen_device_plan_op(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, *,
                          scale: float | None = None, return_lse: bool = False, window: int | None = None,
                          num_sink: int = 0, seq_step: int = 1):
    """Dense, causal or causal sliding-window (``window`` keys, ``num_sink`` sinks) attention on validated packed
    ``[T, H, D]`` inputs, forward only, its rows planned by the kernels from ``cu_q`` / ``cu_k`` on q's device
    (_device_plan_forward): nothing reads the offsets on the host, so the call can be captured in a CUDA
    graph and replayed on other lengths up to ``max_q`` / ``max_k``. ``seq_step`` 2: ``cu_q`` / ``cu_k`` are
    (start, end) token pairs ``[2 S]`` instead (a padded batch read in place, integrations._unpad.token_view):
    query tokens outside every pair are not written."""
    return _device_plan_forward(q, k, v, causal, cu_q, cu_k, max_q, max_k, scale, return_lse, window=window,
                                num_sink=num_sink, seq_step=seq_step)


def grouped_attention_op(q, k, v, stacked: BlockLayout, cu_q, cu_k, max_q: int, max_k: int, kv_lens, *,
                         cu_dk=None, dk_rows=None, free_rows=None, scale: float | None = None,
                         return_lse: bool = False):
    """Grouped attention in one launch on validated packed ``[T, H, D]`` inputs (see
    :func:`sparse_attn.grouped_attention`): ``stacked`` has one batch row per group; ``cu_q`` /
    ``cu_k`` are int32 (start, end) pairs ``[2 G]`` (K/V slices may overlap, query slices may sit
    anywhere); ``kv_lens`` (ints) the groups' key lengths; ``cu_dk`` / ``dk_rows`` the dK/dV scratch
    layout (launch.backward; None when the K/V slices tile k exactly); ``free_rows`` (int64) the
    query rows in no group, which the kernels never write: they get output 0 and LSE -inf here (and
    dQ 0: launch.backward zero-fills dQ for paired bounds)."""
    q, k, v, scale = _kernel_call_inputs(q, k, v, scale)
    needs_grad = _needs_grad(q, k, v)
    out, lse = forward_op(q, k, v, *layout_inputs(stacked, needs_grad, kv_lens), _offsets(cu_q), _offsets(cu_k),
                          stacked.block_q, stacked.block_k, scale, max_q, max_k, 2, _offsets(cu_dk), dk_rows)
    if free_rows is not None:  # out of place: the op's own output is saved for backward
        out = out.index_fill(0, free_rows, 0.0)
        lse = lse.index_fill(1, free_rows, float("-inf"))
    return (out, lse) if return_lse else out
