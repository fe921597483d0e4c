"""The collectives zigzag context parallelism needs (torch.distributed, any backend).

Failure behaviour:

- Shape, dtype or option mismatches between live ranks are caught up front by
  :func:`check_consistent_shapes` (one small all-gather of host integers, over a gloo group beside
  an NCCL one, so it never waits for the GPU), which raises the same ``ValueError`` on every rank,
  naming the ranks and what each passed.
- A missing or dead peer cannot be told apart from a slow one: every collective waits until the
  process group's timeout, ``init_process_group(..., timeout=datetime.timedelta(seconds=...))``
  (default 10 minutes for NCCL, 30 for gloo). With gloo the waiting call then raises; the input check
  (the first collective of every call) re-raises that as a ``RuntimeError`` saying a peer did not
  answer. With NCCL the watchdog reports ``Watchdog caught collective operation timeout ...`` and,
  under the default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, tears the process down; set
  ``TORCH_NCCL_BLOCKING_WAIT=1`` to get a Python exception in the waiting call instead. Under
  torchrun a rank that crashes makes the agent stop the others.
"""
from __future__ import annotations

import struct
import zlib

import torch
import torch.distributed as dist

from .chunks import zigzag_merge, zigzag_split

_MAX_DIMS = 6
_ROW_INTS = 48  # the cross-rank check's row: a call digest, the body's length, the body, zero padding
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_REDUCE_SCATTER_UNSUPPORTED: set = set()
# single-tensor collectives (ranks along dim 0): torch >= 2.12 names them *_single, older ones *_tensor
_ALL_GATHER_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _encode(t: torch.Tensor) -> list[int]:
    if t.dim() > _MAX_DIMS:
        return [t.dim()] + [-1] * _MAX_DIMS + [-1]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return [t.dim()] + list(t.shape) + [-1] * (_MAX_DIMS - t.dim()) + [dtype]


def _decode(row: list[int], names, extras: dict) -> str:
    parts, i = [], 0
    for name in names:
        nd = row[i]
        shape = tuple(row[i + 1:i + 1 + min(nd, _MAX_DIMS)]) if nd <= _MAX_DIMS else f"<{nd}-D>"
        dt = row[i + 1 + _MAX_DIMS]
        parts.append(f"{name} {shape} {str(_DTYPES[dt]).removeprefix('torch.') if dt >= 0 else '?'}")
        i += _MAX_DIMS + 2
    parts += [f"{k}={_show_value(v, extras[k])}" for k, v in zip(extras, row[i:])]
    return ", ".join(parts)


_HOST_GROUPS: dict = {}  # process group -> (that group, the group the input check runs over)


def _host_group(group):
    """The group that carries the input check on the host: ``group`` itself when its backend is gloo,
    otherwise a gloo group over the same ranks, made on first use (only its members take part) and
    kept. Checking host integers this way costs no device round trip: an all_gather of a CUDA tensor
    read back with ``.tolist()`` stalls the host until the GPU has drained everything queued before
    it, every call (0.4 ms of a 2.7 ms context-parallel forward at 8K tokens per GPU on an H100),
    and in training the queue the host had built up is lost. Gloo's own latency remains host time
    (0.2-0.9 ms per call on the lent 2 x H200), hidden when the host runs ahead of the GPU."""
    pg = group if group is not None else dist.group.WORLD
    hit = _HOST_GROUPS.get(id(pg))
    if hit is not None and hit[0] is pg:  # the entry holds pg, so its id cannot be reused meanwhile
        return hit[1]
    if dist.get_backend(pg) == "gloo" or not dist.is_gloo_available():
        host = pg
    else:
        host = dist.new_group(dist.get_process_group_ranks(pg), backend="gloo", use_local_synchronization=True)
    _HOST_GROUPS[id(pg)] = (pg, host)
    return host


def _row_value(v) -> int:
    """One extra as an int64: ints as they are, floats by their float64 bits, None as -1 (the bits of no
    float a caller passes: a negative NaN)."""
    if v is None:
        return -1
    if isinstance(v, float):
        return struct.unpack("<q", struct.pack("<d", v))[0]
    return int(v)


def _show_value(v: int, like) -> str:
    """``v`` (a row entry) shown as what it encodes; ``like``: this rank's value of the same extra,
    which says whether it is an int or a float-or-None option."""
    if like is not None and not isinstance(like, float):
        return str(v)
    return "None" if v == -1 else repr(struct.unpack("<d", struct.pack("<q", v))[0])


def _call_signature(what: str, names, extras) -> int:
    """A digest of the call (its entry point and the names of what it checks) that is the same in every
    process (Python's own ``hash`` of a string is salted per process)."""
    return zlib.crc32(f"{what}|{','.join(names)}|{','.join(extras)}".encode())


def check_consistent_shapes(tensors: dict, group=None, extras: dict | None = None, what: str = "") -> None:
    """All-gather a small int tensor describing ``tensors`` (name -> tensor: shape and dtype) and
    ``extras`` (name -> int, float or None) and raise ``ValueError`` on every rank if any rank
    disagrees with rank 0, naming the ranks and what each passed. Call it before any collective whose
    sizes depend on them, so a wrong shape on one rank is an error everywhere rather than a hang.

    Every rank's row has the same length (:data:`_ROW_INTS`), led by a digest of the call, so ranks
    that entered different functions (another entry point, other checked names) also get the
    ``ValueError`` rather than a failed all-gather of unequal sizes. Runs on the host (see
    :func:`_host_group`); falls back to ``group`` with a tensor on the inputs' device when this
    torch has no gloo."""
    extras = extras or {}
    body = [v for t in tensors.values() for v in _encode(t)] + [_row_value(v) for v in extras.values()]
    if len(body) + 2 > _ROW_INTS:  # a caller's fixed layout, the same on every rank: raised everywhere alike
        raise ValueError(f"{what}the cross-rank check holds {_ROW_INTS - 2} integers, this call needs {len(body)}")
    row = [_call_signature(what, tensors, extras), len(body)] + body + [0] * (_ROW_INTS - 2 - len(body))
    world = dist.get_world_size(group)
    try:
        host = _host_group(group)
        device = "cpu" if dist.get_backend(host) == "gloo" else next(iter(tensors.values())).device
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine, group=host)
    except RuntimeError as e:  # a timeout or a dead peer: say what it most likely means
        raise RuntimeError(f"{what}rank {dist.get_rank(group)} of {world}: a peer did not answer the cross-rank input "
                           f"check (an all_gather): {e}. Every rank of the group must make the same call; a rank "
                           f"that crashed, hangs or took another code path shows up here after the process group's "
                           f"timeout (init_process_group(timeout=...)).") from e
    rows = [r.tolist() for r in rows]
    other_call = [r for r in range(world) if rows[r][:2] != rows[0][:2]]
    if other_call:
        raise ValueError(f"{what}ranks {other_call} made a different call than rank 0 (another function or other "
                         f"options checked; this is rank {dist.get_rank(group)}, checking "
                         f"{', '.join([*tensors, *extras])}). Every rank must make the same call.")
    bad = [r for r in range(world) if rows[r] != rows[0]]
    if bad:
        desc = "; ".join(f"rank {r}: {_decode(rows[r][2:], list(tensors), extras)}" for r in [0] + bad)
        raise ValueError(f"{what}ranks {bad} disagree with rank 0 on their inputs ({desc}). Every rank must pass "
                         f"the same shapes, dtypes and options (its zigzag share of the same sequence length).")


def all_gather_zigzag(x: torch.Tensor, dim: int = 2, group=None) -> torch.Tensor:
    """All-gather every rank's zigzag-local ``x`` (e.g. ``[B, H, L / W, D]``, ``dim=2``) and return
    the full tensor in sequence order (``[B, H, L, D]``)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return zigzag_merge(parts, dim)


zigzag_gather = all_gather_zigzag


def reduce_scatter_zigzag(full: torch.Tensor, dim: int = 2, group=None) -> torch.Tensor:
    """Sum ``full`` (sequence order, same shape on every rank, e.g. ``[B, H, L, D]`` with ``dim=2``) over ranks
    and return this rank's zigzag share (``[B, H, L / W, D]``). Uses ``dist.reduce_scatter``; on backends
    without it (gloo in some torch versions) falls back to ``all_reduce`` + local slice (W times the traffic,
    same result)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    if backend not in _REDUCE_SCATTER_UNSUPPORTED:
        parts = [zigzag_split(full, world, r, dim).contiguous() for r in range(world)]
        out = torch.empty_like(parts[rank])
        try:
            dist.reduce_scatter(out, parts, group=group)
            return out
        except RuntimeError as e:  # raised locally, before any communication, identically on every rank
            if "support" not in str(e).lower():
                raise
            _REDUCE_SCATTER_UNSUPPORTED.add(backend)
    full = full.contiguous().clone()
    dist.all_reduce(full, group=group)
    return zigzag_split(full, world, rank, dim)


# ---- pipelined head-chunk collectives (used by the autograd function in zigzag.py) --------------------

def _split_pieces(full: torch.Tensor, plan) -> torch.Tensor:
    """``full [B, h, L, D]`` (global order) -> ``[W, B, h, Lloc, D]``: row r is rank r's zigzag share."""
    send = full.new_empty((plan.world_size,) + full.shape[:2] + (plan.local_tokens,) + full.shape[3:])
    for r, pieces in enumerate(plan.scatter_pieces()):
        torch.cat([full[:, :, s:s + n] for s, n in pieces], 2, out=send[r])
    return send


class HeadChunkGather:
    """All-gather ``tensors`` (each ``[B, H, Lloc, D]``, zigzag-local; K and V) one head range at a
    time, in global token order, and hand each out as a ``[B, h, L, D]`` view of one token-major
    ``[L, n, B, h, D]`` buffer (n tensors side by side; the kernels take any strides). Per range: one
    copy stacks the local shares token-major, one ``all_gather_into_tensor`` fills a rank-major
    staging buffer, one concatenation of whole-row pieces puts the chunks in global order. Range i+1
    is already in flight while the caller computes on range i, so at most two ranges of gathered K/V
    exist at once. Every rank must walk the ranges in the same order (it does: they come from shapes
    checked to agree). Tensors whose shapes differ (Dv != D) are gathered one by one.

    Measured on 2 H200 (16K tokens, 8 heads, bf16): the all-gather takes 90 us per tensor; the
    head-major concatenation this replaces took 67 us per tensor, the token-major one 17 us; sending
    each chunk straight to its place with batched point-to-point ops instead took 670 us for K and V
    (NCCL's send/recv kernel); each collective also costs the host 50-100 us before the GPU sees it."""

    def __init__(self, tensors, ranges, plan, group=None):
        self.ranges, self.plan, self.group = ranges, plan, group
        same = all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors)
        self.stacks = [tuple(tensors)] if same else [(t,) for t in tensors]
        self._next = None

    def _issue(self, i):
        h0, h1 = self.ranges[i]
        pending = []
        for stack in self.stacks:
            src = torch.stack([t[:, h0:h1].permute(2, 0, 1, 3) for t in stack], 1)  # [Lloc, n, B, h, D]
            if self.plan.world_size == 1:
                pending.append((src, None))
                continue
            buf = src.new_empty((self.plan.world_size * src.shape[0],) + src.shape[1:])  # rank-major tokens
            pending.append((buf, _ALL_GATHER_1(buf, src, group=self.group, async_op=True)))
        return i, pending

    def __getitem__(self, i):
        cur = self._next if self._next is not None and self._next[0] == i else self._issue(i)
        self._next = self._issue(i + 1) if i + 1 < len(self.ranges) else None
        out, n_loc = [], self.plan.local_tokens
        for buf, work in cur[1]:
            if work is None:  # one rank: its two chunks of every sequence are already in global order
                full = buf
            else:
                work.wait()
                full = torch.cat([buf[r * n_loc + s:r * n_loc + s + n] for r, s, n in self.plan.gather_pieces()], 0)
            out += [full[:, j].permute(1, 2, 0, 3) for j in range(full.shape[1])]
        return out


class GradReduceScatter:
    """Sum full-sequence gradients over ranks and keep this rank's share: :meth:`push` starts the
    reduce-scatter of one head range (asynchronously) and finishes the previous one, writing it into
    its destinations (cast to their dtype); :meth:`flush` finishes the last. Backends without
    ``reduce_scatter_tensor`` fall back to ``all_reduce`` + local slice (W times the traffic)."""

    def __init__(self, plan, group=None):
        self.plan, self.group, self._pending = plan, group, None

    def _start(self, full):
        send = _split_pieces(full, self.plan)
        backend = dist.get_backend(self.group)
        if backend not in _REDUCE_SCATTER_UNSUPPORTED:
            out = send.new_empty(send.shape[1:])
            flat = send.view((-1,) + send.shape[2:])  # ranks along dim 0, as every backend takes it
            try:
                return send, out, _REDUCE_SCATTER_1(out, flat, group=self.group, async_op=True)
            except RuntimeError as e:  # raised locally, before any communication, identically on every rank
                if "support" not in str(e).lower():
                    raise
                _REDUCE_SCATTER_UNSUPPORTED.add(backend)
        work = dist.all_reduce(send, group=self.group, async_op=True)
        return send, send[dist.get_rank(self.group)], work

    def push(self, fulls, dsts) -> None:
        started = [self._start(f) for f in fulls]
        self.flush()
        self._pending = (started, dsts)

    def flush(self) -> None:
        if self._pending is None:
            return
        started, dsts = self._pending
        for (_, out, work), dst in zip(started, dsts):
            work.wait()
            dst.copy_(out)
        self._pending = None
