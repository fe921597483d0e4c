"""Zigzag sharding of a sequence dimension: pure tensor slicing, no communication.

A sequence of length L is cut into 2W chunks of C = L / (2W) tokens; rank r holds chunks r and
2W-1-r, concatenated in that order (its "local" tensor, 2C tokens). Early chunks (cheap under causal
masking) pair with late ones (expensive), so every rank does the same causal work.
"""
from __future__ import annotations

import itertools

import torch

from ..layout import as_int


def as_count(value, name: str) -> int:
    """``value`` (an int, or an integer numpy / torch scalar) as a Python int; a float or bool is a TypeError
    (rank 1.5 was cut to 1 by zigzag_plan, a float world size failed inside narrow(), True split as one rank)."""
    v = as_int(value)
    if v is None:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return v


def zigzag_chunk_ids(world_size: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2 * world_size) that ``rank`` holds, in local order."""
    world_size, rank = as_count(world_size, "world_size"), as_count(rank, "rank")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, 2 * world_size - 1 - rank


def offsets(cu_seqlens) -> list[int]:
    """``cu_seqlens`` (an int tensor or a sequence of ints) as a list of Python ints; a float (8.5 was
    cut to 8) or a float tensor is an error."""
    if torch.is_tensor(cu_seqlens) and (cu_seqlens.is_floating_point() or cu_seqlens.is_complex()):
        raise TypeError(f"cu_seqlens must hold integer offsets, got a {cu_seqlens.dtype} tensor")
    vals = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    ints = [as_int(x) for x in vals]
    if any(i is None for i in ints):
        raise TypeError(f"cu_seqlens must hold integer offsets, got {vals}")
    return ints


def _check_world(world_size) -> int:
    world_size = as_count(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return world_size


def _chunk_len(length: int, world_size: int, what: str) -> int:
    world_size = _check_world(world_size)
    if length % (2 * world_size):
        raise ValueError(f"{what} has length {length}, which is not divisible by 2 * world_size = "
                         f"{2 * world_size}: pad each sequence to a multiple of {2 * world_size}")
    return length // (2 * world_size)


def zigzag_split(x: torch.Tensor, world_size: int, rank: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s zigzag share of ``x`` along ``dim``: chunks r and 2W-1-r, concatenated
    (length ``x.shape[dim] / W``). ``dim=2`` is the sequence dim of ``[B, H, L, D]``."""
    a, b = zigzag_chunk_ids(world_size, rank)
    c = _chunk_len(x.shape[dim], world_size, f"dim {dim} of a tensor of shape {tuple(x.shape)}")
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim)


def zigzag_merge(parts, dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: ``parts[r]`` is rank r's local tensor (all W of them, in rank
    order), e.g. ``[B, H, L / W, D]`` with ``dim=2``; returns the full tensor in sequence order,
    ``[B, H, L, D]`` (``dim`` W times longer)."""
    world_size = len(parts)
    if not world_size:
        raise ValueError("zigzag_merge needs every rank's local tensor (parts in rank order), got none")
    shapes = [tuple(p.shape) for p in parts]
    if len(set(shapes)) > 1:  # only parts[0] was measured: longer parts lost their tail
        raise ValueError(f"zigzag_merge: every rank's local tensor has the same shape, got {shapes}")
    c = _chunk_len(parts[0].shape[dim], 1, f"dim {dim} of the local tensor {tuple(parts[0].shape)}")
    chunks = [None] * (2 * world_size)
    for r, p in enumerate(parts):
        a, b = zigzag_chunk_ids(world_size, r)
        chunks[a], chunks[b] = p.narrow(dim, 0, c), p.narrow(dim, c, c)
    return torch.cat(chunks, dim)


def _seq_bounds(cu_seqlens, world_size: int) -> list[tuple[int, int]]:
    cu = offsets(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must have at least 2 entries, start at 0 and be non-decreasing, got {cu}")
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        _chunk_len(b - a, world_size, f"sequence {i} (cu_seqlens[{i}:{i + 2}] = [{a}, {b}])")
    return list(itertools.pairwise(cu))


def zigzag_cu_seqlens(cu_seqlens: torch.Tensor, world_size: int) -> torch.Tensor:
    """Local cu_seqlens of a packed varlen batch after :func:`zigzag_split_varlen`: every sequence
    keeps 2 of its 2W chunks on each rank, so local offsets are ``cu_seqlens // W`` (same on every
    rank). ``cu_seqlens`` int ``[num_seqs + 1]`` (tensor or list) -> a tensor ``[num_seqs + 1]`` of its
    dtype (int64 for a list). Each sequence length must be divisible by 2W."""
    _seq_bounds(cu_seqlens, world_size)
    return torch.div(torch.as_tensor(cu_seqlens), _check_world(world_size), rounding_mode="floor")


def zigzag_split_varlen(x: torch.Tensor, cu_seqlens, world_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Zigzag-split every sequence of a packed batch (``x`` packed along ``dim``, e.g. ``[T, H, D]``)
    and concatenate the local shares; offsets are :func:`zigzag_cu_seqlens`. ``x`` holds exactly
    ``cu_seqlens[-1]`` tokens along ``dim``."""
    bounds = _seq_bounds(cu_seqlens, world_size)
    if x.shape[dim] != bounds[-1][1]:  # tokens past the last offset were dropped
        raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim}, cu_seqlens ends at {bounds[-1][1]}: they must "
                         "match")
    return torch.cat([zigzag_split(x.narrow(dim, a, b - a), world_size, rank, dim) for a, b in bounds], dim)


def zigzag_merge_varlen(parts, cu_seqlens, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`zigzag_split_varlen`: ``parts[r]`` is rank r's packed local tensor
    (``[T / W, H, D]`` with ``dim=0``); returns the packed batch ``[T, H, D]`` in sequence order."""
    world_size = len(parts)
    bounds = _seq_bounds(cu_seqlens, world_size)
    local = bounds[-1][1] // world_size
    sizes = [p.shape[dim] for p in parts]
    if any(n != local for n in sizes):
        raise ValueError(f"zigzag_merge_varlen: cu_seqlens holds {bounds[-1][1]} tokens, so each of the {world_size} "
                         f"parts holds {local} along dim {dim}, got {sizes}")
    full = []
    for a, b in bounds:
        la, n = a // world_size, (b - a) // world_size
        full.append(zigzag_merge([p.narrow(dim, la, n) for p in parts], dim))
    return torch.cat(full, dim)
