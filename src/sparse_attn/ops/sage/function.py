"""torch.library custom op of the 8-bit forward (with a fake impl for torch.compile).

Not differentiable by itself: :func:`sparse_attn.attention` routes gradients through the
fp16/bf16 kernels (see sparse_attn/quantized.py). Callers go through :func:`sage_forward`: the custom
op while torch.compile traces, the launcher itself in eager mode, which skips the dispatcher's
per-call host work (autograd wrapper, redispatch, output alias checks; block_sparse/function.py does
the same for the bf16 op). ``benchmarks/launch_overhead.py --quant int8-fp8`` on an H200 host, L=256,
with kv_stats' finishing kernel: 753-981 us a call before, 500-525 us after
(results/sage-host-time-h200/).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import launch


@torch.library.custom_op("sparse_attn::sage_fwd", mutates_args=())
def sage_fwd(q: Tensor, k: Tensor, v: Tensor, counts: Tensor, n_full: Tensor, full_start: Tensor,
             indices: Tensor, mask_ids: Tensor, contiguous: bool, terms: Tensor, n_terms: int,
             cu_q: Optional[Tensor], cu_k: Optional[Tensor], block_q: int, block_k: int, sm_scale: float,
             max_q: int, max_k: int, quant: int, granularity: str, smooth_k: bool,
             unsmoothed_lse: bool = False) -> tuple[Tensor, Tensor]:
    return launch.forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms, n_terms,
                          cu_q, cu_k, block_q, block_k, sm_scale, max_q, max_k, quant, granularity, smooth_k,
                          unsmoothed_lse)


@sage_fwd.register_fake
def _(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms, n_terms, cu_q, cu_k, block_q,
      block_k, sm_scale, max_q, max_k, quant, granularity, smooth_k, unsmoothed_lse=False):
    if cu_q is not None:
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    # contiguous, as launch.forward allocates it: empty_like kept a transposed q's strides, and compiled graphs
    # over [B, L, H, D] activations failed on them
    return q.new_empty(q.shape), lse


def sage_forward(*args):
    """The 8-bit forward (arguments as :func:`sage_fwd`) -> ``(out, lse)``: the custom op while
    torch.compile traces, :func:`launch.forward` directly otherwise (nothing to differentiate, so no
    autograd wrapper is needed in eager mode)."""
    if torch.compiler.is_compiling():
        return sage_fwd(*args)
    return launch.forward(*args)
