"""Launcher of the block-pooling kernel: grid and strides. x is read in place (any strides)."""
from __future__ import annotations

import math

import torch
import triton

from . import kernels
from ..block_sparse.launch import grid_heads_batch

ROW_ELEMS = 4096  # elements loaded per row chunk (BR x padded head_dim)


def block_pool(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[B, H, L, D]`` (fp16/bf16/fp32) -> (pooled fp32 ``[B, H, nb, D]``, sim fp32 ``[B, H, nb]``)."""
    B, H, L, D = x.shape
    nb = math.ceil(L / block)
    pooled = torch.empty(B, H, nb, D, dtype=torch.float32, device=x.device)
    sim = torch.empty(B, H, nb, dtype=torch.float32, device=x.device)
    if pooled.numel() == 0 or sim.numel() == 0:
        return pooled.zero_(), sim.zero_()
    bd = triton.next_power_of_2(D)
    br = 16  # block is a multiple of 16: the largest power of two <= ROW_ELEMS / bd dividing it
    while br * 2 * bd <= ROW_ELEMS and block % (br * 2) == 0:
        br *= 2
    kernels.block_pool_kernel[(nb, *grid_heads_batch(B, H))](
        x, pooled, sim, L, *x.stride(), *pooled.stride()[:3], *sim.stride()[:2],
        D=D, BLOCK=block, BR=br, BD=bd, num_warps=2)  # H100, 32K x 32 heads x 128, block 64/128: 2 warps
    # 130-145 us, 4 warps 320 us, 8 warps 620 us (benchmarks/predict_probe.py); the read alone is ~81 us
    return pooled, sim
