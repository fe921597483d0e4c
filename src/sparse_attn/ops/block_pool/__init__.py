"""Block pooling for the adaptive predictor: per block, the mean token and the tokens' mean cosine to it.

CUDA fp16/bf16/fp32 inputs run the Triton kernel (one read of x, fp32 math, any strides); everything
else (CPU, fp64) the PyTorch twin in ``reference.py``.
"""
from __future__ import annotations

import torch

from . import reference

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def block_pool_sim(x: torch.Tensor, block: int, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[B, H, L, D]`` -> (pooled ``[B, H, nb, D]``, sim ``[B, H, nb]``) in ``work`` dtype, ``nb = ceil(L / block)``.

    A block whose mean is not finite (a NaN or inf token) gets sim NaN, never ``>=`` a threshold: both
    pools read a NaN norm as no norm (sim 0), which a threshold <= 0 took as self-similar, and its NaN
    pooled scores then took the whole row's softmax."""
    if x.is_cuda and work == torch.float32 and x.dtype in KERNEL_DTYPES:
        from .launch import block_pool
        pooled, sim = block_pool(x, block)
    else:
        pooled, sim = reference.block_pool_sim(x, block, work)
    return pooled, sim.masked_fill(~torch.isfinite(pooled).all(-1), float("nan"))  # O(nb * D), no sync
