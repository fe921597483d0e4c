"""Run a suite: expand cases into rows, build layouts and inputs once, time each provider.

Inputs are ``torch.randn`` (never zeros, which some kernels would skip through); each failure is
recorded on its row instead of stopping the run: ``error="OOM"`` for out-of-memory, else the
exception's type and first line. Dense providers (SDPA) ignore the layout, so their timing for one
(L, B, H, Hkv, D, dtype, mode, causal) is measured once and reused for every pattern; the row
still gets the pattern's own effective TFLOP/s (see :mod:`sparse_attn.bench.flops`). Optionally
(``interleave``) the providers of one row are timed together, repetitions interleaved
(:func:`sparse_attn.bench.timing.time_interleaved`).
"""
from __future__ import annotations

import contextlib
import gc
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .flops import attention_flops, block_density, tflops
from .registry import get_provider
from .results import Row
from .suites import DTYPES, Case, Suite
from .timing import peak_memory, reset_grads, time_fn, time_interleaved


@dataclass(frozen=True)
class Point:
    """One row to measure."""

    case: Case
    seq_len: int
    kv_heads: int
    mode: str
    provider: str

    def key(self) -> tuple:
        c = self.case
        return (c.pattern.name, self.seq_len, c.batch, c.heads, self.kv_heads, c.head_dim, c.dtype,
                self.mode, c.pattern.causal, self.provider)

    def label(self) -> str:
        return f"{self.case.pattern.name} L={self.seq_len} Hkv={self.kv_heads} {self.mode} {self.provider}"


def expand(suite: Suite) -> list[Point]:
    """All rows of a suite in run order (case, L, Hkv, mode, provider), duplicates dropped."""
    points: dict[tuple, Point] = {}
    for c in suite.cases:
        for L in c.seq_lens:
            for hkv in c.kv_heads:
                for mode in c.modes:
                    for prov in c.providers:
                        p = Point(c, L, hkv, mode, prov)
                        points.setdefault(p.key(), p)
    return list(points.values())


def check_providers(names, device) -> tuple[list[str], dict[str, str]]:
    """(usable names, {skipped name: reason}) on ``device``; unknown names raise KeyError."""
    usable, skipped = [], {}
    for name in dict.fromkeys(names):
        ok, why = get_provider(name).available(torch.device(device))
        (usable.append(name) if ok else skipped.__setitem__(name, why))
    return usable, skipped


def is_oom(e: BaseException) -> bool:
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), MemoryError) if t is not None)
    text = str(e).lower()
    return isinstance(e, oom_types) or "out of memory" in text or "can't allocate memory" in text


def describe_error(e: BaseException) -> str:
    if is_oom(e):
        return "OOM"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _Inputs:
    """Keeps one (q, k, v) set alive at a time: re-made when shape, dtype or grad-ness changes."""

    def __init__(self, device: torch.device):
        self.device, self.key, self.qkv = device, None, None

    def get(self, p: Point):
        c = p.case
        needs_grad = p.mode != "fwd"
        key = (p.seq_len, c.batch, c.heads, p.kv_heads, c.head_dim, c.dtype, needs_grad)
        if key != self.key:
            self.qkv = self.key = None
            _free(self.device)
            g = torch.Generator(device=self.device).manual_seed(0)
            dtype = DTYPES[c.dtype]

            def make(h):
                t = torch.randn(c.batch, h, p.seq_len, c.head_dim, generator=g, device=self.device, dtype=dtype)
                return t.requires_grad_(needs_grad)
            self.qkv = (make(c.heads), make(p.kv_heads), make(p.kv_heads))
            self.key = key
        return self.qkv


class _Layouts:
    """Layouts of the current pattern, by (L, H); a build error is remembered and re-raised."""

    def __init__(self, device: torch.device):
        self.device, self.pattern, self.cache = device, None, {}

    def get(self, p: Point):
        c = p.case
        if c.pattern != self.pattern:
            self.pattern, self.cache = c.pattern, {}
        key = (p.seq_len, c.heads, c.block_q, c.block_k)
        if key not in self.cache:
            try:
                self.cache[key] = c.pattern.build(p.seq_len, heads=c.heads, block_q=c.block_q,
                                                  block_k=c.block_k, device=self.device)
            except Exception as e:  # noqa: BLE001 - recorded on every row of the pattern
                self.cache[key] = e
        got = self.cache[key]
        if isinstance(got, Exception):
            raise got
        return got


def run_suite(suite: Suite, device, *, reps: int | None = None, warmup: int | None = None,
              progress: bool = True, on_row: Callable[[Row], None] | None = None,
              interleave: bool = False) -> list[Row]:
    """Measure every row of ``suite`` on ``device`` (providers must be available there).

    By default each provider is called once (compile, autotune) and then timed alone, its
    repetitions back to back: its sustained speed as a user running it in a loop sees it. With
    ``interleave`` the providers of one row (same pattern, L, Hkv, mode) are timed together, their
    repetitions interleaved (each follows every other equally often, :func:`~.timing.balanced_order`),
    all under one mix of clock and power states. On the power-capped H100 the two differ by more than
    noise (benchmarks/NOTES.md, "How the numbers were taken"), so result headers say which one was used."""
    from tqdm.auto import tqdm
    device = torch.device(device)
    points = expand(suite)
    inputs, layouts = _Inputs(device), _Layouts(device)
    dense_memo: dict[tuple, tuple] = {}
    rows: list[Row] = []
    bar = tqdm(total=len(points), desc=f"bench {suite.name}", unit="row", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    # CUDA events, the L2 flush buffer and the memory counters follow the current device: on cuda:1 called
    # from Python (the CLI sets it itself) they would have timed and measured cuda:0
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        for group in (row_groups(points) if interleave else [[p] for p in points]):
            bar.set_postfix_str(group[0].label().rsplit(" ", 1)[0] + " " + "/".join(p.provider for p in group),
                                refresh=False)
            for row in _run_group(group, device, inputs, layouts, dense_memo, reps, warmup):
                rows.append(row)
                if on_row is not None:
                    on_row(row)
            bar.update(len(group))
    bar.close()
    return rows


def row_groups(points: list[Point]) -> list[list[Point]]:
    """Consecutive points that differ only in provider: one row of the results table each."""
    groups: list[list[Point]] = []
    for p in points:
        if groups and groups[-1][0].key()[:-1] == p.key()[:-1]:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _new_row(p: Point, layouts: _Layouts) -> tuple[Row, object, int | None]:
    """The row of ``p`` with its density, the layout and the effective FLOPs (layout errors recorded)."""
    c = p.case
    row = Row(p.provider, c.pattern.name, p.seq_len, c.batch, c.heads, p.kv_heads, c.head_dim, c.dtype,
              p.mode, c.pattern.causal, None)
    try:
        layout = layouts.get(p)
        row.density = block_density(layout, batch=c.batch, heads=c.heads, causal=c.pattern.causal)
        flops = attention_flops(layout, batch=c.batch, heads=c.heads, head_dim=c.head_dim, mode=p.mode,
                                causal=c.pattern.causal)
    except Exception as e:  # noqa: BLE001
        row.error = "layout: " + describe_error(e)
        return row, None, None
    return row, layout, flops


def _run_group(group: list[Point], device, inputs: _Inputs, layouts: _Layouts, dense_memo: dict, reps,
               warmup) -> list[Row]:
    """Rows of one group: each provider is set up, then timed, several together by
    :func:`time_interleaved` (each called once first, untimed: compile, autotune), one alone by
    :func:`time_fn` (which makes that first call itself). A failure is recorded on its own row only.
    Dense providers ignore the layout, so their (ms, memory, error) is measured once per
    (L, B, H, Hkv, D, dtype, mode, causal) and reused for every pattern (``dense_memo``)."""
    rows, ready = [], []  # ready: (row, run, flops, memo key or None)
    for p in group:
        row, layout, flops = _new_row(p, layouts)
        rows.append(row)
        if row.error:
            continue
        memo_key = p.key()[1:] if get_provider(p.provider).computes == "dense" else None
        if memo_key in dense_memo:
            row.ms, row.peak_mem_bytes, row.error = dense_memo[memo_key]
            row.tflops = tflops(flops, row.ms)
            continue
        try:
            q, k, v = inputs.get(p)
            run = get_provider(p.provider).make_run(q, k, v, layout, p.case.pattern.causal, p.mode)
            if len(group) > 1:  # compile / autotune / first touch before the interleaved timing, never timed
                reset_grads(run.grad_to_none)
                run.fn()
            ready.append((row, run, flops, memo_key))
        except Exception as e:  # noqa: BLE001 - one row's failure must not stop the suite
            row.error = describe_error(e)
            del e
            _free(device)
            if memo_key is not None:
                dense_memo[memo_key] = (None, None, row.error)
    if not ready:
        return rows
    times = None
    if len(ready) > 1:
        try:
            times = time_interleaved([r.fn for _, r, _, _ in ready], device, reps=reps, warmup=warmup,
                                     grad_to_none=[r.grad_to_none for _, r, _, _ in ready])
        except Exception:  # noqa: BLE001 - time them one by one, so the failure lands on its own row
            _free(device)
    for i, (row, run, flops, memo_key) in enumerate(ready):
        try:
            row.ms = times[i] if times is not None else time_fn(run.fn, device, reps=reps, warmup=warmup,
                                                                grad_to_none=run.grad_to_none)
            row.peak_mem_bytes = peak_memory(run.fn, device, run.grad_to_none)
        except Exception as e:  # noqa: BLE001
            row.error = describe_error(e)
            del e
            _free(device)
        row.tflops = tflops(flops, row.ms)
        if memo_key is not None:
            dense_memo[memo_key] = (row.ms, row.peak_mem_bytes, row.error)
    return rows
