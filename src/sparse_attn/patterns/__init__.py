"""Pattern builders: one small function per pattern family, each returning a BlockLayout.

Conventions shared by every builder: ``seq_len`` is the query length ``Lq``, ``kv_len`` the key
length ``Lk`` (default ``Lq``); positions are in the key frame, query row ``i`` at
``p = i + Lk - Lq`` (bottom-right alignment, FlashAttention's causal convention); block sizes
``block_q``/``block_k`` are multiples of 16 in [16, 256]; lengths need not be block multiples.
Token-exact patterns (dense, causal, local, streaming, block_diagonal) list exactly the blocks
their rule touches, full where the rule allows the whole block. Block patterns (strided, dilated,
random, bigbird, from_block_index, topk) list full blocks, cut token-exactly to ``j <= p`` when
``causal``. Combine with ``|`` (union) and ``&`` (intersection).
"""
from .basic import causal, causal_block_count, causal_cut, dense
from .bigbird_blocks import bigbird
from .block_index import from_block_index, from_block_mask, to_block_index
from .csr import from_csr, to_csr
from .documents import block_diagonal
from .flex import from_flex, to_flex
from .random_blocks import random
from .sliding import local, local_block_count, streaming, streaming_block_count
from .strided_blocks import dilated, strided
from .topk_blocks import topk

__all__ = ["dense", "causal", "causal_block_count", "causal_cut", "local", "local_block_count", "streaming", "streaming_block_count", "block_diagonal", "strided", "dilated", "random", "bigbird",
           "from_block_index", "to_block_index", "from_block_mask", "to_csr", "from_csr", "topk", "from_flex",
           "to_flex"]
