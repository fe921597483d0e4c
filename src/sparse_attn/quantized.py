"""8-bit attention behind :func:`sparse_attn.attention` / :func:`sparse_attn.varlen_attention`
(``quant="int8"`` or ``"int8-fp8"``): the Triton 8-bit kernels on CUDA, their PyTorch twin
(ops/sage/reference.py) elsewhere.

Gradients: the 8-bit forward has none of its own. When an input requires grad, the fp16/bf16
attention also runs (kernel on CUDA) and the result is ``out_hp + (out_8bit - out_hp).detach()``:
the value is the 8-bit output, the gradients are exactly those of the fp16/bf16 attention. That
costs one extra fp16/bf16 forward per training step; inference pays nothing.
"""
from __future__ import annotations

import torch

from .layout import BlockLayout
from .ops.sage.granularity import check_quant, check_quant_shapes
from .validation import needs_grad


def attention(q, k, v, layout: BlockLayout | None, *, causal: bool, scale, return_lse: bool, quant: str,
              granularity: str, smooth_k: bool):
    """Validated ``[B, H, L, D]`` inputs (see :func:`sparse_attn.attention`)."""
    from . import api
    check_quant_shapes(check_quant(quant, granularity), q.shape[-1], None if layout is None else layout.block_k,
                       v.shape[-1])
    with torch.no_grad():
        if q.is_cuda:
            from .ops.sage import sage_attention_op
            # exact=False: the 8-bit kernels are forward-only (gradients go through api.attention below)
            kernel_layout = api._kernel_layout(layout, causal, q.shape[2], k.shape[2], q.device, exact=False)
            out, lse = sage_attention_op(q, k, v, kernel_layout, quant=quant, granularity=granularity,
                                         smooth_k=smooth_k, scale=scale, unsmoothed_lse=return_lse)
        elif layout is not None and torch.compiler.is_compiling():  # the twin's key walk is data-dependent
            from . import reference_op
            out, lse = reference_op.sage_attention(q, k, v, layout, causal=causal, scale=scale, quant=quant,
                                                   granularity=granularity, smooth_k=smooth_k)
        else:
            from .ops.sage import reference as sage_ref
            out, lse = sage_ref.attention(q, k, v, layout, causal=causal, scale=scale, return_lse=True, quant=quant,
                                          granularity=granularity, smooth_k=smooth_k)
    if needs_grad(q, k, v):
        out_hp = api.attention(q, k, v, layout, causal=causal, scale=scale)
        out = out_hp + (out - out_hp).detach()
    return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, plan, *, scale, return_lse: bool, quant: str,
                     granularity: str, smooth_k: bool, hp_call):
    """Validated packed ``[T, H, D]`` inputs and a varlen plan (see api._varlen_plan); ``hp_call()``
    runs the fp16/bf16 varlen attention (for gradients)."""
    check_quant_shapes(check_quant(quant, granularity), q.shape[-1], plan.block_k,
                       v.shape[-1])
    with torch.no_grad():
        if q.is_cuda:
            from .ops.sage import sage_varlen_attention_op
            out, lse = sage_varlen_attention_op(q, k, v, plan.stacked, cu_q, cu_k, max_q, max_k, plan.kv_lens,
                                                quant=quant, granularity=granularity, smooth_k=smooth_k, scale=scale,
                                                unsmoothed_lse=return_lse)
        else:
            out, lse = _varlen_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), plan.per_seq, scale, quant,
                                         granularity, smooth_k)
    if needs_grad(q, k, v):
        out_hp = hp_call()
        out = out_hp + (out - out_hp).detach()
    return (out, lse) if return_lse else out


def _varlen_reference(q, k, v, cq, ck, per_seq, scale, quant, granularity, smooth_k):
    """Per-sequence 8-bit twin calls (each sequence quantized on its own), concatenated back."""
    from .ops.sage import reference as sage_ref
    outs, lses = [], []
    for b, lay in enumerate(per_seq):
        qs, ks, vs = (t[a:e].transpose(0, 1)[None] for t, a, e in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                                                                  (v, ck[b], ck[b + 1])))
        o, lse = sage_ref.attention(qs, ks, vs, lay.to(q.device), scale=scale, return_lse=True, quant=quant,
                                    granularity=granularity, smooth_k=smooth_k)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
