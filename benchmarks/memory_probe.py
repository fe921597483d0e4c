"""Memory and time of the host-side steps the twenty-ninth session rewrote, on the GPU they run on:

- ``causal_cut`` of a band layout at 1M tokens (what ``attention(..., causal=True)`` and
  ``prepare(causal=True)`` run), against the old definition ``layout & causal(...)``, which builds
  the Qb x Kb causal layout;
- ``metrics.compare`` of two bf16 outputs of 1 GiB, in chunks (shipped) and as one chunk (about
  what converting both whole tensors to float64 costs);
- ``attention(..., causal=True)``'s first call on that band layout at 1M tokens (cut, schedule,
  forward), H=32, D=128, bf16, checked against a call on the builder's own causal layout.

Peak memory is ``torch.cuda.max_memory_allocated`` above what was allocated before the step.

    python benchmarks/memory_probe.py --out $OUT/memory-probe-h100.json
"""
from __future__ import annotations

import argparse
import time

import torch

import sparse_attn
from sparse_attn import metrics, patterns
from sparse_attn.bench.results import make_header
from sparse_attn.json_io import dumps


def measure(fn):
    """(result, seconds, peak bytes above the start) of one call, synchronised."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t, torch.cuda.max_memory_allocated() - base


def cut_rows(L: int) -> list[dict]:
    rows = []
    for block in (128, 64):
        first, second = (patterns.local(L, 4096, causal=False, block_q=block, block_k=block, device="cuda")
                         for _ in range(2))  # one layout object per path: nothing derived is shared
        new, t_new, m_new = measure(lambda: patterns.causal_cut(first))
        try:
            old, t_old, m_old = measure(lambda: second & patterns.causal(L, block_q=block, block_k=block,
                                                                         device="cuda"))
            same = all(torch.equal(getattr(new, f), getattr(old, f)) for f in ("kv_counts", "kv_indices",
                                                                              "kv_mask_ids")) and new.masks == old.masks
            del old
        except torch.OutOfMemoryError as e:  # the old definition may not fit at 64-blocks
            t_old, m_old, same = None, None, f"old path out of memory: {str(e)[:120]}"
        rows.append({"step": "causal_cut", "seq_len": L, "block": block, "blocks": new.num_blocks,
                     "new_s": t_new, "new_peak_mb": m_new / 2**20, "old_s": t_old,
                     "old_peak_mb": None if m_old is None else m_old / 2**20, "equal": same})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def compare_rows() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1, 32, 131072, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    b = a + (0.01 * torch.randn(a.shape, device="cuda", generator=g)).to(torch.bfloat16)
    rows, shipped = [], metrics.CHUNK
    for label, chunk in (("chunked", shipped), ("one chunk", a.numel())):
        metrics.CHUNK = chunk
        m, t, peak = measure(lambda: metrics.compare(a, b))
        rows.append({"step": "metrics.compare", "mode": label, "input_gb_each": a.numel() * 2 / 2**30, "s": t,
                     "peak_mb": peak / 2**20, "cosine": m["cosine"], "relative_l1": m["relative_l1"]})
        print(rows[-1], flush=True)
    metrics.CHUNK = shipped
    return rows


def attention_rows(L: int) -> list[dict]:
    q, k, v = (torch.randn(1, 32, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # local(causal=False) reaches `window` keys each side, self not counted: cut to causal, window 4095
    # is local(4096)'s 4096 keys, self included (a first run compared against window 4096 here: max diff 0.125)
    band = patterns.local(L, 4095, causal=False, device="cuda")
    out, t, peak = measure(lambda: sparse_attn.attention(q, k, v, band, causal=True))
    want = sparse_attn.attention(q, k, v, patterns.local(L, 4096, device="cuda"))
    row = {"step": "attention(causal=True) first call, band layout", "seq_len": L, "s": t, "peak_mb": peak / 2**20,
           "output_mb": out.numel() * 2 / 2**20, "max_diff_vs_causal_band": float((out - want).abs().max())}
    print(row, flush=True)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=1 << 20)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = cut_rows(a.seq_len) + compare_rows()
    torch.cuda.empty_cache()
    rows += attention_rows(a.seq_len)
    if a.out:
        with open(a.out, "w") as f:
            f.write(dumps({"header": make_header("cuda", "memory-probe"), "rows": rows}))


if __name__ == "__main__":
    main()
