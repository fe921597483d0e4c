"""Helpers shared by the tests and the accuracy CLI: oracles, tolerance checks, inputs.

Two oracles, deliberately different code:

- :func:`oracle_attention` is :func:`sparse_attn.reference.attention` run in float64 (chunked,
  layout-driven) — the oracle kernels are measured against (the tolerance rule below).
- :func:`naive_masked_attention` is a full-matrix float64 softmax under a dense token mask — the
  independent check of the reference itself. O(Lq * Lk) memory: small sizes only.

Masking convention (as everywhere in the package): query row ``i`` sits at key position
``p = i + Lk - Lq`` (bottom-right alignment); a row with no allowed key gets output 0 and
LSE ``-inf``.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import metrics
from .reference import attention as reference_attention

__all__ = ["oracle_attention", "assert_close_to_oracle", "assert_grads_close_to_oracle",
           "assert_layout_grads_close_to_oracle", "split_and_fused_grads",
           "grads_per_launch_setting", "launch_settings", "launch_import_stderr", "QUANT_L1_BOUND",
           "default_atol_floor", "random_qkv",
           "random_packed_qkv", "ZERO_LENGTH_CASES", "check_zero_length_case", "check_non_finite_spread",
           "naive_masked_attention", "causal_token_mask", "element_mask_dense", "block_map_from_token_mask"]


# ----------------------------------------------------------------------------- oracles
def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout=None, *, causal: bool = False,
                     scale: float | None = None, return_lse: bool = False):
    """The reference attention in float64: q/k/v are upcast, the result stays float64.

    Shapes as :func:`sparse_attn.attention`: q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``,
    v ``[B, Hkv, Lk, Dv]`` -> out float64 ``[B, Hq, Lq, Dv]`` (and lse ``[B, Hq, Lq]``, fp32 as the
    reference returns it). The default scale is ``1/sqrt(D)``, as for the inputs' own dtype.
    """
    return reference_attention(q.detach().to(torch.float64), k.detach().to(torch.float64),
                               v.detach().to(torch.float64), layout, causal=causal, scale=scale,
                               return_lse=return_lse)


def naive_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_mask: torch.Tensor,
                           scale: float | None = None, *, return_lse: bool = False):
    """Full-matrix softmax attention in float64 under a dense token mask (independent oracle).

    Args:
        q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv]`` with ``Hq % Hkv == 0``
        (K/V heads are repeated: query head h reads kv head ``h // (Hq // Hkv)``).
        token_mask: bool ``[B|1, Hq|1, Lq, Lk]`` (or ``[Lq, Lk]``), True = attend.
        scale: default ``1/sqrt(D)``.

    Returns: out float64 ``[B, Hq, Lq, Dv]`` (and lse float64 ``[B, Hq, Lq]``). Rows with no allowed
    key: out exactly 0, lse ``-inf``. Differentiable (no NaN in the gradient of such rows).
    """
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if token_mask.dim() == 2:
        token_mask = token_mask[None, None]
    group = Hq // Hkv
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    mask = token_mask.to(q.device).expand(B, Hq, Lq, k.shape[2])
    s = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    row_any = mask.any(-1, keepdim=True)
    s = torch.where(mask, s, float("-inf"))
    s = torch.where(row_any, s, 0.0)  # empty rows: a harmless finite row, zeroed below
    p = torch.where(row_any, torch.softmax(s, -1), 0.0)
    out = torch.matmul(p, v64)
    if not return_lse:
        return out
    lse = torch.where(row_any[..., 0], torch.logsumexp(s, -1), float("-inf"))
    return out, lse


# ----------------------------------------------------------------------------- dense masks
def causal_token_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """bool ``[q_len, kv_len]``: key j visible to query i iff ``j <= i + kv_len - q_len``."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + (kv_len - q_len)


def element_mask_dense(mask, q_len: int, kv_len: int) -> torch.Tensor:
    """bool ``[q_len, kv_len]`` of an :class:`~sparse_attn.masks.ElementMask`, evaluated with plain
    Python integer loops straight from the documented definition (independent of ``masks.py``'s
    interval code). O(q_len * kv_len * terms) Python work: small sizes only."""
    out = [[False] * kv_len for _ in range(q_len)]
    for i in range(q_len):
        p = i + kv_len - q_len
        row = out[i]
        for t in mask.terms:
            if not (t.q_lo <= p <= t.q_hi):
                continue
            for j in range(kv_len):
                if row[j]:
                    continue
                if (t.k_lo <= j <= t.k_hi and p - t.left <= j <= p + t.right
                        and (t.doc == 0 or p // t.doc == j // t.doc)):
                    row[j] = True
    return torch.tensor(out, dtype=torch.bool).reshape(q_len, kv_len)


def block_map_from_token_mask(token_mask: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """int ``[..., Qb, Kb]`` from a bool ``[..., Lq, Lk]`` token mask: -2 no token allowed (block
    absent), -1 every token of the (possibly ragged edge) block allowed (full), 0 some (partial)."""
    *lead, lq, lk = token_mask.shape
    nq, nk = math.ceil(lq / block_q), math.ceil(lk / block_k)
    out = torch.full((*lead, nq, nk), -2, dtype=torch.int32)
    for a in range(nq):
        for c in range(nk):
            blk = token_mask[..., a * block_q:(a + 1) * block_q, c * block_k:(c + 1) * block_k]
            anyv, allv = blk.flatten(-2).any(-1), blk.flatten(-2).all(-1)
            out[..., a, c] = torch.where(allv, -1, torch.where(anyv, 0, -2)).to(torch.int32)
    return out


# ----------------------------------------------------------------------------- tolerance
# The project's design rule 3: compare kernel and same-dtype reference against an fp64 oracle; the kernel's
# error may be at most ~1.1-2x the reference's; NaN never passes.
_FLOORS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 3e-4, torch.bfloat16: 2e-3}


# The 8-bit paths' relative L1 bound against the fp16/bf16 kernel on the same layout. The issue's bar is
# 0.02; FP8 e4m3 keeps 3 mantissa bits, so each rounded P and V value carries up to 1/16 relative error,
# which averages to ~3% (SageAttention2 reports the same for E4M3 P.V): int8-fp8 is held to 0.045.
QUANT_L1_BOUND = {"int8": 0.02, "int8-fp8": 0.045}


def default_atol_floor(dtype: torch.dtype) -> float:
    """The small absolute slack added to ``factor * reference_error``: it only matters where the
    same-dtype reference is (nearly) exact, e.g. outputs that are exactly 0."""
    return _FLOORS.get(dtype, 1e-6)


def assert_close_to_oracle(out: torch.Tensor, ref_same_dtype: torch.Tensor, oracle: torch.Tensor, *,
                           factor: float = 2.0, atol_floor: float | None = None, name: str = "output") -> None:
    """The tolerance rule: ``out``'s error against the fp64 ``oracle`` may be at most ``factor`` times the
    error of the same-dtype reference ``ref_same_dtype``, plus ``atol_floor``.

    Checked for both the max-abs error and the RMSE (all three tensors the same shape, any dtype).
    NaN/inf in ``out`` or ``oracle`` (or in the reference) never passes. Raises AssertionError with
    both errors in the message.
    """
    if out.shape != oracle.shape or ref_same_dtype.shape != oracle.shape:
        raise AssertionError(f"{name}: shape mismatch: out {tuple(out.shape)}, reference "
                             f"{tuple(ref_same_dtype.shape)}, oracle {tuple(oracle.shape)}")
    floor = default_atol_floor(out.dtype) if atol_floor is None else atol_floor
    for what, t in (("output", out), ("same-dtype reference", ref_same_dtype), ("oracle", oracle)):
        if not bool(torch.isfinite(t).all()):
            n_nan = int(torch.isnan(t).sum())
            n_inf = int(torch.isinf(t).sum())
            raise AssertionError(f"{name}: the {what} is not finite ({n_nan} NaN, {n_inf} inf of {t.numel()})")
    errs = {}
    for metric in (metrics.max_abs_error, metrics.rmse):
        got, base = metric(out, oracle), metric(ref_same_dtype, oracle)
        allowed = factor * base + floor
        errs[metric.__name__] = (got, base, allowed)
    bad = {m: e for m, e in errs.items() if not e[0] <= e[2]}
    if bad:
        lines = [f"{m}: kernel {g:.3e} vs fp64 oracle, same-dtype reference {b:.3e}, "
                 f"allowed {factor} x {b:.3e} + {floor:.1e} = {a:.3e}" for m, (g, b, a) in errs.items()]
        raise AssertionError(f"{name} ({out.dtype}) too far from the fp64 oracle:\n  " + "\n  ".join(lines))


def assert_grads_close_to_oracle(outs: tuple, do: torch.Tensor, inputs: tuple, lowp: tuple, oracle: tuple,
                                 **kwargs) -> None:
    """Rule 3 for the gradients: backpropagate ``do`` through ``outs = (kernel out, same-dtype
    reference out, fp64 oracle out)`` and check dq, dk, dv of ``inputs`` (the kernel's q, k, v) against
    the oracle's, next to the same-dtype reference's (``lowp``). ``kwargs`` go to assert_close_to_oracle.

    The same-dtype reference's gradients round as the kernels' backward does, delta from the rounded
    output included (:func:`sparse_attn.reference.attention_backward`). A fallback to a backward with only
    that delta rounding, once needed on x10 inputs and groups of a few rows, decided no case once the
    reference took it in (benchmarks/NOTES.md) and is gone."""
    out, o_lp, o_or = outs
    out.backward(do)
    o_or.backward(do.double())
    o_lp.backward(do)
    for name, a, b, c in zip(("dq", "dk", "dv"), inputs, oracle, lowp):
        assert_close_to_oracle(a.grad, c.grad, b.grad, name=name, **kwargs)


def assert_layout_grads_close_to_oracle(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                                        **kwargs) -> None:
    """Rule 3 for the gradients of ``fn(q, k, v, layout)`` (q/k/v leaves requiring grad): runs it,
    the same-dtype reference and the fp64 oracle on detached copies, backpropagates one random
    ``do`` through all three and checks dq, dk, dv (:func:`assert_grads_close_to_oracle`)."""
    out = fn(q, k, v, layout)
    oracle = [t.detach().double().requires_grad_() for t in (q, k, v)]
    lowp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_or = reference_attention(*oracle, layout)
    o_lp = reference_attention(*lowp, layout, _lowp=True)
    assert_grads_close_to_oracle((out, o_lp, o_or), torch.randn_like(out), (q, k, v), lowp, oracle, **kwargs)


def grads_per_launch_setting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, do: torch.Tensor,
                             attr: str, values) -> list:
    """Gradients of the block-sparse kernels' ``attention_op(q, k, v, layout)`` for ``do``, one
    (dq, dk, dv) tuple per value of ``ops.block_sparse.launch.<attr>``, in the order of ``values``
    (a value may repeat). Sets the attribute for each call and restores it."""
    from .ops.block_sparse import attention_op, launch

    saved = getattr(launch, attr)
    try:
        grads = []
        for value in values:
            setattr(launch, attr, value)
            grads.append(torch.autograd.grad(attention_op(q, k, v, layout), (q, k, v), do))
        return grads
    finally:
        setattr(launch, attr, saved)


@contextlib.contextmanager
def launch_settings(**values):
    """``ops.block_sparse.launch.<name> = value`` for each keyword inside the block (probes, tests);
    the previous values are restored after it."""
    from .ops.block_sparse import launch

    saved = {name: getattr(launch, name) for name in values}
    for name, value in values.items():
        setattr(launch, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(launch, name, value)


def without_replays(fn):
    """``fn()`` with ops.block_sparse.replay off: the path a replayed launch skips (its reference)."""
    from .ops.block_sparse import replay

    saved = replay.ENABLED
    replay.ENABLED = False
    try:
        return fn()
    finally:
        replay.ENABLED = saved


def count_forward_paths(monkeypatch) -> dict:
    """Counts the calls that take launch.forward's own path (not replayed) in ``counts["path"]`` from now on, through
    pytest's ``monkeypatch`` (undone after the test)."""
    from .ops.block_sparse import launch
    return _count_calls(monkeypatch, launch, "_forward", "path")


def count_op_calls(monkeypatch, op: str = "device_plan_attention_op") -> dict:
    """Counts the calls that reach the device-plan op ``op`` of ops.block_sparse (not served by ops.block_sparse.entry)
    in ``counts["n"]`` from now on, as :func:`count_forward_paths`: sparse_attn.attention's, or with
    ``"varlen_device_plan_op"`` a padded batch's in place (integrations._unpad.in_place)."""
    from .ops import block_sparse
    return _count_calls(monkeypatch, block_sparse, op, "n")


def _count_calls(monkeypatch, owner, name: str, label: str) -> dict:
    counts = {label: 0}
    real = getattr(owner, name)

    def counted(*args, **kw):
        counts[label] += 1
        return real(*args, **kw)
    monkeypatch.setattr(owner, name, counted)
    return counts


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` inside the block; the caller's
    setting is restored after it."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def launch_import_stderr(env_name: str, value: str) -> str:
    """stderr of importing ``ops.block_sparse.launch`` in a fresh interpreter with the environment
    variable ``env_name`` set to ``value``; raises AssertionError when that import succeeds (the
    settings read at import must refuse a bad value, not fall back)."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sparse_attn.ops.block_sparse.launch"],
                       env=dict(os.environ, **{env_name: value}), capture_output=True, text=True)
    assert r.returncode != 0, f"{env_name}={value!r}: the import succeeded"
    return r.stderr


def split_and_fused_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, do: torch.Tensor) -> tuple:
    """Gradients under the backward's two schedules (launch.BWD_VARIANT): ``(split, split again,
    fused)``, each a (dq, dk, dv) tuple."""
    return tuple(grads_per_launch_setting(q, k, v, layout, do, "BWD_VARIANT", ("split", "split", "fused")))


def check_non_finite_spread(run, layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int) -> None:
    """The README's rule for a NaN in K or V at key ``key`` of batch 0, kv head 0 (``[B, H, L, D]`` inputs;
    ``run(q, k, v) -> out`` attends ``layout``, no causal): in K it reaches exactly the rows that may see that
    key (masked scores are set to -inf); in V it reaches those rows and may reach the other rows of the query
    blocks that visit its key block (0 * NaN), never a row outside them. Checked on every query head that
    reads kv head 0 (``h < Hq // Hkv``, each under its own layout head); every other (batch, head) output
    must stay NaN-free (a kernel reading another head's or batch's K/V would spread it there)."""
    group = q.shape[1] // k.shape[1]
    token_mask, block_mask = layout.to_token_mask()[0], layout.to_block_mask()[0]  # [Hl, Lq, Lk], [Hl, Qb, Kb]
    assert token_mask[:, :, key].any(), "pick a key some row sees"
    for name in ("k", "v"):
        kk, vv = k.clone(), v.clone()
        (kk if name == "k" else vv)[0, 0, key] = float("nan")
        nan_rows = run(q, kk, vv).isnan().any(-1)  # [B, Hq, Lq]
        for h in range(group):
            lh = h if layout.heads > 1 else 0
            may_see = token_mask[lh][:, key].nonzero().flatten().tolist()
            visiting = block_mask[lh][:, key // layout.block_k].nonzero().flatten().tolist()
            block_rows = {r for qb in visiting
                          for r in range(qb * layout.block_q, min((qb + 1) * layout.block_q, layout.q_len))}
            rows = nan_rows[0, h].nonzero().flatten().tolist()
            if name == "k":
                assert rows == may_see, \
                    f"head {h}: NaN in K reached rows {rows}; the rows that may see key {key}: {may_see}"
            else:
                assert set(may_see) <= set(rows) <= block_rows, \
                    f"head {h}: NaN in V reached rows {rows}: must cover {may_see}, stay within the visiting blocks"
        nan_rows[0, :group] = False
        pairs = nan_rows.any(-1).nonzero().tolist()
        assert not pairs, \
            f"NaN in {name.upper()} (batch 0, kv head 0) reached the (batch, head) pairs {pairs}, which do not read it"


# ----------------------------------------------------------------------------- inputs
def random_qkv(B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, dtype=torch.float32, device="cpu",
               scale: float = 1.0, seed: int | None = None, *, Dv: int | None = None,
               requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard-normal q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]``, v ``[B, Hkv, Lk, Dv or D]``,
    times ``scale``, drawn in fp32 on ``device`` (from a private generator when ``seed`` is given,
    so one seed gives the same values on one device whatever the dtype) and cast to ``dtype``."""
    device = torch.device(device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D if Dv is None else Dv))
    out = []
    for shape in shapes:
        t = (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * scale).to(dtype)
        out.append(t.requires_grad_(requires_grad))
    return tuple(out)


def random_packed_qkv(Tq: int, Tk: int, Hq: int, Hkv: int, D: int, *, seed: int, dtype=torch.float16,
                      requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard-normal packed (varlen) q ``[Tq, Hq, D]``, k and v ``[Tk, Hkv, D]`` on the CPU, drawn in
    that order from one generator seeded with ``seed`` and cast to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((Tq, Hq, D), (Tk, Hkv, D), (Tk, Hkv, D))
    return tuple(torch.randn(s, generator=g).to(dtype).requires_grad_(requires_grad) for s in shapes)


# ----------------------------------------------------------------------------- zero-length inputs
def _api():
    import sparse_attn  # at call time: this module is imported while the package itself loads
    return sparse_attn


def _cu(t, *offsets):
    return torch.tensor(offsets, dtype=torch.int32, device=t.device)


def _group(*bounds):
    from .grouped import Group
    return [Group(*bounds)]


# case -> (q shape, k/v shape, call(q, k, v)): no query token or no key token on each public entry
# point; packed shapes are [T, H, D], the others [B, H, L, D]
_ZERO_LENGTH = {
    "attention-no-query": ((1, 2, 0, 64), (1, 1, 10, 64), lambda q, k, v: _api().attention(q, k, v)),
    "attention-no-key-causal": ((1, 2, 5, 64), (1, 1, 0, 64),
                                lambda q, k, v: _api().attention(q, k, v, causal=True)),
    "int8-no-query": ((1, 2, 0, 64), (1, 1, 10, 64), lambda q, k, v: _api().attention(q, k, v, quant="int8")),
    "adaptive-no-query": ((1, 2, 0, 64), (1, 1, 10, 64), lambda q, k, v: _api().attention(q, k, v, "adaptive")),
    "varlen-no-query": ((0, 2, 64), (10, 1, 64),
                        lambda q, k, v: _api().varlen_attention(q, k, v, _cu(q, 0, 0, 0), _cu(q, 0, 4, 10), 1, 6)),
    "varlen-no-key": ((5, 2, 64), (0, 1, 64),
                      lambda q, k, v: _api().varlen_attention(q, k, v, _cu(q, 0, 5), _cu(q, 0, 0), 5, 1)),
    "grouped-no-query": ((0, 2, 64), (10, 1, 64),
                         lambda q, k, v: _api().grouped_attention(q, k, v, _group(0, 0, 0, 10))),
    "grouped-no-key": ((5, 2, 64), (0, 1, 64), lambda q, k, v: _api().grouped_attention(q, k, v, _group(0, 5, 0, 0))),
}
ZERO_LENGTH_CASES = tuple(_ZERO_LENGTH)


def check_zero_length_case(case: str, device, dtype) -> None:
    """Run one of ZERO_LENGTH_CASES forward and backward and check what SDPA does with such inputs:
    an output of q's shape, all zeros (no row sees a key), and backward() giving zero gradients."""
    q_shape, kv_shape, call = _ZERO_LENGTH[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for s in (q_shape, kv_shape, kv_shape))
    out = call(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype, (case, tuple(out.shape), out.dtype)
    assert torch.equal(out, torch.zeros_like(out)), case
    out.float().sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and t.grad.shape == t.shape, (case, name)
        assert torch.equal(t.grad, torch.zeros_like(t)), (case, name)


def capture_graph(fn, warmup: int = 3, warm_up=None):
    """PyTorch's capture recipe: ``warmup`` eager calls of ``fn`` on a side stream (kernel compiles,
    autotuning, layout caches), then one call captured into a ``torch.cuda.CUDAGraph``. Returns
    ``(graph, what the captured call returned)``; ``graph.replay()`` refills those outputs.
    ``warm_up``: call that instead for the eager calls, where the eager form must differ from the
    captured one (a varlen step captured on whole K/V buffers, whose eager calls want offsets that end at
    the tensors' length)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            (warm_up or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def attention_runner(layout=None, *, backward: bool = False, **kwargs):
    """For comparing one attention call across input sets (e.g. a CUDA graph's replay against eager):
    ``runner(inputs)`` with ``inputs = [q, k, v]`` gives a no-argument call of
    ``sparse_attn.attention(q, k, v, layout, **kwargs)`` that returns a list: the output (and LSE), and
    with ``backward`` the gradients of q, k, v under the loss ``sum(out ** 2)``, cleared first."""
    from .api import attention

    def runner(inputs):
        q, k, v = inputs

        def run():
            if backward:
                for t in inputs:
                    t.grad = None
            out = attention(q, k, v, layout, **kwargs)
            if not backward:
                return list(out) if isinstance(out, tuple) else [out]
            out.float().square().sum().backward()
            return [out, q.grad, k.grad, v.grad]
        return run
    return runner
