"""The kernels' visiting order for a layout: derived data, cached on the layout, never a new format.

Each row's blocks are reordered so that blocks needing no masking come first (the kernels run them
in a loop with no mask logic at all) and blocks that need an element mask or the sequence-end bound
come last. When every row's unmasked blocks form one contiguous run (dense, causal, windows,
block-diagonal...), the kernels walk that run by arithmetic instead of loading an index per tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layout import BlockLayout


@dataclass
class Schedule:
    counts: torch.Tensor      # int32 [Bl, Hl, Qb]: the layout's kv_counts, contiguous like n_full and full_start
    #                           (the kernels read the three at one offset; a transposed or expanded kv_counts
    #                           passed as it was made a row read another row's count, and K/V out of bounds)
    n_full: torch.Tensor      # int32 [Bl, Hl, Qb]: leading slots that need no mask
    full_start: torch.Tensor  # int32 [Bl, Hl, Qb]: first unmasked key block (meaningful when contiguous)
    indices: torch.Tensor     # int32 [Bl, Hl, Qb, max_k]: unmasked blocks ascending, then masked ascending
    mask_ids: torch.Tensor    # int32 [Bl, Hl, Qb, max_k]: per reordered slot, -1 or a mask id
    contiguous: bool          # every row's unmasked blocks are one run full_start .. full_start + n_full - 1


def trainable(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or where it was made under torch.inference_mode (autograd refuses to save such a tensor) a
    normal copy of it, made outside inference mode even when called inside it (as prepare() may be)."""
    if t is None or not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def made_trainable(sched: Schedule) -> Schedule:
    """``sched`` with each tensor made under torch.inference_mode replaced, in place and so once, by a normal
    copy (trainable): a layout first run in an evaluation pass under inference mode (Lightning's sanity check
    and validation loops use it), or built there, caches such tensors, and autograd refuses to save them
    when the layout is later trained with."""
    for name in ("counts", "n_full", "full_start", "indices", "mask_ids"):
        setattr(sched, name, trainable(getattr(sched, name)))
    return sched


def schedule_key(kv_lens, bound_tail: bool = True) -> tuple:
    """Cache key of a schedule; ``kv_lens`` as Python ints so a lookup never syncs with the GPU."""
    if isinstance(kv_lens, torch.Tensor):
        kv_lens = kv_lens.tolist()
    return ("schedule", bound_tail, None if kv_lens is None else tuple(int(n) for n in kv_lens))


def schedule(layout: BlockLayout, kv_lens=None, *, bound_tail: bool = True) -> Schedule:
    """Reorder ``layout``'s rows (cached per ``kv_lens``).

    kv_lens: key length per batch row (varlen), a sequence of ints (or an int tensor [Bl]);
        default ``layout.kv_len`` for every row.
    bound_tail: a last key block cut by the sequence end needs the bound mask, so it goes last.
    """
    key = schedule_key(kv_lens, bound_tail)
    caches = layout._caches()
    if key not in caches:
        lens = None if key[2] is None else torch.tensor(key[2], device=layout.device)
        caches[key] = _build(layout, lens, bound_tail)
    return caches[key]


def seed_ordered(layout: BlockLayout, n_full: torch.Tensor, *, contiguous: bool = False, kv_lens=None,
                 first: torch.Tensor | None = None) -> Schedule:
    """Cache the forward schedule (for ``kv_lens``, tail bound) of a layout whose rows are already in
    visiting order: in every row the first ``n_full`` listed blocks need no mask and the rest do
    (an element mask or the sequence-end bound). A builder that knows this (``predict.meansim``)
    calls it so a fresh layout costs no reordering and no host sync; ``contiguous`` is a claim the
    caller must know to be true (False is always safe: the kernels then load every index).

    n_full: int [Bl, Hl, Qb]. The layout's own tensors are the schedule's indices and mask ids.
    first: int32 [Bl, Hl, Qb], each row's first listed block where the caller has it (else read from the
    layout: four small device ops, which a decoding step's plan pays every call).
    """
    n_full = n_full.to(torch.int32).contiguous()
    if first is not None:
        first = first.contiguous()
    elif layout.max_k:
        first = torch.where(n_full > 0, layout.kv_indices[..., 0], 0).to(torch.int32).contiguous()
    else:
        first = torch.zeros_like(n_full)
    sched = Schedule(layout.kv_counts.contiguous(), n_full, first, layout.kv_indices.contiguous(),
                     layout.kv_mask_ids.contiguous(), contiguous)
    layout._caches()[schedule_key(kv_lens)] = sched
    return sched


def _build(layout: BlockLayout, kv_lens, bound_tail: bool) -> Schedule:
    counts, idx, mids = layout.kv_counts.long(), layout.kv_indices.long(), layout.kv_mask_ids
    max_k = idx.shape[-1]
    slot = torch.arange(max_k, device=idx.device)
    valid = slot < counts[..., None]
    needs = valid & (mids >= 0)
    if bound_tail:
        lens = torch.full((layout.batch,), layout.kv_len, device=idx.device) if kv_lens is None else kv_lens.to(idx.device).long()
        lens = lens.view(-1, 1, 1, 1)
        last = (lens + layout.block_k - 1) // layout.block_k - 1
        needs |= valid & (idx == last) & (lens % layout.block_k != 0)
    full = valid & ~needs
    order_key = torch.where(full, slot, torch.where(needs, max_k + slot, 2 * max_k + slot))
    order = torch.argsort(order_key, dim=-1)
    n_full = full.sum(-1)
    first = torch.where(n_full > 0, idx.gather(-1, order[..., :1])[..., 0] if max_k else n_full, 0)
    if max_k:
        last_full = idx.gather(-1, order).gather(-1, (n_full - 1).clamp(min=0)[..., None])[..., 0]
        contiguous = bool(((n_full == 0) | (last_full - first + 1 == n_full)).all())
    else:
        contiguous = True
    return Schedule(layout.kv_counts.contiguous(), n_full.to(torch.int32).contiguous(),
                    first.to(torch.int32).contiguous(), idx.gather(-1, order).to(torch.int32).contiguous(),
                    mids.gather(-1, order).contiguous(), contiguous)
