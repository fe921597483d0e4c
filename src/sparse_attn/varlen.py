"""Variable-length (packed) attention: validation, per-sequence layouts, the reference path.

Packed tensors are ``[total_tokens, H, D]``; sequence b owns tokens ``cu_seqlens[b]:cu_seqlens[b+1]``.
Each sequence gets its own layout, built for its own lengths (so causal and window masks stay
bottom-right aligned per sequence); the kernels see them stacked along the batch dimension.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import patterns
from .layout import BlockLayout, LayoutError, _Coo, as_int
from .plan_cache import LastOne
from .validation import capturing, check_not_capturing

PatternFn = Callable[[int, int], BlockLayout]


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, device,
                     plan_on_device: bool = False) -> list[int] | None:
    """Return the per-sequence lengths after checking ``cu`` (int32 [B + 1], 0 .. total, non-decreasing).
    Inside a CUDA graph capture the values cannot be read: a call whose kernels plan on the device
    (``plan_on_device``, api.varlen_attention) gets None after the checks that need no values; any other
    call is refused."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D int32 tensor [num_seqs + 1], got {got}")
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"{name} is on {cu.device} but q is on {device}: pass it on {device} or on the CPU")
    if plan_on_device and capturing(torch.device(device)):
        _check_unread(name, cu, max_seqlen, device)
        return None
    # q's device, not cu's: offsets on the CPU are read without a sync, but a replay would keep the plan too
    check_not_capturing("varlen_attention", torch.device(device), f"it reads {name} on the host to plan each "
                        "sequence's layout, and a replay would keep that plan whatever lengths the tensor then holds",
                        "Capture only forward-only calls without layouts, pattern or quant (dense or causal: their "
                        "kernels plan from the offsets on the GPU), call it eagerly, or capture attention() on a "
                        "padded [B, H, L, D] batch.")
    vals = cu.tolist()
    if len(vals) < 2:
        raise ValueError(f"{name} must hold num_seqs + 1 >= 2 offsets (start 0, end {total}), got {vals}")
    if vals[0] != 0 or vals[-1] != total:
        shown = vals if len(vals) <= 6 else f"{vals[:3]}...{vals[-2:]}"
        raise ValueError(f"{name} must start at 0 and end at the number of packed tokens ({total}), got {shown}")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if min(lens) < 0:
        i = min(range(len(lens)), key=lens.__getitem__)
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={vals[i]} > {name}[{i + 1}]={vals[i + 1]}")
    if as_int(max_seqlen) is None:
        raise TypeError(f"max_seqlen for {name} must be an int >= the longest sequence ({max(lens)} tokens), got "
                        f"{type(max_seqlen).__name__} {max_seqlen!r}; e.g. int(({name}[1:] - {name}[:-1]).max())")
    if max(lens) > max_seqlen:
        raise ValueError(f"max_seqlen for {name} is {max_seqlen} but a sequence has {max(lens)} tokens")
    return lens


def _check_unread(name: str, cu: torch.Tensor, max_seqlen: int, device) -> None:
    """check_cu_seqlens inside a CUDA graph capture, for kernels that plan on the device: what needs no
    value. The values are the caller's promise there (a replay reads whatever the tensor then holds): the
    kernels keep every access inside the packed tensors, but a sequence longer than ``max_seqlen`` would
    leave its rows past that unwritten."""
    if cu.device != torch.device(device):
        raise ValueError(f"{name} is on {cu.device}: inside CUDA graph capture pass it on {device} (a replay "
                         "reads the offsets the tensor then holds; a copy from host memory would be frozen)")
    if cu.numel() < 2:
        raise ValueError(f"{name} must hold num_seqs + 1 >= 2 offsets, got {cu.numel()}")
    if as_int(max_seqlen) is None or max_seqlen < 0:
        raise TypeError(f"max_seqlen for {name} must be an int >= the longest sequence, got "
                        f"{type(max_seqlen).__name__} {max_seqlen!r}")


def check_layout_args(layouts, pattern, n: int, unit: str = "sequence") -> None:
    """layouts= (a list of ``n``, one per ``unit``) or pattern= (a function), not both; errors say
    what to pass instead of the usual slips (one BlockLayout, a pattern name)."""
    if layouts is not None and pattern is not None:
        raise ValueError("give either layouts= or pattern=, not both")
    if pattern is not None and not callable(pattern):
        # a name ("local") or one BlockLayout is the usual slip: a layout is built per sequence length
        hint = (f"pass layouts=[one BlockLayout per {unit}]" if isinstance(pattern, BlockLayout) else
                "e.g. pattern=lambda lq, lk: patterns.local(lq, 256, kv_len=lk)")
        raise TypeError(f"pattern must be a function (q_len, kv_len) -> BlockLayout, called once per {unit}, "
                        f"got {type(pattern).__name__} {pattern!r:.60}: {hint}")
    if layouts is not None:
        if isinstance(layouts, BlockLayout) or not isinstance(layouts, (list, tuple)):
            raise TypeError(f"layouts must be a list with one BlockLayout per {unit}, got {type(layouts).__name__}"
                            f" (for one pattern over every {unit}, pass pattern=lambda lq, lk: ...)")
        if len(layouts) != n:
            raise LayoutError(f"got {len(layouts)} layouts for {n} {unit}s: give one per {unit}"
                              + (" (None for an empty group)" if unit == "group" else ""))
        check_same_blocks(layouts, unit)


def check_same_blocks(layouts, unit: str, source: str = "layout") -> None:
    """Every BlockLayout among ``layouts`` has the same block_q x block_k. The CPU path runs them one by
    one and would accept mixed sizes; the kernels cannot, so code tried on the CPU would fail on a GPU."""
    blocks = sorted({(lay.block_q, lay.block_k) for lay in layouts if isinstance(lay, BlockLayout)})
    if len(blocks) > 1:
        raise LayoutError(f"every {unit}'s {source} must have the same block_q x block_k (one launch runs them "
                          f"all), got {' and '.join(f'{q}x{k}' for q, k in blocks)}: build them with the same "
                          "block_q=, block_k=")


def build_layouts(q_lens: Sequence[int], k_lens: Sequence[int], layouts: Sequence[BlockLayout] | None,
                  pattern: PatternFn | None, causal: bool, block: int = 128, *,
                  heads: int | None = None, unit: str = "sequence", names: Sequence[int] | None = None
                  ) -> list[BlockLayout]:
    """One layout per sequence: given, produced by ``pattern(q_len, kv_len)`` (once per distinct
    shape: it must be a pure function of them), or dense/causal. ``heads`` (the query heads) is
    checked against each layout's heads (1 or heads). ``unit`` and
    ``names`` (each entry's index as the caller numbers them) are for the error messages."""
    check_layout_args(layouts, pattern, len(q_lens), unit)
    source = "layout (from pattern=)" if pattern is not None else "layout"
    if layouts is None:
        if pattern is None:
            builder = patterns.causal if causal else patterns.dense
            pattern = lambda lq, lk: builder(lq, lk, block_q=block, block_k=block)  # noqa: E731
            causal = False
        per_shape: dict = {}
        for shape in zip(q_lens, k_lens):
            if shape not in per_shape:
                per_shape[shape] = pattern(*shape)
        layouts = [per_shape[shape] for shape in zip(q_lens, k_lens)]
    names = range(len(q_lens)) if names is None else names
    checked = [check_unit_layout(lay, lq, lk, heads, unit, i) for lay, lq, lk, i in zip(layouts, q_lens, k_lens, names)]
    check_same_blocks(checked, unit, source)
    return [patterns.causal_cut(lay) if causal else lay for lay in checked]


def check_unit_layout(lay, lq: int, lk: int, heads: int | None, unit: str, i: int) -> BlockLayout:
    """One sequence's (group's) layout: a validated batch-1 BlockLayout built for ``(lq, lk)`` with 1 or
    ``heads`` heads."""
    if not isinstance(lay, BlockLayout):
        raise TypeError(f"layout {i} must be a BlockLayout, got {type(lay).__name__}")
    # attention() refuses a transpose() too: its masks keep the original frame (wrong inside partial blocks)
    lay.check_token_frame(f"{'varlen' if unit == 'sequence' else 'grouped'}_attention (layout {i})")
    if (lay.q_len, lay.kv_len) != (lq, lk):
        raise LayoutError(f"layout {i} was built for q_len={lay.q_len}, kv_len={lay.kv_len} but {unit} {i} "
                          f"has {lq} query and {lk} key tokens")
    if heads is not None and lay.heads not in (1, heads):
        raise LayoutError(f"layout {i} has {lay.heads} heads; q has {heads}: use 1 (broadcast) or {heads} "
                          "(one per query head)")
    if lay.batch != 1:
        raise LayoutError(f"layout {i} has batch {lay.batch}; per-{unit} layouts must have batch 1")
    lay._ensure_valid()
    return lay


def stack(layouts: Sequence[BlockLayout], max_q: int, max_k: int, heads: int) -> BlockLayout:
    """Per-sequence layouts as one layout with batch = number of sequences (rows past a sequence's
    own length are empty). Masks keep their meaning: the kernels align them per sequence."""
    check_same_blocks(layouts, "sequence")
    bq, bk = layouts[0].block_q, layouts[0].block_k
    hl = max(lay.heads for lay in layouts)
    if any(lay.heads not in (1, hl) for lay in layouts) or hl not in (1, heads):
        raise LayoutError(f"per-sequence layouts must have 1 or {heads} heads")
    parts, masks = [], []
    for b, lay in enumerate(layouts):
        coo = lay._to_coo(1, hl)
        mid = torch.where(coo.mask_id >= 0, coo.mask_id + len(masks), -1)
        parts.append(_Coo(torch.full_like(coo.b, b), coo.h, coo.qb, coo.kb, mid))
        masks.extend(lay.masks)
    device = layouts[0].device
    cat = _Coo(*(torch.cat([getattr(p, f) for p in parts]).to(device) for f in ("b", "h", "qb", "kb", "mask_id")))
    return BlockLayout._from_coo(cat, batch=len(layouts), heads=hl, block_q=bq, block_k=bk,
                                 q_len=max_q, kv_len=max_k, masks=tuple(masks))


# a one-shot plan of at most this many (sequence, query block, key slot) entries is built on the host
# and copied to the device at once: a decoding step's, whose few hundred entries took ~40 small CUDA ops
# (1 ms of launches on the H200's host) where the CPU takes a fraction of that; larger ones on the device
HOST_PLAN_ENTRIES = 1 << 16
# and a plan of at most this many (sequence, query block) rows row by row in Python (_rows_by_arithmetic):
# a decoding step's one or few rows then cost a few tensor ops instead of ~40 over the whole grid
ARITHMETIC_PLAN_ROWS = 64


def stack_dense_or_causal(q_lens: Sequence[int], k_lens: Sequence[int], causal: bool, max_q: int, max_k: int,
                          device, block: int = 128) -> BlockLayout:
    """``stack(build_layouts(q_lens, k_lens, None, None, causal, block), max_q, max_k, heads)`` for the
    kernels, built at once with a few tensor ops instead of one layout per sequence (a decoding step
    changes every key length, so no plan is ever reused: 8 sequences cost ~7 ms of host time a call
    that way on the H200). Same blocks and masks, with one mask entry that every sequence shares (the
    kernels align it per sequence). Its forward schedule for ``k_lens`` is seeded
    (schedule.seed_ordered): every row's blocks are one run from key block 0 whose partial blocks
    (the causal edge, the sequence's cut last block) come last, so nothing is reordered or synced.
    Plans built on the host reach a CUDA device by one asynchronous copy (pinned memory): no sync,
    so a decoding loop's host can run ahead of its kernels.

    Returns a BlockLayout on ``device`` with batch = number of sequences, heads 1, q_len ``max_q``,
    kv_len ``max_k``."""
    from .ops.block_sparse.schedule import seed_ordered
    from .patterns._common import CAUSAL
    from .predict.pack import packed_layout
    n_q = -(-max_q // block)
    # the longest row: a sequence's last query row sees all its keys (bottom-right causal too)
    max_count = max([-(-lk // block) for lq, lk in zip(q_lens, k_lens) if lq > 0] + [0])
    if len(q_lens) * n_q <= ARITHMETIC_PLAN_ROWS:
        host, (rows, slots) = True, _rows_by_arithmetic(q_lens, k_lens, causal, n_q, max_count, block)
    else:
        host = len(q_lens) * n_q * max(max_count, 1) <= HOST_PLAN_ENTRIES
        rows, slots = _rows_by_grid(q_lens, k_lens, causal, n_q, max_count, block, "cpu" if host else device)
    counts, n_full, indices, mask_ids = rows[0], rows[1], slots[0], slots[1]
    if host:  # one copy to the device
        counts, n_full, indices, mask_ids = _to_device_aligned((counts, n_full, indices, mask_ids), device)
    counts, n_full = counts.unsqueeze(1), n_full.unsqueeze(1)  # [S, 1, n_q] each
    indices, mask_ids = indices.unsqueeze(1), mask_ids.unsqueeze(1)  # [S, 1, n_q, max_count] each
    layout = packed_layout(counts, indices, mask_ids, (CAUSAL,) if causal else (), q_len=max_q, kv_len=max_k,
                           block_q=block, block_k=block, causal=False)  # causal per sequence, not as a whole
    # every row's run starts at key block 0
    seed_ordered(layout, n_full, contiguous=True, kv_lens=k_lens, first=torch.zeros_like(n_full))
    return layout


def plan_key(q_lens: Sequence[int], k_lens: Sequence[int], causal: bool, max_q: int, block: int = 128
             ) -> tuple | None:
    """What the forward kernels read of stack_dense_or_causal's plan: the query blocks a sequence has room
    for (of max_q rows) and, per sequence and query block, the kept key blocks, the unmasked ones and the
    first partial slot (_row_by_arithmetic; the longest row's count is the plan's width). They take the
    lengths themselves from the call (cu_seqlens or the tensors' shapes): the causal term is aligned in
    the kernel and keys past a sequence's end are cut by the masked phase's bound. So a plan built for
    other lengths with this key gives the same bits, forward; the backward's transposed layout reads the
    plan's own lengths. None past ARITHMETIC_PLAN_ROWS rows: the key would cost a Python loop of that
    length every call."""
    n_q = -(-max_q // block)
    if len(q_lens) * n_q > ARITHMETIC_PLAN_ROWS:
        return None
    return causal, n_q, tuple(_row_by_arithmetic(lq, lk, qb, causal, block)
                              for lq, lk in zip(q_lens, k_lens) for qb in range(n_q))


def offsets_on(device, *cus: torch.Tensor) -> list[torch.Tensor]:
    """``cu_seqlens`` tensors on ``device`` for the kernels: those given on the CPU (which the plan read
    without a sync) arrive by one asynchronous copy, the rest as they are. The last copy is kept while the
    same CPU tensors come back unchanged (every layer of a decoding step passes the step's offsets: one copy a
    step, not one a layer)."""
    device = torch.device(device)
    host = [cu for cu in cus if cu.device != device]
    copies = iter(_copied(host, device) if host else ())
    return [next(copies) if cu.device != device else cu for cu in cus]


def _copied(host: list, device: torch.device) -> list:
    """offsets_on's copy, reused for the same device and stream; never stored or hit while a CUDA graph
    captures (a copy recorded in a capture has not run when an eager call would read it) or while torch.compile
    traces."""
    if capturing(device) or torch.compiler.is_compiling():
        return _to_device_aligned(host, device)
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    return _LAST_COPY.get(tuple(host), (str(device), stream), lambda: _to_device_aligned(host, device))


# the device copy of the last CPU offsets offsets_on moved (plan_cache.LastOne: the same objects, unmodified)
_LAST_COPY = LastOne()


def _to_device_aligned(tensors, device) -> list[torch.Tensor]:
    """Host int32 tensors on ``device`` by one copy, each starting on a 16-byte boundary: Triton compiles a
    kernel apart for every pattern of aligned pointers, and packed back to back the tensors' offsets
    moved with the plan's sizes, so a decoding loop compiled new variants as its caches grew. To CUDA
    the copy goes through pinned memory, asynchronously (a pageable copy waits for every queued kernel)."""
    sizes = [t.numel() for t in tensors]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 4) * 4)  # 4 int32: 16 bytes
    flat = torch.empty(starts[-1], dtype=torch.int32)
    for t, a, n in zip(tensors, starts, sizes):
        flat[a:a + n] = t.flatten()
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:  # Dynamo cannot trace pin_memory (a compiled varlen call traces its plan up to the graph break)
        flat = flat.to(device)
    return [flat[a:a + n].view(t.shape) for t, a, n in zip(tensors, starts, sizes)]


def _rows_by_grid(q_lens, k_lens, causal: bool, n_q: int, max_count: int, block: int, at) -> tuple:
    """The plan's rows ``[2, S, n_q]`` (counts, unmasked counts) and slots ``[2, S, n_q, max_count]``
    (key blocks, mask ids; -1 past the count), int32 on ``at``, from the [S, n_q, max_count] grid of
    blocks: each block is kept as ``patterns.causal`` keeps it (it holds a key at or before its query
    block's last position), partial if its last real key is after the block's first position."""
    lq = torch.tensor(list(q_lens), device=at).view(-1, 1, 1)
    lk = torch.tensor(list(k_lens), device=at).view(-1, 1, 1)
    qb = torch.arange(n_q, device=at).view(1, -1, 1)
    kb = torch.arange(max_count, device=at, dtype=torch.int32).view(1, 1, -1)  # int32: the grids below are O(Qb x Kb)
    k_first, k_last = kb * block, torch.minimum((kb + 1) * block, lk) - 1  # [S, 1, max_count]
    present = (qb * block < lq) & (k_first < lk)  # [S, n_q, max_count]
    partial = torch.zeros_like(present)
    if causal:  # as patterns.causal: a block is kept if it holds a key at or before its last row's position
        offset = lk - lq
        p_first, p_last = qb * block + offset, torch.minimum((qb + 1) * block, lq) - 1 + offset
        present &= k_first <= p_last
        partial = present & (k_last > p_first)
    # present is a prefix of each row, partial a suffix of it; the schedule's masked phase also takes a
    # last block cut by the sequence end
    cut = (kb == (lk - 1) // block) & (lk % block != 0)
    rows = torch.stack([present.sum(-1, dtype=torch.int32),  # counts, n_full [2, S, n_q]
                        (present & ~partial & ~cut).sum(-1, dtype=torch.int32)])
    slots = torch.stack([torch.where(present, kb, -1), torch.where(partial, 0, -1).to(torch.int32)])  # indices, mask ids
    return rows, slots


def _row_by_arithmetic(lq: int, lk: int, qb: int, causal: bool, block: int) -> tuple[int, int, int]:
    """One row of _rows_by_grid's plan in closed form: (kept blocks, unmasked blocks, first partial
    slot). The kept blocks are key blocks 0 .. count - 1; the partial ones a suffix of them (a block's
    last real key only grows with its index); the sequence's cut last block, if kept, is masked too."""
    nk = -(-lk // block)
    if qb * block >= lq or nk == 0:
        return 0, 0, 0
    count, partial = nk, nk
    if causal:
        offset = lk - lq
        p_first, p_last = qb * block + offset, min((qb + 1) * block, lq) - 1 + offset
        count = min(nk, p_last // block + 1) if p_last >= 0 else 0
        first = max((p_first + 1) // block, 0)  # the first block whose last key (uncut) is past p_first
        partial = first if first < count and min((first + 1) * block, lk) - 1 > p_first else count
    cut = lk % block != 0 and count == nk and nk - 1 < partial  # the cut last block, kept and not partial
    return count, partial - cut, partial


def _rows_by_arithmetic(q_lens, k_lens, causal: bool, n_q: int, max_count: int, block: int) -> tuple:
    """_rows_by_grid's result (on the CPU) from each row's closed form: a Python loop over the rows, and
    four tensor ops over the slots."""
    plan = [_row_by_arithmetic(lq, lk, qb, causal, block) for lq, lk in zip(q_lens, k_lens) for qb in range(n_q)]
    per_row = torch.tensor(plan, dtype=torch.int32).view(len(q_lens), n_q, 3)
    count, partial = per_row[..., :1], per_row[..., 2:]
    kb = torch.arange(max_count, dtype=torch.int32)
    kept = kb < count
    slots = torch.stack([torch.where(kept, kb, -1), torch.where(kept & (kb >= partial), 0, -1).to(torch.int32)])
    return per_row[..., :2].permute(2, 0, 1), slots
