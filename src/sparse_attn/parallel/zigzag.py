"""Zigzag llama3 context-parallel attention, dense ``[B, H, L, D]`` and packed varlen ``[T, H, D]``.

Legend: W world size, r rank; every sequence is cut into 2W chunks of C tokens and rank r holds
chunks r and 2W-1-r (see plan.py). Per K/V head range: all-gather K/V (the next range already in
flight), run the local attention of this rank's query chunks against the gathered K/V (query chunk c
attends keys ``[0, (c+1)*C)`` of its sequence, bottom-right causal; all keys when not causal), keep
out and LSE. Backward: re-gather K/V per head range, run the local backward (no forward recompute on
the kernel path), sum dK/dV in fp32 and reduce-scatter them back to their owners, overlapped with
the next range.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import as_int
from ..validation import check_causal, check_scale
from . import local
from .chunks import offsets
from .comm import GradReduceScatter, HeadChunkGather, check_consistent_shapes
from .plan import ZigzagPlan, dense_plan, zigzag_plan


def _head_ranges(hkv: int, step: int):
    return [(h, min(h + step, hkv)) for h in range(0, hkv, step)]


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ZigzagAttention(torch.autograd.Function):
    """q ``[B, Hq, Lloc, D]``, k/v ``[B, Hkv, Lloc, D|Dv]`` (views; a packed batch as ``[1, H, T, D]``)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ZigzagPlan, group, causal, scale, head_step, packed, grouped):
        if packed:  # allocate [T, Hq, Dv] and hand out its [1, Hq, T, Dv] view: the caller gets a contiguous result
            out = q.new_empty(q.shape[2], q.shape[1], v.shape[3]).transpose(0, 1)[None]
        else:
            out = q.new_empty(q.shape[:3] + v.shape[3:])
        g, groups = q.shape[1] // k.shape[1], plan.groups(causal)
        ranges = _head_ranges(k.shape[1], head_step) if groups else []  # no tokens: nothing to gather
        lse = (torch.empty if groups else torch.zeros)(q.shape[:3], dtype=torch.float32, device=q.device)
        if not groups:
            out.zero_()
        gather = HeadChunkGather((k, v), ranges, plan, group)
        for i, (h0, h1) in enumerate(ranges):
            kf, vf = gather[i]
            qh = slice(h0 * g, h1 * g)
            local.forward(q[:, qh], kf, vf, groups, causal, scale, out[:, qh], lse[:, qh], plan._cache, grouped)
            del kf, vf
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (plan, group, causal, scale, head_step)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        # the collectives and the local backward (kernels, or the reference under its own autograd.grad)
        # record no graph: without this a create_graph=True gradient came back detached and a gradient
        # penalty was silently dropped; a second backward now raises, as the kernels' own does
        q, k, v, out, lse = ctx.saved_tensors
        plan, group, causal, scale, head_step = ctx.args
        g, groups = q.shape[1] // k.shape[1], plan.groups(causal)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        ranges = _head_ranges(k.shape[1], head_step) if groups else []
        gather, scatter = HeadChunkGather((k, v), ranges, plan, group), GradReduceScatter(plan, group)
        acc = _acc_dtype(k.dtype)
        for i, (h0, h1) in enumerate(ranges):
            kf, vf = gather[i]
            dkf, dvf = kf.new_zeros(kf.shape, dtype=acc), vf.new_zeros(vf.shape, dtype=acc)
            qh = slice(h0 * g, h1 * g)
            local.backward(dout[:, qh], q[:, qh], kf, vf, out[:, qh], lse[:, qh], groups, causal, scale, dq[:, qh],
                           dkf, dvf, plan._cache)
            del kf, vf
            scatter.push((dkf, dvf), (dk[:, h0:h1], dv[:, h0:h1]))
        scatter.flush()
        return dq, dk, dv, None, None, None, None, None, None, None


def _check_grouped(use_grouped_attention) -> None:
    if use_grouped_attention is not None and not isinstance(use_grouped_attention, bool):
        raise ValueError(f"use_grouped_attention must be True, False or None (automatic), "
                         f"got {use_grouped_attention!r}")


def _check_options(kv_head_chunk, hkv: int | None):
    """``kv_head_chunk`` as a Python int (numpy / torch integers too) or None; with ``hkv``, the head step."""
    step = None if kv_head_chunk is None else as_int(kv_head_chunk)
    if kv_head_chunk is not None and (step is None or step < 1):
        raise ValueError(f"kv_head_chunk must be a positive number of K/V heads (or None: all "
                         f"{'of them' if hkv is None else hkv}), got {kv_head_chunk!r}")
    if step is None:
        return hkv
    return step if hkv is None else min(step, hkv)


def _validate_dense(q, k, v):
    """Local checks; run after the cross-rank consistency check, so they fail on every rank alike."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q/k/v must be [B, H, 2*C, D] local zigzag shares, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share [B, Hkv, L]; q is {tuple(q.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"local q has {q.shape[2]} tokens, k has {k.shape[2]}: both must hold the same two zigzag "
                         f"chunks (an even count, L / world_size)")
    _validate_common(q, k, v)


def _validate_common(q, k, v):
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]}, k has {k.shape[-1]}: they must match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads, q has {q.shape[1]}: Hq must be a multiple of Hkv")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q/k/v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")


def _check_option_types(causal, scale, kv_head_chunk, grouped):
    """The options' own checks (no collective): ``(causal, scale)`` normalised, or TypeError/ValueError."""
    causal, scale = check_causal(causal), check_scale(scale)
    _check_options(kv_head_chunk, None)
    _check_grouped(grouped)
    return causal, scale


def _check_across_ranks(q, k, v, group, causal: bool, scale, kv_head_chunk, grouped, fn: str, check: bool,
                        earlier_error: Exception | None = None, **extras):
    """Both entries' input check: the options' own checks, then (``check``) shapes and dtypes of q/k/v,
    the options and ``extras`` (name -> int) compared on every rank before any collective
    (:func:`check_consistent_shapes`). Returns ``(causal, scale)`` normalised.

    A bad option on one rank only must not raise there alone (its peers would wait in their first
    collective until the timeout): whether the options passed their own checks is compared across
    ranks too, and the rank whose options failed raises its own error only after that comparison.
    ``earlier_error``: the caller's own argument check failed on this rank (the varlen entry's
    cu_seqlens), raised the same way."""
    if not check:
        if earlier_error is not None:
            raise earlier_error
        return _check_option_types(causal, scale, kv_head_chunk, grouped)
    own_error = earlier_error
    if own_error is None:
        try:
            causal, scale = _check_option_types(causal, scale, kv_head_chunk, grouped)
        except (TypeError, ValueError) as e:
            own_error = e
    if own_error is not None:  # compared as "options_valid" = 0; the values are not encodable
        causal, scale, kv_head_chunk, grouped = False, None, None, None
    options = {"options_valid": int(own_error is None), "causal": int(causal),
               "scale": None if scale is None else float(scale),
               "kv_head_chunk": -1 if kv_head_chunk is None else kv_head_chunk,
               "use_grouped_attention": -1 if grouped is None else int(grouped)}
    try:
        check_consistent_shapes({"q": q, "k": k, "v": v}, group, {**options, **extras}, what=f"{fn}: ")
    except ValueError as mismatch:
        if own_error is not None:  # this rank's own message says what is wrong with its arguments
            raise own_error from mismatch
        raise
    if own_error is not None:  # every rank's options failed: each raises its own error
        raise own_error
    return causal, scale


def zigzag_llama3_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, *,
                            group=None, causal: bool = True, scale: float | None = None,
                            kv_head_chunk: int | None = None, check_inputs: bool = True,
                            use_grouped_attention: bool | None = None) -> torch.Tensor:
    """Context-parallel attention over the ranks of ``group`` (default: the world), zigzag sharded.

    Args:
        q_local: ``[B, Hq, 2C, D]``; k_local / v_local: ``[B, Hkv, 2C, D]`` / ``[B, Hkv, 2C, Dv]``:
            this rank's chunks r and 2W-1-r (of 2W chunks of C tokens each) of the full sequence,
            concatenated, as :func:`sparse_attn.parallel.zigzag_split` makes them. ``Hq % Hkv == 0`` (GQA).
        causal: bottom-right causal over the full sequence (token i sees key j iff j <= i);
            otherwise every query sees all L keys.
        scale: softmax scale, default ``1 / sqrt(D)``.
        kv_head_chunk: all-gather K/V this many heads at a time (peak extra memory ~ two chunks,
            ``4 * B * kv_head_chunk * L * D`` elements); the gather of the next chunk overlaps the
            attention of the current one. Default all heads at once (no overlap).
        check_inputs: compare shapes, dtypes and options across ranks before any collective (below).
            False skips it: then a rank that passes other shapes makes the K/V all-gather undefined
            (a hang or wrong results). The check is one all-gather of a few host integers over gloo;
            it never waits for the GPU, but its latency is host time before the first kernel:
            0.2-0.9 ms on the lent 2 x H200, against a 2.4 ms forward at 8K tokens per GPU.
        use_grouped_attention: how the CUDA forward runs this rank's query chunks (groups) against
            the gathered K/V: True, one grouped launch for all of them (:func:`sparse_attn.grouped_attention`'s
            kernel, K/V read once); False, one kernel launch per group (the two-kernel baseline of
            llama3 CP); None (default) picks grouped for more than two groups (packed batches) and
            per-group launches for the two chunks of one sequence, which measured 6% faster
            (benchmarks/NOTES.md). The backward runs per group either way; the PyTorch reference
            path (CPU) computes the same per-group attention for every value.

    Returns: ``out_local [B, Hq, 2C, Dv]``, this rank's zigzag share of the full output. Differentiable
    once: the backward re-gathers K/V, runs the local backward and reduce-scatters dK/dV (summed in fp32);
    differentiating its gradients again (``create_graph=True``) raises.

    Every rank must call this with the same shapes and options; they are all-gathered and compared first
    (unless ``check_inputs=False``), and a mismatch raises ``ValueError`` on every rank naming the
    ranks. A peer that never calls in blocks the others until the process group's ``timeout`` (see
    :mod:`sparse_attn.parallel.comm`).
    """
    causal, scale = _check_across_ranks(q_local, k_local, v_local, group, causal, scale, kv_head_chunk,
                                        use_grouped_attention, "zigzag_llama3_attention", check_inputs)
    _validate_dense(q_local, k_local, v_local)
    step = _check_options(kv_head_chunk, k_local.shape[1])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = dense_plan(q_local.shape[2] * world, world, rank)
    return _ZigzagAttention.apply(q_local, k_local, v_local, plan, group, causal, scale, step, False,
                                  use_grouped_attention)


def _cu_fingerprint(cu: list[int]) -> int:
    """A deterministic 62-bit digest of the offsets, compared across ranks (any difference shows)."""
    h = 0
    for x in cu:
        h = (h * 1_000_003 + x + 1) % ((1 << 61) - 1)
    return h


def zigzag_llama3_varlen_attention(q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                                   cu_seqlens, *, group=None, causal: bool = True, scale: float | None = None,
                                   kv_head_chunk: int | None = None, check_inputs: bool = True,
                                   use_grouped_attention: bool | None = None) -> torch.Tensor:
    """Context-parallel attention over packed variable-length sequences, each zigzag sharded.

    Args:
        q_local: ``[T / W, Hq, D]``; k_local / v_local: ``[T / W, Hkv, D]`` / ``[T / W, Hkv, Dv]``: this
            rank's share of a packed batch of T tokens, as
            ``sparse_attn.parallel.zigzag_split_varlen(x, cu_seqlens, W, rank)`` makes it (every
            sequence's chunks r and 2W-1-r, in sequence order; local offsets are
            ``zigzag_plan(cu_seqlens, W, rank).cu_seqlens_local()``).
        cu_seqlens: the GLOBAL offsets ``[num_seqs + 1]`` of the unsharded batch (int tensor or list,
            identical on every rank); every sequence length must be a multiple of 2W.
        causal: causal within each sequence (token i sees key j of its own sequence iff j <= i);
            otherwise each token sees its whole sequence. Sequences never see each other.
        scale, kv_head_chunk, group, check_inputs, use_grouped_attention: as
            :func:`zigzag_llama3_attention`.

    Returns: ``out_local [T / W, Hq, Dv]``, this rank's share of the full output. Differentiable once.
    Shapes, dtypes, options and cu_seqlens are compared across ranks first (mismatch: ``ValueError``
    on every rank), unless ``check_inputs=False``.
    """
    try:
        cu, cu_error = offsets(cu_seqlens), None
    except (TypeError, ValueError) as e:  # raised after the cross-rank check, so no peer waits for this rank
        cu, cu_error = [], e
    causal, scale = _check_across_ranks(q_local, k_local, v_local, group, causal, scale, kv_head_chunk,
                                        use_grouped_attention, "zigzag_llama3_varlen_attention", check_inputs,
                                        cu_error, num_seqs=len(cu) - 1, total_tokens=cu[-1] if cu else -1,
                                        cu_seqlens_digest=_cu_fingerprint(cu))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = zigzag_plan(cu, world, rank)
    if q_local.dim() != 3 or k_local.dim() != 3 or v_local.dim() != 3:
        raise ValueError(f"varlen q/k/v must be packed [T / world_size, heads, head_dim] local shares, got "
                         f"{tuple(q_local.shape)}, {tuple(k_local.shape)}, {tuple(v_local.shape)}")
    for name, t in (("q", q_local), ("k", k_local), ("v", v_local)):
        if t.shape[0] != plan.local_tokens:
            raise ValueError(f"{name} has {t.shape[0]} tokens, but cu_seqlens holds {plan.total_tokens} tokens, "
                             f"so each of the {world} ranks must hold {plan.local_tokens}: pass the global "
                             f"cu_seqlens and the zigzag_split_varlen share")
    if k_local.shape[1] != v_local.shape[1]:
        raise ValueError(f"k has {k_local.shape[1]} heads, v has {v_local.shape[1]}: they must match")
    _validate_common(q_local, k_local, v_local)
    step = _check_options(kv_head_chunk, k_local.shape[1])
    as4 = lambda t: t.transpose(0, 1)[None]  # noqa: E731  [T, H, D] -> [1, H, T, D] view
    out = _ZigzagAttention.apply(as4(q_local), as4(k_local), as4(v_local), plan, group, causal, scale, step, True,
                                 use_grouped_attention)
    return out[0].transpose(0, 1)
