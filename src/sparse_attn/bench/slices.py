"""Estimate a suite's GPU time row by row and cut it into slices that each fit one time-limited command.

    from sparse_attn.bench.slices import estimate_seconds, plan, slice_suite, slices_needed
    n = slices_needed(get_suite("report-gpu"), limit_s=420)   # fewest slices of <= 7 min each
    part = slice_suite(get_suite("report-gpu"), 2, n)        # the 2nd: a Suite, rows in run order
    estimate_seconds(part)                                   # its estimated seconds on an H100

Slices are contiguous runs of the suite's rows (:func:`~sparse_attn.bench.runner.expand` order), so
each keeps the runner's input and layout reuse; every row is in exactly one slice. The cost model is
rough (H100, bf16, D=128) and meant to keep slices well inside a limit, not to predict results:

* a row is timed as :mod:`.timing` does it: 1 compiling call, 2 estimate calls, warm-up (25 ms
  worth, 1-10 calls), repetitions (200 ms worth, 3-100) and 1 peak-memory call, each taking the
  row's effective FLOPs over the provider's rate in :data:`RATES` (effective TFLOP/s, rounded down
  from ``benchmarks/results/kernels-h100.json``); dense providers count dense (or causal) FLOPs;
* plus :data:`ROW_S` of set-up per row, :data:`LAYOUT_S` per layout built, :data:`STARTUP_S` per slice;
* compiles, charged the first time in a slice: :data:`FLEX_COMPILE_S` per (T, causal, mode) for flex
  (``torch.compile`` specialises on shapes), :data:`TRITON_COMPILE_S` per (pattern, mode) for the
  Triton kernels (an upper bound: a carried Triton cache usually holds them);
* an ``sdpa-math`` row whose materialised fp32 scores exceed :data:`MEMORY_BYTES` fails at once (:data:`OOM_S`).

Densities come from the pattern's layout built at one head (cached) up to 32K; past that the visited
blocks are extrapolated by the quadratic through 8K, 16K and 32K (every report pattern's count is
linear or quadratic in T there), so no long layout is built here.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from .runner import Point, expand
from .suites import Case, PatternSpec, Suite

# effective TFLOP/s per (provider, mode) on an H100, bf16, D=128 ("bwd" uses the fwd+bwd rate)
RATES = {
    "sparse_attn": {"fwd": 450.0, "fwd+bwd": 330.0},
    "adaptive": {"fwd": 380.0, "fwd+bwd": 300.0},
    "sdpa-cudnn": {"fwd": 580.0, "fwd+bwd": 540.0},
    "sdpa-flash": {"fwd": 330.0, "fwd+bwd": 290.0},
    "sdpa-efficient": {"fwd": 250.0, "fwd+bwd": 200.0},
    "flex": {"fwd": 380.0, "fwd+bwd": 340.0},
    "sdpa-math": {"fwd": 20.0, "fwd+bwd": 15.0},
    "reference": {"fwd": 10.0, "fwd+bwd": 8.0},
}
DEFAULT_RATE = {"fwd": 100.0, "fwd+bwd": 80.0}
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
MIN_CALL_MS = {"adaptive": 1.0}  # the prediction's fixed cost per call; others launch in ~0.05 ms
STARTUP_S = 20.0
ROW_S = 0.5
LAYOUT_S = 1.0
LONG_LAYOUT_S = 5.0  # layouts past 128K (built on the GPU)
FLEX_COMPILE_S = {"fwd": 8.0, "bwd": 20.0, "fwd+bwd": 20.0}
TRITON_COMPILE_S = 20.0
MEMORY_BYTES = 75 * 2**30
OOM_S = 1.0
_BUILT_UP_TO = 32768


# ----------------------------------------------------------------------------- density
@lru_cache(maxsize=None)
def _built_density(pattern: PatternSpec, seq_len: int, block_q: int, block_k: int) -> float:
    from .flops import block_density
    layout = pattern.build(seq_len, heads=1, block_q=block_q, block_k=block_k)
    return block_density(layout, batch=1, heads=1, causal=pattern.causal)


def density(pattern: PatternSpec, seq_len: int, block_q: int = 128, block_k: int = 128) -> float:
    """Visited-block fraction of ``pattern`` at ``seq_len`` (extrapolated past 32K, see the module doc)."""
    if seq_len <= _BUILT_UP_TO:
        return _built_density(pattern, seq_len, block_q, block_k)
    xs = (_BUILT_UP_TO // 4, _BUILT_UP_TO // 2, _BUILT_UP_TO)

    def grid(L):
        return math.ceil(L / block_q) * math.ceil(L / block_k)
    vs = [_built_density(pattern, L, block_q, block_k) * grid(L) for L in xs]
    # the quadratic through the three (T, visited blocks) points: exact for bands, sinks, global rows,
    # block-diagonal, top-k rows (linear plus a constant ramp) and for dense, causal, strided (quadratic)
    visited = sum(v * math.prod((seq_len - xj) / (xi - xj) for xj in xs if xj != xi) for xi, v in zip(xs, vs))
    return min(1.0, max(visited, 0.0) / grid(seq_len))


# ----------------------------------------------------------------------------- one row
def _calls(ms: float) -> tuple[int, int]:
    """(total calls, timed repetitions) of one row whose call takes ``ms`` (as timing.time_cuda)."""
    reps = int(min(max(200.0 / ms, 3), 100))
    warmup = int(min(max(25.0 / ms, 1), 10))
    return 1 + 2 + warmup + reps + 1, reps


def call_ms(p: Point) -> float:
    """Estimated milliseconds of one call of row ``p``."""
    from .registry import get_provider
    c = p.case
    dense = get_provider(p.provider).computes == "dense"
    if dense:
        dens = 0.5 + 0.5 / max(1, math.ceil(p.seq_len / c.block_q)) if c.pattern.causal else 1.0
    else:
        dens = density(c.pattern, p.seq_len, c.block_q, c.block_k)
    flops = 4.0 * c.batch * c.heads * p.seq_len * p.seq_len * c.head_dim * dens * MODE_FLOPS[p.mode]
    rate = RATES.get(p.provider, DEFAULT_RATE)["fwd" if p.mode == "fwd" else "fwd+bwd"]
    return max(flops / (rate * 1e12) * 1e3, MIN_CALL_MS.get(p.provider, 0.05))


def runs_out_of_memory(p: Point) -> bool:
    """Whether ``sdpa-math`` (materialised fp32 scores, ~2x for fwd, ~3x with bwd) surely cannot fit."""
    if p.provider != "sdpa-math":
        return False
    c = p.case
    scores = c.batch * c.heads * p.seq_len * p.seq_len * 4
    return scores * (2 if p.mode == "fwd" else 3) > MEMORY_BYTES


def row_seconds(p: Point) -> float:
    """Estimated seconds of row ``p`` alone, without compiles (see :func:`estimate_seconds`)."""
    if runs_out_of_memory(p):
        return OOM_S
    ms = call_ms(p)
    calls, reps = _calls(ms)
    return ROW_S + (calls * ms + reps * 0.1) / 1e3


def _once_costs(p: Point, seen: set) -> float:
    """Compile and layout costs the first time a slice meets them (``seen`` is updated)."""
    c, cost = p.case, 0.0
    keys = [(("layout", c.pattern, p.seq_len), LONG_LAYOUT_S if p.seq_len > 131072 else LAYOUT_S)]
    if p.provider == "flex" and not runs_out_of_memory(p):
        keys.append((("flex", p.seq_len, c.pattern.causal, p.mode), FLEX_COMPILE_S[p.mode]))
    if p.provider in ("sparse_attn", "adaptive"):
        keys.append((("triton", c.pattern.name, p.mode), TRITON_COMPILE_S))
    for key, seconds in keys:
        if key not in seen:
            seen.add(key)
            cost += seconds
    return cost


def _dense_memo_key(p: Point) -> tuple | None:
    from .registry import get_provider
    return p.key()[1:] if get_provider(p.provider).computes == "dense" else None


def point_costs(points: list[Point]) -> list[float]:
    """Seconds of each row run in this order in one process (compiles charged where first met;
    dense rows the runner reuses across patterns cost nothing the second time)."""
    seen: set = set()
    out = []
    for p in points:
        memo = _dense_memo_key(p)
        if memo is not None and ("memo", memo) in seen:
            out.append(0.0)
            continue
        if memo is not None:
            seen.add(("memo", memo))
        out.append(row_seconds(p) + _once_costs(p, seen))
    return out


def estimate_seconds(suite: Suite) -> float:
    """Estimated wall seconds of ``sparse-attn bench`` running ``suite`` in one fresh process."""
    points = expand(suite)
    return STARTUP_S + sum(point_costs(points)) if points else 0.0


# ----------------------------------------------------------------------------- slicing
def points_suite(suite: Suite, points: list[Point], name: str | None = None) -> Suite:
    """A suite whose :func:`expand` is exactly ``points``, in order (one case per (case, L, Hkv, mode))."""
    cases: list[Case] = []
    last = None
    for p in points:
        group = (p.case, p.seq_len, p.kv_heads, p.mode)
        if group == last:
            cases[-1] = replace(cases[-1], providers=cases[-1].providers + (p.provider,))
        else:
            cases.append(replace(p.case, seq_lens=(p.seq_len,), kv_heads=(p.kv_heads,), modes=(p.mode,),
                                 providers=(p.provider,)))
        last = group
    return Suite(name or suite.name, suite.description, tuple(cases))


def _cuts(costs: list[float], n: int) -> list[int]:
    """Start indices of ``n`` contiguous, non-empty parts with about equal summed cost."""
    total = sum(costs)
    starts, acc, k = [0], 0.0, 1
    for i, c in enumerate(costs):
        if k < n and i > starts[-1] and acc >= k * total / n and len(costs) - i >= n - k:
            starts.append(i)
            k += 1
        acc += c
    while len(starts) < n:  # fewer cost jumps than parts: split the tail one row at a time
        starts.append(len(costs) - (n - len(starts)))
    return starts


def plan(suite: Suite, n: int) -> list[Suite]:
    """``suite`` cut into ``n`` contiguous slices of about equal estimated time."""
    points = expand(suite)
    if not 1 <= n <= max(1, len(points)):
        raise ValueError(f"cannot cut {len(points)} rows of suite {suite.name!r} into {n} slices: "
                         f"choose 1..{max(1, len(points))}")
    starts = _cuts(point_costs(points), n) + [len(points)]
    return [points_suite(suite, points[a:b]) for a, b in zip(starts, starts[1:])]


def slice_suite(suite: Suite, k: int, n: int) -> Suite:
    """Slice ``k`` (1-based) of ``n`` of ``suite`` (see :func:`plan`)."""
    if not 1 <= k <= n:
        raise ValueError(f"slice must be K/N with 1 <= K <= N, got {k}/{n}")
    return plan(suite, n)[k - 1]


def slices_needed(suite: Suite, limit_s: float, max_slices: int = 64) -> int:
    """The fewest slices whose estimates are all at most ``limit_s`` seconds."""
    rows = len(expand(suite))
    for n in range(1, min(max_slices, max(rows, 1)) + 1):
        if max(estimate_seconds(s) for s in plan(suite, n)) <= limit_s:
            return n
    raise ValueError(f"suite {suite.name!r} does not fit slices of {limit_s:.0f} s (one row is longer?)")


def drop_done(suite: Suite, folder) -> tuple[Suite, int]:
    """``suite`` without the rows that result JSON files in ``folder`` already hold (timed or failed),
    and how many were dropped; a missing folder holds none. Re-running a slice that was cut off with
    this finishes it."""
    import json
    from pathlib import Path

    from .results import ROW_FIELDS, Row
    done = set()
    folder = Path(folder)
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        for r in json.loads(f.read_text()).get("rows", []):
            # keys beyond the row's fields are annotations (merge_results.py's 'slice'), as results.read_result
            row = Row(**{k: v for k, v in r.items() if k in ROW_FIELDS})
            done.add(row.key() + (row.provider,))
    points = expand(suite)
    keep = [p for p in points if p.key() not in done]
    return points_suite(suite, keep), len(points) - len(keep)


def parse_slice(text: str) -> tuple[int, int]:
    """``"2/5"`` -> ``(2, 5)``."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"a slice is K/N, e.g. 2/5, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"a slice K/N needs 1 <= K <= N, got {text!r}")
    return k, n


__all__ = ["RATES", "density", "call_ms", "row_seconds", "point_costs", "estimate_seconds", "points_suite",
           "plan", "slice_suite", "slices_needed", "parse_slice", "runs_out_of_memory", "drop_done"]
