"""8-bit block-sparse attention (SageAttention-style): INT8 Q.K with smoothed K, FP16/BF16 or FP8 P.V.

Forward only; see :mod:`sparse_attn.quantized` for the public entry and its gradients."""
from __future__ import annotations

import torch

from ...layout import BlockLayout
from ..block_sparse import _offsets, check_kernel_inputs, forward_layout_inputs, softmax_scale
from .granularity import GRANULARITY, QUANT_MODES, check_quant, check_quant_shapes

__all__ = ["GRANULARITY", "QUANT_MODES", "check_quant", "check_fp8_device", "sage_attention_op",
           "sage_varlen_attention_op"]


def check_fp8_device(device: torch.device) -> None:
    """FP8 tensor-core MMAs need compute capability 8.9+ (Ada, Hopper and newer)."""
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise RuntimeError(f"quant='int8-fp8' needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or newer); "
                           f"{torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}: use quant='int8'")


def _prepare(q, k, v, quant: str, granularity: str, block_k: int):
    check_kernel_inputs(q, v)
    mode = check_quant(quant, granularity)
    if mode == 2 and q.is_cuda:
        check_fp8_device(q.device)
    check_quant_shapes(mode, q.shape[-1], block_k)
    return mode, tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def sage_attention_op(q, k, v, layout: BlockLayout, *, quant: str, granularity: str, smooth_k: bool,
                      scale: float | None = None, unsmoothed_lse: bool = False):
    """8-bit kernels on validated ``[B, H, L, D]`` fp16/bf16 inputs. Returns (out, lse fp32
    ``[B, H, Lq]``): the LSE of the smoothed scores, or with ``unsmoothed_lse`` that of the scores
    themselves (the smoothing shift added back with the K mean the quantization took)."""
    from .function import sage_forward
    mode, (q, k, v) = _prepare(q, k, v, quant, granularity, layout.block_k)
    scale = softmax_scale(q, scale)
    fwd = forward_layout_inputs(layout)
    return sage_forward(q, k, v, *fwd, None, None, layout.block_q, layout.block_k, scale, q.shape[2], k.shape[2],
                        mode, granularity, smooth_k, unsmoothed_lse)


def sage_varlen_attention_op(q, k, v, stacked: BlockLayout, cu_q, cu_k, max_q: int, max_k: int, kv_lens, *,
                             quant: str, granularity: str, smooth_k: bool, scale: float | None = None,
                             unsmoothed_lse: bool = False):
    """8-bit kernels on packed ``[T, H, D]`` inputs (see varlen_attention_op). Returns (out, lse [H, T]),
    the LSE as in sage_attention_op."""
    from .function import sage_forward
    mode, (q, k, v) = _prepare(q, k, v, quant, granularity, stacked.block_k)
    scale = softmax_scale(q, scale)
    fwd = forward_layout_inputs(stacked, kv_lens)
    # offsets at unit stride, as the kernels read them (a strided view was read as packed: other sequences' bounds)
    return sage_forward(q, k, v, *fwd, _offsets(cu_q), _offsets(cu_k), stacked.block_q, stacked.block_k, scale,
                        max_q, max_k, mode, granularity, smooth_k, unsmoothed_lse)
