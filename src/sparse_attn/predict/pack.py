"""The predictor's last step: a dense per-row block decision -> BlockLayout, with no host sync.

A predictor decides, per (batch, head, query block), which key blocks to keep: a bool grid
``[B, H, Qb, Kb]``. Packing it through coordinates (nonzero, unique, bincount, max) costs several
host syncs and sorts, and an adaptive layout is new on every call, so every forward would pay them.
Here rows are packed in place: ``max_k = Kb`` (one slot per key block; the grid itself is already
``O(B * H * Qb * Kb)``), kept blocks first in ascending order (a prefix sum and a scatter), -1 after.

Under ``causal`` (bottom-right aligned) blocks wholly above the diagonal are dropped and blocks
crossing it get the causal element mask (``j <= p``): the result equals the kept blocks intersected
with ``patterns.causal(Lq, Lk)`` and is marked as its own causal cut. The masked blocks of a row
are its largest visible key blocks, and so is a tail block cut by the sequence end, so every row is
already in the kernels' visiting order (unmasked blocks first): the schedule is seeded directly.
"""
from __future__ import annotations

import functools
import math

import torch

from ..layout import BlockLayout, LayoutError
from ..masks import mask_table
from ..patterns._common import CAUSAL, row_positions
from ..patterns.basic import mark_causal

_TABLES: dict = {}  # (causal, device) -> the masks' term table (built once: a host-to-device copy syncs)


def causal_grid(q_len: int, kv_len: int, block_q: int, block_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, partial) bool ``[Qb, Kb]``: key block ``kb`` is visible to query block ``qb`` iff its
    first key ``<=`` the block's last row position, partial (needs the causal mask) iff visible and its
    last key ``>`` the block's first row position."""
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_k)
    p_first, p_last = row_positions(torch.arange(nq, device=device), q_len, kv_len, block_q)
    kb = torch.arange(nk, device=device)
    k_first = kb * block_k
    k_last = torch.clamp(k_first + block_k, max=kv_len) - 1
    visible = k_first[None, :] <= p_last[:, None]
    return visible, visible & (k_last[None, :] > p_first[:, None])


@functools.lru_cache(maxsize=256)
def _any_partial(q_len: int, kv_len: int, block_q: int, block_k: int) -> bool:
    """Whether some query block's diagonal block crosses the diagonal (on the host, O(Qb)). Every
    partial block lies in a row whose diagonal block is partial, and predictors keep the diagonal."""
    nq = math.ceil(q_len / block_q)
    for qb in range(nq):
        p_first = qb * block_q + kv_len - q_len
        p_last = min((qb + 1) * block_q, q_len) - 1 + kv_len - q_len
        if p_last < 0:
            continue
        d = p_last // block_k
        if min((d + 1) * block_k, kv_len) - 1 > p_first:
            return True
    return False


def _mask_table(causal: bool, device: torch.device):
    key = (causal, str(device))
    if key not in _TABLES:
        _TABLES[key] = mask_table((CAUSAL,) if causal else (), device)
    return _TABLES[key]


def layout_from_keep(keep: torch.Tensor, *, q_len: int, kv_len: int, block_q: int, block_k: int,
                     causal: bool, schedule: bool | None = None) -> BlockLayout:
    """Pack a bool keep grid ``[B, H, Qb, Kb]`` into a validated BlockLayout (batch B, heads H).

    causal: drop blocks above the diagonal, mask the ones crossing it (see the module docstring).
    schedule: seed the kernels' schedule on the layout (default: when ``keep`` is on CUDA).
    Nothing here reads a value back to the host. The layout is marked validated (sorted, unique and in
    range by construction), so the grid's shape and dtype are checked here, against the lengths.
    """
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 4:
        raise TypeError(f"keep must be a bool [B, H, Qb, Kb] tensor, got "
                        f"{getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}")
    B, H, nq, nk = keep.shape
    want = (math.ceil(q_len / block_q), math.ceil(kv_len / block_k))
    if (nq, nk) != want:
        raise LayoutError(f"keep has a {nq} x {nk} block grid; q_len={q_len}, kv_len={kv_len} in {block_q} x {block_k} "
                          f"blocks need {want[0]} x {want[1]}")
    dev = keep.device
    masks: tuple = ()
    partial = None
    if causal:
        visible, partial = causal_grid(q_len, kv_len, block_q, block_k, dev)
        keep = keep & visible
        masks = causal_masks(q_len, kv_len, block_q, block_k)
    if nk == 0:
        counts = torch.zeros(B, H, nq, dtype=torch.int32, device=dev)
        indices = torch.zeros(B, H, nq, 0, dtype=torch.int32, device=dev)
        mask_ids = indices.clone()
    else:
        kb = torch.arange(nk, dtype=torch.int32, device=dev)
        csum = keep.cumsum(-1, dtype=torch.int32)            # kept blocks up to and including kb
        counts = csum[..., -1].contiguous()                 # [B, H, Qb]
        # kept block -> its rank among the kept; dropped block -> count + its rank among the dropped
        slot = torch.where(keep, csum - 1, counts[..., None] + kb - csum).long()
        indices = torch.empty_like(csum).scatter_(-1, slot, torch.where(keep, kb, -1))
        if masks:
            mask_ids = torch.empty_like(csum).scatter_(
                -1, slot, torch.where(keep & partial, 0, -1).to(torch.int32))
        else:
            mask_ids = torch.full_like(csum, -1)
    layout = packed_layout(counts, indices, mask_ids, masks, q_len=q_len, kv_len=kv_len, block_q=block_q,
                            block_k=block_k, causal=causal)
    if schedule if schedule is not None else keep.is_cuda:
        _seed_schedule(layout, keep, partial if masks else None)
    return layout


def causal_masks(q_len: int, kv_len: int, block_q: int, block_k: int) -> tuple:
    """The masks tuple of a packed causal layout: the causal mask when some block crosses the diagonal."""
    return (CAUSAL,) if _any_partial(q_len, kv_len, block_q, block_k) else ()


def layout_from_packed(counts: torch.Tensor, indices: torch.Tensor, mask_ids: torch.Tensor, n_full: torch.Tensor,
                       *, q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool) -> BlockLayout:
    """A BlockLayout from rows already packed as :func:`layout_from_keep` packs them (``ops/block_select``
    writes them so), with the schedule seeded from ``n_full`` (int32 ``[B, H, Qb]``, leading slots that need
    no mask). Mask id 0 means the causal mask, present when :func:`causal_masks` says so."""
    masks = causal_masks(q_len, kv_len, block_q, block_k) if causal else ()
    layout = packed_layout(counts, indices, mask_ids, masks, q_len=q_len, kv_len=kv_len, block_q=block_q,
                            block_k=block_k, causal=causal)
    from ..ops.block_sparse.schedule import seed_ordered
    seed_ordered(layout, n_full)
    return layout


def packed_layout(counts, indices, mask_ids, masks, *, q_len, kv_len, block_q, block_k, causal) -> BlockLayout:
    """A BlockLayout of rows already packed (ascending, -1 after the count), valid by construction, with
    the masks' term table shared per device (no host-to-device copy per layout); ``causal``: marked as
    its own causal cut."""
    layout = BlockLayout(block_q, block_k, q_len, kv_len, counts, indices, mask_ids, masks)
    layout._validated = True  # sorted, unique, in range by construction
    layout._table = _mask_table(bool(masks), counts.device)
    if causal:
        mark_causal(layout)
    return layout


def _seed_schedule(layout: BlockLayout, keep: torch.Tensor, partial: torch.Tensor | None) -> None:
    """Unmasked blocks per row: kept blocks minus the causal-partial ones and a tail block cut by kv_len."""
    from ..ops.block_sparse.schedule import seed_ordered
    nk = keep.shape[-1]
    needs = torch.zeros(keep.shape[-2:], dtype=torch.bool, device=keep.device) if partial is None else partial
    if nk and layout.kv_len % layout.block_k:
        needs = needs.clone()
        needs[:, nk - 1] = True
    n_full = layout.kv_counts - (keep & needs).sum(-1, dtype=torch.int32)
    seed_ordered(layout, n_full)
