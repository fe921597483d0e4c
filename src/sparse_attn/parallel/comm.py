"""The collectives zigzag context parallelism needs (torch.distributed, any backend).

A missing or dead peer makes every collective wait until the process group's timeout
(``init_process_group(..., timeout=datetime.timedelta(...))``), then raise; nothing here can detect it
sooner. Shape mismatches between live ranks, by contrast, are caught up front by
:func:`check_consistent_shapes`, which raises the same clear error on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .chunks import zigzag_merge, zigzag_split

_MAX_DIMS = 6
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_REDUCE_SCATTER_UNSUPPORTED: set = set()


def _encode(t: torch.Tensor) -> list[int]:
    if t.dim() > _MAX_DIMS:
        return [t.dim()] + [-1] * _MAX_DIMS + [-1]
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    return [t.dim()] + list(t.shape) + [-1] * (_MAX_DIMS - t.dim()) + [dtype]


def _decode(row: list[int], names, extras) -> str:
    parts, i = [], 0
    for name in names:
        nd = row[i]
        shape = tuple(row[i + 1:i + 1 + min(nd, _MAX_DIMS)]) if nd <= _MAX_DIMS else f"<{nd}-D>"
        dt = row[i + 1 + _MAX_DIMS]
        parts.append(f"{name} {shape} {str(_DTYPES[dt]).removeprefix('torch.') if dt >= 0 else '?'}")
        i += _MAX_DIMS + 2
    parts += [f"{k}={v}" for k, v in zip(extras, row[i:])]
    return ", ".join(parts)


def check_consistent_shapes(tensors: dict, group=None, extras: dict | None = None, what: str = "") -> None:
    """All-gather a small int tensor describing ``tensors`` (name -> tensor: shape and dtype) and
    ``extras`` (name -> int) and raise ``ValueError`` on every rank if any rank disagrees with rank 0,
    naming the ranks and what each passed. Call it before any collective whose sizes depend on them,
    so a wrong shape on one rank is an error everywhere rather than a hang."""
    extras = extras or {}
    device = next(iter(tensors.values())).device
    row = [v for t in tensors.values() for v in _encode(t)] + [int(v) for v in extras.values()]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    rows = [r.tolist() for r in rows]
    bad = [r for r in range(world) if rows[r] != rows[0]]
    if bad:
        desc = "; ".join(f"rank {r}: {_decode(rows[r], list(tensors), list(extras))}" for r in [0] + bad)
        raise ValueError(f"{what}ranks {bad} disagree with rank 0 on their inputs ({desc}). Every rank must pass "
                         f"the same shapes, dtypes and options (its zigzag share of the same sequence length).")


def all_gather_zigzag(x: torch.Tensor, dim: int = 2, group=None) -> torch.Tensor:
    """All-gather every rank's zigzag-local ``x`` and return the full tensor in sequence order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return zigzag_merge(parts, dim)


zigzag_gather = all_gather_zigzag


def reduce_scatter_zigzag(full: torch.Tensor, dim: int = 2, group=None) -> torch.Tensor:
    """Sum ``full`` (sequence order, same shape on every rank) over ranks and return this rank's zigzag
    share. Uses ``dist.reduce_scatter``; on backends without it (gloo in some torch versions) falls back
    to ``all_reduce`` + local slice (W times the traffic, same result)."""
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
