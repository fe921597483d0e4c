#!/usr/bin/env python3
"""Zigzag llama3 context parallelism on N ranks: correctness on every rank, then per-GPU speed.

GPU (NCCL), one command per world size (about 4-6 minutes each on H200, most of it Triton compiles):
    torchrun --standalone --nproc_per_node=2 benchmarks/cp_run.py --out cp-h200-w2.json
    torchrun --standalone --nproc_per_node=4 benchmarks/cp_run.py --out cp-h200-w4.json
CPU (gloo, the PyTorch reference path, tiny sizes; what CI runs so this script cannot rot):
    torchrun --standalone --nproc_per_node=2 benchmarks/cp_run.py --backend gloo --device cpu --tiny --out cp.json

(a) Correctness: bf16, H=32, Hkv=8, D=128, causal, --check-tokens total tokens; a dense batch
    (B=1) and a packed varlen batch of 4 sequences. Every rank compares its share of the CP output
    and of dQ/dK/dV with the fp64 oracle (the reference over the whole sequence(s)): its error may be
    at most 2x the error of single-device attention (``sparse_attn.attention`` / ``varlen_attention``
    over the whole sequence on this GPU) plus the bf16 floor, max-abs and RMSE (DESIGN.md rule 3).
(b) Speed: per GPU, --tokens-per-gpu tokens (B=1, one sequence of tokens * W), forward and
    forward+backward, for each --kv-head-chunks value: the CP call, and the same per-rank local work
    timed alone (``sparse_attn.attention`` on this rank's query chunks against full K/V already in
    memory, no communication). CUDA-event medians after warm-up, a barrier before each CP rep;
    FLOPs counted from the exact causal (query, key) pairs, x3.5 for forward+backward. ``fraction``
    = local time / CP time (per rank, then the mean and the min over ranks); ``fraction_back_to_back``
    the same from the mean time of reps calls issued back to back (the host ahead of the GPU, as in
    training, so host latency before a call's first kernel hides behind the previous call). Sizes
    that would not fit in --budget-s are skipped (and listed).

A missing peer: every collective waits for --timeout seconds (env SPARSE_ATTN_CP_TIMEOUT_S, default
300), then the NCCL watchdog reports the timed-out collective and stops the process (gloo raises).
Rank 0 writes the JSON (--out). Exit status 1 when a correctness check failed.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:
    import sparse_attn
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist

import sparse_attn
from sparse_attn import reference
from sparse_attn.bench.results import make_header
from sparse_attn.metrics import max_abs_error, rmse
from sparse_attn.parallel import (
    zigzag_llama3_attention,
    zigzag_llama3_varlen_attention,
    zigzag_plan,
    zigzag_split,
    zigzag_split_varlen,
)
from sparse_attn.parallel.plan import dense_plan
from sparse_attn.testing import assert_close_to_oracle

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default=None, help="nccl (default with CUDA) or gloo")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bf16 (fp32 with --tiny)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32; 4 with --tiny)")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default 8; 2 with --tiny)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (16 with --tiny)")
    p.add_argument("--check-tokens", type=int, default=None,
                   help="total tokens of the correctness check (default 8192; 64 with --tiny)")
    p.add_argument("--tokens-per-gpu", default=None,
                   help="benchmark sizes, comma-separated (default 8192,16384,32768; 32,64 with --tiny)")
    p.add_argument("--kv-head-chunks", default=None,
                   help="kv_head_chunk values to benchmark: K/V heads gathered at a time, >= Hkv means all at "
                        "once (default 8,4,2; 2,1 with --tiny)")
    p.add_argument("--reps", type=int, default=None, help="timed reps (default: ~300 ms worth, 5..30)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip benchmark sizes predicted to end later than this many seconds after start")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("SPARSE_ATTN_CP_TIMEOUT_S", "300")),
                   help="process-group timeout in seconds: how long a rank waits for a missing peer")
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke run")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--out", default=None, help="JSON written by rank 0")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    a.device = a.device or ("cuda" if cuda else "cpu")
    a.backend = a.backend or ("nccl" if a.device == "cuda" else "gloo")
    defaults = ({"heads": 4, "kv_heads": 2, "head_dim": 16, "check_tokens": 64, "tokens_per_gpu": "32,64",
                 "kv_head_chunks": "2,1", "dtype": "fp32"} if a.tiny else
                {"heads": 32, "kv_heads": 8, "head_dim": 128, "check_tokens": 8192, "tokens_per_gpu": "8192,16384,32768",
                 "kv_head_chunks": "8,4,2", "dtype": "bf16"})
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.dtype = DTYPES[a.dtype]
    a.tokens_per_gpu = [int(x) for x in str(a.tokens_per_gpu).split(",") if x]
    a.kv_head_chunks = [int(x) for x in str(a.kv_head_chunks).split(",") if x]
    return a


# ------------------------------------------------------------------------------------------ setup
def init(args):
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kw = {}
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if args.backend == "nccl":
            kw["device_id"] = device
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout), **kw)
    return dist.get_rank(), dist.get_world_size(), device


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def _randn(shape, dtype, device, gen):
    """Drawn on the CPU from one seed, so every rank builds the same full tensors."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------ correctness
def _oracle_dense(q, k, v, do, causal=True):
    """fp64 reference over the whole sequence, one K/V head (and its query heads) at a time to bound
    the autograd memory. Returns out, dq, dk, dv in fp64."""
    g = q.shape[1] // k.shape[1]
    res = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (do, q, k, v)]
    for h in range(k.shape[1]):
        qs = slice(h * g, (h + 1) * g)
        qh, kh, vh = (t.detach().double().requires_grad_() for t in (q[:, qs], k[:, h:h + 1], v[:, h:h + 1]))
        o = reference.attention(qh, kh, vh, causal=causal)
        grads = torch.autograd.grad(o, (qh, kh, vh), do[:, qs].double())
        res[0][:, qs], res[1][:, qs], res[2][:, h:h + 1], res[3][:, h:h + 1] = o.detach(), *grads
    return res


def _oracle_varlen(q, k, v, do, cu):
    """Per sequence of the packed ``[T, H, D]`` batch, as :func:`_oracle_dense`."""
    outs = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (do, q, k, v)]
    as4 = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    for a, b in itertools.pairwise(cu):
        for dst, src in zip(outs, _oracle_dense(*(as4(t[a:b]) for t in (q, k, v, do)))):
            dst[a:b] = src[0].transpose(0, 1)
    return outs


def _compare(name, rank, cp, single, oracle):
    row = {"what": name, "rank": rank, "err_cp": max_abs_error(cp, oracle), "err_single": max_abs_error(single, oracle),
           "rmse_cp": rmse(cp, oracle), "rmse_single": rmse(single, oracle), "ok": True}
    try:
        assert_close_to_oracle(cp, single, oracle, factor=2.0, name=name)
    except AssertionError as e:
        row["ok"], row["error"] = False, str(e)
    return row


def check_dense(args, rank, world, device):
    gen = torch.Generator().manual_seed(1234)
    L, H, Hkv, D = args.check_tokens, args.heads, args.kv_heads, args.head_dim
    q, k, v, do = (_randn((1, h, L, D), args.dtype, device, gen) for h in (H, Hkv, Hkv, H))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attn.attention(*full, causal=True)  # single-device attention (first: compiles/autotunes)
    out.backward(do)
    single = [out.detach()] + [t.grad for t in full]
    loc = [zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v)]
    chunk = max(1, Hkv // 4)
    out_l = zigzag_llama3_attention(*loc, causal=True, kv_head_chunk=chunk)
    out_l.backward(zigzag_split(do, world, rank))
    cp = [out_l.detach()] + [t.grad for t in loc]
    oracle = _oracle_dense(q, k, v, do)
    return [_compare(f"dense L={L} kv_head_chunk={chunk} {n}", rank, c, zigzag_split(s, world, rank),
                     zigzag_split(o, world, rank))
            for n, c, s, o in zip(("out", "dq", "dk", "dv"), cp, single, oracle)]


def _varlen_cu(total, world):
    """4 sequences: 1/2, 1/4, 1/8, 1/8 of the tokens, each a multiple of 2W."""
    unit = 2 * world
    lens = [total // 2, total // 4, total // 8]
    lens = [max(unit, n // unit * unit) for n in lens]
    lens.append(total - sum(lens))
    if lens[-1] <= 0 or lens[-1] % unit:
        raise SystemExit(f"--check-tokens {total} cannot be split into 4 sequences of multiples of {unit}")
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def check_varlen(args, rank, world, device):
    gen = torch.Generator().manual_seed(4321)
    T, H, Hkv, D = args.check_tokens, args.heads, args.kv_heads, args.head_dim
    cu = _varlen_cu(T, world)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    q, k, v, do = (_randn((T, h, D), args.dtype, device, gen) for h in (H, Hkv, Hkv, H))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mx = max(b - a for a, b in itertools.pairwise(cu))
    out = sparse_attn.varlen_attention(*full, cu_t, cu_t, mx, mx, causal=True)
    out.backward(do)
    single = [out.detach()] + [t.grad for t in full]
    split = lambda t: zigzag_split_varlen(t, cu, world, rank)  # noqa: E731
    loc = [split(t).requires_grad_() for t in (q, k, v)]
    chunk = max(1, Hkv // 2)
    out_l = zigzag_llama3_varlen_attention(*loc, cu, causal=True, kv_head_chunk=chunk)
    out_l.backward(split(do))
    cp = [out_l.detach()] + [t.grad for t in loc]
    oracle = _oracle_varlen(q, k, v, do, cu)
    return [_compare(f"varlen cu={cu} kv_head_chunk={chunk} {n}", rank, c, split(s), split(o))
            for n, c, s, o in zip(("out", "dq", "dk", "dv"), cp, single, oracle)]


# ------------------------------------------------------------------------------------------ timing
class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once_ms(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def back_to_back_ms(self, fn, reps: int) -> float:
        """Mean time per call of ``reps`` calls issued back to back (the host runs ahead of the GPU,
        as in a training step), after a barrier and a sync."""
        dist.barrier()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / reps
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps

    def median_ms(self, fn, reps: int, warmup: int, barrier: bool) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if barrier:
                dist.barrier()
            self.sync()
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _all_max(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _reps(args, est_ms, device):
    """Same rep count on every rank (the CP call holds collectives)."""
    if args.reps:
        return args.reps
    est = _all_max(est_ms, device)
    return int(min(30, max(5 if device.type == "cuda" else 2, 300.0 / max(est, 1e-3))))


def _gather(x, world):
    got = [None] * world
    dist.all_gather_object(got, x)
    return got


def bench_size(args, rank, world, device, timer, tokens, varlen: bool):
    """Rows for one per-GPU size: CP fwd / fwd+bwd per kv_head_chunk, and the local work alone."""
    H, Hkv, D, dt = args.heads, args.kv_heads, args.head_dim, args.dtype
    L = tokens * world
    gen = torch.Generator().manual_seed(99 + rank)
    if varlen:  # 4 equal sequences packed: [T, H, D] local shares, viewed [1, H, T, D] for the local work
        cu = [i * L // 4 for i in range(5)]
        plan = zigzag_plan(cu, world, rank)
        q, k, v, do = (_randn((tokens, h, D), dt, device, gen) for h in (H, Hkv, Hkv, H))
        kf, vf = (_randn((L, Hkv, D), dt, device, gen) for _ in range(2))
        as4 = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        lq, lkf, lvf, ldo = as4(q), as4(kf), as4(vf), as4(do)
        cp_call = lambda qq, kk, vv, hc, check=True: zigzag_llama3_varlen_attention(  # noqa: E731
            qq, kk, vv, cu, causal=True, kv_head_chunk=hc, check_inputs=check)
    else:
        plan = dense_plan(L, world, rank)
        q, k, v, do = (_randn((1, h, tokens, D), dt, device, gen) for h in (H, Hkv, Hkv, H))
        kf, vf = (_randn((1, Hkv, L, D), dt, device, gen) for _ in range(2))
        lq, lkf, lvf, ldo = q, kf, vf, do
        cp_call = lambda qq, kk, vv, hc, check=True: zigzag_llama3_attention(  # noqa: E731
            qq, kk, vv, causal=True, kv_head_chunk=hc, check_inputs=check)
    groups = plan.groups(causal=True)
    flops_fwd = 4.0 * H * D * plan.pairs(causal=True)
    flops = {"fwd": flops_fwd, "fwd+bwd": 3.5 * flops_fwd}

    def local_run(with_bwd):
        def run():
            qq, kk, vv = (t.detach().requires_grad_(with_bwd) for t in (lq, lkf, lvf))
            with torch.set_grad_enabled(with_bwd):
                outs = [sparse_attn.attention(qq[:, :, g.q_start:g.q_end], kk[:, :, g.k_start:g.k_end],
                                              vv[:, :, g.k_start:g.k_end], causal=True) for g in groups]
                if with_bwd:
                    torch.autograd.grad(outs, (qq, kk, vv), [ldo[:, :, g.q_start:g.q_end] for g in groups])
        return run

    def cp_run(with_bwd, hc, check=True):
        def run():
            qq, kk, vv = (t.detach().requires_grad_(with_bwd) for t in (q, k, v))
            with torch.set_grad_enabled(with_bwd):
                out = cp_call(qq, kk, vv, hc, check)
                if with_bwd:
                    torch.autograd.grad(out, (qq, kk, vv), do)
        return run

    rows = []
    for mode, with_bwd in (("fwd", False), ("fwd+bwd", True)):
        fn = local_run(with_bwd)
        est = timer.once_ms(fn)  # also the first (compiling) call
        est = timer.once_ms(fn)
        reps = _reps(args, est, device)
        local_ms = timer.median_ms(fn, reps, args.warmup, barrier=False)
        local_b2b = timer.back_to_back_ms(fn, reps)
        for hc in args.kv_head_chunks:
            fn = cp_run(with_bwd, hc)
            timer.once_ms(fn)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            cp_ms = timer.median_ms(fn, reps, args.warmup, barrier=True)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
            cp_b2b = timer.back_to_back_ms(fn, reps)
            cp_unchecked = timer.median_ms(cp_run(with_bwd, hc, check=False), reps, args.warmup, barrier=True)
            per_rank = _gather({"rank": rank, "cp_ms": cp_ms, "local_ms": local_ms, "peak_extra_gib": peak,
                                "cp_b2b": cp_b2b, "local_b2b": local_b2b, "cp_unchecked": cp_unchecked}, world)
            fr = [r["local_ms"] / r["cp_ms"] for r in per_rank]
            fr_b2b = [r["local_b2b"] / r["cp_b2b"] for r in per_rank]
            rows.append({
                "layout": "varlen 4 seqs" if varlen else "dense B=1", "tokens_per_gpu": tokens, "total_tokens": L,
                "mode": mode, "kv_head_chunk": min(hc, Hkv), "heads": H, "kv_heads": Hkv, "head_dim": D,
                "dtype": str(dt).removeprefix("torch."), "causal": True, "reps": reps,
                "cp_ms": [r["cp_ms"] for r in per_rank], "local_ms": [r["local_ms"] for r in per_rank],
                "cp_tflops_per_gpu": statistics.mean(flops[mode] / r["cp_ms"] / 1e9 for r in per_rank),
                "local_tflops_per_gpu": statistics.mean(flops[mode] / r["local_ms"] / 1e9 for r in per_rank),
                "fraction": statistics.mean(fr), "fraction_min": min(fr),
                "cp_ms_back_to_back": [r["cp_b2b"] for r in per_rank],
                "local_ms_back_to_back": [r["local_b2b"] for r in per_rank],
                "fraction_back_to_back": statistics.mean(fr_b2b), "fraction_back_to_back_min": min(fr_b2b),
                "cp_ms_unchecked": [r["cp_unchecked"] for r in per_rank],
                "fraction_unchecked": statistics.mean(r["local_ms"] / r["cp_unchecked"] for r in per_rank),
                "peak_extra_gib": [r["peak_extra_gib"] for r in per_rank],
            })
            r = rows[-1]
            log(rank, f"  {r['layout']:13s} {tokens:>6d}/gpu {mode:7s} kv_head_chunk={r['kv_head_chunk']}: "
                      f"CP {max(r['cp_ms']):8.2f} ms {r['cp_tflops_per_gpu']:7.1f} TFLOP/s/gpu | local "
                      f"{statistics.mean(r['local_ms']):8.2f} ms {r['local_tflops_per_gpu']:7.1f} | "
                      f"fraction {r['fraction']:.3f} (min {r['fraction_min']:.3f}); back to back "
                      f"{r['fraction_back_to_back']:.3f} (min {r['fraction_back_to_back_min']:.3f}); "
                      f"check_inputs=False {r['fraction_unchecked']:.3f}")
    return rows


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    rank, world, device = init(args)
    timer = Timer(device)
    log(rank, f"cp_run: world {world}, backend {args.backend}, device {device.type}, dtype {args.dtype}, "
              f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, timeout {args.timeout:.0f} s")
    header = make_header(
        device, "cp", world_size=world, backend=args.backend, script="benchmarks/cp_run.py", argv=sys.argv[1:],
        flops="exact causal (query, key) pairs x 4 x H x D per rank; fwd+bwd x3.5",
        fraction="local (this rank's attention alone, K/V in memory) time / CP time, per rank; mean and min; "
                 "each call timed alone after a barrier and a sync (the GPU idle at the start, so host time "
                 "before the first kernel counts)",
        fraction_back_to_back="the same with reps calls issued back to back after one barrier (the host runs "
                              "ahead of the GPU, as in a training step): mean time per call",
        fraction_unchecked="as fraction, with check_inputs=False (no cross-rank input check)")
    checks, failed = [], False
    if not args.skip_check:
        t0 = time.monotonic()
        mine = check_dense(args, rank, world, device) + check_varlen(args, rank, world, device)
        checks = [row for rows in _gather(mine, world) for row in rows]
        failed = not all(c["ok"] for c in checks)
        for c in checks:
            if not c["ok"] or c["rank"] == 0:
                log(rank, f"  check rank {c['rank']} {c['what']}: err {c['err_cp']:.3e} (single-device "
                          f"{c['err_single']:.3e}) {'ok' if c['ok'] else 'FAILED'}")
        log(rank, f"correctness: {'FAILED' if failed else 'ok'} on all {world} ranks ({time.monotonic() - t0:.0f} s)")
    rows, skipped = [], []
    if not args.skip_bench:
        last = None  # (tokens, seconds) of the previous size
        for i, tokens in enumerate(args.tokens_per_gpu):
            elapsed = _all_max(time.monotonic() - t_start, device)
            predicted = 0.0 if last is None else last[1] * (tokens / last[0]) ** 2 * 1.3
            if elapsed + predicted > args.budget_s:
                skipped.append({"tokens_per_gpu": tokens, "reason": f"predicted {predicted:.0f} s after "
                                f"{elapsed:.0f} s exceeds --budget-s {args.budget_s:.0f}"})
                log(rank, f"skip {tokens}/gpu: {skipped[-1]['reason']}")
                continue
            t0 = time.monotonic()
            if tokens % 8:
                raise SystemExit(f"--tokens-per-gpu {tokens}: need a multiple of 8")
            rows += bench_size(args, rank, world, device, timer, tokens, varlen=False)
            if i == 0:
                rows += bench_size(args, rank, world, device, timer, tokens, varlen=True)
            last = (tokens, _all_max(time.monotonic() - t0, device))
    if rank == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"header": header, "checks_passed": not failed, "checks": checks,
                                              "rows": rows, "skipped": skipped}, indent=1) + "\n")
        log(rank, f"wrote {args.out} ({time.monotonic() - t_start:.0f} s)")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization: with gloo (torch 2.13, CPU) a worker thread can still be releasing the
    # last barrier's work while Python shuts down; its tensor decref then needs the GIL and the process dies
    # with "terminate called without an active exception" (SIGABRT, ~1 run in 10 locally) after the run
    # succeeded. Everything is written and the process group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
