"""Grouped attention: packed query slices, each attending its own (possibly shared) K/V slice.

Packed tensors are ``[total_tokens, H, D]``. A :class:`Group` ``(q_start, q_end, k_start, k_end)``
says query tokens ``q[q_start:q_end]`` attend keys/values ``k[k_start:k_end]`` / ``v[k_start:k_end]``.
Unlike varlen attention, K/V slices may overlap between groups: zigzag (llama3) context parallelism
gives each rank two query chunks that attend different prefixes of the same all-gathered K/V.
Query slices must not overlap; query tokens in no group get output 0 and LSE ``-inf``.

Causal masking is bottom-right aligned per group (query i of a group sees key j of its slice iff
``j <= i + k_len - q_len``), as in :func:`sparse_attn.varlen_attention`.

``grouped_attention_loop`` is the prototype: one :func:`sparse_attn.attention` call per group (the
Triton kernel on CUDA, the PyTorch reference elsewhere). It stays public as the reference and a
benchmark provider once a one-launch grouped kernel exists.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence

import torch

from .layout import BlockLayout
from .validation import check_qkv, check_scale

PatternFn = Callable[[int, int], BlockLayout]


@dataclasses.dataclass(frozen=True)
class Group:
    """Query tokens ``[q_start, q_end)`` attend K/V tokens ``[k_start, k_end)`` (packed token indices)."""
    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def k_len(self) -> int:
        return self.k_end - self.k_start


def groups_from_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[Group]:
    """Groups from varlen-style offsets: group g is ``q[cu_q[g]:cu_q[g+1]]`` attending
    ``k[cu_k[g]:cu_k[g+1]]`` (consecutive, non-overlapping slices on both sides; for overlapping K/V
    build the :class:`Group` list directly). Both: 1-D int32 ``[G + 1]``, non-decreasing."""
    vals = []
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be a 1-D int32 tensor [num_groups + 1] (at least 2 entries), got {got}")
        v = cu.tolist()
        for i in range(len(v) - 1):
            if v[i + 1] < v[i]:
                raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={v[i]} > {name}[{i + 1}]={v[i + 1]}")
        vals.append(v)
    cq, ck = vals
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} groups, cu_seqlens_k has {len(ck) - 1}: they must match")
    return [Group(cq[g], cq[g + 1], ck[g], ck[g + 1]) for g in range(len(cq) - 1)]


def check_groups(groups: Sequence[Group], tq: int, tk: int) -> list[Group]:
    """Return the groups as a list after checking bounds and that query slices do not overlap."""
    if isinstance(groups, Group) or not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be a list of sparse_attn.Group, got {type(groups).__name__}"
                        + (": wrap a single group in a list" if isinstance(groups, Group) else ""))
    if len(groups) == 0:
        raise ValueError("groups is empty: give at least one Group(q_start, q_end, k_start, k_end)")
    for i, g in enumerate(groups):
        if not isinstance(g, Group):
            raise TypeError(f"groups[{i}] must be a sparse_attn.Group, got {type(g).__name__}: "
                            "use Group(q_start, q_end, k_start, k_end)")
        for f in ("q_start", "q_end", "k_start", "k_end"):
            x = getattr(g, f)
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"groups[{i}].{f} must be a Python int, got {type(x).__name__} ({x!r}): "
                                "convert tensor bounds with int() or .tolist()")
        for side, a, e, total, name in (("q", g.q_start, g.q_end, tq, "q"), ("k", g.k_start, g.k_end, tk, "k/v")):
            if a < 0 or e > total:
                raise ValueError(f"groups[{i}] {side} slice [{a}, {e}) is out of range: {name} has {total} "
                                 f"tokens, bounds must lie in [0, {total}]")
            if e < a:
                raise ValueError(f"groups[{i}] has {side}_end={e} < {side}_start={a}: {side}_end must be >= {side}_start")
    order = sorted(range(len(groups)), key=lambda i: (groups[i].q_start, groups[i].q_end))
    prev = None
    for i in order:
        g = groups[i]
        if g.q_len == 0:
            continue
        if prev is not None and g.q_start < groups[prev].q_end:
            p = groups[prev]
            raise ValueError(f"query slices overlap: groups[{prev}] has q [{p.q_start}, {p.q_end}) and groups[{i}] "
                             f"has q [{g.q_start}, {g.q_end}); each query token may belong to at most one group")
        prev = i
    return list(groups)


def _check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"grouped q/k/v must be packed [total_tokens, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    check_qkv(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2))


def grouped_attention_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[Group], *,
                           causal: bool = True, scale: float | None = None, return_lse: bool = False,
                           pattern: PatternFn | None = None):
    """Grouped attention as one :func:`sparse_attn.attention` call per group (same arguments and
    result as :func:`grouped_attention`). Outputs are assembled out of place (``torch.cat``), so
    autograd reaches q, k and v, and gradients of overlapping K/V slices add up."""
    from .api import attention
    _check_packed(q, k, v)
    check_scale(scale)
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    groups = check_groups(groups, tq, k.shape[0])
    layouts: dict = {}  # (q_len, kv_len) -> layout, one pattern call per distinct shape
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (q_start, out [L, Hq, Dv], lse [Hq, L])
    for g in groups:
        if g.q_len == 0:
            continue
        if g.k_len == 0:  # nothing to see: zeros that keep q/k/v in the graph (zero grads)
            anchor = (q[:0].sum() + k[:0].sum() + v[:0].sum()).to(q.dtype)
            pieces.append((g.q_start, q.new_zeros(g.q_len, hq, dv) + anchor,
                           torch.full((hq, g.q_len), float("-inf"), device=q.device)))
            continue
        layout = None
        if pattern is not None:
            key = (g.q_len, g.k_len)
            if key not in layouts:
                layouts[key] = pattern(g.q_len, g.k_len)
            layout = layouts[key]
        qs = q[g.q_start:g.q_end].transpose(0, 1)[None]
        ks = k[g.k_start:g.k_end].transpose(0, 1)[None]
        vs = v[g.k_start:g.k_end].transpose(0, 1)[None]
        o, lse = attention(qs, ks, vs, layout, causal=causal, scale=scale, return_lse=True)
        pieces.append((g.q_start, o[0].transpose(0, 1), lse[0].float()))
    out, lse = _assemble(pieces, q, tq, hq, dv)
    return (out, lse) if return_lse else out


def _assemble(pieces, q, tq, hq, dv):
    """Concatenate the group pieces in token order, zero / -inf for tokens in no group."""
    outs, lses, pos = [], [], 0
    for start, o, lse in sorted(pieces, key=lambda p: p[0]):
        if start > pos:
            outs.append(q.new_zeros(start - pos, hq, dv))
            lses.append(torch.full((hq, start - pos), float("-inf"), device=q.device))
        outs.append(o.to(q.dtype))
        lses.append(lse)
        pos = start + o.shape[0]
    if pos < tq:
        outs.append(q.new_zeros(tq - pos, hq, dv))
        lses.append(torch.full((hq, tq - pos), float("-inf"), device=q.device))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[Group], *,
                      causal: bool = True, scale: float | None = None, return_lse: bool = False,
                      pattern: PatternFn | None = None):
    """Attention of packed query slices over their own, possibly overlapping, K/V slices.

    Args:
        q: ``[Tq, Hq, D]`` packed queries; k: ``[Tk, Hkv, D]``; v: ``[Tk, Hkv, Dv]``; one dtype and
            device; ``Hq % Hkv == 0`` (GQA/MQA).
        groups: list of :class:`Group` ``(q_start, q_end, k_start, k_end)`` (Python ints): query tokens
            ``[q_start, q_end)`` attend K/V tokens ``[k_start, k_end)``. Query slices must not overlap;
            K/V slices may (e.g. zigzag llama3 context parallelism: group g attends ``k[0:end_g]``).
            For consecutive varlen-style slices use :func:`groups_from_cu_seqlens`.
        causal: bottom-right aligned per group: query i of a group sees key j of its slice iff
            ``j <= i + k_len - q_len``. Default True.
        scale: softmax scale; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp, fp32 ``[Hq, Tq]``.
        pattern: optional ``pattern(q_len, kv_len) -> BlockLayout`` called per group shape (as in
            :func:`sparse_attn.varlen_attention`), intersected with causal when ``causal``.

    Returns:
        ``out [Tq, Hq, Dv]`` in q's dtype, or ``(out, lse)``. Query tokens in no group (and rows that
        see no key) get output 0 and LSE ``-inf``.

    Today this runs :func:`grouped_attention_loop` (one attention call per group).
    """
    return grouped_attention_loop(q, k, v, groups, causal=causal, scale=scale, return_lse=return_lse,
                                  pattern=pattern)
