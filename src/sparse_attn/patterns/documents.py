"""Block-diagonal (fixed-size documents) layout, token-exact for any document size."""
from __future__ import annotations

from ..layout import BlockLayout
from ..masks import ElementMask, document_term
from ..validation import check_flag
from ._common import check_int, lengths


def block_diagonal(seq_len: int, block_size: int, kv_len: int | None = None, *, causal: bool = False,
                   block_q: int = 128, block_k: int = 128, device=None) -> BlockLayout:
    """Attention inside fixed-size documents of ``block_size`` tokens.

    Masking rule (``p = i + Lk - Lq``): key ``j`` allowed iff ``p // block_size == j // block_size``
    (floor division; documents tile the key axis from key 0), and with ``causal`` also ``j <= p``.
    ``block_size`` is any int >= 1, independent of the kernel blocks ``block_q``/``block_k``.
    When ``Lq > Lk`` the rows with ``p < 0`` see nothing.
    """
    q_len, kv_len = lengths(seq_len, kv_len)
    check_int("block_size", block_size, 1)
    check_flag("causal", causal)  # "False" is truthy: it ran causal
    mask = ElementMask((document_term(block_size, causal=causal),))
    return BlockLayout.from_mask(mask, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k,
                                 device=device)
