"""Zigzag llama3 context-parallel attention.

Legend: W world size, r rank, C = L / (2W) chunk length, local q/k/v hold chunks (r, 2W-1-r) of the
sequence, ``[B, H, 2C, D]``. Query chunk c (tokens [c*C, (c+1)*C)) attends full K/V keys
``[0, (c+1)*C)`` with bottom-right causal masking (or all L keys when not causal).

TODO (varlen): packed [T, H, D] batches. :func:`zigzag_split_varlen` / :func:`zigzag_cu_seqlens`
shard them already; the attention itself would gather K/V per head chunk as here, then run
``sparse_attn.varlen_attention`` once per local chunk with per-sequence key prefixes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import attention
from .chunks import zigzag_chunk_ids
from .comm import all_gather_zigzag, check_consistent_shapes, reduce_scatter_zigzag


def _local_attention(q, kf, vf, world, rank, causal, scale):
    """Both local query chunks of ``q`` [B, h, 2C, D] against the gathered ``kf``/``vf`` [B, hk, L, D]."""
    c = q.shape[2] // 2
    outs = []
    for half, chunk in enumerate(zigzag_chunk_ids(world, rank)):
        end = (chunk + 1) * c if causal else kf.shape[2]
        outs.append(attention(q[:, :, half * c:(half + 1) * c], kf[:, :, :end], vf[:, :, :end],
                              causal=causal, scale=scale))
    return torch.cat(outs, 2)


def _head_ranges(hkv: int, step: int):
    return [(h, min(h + step, hkv)) for h in range(0, hkv, step)]


class _ZigzagLlama3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, head_step):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        g = q.shape[1] // k.shape[1]
        out = q.new_empty(q.shape[:3] + v.shape[3:])
        for h0, h1 in _head_ranges(k.shape[1], head_step):
            kf = all_gather_zigzag(k[:, h0:h1], 2, group)
            vf = all_gather_zigzag(v[:, h0:h1], 2, group)
            out[:, h0 * g:h1 * g] = _local_attention(q[:, h0 * g:h1 * g], kf, vf, world, rank, causal, scale)
            del kf, vf
        ctx.save_for_backward(q, k, v)
        ctx.args = (group, causal, scale, head_step)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        group, causal, scale, head_step = ctx.args
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for h0, h1 in _head_ranges(k.shape[1], head_step):
            # recompute this head chunk's local attention with autograd: dQ stays local, dK/dV are
            # gradients for the whole gathered sequence and get summed back to their owners
            kf = all_gather_zigzag(k[:, h0:h1], 2, group).requires_grad_()
            vf = all_gather_zigzag(v[:, h0:h1], 2, group).requires_grad_()
            qh = q[:, h0 * g:h1 * g].detach().requires_grad_()
            with torch.enable_grad():
                o = _local_attention(qh, kf, vf, world, rank, causal, scale)
                gq, gk, gv = torch.autograd.grad(o, (qh, kf, vf), dout[:, h0 * g:h1 * g])
            dq[:, h0 * g:h1 * g] = gq
            dk[:, h0:h1] = reduce_scatter_zigzag(gk, 2, group)
            dv[:, h0:h1] = reduce_scatter_zigzag(gv, 2, group)
        return dq, dk, dv, None, None, None, None


def _validate(q, k, v, kv_head_chunk):
    """Local checks; run after the cross-rank consistency check, so they fail on every rank alike."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q/k/v must be [B, H, 2*C, D] local zigzag shares, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [B, Hkv, L]; q is {tuple(q.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"local q has {q.shape[2]} tokens, k has {k.shape[2]}: both must hold the same two zigzag "
                         f"chunks (an even count, L / world_size)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads, q has {q.shape[1]}: Hq must be a multiple of Hkv")
    if kv_head_chunk is not None and not 1 <= kv_head_chunk:
        raise ValueError(f"kv_head_chunk must be a positive number of K/V heads, got {kv_head_chunk}")


def zigzag_llama3_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, *,
                            group=None, causal: bool = True, scale: float | None = None,
                            kv_head_chunk: int | None = None) -> torch.Tensor:
    """Context-parallel attention over the ranks of ``group`` (default: the world), zigzag sharded.

    Args:
        q_local: ``[B, Hq, 2C, D]``; k_local / v_local: ``[B, Hkv, 2C, D]`` / ``[B, Hkv, 2C, Dv]``:
            this rank's chunks r and 2W-1-r (of 2W chunks of C tokens each) of the full sequence,
            concatenated, as :func:`sparse_attn.parallel.zigzag_split` makes them. ``Hq % Hkv == 0`` (GQA).
        causal: bottom-right causal over the full sequence (token i sees key j iff j <= i);
            otherwise every query sees all L keys.
        scale: softmax scale, default ``1 / sqrt(D)``.
        kv_head_chunk: all-gather K/V this many heads at a time (peak extra memory ~
            ``2 * B * kv_head_chunk * L * D``); default all heads at once.

    Returns: ``out_local [B, Hq, 2C, Dv]``, this rank's zigzag share of the full output. Differentiable:
    the backward re-gathers K/V, recomputes the local attention and reduce-scatters dK/dV.

    Every rank must call this with the same shapes and options; they are all-gathered and compared first,
    and a mismatch raises ``ValueError`` on every rank naming the ranks. A peer that never calls in
    blocks the others until the process group's ``timeout`` (set it at ``init_process_group``).
    """
    check_consistent_shapes({"q": q_local, "k": k_local, "v": v_local}, group,
                            {"causal": int(causal), "kv_head_chunk": -1 if kv_head_chunk is None else kv_head_chunk},
                            what="zigzag_llama3_attention: ")
    _validate(q_local, k_local, v_local, kv_head_chunk)
    step = k_local.shape[1] if kv_head_chunk is None else min(kv_head_chunk, k_local.shape[1])
    return _ZigzagLlama3.apply(q_local, k_local, v_local, group, causal, scale, step)
