"""torch.library custom ops (with fake impls for torch.compile) and their autograd.

The layout arrives as its schedule (see schedule.py): forward rows ``counts, n_full, full_start,
indices, mask_ids, contiguous`` and, when a gradient is needed, the transposed rows ``t_*`` for dK/dV.

Callers go through :func:`forward_op`: the custom op while torch.compile traces; in eager mode an
``autograd.Function`` over the same implementation and backward, which skips the dispatcher's
per-call host work (autograd wrapper, redispatch, output alias checks).
``benchmarks/launch_overhead.py`` at L=256 on an H200 host: before, 200 us per call through the
custom op against 115 us for the bare launch in the same run; after, 163 us against 180 us (another
machine of the same kind: host figures vary by 1.5x between machines). That host time is what a
short call, and every call of a context-parallel step, waits for before its kernel starts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...validation import needs_grad
from . import launch
from .schedule import trainable


def _fwd_impl(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices,
              t_mask_ids, t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k,
              seq_step, cu_dk, dk_rows, pv_threshold, device_plan=0, window=0, sinks=0):
    return launch.forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms, n_terms,
                          cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step, pv_threshold=pv_threshold,
                          device_plan=device_plan, window=window, sinks=sinks)


@torch.library.custom_op("sparse_attn::block_sparse_fwd", mutates_args=())
def block_sparse_fwd(q: Tensor, k: Tensor, v: Tensor, counts: Tensor, n_full: Tensor, full_start: Tensor,
                     indices: Tensor, mask_ids: Tensor, contiguous: bool,
                     t_counts: Optional[Tensor], t_n_full: Optional[Tensor], t_indices: Optional[Tensor],
                     t_mask_ids: Optional[Tensor], t_contiguous: bool, terms: Tensor, n_terms: int,
                     cu_q: Optional[Tensor], cu_k: Optional[Tensor], block_q: int, block_k: int, sm_scale: float,
                     max_q: int, max_k: int, seq_step: int = 1, cu_dk: Optional[Tensor] = None,
                     dk_rows: Optional[Tensor] = None, pv_threshold: float = 0.0,
                     device_plan: int = 0, window: int = 0, sinks: int = 0) -> tuple[Tensor, Tensor]:
    """Forward; the ``t_*`` tensors (and ``cu_dk`` / ``dk_rows``, see launch.backward) only ride
    along for backward. ``seq_step`` 2: ``cu_q`` / ``cu_k`` are (start, end) pairs per sequence.
    ``pv_threshold`` > 0 skips negligible tiles (launch.forward); forward only. ``device_plan`` 1 / 2 / 3
    (dense / causal / causal window of ``window`` keys after ``sinks`` sink keys, forward only): the kernel
    plans its rows, the schedule tensors are stand-ins (launch.forward)."""
    return _fwd_impl(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full,
                     t_indices, t_mask_ids, t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale,
                     max_q, max_k, seq_step, cu_dk, dk_rows, pv_threshold, device_plan, window, sinks)


@block_sparse_fwd.register_fake
def _(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids,
      t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step=1, cu_dk=None,
      dk_rows=None, pv_threshold=0.0, device_plan=0, window=0, sinks=0):
    if cu_q is not None:
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return q.new_empty(q.shape), lse  # contiguous, as launch.forward allocates it (not q's strides)


def _bwd_impl(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full, t_indices, t_mask_ids,
              terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step=1, cu_dk=None,
              dk_rows=None, contiguous=False, t_contiguous=False, dlse=None):
    return launch.backward(do.contiguous(), q, k, v, out, lse, counts, n_full, indices, mask_ids,
                           t_counts, t_n_full, t_indices, t_mask_ids, terms, n_terms, cu_q, cu_k,
                           block_q, block_k, sm_scale, max_q, max_k, seq_step, cu_dk, dk_rows,
                           contiguous=contiguous, t_contiguous=t_contiguous, dlse=dlse)


@torch.library.custom_op("sparse_attn::block_sparse_bwd", mutates_args=())
def block_sparse_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     counts: Tensor, n_full: Tensor, indices: Tensor, mask_ids: Tensor,
                     t_counts: Tensor, t_n_full: Tensor, t_indices: Tensor, t_mask_ids: Tensor,
                     terms: Tensor, n_terms: int, cu_q: Optional[Tensor], cu_k: Optional[Tensor],
                     block_q: int, block_k: int, sm_scale: float, max_q: int, max_k: int, seq_step: int = 1,
                     cu_dk: Optional[Tensor] = None, dk_rows: Optional[Tensor] = None, contiguous: bool = False,
                     t_contiguous: bool = False, dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full, t_indices,
                     t_mask_ids, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step,
                     cu_dk, dk_rows, contiguous, t_contiguous, dlse)


@block_sparse_bwd.register_fake
def _(do, q, k, v, *args):
    # contiguous, as launch.backward allocates them: a fake with the inputs' strides made compiled graphs
    # over transposed [B, L, H, D] inputs fail (a traced view of a tensor that came back contiguous)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    (q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids,
     t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step, cu_dk, dk_rows,
     pv_threshold, device_plan, window, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *map(trainable, (counts, n_full, indices, mask_ids, t_counts, t_n_full,
                                                              t_indices, t_mask_ids, terms, cu_q, cu_k, cu_dk,
                                                              dk_rows)))
    ctx.meta = (n_terms, block_q, block_k, sm_scale, max_q, max_k, seq_step, pv_threshold, contiguous, t_contiguous)


def _backward(ctx, do, dlse, bwd=block_sparse_bwd):
    """Gradients of q, k, v, from the output's gradient ``do`` and the LSE's ``dlse`` (None when the loss did
    not use it; ``do`` None, eager only: the loss used only the LSE). The custom op's autograd calls the
    backward custom op: AOTAutograd traces this function with fake tensors while
    ``torch.compiler.is_compiling()`` is False, so only an opaque op may run here then."""
    (q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full, t_indices, t_mask_ids, terms,
     cu_q, cu_k, cu_dk, dk_rows) = ctx.saved_tensors
    if do is None:  # eager, the loss used only the LSE (gradients are not materialized, _EagerForward)
        do = torch.zeros_like(out)
    n_terms, block_q, block_k, sm_scale, max_q, max_k, seq_step, pv_threshold, contiguous, t_contiguous = ctx.meta
    if pv_threshold > 0:  # the api refuses it with grad enabled; this guards direct op callers
        raise RuntimeError("sparse_attn: pv_threshold is a forward-only (inference) option: the output dropped tiles "
                           "that exact gradients would need")
    if t_counts is None:
        raise RuntimeError("sparse_attn: backward needs the layout's transpose, which is passed only when an input "
                           "requires grad at forward time; call attention() with grad enabled")
    dq, dk, dv = bwd(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full, t_indices,
                     t_mask_ids, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step,
                     cu_dk, dk_rows, contiguous, t_contiguous, dlse)
    return (dq, dk, dv) + (None,) * 27


block_sparse_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """The custom op's forward and backward without the dispatcher (eager mode only)."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        # an unused output's gradient arrives as None, not zeros: a loss that ignores the LSE then skips
        # the row-terms pass's dLSE load (HAS_DLSE) instead of reading a zero tensor
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        # the Triton backward records no graph: without this a create_graph=True gradient came back
        # detached and a gradient penalty was silently dropped; double backward is the reference's
        return _backward(ctx, do, dlse, _bwd_impl)


def forward_op(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices,
               t_mask_ids, t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k,
               seq_step=1, cu_dk=None, dk_rows=None, pv_threshold=0.0, device_plan=0, window=0, sinks=0):
    """The forward op (arguments as :func:`block_sparse_fwd`) -> ``(out, lse)``, differentiable in
    q, k, v: the custom op while torch.compile traces, :class:`_EagerForward` otherwise."""
    args = (q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices,
            t_mask_ids, t_contiguous, terms, n_terms, cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, seq_step,
            cu_dk, dk_rows, pv_threshold, device_plan, window, sinks)
    if torch.compiler.is_compiling():
        return block_sparse_fwd(*args)
    if not needs_grad(q, k, v):
        # nothing to record (inference, decoding): the Function's apply costs ~25-30 us of host time a
        # call, about what the kernel itself takes on a short decoding step
        return _fwd_impl(*args)
    return _EagerForward.apply(*args)
