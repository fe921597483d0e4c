"""SM clock, board power and energy per call of each provider, under the suite's two timing methods.

NOTES.md ("How the numbers were taken") reads the gap between block and interleaved timing as the
power cap: alone, a kernel runs at the clock its own draw allows; interleaved, the kernels share the
clock of the mix. That reading was never checked with counters. This probe checks it: a thread
samples NVML (SM clock, power, clock-event reasons, temperature) every few milliseconds while the
providers of one case run

- in blocks: each provider's calls back to back for ``--block-s`` seconds (the suite's default);
  the board's energy counter over the block gives joules per call;
- interleaved: one call each in turn, the order rotating, for ``--inter-s`` seconds.

Each sample is attributed to the call that was executing on the GPU when it was taken (CUDA event
times mapped onto the host clock from one anchor), so every provider gets its own clock and power
figures under both methods. Calls are timed like ``bench.timing`` (CUDA events, 256 MB L2 flush
before each, warm-up excluded).

    python benchmarks/power_probe.py --out $OUT/power-h100.json [--cases dense:16384:fwd,...]
    bash benchmarks/power_ncu.sh [CASES]   # --profile: one call each, for Nsight Compute

Case syntax ``pattern:seq_len:mode[:providers]`` (providers joined by ``+``), pattern one of the
names in CASE_PATTERNS. Besides the registry's providers, this file registers sparse_attn with one
launch setting changed during its calls: ``sparse_attn-indexed`` (contiguous rows through their
indices), ``sparse_attn-grid`` (no wave order), ``sparse_attn-clock`` / ``sparse_attn-gridphase`` (the
wave order's phase from the GPU clock, contiguous runs rotated by it too / from the grid position, no
rotation of contiguous runs). NOTES.md "Power, clocks and energy"
and "The wave order's clock phase" hold what it measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import pynvml
import torch

from sparse_attn import patterns
from sparse_attn.bench.registry import MODES, get_provider, register_provider
from sparse_attn.bench.results import make_header
from sparse_attn.bench.timing import _flush, reset_grads
from sparse_attn.ops.block_sparse import launch
from sparse_attn.layout import BlockLayout
from sparse_attn.testing import random_qkv

from kv_split_probe import random_mask  # benchmarks/, beside this script

H, D = 32, 128
CASE_PATTERNS = {
    "dense": lambda L: patterns.dense(L, device="cuda"),
    "causal": lambda L: patterns.causal(L, device="cuda"),
    "streaming": lambda L: patterns.streaming(L, window=4096, num_sink=128, device="cuda"),
    "random-0.1": lambda L: patterns.random(L, density=0.1, heads=H, seed=0, device="cuda"),
    "random-0.25": lambda L: patterns.random(L, density=0.25, heads=H, seed=0, device="cuda"),
    "random-0.5": lambda L: patterns.random(L, density=0.5, heads=H, seed=0, device="cuda"),
    # rows of the causal triangle: row i keeps half of its i + 1 candidate blocks (lengths 1..n/2)
    "random-causal-0.5": lambda L: patterns.random(L, density=0.5, heads=H, seed=0, causal=True, device="cuda"),
    # each block in with probability 0.5, so rows differ in length (binomially), unlike patterns.random's
    # equal rows: the row-length spread the wave order was designed and first measured on
    "bernoulli-0.5": lambda L: BlockLayout.from_block_mask(random_mask(L, 0.5), block_q=128, block_k=128).to("cuda"),
}
DEFAULT_CASES = ("dense:16384:fwd:sparse_attn+flex+sdpa-cudnn,random-0.5:131072:fwd:sparse_attn+flex,"
                 "dense:16384:bwd:sparse_attn+flex,dense:32768:fwd:sparse_attn-int8-fp8+sparse_attn")


def _register_with_setting(name: str, setting: str, value, description: str) -> None:
    """A provider: sparse_attn with ``launch.<setting>`` set to ``value`` during its calls only (the
    launcher reads these settings on the host at launch time)."""
    def build(q, k, v, layout, causal):
        forward = get_provider("sparse_attn").build(q, k, v, layout, causal)

        def run():
            saved = getattr(launch, setting)
            setattr(launch, setting, value)
            try:
                return forward()
            finally:
                setattr(launch, setting, saved)
        return run
    register_provider(name, description=description)(build)


_register_with_setting("sparse_attn-indexed", "FORCE_INDEXED", True,
                       "contiguous rows walked through their block indices: the indexed walk's cost")
_register_with_setting("sparse_attn-grid", "FWD_WAVE", False, "indexed rows in grid order (no wave order)")
_register_with_setting("sparse_attn-clock", "FWD_WAVE_CLOCK", "1", "the wave order's phase from the GPU clock")
_register_with_setting("sparse_attn-gridphase", "FWD_WAVE_CLOCK", "0",
                       "the wave order's phase from the grid position (the order before the clock's)")


# NVML clock-event reasons recorded (nvmlClocksEventReason* bits): the share of samples with each set
REASONS = {0x1: "gpu_idle", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
           0x80: "hw_power_brake"}


def _reasons_fn():
    """nvmlDeviceGetCurrentClocksEventReasons (newer nvidia-ml-py) or its older name."""
    return getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons


def _power_w(handle) -> tuple[float, float | None]:
    """(NVML's power reading, W; the instantaneous field where the driver has it, else None). On
    recent drivers the plain reading is an average over about a second, too slow to tell one
    7 ms call from the next, hence the instantaneous field."""
    avg = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    field = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", None)
    if field is None:
        return avg, None
    fv = pynvml.nvmlDeviceGetFieldValues(handle, [field])[0]
    return avg, (fv.value.uiVal / 1000.0 if fv.nvmlReturn == 0 else None)


class Sampler(threading.Thread):
    """Polls NVML every ``period_s``: (host time, SM MHz, power W, instantaneous power W or None,
    clock-event reason bits, deg C)."""

    def __init__(self, handle, period_s: float):
        super().__init__(daemon=True)
        self.handle, self.period_s, self.samples, self._halt = handle, period_s, [], threading.Event()
        self._reasons = _reasons_fn()

    def run(self):
        h = self.handle
        while not self._halt.is_set():
            t = time.perf_counter()
            mhz = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            self.samples.append((t, mhz, *_power_w(h), self._reasons(h),
                                 pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
            time.sleep(self.period_s)

    def stop(self):
        self._halt.set()
        self.join()


def run_calls(providers: list[int], runs, seconds: float) -> tuple[list[tuple[int, float, float]], float, float]:
    """Runs rounds of one call per provider in ``providers`` (the order rotating every round, as
    ``time_interleaved`` does; one provider: its calls back to back) until ``seconds`` of GPU time
    have passed. Returns ([(provider index, start, end)] in host seconds, host start, host end).
    Nothing synchronizes between calls (as in the suite's timers): the host waits on the previous
    round's end, so one round stays queued. The GPU's event times are placed on the host clock by an
    anchor event recorded right after a synchronize."""
    flush = _flush()
    torch.cuda.synchronize()
    anchor = torch.cuda.Event(enable_timing=True)
    anchor.record()
    torch.cuda.synchronize()
    t_anchor = time.perf_counter()
    events, prev_end, r, n = [], None, 0, len(providers)
    while True:
        for j in range(n):
            i = providers[(r + j) % n]
            reset_grads(runs[i].grad_to_none)
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            runs[i].fn()
            e.record()
            events.append((i, s, e))
        r += 1
        if prev_end is not None:
            prev_end.synchronize()
            if anchor.elapsed_time(prev_end) / 1e3 >= seconds:
                break
        prev_end = e
    torch.cuda.synchronize()
    spans = [(i, t_anchor + anchor.elapsed_time(s) / 1e3, t_anchor + anchor.elapsed_time(e) / 1e3)
             for i, s, e in events]
    return spans, t_anchor, time.perf_counter()


def summarize(spans, samples, name: str, i: int) -> dict:
    """Median ms and the clock / power / reason figures of the samples inside provider i's calls."""
    mine = [(s, e) for j, s, e in spans if j == i]
    inside, k = [], 0
    ordered = sorted(mine)
    for t, mhz, watts, instant, reasons, temp in samples:  # samples and spans are both in time order
        while k < len(ordered) and ordered[k][1] < t:
            k += 1
        if k < len(ordered) and ordered[k][0] <= t:
            inside.append((mhz, watts, instant, reasons, temp))
    row = {"provider": name, "calls": len(mine), "ms": statistics.median((e - s) * 1e3 for s, e in mine),
           "samples": len(inside)}
    if inside:
        instants = [x[2] for x in inside if x[2] is not None]
        row.update(sm_mhz_mean=statistics.fmean(x[0] for x in inside),
                   sm_mhz_median=statistics.median(x[0] for x in inside),
                   power_w_mean=statistics.fmean(x[1] for x in inside),
                   power_instant_w_mean=statistics.fmean(instants) if instants else None,
                   temp_c_max=max(x[4] for x in inside),
                   reasons={label: sum(1 for x in inside if x[3] & bit) / len(inside) for bit, label in REASONS.items()})
    return row


def parse_case(case: str) -> tuple[str, int, str, list[str]]:
    """``pattern:seq_len:mode[:p1+p2...]`` -> (pattern, seq_len, mode, providers), checked before any run."""
    parts = case.split(":")
    if len(parts) not in (3, 4) or parts[0] not in CASE_PATTERNS or not parts[1].isdigit() or parts[2] not in MODES:
        raise SystemExit(f"case {case!r}: expected pattern:seq_len:mode[:providers], pattern one of "
                         f"{', '.join(CASE_PATTERNS)}, mode one of {', '.join(MODES)}")
    providers = parts[3].split("+") if len(parts) == 4 else ["sparse_attn", "flex"]
    for p in providers:
        get_provider(p)  # KeyError naming the registered providers
    return parts[0], int(parts[1]), parts[2], providers


def prepare(case: str):
    """(provider names, their runs), compiled, autotuned and warmed up."""
    pattern, L, mode, providers = parse_case(case)
    q, k, v = random_qkv(1, H, H, L, L, D, torch.bfloat16, "cuda", seed=0, requires_grad=mode != "fwd")
    layout = CASE_PATTERNS[pattern](L)
    runs = [get_provider(p).make_run(q, k, v, layout, pattern == "causal", mode) for p in providers]
    for r in runs:  # compile / autotune / warm-up, untimed
        for _ in range(3):
            reset_grads(r.grad_to_none)
            r.fn()
    torch.cuda.synchronize()
    return providers, runs


def profile(case: str) -> None:
    """One call of each provider between cudaProfilerStart / Stop, for ncu --profile-from-start off."""
    _, runs = prepare(case)
    for r in runs:
        reset_grads(r.grad_to_none)
        torch.cuda.cudart().cudaProfilerStart()
        r.fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def measure(case: str, handle, a) -> list[dict]:
    providers, runs = prepare(case)
    rows = []
    for rnd in range(a.rounds):
        for i, name in enumerate(providers):
            time.sleep(a.rest_s)  # every block starts from a rested board
            sampler = Sampler(handle, a.period_s)
            e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            sampler.start()
            spans, t0, t1 = run_calls([i], runs, a.block_s)
            e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            sampler.stop()
            row = summarize(spans, sampler.samples, name, i)
            row.update(case=case, round=rnd, method="blocks", joules_per_call=(e1 - e0) / 1e3 / len(spans),
                       block_power_w=(e1 - e0) / 1e3 / (t1 - t0))
            rows.append(row)
            print(json.dumps(row), flush=True)
        time.sleep(a.rest_s)
        sampler = Sampler(handle, a.period_s)
        sampler.start()
        spans, _, _ = run_calls(list(range(len(providers))), runs, a.inter_s)
        sampler.stop()
        for i, name in enumerate(providers):
            row = summarize(spans, sampler.samples, name, i)
            row.update(case=case, round=rnd, method="interleaved")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-s", type=float, default=3.0)
    ap.add_argument("--inter-s", type=float, default=5.0)
    ap.add_argument("--rest-s", type=float, default=1.0)
    ap.add_argument("--period-s", type=float, default=0.005)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true", help="one call each under ncu, no sampling")
    a = ap.parse_args()
    cases = a.cases.split(",")
    for case in cases:
        parse_case(case)
    if a.profile:
        for case in cases:
            profile(case)
        return
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    max_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    print(f"power limit {limit_w:.0f} W, max SM clock {max_mhz} MHz", flush=True)
    header = make_header("cuda", "probe", script="benchmarks/power_probe.py", power_limit_w=limit_w,
                         max_sm_mhz=max_mhz, block_s=a.block_s, inter_s=a.inter_s, period_s=a.period_s)
    rows = []
    for case in cases:
        rows += measure(case, handle, a)
        json.dump({**header, "rows": rows}, open(a.out, "w"), indent=1)  # after every case: a crash keeps the rest

if __name__ == "__main__":
    main()
