"""Effective FLOPs: counted from the blocks a layout actually visits.

    fwd      = 4 * D * block_q * block_k * (visited blocks summed over all B x Hq rows)
    bwd      = 2.5 * fwd
    fwd+bwd  = 3.5 * fwd

A layout that broadcasts over batch (``Bl == 1``) or heads (``Hl == 1``) counts ``B`` or ``Hq``
times. Blocks count whole (``block_q * block_k`` pairs) even where a partial block's element mask
or the ragged last block allows fewer. With ``causal=True`` a block counts only if the
bottom-right causal mask allows some pair in it (``4 * D`` is ``2 * D`` for QK^T plus ``2 * D``
for PV, with ``Dv == D``).

Every provider of a pattern gets the same count, dense SDPA baselines included, so TFLOP/s
ratios between providers are exactly their time ratios ("effective" TFLOP/s, as the project's design notes define them).
"""
from __future__ import annotations

import torch

MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def _per_head_blocks(layout, causal: bool) -> torch.Tensor:
    """int64 [Bl, Hl]: blocks visited per layout row set, causal-aware."""
    valid = torch.arange(layout.max_k, device=layout.device) < layout.kv_counts[..., None]
    if causal:
        qb = torch.arange(layout.num_q_blocks, device=layout.device)
        last_p = torch.clamp((qb + 1) * layout.block_q, max=layout.q_len) - 1 + (layout.kv_len - layout.q_len)
        last_kb = torch.div(last_p, layout.block_k, rounding_mode="floor")
        valid = valid & (layout.kv_indices.long() <= last_kb[:, None])
    return valid.sum(dim=(-1, -2), dtype=torch.int64)


def visited_blocks(layout, *, batch: int, heads: int, causal: bool = False) -> int:
    """Blocks computed over all ``batch x heads`` (b, h) pairs."""
    if layout.batch not in (1, batch) or layout.heads not in (1, heads):
        raise ValueError(f"layout has batch {layout.batch}, heads {layout.heads}: it cannot broadcast "
                         f"to batch {batch}, heads {heads}")
    per = _per_head_blocks(layout, causal)
    return int(per.sum()) * (batch // layout.batch) * (heads // layout.heads)


def block_density(layout, *, batch: int, heads: int, causal: bool = False) -> float:
    """Visited blocks over the whole ``B x Hq x Qb x Kb`` grid (whole blocks, causal-aware)."""
    total = batch * heads * layout.num_q_blocks * layout.num_kv_blocks
    return visited_blocks(layout, batch=batch, heads=heads, causal=causal) / total if total else 0.0


def attention_flops(layout, *, batch: int, heads: int, head_dim: int, mode: str = "fwd",
                    causal: bool = False) -> int:
    """Effective FLOPs of one call of ``mode`` on ``layout`` (see the module docstring)."""
    if mode not in MODE_FACTOR:
        raise ValueError(f"mode must be one of {tuple(MODE_FACTOR)}, got {mode!r}")
    blocks = visited_blocks(layout, batch=batch, heads=heads, causal=causal)
    fwd = 4 * head_dim * layout.block_q * layout.block_k * blocks
    return int(round(fwd * MODE_FACTOR[mode]))


def tflops(flops: int, ms: float | None) -> float | None:
    return None if not ms else flops / (ms * 1e-3) / 1e12
