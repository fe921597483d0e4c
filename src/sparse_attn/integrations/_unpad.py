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

import torch


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where a ``[B, Lq]`` query / ``[B, Lk]`` key batch's real sequences lie, one entry per sequence
    kept (rows without a real query are left out; their outputs are zeros).

    :attr:`cu_q` / :attr:`cu_k`: int32 ``[S + 1]`` offsets on the CPU (varlen_attention reads CPU offsets without
    a sync), the caller's (``given_cu``) or made from the lengths when first asked for (a padded batch read in place
    never needs them). A padded batch (``rows`` not None) also names each sequence's batch row and the positions of
    its first query (among the call's ``q_len`` queries) and first key (among its ``kv_len`` keys); a packed batch
    (``rows`` None) is the whole batch in order."""

    batch: int
    q_len: int
    kv_len: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    q_starts: tuple[int, ...] = ()
    k_starts: tuple[int, ...] = ()
    given_cu: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, compare=False)
    # what was built from the above on a device, once for every layer of the forward (the Packing is the
    # forward's: _packing_for finds it again for each layer)
    _built: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k(self) -> int:
        return max(self.k_lens, default=0)

    @property
    def cu_q(self) -> torch.Tensor:
        return self._offsets()[0]

    @property
    def cu_k(self) -> torch.Tensor:
        return self._offsets()[1]

    def _offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.given_cu is not None:
            return self.given_cu
        return self._once(("cu",), lambda: (_offsets(self.q_lens), _offsets(self.k_lens)))

    def _once(self, key: tuple, build):
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def token_ranges(self, keys: bool, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each packed query (``keys``: key) token's batch row and position, int64 ``[T]`` on ``device`` in packed
        order; None when the packed tokens are the whole batch in order (not padded)."""
        if self.rows is None:
            return None
        starts, lens = (self.k_starts, self.k_lens) if keys else (self.q_starts, self.q_lens)
        return self._once(("ranges", keys, str(device)), lambda: _ranges(list(self.rows), list(starts), list(lens),
                                                                          device))

    def pack(self, t: torch.Tensor, keys: bool) -> torch.Tensor:
        """``[B, H, L, D]`` -> packed ``[T, H, D]`` (the sequences' tokens, back to back; one copy)."""
        tokens = t.transpose(1, 2)  # [B, L, H, D], a view
        ranges = self.token_ranges(keys, t.device)
        if ranges is None:
            return tokens.reshape(-1, *tokens.shape[2:]).contiguous()
        return tokens[ranges]

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """Packed output ``[Tq, H, Dv]`` -> ``[B, Lq, H, Dv]``, zeros at the queries no sequence holds."""
        ranges = self.token_ranges(False, out.device)
        if ranges is None:
            return out.view(self.batch, self.q_len, *out.shape[1:])
        full = out.new_zeros(self.batch, self.q_len, *out.shape[1:])
        return full.index_put(ranges, out)

    def pairs_on(self, device, q_row_tokens: int, k_row_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's (first, one past the last) query and key token, int32 ``[2 S]`` on ``device`` (the
        kernels' SEQ_STEP 2 bounds), in token spaces where batch row ``b``'s position ``i`` is token
        ``b * row_tokens + i`` (:func:`token_view`). Padded batches only; one copy for every layer."""
        def build():
            pairs = []
            for row, qs, nq in zip(self.rows, self.q_starts, self.q_lens):
                pairs += (row * q_row_tokens + qs, row * q_row_tokens + qs + nq)
            n = len(pairs)
            pairs += [0] * (-n % 4)  # the key pairs start 16 bytes in (varlen._to_device_aligned's reason)
            k0 = len(pairs)
            for row, ks, nk in zip(self.rows, self.k_starts, self.k_lens):
                pairs += (row * k_row_tokens + ks, row * k_row_tokens + ks + nk)
            # one copy, through pinned memory to CUDA (asynchronous; not offsets_on's cache: built once a forward)
            flat = torch.tensor(pairs, dtype=torch.int32)
            flat = flat.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else \
                flat.to(device)
            return flat[:n], flat[k0:]
        return self._once(("pairs", str(device), q_row_tokens, k_row_tokens), build)

    def free_queries_on(self, device) -> torch.Tensor | None:
        """bool ``[B * Lq, 1, 1]`` on ``device``, True at the queries no sequence holds (padding; a padded batch's
        rows as its ``[B, Lq]`` tokens); None when every query is a sequence's."""
        if self.rows is None or sum(self.q_lens) == self.batch * self.q_len:
            return None

        def build():
            free = torch.ones(self.batch * self.q_len, 1, 1, dtype=torch.bool)
            for row, qs, nq in zip(self.rows, self.q_starts, self.q_lens):
                free[row * self.q_len + qs:row * self.q_len + qs + nq] = False
            return free.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else \
                free.to(device)
        return self._once(("free", str(device)), build)


def token_view(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``[B, H, L, D]`` (unit stride in D) as tokens ``[T, H, D]``, without a copy: row ``b``'s position ``i`` is
    token ``b * r + i``, where ``r`` is the batch stride in token strides. Returns (the view, ``r``), or None
    where the strides do not allow it (the batch stride not a multiple of the token stride), or where token
    indices would pass int32. A KV cache ``[B, Hkv, L, D]`` gives ``r = Hkv * L`` (its rows' tokens, heads
    apart, interleave: the view's T covers them all, the kernels read only the pairs' ranges); a query
    ``[B, Lq, H, D]`` in memory gives ``r = Lq``."""
    B, H, L, D = t.shape
    sb, sh, sl, sd = t.stride()
    if L == 1:  # one token a row (a decoding step's query): its stride is free, so the batch stride numbers rows
        sl = sb if B > 1 else 1
    if sd != 1 or sl <= 0 or B == 0 or L == 0:
        return None
    r = L if B == 1 else sb // sl
    if B > 1 and (sb % sl or r < L):
        return None
    tokens = (B - 1) * r + L
    if tokens >= 2 ** 31:
        return None
    return t.as_strided((tokens, H, D), (sl, sh, 1)), r


def _copied_token_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`token_view` of a copy of ``t`` in ``[B, L, H, D]`` memory (``r = L``), for a tensor it cannot place
    as it is."""
    return token_view(t.transpose(1, 2).contiguous().transpose(1, 2))


def in_place(packing: Packing, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
             window: int | None = None, num_sink: int = 0, scale: float | None = None) -> torch.Tensor | None:
    """A padded batch's dense, causal or causal-window attention read and written where the batch lies: no
    gathers of its real tokens and no scatter of the output (what :meth:`Packing.pack` / :meth:`Packing.unpack`
    cost each layer). query ``[B, Hq, Lq, D]``, key / value ``[B, Hkv, Lk, D]`` -> ``[B, Lq, Hq, D]``, zeros at
    the queries no sequence holds; each sequence as :func:`sparse_attn.varlen_attention` runs it on its packed
    tokens (the kernels' device plan over (start, end) token pairs). None where that plan does not run (the
    CPU, gradients, a torch.compile trace): the caller packs then. A query or key / value that
    :func:`token_view` cannot place is copied once to ``[B, L, H, D]``. A decoding step's later layers (one
    geometry on one batch) run what its first layer launched, directly (ops.block_sparse.entry; kept on the
    Packing, which is the step's); its first layer runs the previous step's launches rewritten for this step's cache
    length, where they show to be the path's (entry.derive_pairs)."""
    from .. import api
    from ..ops.block_sparse import entry
    if packing.rows is None or not api._varlen_device_plan(query, key, value, None, None, None):
        return None
    entry_key = entry.key(query, key, value, causal, scale, False, window, num_sink)
    kept = None if entry_key is None else packing._built.get(("entry", entry_key))
    if kept is not None:  # a decoding step's later layer: the first one's launches, nothing else
        out = _run_kept(kept, query, key, value)
        if out is not None:
            return out
    views = _token_views(query, key, value)
    q_pairs, k_pairs = packing.pairs_on(query.device, views[1], views[3])
    free = packing.free_queries_on(query.device)
    q, _, k, _, v = views
    family = None
    if entry_key is not None and (q.data_ptr(), k.data_ptr(), v.data_ptr()) == (
            query.data_ptr(), key.data_ptr(), value.data_ptr()):  # views, not copies: as_strided makes them again
        family = entry.pairs_family(entry_key, q_pairs, k_pairs, packing.max_q, packing.max_k)
        # a step's first layer: the previous step's launches, rewritten for this cache length (the pairs are inputs)
        learnt = entry.derive_pairs(family, (q, k, v), packing.max_k)
        out = None if learnt is None else entry.run_pairs(learnt, (q, k, v), q_pairs, k_pairs)
        if out is not None:
            _remember(packing, entry_key, learnt, (q, k, v), q_pairs, k_pairs, free)
            return _unpacked(out, free, query)
    out = _run_pairs(query, views, q_pairs, k_pairs, packing.max_q, packing.max_k, free, causal, window, num_sink,
                     scale)
    if family is not None:
        learnt = entry.learn_pairs((q, k, v), q_pairs, k_pairs, family)
        if learnt is not None:
            _remember(packing, entry_key, learnt, (q, k, v), q_pairs, k_pairs, free)
    return out


def _remember(packing: Packing, entry_key: tuple, learnt, views: tuple, q_pairs: torch.Tensor, k_pairs: torch.Tensor,
              free: torch.Tensor | None) -> None:
    """Keep on the step's Packing what the step's later layers of this geometry run (:func:`_run_kept`): the learnt
    launches, the token views' sizes and strides, the pairs and the free queries."""
    placed = tuple((tuple(t.shape), t.stride()) for t in views)
    packing._built["entry", entry_key] = (learnt, placed, q_pairs, k_pairs, free)


def _run_kept(kept: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """:func:`in_place` through what its first call of this geometry on this batch learnt (ops.block_sparse.entry):
    the same token views (the geometry fixes them), pairs and launches; None where the recipe is gone."""
    from ..ops.block_sparse import entry
    learnt, placed, q_pairs, k_pairs, free = kept
    views = tuple(t.as_strided(*p) for t, p in zip((query, key, value), placed))
    out = entry.run_pairs(learnt, views, q_pairs, k_pairs)
    return None if out is None else _unpacked(out, free, query)


def row_spans(mask: torch.Tensor, lq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A padded batch's sequences read off ``mask`` (as :func:`from_padding` takes it) with tensor ops on its device,
    no host read (traced once a compiled step for every layer). Returns ``spans`` int32 ``[B, 5]``: each row's real
    queries (first, one past the last, among the call's ``lq``), its keys (first, one past the last) and the row
    index, empty query ranges at rows without a real query (:func:`in_place_spans` runs them); ``drop`` bool ``[B * lq, 1, 1]``, True at the queries no
    row holds; ``fill`` (``dtype``, same shape) what those get: 0, or NaN in a row whose real tokens are not one
    run or whose mask function was refused (:data:`REFUSED`), which from_padding refuses by name (refusing here would
    need the host to read the mask)."""
    batch = mask.shape[0]
    first, end, count, q_end = _row_bounds(mask)
    q0 = q_end - lq  # the position of query 0: lq slots before the first unwritten one
    broken = (count > 0) & (end - first != count)
    if mask.dtype == torch.int8:  # key states (a bool padding mask refuses nothing)
        broken = broken | (mask == REFUSED).any(1)
    q_first = torch.maximum(first, q0)
    held = (count > 0) & (end > q_first) & ~broken  # rows whose real queries run
    rows = torch.arange(batch, device=mask.device)
    spans = torch.stack([q_first - q0, end - q0, first, end], 1) * held[:, None]
    spans = torch.cat([spans, rows[:, None]], 1).to(torch.int32)
    i = torch.arange(lq, device=mask.device)
    drop = ~((i >= spans[:, :1]) & (i < spans[:, 1:2]))
    fill = torch.where(broken, float("nan"), 0.0).to(dtype)[:, None].expand(batch, lq)
    return spans, drop.reshape(batch * lq, 1, 1), fill.reshape(batch * lq, 1, 1)


def _row_bounds(mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's first real token, one past its last, and its count (int64 ``[B]``), and one past the last written
    slot (a 0-dim tensor: the key states' first -1, else ``Lk``) of a padding mask as :func:`from_padding` takes it."""
    real = mask > 0
    pos = torch.arange(real.shape[1], device=mask.device)
    first = torch.where(real, pos, real.shape[1]).amin(1)
    end = torch.where(real, pos + 1, 0).amax(1)
    return first, end, real.sum(1), (mask >= 0).sum(1).amax()


def in_place_spans(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: torch.Tensor,
                   drop: torch.Tensor, fill: torch.Tensor, *, causal: bool, window: int | None = None,
                   num_sink: int = 0, scale: float | None = None) -> torch.Tensor:
    """:func:`in_place` over the rows' :func:`row_spans`: two small additions number them in the token views (the
    pairs), then the kernels' device plan (``max_q`` / ``max_k`` the call's ``Lq`` / ``Lk``), then one select writes
    ``fill`` at the ``drop`` queries; ``[B, Lq, Hq, Dv]``. A few kernels, no host read."""
    views = _token_views(query, key, value)
    q_row, k_row = views[1], views[3]
    q_pairs = torch.add(spans[:, 0:2], spans[:, 4:5], alpha=q_row).flatten()
    k_pairs = torch.add(spans[:, 2:4], spans[:, 4:5], alpha=k_row).flatten()
    out = _run_pairs(query, views, q_pairs, k_pairs, query.shape[2], key.shape[2], None, causal, window, num_sink,
                     scale)
    return torch.where(drop.view(out.shape[0], out.shape[1], 1, 1), fill.view(out.shape[0], out.shape[1], 1, 1), out)


def _token_views(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple:
    """(q, q_row, k, k_row, v): :func:`token_view` of each, with the query's ``r`` its ``Lq`` (the output shares its
    token numbers: ``[B * Lq, Hq, D]``) and one ``r`` for key and value (one set of key pairs); a tensor that cannot
    be placed so is copied first."""
    from ..validation import check_qkv
    check_qkv(query, key, value)  # the views below then hold the same dtypes, devices, heads and head dims
    q_view = token_view(query)
    if q_view is None or q_view[1] != query.shape[2]:
        q_view = _copied_token_view(query)
    kv = token_view(key), token_view(value)
    if kv[0] is None or kv[1] is None or kv[0][1] != kv[1][1]:
        kv = _copied_token_view(key), _copied_token_view(value)
    (q, q_row), (k, k_row), (v, _) = q_view, *kv
    return q, q_row, k, k_row, v


def _run_pairs(query: torch.Tensor, views: tuple, q_pairs: torch.Tensor, k_pairs: torch.Tensor, max_q: int, max_k: int,
               free: torch.Tensor | None, causal: bool, window: int | None, num_sink: int,
               scale: float | None) -> torch.Tensor:
    """The device plan over the pairs in the token views, zeros at the ``free`` queries: ``[B, Lq, Hq, Dv]``."""
    from ..ops.block_sparse import varlen_device_plan_op
    q, _, k, _, v = views
    out = varlen_device_plan_op(q, k, v, q_pairs, k_pairs, max_q, max_k, causal, scale=scale, window=window,
                                num_sink=num_sink, seq_step=2)
    return _unpacked(out, free, query)


def _unpacked(out: torch.Tensor, free: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The kernels' ``[B * Lq, Hq, Dv]`` over the query's token view as ``[B, Lq, Hq, Dv]``, zeros at the ``free``
    queries (the kernels write only the pairs')."""
    if free is not None:
        out.masked_fill_(free, 0.0)
    return out.view(query.shape[0], query.shape[2], *out.shape[1:])


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


# Key states (the int8 [B, Lk] the mask interface gives for keys that do not simply end at the last query): 0 is
# padding, and
REAL = 1        # a real key of a buffer whose slot 0 is token 0
SHIFTED = 2     # a real key of a buffer that dropped its first keys (a sliding-window cache rolled past token 0),
                # so that patterns placed by position refuse it even when the mask was copied or made while traced
UNWRITTEN = -1  # a slot of a static cache's buffer at or after the last query's
REFUSED = -2    # every slot of a row whose mask function allows other keys than the one sparse_attn runs (found
                # while traced, where nothing can raise): the row's outputs are NaN, and read on the host it raises


def key_states(padding: torch.Tensor | None, batch: int, kv_length: int, q_end, device, shifted=False,
               refused: torch.Tensor | None = None) -> torch.Tensor:
    """The mask interface's int8 ``[B, Lk]`` for keys that run past the last query (a static cache's buffer) or that
    start past token 0 (a sliding-window buffer that rolled): :data:`REAL` (1; :data:`SHIFTED`, 2, where ``shifted``)
    a real key, 0 padding, :data:`UNWRITTEN` (-1) the slots from ``q_end`` on (one past the last query among the
    keys: an int, or a 0-dim tensor while torch.compile traces, which the attention function reads on the device),
    and :data:`REFUSED` (-2) every slot of the rows where ``refused`` (bool ``[B]``) is true.
    ``padding``: ``[B, Lk]`` nonzero at real tokens, or None (all real)."""
    written = torch.arange(kv_length, device=device) < q_end
    real = written if padding is None else padding.to(device=device, dtype=torch.bool) & written
    states = torch.where(written, real.to(torch.int8) * (SHIFTED if shifted else REAL), UNWRITTEN)
    states = states.expand(batch, kv_length)
    if refused is not None:
        states = torch.where(refused.to(device)[:, None], REFUSED, states)
    return states


def call_padding(attention_mask: torch.Tensor, kv_length: int, kv_offset) -> torch.Tensor:
    """The ``[B, kv_length]`` padding of a call's keys (tokens ``kv_offset`` on) from a 2-D attention mask: a whole
    sequence's mask, from token 0, is cut there; one exactly ``kv_length`` wide while ``kv_offset`` > 0 already is
    the call's keys (a whole sequence's would be wider): the mask interface's own answer, which generate() hands the
    model back and the model makes its masks again from. Cut again, it would be one slot off a rolled buffer."""
    from transformers.masking_utils import prepare_padding_mask
    if kv_offset and attention_mask.shape[-1] == kv_length:
        return attention_mask
    return prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]


def key_states_of(mask) -> torch.Tensor | None:
    """The ``[B, Lk]`` key states ``mask`` holds: itself for a 2-D int8 mask, the ``[B, 1, 1, Lk]`` int8 container
    the mask interface gives a sliding-window layer's replayed step viewed as ``[B, Lk]`` (4-D, so that the model's
    own mask call passes it through: made again from a 2-D mask it would read the cache's offsets, Python ints,
    into the compiled step, which then records a CUDA graph at every step); None for any other mask."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int8:
        return None
    if mask.dim() == 2:
        return mask
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        return mask[:, 0, 0]
    return None


def shifted(mask) -> bool:
    """Whether ``mask`` holds key states of a buffer that dropped its first keys (:data:`SHIFTED`). A host read,
    for masks the registry does not know (made while traced, or copied)."""
    states = key_states_of(mask)
    return states is not None and bool((states == SHIFTED).any())


def from_padding(mask: torch.Tensor, q_len: int) -> Packing | None:
    """The sequences of a padded batch. ``mask``: ``[B, Lk]`` over the call's keys, positive at a real token, zero
    at padding, and negative at a static cache's slots not written yet (:func:`key_states`), which come after the
    last query; the queries are the ``q_len`` key positions before the first such slot (else before ``Lk``:
    bottom-right). Each row's real tokens must be one contiguous run (left and / or right padding); None when
    no row has padding. A few reductions and one or two host reads (:func:`_read_rows`)."""
    batch, width = mask.shape
    if width == 0:
        return None
    firsts, counts, pos_sums, q_ends, refuses = _read_rows(mask)
    if any(refuses):
        raise NotImplementedError(
            f"sparse_attn: the mask of row {[bool(r) for r in refuses].index(True)} was made by a sliding-window mask "
            "function that allows other keys than the layer's window (a mask function combined with others, found "
            "while torch.compile traced the model); sparse_attn runs the window alone: run the model uncompiled, or "
            "use attn_implementation='sdpa' for it")
    kv_len = max(q_ends)  # the keys the queries see: a static cache's slots after the last query are no keys yet
    if kv_len == width and all(c == width for c in counts):
        return None
    q0 = kv_len - q_len  # the position of query 0
    rows, q_starts, q_lens, k_starts, k_lens = [], [], [], [], []
    for row, (s, c, total) in enumerate(zip(firsts, counts, pos_sums)):
        # c distinct positions from s on sum to at least c * s + c (c - 1) / 2, exactly when they are s..s + c - 1
        if c and total != c * s + c * (c - 1) // 2:
            last = int(torch.where(mask[row] > 0, torch.arange(width, device=mask.device), -1).amax())
            raise NotImplementedError(
                f"sparse_attn: attention_mask row {row} has padding between real tokens ({c} real tokens spread "
                f"over positions {s}..{last}); only left or right padding (one run of real tokens a row) is "
                "supported: for generation pad on the left (tokenizer.padding_side='left')")
        e = s + c
        qs = max(s, q0)
        if c and e > qs:  # a row with no real query contributes nothing (its outputs are zeros)
            rows.append(row)
            q_starts.append(qs - q0)
            q_lens.append(e - qs)
            k_starts.append(s)
            k_lens.append(c)
    return Packing(batch, q_len, kv_len, tuple(q_lens), tuple(k_lens), tuple(rows), tuple(q_starts), tuple(k_starts))


def _read_rows(mask: torch.Tensor) -> tuple[list, list, list, list, list]:
    """Each row's first real token (0 in a row without one), real-token count and sum of real positions, one past its
    last written slot (:data:`UNWRITTEN` slots come last; ``Lk`` in a bool mask) and its :data:`REFUSED` slots. A bool
    mask is read in two steps: its counts (one reduction and a host read, all a batch without padding costs, as a
    check of ``mask.all()`` did), then, where some row is padded, its first tokens and position sums (a second read,
    with the GPU idle since the first); any other mask in one read after ten small reductions."""
    batch, width = mask.shape
    if mask.dtype == torch.bool:
        counts = mask.sum(1).tolist()
        if all(c == width for c in counts):
            return [0] * batch, counts, [width * (width - 1) // 2] * batch, [width] * batch, [0] * batch
        pos = torch.arange(width, device=mask.device)
        firsts, pos_sums = torch.stack([mask.view(torch.uint8).argmax(1), (mask * pos).sum(1)]).tolist()
        return firsts, counts, pos_sums, [width] * batch, [0] * batch
    real, pos = mask > 0, torch.arange(width, device=mask.device)
    parts = [real.view(torch.uint8).argmax(1), real.sum(1), (real * pos).sum(1), (mask >= 0).sum(1),
             (mask == REFUSED).sum(1)]
    return tuple(torch.stack(parts).tolist())


def from_segments(bounds: list[list[int]], length: int) -> Packing:
    """The sequences of a packed batch: row ``b`` holds sequences ``[bounds[b][i], bounds[b][i + 1])``
    (each row's bounds run from 0 to ``length``), queries and keys alike."""
    lens = tuple(e - s for row in bounds for s, e in itertools.pairwise(row))
    return Packing(len(bounds), length, length, lens, lens)


def from_offsets(cu_q: torch.Tensor, cu_k: torch.Tensor, q_len: int, kv_len: int) -> Packing:
    """The sequences that ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (FlashAttention's keyword arguments, which
    transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives) name in a batch of
    one row. Read on the host once; varlen_attention checks them."""
    cq, ck = (c.detach().to("cpu", torch.int32) for c in (cu_q, cu_k))
    lens, klens = (tuple(b - a for a, b in itertools.pairwise(v)) for v in (cq.tolist(), ck.tolist()))
    return Packing(1, q_len, kv_len, lens, klens, given_cu=(cq, ck))


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
