"""Launcher of the select-and-pack kernel: one program per (query block, query head, batch) row."""
from __future__ import annotations

import torch
import triton

from . import kernels
from ..block_sparse.launch import grid_heads_batch

MAX_KEY_BLOCKS = 4096  # rows longer than this sort in PyTorch (the row is ranked in registers)


def fits(num_key_blocks: int) -> bool:
    """Whether a row of this many key blocks is ranked by the kernel."""
    return 0 < num_key_blocks <= MAX_KEY_BLOCKS


def select_pack(scores: torch.Tensor, sim_q: torch.Tensor, sim_k: torch.Tensor, sim_thr: torch.Tensor,
                thr: torch.Tensor, *, topk: bool, q_len: int, kv_len: int, block_q: int, block_k: int,
                scale: float, causal: bool, sink: bool, has_mask: bool):
    """Rank, select and pack every row (the rule of ``predict/meansim.py``, the packing of ``predict/pack.py``).

    scores fp32 ``[B, Hq, Qb, Kb]`` (pooled q . pooled k, unscaled);
    sim_q fp32 ``[B, Hq, Qb]``; sim_k fp32 ``[B, Hkv, Kb]``; sim_thr and thr fp32 ``[Hq]`` (the
    self-similarity threshold and the CDF mass, or the top-k fraction when ``topk``).
    Returns int32 (counts ``[B, Hq, Qb]``, indices ``[B, Hq, Qb, Kb]``, mask ids ``[B, Hq, Qb, Kb]``,
    n_full ``[B, Hq, Qb]``).
    """
    B, Hq, Qb, Kb = scores.shape
    Hkv = sim_k.shape[1]
    if not fits(Kb):
        raise ValueError(f"select_pack ranks rows of 1..{MAX_KEY_BLOCKS} key blocks, got {Kb}")
    scores, sim_q, sim_k = (t if t.stride(-1) == 1 else t.contiguous() for t in (scores, sim_q, sim_k))
    dev = scores.device
    counts = torch.empty(B, Hq, Qb, dtype=torch.int32, device=dev)
    n_full = torch.empty_like(counts)
    indices = torch.empty(B, Hq, Qb, Kb, dtype=torch.int32, device=dev)
    mask_ids = torch.empty_like(indices)
    if counts.numel() == 0:
        return counts, indices, mask_ids, n_full
    kb_pow2 = max(16, triton.next_power_of_2(Kb))
    kernels.select_pack_kernel[(Qb, *grid_heads_batch(B, Hq))](
        scores, sim_q, sim_k, sim_thr.contiguous(), thr.contiguous(), counts, indices, mask_ids, n_full,
        Hq, Qb, Kb, Hq // Hkv, q_len, kv_len, block_q, block_k, float(scale),
        *scores.stride()[:3], *sim_q.stride()[:2], *sim_k.stride()[:2],
        TOPK=topk, CAUSAL=causal, SINK=sink, HAS_MASK=has_mask, KB=kb_pow2,
        num_warps=max(1, min(8, kb_pow2 // 256)))  # ~8-16 keys per thread: rows are short, programs many
    return counts, indices, mask_ids, n_full
