"""Element masks of partial blocks, described as data.

A mask is a union (OR) of *terms*; a term is a conjunction of interval constraints on the
query position ``p`` and key position ``j``. Positions live in the key frame: query row ``i``
has position ``p = i + (kv_len - q_len)`` (bottom-right alignment, as FlashAttention defines
causal for ``Lq != Lk``). A term allows ``(i, j)`` iff

    q_lo <= p <= q_hi            (rows the term applies to, e.g. BigBird global rows)
    k_lo <= j <= k_hi            (absolute key range, e.g. attention sinks)
    p - left <= j <= p + right   (sliding window; causal is right = 0)
    doc == 0 or p // doc == j // doc   (token-exact block-diagonal of any size)

Everything is plain integers, so the Triton kernels read a mask from a small int32 table and
apply it with a handful of compares; the same table drives the PyTorch reference.
Unbounded fields hold ``INF`` (2**30), which keeps ``p +- INF`` inside int32.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch

INF = 1 << 30
TERM_FIELDS = 7  # q_lo, q_hi, k_lo, k_hi, left, right, doc
MAX_TERMS = 8


@dataclass(frozen=True)
class MaskTerm:
    """One conjunction of interval constraints (see module docstring)."""

    q_lo: int = -INF
    q_hi: int = INF
    k_lo: int = -INF
    k_hi: int = INF
    left: int = INF
    right: int = INF
    doc: int = 0

    def __post_init__(self):
        for name in ("q_lo", "q_hi", "k_lo", "k_hi", "left", "right", "doc"):
            value = getattr(self, name)
            try:
                value = operator.index(value)
            except TypeError:
                raise TypeError(f"MaskTerm.{name} must be an int, got {type(value).__name__} {value!r}") from None
            # beyond +-INF every field already means "unbounded" (positions stay far below 2**30);
            # clamping keeps the kernels' int32 sums p +- field from wrapping around
            object.__setattr__(self, name, max(-INF, min(INF, value)))
        if self.doc < 0:
            raise ValueError(f"MaskTerm.doc must be >= 0 (0 = no document blocks), got {self.doc}")

    def as_row(self) -> list[int]:
        return [self.q_lo, self.q_hi, self.k_lo, self.k_hi, self.left, self.right, self.doc]

    def intersect(self, other: "MaskTerm") -> "MaskTerm":
        doc = self.doc or other.doc
        if self.doc and other.doc and self.doc != other.doc:
            small, big = sorted((self.doc, other.doc))
            if big % small:
                raise NotImplementedError(
                    f"intersecting block-diagonal masks of sizes {self.doc} and {other.doc} is not supported (one "
                    "size must divide the other); build the pattern with one document size")
            doc = small  # the same small document implies the same big one
        return MaskTerm(
            q_lo=max(self.q_lo, other.q_lo), q_hi=min(self.q_hi, other.q_hi),
            k_lo=max(self.k_lo, other.k_lo), k_hi=min(self.k_hi, other.k_hi),
            left=min(self.left, other.left), right=min(self.right, other.right),
            doc=doc)

    def contains(self, other: "MaskTerm") -> bool:
        """Every (p, j) that ``other`` allows, this term allows too (field by field)."""
        return (self.q_lo <= other.q_lo and self.q_hi >= other.q_hi and self.k_lo <= other.k_lo
                and self.k_hi >= other.k_hi and self.left >= other.left and self.right >= other.right
                and (self.doc == 0 or self.doc == other.doc))

    def is_trivially_empty(self) -> bool:
        return self.q_lo > self.q_hi or self.k_lo > self.k_hi or self.left + self.right < 0


@dataclass(frozen=True)
class ElementMask:
    """A union of :class:`MaskTerm`. ``ElementMask(())`` allows nothing."""

    terms: tuple[MaskTerm, ...]

    def __post_init__(self):
        if isinstance(self.terms, MaskTerm) or not isinstance(self.terms, (tuple, list)):
            raise TypeError(f"ElementMask takes a tuple of MaskTerm, got {type(self.terms).__name__}")
        object.__setattr__(self, "terms", tuple(self.terms))
        bad = [t for t in self.terms if not isinstance(t, MaskTerm)]
        if bad:
            raise TypeError(f"ElementMask terms must be MaskTerm, got {type(bad[0]).__name__} {bad[0]!r}")
        if len(self.terms) > MAX_TERMS:
            raise ValueError(f"an element mask may hold at most {MAX_TERMS} terms, got {len(self.terms)} (a | of "
                             "layouts whose partial blocks overlap joins their masks' terms): compose fewer patterns, "
                             "or use block-aligned ones (their blocks are full, no mask)")

    def __or__(self, other: "ElementMask") -> "ElementMask":
        return ElementMask(_dedup(self.terms + other.terms))

    def __and__(self, other: "ElementMask") -> "ElementMask":
        terms = [a.intersect(b) for a, b in itertools.product(self.terms, other.terms)]
        terms = _dedup(tuple(t for t in terms if not t.is_trivially_empty()))
        if len(terms) > MAX_TERMS:
            raise ValueError(f"intersecting masks of {len(self.terms)} and {len(other.terms)} terms gives "
                             f"{len(terms)} terms, over the limit of {MAX_TERMS}; simplify the masks")
        return ElementMask(terms)


def _dedup(terms: tuple[MaskTerm, ...]) -> tuple[MaskTerm, ...]:
    """Drop repeated terms and terms another term contains (keeps products of unions small)."""
    uniq = list(dict.fromkeys(terms))
    return tuple(t for i, t in enumerate(uniq)
                 if not any(o.contains(t) and (o != t) and (not t.contains(o) or j < i) for j, o in enumerate(uniq)))


# ----------------------------------------------------------------------------- named terms
def causal_term() -> MaskTerm:
    return MaskTerm(right=0)


def window_term(left: int, right: int) -> MaskTerm:
    """Keys with ``p - left <= j <= p + right``; ``left=W-1, right=0`` is a causal window of W tokens."""
    return MaskTerm(left=left, right=right)


def sink_term(num_sink: int) -> MaskTerm:
    return MaskTerm(k_lo=0, k_hi=num_sink - 1)


def document_term(doc: int, causal: bool = False) -> MaskTerm:
    return MaskTerm(doc=doc, right=0 if causal else INF)


# ----------------------------------------------------------------------------- evaluation
def term_intervals(term: MaskTerm, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query position ``p`` (int64 [N]), the allowed key interval ``[lo, hi]`` (empty if lo > hi)."""
    lo = torch.clamp(p - term.left, min=term.k_lo)
    hi = torch.clamp(p + term.right, max=term.k_hi)
    if term.doc:
        d0 = torch.div(p, term.doc, rounding_mode="floor") * term.doc
        lo = torch.maximum(lo, d0)
        hi = torch.minimum(hi, d0 + term.doc - 1)
    rows_out = (p < term.q_lo) | (p > term.q_hi)
    hi = torch.where(rows_out, lo - 1, hi)
    return lo, hi


def allowed(mask: ElementMask, p: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Boolean ``[len(p), len(j)]``: does the mask allow query position p[a] to see key j[b]."""
    out = torch.zeros(p.numel(), j.numel(), dtype=torch.bool, device=p.device)
    for term in mask.terms:
        lo, hi = term_intervals(term, p)
        out |= (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
    return out


def count_allowed(mask: ElementMask, p: torch.Tensor, j0: torch.Tensor, j1: torch.Tensor) -> torch.Tensor:
    """How many keys in ``[j0, j1]`` each query position may see, by inclusion-exclusion over terms.

    p, j0, j1 broadcast together (int64). Exact for the union of the terms' intervals:
    the intersection of intervals is an interval, so every subset contributes one overlap length.
    """
    ivals = [term_intervals(t, p) for t in mask.terms]
    total = torch.zeros(torch.broadcast_shapes(p.shape, j0.shape, j1.shape), dtype=torch.int64, device=p.device)
    for r in range(1, len(ivals) + 1):
        sign = 1 if r % 2 else -1
        for subset in itertools.combinations(ivals, r):
            lo = torch.maximum(j0, torch.stack(torch.broadcast_tensors(*[s[0] for s in subset])).amax(0))
            hi = torch.minimum(j1, torch.stack(torch.broadcast_tensors(*[s[1] for s in subset])).amin(0))
            total += sign * (hi - lo + 1).clamp(min=0)
    return total


def mask_table(masks: tuple[ElementMask, ...], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack masks into the kernels' table: terms int32 [n_masks, max_terms, 7], counts int32 [n_masks]."""
    n_terms = max([len(m.terms) for m in masks] + [1])
    table = torch.zeros(max(len(masks), 1), n_terms, TERM_FIELDS, dtype=torch.int32)
    table[..., 0] = INF  # padding terms are empty (q_lo > q_hi)
    table[..., 1] = -INF
    for mi, m in enumerate(masks):
        for ti, t in enumerate(m.terms):
            table[mi, ti] = torch.tensor(t.as_row(), dtype=torch.int32)
    counts = torch.tensor([len(m.terms) for m in masks] or [0], dtype=torch.int32)
    return table.to(device), counts.to(device)

