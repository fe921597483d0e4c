"""The adaptive predictor's rank-select-pack step as one Triton kernel (CUDA).

Its PyTorch twin is ``predict.meansim.select_ranked`` followed by ``predict.pack.layout_from_keep``:
the CPU path, and the reference the kernel is tested against (``tests/test_block_select.py``).
"""
from .launch import MAX_KEY_BLOCKS, fits, select_pack

__all__ = ["MAX_KEY_BLOCKS", "fits", "select_pack"]
