"""Continuous-batching decoding steps through varlen_attention: eager calls against one captured CUDA graph
replayed on new lengths (the kernels' device plan, launch.forward ``device_plan``).

    python benchmarks/varlen_graph_probe.py --out $OUT/varlen-graph.json [--seqs 8 64]

Per step: S sequences x 1 query row, caches 1K-32K (spread evenly), causal, H=32, Hkv 8, D=128, bf16, no
grad; every cache one token longer each step. Cases:
``eager, offsets on the GPU`` / ``on the CPU``: varlen_attention called each step (on the GPU the
validation reads the offsets: a sync); ``graph replay``: the step captured once (max_seqlen_k covering
every step) and replayed after writing the step's offsets into the captured tensor (a device copy);
``graph replay, no copy``: the replay alone (the offsets left as they are: the floor of a replayed step).
The graph is captured on the whole K/V buffers (a replay's offsets may end before their end: inside a
capture the values are not checked), after eager warm-up calls on the first step's.
Each case runs WARM steps first, then CALLS steps back to back: the host loop's time a step, the wall time
to the end of the last kernel, and the GPU span between events around the loop. Run under an older tree
(PYTHONPATH) the graph cases record why they did not run instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sparse_attn  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.testing import capture_graph  # noqa: E402
from varlen_offsets_probe import _time  # noqa: E402

H, HKV, D, GROW, WARM, CALLS, ROUNDS = 32, 8, 128, 1024, 64, 500, 2


def _offsets(lens, device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _cases(n_seqs: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    k_lens = [1024 + i * (32768 - 1024) // max(n_seqs - 1, 1) for i in range(n_seqs)]
    total = sum(k_lens) + n_seqs * GROW
    q = torch.randn(n_seqs, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(total, HKV, D, device=dev, dtype=dt) for _ in range(2))
    cu_q = torch.arange(n_seqs + 1, dtype=torch.int32, device=dev)
    cu_k = [_offsets([n + s for n in k_lens], dev) for s in range(GROW + 1)]
    on = {"gpu": (cu_q, cu_k), "cpu": (cu_q.cpu(), [c.cpu() for c in cu_k])}
    max_k = max(k_lens) + GROW

    def eager(s: int, where: str):
        t = sum(k_lens) + n_seqs * s
        cq, ck = on[where]
        return sparse_attn.varlen_attention(q, k[:t], v[:t], cq, ck[s], 1, max_k, causal=True)

    cases = {"eager, offsets on the GPU": lambda s: eager(s, "gpu"),
             "eager, offsets on the CPU": lambda s: eager(s, "cpu")}
    static_cu = cu_k[0].clone()
    try:  # the eager warm-up on offsets that end at the tensors' length
        graph, _ = capture_graph(lambda: sparse_attn.varlen_attention(q, k, v, cu_q, static_cu, 1, max_k, causal=True),
                                 warm_up=lambda: eager(0, "gpu"))
    except TypeError as e:  # an older tree's capture_graph, without warm_up= (its varlen calls refused capture)
        return cases, f"not run: this tree's testing.capture_graph has no warm_up= ({str(e)[:80]})"
    except RuntimeError as e:  # a call that refuses capture
        return cases, f"{type(e).__name__}: {str(e)[:160]}"

    def replay(s: int, copy: bool = True):
        if copy:
            static_cu.copy_(cu_k[s], non_blocking=True)
        graph.replay()

    cases["graph replay"] = replay
    cases["graph replay, no copy"] = lambda s: replay(s, copy=False)
    return cases, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", type=int, nargs="+", default=[8, 64])
    a = ap.parse_args()
    rows = []
    for n_seqs in a.seqs:
        cases, refused = _cases(n_seqs)
        if refused:
            rows.append({"seqs": n_seqs, "case": "graph replay", "refused": refused})
            print(json.dumps(rows[-1]), flush=True)
        for r in range(1, ROUNDS + 1):
            for name, fn in cases.items():
                row = {"seqs": n_seqs, "round": r, "case": name, **_time(fn, WARM, CALLS)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    Path(a.out).write_text(json.dumps({"header": make_header("cuda", "varlen-graph"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
