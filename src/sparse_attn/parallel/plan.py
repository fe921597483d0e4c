"""The zigzag plan of a (packed) batch: which tokens each rank holds, where gathered chunks go, and
what each local query chunk attends. Pure bookkeeping on Python ints, no communication.

Sequence s owns global tokens ``[a_s, b_s)`` (``cu_seqlens[s]:cu_seqlens[s+1]``), cut into 2W chunks
of ``C_s = (b_s - a_s) / (2W)`` tokens; rank r holds chunks r and 2W-1-r of every sequence, packed in
sequence order, so its local sequence s sits at ``[a_s / W, b_s / W)`` (local cu_seqlens =
``cu_seqlens // W``). A dense ``[B, H, L, D]`` batch is the one-sequence case, ``cu_seqlens = [0, L]``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ..grouped import Group
from .chunks import as_count, offsets, zigzag_chunk_ids


@dataclasses.dataclass(frozen=True)
class ZigzagPlan:
    """Zigzag bookkeeping for one batch shape on one rank (build it with :func:`zigzag_plan`)."""
    world_size: int
    rank: int
    cu_seqlens: tuple[int, ...]  # global offsets, [num_seqs + 1]
    _cache: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def local_tokens(self) -> int:
        return self.total_tokens // self.world_size

    def seq_bounds(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.cu_seqlens))

    def cu_seqlens_local(self, device=None) -> torch.Tensor:
        """int32 ``[num_seqs + 1]``: this rank's packed offsets (``cu_seqlens // W``, the same on every rank)."""
        return torch.tensor([c // self.world_size for c in self.cu_seqlens], dtype=torch.int32, device=device)

    @property
    def max_seqlen_local(self) -> int:
        return max((b - a for a, b in self.seq_bounds()), default=0) // self.world_size

    def position_ids(self, device=None) -> torch.Tensor:
        """int64 ``[local_tokens]``: each local token's position inside its own sequence (for RoPE)."""
        pos = []
        for a, b in self.seq_bounds():
            c = (b - a) // (2 * self.world_size)
            for chunk in zigzag_chunk_ids(self.world_size, self.rank):
                pos.append(torch.arange(chunk * c, (chunk + 1) * c))
        return (torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)).to(device)

    def groups(self, causal: bool) -> tuple[Group, ...]:
        """One :class:`sparse_attn.Group` per local query chunk (both chunks of a sequence in one group
        when not causal): local query tokens ``[q_start, q_end)`` attend gathered (global-order) keys
        ``[k_start, k_end)``; with bottom-right causal masking this is exactly causal attention over
        the whole sequence. Empty sequences give no group. A tuple: the plan caches it, and a list
        handed out could be edited by a caller, changing every later call's groups."""
        key = ("groups", causal)
        if key not in self._cache:
            w, out = self.world_size, []
            for a, b in self.seq_bounds():
                c, la = (b - a) // (2 * w), a // w
                if c == 0:
                    continue
                if not causal:
                    out.append(Group(la, la + 2 * c, a, b))
                    continue
                for half, chunk in enumerate(zigzag_chunk_ids(w, self.rank)):
                    out.append(Group(la + half * c, la + (half + 1) * c, a, a + (chunk + 1) * c))
            self._cache[key] = tuple(out)
        return self._cache[key]

    def gather_pieces(self) -> tuple[tuple[int, int, int], ...]:
        """``(rank, local_start, length)`` of every chunk, in global token order: concatenating
        ``gathered[rank][..., local_start:local_start + length]`` rebuilds the full sequence(s)."""
        if "gather" not in self._cache:
            w, out = self.world_size, []
            for a, b in self.seq_bounds():
                c, la = (b - a) // (2 * w), a // w
                if c == 0:
                    continue
                owner = {}
                for r in range(w):
                    for half, chunk in enumerate(zigzag_chunk_ids(w, r)):
                        owner[chunk] = (r, la + half * c, c)
                out.extend(owner[i] for i in range(2 * w))
            self._cache["gather"] = tuple(out)
        return self._cache["gather"]

    def scatter_pieces(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per rank, ``(global_start, length)`` of its chunks in its local order (the inverse of
        :meth:`gather_pieces`): concatenating them gives that rank's zigzag share."""
        if "scatter" not in self._cache:
            per_rank = [[] for _ in range(self.world_size)]
            for r in range(self.world_size):
                for a, b in self.seq_bounds():
                    c = (b - a) // (2 * self.world_size)
                    if c:
                        per_rank[r].extend((a + chunk * c, c) for chunk in zigzag_chunk_ids(self.world_size, r))
            self._cache["scatter"] = tuple(tuple(r) for r in per_rank)
        return self._cache["scatter"]

    def pairs(self, causal: bool) -> int:
        """(query, key) pairs this rank computes (for FLOP counts: ``4 * B * Hq * D * pairs`` forward)."""
        total = 0
        for g in self.groups(causal):
            lq, lk = g.q_len, g.k_len
            total += lq * lk - (lq * (lq - 1) // 2 if causal else 0)  # bottom-right causal, lk >= lq
        return total


def check_cu_seqlens(cu: list[int], world_size: int) -> None:
    """Raise ``ValueError`` unless ``cu`` starts at 0, never decreases, and every sequence length is a
    multiple of 2 * world_size (zigzag needs 2W equal chunks per sequence)."""
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must have at least 2 entries and start at 0, got {cu[:4]}")
    for i, (a, b) in enumerate(itertools.pairwise(cu)):
        if b < a:
            raise ValueError(f"cu_seqlens must be non-decreasing: cu_seqlens[{i}]={a} > cu_seqlens[{i + 1}]={b}")
        if (b - a) % (2 * world_size):
            raise ValueError(f"sequence {i} (cu_seqlens[{i}:{i + 2}] = [{a}, {b}]) has {b - a} tokens, not a multiple "
                             f"of 2 * world_size = {2 * world_size}: pad each sequence to a multiple of {2 * world_size}")


@functools.lru_cache(maxsize=64)
def _plan(cu: tuple[int, ...], world_size: int, rank: int) -> ZigzagPlan:
    zigzag_chunk_ids(world_size, rank)  # validates rank and world size first (no division by zero below)
    check_cu_seqlens(list(cu), world_size)
    return ZigzagPlan(world_size, rank, cu)


def zigzag_plan(cu_seqlens, world_size: int, rank: int) -> ZigzagPlan:
    """The zigzag plan of a packed batch with GLOBAL offsets ``cu_seqlens`` (int tensor or list
    ``[num_seqs + 1]``, the same on every rank) for ``rank`` of ``world_size``. Cached per
    ``(cu_seqlens, world_size, rank)``; reading a CUDA ``cu_seqlens`` syncs the host once.

    The helpers a training step needs: ``plan.cu_seqlens_local()`` (this rank's offsets, for other
    varlen ops), ``plan.max_seqlen_local``, ``plan.position_ids()`` (RoPE positions of the local
    tokens); shard the packed inputs with :func:`sparse_attn.parallel.zigzag_split_varlen`."""
    return _plan(tuple(offsets(cu_seqlens)), as_count(world_size, "world_size"), as_count(rank, "rank"))


def dense_plan(seq_len: int, world_size: int, rank: int) -> ZigzagPlan:
    """The plan of one sequence of ``seq_len`` tokens (the dense ``[B, H, L, D]`` case)."""
    return _plan((0, int(seq_len)), int(world_size), int(rank))
