"""Pure-PyTorch reference attention: the semantics every kernel must match.

Runs on any device, accumulates in fp32 (fp64 for fp64 inputs, which makes it the test oracle),
processes one query block at a time over only the keys its layout row visits, so memory stays
O(B * H * block_q * visited keys), and handles GQA by viewing query heads as ``[Hkv, group]``
instead of repeating K/V. A query row with no allowed key gets output 0 and LSE -inf, never NaN.

Under autograd the forward keeps only q, k, v and the LSE (:class:`_RecomputingAttention`): the
backward recomputes each block's probabilities, so training memory is linear in the length too
(autograd over the chunk loop kept every chunk's scores, O(L^2 H) under causal masking). The
backward is written in differentiable ops, so double backward still works.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layout import BlockLayout, LayoutError
from .masks import allowed
from .validation import check_causal, check_qkv, check_scale


def visited_keys(layout: BlockLayout, qb: int) -> tuple[int, int, torch.Tensor | None]:
    """The keys any (batch, head) row of query block ``qb`` visits: ``(j0, j1, cols)``. ``cols`` is
    None when the visited key blocks are one contiguous run, then the keys are ``[j0, j1)``
    (``j0 == j1``: none); otherwise ``cols`` (int64, sorted) lists the visited keys and ``[j0, j1)``
    spans them. Listing them keeps memory O(rows x visited keys) for layouts whose visited blocks
    spread over the whole prefix (attention sinks + window, random, BigBird). Host sync."""
    counts = layout.kv_counts[:, :, qb].long()
    valid = torch.arange(layout.max_k, device=layout.device) < counts[..., None]
    blocks = torch.unique(layout.kv_indices[:, :, qb].long()[valid])  # sorted
    if blocks.numel() == 0:
        return 0, 0, None
    first, last = int(blocks[0]), int(blocks[-1])
    j0, j1 = first * layout.block_k, min((last + 1) * layout.block_k, layout.kv_len)
    if blocks.numel() == last - first + 1:
        return j0, j1, None
    cols = (blocks[:, None] * layout.block_k + torch.arange(layout.block_k, device=blocks.device)).flatten()
    return j0, j1, cols[cols < layout.kv_len]


def token_mask_rows(layout: BlockLayout, r0: int, r1: int, j0: int = 0, j1: int | None = None,
                    cols: torch.Tensor | None = None) -> torch.Tensor:
    """bool [Bl, Hl, r1 - r0, K]: the layout's pattern for query rows [r0, r1) (inside one query
    block) and keys [j0, j1) (K = j1 - j0), or the keys ``cols`` (int64, K = len(cols)) when given."""
    j1 = layout.kv_len if j1 is None else j1
    qb = r0 // layout.block_q
    nk = layout.num_kv_blocks
    counts = layout.kv_counts[:, :, qb].long()
    idx = layout.kv_indices[:, :, qb].long()
    mids = layout.kv_mask_ids[:, :, qb].long()
    valid = torch.arange(layout.max_k, device=layout.device) < counts[..., None]
    bmap = torch.full((layout.batch, layout.heads, nk + 1), -2, dtype=torch.long, device=layout.device)
    bmap.scatter_(2, torch.where(valid, idx, nk), torch.where(valid, mids, -2))  # slot nk swallows padding
    j = torch.arange(j0, j1, device=layout.device) if cols is None else cols.to(layout.device)
    tok = bmap[..., j // layout.block_k]  # [Bl, Hl, K]: each key's mask id in its block's entry
    out = (tok == -1)[:, :, None, :].expand(-1, -1, r1 - r0, -1).clone()
    p = torch.arange(r0, r1, device=layout.device) + (layout.kv_len - layout.q_len)
    for m, em in enumerate(layout.masks):
        sel = tok == m
        if sel.any():
            out |= sel[:, :, None, :] & allowed(em, p, j)
    return out


def row_chunks(q_len: int, chunk: int) -> range:
    """First rows of the query chunks, LAST chunk first. Under causal masking each chunk sees more keys
    than the one before, so its temporaries are larger. Walked in order, every allocation outgrew the
    blocks glibc had kept from the last, and the process grew with the sum of all chunks: 1.8 GiB of
    peak RSS for a 16K causal forward (4 heads, D=16) whose live tensors are about 0.2 GiB. Walked
    largest first, later chunks reuse the freed memory: 0.24 GiB, and 4x faster (fewer page faults)."""
    return reversed(range(0, q_len, chunk))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference's accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_frame(layout: BlockLayout, B: int, Hq: int, Lq: int, Lk: int) -> None:
    """The layout's own shape facts against q/k's (no device sync): this module is public as the test
    oracle, and a layout for other lengths gave a silently wrong result or an IndexError deep inside; a
    transpose() ran as a pattern of its own, its masks in the wrong frame."""
    layout.check_token_frame("reference.attention")
    if (layout.q_len, layout.kv_len) != (Lq, Lk) or layout.batch not in (1, B) or layout.heads not in (1, Hq):
        raise LayoutError(f"reference.attention: the layout is for q_len={layout.q_len}, kv_len={layout.kv_len}, "
                          f"batch={layout.batch}, heads={layout.heads} but q/k have Lq={Lq}, Lk={Lk}, B={B}, Hq={Hq} "
                          "(batch and heads may also be 1)")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout | None = None, *,
              causal: bool = False, scale: float | None = None, return_lse: bool = False,
              _lowp: bool = False, _round_p=None, _acc_lse: bool = False):
    """Reference block-sparse attention.

    Args:
        q: ``[B, Hq, Lq, D]``; k: ``[B, Hkv, Lk, D]``; v: ``[B, Hkv, Lk, Dv]``; ``Hq % Hkv == 0``.
        layout: a :class:`BlockLayout` for ``(Lq, Lk)`` with batch in {1, B} and heads in {1, Hq};
            None means every key.
        causal: additionally mask keys after the query, bottom-right aligned
            (query i sees keys j <= i + Lk - Lq).
        scale: softmax scale, default ``1/sqrt(D)``.
        return_lse: also return the natural-log sum-exp of the scaled, masked scores, fp32 ``[B, Hq, Lq]``.

    Returns: out ``[B, Hq, Lq, Dv]`` in q's dtype (and lse).

    ``_lowp`` (tests only) rounds as a fused kernel does, forward and backward: the "same-dtype reference" of
    the tolerance rule (sparse_attn.testing), whose error against the fp64 oracle sets the kernels'
    tolerance. Values: fp32 scores and P.V, probabilities rounded to the input dtype for P.V. Gradients
    (:func:`attention_backward` with ``_fused_out``): fp32 products, P and dS rounded to the input dtype
    before the products that take them, delta from the rounded output. ``_round_p`` (the 8-bit twin,
    ops/sage/reference.py) rounds the probabilities used in P.V (not those in the normaliser), as an FP8
    P.V kernel does. ``_acc_lse`` (:mod:`sparse_attn.reference_op`) keeps the LSE in the accumulation
    dtype, float64 for float64 inputs: its explicit backward recomputes P from that LSE, and an fp32 one
    cost float64 gradients about 1e-5 of their size.
    """
    check_qkv(q, k, v)  # public as the oracle: a GQA mismatch failed in a view() deep inside
    causal, scale = check_causal(causal), check_scale(scale)  # as the API: causal="False" ran causal
    if layout is not None:
        _check_frame(layout, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        layout._ensure_valid()  # a hand-built layout with an index past the grid ran silently here
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # fp32 accumulation as documented: under CPU autocast the products ran in bf16 while the backward
    # recomputed in fp32 from that LSE (gradients ~4x worse than bf16 inputs without autocast)
    with torch.autocast(q.device.type, enabled=False):
        if _recomputes(q, k, v, _round_p):
            out, lse = _RecomputingAttention.apply(q, k, v, layout, causal, scale, _lowp)
        else:
            out, lse = _forward(q, k, v, layout, causal, scale, _fused_rounding(q.dtype) if _lowp else _round_p)
    if not return_lse:
        return out
    return out, lse if _acc_lse else lse.to(torch.float32)


def _recomputes(q, k, v, round_p) -> bool:
    """Whether autograd records this call through :class:`_RecomputingAttention` rather than op by op:
    whenever it records at all, except for the 8-bit twin's rounding (whose gradients nobody takes)
    and while torch.compile traces (it traces the plain ops)."""
    return (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)) and round_p is None
            and not torch.compiler.is_compiling())


def _fused_rounding(dtype: torch.dtype):
    """A fused kernel's rounding of the probabilities it multiplies: to the input dtype, kept in fp32."""
    return lambda t: t.to(dtype).to(t.dtype)


class _RecomputingAttention(torch.autograd.Function):
    """The reference under autograd with linear memory: the forward saves q, k, v and the LSE (in the
    accumulation dtype: the backward recomputes P = exp(s - lse) from it, and an fp32 LSE would cost
    float64 gradients about 1e-5 of their size), the backward is :func:`attention_backward`.
    ``fused``: ``_lowp``'s fused-kernel rounding, forward and backward (the output is saved too: the
    backward takes delta from it).

    Recording the chunk loop op by op kept every chunk's masked scores and probabilities: for a causal
    8K forward with 2 heads and D=16, 880 MiB of saved tensors against 3 MiB of inputs. The backward's ops
    are differentiable, so under ``create_graph=True`` autograd records them and double backward works
    (with the quadratic memory that recording costs)."""

    @staticmethod
    def forward(q, k, v, layout, causal, scale, fused):
        return _forward(q, k, v, layout, causal, scale, _fused_rounding(q.dtype) if fused else None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, layout, causal, scale, fused = inputs
        ctx.save_for_backward(q, k, v, output[1], output[0] if fused else None)
        ctx.layout, ctx.causal, ctx.scale = layout, causal, scale
        ctx.fingerprint = None if layout is None else layout._fingerprint()

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, lse, out = ctx.saved_tensors
        if ctx.layout is not None and ctx.layout._fingerprint() != ctx.fingerprint:
            # the layout is held as an object: an edit in place gave gradients of the edited layout, silently
            raise RuntimeError("sparse_attn: the layout was modified after the forward that used it; the backward "
                               "needs the layout the forward ran (edit a copy, or run the forward again)")
        with torch.autocast(q.device.type, enabled=False):
            grads = attention_backward(do, dlse, q, k, v, lse, ctx.layout, causal=ctx.causal, scale=ctx.scale,
                                       _fused_out=out)
        return (*grads, None, None, None, None)


def _forward(q, k, v, layout, causal, scale, round_p):
    """The chunk loop of :func:`attention`: ``(out in q's dtype, lse in the accumulation dtype)``, both
    products accumulated in fp32 (fp64 for fp64 inputs). ``round_p`` rounds the probabilities used in
    P.V (not those in the normaliser)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    acc = acc_dtype(q.dtype)
    kf, vf = k.to(acc), v.to(acc)
    chunk = layout.block_q if layout is not None else 128
    outs, lses = [], []
    for r0 in row_chunks(Lq, chunk):
        r1 = min(r0 + chunk, Lq)
        keys = chunk_keys(layout, r0, r1, Lq, Lk, causal, q.device)
        if keys is None:  # no key visible to any row of this chunk
            outs.append(q.new_zeros(B, Hq, r1 - r0, Dv, dtype=acc) + graph_anchor(q, k, v, acc))
            lses.append(torch.full((B, Hq, r1 - r0), float("-inf"), device=q.device, dtype=acc)
                        + graph_anchor(q, k, v, acc))  # a loss on the LSE alone must still backward()
            continue
        kc, vc = keys.take(kf), keys.take(vf)
        qc = q[:, :, r0:r1].to(acc).view(B, Hkv, group, r1 - r0, D)
        s = torch.einsum("bhgqd,bhkd->bhgqk", qc, kc) * scale
        s = s.masked_fill(~_heads_as_groups(keys.ok, Hkv, group), float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: avoid inf - inf
        e = torch.exp(s - m)
        denom = e.sum(-1, keepdim=True)
        e_pv = e if round_p is None else round_p(e)
        o = torch.einsum("bhgqk,bhkd->bhgqd", e_pv, vc)
        o = o / torch.where(denom > 0, denom, torch.ones_like(denom))
        outs.append(o.reshape(B, Hq, r1 - r0, Dv))
        lses.append((m + torch.log(denom)).reshape(B, Hq, r1 - r0))
    if not outs:  # no query rows: an empty output, still in the graph (as SDPA's), so backward() runs
        outs.append(q.new_zeros(B, Hq, 0, Dv, dtype=acc) + graph_anchor(q, k, v, acc))
    outs.reverse()  # row_chunks runs last rows first
    lses.reverse()
    out = torch.cat(outs, 2).to(q.dtype)
    lse = torch.cat(lses, 2) if lses else q.new_zeros(B, Hq, 0, dtype=acc) + graph_anchor(q, k, v, acc)
    return out, lse


class ChunkKeys(NamedTuple):
    """The keys query rows ``[r0, r1)`` may see: ``[j0, j1)`` when ``cols`` is None, else the keys
    ``cols``; ``j`` those keys' positions (int64 [K]); ``ok`` bool ``[Bl, Hl, r1 - r0, K]``, the
    layout's pattern (and ``causal``) on them."""

    j0: int
    j1: int
    cols: torch.Tensor | None
    j: torch.Tensor
    ok: torch.Tensor

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """``t [B, H, Lk, X]`` restricted to these keys: ``[B, H, K, X]``."""
        return t[:, :, self.j0:self.j1] if self.cols is None else t.index_select(2, self.j)

    def add_into(self, acc: torch.Tensor, part: torch.Tensor) -> None:
        """``acc[:, :, keys] += part`` (``acc [B, H, Lk, X]``, ``part [B, H, K, X]``)."""
        if self.cols is None:
            acc[:, :, self.j0:self.j1] += part
        else:
            acc.index_add_(2, self.j, part)


def chunk_keys(layout: BlockLayout | None, r0: int, r1: int, Lq: int, Lk: int, causal: bool,
               device) -> ChunkKeys | None:
    """The keys query rows ``[r0, r1)`` (inside one query block of ``layout``) may see, or None
    when no row of them sees any key. Only the visited key blocks: memory O(rows x visited keys)."""
    j0, j1, cols = (0, Lk, None) if layout is None else visited_keys(layout, r0 // layout.block_q)
    if causal:
        j1 = max(j0, min(j1, r1 + Lk - Lq))
        cols = None if cols is None else cols[cols < j1]
    if j1 <= j0 or (cols is not None and cols.numel() == 0):
        return None
    j = torch.arange(j0, j1, device=device) if cols is None else cols.to(device)
    ok = torch.ones(1, 1, r1 - r0, j.numel(), dtype=torch.bool, device=device)
    if layout is not None:
        ok = token_mask_rows(layout, r0, r1, j0, j1, cols=cols).to(device)
    if causal:
        p = torch.arange(r0, r1, device=device) + (Lk - Lq)
        ok = ok & (j[None, :] <= p[:, None])
    return ChunkKeys(j0, j1, None if cols is None else j, j, ok)


def _check_backward_args(do, dlse, q, k, v, lse, layout) -> None:
    """:func:`attention_backward`'s arguments against each other, as :func:`attention` checks its own:
    a layout for other lengths or mismatched heads failed deep inside (IndexError, a view's size)."""
    check_qkv(q, k, v)
    B, Hq, Lq = q.shape[:3]
    want = {"do": (B, Hq, Lq, v.shape[-1]), "lse": (B, Hq, Lq), "dlse": (B, Hq, Lq)}
    for name, t in (("do", do), ("lse", lse), ("dlse", dlse)):
        if t is not None and tuple(t.shape) != want[name]:
            raise ValueError(f"attention_backward: {name} has shape {tuple(t.shape)}, expected {want[name]} "
                             f"(q {tuple(q.shape)}, v {tuple(v.shape)})")
    if layout is not None:
        _check_frame(layout, B, Hq, Lq, k.shape[2])


def attention_backward(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, lse: torch.Tensor, layout: BlockLayout | None = None, *,
                       causal: bool = False, scale: float | None = None, _fused_out: torch.Tensor | None = None):
    """Gradients of :func:`attention` without autograd: ``(dq, dk, dv)`` shaped and typed as q, k, v.

    ``do [B, Hq, Lq, Dv]`` is the output's gradient, ``dlse [B, Hq, Lq]`` the LSE's (None: the loss
    did not use it), ``lse`` the forward's. Per query block, as the forward: P = exp(s - lse) on the
    visited keys, dV += Pᵀ dO, dS = P (dP - rowsum(P dP) + dLSE) with dP = dO Vᵀ (the row sum over the
    block's keys is over every key the row sees, so no forward output is needed), dQ = scale dS K,
    dK += scale dSᵀ Q. For callers where autograd cannot record (a custom op's kernel,
    sparse_attn.reference_op); accumulates in fp32 (fp64 for fp64 inputs).

    ``_fused_out`` (tests only: ``attention(_lowp=True)``) is the forward's output, rounded to the input
    dtype. Given it, the gradients round as the Triton backward does: delta = rowsum(out * dO) - dLSE
    from that output (a fused kernel has no other), P rounded to the input dtype for dV = Pᵀ dO, dS
    rounded to it for dQ and dK. The same-dtype reference's gradients had run every product in the
    input dtype, scores included: a yardstick so loose that at x10 inputs gradients 3% too large passed.
    """
    _check_backward_args(do, dlse, q, k, v, lse, layout)
    causal, scale = check_causal(causal), check_scale(scale)  # causal="False" computed causal gradients
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = acc_dtype(q.dtype)
    kf, vf = k.to(acc), v.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    fused = _fused_out is not None
    rnd = _fused_rounding(q.dtype) if fused else (lambda t: t)
    if fused:
        delta = (_fused_out.to(acc) * do.to(acc)).sum(-1)  # [B, Hq, Lq]
        delta = delta if dlse is None else delta - dlse.to(acc)
    chunk = layout.block_q if layout is not None else 128
    for r0 in row_chunks(Lq, chunk):
        r1 = min(r0 + chunk, Lq)
        keys = chunk_keys(layout, r0, r1, Lq, Lk, causal, q.device)
        if keys is None:  # no key: zero gradients
            continue
        R = r1 - r0
        kc, vc = keys.take(kf), keys.take(vf)
        qc = q[:, :, r0:r1].to(acc).view(B, Hkv, group, R, D)
        doc = do[:, :, r0:r1].to(acc).view(B, Hkv, group, R, -1)
        lse_c = lse[:, :, r0:r1].to(acc).view(B, Hkv, group, R, 1)
        lse_c = torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), lse_c)  # rows without keys: s is -inf
        s = torch.einsum("bhgqd,bhkd->bhgqk", qc, kc) * scale
        s = s.masked_fill(~_heads_as_groups(keys.ok, Hkv, group), float("-inf"))
        p = torch.exp(s - lse_c)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", doc, vc)
        if fused:
            ds = dp - delta[:, :, r0:r1].view(B, Hkv, group, R, 1)
        else:
            ds = dp - (p * dp).sum(-1, keepdim=True)
            if dlse is not None:
                ds = ds + dlse[:, :, r0:r1].to(acc).view(B, Hkv, group, R, 1)
        ds = rnd(p * ds)
        keys.add_into(dv, torch.einsum("bhgqk,bhgqd->bhkd", rnd(p), doc))
        keys.add_into(dk, torch.einsum("bhgqk,bhgqd->bhkd", ds, qc) * scale)
        dq[:, :, r0:r1] = torch.einsum("bhgqk,bhkd->bhgqd", ds, kc).reshape(B, Hq, R, D) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def graph_anchor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An exact zero scalar (empty-slice sums) that depends on q, k and v: added to an output no
    attention product made (rows that see no key, no rows at all), it keeps backward() working and
    gives q, k and v zero gradients."""
    return (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum()).to(dtype)


def _heads_as_groups(ok: torch.Tensor, hkv: int, group: int) -> torch.Tensor:
    """[Bl, Hl, R, Lk] with Hl in {1, Hq} -> broadcastable [Bl, Hkv|1, group|1, R, Lk]."""
    bl, hl = ok.shape[:2]
    if hl == 1:
        return ok[:, :, None]
    return ok.view(bl, hkv, group, *ok.shape[2:])
