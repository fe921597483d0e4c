"""Scale groups of the 8-bit path, shared by the Triton kernels and the PyTorch twin.

A group is ``(span, period)``: the rows of one ``span``-row span that are equal modulo ``period``
share one int8 scale (see ops/sage/kernels.py). The groups follow SageAttention's names, with its
Hopper kernel's 128-key K blocks for per_block / per_warp:

    per_block   Q: 128 contiguous rows      K: 128 contiguous keys
    per_warp    Q: 16 rows (one warp's MMA rows)   K: 128 keys
    per_thread  Q: 2 rows {r, r + 8} of a 16-row MMA tile (what one thread holds)
                K: 8 keys {n, n + 8, ...} of a 64-key block (likewise)

Scales are expanded to one per row before attention. Finer Q groups cost nothing at run time and
follow outliers more closely; a K group that spans whole kernel tiles (128 keys, on dense inputs)
lets the kernel apply its scale once per tile and row instead of once per score (kernels._scores):
H100 timings in benchmarks/NOTES.md.
"""
from __future__ import annotations

GRANULARITY: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "per_block": ((128, 1), (128, 1)),
    "per_warp": ((16, 1), (128, 1)),
    "per_thread": ((16, 8), (64, 8)),
}
QUANT_MODES: dict[str, int] = {"int8": 1, "int8-fp8": 2}  # value: the kernels' QUANT flag
FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT8_MAX = 127.0


def check_granularity(granularity: str) -> str:
    """``granularity`` when it names a scale grouping of :data:`GRANULARITY`, else a ValueError listing them."""
    if not isinstance(granularity, str) or granularity not in GRANULARITY:
        raise ValueError(f"quant_granularity={granularity!r} is not supported; choose one of "
                         f"{', '.join(map(repr, GRANULARITY))}")
    return granularity


def check_quant(quant: str, granularity: str) -> int:
    """The kernels' QUANT flag of ``quant``; clear errors for unknown names."""
    if not isinstance(quant, str) or quant not in QUANT_MODES:
        raise ValueError(f"quant={quant!r} is not supported; choose one of {', '.join(map(repr, QUANT_MODES))} "
                         "(or None for fp16/bf16 attention)")
    check_granularity(granularity)
    return QUANT_MODES[quant]


def check_quant_shapes(mode: int, head_dim: int, block_k: int | None, v_head_dim: int | None = None) -> None:
    """What the 8-bit kernels can run, checked on every device (the CPU twin too, so code tried on a
    CPU does not fail on the GPU): head_dim a multiple of 16 in [32, 256]; v's head dim equal to it
    (None: not checked); for int8-fp8 ``block_k`` a multiple of 32 (None: no layout, the kernels' own dense
    tiles): the kernel's key tile divides the layout's block, and for 48, 80, ... no tile of 32 keys or more
    does, so the launcher fell back to 16-key tiles, which an FP8 MMA cannot take."""
    if v_head_dim is not None and v_head_dim != head_dim:
        raise ValueError(f"the 8-bit kernels need v's head_dim equal to q/k's, got {v_head_dim} and {head_dim}: "
                         "pad v, or use quant=None (the fp16/bf16 reference path takes any v head_dim on the CPU)")
    from ..block_sparse import MAX_HEAD_DIM
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the 8-bit kernels take head_dim up to {MAX_HEAD_DIM}, got {head_dim}: split the heads, "
                         "or use quant=None (the fp16/bf16 reference path takes any head_dim on the CPU)")
    if head_dim % 16 or head_dim < 32:
        raise ValueError(f"the 8-bit kernels need head_dim a multiple of 16 and at least 32 (int8 rows in 16-byte "
                         f"units; an int8 MMA takes 32 channels at a time), got {head_dim}: pad q/k/v, or use "
                         "quant=None")
    if mode == 2 and block_k is not None and block_k % 32:
        raise ValueError(f"quant='int8-fp8' needs the layout's block_k a multiple of 32 (an FP8 MMA takes 32 keys at "
                         f"a time, and kernel tiles divide the layout's blocks), got block_k={block_k}: build the "
                         f"layout with block_k 32, 64, 96, 128, ..., or use quant='int8'")
