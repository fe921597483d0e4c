"""Padded and packed ``transformers`` batches as one :func:`sparse_attn.varlen_attention` call.

A padded batch (a ``[B, Lk]`` attention_mask with zeros: left padding in ``generate()``, right padding in
training) and a packed one (several sequences in a row, ``position_ids`` restarting at 0: padding-free
training) both become the list of their real sequences. Each runs as if it were called alone: causal
bottom-right aligned within it, the layer's pattern and the model's sliding window counted from its own
first token. That is what a forward of each sequence unpadded and unpacked computes, which is what the
padding and packing masks ask for wherever a pattern is position-free (dense, causal, a window) and
the only reading under which a padded row's result does not depend on its padding for the others.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where a ``[B, Lq]`` query / ``[B, Lk]`` key batch's real sequences lie, one entry per sequence
    kept (rows without a real query are left out; their outputs are zeros).

    ``q_rows`` / ``q_pos`` (int64 ``[Tq]`` on the batch's device): each packed query token's batch row and
    position, in packed order; None when the packed queries are the whole batch in order (packed
    sequences, no padding). The same for keys. ``cu_q`` / ``cu_k``: int32 ``[S + 1]`` offsets on the CPU
    (varlen_attention reads CPU offsets without a sync)."""

    batch: int
    q_len: int
    kv_len: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    q_rows: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k(self) -> int:
        return max(self.k_lens, default=0)

    def pack(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        """``[B, H, L, D]`` -> packed ``[T, H, D]`` (the sequences' tokens, back to back; one copy)."""
        rows, pos = (self.k_rows, self.k_pos) if keys else (self.q_rows, self.q_pos)
        tokens = t.transpose(1, 2)  # [B, L, H, D], a view
        if rows is None:
            return tokens.reshape(-1, *tokens.shape[2:]).contiguous()
        return tokens[rows, pos]

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """Packed output ``[Tq, H, Dv]`` -> ``[B, Lq, H, Dv]``, zeros at the queries no sequence holds."""
        if self.q_rows is None:
            return out.view(self.batch, self.q_len, *out.shape[1:])
        full = out.new_zeros(self.batch, self.q_len, *out.shape[1:])
        return full.index_put((self.q_rows, self.q_pos), out)


def _offsets(lens) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _ranges(rows: list[int], starts: list[int], lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) int64 ``[sum(lens)]`` of the token ranges ``[start, start + len)`` of ``rows``,
    back to back, built on ``device`` from three small host lists (no per-token host work)."""
    total = sum(lens)
    n = torch.tensor(lens, dtype=torch.int64).to(device, non_blocking=True)
    first = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
    row = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), n, output_size=total)
    begin = torch.cumsum(n, 0) - n  # each range's first packed index
    pos = torch.arange(total, device=device) - begin[seq] + first[seq]
    return row[seq], pos


def from_padding(mask: torch.Tensor, q_len: int, q_end: int | None = None) -> Packing | None:
    """The sequences of a padded batch. ``mask``: ``[B, Lk]`` (nonzero: a real token) over the call's
    keys; the queries are the ``q_len`` key positions before ``q_end`` (default ``Lk``: bottom-right; less
    in a static cache's buffer, whose later slots are not keys yet). Each row's real tokens must be one
    contiguous run (left and / or right padding); None when no row has padding. One host read of three
    numbers a row."""
    cut = q_end is not None and q_end < mask.shape[1]  # keys past the queries: a static cache's unwritten slots
    real = mask[:, :q_end].bool() if cut else mask.bool()
    batch, kv_len = real.shape
    if kv_len == 0:
        return None
    pos = torch.arange(kv_len, device=real.device)
    first = torch.where(real, pos, kv_len).amin(1)
    end = torch.where(real, pos + 1, 0).amax(1)
    firsts, ends, counts = torch.stack([first, end, real.sum(1)]).tolist()
    if not cut and all(c == kv_len for c in counts):
        return None
    q0 = kv_len - q_len  # the position of query 0
    rows, q_starts, q_lens, k_starts, k_lens = [], [], [], [], []
    for row, (s, e, c) in enumerate(zip(firsts, ends, counts)):
        if c and e - s != c:
            raise NotImplementedError(
                f"sparse_attn: attention_mask row {row} has padding between real tokens ({c} real tokens spread "
                f"over positions {s}..{e - 1}); only left or right padding (one run of real tokens a row) is "
                "supported: for generation pad on the left (tokenizer.padding_side='left')")
        qs = max(s, q0)
        if c and e > qs:  # a row with no real query contributes nothing (its outputs are zeros)
            rows.append(row)
            q_starts.append(qs - q0)
            q_lens.append(e - qs)
            k_starts.append(s)
            k_lens.append(e - s)
    q_rows, q_pos = _ranges(rows, q_starts, q_lens, real.device)
    k_rows, k_pos = _ranges(rows, k_starts, k_lens, real.device)
    return Packing(batch, q_len, kv_len, tuple(q_lens), tuple(k_lens), _offsets(q_lens), _offsets(k_lens),
                   q_rows, q_pos, k_rows, k_pos)


def from_segments(bounds: list[list[int]], length: int) -> Packing:
    """The sequences of a packed batch: row ``b`` holds sequences ``[bounds[b][i], bounds[b][i + 1])``
    (each row's bounds run from 0 to ``length``), queries and keys alike."""
    lens = tuple(e - s for row in bounds for s, e in itertools.pairwise(row))
    cu = _offsets(lens)
    return Packing(len(bounds), length, length, lens, lens, cu, cu)


def from_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, q_len: int, kv_len: int) -> Packing:
    """The sequences that ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (FlashAttention's keyword arguments, which
    transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives) name in a batch of
    one row. Read on the host once; varlen_attention checks them."""
    cq, ck = (c.detach().to("cpu", torch.int32) for c in (cu_q, cu_k))
    lens, klens = (tuple(b - a for a, b in itertools.pairwise(v)) for v in (cq.tolist(), ck.tolist()))
    return Packing(1, q_len, kv_len, lens, klens, cq, ck)


def segments(batch: int, length: int, mask_function, device) -> list[list[int]] | None:
    """Candidate sequence bounds of a packed batch, read off ``mask_function`` at the pairs (i, i - 1): a
    token that may not see the one before it starts a sequence. One evaluation a token (the caller
    verifies the whole mask against these bounds). None when the function does not take index tensors."""
    if length < 2:
        return [[0, length] if length else [0] for _ in range(batch)]
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, device=device, dtype=torch.long)[None, :, None, None]
    q = torch.arange(1, length, device=device)[None, None, :, None]
    try:
        linked = mask_function(b, h, q, q - 1)
        linked = torch.as_tensor(linked, device=device).bool().expand(batch, 1, length - 1, 1)
    except Exception:  # noqa: BLE001 -- a mask function written for scalar (vmap) calls: not a packed batch we read
        return None
    bounds = [[0] for _ in range(batch)]
    for row, i in (~linked[:, 0, :, 0]).nonzero().tolist():  # the starts only: a few numbers, not a bool a token
        bounds[row].append(i + 1)
    return [row + [length] for row in bounds]


def token_spans(bounds: list[list[int]], length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token, one past the last token) of the sequence each token belongs to, int64 ``[B, length]``."""
    first = torch.zeros(len(bounds), length, dtype=torch.int64)
    end = torch.zeros(len(bounds), length, dtype=torch.int64)
    for r, row in enumerate(bounds):
        for s, e in itertools.pairwise(row):
            first[r, s:e] = s
            end[r, s:e] = e
    return first.to(device), end.to(device)


class LastOne:
    """The value built for the last key object seen (a mask, an offsets tensor), while that same object,
    unchanged in place, comes back: every layer of a forward gets the same mask, so it is read once a
    forward, not once a layer. Inference tensors have no version counter: never remembered."""

    def __init__(self):
        self._entry: tuple | None = None  # (weakref to the object, signature, value)

    def get(self, obj: torch.Tensor, signature: tuple, build):
        try:
            sig = signature + (obj._version,)
        except RuntimeError:
            return build()
        if self._entry is not None and self._entry[0]() is obj and self._entry[1] == sig:
            return self._entry[2]
        value = build()
        self._entry = (weakref.ref(obj), sig, value)
        return value
