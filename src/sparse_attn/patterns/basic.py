"""Dense and causal layouts (token-exact, any lengths)."""
from __future__ import annotations

from ..layout import BlockLayout
from ..masks import ElementMask, MaskTerm
from ._common import CAUSAL, lengths


def dense(seq_len: int, kv_len: int | None = None, *, block_q: int = 128, block_k: int = 128,
          device=None) -> BlockLayout:
    """Every query sees every key: all ``ceil(Lq/block_q) x ceil(Lk/block_k)`` blocks, all full.

    Args:
        seq_len: query length ``Lq``; kv_len: key length ``Lk`` (default ``Lq``).
    Returns: a BlockLayout with batch = heads = 1 (broadcast).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    return BlockLayout.from_mask(ElementMask((MaskTerm(),)), q_len=q_len, kv_len=kv_len,
                                 block_q=block_q, block_k=block_k, device=device)


def causal(seq_len: int, kv_len: int | None = None, *, block_q: int = 128, block_k: int = 128,
           device=None) -> BlockLayout:
    """Causal, bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``.

    Blocks wholly below the diagonal are full, blocks crossing it are partial (causal element
    mask), blocks wholly above it are not listed. When ``Lq > Lk`` the first ``Lq - Lk`` query
    rows see no key (their output is 0).
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    return BlockLayout.from_mask(CAUSAL, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k,
                                 device=device)
