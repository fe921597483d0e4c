"""Block pooling for the adaptive predictor: per block, the mean token and the tokens' mean cosine to it.

CUDA fp16/bf16/fp32 inputs run the Triton kernel (one read of x, fp32 math, any strides); everything
else (CPU, fp64) the PyTorch twin in ``reference.py``.
"""
from __future__ import annotations

import torch

from . import reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def block_pool_sim(x: torch.Tensor, block: int, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[B, H, L, D]`` -> (pooled ``[B, H, nb, D]``, sim ``[B, H, nb]``) in ``work`` dtype, ``nb = ceil(L / block)``."""
    if x.is_cuda and work == torch.float32 and x.dtype in KERNEL_DTYPES:
        from .launch import block_pool
        return block_pool(x, block)
    return reference.block_pool_sim(x, block, work)
