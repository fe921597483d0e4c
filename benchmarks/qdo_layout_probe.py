"""Does the memory layout of Q and dO change the dK/dV kernel's speed?

grouped_profile.py found the one-launch grouped backward's dK/dV kernel ~25% slower than the same
kernel in a plain call over the same group, with the same layout and (locally compiled) nearly the
same code. One difference is memory layout: grouped attention passes packed ``[T, H, D]`` Q and dO
(a head's rows H * D elements apart), while the plain call over slices gets packed Q but a
head-major contiguous dO from autograd. This runs one plain causal attention (Lq 8192 at the end of
Lk 32768, as the zigzag group with the longest K/V slice; H=32, Hkv=8, D=128, bf16) with Q and dO
each packed or head-major (launch.backward called directly: the autograd op makes dO contiguous,
i.e. head-major, for any [B, H, L, D] view), then the same data through the packed kernels, and
prints the GPU ms per backward of each kernel (torch.profiler). ``--dq-kv ptr tma`` repeats it all
for each way the dQ kernel loads K/V (launch.BWD_DQ_KV).

Found (H100, results/qdo-layout*-h100.json): the layout of Q/dO does not matter; the packed dK/dV
kernel was 23% slower than the dense one on the same data until its row terms were padded
(NOTES.md, backward item 10).

    python benchmarks/qdo_layout_probe.py --out /tmp/qdo-layout.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_profile import kernel_ms  # noqa: E402
from sparse_attn import patterns  # noqa: E402
from sparse_attn.bench.results import make_header  # noqa: E402
from sparse_attn.ops.block_sparse import launch, layout_inputs  # noqa: E402


def as_layout(t_packed: torch.Tensor, kind: str) -> torch.Tensor:
    """``[1, H, L, D]`` view of packed ``[L, H, D]`` data: strided over the packed rows, or a
    head-major contiguous copy."""
    view = t_packed.transpose(0, 1)[None]
    return view if kind == "packed" else view.contiguous()


def run_plain(step) -> dict:
    step()
    torch.cuda.synchronize()
    return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lq", type=int, default=8192)
    ap.add_argument("--lk", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dq-kv", nargs="+", default=["tma"], choices=["tma", "ptr"],
                    help="the dQ kernel's K/V loads (launch.BWD_DQ_KV), one pass each")
    ap.add_argument("--ncu", action="store_true",
                    help="no torch.profiler (which Nsight Compute's own CUPTI session excludes): each config runs "
                         "one backward, in the order printed; pick launches with ncu's --launch-skip")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda n, h: torch.randn(n, h, 128, generator=g, device=dev).bfloat16()  # noqa: E731
    q_p, k_p, v_p, do_p = mk(a.lq, 32), mk(a.lk, 8), mk(a.lk, 8), mk(a.lq, 32)
    layout = patterns.causal(a.lq, a.lk).to(dev)
    scale = 128 ** -0.5
    rows = []
    for dq_kv in a.dq_kv:
        launch.BWD_DQ_KV = dq_kv
        print(f"dQ kernel K/V loads: {dq_kv}")
        rows += run_layouts(a, dev, q_p, k_p, v_p, do_p, layout, scale)
    if a.out:
        Path(a.out).write_text(json.dumps({**make_header(dev, "qdo-layout"), "config": vars(a), "rows": rows},
                                          indent=1))
        print(f"wrote {a.out}")
    return 0


def run_layouts(a, dev, q_p, k_p, v_p, do_p, layout, scale) -> list[dict]:
    """The dense layouts (Q, dO packed or head-major), then the packed kernels; one row each."""
    rows = []
    k, v = as_layout(k_p, "packed"), as_layout(v_p, "packed")
    (counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, _, terms,
     n_terms) = layout_inputs(layout, True)
    for q_kind in ("packed", "head-major"):
        for do_kind in ("packed", "head-major"):
            q, do = as_layout(q_p, q_kind), as_layout(do_p, do_kind)
            out = torch.empty_like(q)  # the output in q's layout, as the op allocates it
            out, lse = launch.forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms,
                                      n_terms, None, None, 128, 128, scale, a.lq, a.lk, out=out)

            def step(q=q, do=do, out=out, lse=lse):
                launch.backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                                t_indices, t_mask_ids, terms, n_terms, None, None, 128, 128, scale, a.lq, a.lk)
            per = run_plain(step) if a.ncu else kernel_ms(step, a.reps)
            print(f"q {q_kind:10s} dO {do_kind:10s} " + "  ".join(f"{n} {ms:.3f}" for n, ms in per.items()
                                                              if "kernel" in n and "at::" not in n), flush=True)
            rows.append({"q": q_kind, "do": do_kind, "dq_kv": launch.BWD_DQ_KV, "kernels": per})
    # the same data through the packed (varlen) kernels: one sequence, as cu_seqlens (seq_step 1) or as
    # grouped attention's (start, end) pairs (seq_step 2)
    for seq_step in (1, 2):
        cu_q = torch.tensor([0, a.lq], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, a.lk], dtype=torch.int32, device=dev)
        (counts, n_full, full_start, indices, mask_ids, contiguous, t_counts, t_n_full, t_indices, t_mask_ids, _,
         terms, n_terms) = layout_inputs(layout, True, (a.lk,))
        out, lse = launch.forward(q_p, k_p, v_p, counts, n_full, full_start, indices, mask_ids, contiguous, terms,
                                  n_terms, cu_q, cu_k, 128, 128, scale, a.lq, a.lk, seq_step)

        def step(out=out, lse=lse, seq_step=seq_step, cu_q=cu_q, cu_k=cu_k):
            launch.backward(do_p, q_p, k_p, v_p, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full,
                            t_indices, t_mask_ids, terms, n_terms, cu_q, cu_k, 128, 128, scale, a.lq, a.lk, seq_step)
        per = run_plain(step) if a.ncu else kernel_ms(step, a.reps)
        print(f"packed, seq_step {seq_step}: " + "  ".join(f"{n} {ms:.3f}" for n, ms in per.items()
                                                          if "kernel" in n and "at::" not in n), flush=True)
        rows.append({"q": "packed", "do": "packed", "varlen_seq_step": seq_step, "dq_kv": launch.BWD_DQ_KV,
                     "kernels": per})
    return rows


if __name__ == "__main__":
    sys.exit(main())
