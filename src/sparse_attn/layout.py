"""BlockLayout: the one sparse format every op consumes.

The attention matrix ``[Lq, Lk]`` is tiled into ``block_q x block_k`` blocks. For each query-block
row the layout lists the key blocks to visit (ascending), and marks each one *full* (no element
mask) or *partial* (an :class:`~sparse_attn.masks.ElementMask` from ``masks`` is applied inside
the block). Token ``(i, j)`` is attended iff its block is listed and (the block is full or the
block's mask allows ``(i, j)``), and always ``i < q_len``, ``j < kv_len``.

Storage (B and H broadcast: a dim of size 1 serves every batch element / head):

    kv_counts   int32 [Bl, Hl, Qb]          how many key blocks row qb visits
    kv_indices  int32 [Bl, Hl, Qb, max_k]   which, ascending; slots past the count hold -1
    kv_mask_ids int32 [Bl, Hl, Qb, max_k]   -1 = full block, m >= 0 = partial with masks[m]

Memory is O(Bl*Hl*Qb*max_k); only ``to_block_mask`` / ``to_token_mask`` are dense.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

import torch

from .masks import ElementMask, MaskTerm, allowed, count_allowed, mask_table, term_intervals

MIN_BLOCK, MAX_BLOCK = 16, 256
_CLASSIFY_CHUNK = 1 << 21  # candidate-rows per chunk when classifying blocks (bounds host memory)
_FEW_ROWS = 16  # from_mask of one query block of at most this many rows runs in plain integers


def _interval(term: MaskTerm, p: int) -> tuple[int, int]:
    """:func:`masks.term_intervals` for one query position: the allowed keys ``[lo, hi]`` (empty if lo > hi)."""
    lo = max(p - term.left, term.k_lo)
    hi = min(p + term.right, term.k_hi)
    if term.doc:
        d0 = p // term.doc * term.doc
        lo, hi = max(lo, d0), min(hi, d0 + term.doc - 1)
    if p < term.q_lo or p > term.q_hi:
        hi = lo - 1
    return lo, hi


def _union_length(intervals: list[tuple[int, int]], j0: int, j1: int) -> int:
    """How many keys of ``[j0, j1]`` the union of ``intervals`` holds."""
    cut = sorted((max(lo, j0), min(hi, j1)) for lo, hi in intervals if max(lo, j0) <= min(hi, j1))
    total, end = 0, j0 - 1
    for lo, hi in cut:
        if hi > end:
            total += hi - max(lo, end + 1) + 1
            end = hi
    return total


class LayoutError(ValueError):
    """A BlockLayout that is inconsistent with itself or with the tensors it is used on."""


def as_int(value):
    """``value`` as a plain int when it is an integer of any kind (numpy / torch scalars too), else None."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    try:
        return operator.index(value)
    except TypeError:  # a tensor of more than one element
        return None


def _version(t) -> int:
    """A tensor's version counter (-1 for a non-tensor, or a tensor made under torch.inference_mode, which
    has none): BlockLayout._fingerprint."""
    return -1 if not isinstance(t, torch.Tensor) or t.is_inference() else t._version


def check_block_size(name: str, value: int) -> None:
    v = as_int(value)
    if v is None or v % 16 or not MIN_BLOCK <= v <= MAX_BLOCK:
        raise LayoutError(f"{name} must be a multiple of 16 in [{MIN_BLOCK}, {MAX_BLOCK}], got {value!r}")


def check_length(name: str, value) -> int:
    """A sequence length as a plain int >= 0, or a LayoutError naming it."""
    v = as_int(value)
    if v is None or v < 0:
        raise LayoutError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    return v


@dataclass
class _Coo:
    """Layout entries as flat int64 coordinates (b, h, qb, kb) plus a mask id; internal currency."""

    b: torch.Tensor
    h: torch.Tensor
    qb: torch.Tensor
    kb: torch.Tensor
    mask_id: torch.Tensor


@dataclass(eq=False)
class BlockLayout:
    """Which ``block_q x block_k`` blocks of the ``[q_len, kv_len]`` attention matrix each query-block
    row visits (the module docstring has the semantics):

        kv_counts   int32 [Bl, Hl, Qb]          key blocks row qb visits (Bl in {1, B}, Hl in {1, Hq})
        kv_indices  int32 [Bl, Hl, Qb, max_k]   which, ascending; slots past the count hold -1
        kv_mask_ids int32 [Bl, Hl, Qb, max_k]   -1 = full block, m >= 0 = partial with ``masks[m]``
        masks       ElementMask per partial kind (token-exact rules applied inside the block)

    Build one with :mod:`sparse_attn.patterns` or :meth:`from_mask` / :meth:`from_block_mask`.
    """

    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    kv_counts: torch.Tensor
    kv_indices: torch.Tensor
    kv_mask_ids: torch.Tensor
    masks: tuple[ElementMask, ...] = ()
    # True for the result of transpose(): the backward's view, whose masks stay in the (query, key)
    # frame of the layout it came from, so it has no token-level meaning of its own
    _is_transpose: bool = field(default=False, repr=False)
    # Caches of state derived from the fields above (not constructor arguments, so dataclasses.replace
    # and copy.copy start a copy without them). They belong to the fields as they were when filled
    # (_state); a layout changed since, in place or by assigning a field, drops them on its next use.
    _transpose: "BlockLayout | None" = field(default=None, init=False, repr=False)
    _table: tuple | None = field(default=None, init=False, repr=False)
    _validated: bool = field(default=False, init=False, repr=False)  # set by the API after validate() passed
    # cached .to(q.device), one per device (a model split over GPUs uses one layout on each)
    _device_copies: dict = field(default_factory=dict, init=False, repr=False)
    _derived: dict = field(default_factory=dict, init=False, repr=False)  # schedules, causal cut, ...
    _state: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self):
        # numpy / torch integer scalars become plain ints: these reach kernel arguments and cache keys
        for name in ("block_q", "block_k", "q_len", "kv_len"):
            v = as_int(getattr(self, name))
            if v is not None:
                setattr(self, name, v)
        self._state = self._fingerprint()

    def __copy__(self) -> "BlockLayout":
        return replace(self)  # the same fields, none of the caches

    def _fingerprint(self) -> tuple:
        """What the caches depend on, read without a device sync: each tensor's identity and version
        counter (bumped by every in-place write; tensors made under torch.inference_mode have none, so
        their in-place edits go unseen), the masks' identity and the four sizes. A list of masks (a
        hand-built layout's; builders give tuples) also by its contents, which an in-place edit changes
        (ElementMask compares and hashes by value; anything else, refused by validate(), by identity)."""
        # written out (no helper, no generators): it runs a few times in every call, decoding steps included
        c, i, m = self.kv_counts, self.kv_indices, self.kv_mask_ids
        masks = ()
        if isinstance(self.masks, list):
            masks = tuple(x if isinstance(x, ElementMask) else id(x) for x in self.masks)
        return (id(c), _version(c), id(i), _version(i), id(m), _version(m), id(self.masks), masks, self.block_q,
                self.block_k, self.q_len, self.kv_len)

    def _drop_stale_caches(self) -> None:
        """Forget every cache (and the validation) if the layout changed since they were filled: a
        layout edited after a first call ran its old schedule and mask table (wrong results), and one
        made invalid kept its validation (reads out of bounds on a GPU). Not while torch.compile
        traces: a prepared layout's caches must then be used as they are."""
        if torch.compiler.is_compiling():
            return
        state = self._fingerprint()
        if state != self._state:
            self._state = state
            self._transpose = self._table = None
            self._device_copies = {}
            self._validated = False
            self._derived = {}

    def _ensure_valid(self) -> None:
        """:meth:`validate` once per state of the layout (builders' layouts are valid by construction)."""
        self._drop_stale_caches()
        if not self._validated:
            self.validate()
            self._validated = True

    def _caches(self) -> dict:
        """The derived-state cache (schedules, causal cut), current with the layout's fields."""
        self._drop_stale_caches()
        return self._derived

    # ------------------------------------------------------------------ shape facts
    @property
    def num_q_blocks(self) -> int:
        return math.ceil(self.q_len / self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.kv_len / self.block_k)

    @property
    def batch(self) -> int:
        return self.kv_counts.shape[0]

    @property
    def heads(self) -> int:
        return self.kv_counts.shape[1]

    @property
    def max_k(self) -> int:
        return self.kv_indices.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.kv_counts.device

    @property
    def kv_partial(self) -> torch.Tensor:
        """bool [Bl, Hl, Qb, max_k]: the block needs its element mask (only meaningful below the count)."""
        return self.kv_mask_ids >= 0

    @property
    def num_blocks(self) -> int:
        """Blocks computed for one (batch, head) pair summed over the layout's broadcast rows."""
        return int(self.kv_counts.sum())

    @property
    def density(self) -> float:
        """Fraction of the block grid that is visited, counted in whole blocks, over Bl*Hl rows."""
        total = self._grid_blocks()
        return self.num_blocks / total if total else 0.0

    @property
    def sparsity(self) -> float:
        """Fraction of the block grid skipped; 0.0 for an empty grid (nothing visited, nothing skipped),
        as ``metrics.sparsity`` of an empty mask and ``accuracy.effective_sparsity`` say."""
        return 1.0 - self.density if self._grid_blocks() else 0.0

    def _grid_blocks(self) -> int:
        return self.batch * self.heads * self.num_q_blocks * self.num_kv_blocks

    @property
    def nbytes(self) -> int:
        tensors = [self.kv_counts, self.kv_indices, self.kv_mask_ids]
        return sum(t.numel() * t.element_size() for t in tensors)

    def counts_per_head(self) -> torch.Tensor:
        """int64 [Bl, Hl]: blocks visited by each (batch, head)."""
        return self.kv_counts.sum(-1, dtype=torch.int64)

    def mask_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(terms int32 [n_masks, n_terms, 7], term counts int32 [n_masks]) on the layout's device."""
        self._drop_stale_caches()
        if self._table is None or self._table[0].device != self.device:
            self._table = mask_table(self.masks, self.device)
        return self._table

    def __repr__(self) -> str:
        return (f"BlockLayout(block_q={self.block_q}, block_k={self.block_k}, q_len={self.q_len}, "
                f"kv_len={self.kv_len}, batch={self.batch}, heads={self.heads}, max_k={self.max_k}, "
                f"density={self.density:.4f}, masks={len(self.masks)})")

    # ------------------------------------------------------------------ construction
    @classmethod
    def _from_coo(cls, coo: _Coo, *, batch: int, heads: int, block_q: int, block_k: int,
                  q_len: int, kv_len: int, masks: tuple[ElementMask, ...]) -> "BlockLayout":
        """Pack entries (any order, no duplicates) into the padded row format."""
        if batch < 1 or heads < 1:  # a [0, ...] block mask or score tensor: '|' then failed in a broadcast
            raise LayoutError(f"a layout needs batch >= 1 and heads >= 1 (1 broadcasts over all), got batch={batch}, "
                              f"heads={heads}")
        check_block_size("block_q", block_q)
        check_block_size("block_k", block_k)
        nq = math.ceil(q_len / block_q)
        nk = math.ceil(kv_len / block_k)
        device = coo.b.device
        row = (coo.b * heads + coo.h) * nq + coo.qb
        order = torch.argsort(row * max(nk, 1) + coo.kb)
        row, kb, mid = row[order], coo.kb[order], coo.mask_id[order]
        counts = torch.bincount(row, minlength=batch * heads * nq) if row.numel() else \
            torch.zeros(batch * heads * nq, dtype=torch.int64, device=device)
        max_k = int(counts.max()) if counts.numel() else 0
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(row.numel(), device=device) - starts[row]
        indices = torch.full((batch * heads * nq, max_k), -1, dtype=torch.int32, device=device)
        mask_ids = torch.full_like(indices, -1)
        indices[row, slot] = kb.to(torch.int32)
        mask_ids[row, slot] = mid.to(torch.int32)
        layout = cls(block_q, block_k, q_len, kv_len,
                     counts.to(torch.int32).view(batch, heads, nq),
                     indices.view(batch, heads, nq, max_k),
                     mask_ids.view(batch, heads, nq, max_k), tuple(masks))
        # sorted, de-duplicated, in-range by construction: no host-syncing validate() needed later
        # (which also keeps torch.compile(fullgraph=True) free of data-dependent branches)
        layout._validated = True
        return layout

    def _to_coo(self, batch: int | None = None, heads: int | None = None) -> _Coo:
        """Entries as coordinates, broadcast to (batch, heads) when given."""
        counts, idx, mids = self.kv_counts, self.kv_indices, self.kv_mask_ids
        if batch is not None or heads is not None:
            shape = (batch or self.batch, heads or self.heads)
            counts = counts.expand(*shape, -1)
            idx = idx.expand(*shape, -1, -1)
            mids = mids.expand(*shape, -1, -1)
        slots = torch.arange(idx.shape[-1], device=idx.device)
        valid = slots < counts[..., None].long()
        b, h, qb, s = valid.nonzero(as_tuple=True)
        return _Coo(b, h, qb, idx[b, h, qb, s].long(), mids[b, h, qb, s].long())

    @classmethod
    def from_block_mask(cls, block_mask: torch.Tensor, *, block_q: int, block_k: int,
                        q_len: int | None = None, kv_len: int | None = None,
                        partial: torch.Tensor | None = None, mask: ElementMask | None = None) -> "BlockLayout":
        """From a dense bool ``[Bl, Hl, Qb, Kb]`` (or ``[Qb, Kb]``) block mask.

        ``partial`` (same shape, bool) marks blocks to which ``mask`` applies; without it every
        listed block is full. ``q_len``/``kv_len`` default to whole blocks.
        """
        if block_mask.dtype != torch.bool:
            raise LayoutError(f"block_mask must be bool, got {block_mask.dtype}")
        if block_mask.dim() == 2:
            block_mask = block_mask[None, None]
        if block_mask.dim() != 4:
            raise LayoutError(f"block_mask must be [Qb, Kb] or [B, H, Qb, Kb], got shape {tuple(block_mask.shape)}")
        nq, nk = block_mask.shape[-2:]
        q_len = nq * block_q if q_len is None else check_length("q_len", q_len)
        kv_len = nk * block_k if kv_len is None else check_length("kv_len", kv_len)
        if math.ceil(q_len / block_q) != nq or math.ceil(kv_len / block_k) != nk:
            raise LayoutError(
                f"block_mask has {nq}x{nk} blocks but q_len={q_len}, kv_len={kv_len} with blocks "
                f"{block_q}x{block_k} need {math.ceil(q_len / block_q)}x{math.ceil(kv_len / block_k)}")
        b, h, qb, kb = block_mask.nonzero(as_tuple=True)
        mid = torch.full_like(b, -1)
        masks: tuple[ElementMask, ...] = ()
        if (partial is None) != (mask is None):
            raise LayoutError("partial blocks were marked but no element mask was given" if mask is None else
                              "an element mask was given but no partial= blocks to apply it to: pass partial= (bool, "
                              "like block_mask) marking the blocks the mask cuts, or drop mask=")
        if partial is not None:
            if not isinstance(partial, torch.Tensor) or partial.dtype != torch.bool:
                raise LayoutError(f"partial must be a bool tensor like block_mask, got "
                                  f"{getattr(partial, 'dtype', type(partial).__name__)}")
            if partial.dim() == 2:
                partial = partial[None, None]
            try:
                partial = partial.expand_as(block_mask)
            except RuntimeError:
                raise LayoutError(f"partial has shape {tuple(partial.shape)}, block_mask "
                                  f"{tuple(block_mask.shape)}: give one like block_mask") from None
            if not isinstance(mask, ElementMask):
                raise LayoutError(f"mask must be an ElementMask, got {type(mask).__name__}")
            mid = torch.where(partial[b, h, qb, kb], 0, -1)
            masks = (mask,)
        coo = _Coo(b, h, qb, kb, mid)
        return cls._from_coo(coo, batch=block_mask.shape[0], heads=block_mask.shape[1], block_q=block_q,
                             block_k=block_k, q_len=q_len, kv_len=kv_len, masks=masks)._classified()

    @classmethod
    def from_mask(cls, mask: ElementMask, *, q_len: int, kv_len: int | None = None,
                  block_q: int = 128, block_k: int = 128, device=None) -> "BlockLayout":
        """The token-exact layout of an element mask, shared by every batch element and head.

        Visits exactly the blocks the mask touches; blocks entirely allowed are full.
        Cost O(Qb * candidates * block_q) time in chunks, O(Qb * max_k) memory.
        """
        if not isinstance(mask, ElementMask):
            hint = ": wrap it, ElementMask((term,))" if isinstance(mask, MaskTerm) else ""
            raise TypeError(f"from_mask takes an ElementMask, got {type(mask).__name__}{hint}")
        q_len = check_length("q_len", q_len)
        kv_len = q_len if kv_len is None else check_length("kv_len", kv_len)
        check_block_size("block_q", block_q)
        check_block_size("block_k", block_k)
        block_q, block_k = int(block_q), int(block_k)
        if 0 < q_len <= min(block_q, _FEW_ROWS) and kv_len > 0:
            return cls._from_mask_few_rows(mask, q_len, kv_len, block_q, block_k, device)
        return cls._from_mask_blocks(mask, q_len, kv_len, block_q, block_k, device)

    @classmethod
    def _from_mask_blocks(cls, mask: ElementMask, q_len: int, kv_len: int, block_q: int, block_k: int,
                          device) -> "BlockLayout":
        """:meth:`from_mask` by tensor ops over every query block (checked arguments)."""
        nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_k)
        offset = kv_len - q_len
        qb = torch.arange(nq, device=device)
        p_first = qb * block_q + offset
        p_last = torch.clamp((qb + 1) * block_q, max=q_len) - 1 + offset
        qs, ks = [], []
        for term in mask.terms:  # candidate key-block range per query block, per term
            lo_first, _ = term_intervals(term, torch.clamp(p_first, min=term.q_lo))
            _, hi_last = term_intervals(term, torch.clamp(p_last, max=term.q_hi))
            lo = torch.clamp(lo_first, min=0)
            hi = torch.clamp(hi_last, max=kv_len - 1)
            live = (lo <= hi) & (p_last >= term.q_lo) & (p_first <= term.q_hi)
            kb_lo, kb_hi = lo // block_k, hi // block_k
            width = torch.where(live, kb_hi - kb_lo + 1, 0)
            rows = torch.repeat_interleave(qb, width)
            first = torch.repeat_interleave(kb_lo, width)
            pos = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(torch.cumsum(width, 0) - width, width)
            qs.append(rows)
            ks.append(first + pos)
        if qs:
            key = torch.unique(torch.cat(qs) * max(nk, 1) + torch.cat(ks))
            q_c, k_c = key // max(nk, 1), key % max(nk, 1)
        else:
            q_c = k_c = torch.zeros(0, dtype=torch.long, device=device)
        zeros = torch.zeros_like(q_c)
        coo = _Coo(zeros, zeros, q_c, k_c, zeros)  # every candidate starts partial with mask 0
        return cls._from_coo(coo, batch=1, heads=1, block_q=block_q, block_k=block_k,
                             q_len=q_len, kv_len=kv_len, masks=(mask,))._classified()

    @classmethod
    def _from_mask_few_rows(cls, mask: ElementMask, q_len: int, kv_len: int, block_q: int, block_k: int,
                            device) -> "BlockLayout":
        """:meth:`from_mask` of one query block of at most :data:`_FEW_ROWS` rows (a decoding step's), in plain
        integers: the tensor path's hundred-odd small ops cost ~2.5 ms a layout on a CPU core, more on a GPU,
        for a grid of one row of blocks. The same entries, masks and order (tests/test_layout_fast_path.py
        compares the two on random masks). Each candidate block is settled by the first and last row's
        intervals where one term fills it or every term misses it (both interval ends are non-decreasing in
        the query position, as in :meth:`_bounds_classify`), else by counting its allowed keys row by row."""
        offset = kv_len - q_len
        p_first, p_last = offset, q_len - 1 + offset
        bounds, candidates = [], set()
        for t in mask.terms:
            lo_first, hi_first = _interval(t, min(max(p_first, t.q_lo), t.q_hi))
            lo_last, hi_last = _interval(t, max(min(p_last, t.q_hi), t.q_lo))
            touches = p_last >= t.q_lo and p_first <= t.q_hi
            bounds.append((p_first >= t.q_lo and p_last <= t.q_hi, touches, lo_first, hi_first, lo_last, hi_last))
            # candidates as the tensor path takes them: from the first row's start to the last row's end
            lo = max(_interval(t, max(p_first, t.q_lo))[0], 0)
            hi = min(_interval(t, min(p_last, t.q_hi))[1], kv_len - 1)
            if lo <= hi and touches:
                candidates.update(range(lo // block_k, hi // block_k + 1))
        rows = None  # each row's intervals, made when a block needs counting
        kbs, mids = [], []
        for kb in sorted(candidates):
            j0 = kb * block_k
            j1 = min(j0 + block_k, kv_len) - 1
            if any(in_rows and lo_l <= j0 and hi_f >= j1 for in_rows, _, _, hi_f, lo_l, _ in bounds):
                kbs.append(kb)
                mids.append(-1)
                continue
            if all(not touches or hi_l < j0 or lo_f > j1 for _, touches, lo_f, _, _, hi_l in bounds):
                continue
            if rows is None:
                rows = [[_interval(t, p) for t in mask.terms] for p in range(p_first, p_last + 1)]
            total = sum(_union_length(ivals, j0, j1) for ivals in rows)
            if total:
                kbs.append(kb)
                mids.append(-1 if total == q_len * (j1 - j0 + 1) else 0)
        n = len(kbs)
        layout = cls(block_q, block_k, q_len, kv_len,
                     torch.tensor([n], dtype=torch.int32, device=device).view(1, 1, 1),
                     torch.tensor(kbs, dtype=torch.int32, device=device).view(1, 1, 1, n),
                     torch.tensor(mids, dtype=torch.int32, device=device).view(1, 1, 1, n),
                     (mask,) if 0 in mids else ())
        layout._validated = True  # sorted, de-duplicated, in range by construction (as _from_coo)
        return layout

    def _classified(self, only: set | None = None) -> "BlockLayout":
        """Drop partial blocks the mask leaves empty; mark partial blocks it fully allows as full.
        ``only``: classify just the blocks whose mask is in this set (the others are known tight)."""
        if not self.masks:
            return self
        coo = self._to_coo()
        part = coo.mask_id >= 0
        if only is not None:
            part &= torch.tensor([m in only for m in self.masks] + [False], device=self.device)[coo.mask_id]
        keep = torch.ones_like(coo.b, dtype=torch.bool)
        new_mid = coo.mask_id.clone()
        offset = self.kv_len - self.q_len
        # most blocks of a band are settled by the first and last row alone (bounds_classify); only the
        # rest are counted row by row below
        full, empty = self._bounds_classify(coo, part, offset)
        new_mid[full] = -1
        keep &= ~empty
        part = (part & ~full & ~empty).nonzero(as_tuple=True)[0]
        if part.numel() == 0:
            coo = _Coo(coo.b[keep], coo.h[keep], coo.qb[keep], coo.kb[keep], new_mid[keep])
            return self._rebuild(coo, self.batch, self.heads, self.masks)
        rows = torch.arange(self.block_q, device=self.device)
        step = max(1, _CLASSIFY_CHUNK // self.block_q)
        for start in range(0, part.numel(), step):
            sel = part[start:start + step]
            i = coo.qb[sel, None] * self.block_q + rows[None]  # [n, block_q]
            j0 = (coo.kb[sel] * self.block_k)[:, None]
            j1 = torch.clamp(j0 + self.block_k, max=self.kv_len) - 1
            n_rows = torch.clamp(self.q_len - coo.qb[sel] * self.block_q, max=self.block_q)
            n_cols = (j1 - j0 + 1)[:, 0]
            got = torch.zeros(sel.numel(), dtype=torch.int64, device=self.device)
            for m in torch.unique(coo.mask_id[sel]).tolist():
                here = coo.mask_id[sel] == m
                c = count_allowed(self.masks[m], i[here] + offset, j0[here], j1[here])
                c = torch.where(i[here] < self.q_len, c, 0)
                got[here] = c.sum(-1)
            keep[sel] = got > 0
            new_mid[sel] = torch.where(got == n_rows * n_cols, -1, coo.mask_id[sel])
        coo = _Coo(coo.b[keep], coo.h[keep], coo.qb[keep], coo.kb[keep], new_mid[keep])
        return self._rebuild(coo, self.batch, self.heads, self.masks)

    def _bounds_classify(self, coo: _Coo, part: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(full, empty) bool per entry of ``coo``, for the ``part`` entries a mask term settles from
        the block's first and last row. Within a term's row range its key interval ``[lo(p), hi(p)]``
        has both ends non-decreasing in ``p`` (each is a max / min of ``p +- const``, a constant and
        ``p``'s document start), so every row allows the whole key span iff ``lo(last) <= j0`` and
        ``hi(first) >= j1``, and no row reaches it if ``hi(last) < j0`` or ``lo(first) > j1``. A block
        is full if one term fills it, empty if every term misses it; the rest stay undecided."""
        full = torch.zeros_like(part)
        empty = torch.zeros_like(part)
        p_first = coo.qb * self.block_q + offset
        p_last = torch.clamp((coo.qb + 1) * self.block_q, max=self.q_len) - 1 + offset
        j0 = coo.kb * self.block_k
        j1 = torch.clamp(j0 + self.block_k, max=self.kv_len) - 1
        for m, mask in enumerate(self.masks):
            sel = part & (coo.mask_id == m)
            if not sel.any():
                continue
            missed = sel.clone()
            for term in mask.terms:
                in_rows = (p_first >= term.q_lo) & (p_last <= term.q_hi)
                # the intervals of the first and last rows inside the term's row range
                lo_first, hi_first = term_intervals(term, torch.clamp(p_first, min=term.q_lo, max=term.q_hi))
                lo_last, hi_last = term_intervals(term, torch.clamp(p_last, min=term.q_lo, max=term.q_hi))
                full |= sel & in_rows & (lo_last <= j0) & (hi_first >= j1)
                misses = (p_last < term.q_lo) | (p_first > term.q_hi) | (hi_last < j0) | (lo_first > j1)
                missed &= misses
            empty |= missed
        return full, empty & ~full

    def _rebuild(self, coo: _Coo, batch: int, heads: int, masks: tuple) -> "BlockLayout":
        used = torch.unique(coo.mask_id[coo.mask_id >= 0]).tolist()
        remap = torch.full((len(masks) + 1,), -1, dtype=torch.long, device=coo.b.device)
        for new, old in enumerate(used):
            remap[old] = new
        mid = torch.where(coo.mask_id >= 0, remap[coo.mask_id.clamp(min=0)], -1)
        return BlockLayout._from_coo(_Coo(coo.b, coo.h, coo.qb, coo.kb, mid), batch=batch, heads=heads,
                                     block_q=self.block_q, block_k=self.block_k, q_len=self.q_len,
                                     kv_len=self.kv_len, masks=tuple(masks[m] for m in used))

    # ------------------------------------------------------------------ algebra
    def _check_compatible(self, other: "BlockLayout", op: str) -> tuple[int, int]:
        mine = (self.block_q, self.block_k, self.q_len, self.kv_len)
        theirs = (other.block_q, other.block_k, other.q_len, other.kv_len)
        if mine != theirs:
            raise LayoutError(f"cannot {op} layouts with (block_q, block_k, q_len, kv_len) {mine} and {theirs}")
        dims = []
        for name, a, b in (("batch", self.batch, other.batch), ("heads", self.heads, other.heads)):
            if a != b and 1 not in (a, b):
                raise LayoutError(f"cannot {op} layouts with {name} {a} and {b}: they must match or be 1")
            dims.append(max(a, b))
        return dims[0], dims[1]

    def check_token_frame(self, what: str) -> None:
        """Raise for a :meth:`transpose` result, which ``what`` (a token-level use) would misread."""
        if self._is_transpose:
            raise LayoutError(f"{what}: this layout is a transpose() (the backward's per key-block view, whose "
                              "element masks keep the original (query, key) frame), not a pattern with a token-level "
                              "meaning of its own; build the transposed pattern directly instead")

    def _combine(self, other: "BlockLayout", union: bool) -> "BlockLayout":
        if not isinstance(other, BlockLayout):
            raise TypeError(f"a BlockLayout combines ({'|' if union else '&'}) only with another BlockLayout, got "
                            f"{type(other).__name__}")
        for lay in (self, other):
            lay.check_token_frame("| and &")
            lay._ensure_valid()  # a bad hand-built operand came out rearranged and marked valid
        batch, heads = self._check_compatible(other, "union" if union else "intersect")
        a, b = self._to_coo(batch, heads), other._to_coo(batch, heads)
        nq, nk = self.num_q_blocks, max(self.num_kv_blocks, 1)
        key_a = ((a.b * heads + a.h) * nq + a.qb) * nk + a.kb
        key_b = ((b.b * heads + b.h) * nq + b.qb) * nk + b.kb
        n_a = len(self.masks)
        keys = torch.cat([key_a, key_b])
        mids = torch.cat([a.mask_id, torch.where(b.mask_id >= 0, b.mask_id + n_a, -1)])
        uniq, inv, cnt = torch.unique(keys, return_inverse=True, return_counts=True)
        # per unique key: mask id from side a and side b (-2 = absent)
        side_a = torch.full_like(uniq, -2)
        side_b = torch.full_like(uniq, -2)
        side_a[inv[:key_a.numel()]] = mids[:key_a.numel()]
        side_b[inv[key_a.numel():]] = mids[key_a.numel():]
        masks = list(self.masks) + list(other.masks)
        both = (side_a > -2) & (side_b > -2)
        if union:
            keep = torch.ones_like(uniq, dtype=torch.bool)
            result = torch.where(side_a > -2, side_a, side_b)
            full = both & ((side_a == -1) | (side_b == -1))
        else:
            keep = both
            result = torch.where(side_a == -1, side_b, side_a)
            full = both & (side_a == -1) & (side_b == -1)
        result = torch.where(full, -1, result)
        mixed = both & (side_a >= 0) & (side_b >= 0)
        if mixed.any():  # partial on both sides: a new mask, OR (union) or AND (intersection)
            pairs = torch.stack([side_a[mixed], side_b[mixed]], 1)
            up, pinv = torch.unique(pairs, dim=0, return_inverse=True)
            new_ids = []
            for ma, mb in up.tolist():
                masks.append(masks[ma] | masks[mb] if union else masks[ma] & masks[mb])
                new_ids.append(len(masks) - 1)
            result[mixed] = torch.tensor(new_ids, device=uniq.device)[pinv]
        uniq, result = uniq[keep], result[keep]
        kb = uniq % nk
        row = uniq // nk
        coo = _Coo(row // (heads * nq), (row // nq) % heads, row % nq, kb, result)
        out = self._rebuild(coo, batch, heads, tuple(masks))
        if not union:
            return out._classified()
        # a union can only fill blocks partial on both sides (their OR may cover the block): check those
        return out._classified(only=set(masks[n_a + len(other.masks):])) if mixed.any() else out

    def __or__(self, other: "BlockLayout") -> "BlockLayout":
        return self._combine(other, union=True)

    def __and__(self, other: "BlockLayout") -> "BlockLayout":
        return self._combine(other, union=False)

    # ------------------------------------------------------------------ views
    def transpose(self) -> "BlockLayout":
        """Per key-block row: which query blocks visit it (for backward). Cached; q/k roles swap.

        The result's ``kv_*`` tensors are indexed ``[Bl, Hl, Kb, max_q]`` and hold query-block
        indices; ``block_q``/``block_k`` and ``q_len``/``kv_len`` are swapped accordingly, and
        masks keep meaning in the original (query, key) frame. So the result is a block-level
        view: token-level uses (attention, ``|``/``&``, :meth:`to_token_mask`, ``to_flex``,
        ``causal_cut``) refuse it, and its :meth:`transpose` is this layout again.
        """
        self._ensure_valid()
        if self._transpose is None:
            coo = self._to_coo()
            t = BlockLayout._from_coo(_Coo(coo.b, coo.h, coo.kb, coo.qb, coo.mask_id), batch=self.batch,
                                      heads=self.heads, block_q=self.block_k, block_k=self.block_q,
                                      q_len=self.kv_len, kv_len=self.q_len, masks=self.masks)
            t._transpose = self
            t._is_transpose = not self._is_transpose
            self._transpose = t
        return self._transpose

    def to(self, device) -> "BlockLayout":
        if torch.device(device) == self.device:
            return self
        self._drop_stale_caches()  # the copy inherits the validation: only if it is current
        moved = BlockLayout(self.block_q, self.block_k, self.q_len, self.kv_len, self.kv_counts.to(device),
                            self.kv_indices.to(device), self.kv_mask_ids.to(device), self.masks)
        moved._validated = self._validated
        moved._is_transpose = self._is_transpose
        return moved

    def expand(self, batch: int, heads: int) -> "BlockLayout":
        """The same layout with broadcast dims materialised to (batch, heads)."""
        if self.batch not in (1, batch) or self.heads not in (1, heads):
            raise LayoutError(f"a layout with batch {self.batch}, heads {self.heads} expands only where it has 1: "
                              f"got expand({batch}, {heads})")
        self._drop_stale_caches()
        expanded = BlockLayout(self.block_q, self.block_k, self.q_len, self.kv_len,
                               self.kv_counts.expand(batch, heads, -1).contiguous(),
                               self.kv_indices.expand(batch, heads, -1, -1).contiguous(),
                               self.kv_mask_ids.expand(batch, heads, -1, -1).contiguous(), self.masks)
        expanded._validated = self._validated
        expanded._is_transpose = self._is_transpose
        return expanded

    def to_block_mask(self) -> torch.Tensor:
        """Dense bool [Bl, Hl, Qb, Kb]. O(Qb*Kb) memory: for inspection and small sizes."""
        return self._block_map() >= -1

    def _block_map(self) -> torch.Tensor:
        """Dense int [Bl, Hl, Qb, Kb]: -2 absent, -1 full, m partial with masks[m]."""
        out = torch.full((self.batch, self.heads, self.num_q_blocks, self.num_kv_blocks), -2,
                         dtype=torch.int32, device=self.device)
        coo = self._to_coo()
        out[coo.b, coo.h, coo.qb, coo.kb] = coo.mask_id.to(torch.int32)
        return out

    def to_token_mask(self) -> torch.Tensor:
        """Dense bool [Bl, Hl, q_len, kv_len]: the exact attention pattern. For small L and tests."""
        self.check_token_frame("to_token_mask")
        bmap = self._block_map()
        tok = bmap.repeat_interleave(self.block_q, 2).repeat_interleave(self.block_k, 3)
        tok = tok[..., :self.q_len, :self.kv_len]
        out = tok == -1
        p = torch.arange(self.q_len, device=self.device) + (self.kv_len - self.q_len)
        j = torch.arange(self.kv_len, device=self.device)
        for m, em in enumerate(self.masks):
            out |= (tok == m) & allowed(em, p, j)
        return out

    # ------------------------------------------------------------------ checks
    def validate(self) -> "BlockLayout":
        """Raise LayoutError naming the first inconsistency; return self when consistent."""
        check_block_size("block_q", self.block_q)
        check_block_size("block_k", self.block_k)
        check_length("q_len", self.q_len)  # an int >= 0 (a float 64.0 ran, a str failed in a comparison)
        check_length("kv_len", self.kv_len)
        listed = isinstance(self.masks, (tuple, list))  # checked first: an ElementMask itself is not iterable
        if not listed or any(not isinstance(m, ElementMask) for m in self.masks):
            raise LayoutError(f"masks must be a tuple of ElementMask, got {self.masks!r:.80}")
        nq, nk = self.num_q_blocks, self.num_kv_blocks
        for name, t, dim in (("kv_counts", self.kv_counts, 3), ("kv_indices", self.kv_indices, 4),
                             ("kv_mask_ids", self.kv_mask_ids, 4)):
            if t.dtype != torch.int32 or t.dim() != dim:
                raise LayoutError(f"{name} must be int32 with {dim} dims, got {t.dtype} {tuple(t.shape)}")
        if self.kv_counts.shape[2] != nq:
            raise LayoutError(f"kv_counts has {self.kv_counts.shape[2]} query-block rows; q_len={self.q_len} "
                              f"with block_q={self.block_q} needs {nq}")
        if self.kv_indices.shape[:3] != self.kv_counts.shape or self.kv_mask_ids.shape != self.kv_indices.shape:
            raise LayoutError(f"kv_indices {tuple(self.kv_indices.shape)} / kv_mask_ids "
                              f"{tuple(self.kv_mask_ids.shape)} do not match kv_counts {tuple(self.kv_counts.shape)}")
        bad = (self.kv_counts < 0) | (self.kv_counts > min(self.max_k, nk))
        if bad.any():
            b, h, q = [int(x) for x in bad.nonzero()[0]]
            raise LayoutError(f"kv_counts[{b},{h},{q}] = {int(self.kv_counts[b, h, q])} is outside "
                              f"[0, {min(self.max_k, nk)}] (max_k={self.max_k}, {nk} key blocks)")
        valid = torch.arange(self.max_k, device=self.device) < self.kv_counts[..., None]
        out_of_range = valid & ((self.kv_indices < 0) | (self.kv_indices >= nk))
        if out_of_range.any():
            b, h, q, s = [int(x) for x in out_of_range.nonzero()[0]]
            raise LayoutError(f"kv_indices[{b},{h},{q},{s}] = {int(self.kv_indices[b, h, q, s])} is out of range: "
                              f"valid key-block indices are 0..{nk - 1} (kv_len={self.kv_len}, block_k={self.block_k})")
        not_sorted = valid[..., 1:] & (self.kv_indices[..., 1:] <= self.kv_indices[..., :-1])
        if not_sorted.any():
            b, h, q, s = [int(x) for x in not_sorted.nonzero()[0]]
            a, c = int(self.kv_indices[b, h, q, s]), int(self.kv_indices[b, h, q, s + 1])
            kind = "duplicate" if a == c else "unsorted"
            raise LayoutError(f"kv_indices[{b},{h},{q}] has {kind} entries at slots {s},{s + 1}: {a}, {c}; "
                              "each row must be strictly ascending")
        bad_mid = valid & ((self.kv_mask_ids < -1) | (self.kv_mask_ids >= len(self.masks)))
        if bad_mid.any():
            b, h, q, s = [int(x) for x in bad_mid.nonzero()[0]]
            raise LayoutError(f"kv_mask_ids[{b},{h},{q},{s}] = {int(self.kv_mask_ids[b, h, q, s])}: must be -1 "
                              f"(full) or a mask index in [0, {len(self.masks) - 1}]")
        return self


def layout_key(layout) -> tuple | int:
    """Identity and state of a layout (of anything else: its identity), for caches keyed on layouts
    outside them (varlen and grouped plans): a layout changed in place gets a new key. The cache
    must keep the layout alive, so that its id cannot be reused while the entry exists."""
    return (id(layout),) + layout._fingerprint() if isinstance(layout, BlockLayout) else id(layout)
