"""Launcher of the Gluon 8-bit forward for sm_90 (hopper_kernels.py) on quantized dense inputs."""
from __future__ import annotations

import torch

# (BLOCK_M, BLOCK_N, num_warps, NUM_BUF): one warpgroup per 64-row tile, so two CTAs share an SM
# (238 registers a thread, 106.5 KB of shared memory at d128, sm_90 compile); three K/V slots
# because the slot being refilled must be neither the tile in P.V nor the one in Q.K
CONFIG = (64, 128, 4, 3)


def supported(q8: torch.Tensor, k8: torch.Tensor, varlen: bool, dense: bool, k_scale_span: int) -> bool:
    """Whether the Gluon kernel takes this call: dense rows on an sm_90 GPU, d128, lengths in whole
    tiles, Lq == Lk, and one K scale per key tile."""
    bm, bn, _, _ = CONFIG
    if varlen or not dense or not q8.is_cuda or torch.cuda.get_device_capability(q8.device) != (9, 0):
        return False
    L = q8.shape[2]
    return (q8.shape[-1] == 128 and k8.shape[2] == L and L % bm == 0 and L % bn == 0 and k_scale_span > 0
            and k_scale_span % bn == 0)


def forward(q8, k8, v, q_scale, k_scale, v_scale, sm_scale: float, quant: int, out_dtype: torch.dtype,
            config: tuple = CONFIG, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out [B, H, L, D] in out_dtype, lse [B, H, L] fp32, natural log) of dense attention on int8 q8
    [B, H, L, D] / k8 [B, Hkv, L, D] and V: quant 2 FP8 V^T [B, Hkv, D, Lp], quant 1 V [B, Hkv, L, D]
    (fp16/bf16). Scales as sage.launch produces them: q_scale [B, H, L], k_scale [B, Hkv, L] (token
    stride 1), v_scale [B, Hkv, D] (quant 2)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import hopper_kernels

    bm, bn, warps, nbuf = config
    B, H, L, D = q8.shape
    hkv = k8.shape[1]

    def desc(t2d, block, dtype):
        return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))

    q_desc = desc(q8.reshape(B * H * L, D), [bm, D], gl.int8)
    k_desc = desc(k8.reshape(B * hkv * L, D), [bn, D], gl.int8)
    if quant == 2:
        v_desc = desc(v.reshape(B * hkv * D, v.shape[-1]), [D, bn], gl.float8e4nv)
    else:
        v_desc = desc(v.reshape(B * hkv * L, D), [bn, D], gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16)
    if out is None:  # given: written in place (tests poison them first)
        out = torch.empty(B, H, L, D, device=q8.device, dtype=out_dtype)
    if lse is None:
        lse = torch.empty(B, H, L, device=q8.device, dtype=torch.float32)
    vs = v_scale if v_scale is not None else q_scale  # unread when quant 1
    hopper_kernels.dense_fwd_kernel[(L // bm, B * H)](
        q_desc, k_desc, v_desc, out, lse, q_scale, k_scale, vs, sm_scale, H, hkv, L,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1), vs.stride(0), vs.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, NUM_BUF=nbuf, QUANT=quant, num_warps=warps)
    return out, lse


def forward_ws(q8, k8, v, q_scale, k_scale, v_scale, sm_scale: float, quant: int, out_dtype: torch.dtype,
               ping_pong: bool = True, nbuf: int = 3, regs: tuple = (240, 24), maxnreg: int = 240,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """forward() through the warp-specialized kernel (128-row query tiles: two consumer warpgroups and
    a loader warpgroup). Experimental: see benchmarks/NOTES.md."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import hopper_kernels

    half, bn = 64, 128
    B, H, L, D = q8.shape
    hkv = k8.shape[1]

    def desc(t2d, block, dtype):
        return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))

    q_desc = desc(q8.reshape(B * H * L, D), [half, D], gl.int8)
    k_desc = desc(k8.reshape(B * hkv * L, D), [bn, D], gl.int8)
    if quant == 2:
        v_desc = desc(v.reshape(B * hkv * D, v.shape[-1]), [D, bn], gl.float8e4nv)
    else:
        v_desc = desc(v.reshape(B * hkv * L, D), [bn, D], gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16)
    if out is None:  # given: written in place (tests poison them first)
        out = torch.empty(B, H, L, D, device=q8.device, dtype=out_dtype)
    if lse is None:
        lse = torch.empty(B, H, L, device=q8.device, dtype=torch.float32)
    vs = v_scale if v_scale is not None else q_scale
    hopper_kernels.dense_fwd_ws_kernel[(L // (2 * half), B * H)](
        q_desc, k_desc, v_desc, out, lse, q_scale, k_scale, vs, sm_scale, H, hkv, L,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        q_scale.stride(0), q_scale.stride(1), k_scale.stride(0), k_scale.stride(1), vs.stride(0), vs.stride(1),
        BLOCK_N=bn, HEAD_DIM=D, NUM_BUF=nbuf, QUANT=quant, PING_PONG=ping_pong, CONSUMER_REGS=regs[0],
        LOADER_REGS=regs[1], num_warps=4, maxnreg=maxnreg)
    return out, lse
