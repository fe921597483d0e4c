"""One rank's local attention: its query chunks against the gathered K/V, forward and backward.

Tensors are ``[B, H, L, D]`` views along the token dim 2 (a packed ``[T, H, D]`` batch is viewed as
``[1, H, T, D]``); ``groups`` (:class:`sparse_attn.Group`) name each query slice and the key slice it
attends, bottom-right causal per group. Forward keeps the per-token LSE so the backward runs the
kernels' backward directly on the re-gathered K/V, without recomputing the forward.

Two paths, as everywhere in the package: CUDA tensors run the Triton kernels (the forward: one
launch per group, or one grouped launch for them all when there are many; the backward: one kernel
backward per group, on views); other tensors run the PyTorch reference, whose backward recomputes
its forward under autograd. ``FORCE_KERNELS`` (tests) sends CPU tensors down the kernel path too,
which runs under the Triton interpreter.

The backward stays a per-group loop: the grouped backward routes overlapping K/V slices through an
fp32 scratch buffer and an index_add, which measured 0.93-0.98x of the loop (benchmarks/NOTES.md).
"""
from __future__ import annotations

import torch

from .. import api, patterns

FORCE_KERNELS = False
BLOCK = 128  # the blocks of the default dense/causal layouts (as sparse_attn.attention with layout=None)


def use_kernels(q: torch.Tensor) -> bool:
    return q.is_cuda or FORCE_KERNELS


def _layout(causal: bool, lq: int, lk: int, device, cache: dict):
    """The dense/causal kernel layout of one group shape (as ``sparse_attn.attention`` builds it for
    ``layout=None``), held in ``cache`` (the plan's) so its kernel schedules are built once per plan."""
    key = ("layout", causal, lq, lk, str(device))
    if key not in cache:
        cache[key] = (patterns.causal if causal else patterns.dense)(lq, lk, block_q=BLOCK, block_k=BLOCK,
                                                                      device=device)
    return cache[key]


def _packed(t: torch.Tensor, b: int) -> torch.Tensor:
    """Batch row ``b`` of a ``[B, H, L, D]`` view as a packed ``[L, H, D]`` view (no copy)."""
    return t[b].transpose(0, 1)


def forward(q, kf, vf, groups, causal: bool, scale, out: torch.Tensor, lse: torch.Tensor, cache: dict,
            grouped: bool | None = None) -> None:
    """Write each group's attention into ``out [B, h, Lq, Dv]`` and its LSE into ``lse`` (fp32
    ``[B, h, Lq]``); ``q [B, h, Lq, D]``, ``kf``/``vf [B, hk, Lk, D|Dv]`` (gathered, global order).

    Kernels write straight into slices of ``out`` / ``lse`` (no per-group copies; the caller is an
    autograd.Function, so no autograd wrapper either). More than two groups (a packed batch of
    several sequences) run as one grouped launch per batch row, which saves a launch and its host
    time per group (part of the CP forward's 4.1 -> 1.9 ms with 4 sequences at 8K tokens per GPU on
    2 H200); the two groups of one sequence run as two plain launches, which measured 6% faster than
    one grouped launch there (kernels 1.98 vs 2.10 ms). ``grouped`` True / False forces one way
    (``use_grouped_attention`` of the entry points); the reference path ignores it."""
    if not use_kernels(q):
        for g in groups:
            qs, ks, vs = q[:, :, g.q_start:g.q_end], kf[:, :, g.k_start:g.k_end], vf[:, :, g.k_start:g.k_end]
            o, l_ = api.attention(qs, ks, vs, causal=causal, scale=scale, return_lse=True)
            out[:, :, g.q_start:g.q_end] = o
            lse[:, :, g.q_start:g.q_end] = l_
        return
    from ..ops.block_sparse import forward_into
    if (len(groups) > 2) if grouped is None else grouped:
        from ..grouped import grouped_plan
        plan = grouped_plan(groups, q.shape[2], kf.shape[2], causal=causal, heads=q.shape[1], device=q.device)
        assert plan.free_rows is None, "zigzag groups cover every local query token"
        for b in range(q.shape[0]):
            forward_into(_packed(q, b), _packed(kf, b), _packed(vf, b), plan.stacked, _packed(out, b), lse[b],
                         scale=scale, cu_q=plan.cu_q, cu_k=plan.cu_k, max_q=plan.max_q, max_k=plan.max_k,
                         kv_lens=plan.kv_lens, seq_step=2)
        return
    for g in groups:
        qs, ks = slice(g.q_start, g.q_end), slice(g.k_start, g.k_end)
        forward_into(q[:, :, qs], kf[:, :, ks], vf[:, :, ks], _layout(causal, g.q_len, g.k_len, q.device, cache),
                     out[:, :, qs], lse[:, :, qs], scale=scale)


def _kernel_backward(do, q, k, v, out, lse, layout, scale):
    """The kernels' backward of one group, dK/dV in fp32 (they are summed over groups and ranks; bf16
    partial sums doubled the max error against single-device attention at 4K tokens). Called from
    an autograd.Function's backward: the kernels run directly."""
    from ..ops.block_sparse import launch, layout_inputs, softmax_scale
    (counts, n_full, _, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, t_contiguous, terms,
     n_terms) = layout_inputs(layout, True)
    scale = softmax_scale(q, scale)
    return launch.backward(do.contiguous(), q, k, v, out, lse.contiguous(), counts, n_full, indices, mask_ids,
                           t_counts, t_n_full, t_indices, t_mask_ids, terms, n_terms, None, None, layout.block_q,
                           layout.block_k, scale, q.shape[2], k.shape[2], dkv_dtype=torch.float32,
                           contiguous=contiguous, t_contiguous=t_contiguous)


def _reference_backward(do, q, k, v, causal, scale):
    with torch.enable_grad():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        o = api.attention(qs, ks, vs, causal=causal, scale=scale)
        return torch.autograd.grad(o, (qs, ks, vs), do)


def backward(do, q, kf, vf, out, lse, groups, causal: bool, scale, dq: torch.Tensor, dk_acc: torch.Tensor,
             dv_acc: torch.Tensor, cache: dict) -> None:
    """Gradients of :func:`forward`: writes ``dq`` (same slices as ``q``) and adds each group's dK/dV
    into ``dk_acc``/``dv_acc`` (``[B, hk, Lk, D]``, usually fp32: overlapping key slices sum there)."""
    kernels = use_kernels(q)
    for g in groups:
        qsl, ksl = slice(g.q_start, g.q_end), slice(g.k_start, g.k_end)
        args = (do[:, :, qsl], q[:, :, qsl], kf[:, :, ksl], vf[:, :, ksl])
        if kernels:
            gq, gk, gv = _kernel_backward(*args, out[:, :, qsl], lse[:, :, qsl],
                                          _layout(causal, g.q_len, g.k_len, q.device, cache), scale)
        else:
            gq, gk, gv = _reference_backward(*args, causal, scale)
        dq[:, :, qsl] = gq
        dk_acc[:, :, ksl] += gk
        dv_acc[:, :, ksl] += gv
