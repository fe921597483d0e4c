"""Adaptive prediction overhead: meansim alone, attention on a precomputed layout, and the two together
on fresh q/k every repetition (``attention(q, k, v, "adaptive:<level>")``), plus the host syncs each path
makes. Target (issue 5): prediction <= 5% of the sparse attention time at 32K+.

    python benchmarks/predict_overhead.py --out $OUT/predict-overhead-h100.json        # GPU: 16K, 32K, 64K
    python benchmarks/predict_overhead.py --device cpu --lengths 256,512 --heads 2 --head-dim 32 --out x.json

Timings (median of ``--reps`` after warm-up; CUDA events on the GPU, ``perf_counter`` on the CPU):
  * ``*_ms``: each repetition starts on an idle GPU, so launch latency counts wherever the host is
    slower than the device (what a lone call costs).
  * ``*_busy_ms`` (CUDA): the GPU is first kept busy by a spin kernel, so a path that never waits
    for the GPU is fully queued before it starts; this is the device time. A path with host syncs
    stalls on the spin and shows its gaps here too.
  * ``*_host_ms``: time for the host to return from the call (no synchronize), the CPU cost.
  * ``overhead_pct = (end_to_end - attention) / attention * 100`` (and the same for the busy times).
Syncs (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` warnings during one warm call of each path,
with the source lines that triggered them. ``host_reads`` (every device): aten ops that read device
data back to the host (``item``/``bool``, ``nonzero``, ``unique``, boolean indexing, ...), counted
by a dispatch mode.
Inputs: ``sparse_attn.accuracy.structured_qkv`` (sparsifiable), B=1, H=--heads, D=--head-dim.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparse_attn
from sparse_attn.accuracy import structured_qkv
from sparse_attn.ops.block_pool import block_pool_sim, reference as pool_reference
from sparse_attn.predict import level_params, meansim

HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                 "masked_select", "repeat_interleave", "is_nonzero", "equal"}


class HostReads(TorchDispatchMode):
    """Count aten ops that need device values on the host (each one a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        kwargs = kwargs or {}
        if name in HOST_READ_OPS:
            self.counts[name] += 1
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
                                     if i is not None):
            self.counts["index[bool]"] += 1
        elif name == "_to_copy" and kwargs.get("device") is not None and torch.device(kwargs["device"]) != args[0].device:
            self.counts["device copy"] += 1
        return func(*args, **kwargs)


def count_host_reads(fn) -> dict:
    with HostReads() as mode:
        fn()
    return dict(mode.counts)


def count_cuda_syncs(fn) -> tuple[int, list[str]]:
    """Synchronizing CUDA calls during ``fn`` and the source lines that made them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs)
    return len(syncs), [f"{site} x{n}" for site, n in sites.most_common()]


# ----------------------------------------------------------------------------- timers
class Timer:
    def __init__(self, device: str, reps: int, warmup: int):
        self.cuda = device == "cuda"
        self.reps, self.warmup = reps, warmup
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 50_000_000
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        torch.cuda.synchronize()
        return cycles / s.elapsed_time(e)

    def run(self, fn, fresh=lambda: ()) -> dict:
        """fn(*fresh()) timed; ``fresh`` makes new inputs outside the timed span (fresh q/k per rep)."""
        for _ in range(self.warmup):
            fn(*fresh())
        if self.cuda:
            torch.cuda.synchronize()
        plain, busy, host = [], [], []
        for _ in range(self.reps):
            args = fresh()
            if not self.cuda:
                t0 = time.perf_counter()
                fn(*args)
                plain.append((time.perf_counter() - t0) * 1e3)
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            t0 = time.perf_counter()
            fn(*args)
            host.append((time.perf_counter() - t0) * 1e3)
            e.record()
            torch.cuda.synchronize()
            plain.append(s.elapsed_time(e))
        if self.cuda:  # the same with the GPU busy first: the host queues the whole call ahead of it
            spin_ms = 2.0 * statistics.median(host) + 2.0
            for _ in range(self.reps):
                args = fresh()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(spin_ms * self.cycles_per_ms))
                s.record()
                fn(*args)
                e.record()
                torch.cuda.synchronize()
                busy.append(s.elapsed_time(e))
        out = {"ms": statistics.median(plain)}
        if self.cuda:
            out.update(busy_ms=statistics.median(busy), host_ms=statistics.median(host))
        return out


# ----------------------------------------------------------------------------- checks
def pool_check(device: str) -> dict:
    """The pooling kernel against its PyTorch twin (CUDA only), strided bf16 and fp32 inputs."""
    if device != "cuda":
        return {}
    res = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 1000, 4, 128, device="cuda").to(dtype).transpose(1, 2)
        p, s = block_pool_sim(x, 128, torch.float32)
        pr, sr = pool_reference.block_pool_sim(x, 128, torch.float32)
        res[str(dtype).replace("torch.", "")] = {"pooled_max_abs": float((p - pr).abs().max()),
                                                 "sim_max_abs": float((s - sr).abs().max())}
    return res


def schedule_check(layout) -> bool | None:
    """The schedule meansim seeded equals the one the kernels would derive (CUDA only)."""
    from sparse_attn.ops.block_sparse.schedule import _build, schedule_key
    seeded = layout._derived.get(schedule_key(None))
    if seeded is None:
        return None
    built = _build(layout, None, True)
    return bool(torch.equal(seeded.indices, built.indices) and torch.equal(seeded.mask_ids, built.mask_ids)
                and torch.equal(seeded.n_full, built.n_full))


# ----------------------------------------------------------------------------- one case
def measure(qkv, causal: bool, args, timer: Timer) -> dict:
    dev = args.device
    q, k, v = qkv
    L = q.shape[2]
    opts = level_params(args.level)
    spec = f"adaptive:{args.level}"

    def fresh():  # new q/k storage each repetition: nothing cached on tensors or layouts can help
        return q.clone(), k.clone()

    def predict(qi, ki):
        return meansim(qi, ki, causal=causal, **opts)

    layout = predict(q, k)
    attend = lambda: sparse_attn.attention(q, k, v, layout, causal=causal)  # noqa: E731
    end_to_end = lambda qi, ki: sparse_attn.attention(qi, ki, v, spec, causal=causal)  # noqa: E731
    pool = lambda qi, ki: (block_pool_sim(qi, 128, torch.float32), block_pool_sim(ki, 128, torch.float32))  # noqa: E731

    row = {"seq_len": L, "causal": causal, "level": args.level, "heads": args.heads, "head_dim": args.head_dim,
           "dtype": args.dtype, "sparsity": round(float(layout.sparsity), 4)}
    t_pool = timer.run(pool, fresh)
    t_pred = timer.run(predict, fresh)
    t_attn = timer.run(attend)
    t_e2e = timer.run(end_to_end, fresh)
    for name, t in (("pool", t_pool), ("meansim", t_pred), ("attention", t_attn), ("end_to_end", t_e2e)):
        for key, val in t.items():
            row[f"{name}_{key}"] = round(val, 4)
    row["overhead_pct"] = round(100 * (t_e2e["ms"] - t_attn["ms"]) / t_attn["ms"], 2)
    row["meansim_pct_of_attention"] = round(100 * t_pred["ms"] / t_attn["ms"], 2)
    if dev == "cuda":
        row["overhead_busy_pct"] = round(100 * (t_e2e["busy_ms"] - t_attn["busy_ms"]) / t_attn["busy_ms"], 2)
        row["meansim_busy_pct_of_attention"] = round(100 * t_pred["busy_ms"] / t_attn["busy_ms"], 2)
        syncs = {}
        for name, fn in (("meansim", lambda: predict(*fresh())), ("attention", attend),
                         ("end_to_end", lambda: end_to_end(*fresh()))):
            n, sites = count_cuda_syncs(fn)
            syncs[name] = {"count": n, "sites": sites}
        row["cuda_syncs"] = syncs
        row["schedule_seeded_equals_built"] = schedule_check(layout)
    row["host_reads"] = {"meansim": count_host_reads(lambda: predict(*fresh())),
                         "attention": count_host_reads(attend),
                         "end_to_end": count_host_reads(lambda: end_to_end(*fresh()))}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON path")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--lengths", default=None, help="comma-separated (default 16384,32768,65536; CPU 256,512)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default bf16 (CPU fp32)")
    p.add_argument("--level", default="medium", choices=["low", "medium", "high"])
    p.add_argument("--modes", default="causal,full", help="causal and/or full (non-causal)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu")
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    lengths = [int(x) for x in (args.lengths or ("256,512" if cpu else "16384,32768,65536")).split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    timer = Timer(args.device, args.reps, args.warmup)
    import triton
    report = {
        "what": "adaptive prediction overhead (benchmarks/predict_overhead.py)",
        "device": torch.cuda.get_device_name() if not cpu else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": "prediction <= 5% of sparse attention time at 32K+ (overhead_pct)",
        "pool_kernel_check": pool_check(args.device),
        "results": [],
    }
    print(f"{'L':>6} {'mode':>6} {'sparsity':>8} {'pool':>8} {'meansim':>8} {'attn':>8} {'e2e':>8} {'ovh%':>6}"
          + ("" if cpu else f" {'busy ovh%':>9} {'syncs m/a/e':>11}"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for L in lengths:
        qkv = structured_qkv(1, args.heads, L, args.head_dim, dtype=dtype, device=args.device, seed=L)
        for mode in modes:
            row = measure(qkv, mode == "causal", args, timer)
            report["results"].append(row)
            line = (f"{L:>6} {mode:>6} {row['sparsity']:>8.3f} {row['pool_ms']:>8.3f} {row['meansim_ms']:>8.3f} "
                    f"{row['attention_ms']:>8.3f} {row['end_to_end_ms']:>8.3f} {row['overhead_pct']:>6.1f}")
            if not cpu:
                s = row["cuda_syncs"]
                line += (f" {row['overhead_busy_pct']:>9.1f} "
                         f"{s['meansim']['count']:>3}/{s['attention']['count']}/{s['end_to_end']['count']}")
            print(line, flush=True)
            with open(args.out, "w") as f:  # after every case: a cut-off run keeps what it measured
                json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
