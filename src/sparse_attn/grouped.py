"""Grouped attention: packed query slices, each attending its own (possibly shared) K/V slice.

Packed tensors are ``[total_tokens, H, D]``. A :class:`Group` ``(q_start, q_end, k_start, k_end)``
says query tokens ``q[q_start:q_end]`` attend keys/values ``k[k_start:k_end]`` / ``v[k_start:k_end]``.
Unlike varlen attention, K/V slices may overlap between groups: zigzag (llama3) context parallelism
gives each rank two query chunks that attend different prefixes of the same all-gathered K/V.
Query slices must not overlap; query tokens in no group get output 0 and LSE ``-inf``.

Causal masking is bottom-right aligned per group (query i of a group sees key j of its slice iff
``j <= i + k_len - q_len``), as in :func:`sparse_attn.varlen_attention`.

On CUDA :func:`grouped_attention` runs every group in ONE kernel launch (forward) and one dQ plus
one dK/dV launch (backward): the per-group layouts are stacked along the batch dimension (one batch
row per group, as varlen does), the kernels read each group's bounds from int32 (start, end) pairs
(``seq_step`` 2), and the dK/dV of overlapping K/V slices go through a scratch buffer that is
summed into dK/dV in fp32 (see ``ops/block_sparse/launch.backward``). Elsewhere it runs
:func:`grouped_attention_loop`: one :func:`sparse_attn.attention` call per group (the PyTorch
reference on the CPU), which stays public as the reference and as a benchmark provider.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence

import torch

from .device_guard import on_inputs_device
from .layout import BlockLayout, layout_key
from .plan_cache import PlanCache
from .reference import graph_anchor
from .validation import autocast_inputs, check_causal, check_flags, check_not_capturing, check_packed_qkv, check_scale

PatternFn = Callable[[int, int], BlockLayout]

# tests: send CPU tensors down the kernel path (which then runs under TRITON_INTERPRET=1)
FORCE_KERNELS = False


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
        check_not_capturing("groups_from_cu_seqlens", cu, f"it reads {name} on the host",
                            "Build the groups before capturing; grouped_attention() itself takes host groups.")
        v = cu.tolist()
        if v[0] != 0:  # as varlen_attention's offsets; a negative start was reported later, as groups[0]'s
            raise ValueError(f"{name} must start at 0, got {name}[0]={v[0]}")
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


def grouped_attention_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[Group], *,
                           causal: bool = True, scale: float | None = None, return_lse: bool = False,
                           layouts: Sequence[BlockLayout | None] | None = None, pattern: PatternFn | None = None):
    """Grouped attention as one :func:`sparse_attn.attention` call per group (same arguments and
    result as :func:`grouped_attention`). Outputs are assembled out of place (``torch.cat``), so
    autograd reaches q, k and v, and gradients of overlapping K/V slices add up."""
    from .api import attention
    check_packed_qkv(q, k, v, "grouped_attention")
    scale, causal = check_scale(scale), check_causal(causal)
    check_flags(return_lse=return_lse)
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    groups = check_groups(groups, tq, k.shape[0])
    _check_layout_args(layouts, pattern, groups, q.shape[1])
    run = [i for i, g in enumerate(groups) if g.q_len > 0 and g.k_len > 0]
    per_group = _loop_layouts(groups, run, layouts, pattern, hq)
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (q_start, out [L, Hq, Dv], lse [Hq, L])
    for g in groups:
        if g.q_len > 0 and g.k_len == 0:  # nothing to see: zeros that keep q/k/v in the graph (zero grads)
            pieces.append((g.q_start, q.new_zeros(g.q_len, hq, dv) + graph_anchor(q, k, v, q.dtype),
                           torch.full((hq, g.q_len), float("-inf"), device=q.device)))
    for i in run:
        g = groups[i]
        qs = q[g.q_start:g.q_end].transpose(0, 1)[None]
        ks = k[g.k_start:g.k_end].transpose(0, 1)[None]
        vs = v[g.k_start:g.k_end].transpose(0, 1)[None]
        o, lse = attention(qs, ks, vs, per_group.get(i), causal=causal, scale=scale, return_lse=True)
        pieces.append((g.q_start, o[0].transpose(0, 1), lse[0].float()))
    out, lse = _assemble(pieces, q, tq, hq, dv)
    if not pieces:  # no group has queries: all zeros, still in the graph (as the kernel path's)
        out = out + graph_anchor(q, k, v, q.dtype)
    if not run:  # no attention ran: a loss on the LSE alone must still backward()
        lse = lse + graph_anchor(q, k, v, lse.dtype)
    return (out, lse) if return_lse else out


def _loop_layouts(groups, run, layouts, pattern, heads) -> dict:
    """The layouts of the groups that run (group index -> layout; empty for dense), all built and
    checked before any group is computed: a bad one for the last group used to surface only after
    the others had run, and mixed block sizes, which the kernels refuse, passed."""
    if layouts is None and pattern is None:
        return {}
    from .varlen import build_layouts
    built = build_layouts([groups[i].q_len for i in run], [groups[i].k_len for i in run],
                          None if layouts is None else [layouts[i] for i in run], pattern, False, heads=heads,
                          unit="group", names=run)
    return dict(zip(run, built))


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
    if pos < tq or not outs:  # (no query tokens at all: empty tensors)
        outs.append(q.new_zeros(tq - pos, hq, dv))
        lses.append(torch.full((hq, tq - pos), float("-inf"), device=q.device))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _check_layout_args(layouts, pattern, groups: Sequence[Group], heads: int) -> None:
    """layouts= / pattern= as varlen checks them; a layout given for a group with no queries or no keys
    must still be one for that group (it is not run, but a wrong one is a caller's slip to report)."""
    from .varlen import check_layout_args, check_unit_layout
    check_layout_args(layouts, pattern, len(groups), "group")
    for i, g in enumerate(groups):
        if layouts is None:
            break
        if layouts[i] is None and g.q_len > 0 and g.k_len > 0:  # the CPU loop ran it dense, the kernels refused
            raise TypeError(f"layouts[{i}] is None but group {i} has {g.q_len} query and {g.k_len} key tokens: None "
                            "is only for an empty group; give its layout (patterns.dense(q_len, k_len) for every key)")
        if layouts[i] is not None and (g.q_len == 0 or g.k_len == 0):
            check_unit_layout(layouts[i], g.q_len, g.k_len, heads, "group", i)


# ----------------------------------------------------------------------------- the one-launch plan
@dataclasses.dataclass
class GroupedPlan:
    """What the kernels need for one groups signature, built once and cached (:func:`grouped_plan`).

    Only *run* groups (``q_len > 0`` and ``k_len > 0``) reach the kernels, heaviest (most blocks
    visited) first; batch row ``r`` of ``stacked`` is group ``run[r]``. Tensors live on the device the
    plan was built for.
    """
    pinned: tuple                   # the pattern / layouts whose ids are in the cache key
    run: tuple[int, ...]            # indices (into the given groups) of the groups the kernels run
    per_group: list                 # their layouts (causal folded in), as built
    stacked: BlockLayout | None     # one batch row per run group; None when no group runs
    cu_q: torch.Tensor | None       # int32 [2R]: (q_start, q_end) per run group
    cu_k: torch.Tensor | None       # int32 [2R]: (k_start, k_end) per run group
    max_q: int
    max_k: int
    kv_lens: tuple[int, ...]        # per run group (Python ints: schedule lookups never sync)
    cu_dk: torch.Tensor | None      # int32 [2R]: scratch (start, end) of each group's dK/dV rows
    dk_rows: torch.Tensor | None    # int64 [scratch rows]: scratch row -> row of k (None: written in place)
    free_rows: torch.Tensor | None  # int64: query rows in no run group (output 0, LSE -inf), None if none


_PLANS = PlanCache(16)


def grouped_plan(groups: Sequence[Group], tq: int, tk: int, *, layouts=None, pattern: PatternFn | None = None,
                 causal: bool = True, heads: int = 1, device="cpu") -> GroupedPlan:
    """The cached :class:`GroupedPlan` of checked ``groups`` over ``tq`` query / ``tk`` key tokens.
    The key holds the pattern / layout objects by identity; the entry keeps them alive so an id cannot
    be reused while it is cached."""
    device = torch.device(device)
    key = (tuple(dataclasses.astuple(g) for g in groups), tq, tk, causal, heads, str(device), id(pattern),
           None if layouts is None else tuple(layout_key(lay) for lay in layouts))
    return _PLANS.get(key, lambda: _build_plan(list(groups), tq, tk, layouts, pattern, causal, heads, device))


def _build_plan(groups, tq, tk, layouts, pattern, causal, heads, device) -> GroupedPlan:
    from . import varlen
    layouts = None if layouts is None else tuple(layouts)  # pinned as a tuple: see api._varlen_plan
    run = tuple(i for i, g in enumerate(groups) if g.q_len > 0 and g.k_len > 0)
    covered = torch.zeros(tq, dtype=torch.bool)
    for i in run:
        covered[groups[i].q_start:groups[i].q_end] = True
    free = (~covered).nonzero()[:, 0]
    free_rows = free.to(device) if free.numel() else None
    if not run:
        return GroupedPlan((pattern, layouts), run, [], None, None, None, 0, 0, (), None, None, free_rows)
    per_group = varlen.build_layouts([groups[i].q_len for i in run], [groups[i].k_len for i in run],
                                     None if layouts is None else [layouts[i] for i in run], pattern, causal,
                                     heads=heads, unit="group", names=run)
    # heaviest group first: the GPU hands out programs in grid order (query tiles, then batch rows), so
    # the long-running programs of a big group start early instead of forming the launch's tail
    order = sorted(range(len(run)), key=lambda r: -_work(per_group[r], heads))
    run, per_group = tuple(run[r] for r in order), [per_group[r] for r in order]
    rg = [groups[i] for i in run]
    q_lens, k_lens = [g.q_len for g in rg], [g.k_len for g in rg]
    max_q, max_k = max(q_lens), max(k_lens)
    stacked = varlen.stack([lay.to(device) for lay in per_group], max_q, max_k, heads)
    pairs = lambda a, b: torch.tensor([x for g in rg for x in (getattr(g, a), getattr(g, b))],  # noqa: E731
                                      dtype=torch.int32, device=device)
    cu_dk = dk_rows = None
    spans = sorted((g.k_start, g.k_end) for g in rg)
    tiles_k = spans[0][0] == 0 and spans[-1][1] == tk and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if not tiles_k:  # overlapping or partial K/V cover: each group's dK/dV rows go to a scratch buffer
        ends = torch.tensor(k_lens).cumsum(0)
        starts = ends - torch.tensor(k_lens)
        cu_dk = torch.stack([starts, ends], 1).flatten().to(torch.int32).to(device)
        dk_rows = torch.cat([torch.arange(g.k_start, g.k_end) for g in rg]).to(device)
    return GroupedPlan((pattern, layouts), run, per_group, stacked, pairs("q_start", "q_end"),
                       pairs("k_start", "k_end"), max_q, max_k, tuple(k_lens), cu_dk, dk_rows, free_rows)


def _work(layout: BlockLayout, heads: int) -> int:
    """Blocks the kernels visit for one layout (over all query heads): the group's cost estimate."""
    return int(layout.kv_counts.sum()) * (heads // layout.heads)


def _kernel_path(q, k, v, groups, causal, scale, return_lse, layouts, pattern):
    from .ops.block_sparse import grouped_attention_op
    plan = grouped_plan(groups, q.shape[0], k.shape[0], layouts=layouts, pattern=pattern, causal=causal,
                        heads=q.shape[1], device=q.device)
    if plan.stacked is None:  # no group has both queries and keys: zeros that keep q/k/v in the graph
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]) + graph_anchor(q, k, v, q.dtype)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device) + graph_anchor(q, k, v,
                                                                                                  torch.float32)
        return (out, lse) if return_lse else out
    return grouped_attention_op(q, k, v, plan.stacked, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, plan.kv_lens,
                                cu_dk=plan.cu_dk, dk_rows=plan.dk_rows, free_rows=plan.free_rows, scale=scale,
                                return_lse=return_lse)


@on_inputs_device()
def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[Group], *,
                      causal: bool = True, scale: float | None = None, return_lse: bool = False,
                      layouts: Sequence[BlockLayout | None] | None = None, pattern: PatternFn | None = None):
    """Attention of packed query slices over their own, possibly overlapping, K/V slices.

    Args:
        q: ``[Tq, Hq, D]`` packed queries; k: ``[Tk, Hkv, D]``; v: ``[Tk, Hkv, Dv]``; one dtype and
            device; ``Hq % Hkv == 0`` (GQA/MQA). The CUDA kernels take fp16/bf16 and ``Dv == D``.
        groups: list of :class:`Group` ``(q_start, q_end, k_start, k_end)`` (Python ints): query tokens
            ``[q_start, q_end)`` attend K/V tokens ``[k_start, k_end)``. Query slices must not overlap;
            K/V slices may (e.g. zigzag llama3 context parallelism: group g attends ``k[0:end_g]``).
            For consecutive varlen-style slices use :func:`groups_from_cu_seqlens`. Empty groups
            (``q_len`` 0, or ``k_len`` 0: its queries see nothing) are allowed.
        causal: bottom-right aligned per group: query i of a group sees key j of its slice iff
            ``j <= i + k_len - q_len``. Default True.
        scale: softmax scale; default ``1 / sqrt(D)``.
        return_lse: also return the log-sum-exp, fp32 ``[Hq, Tq]``.
        layouts: one :class:`BlockLayout` per group, built for that group's ``(q_len, k_len)`` (None
            for an empty group; all with one ``block_q x block_k``); or
        pattern: ``pattern(q_len, kv_len) -> BlockLayout`` called per group shape (as in
            :func:`sparse_attn.varlen_attention`: on CUDA the layouts are cached per groups signature
            and pattern object, so the pattern must be a pure function of its arguments); neither =
            dense. Intersected with causal when ``causal``.

    Returns:
        ``out [Tq, Hq, Dv]`` in q's dtype, or ``(out, lse)``. Query tokens in no group (and rows that
        see no key) get output 0, LSE ``-inf`` and gradient 0.

    CUDA: one forward launch for all groups, one dQ and one dK/dV launch backward; the per-group
    layouts, bounds and scratch offsets are built once per groups signature and cached. Elsewhere:
    :func:`grouped_attention_loop` (one reference call per group). The LSE is differentiable, as in
    :func:`sparse_attn.attention`. Under ``torch.compile`` on CUDA the call is a graph break
    (``fullgraph=False`` works; ``fullgraph=True`` fails in the host-side plan cache, H100, torch 2.11);
    on the CPU, a loop of reference calls, it also compiles with ``fullgraph=True`` given ``layouts=``
    or neither (``pattern=`` builds layouts inside the graph, data-dependent: ``fullgraph=False``).
    """
    q, k, v = autocast_inputs(q, k, v)  # as attention() does inside torch.autocast("cuda")
    if not (FORCE_KERNELS or (isinstance(q, torch.Tensor) and q.is_cuda)):
        return grouped_attention_loop(q, k, v, groups, causal=causal, scale=scale, return_lse=return_lse,
                                      layouts=layouts, pattern=pattern)
    check_packed_qkv(q, k, v, "grouped_attention")
    scale, causal = check_scale(scale), check_causal(causal)
    check_flags(return_lse=return_lse)
    groups = check_groups(groups, q.shape[0], k.shape[0])
    _check_layout_args(layouts, pattern, groups, q.shape[1])
    return _kernel_path(q, k, v, groups, causal, scale, return_lse, layouts, pattern)
