"""Mean-similarity block prediction (SpargeAttn-style): pooled Q/K scores -> a BlockLayout.

The rule, per (batch b, query head h), with ``g = Hq // Hkv`` and kv head ``h // g``:

1. Tiling. Queries are cut into ``Qb = ceil(Lq / block_q)`` blocks, keys into
   ``Kb = ceil(Lk / block_k)``; the last block of each may be a tail with fewer tokens.
2. Pooling and self-similarity, per block of ``n`` *valid* tokens ``x_1..x_n`` (tails use only
   their valid tokens): ``m = mean(x_a)`` (the pooled vector) and
   ``sim = mean_a cos(x_a, m)`` (``cos = 0`` when a norm is 0; ``sim`` is NaN when ``m`` is not
   finite, a NaN or inf token, so that block is never self-similar). The block is *self-similar*
   iff ``sim >= simthreshd1``. Shapes: pooled Q ``[B, Hq, Qb, D]``, pooled K ``[B, Hkv, Kb, D]``,
   sim Q ``[B, Hq, Qb]``, sim K ``[B, Hkv, Kb]``.
3. Visibility. Without ``causal`` every key block is visible to every query block. With
   ``causal`` (bottom-right aligned, query row ``i`` at key position ``p = i + Lk - Lq``) key
   block ``kb`` is visible to query block ``qb`` iff ``kb <= d(qb)`` where
   ``d(qb) = p_last(qb) // block_k`` is the *diagonal* block (``p_last`` the position of the
   block's last real row); blocks wholly above the diagonal are never kept.
4. Always kept (among visible blocks): every block of a row whose query block is not
   self-similar; every key block that is not self-similar (in every row); under ``causal``
   every key block holding some row's own key position ``p >= 0`` (from
   ``max(p_first(qb), 0) // block_k`` to the diagonal block ``d(qb)``; the diagonal block alone
   when ``Lk - Lq`` is a multiple of ``block_k`` and ``block_k`` of ``block_q``), so every query row
   that may see a key keeps its own; key block 0 with ``attention_sink``.
5. Ranking. Candidates of row ``qb`` are the visible, self-similar key blocks. Their pooled
   scores ``s[kb] = scale * <mq[qb], mk[kb]>`` (``scale`` default ``1/sqrt(D)``) are
   soft-maxed over the candidates only and sorted descending (ties: lower ``kb`` first).
   * CDF mode (default): keep the shortest prefix whose probability mass reaches
     ``cdfthreshd``: rank ``r`` is kept iff the mass of ranks ``< r`` is ``< cdfthreshd``
     (so the top candidate is always kept; ``cdfthreshd >= 1`` keeps every candidate).
   * Top-k mode (``topk`` given; ``cdfthreshd`` is then ignored): keep the first
     ``ceil(topk * N)`` ranks, ``N`` = number of visible key blocks of the row (a product within a
     relative 1e-6 above an integer counts as that integer: ``0.6 * 25`` is 15.000001 in fp32).
6. Layout. Kept blocks are full; with ``causal`` the layout is intersected (``&``) with
   ``sparse_attn.patterns.causal(Lq, Lk)``, so diagonal blocks get the token-exact causal
   element mask (``j <= p``) and blocks wholly below the diagonal stay full (computed on the
   block grid in closed form by :func:`sparse_attn.predict.pack.layout_from_keep`, which equals
   that intersection and marks the layout as its own causal cut).

The block mask is dense in blocks, ``O(B * Hq * Qb * Kb)`` memory (never per token), and so is the
layout (``max_k = Kb``: rows are packed in place). Nothing reads a value back to the host when the
thresholds are plain numbers: on CUDA the pooling is one Triton kernel (``ops/block_pool``) and the
layout arrives with the kernels' schedule, so a fresh prediction adds no host sync to attention. Steps 3-6
and the packing run as one more Triton kernel on CUDA (``ops/block_select``, rows up to 4096 key
blocks; its twin is :func:`select_ranked` + :func:`~sparse_attn.predict.pack.layout_from_keep`).

Differences from SpargeAttn's ``get_block_map_meansim``: self-similarity there is the mean
pairwise cosine of the block's tokens (``|mean of unit vectors|^2``), here the mean cosine to
the pooled vector; its CDF rule keeps the ranks whose *inclusive* mass is ``<= cdfthreshd``
(at least one), this one the shortest prefix *reaching* it; top-k there counts all ``Kb``
blocks, here the visible ones; it forces no block on the causal diagonal, here a row's own key is
always kept.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..device_guard import on_inputs_device
from ..layout import BlockLayout, as_int, check_block_size
from ..ops import block_select
from ..ops.block_pool import block_pool_sim
from ..patterns._common import own_key_blocks
from ..validation import check_causal, check_flag, check_scale
from .pack import causal_masks, layout_from_keep, layout_from_packed


# ----------------------------------------------------------------------------- argument checks
def _check_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a float 4-D [batch, heads, seq_len, head_dim] tensor, "
                             f"got {t.dtype} {tuple(t.shape)}")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if B != Bk:
        raise ValueError(f"q has batch {B}, k has batch {Bk}: they must match")
    if D != Dk:
        raise ValueError(f"q has head_dim {D}, k has {Dk}: they must match")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k has {Hkv} heads, q has {Hq}: Hq must be a multiple of Hkv (GQA/MQA)")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    if D == 0:
        raise ValueError("q and k have head_dim 0: there is nothing to pool")
    return B, Hq, Hkv, Lq, Lk, D


def _per_head(name: str, value, heads: int, device, dtype, lo=None, hi=None) -> torch.Tensor:
    """A float or a sequence/tensor of ``heads`` values -> ``[1, heads, 1]`` (checked against (lo, hi]).
    A plain number is checked on the host and filled on the device (no copy, no sync)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        raise TypeError(f"{name} must be a number or {heads} per-head numbers, got {value!r}")
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise ValueError(f"{name} must not be NaN, got {value!r}")
        if lo is not None and not lo < value <= hi:
            raise ValueError(f"{name} must be in ({lo}, {hi}], got {value!r}")
        return torch.full((1, heads, 1), float(value), dtype=dtype, device=device)
    t = torch.as_tensor(value, dtype=torch.float64).flatten()
    if t.numel() == 1:
        t = t.expand(heads)
    if t.numel() != heads:
        raise ValueError(f"{name} has {t.numel()} values; give one number or one per query head ({heads})")
    if torch.isnan(t).any():
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    if lo is not None and not bool(((t > lo) & (t <= hi)).all()):
        raise ValueError(f"{name} must be in ({lo}, {hi}], got {value!r}")
    return t.to(device=device, dtype=dtype).view(1, heads, 1)


def _blocks(block_q: int, block_k: int, block) -> tuple[int, int]:
    if block is not None:
        if as_int(block) is not None:
            block_q = block_k = block
        elif isinstance(block, (tuple, list)) and len(block) == 2:
            block_q, block_k = block
        else:
            raise TypeError(f"block must be an int or a (block_q, block_k) pair, got {block!r}")
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    return block_q, block_k


# ----------------------------------------------------------------------------- the steps
def visible_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool, device):
    """(visible bool ``[Qb, Kb]``, diagonal block int64 ``[Qb]``) as in step 3 of the module docstring."""
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_k)
    qb = torch.arange(nq, device=device)
    p_last = torch.clamp((qb + 1) * block_q, max=q_len) - 1 + (kv_len - q_len)
    d = torch.div(p_last, block_k, rounding_mode="floor")
    kb = torch.arange(nk, device=device)
    if causal:
        vis = kb[None, :] <= d[:, None]
    else:
        vis = torch.ones(nq, nk, dtype=torch.bool, device=device)
    return vis, d


def own_blocks(q_len: int, kv_len: int, block_q: int, block_k: int, device) -> torch.Tensor:
    """bool ``[Qb, Kb]``: under causal, the key blocks holding some row's own key position ``p >= 0``
    (step 4 of the module docstring; the diagonal block among them)."""
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_k)
    first, last = own_key_blocks(torch.arange(nq, device=device), q_len, kv_len, block_q, block_k)
    kb = torch.arange(nk, device=device)[None, :]
    return (kb >= first[:, None]) & (kb <= last[:, None])


TOPK_SLACK = 1.0 - 1e-6  # ceil(topk * N * TOPK_SLACK): see the module docstring (2.)


def select_ranked(scores: torch.Tensor, cand: torch.Tensor, *, cdfthreshd: torch.Tensor | None,
                  topk: torch.Tensor | None, n_visible: torch.Tensor) -> torch.Tensor:
    """Step 5: bool ``[B, H, Qb, Kb]``, the candidates kept by the CDF or top-k rule.

    scores float ``[B, H, Qb, Kb]``; cand bool (same shape, broadcastable); cdfthreshd / topk
    ``[1, H, 1]`` (exactly one given); n_visible int64 ``[Qb]`` (visible key blocks per row).
    """
    cand = cand.expand_as(scores)
    if scores.shape[-1] == 0:
        return cand.clone()
    s = scores.masked_fill(~cand, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    cand_sorted = cand.gather(-1, order)
    rank = torch.arange(s.shape[-1], device=s.device)
    if topk is not None:
        # relative slack, as the kernel computes it (fp32 rounding lifts 0.6 * 25 above 15); [1, H, Qb, 1]
        n_keep = torch.ceil(topk[..., None].double() * n_visible[:, None].double() * TOPK_SLACK)
        keep_sorted = cand_sorted & (rank < n_keep)
    else:
        any_cand = cand.any(-1, keepdim=True)
        p = torch.softmax(torch.where(any_cand, s, 0.0), dim=-1)  # rows without candidates: ignored below
        p_sorted = p.gather(-1, order).masked_fill(~cand_sorted, 0.0)
        cum = torch.cumsum(p_sorted, -1)
        before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)  # mass of the higher ranks
        thr = cdfthreshd[..., None]
        keep_sorted = cand_sorted & ((before < thr) | (thr >= 1.0))
    return torch.zeros_like(cand_sorted).scatter(-1, order, keep_sorted)


# ----------------------------------------------------------------------------- public
@on_inputs_device()
def meansim(q: torch.Tensor, k: torch.Tensor, *, simthreshd1: float | Sequence[float] | torch.Tensor = 0.6,
            cdfthreshd: float | Sequence[float] | torch.Tensor = 0.98,
            topk: float | Sequence[float] | torch.Tensor | None = None, block_q: int = 128, block_k: int = 128,
            block: int | tuple[int, int] | None = None, causal: bool = False, attention_sink: bool = False,
            scale: float | None = None) -> BlockLayout:
    """Predict a per-head block layout from mean-pooled Q/K similarity (SpargeAttn's "meansim").

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]`` with ``Hq % Hkv == 0`` (query head ``h``
            uses kv head ``h // (Hq // Hkv)``). Any float dtype and device; the rule is computed
            in fp32 (fp64 for fp64 inputs). Lengths need not be block multiples.
        simthreshd1: self-similarity threshold; a block whose mean token-to-mean cosine is below
            it is always computed (its whole query row, or its key column in every row). One
            number or one per query head. Higher = more blocks always computed = denser.
        cdfthreshd: in (0, 1]; probability mass of the pooled softmax each row must keep.
            Lower = sparser. One number or one per query head.
        topk: in (0, 1]; when given, keep the top ``ceil(topk * visible blocks)`` candidates of
            each row instead of the CDF rule (``cdfthreshd`` is ignored).
        block_q, block_k: block sizes (multiples of 16 in [16, 256]); ``block`` (an int or a
            ``(block_q, block_k)`` pair) overrides both.
        causal: bottom-right aligned (query ``i`` sees key ``j <= i + Lk - Lq``): blocks wholly
            above the diagonal are excluded; the blocks the diagonal crosses (those holding a row's
            own key ``i + Lk - Lq``) are always kept, cut token-exactly.
        attention_sink: always keep key block 0 (the first ``block_k`` keys).
        scale: temperature of the pooled scores, default ``1/sqrt(D)`` (the attention scale).

    Returns:
        A :class:`~sparse_attn.BlockLayout` for ``(Lq, Lk)`` with ``batch = B``, ``heads = Hq``;
        kept blocks are full, except causal diagonal blocks (causal element mask).
        ``layout.sparsity`` is the fraction of the ``B * Hq * Qb * Kb`` block grid skipped.

    The exact rule (pooling over valid tokens, visibility, always-kept blocks, ranking) is in
    the docstring of :mod:`sparse_attn.predict.meansim`.
    """
    B, Hq, Hkv, Lq, Lk, D = _check_inputs(q, k)
    causal, attention_sink = check_causal(causal), check_flag("attention_sink", attention_sink)
    block_q, block_k = _blocks(block_q, block_k, block)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    sim_thr = _per_head("simthreshd1", simthreshd1, Hq, dev, work)
    if topk is not None:
        topk_t, cdf_t = _per_head("topk", topk, Hq, dev, work, 0.0, 1.0), None
    else:
        topk_t, cdf_t = None, _per_head("cdfthreshd", cdfthreshd, Hq, dev, work, 0.0, 1.0)
    scale = check_scale(scale)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = Hq // Hkv
    with torch.no_grad():
        mq, sq = block_pool_sim(q.detach(), block_q, work)          # [B, Hq, Qb, D], [B, Hq, Qb]
        mk, sk = block_pool_sim(k.detach(), block_k, work)          # [B, Hkv, Kb, D], [B, Hkv, Kb]
        nq, nk = mq.shape[2], mk.shape[2]
        raw = torch.einsum("bhgqd,bhkd->bhgqk", mq.view(B, Hkv, group, nq, D), mk)  # GQA without a repeat
        return rank_and_pack(raw.reshape(B, Hq, nq, nk), sq, sk, sim_thr, cdf_t, topk_t, q_len=Lq, kv_len=Lk,
                             block_q=block_q, block_k=block_k, scale=scale, causal=causal, sink=attention_sink,
                             kernel=q.is_cuda and work == torch.float32 and block_select.fits(nk))


def rank_and_pack(raw: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor, sim_thr: torch.Tensor,
                  cdf_t: torch.Tensor | None, topk_t: torch.Tensor | None, *, q_len: int, kv_len: int, block_q: int,
                  block_k: int, scale: float, causal: bool, sink: bool, kernel: bool) -> BlockLayout:
    """Steps 3-6 and the packing, from the pooled statistics.

    raw ``[B, Hq, Qb, Kb]`` (pooled q . pooled k, unscaled), sq ``[B, Hq, Qb]``, sk ``[B, Hkv, Kb]``;
    sim_thr and exactly one of cdf_t / topk_t ``[1, Hq, 1]``. ``kernel``: one Triton program per
    query-block row (``ops/block_select``, fp32, CUDA or the interpreter) instead of the PyTorch ops
    below, its twin.
    """
    B, Hq, nq, nk = raw.shape
    Hkv, dev = sk.shape[1], raw.device
    if kernel:
        counts, indices, mask_ids, n_full = block_select.select_pack(
            raw, sq, sk, sim_thr.view(Hq), (topk_t if topk_t is not None else cdf_t).view(Hq),
            topk=topk_t is not None, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k, scale=scale,
            causal=causal, sink=sink, has_mask=causal and bool(causal_masks(q_len, kv_len, block_q, block_k)))
        return layout_from_packed(counts, indices, mask_ids, n_full, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                  block_k=block_k, causal=causal)
    sk = sk[:, :, None].expand(B, Hkv, Hq // Hkv, nk).reshape(B, Hq, nk)  # [B, Hq, Kb]
    q_similar = sq >= sim_thr                                   # [B, Hq, Qb]
    k_similar = sk >= sim_thr                                   # [B, Hq, Kb]
    vis, _ = visible_blocks(q_len, kv_len, block_q, block_k, causal, dev)  # [Qb, Kb]
    always = ~q_similar[..., :, None] | ~k_similar[..., None, :]      # [B, Hq, Qb, Kb]
    if causal:  # the diagonal block, and those of the rows before its first key
        always = always | own_blocks(q_len, kv_len, block_q, block_k, dev)
    if sink:
        always = always | (torch.arange(nk, device=dev) == 0)
    cand = vis & k_similar[..., None, :]
    ranked = select_ranked(raw * scale, cand, cdfthreshd=cdf_t, topk=topk_t, n_visible=vis.sum(-1))
    keep = (ranked | always) & vis
    # == BlockLayout.from_block_mask(keep) & patterns.causal(Lq, Lk) under causal, packed in place with no
    # host sync (this runs on every forward); on CUDA the kernels' schedule comes with it
    return layout_from_keep(keep, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k, causal=causal)
