"""Quick kernel probe on the GPU: effective TFLOP/s of ours vs SDPA (and Flex when present) on a few
layouts, one process, medians after warm-up. The full suite lives in `sparse-attn bench --suite kernels`."""
import argparse
import json
import math
import sys

import torch
import triton

import sparse_attn
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, causal_term, document_term, window_term


def layouts(L, which):
    mk = lambda m: BlockLayout.from_mask(m, q_len=L, block_q=128, block_k=128, device="cuda")  # noqa: E731
    if which == "dense":
        return mk(ElementMask((MaskTerm(),))), False
    if which == "causal":
        return mk(ElementMask((causal_term(),))), True
    if which == "window4096":
        return mk(ElementMask((window_term(4095, 0),))), True
    if which == "streaming4096":  # the suite's streaming-128+4096: 128 sinks + a 4096 causal window
        from sparse_attn.patterns import streaming
        return streaming(L, 4096, 128, device="cuda"), True
    if which == "blockdiag4096":
        return mk(ElementMask((document_term(4096),))), False
    if which.startswith("randcausal"):  # random blocks under the causal triangle: element-masked diagonal
        d = float(which[10:])
        g = torch.Generator().manual_seed(0)
        n = math.ceil(L / 128)
        eye = torch.eye(n, dtype=torch.bool).expand(1, 32, n, n)
        bm = (torch.rand(1, 32, n, n, generator=g) < d).tril() | eye
        return BlockLayout.from_block_mask(bm, block_q=128, block_k=128, partial=eye,
                                           mask=ElementMask((causal_term(),))).to("cuda"), True
    if which.startswith("random"):
        d = float(which[6:])
        g = torch.Generator().manual_seed(0)
        n = math.ceil(L / 128)
        bm = torch.rand(1, 32, n, n, generator=g) < d
        bm |= torch.eye(n, dtype=torch.bool)
        return BlockLayout.from_block_mask(bm, block_q=128, block_k=128).to("cuda"), False
    raise ValueError(which)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "causal:16384", "window4096:32768", "random0.1:32768"])
    ap.add_argument("--hkv", type=int, default=32)
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--variants", nargs="+", default=["tma"],
                    help="forward variants: ptr tma indexed (tma, per-tile index loads even for contiguous rows)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    from sparse_attn.ops.block_sparse import launch
    for case, variant in [(c, v) for c in a.cases for v in a.variants]:
        launch.FWD_VARIANT = "tma" if variant == "indexed" else variant
        launch.FORCE_INDEXED = variant == "indexed"
        try:
            row = run_case(a, case, variant)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile must not hide the others
            row = dict(case=case, variant=variant, error=f"{type(e).__name__}: {str(e)[-300:]}")
        print(json.dumps({k2: (round(v2, 3) if isinstance(v2, float) else v2) for k2, v2 in row.items()}), flush=True)
        rows.append(row)
        if a.out:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "rows": rows}, open(a.out, "w"), indent=1)


_FIRST_OUT: dict = {}


def run_case(a, case, variant):
    which, L = case.split(":")
    L = int(L)
    layout, causal_like = layouts(L, which)
    B, H, D = 1, 32, 128
    torch.manual_seed(0)  # the same inputs for every variant of a case: outputs are compared below
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, a.hkv, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, a.hkv, L, D, device="cuda", dtype=torch.bfloat16)
    flops = 4 * B * D * 128 * 128 * (layout.num_blocks * (H // layout.heads))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = sparse_attn.attention(q, k, v, layout)
    torch.cuda.synchronize()
    extra_bytes = torch.cuda.max_memory_allocated() - base  # output + lse + workspace, beyond q/k/v/layout
    ms = bench(lambda: sparse_attn.attention(q, k, v, layout))
    row = dict(peak_extra_bytes=extra_bytes, inputs_bytes=3 * q.numel() * q.element_size(), layout_bytes=layout.nbytes,
               peak_total_bytes=torch.cuda.max_memory_allocated(), case=which, variant=variant, L=L, hkv=a.hkv, density=layout.density, ms=ms, tflops=flops / ms * 1e-9)
    first = _FIRST_OUT.setdefault(case, out)  # the case's first variant
    row["max_abs_diff_vs_first_variant"] = (out.float() - first.float()).abs().max().item()
    if which in ("dense", "causal") and variant == a.variants[0]:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kk, vv = (k, v) if a.hkv == H else (k.repeat_interleave(H // a.hkv, 1), v.repeat_interleave(H // a.hkv, 1))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["cudnn_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=causal_like))
        row["cudnn_tflops"] = flops / row["cudnn_ms"] * 1e-9
    if a.bwd and variant == a.variants[0]:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        o = sparse_attn.attention(qg, kg, vg, layout)
        do = torch.randn_like(o)
        row["bwd_ms"] = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
        row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] * 1e-9
    return row


if __name__ == "__main__":
    sys.exit(main())
