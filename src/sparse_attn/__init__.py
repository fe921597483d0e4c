"""sparse_attn: block-sparse FlashAttention in Triton under a small PyTorch API.

    import sparse_attn
    from sparse_attn import patterns
    layout = patterns.local(seq_len, window=4096)          # a BlockLayout
    out = sparse_attn.attention(q, k, v, layout)           # q [B, Hq, L, D], k/v [B, Hkv, L, D]
"""
from . import masks, reference
from .api import attention, prepare, varlen_attention
from .grouped import Group, grouped_attention
from .layout import BlockLayout, LayoutError
from .masks import ElementMask, MaskTerm

__all__ = ["attention", "prepare", "varlen_attention", "grouped_attention", "Group", "BlockLayout", "LayoutError", "ElementMask", "MaskTerm", "masks", "reference"]
__version__ = "0.1.0"
