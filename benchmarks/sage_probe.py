"""Quick 8-bit probe on the GPU: dense (and one sparse) forward, bf16 kernel vs int8 / int8-fp8
end to end (quantization included) and kernel alone (inputs quantized beforehand), effective
TOPS = 4 B H L^2 D density / time. The full suite is `sparse-attn bench --suite sage`."""
import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

import sparse_attn
from sparse_attn import patterns
from sparse_attn.api import _kernel_layout
from sparse_attn.ops.block_sparse import launch as bs_launch
from sparse_attn.ops.block_sparse import forward_layout_inputs
from sparse_attn.ops.sage import launch as sage_launch
from sparse_attn.ops.sage.granularity import GRANULARITY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import layouts  # noqa: E402


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_only(q, k, v, lay, quant, gran, per_key_scales=False):
    """The attention kernel on pre-quantized inputs (what the quantization costs is measured apart).
    ``per_key_scales``: multiply every score by its key's scale even where one K scale covers a tile
    (the kernel's path before the per-tile fold), for an A/B on the same inputs."""
    (qs, qp), (ks, kp) = GRANULARITY[gran]
    q8, q_s = sage_launch.quantize_rows(q, qs, qp, None, False)
    k8, k_s = sage_launch.quantize_rows(k, ks, kp, sage_launch.k_mean(k, False), False)
    vq, v_s = sage_launch.quantize_v_fp8(v, False) if quant == 2 else (v, None)
    args = forward_layout_inputs(lay)
    scale = 1 / math.sqrt(q.shape[-1])
    span = 0 if per_key_scales or kp != 1 else ks
    return lambda: bs_launch.forward(q8, k8, vq, *args, None, None, lay.block_q, lay.block_k, scale, q.shape[2],
                                     k.shape[2], 1, (q_s, k_s, v_s), quant, q.dtype, k_scale_span=span)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dense:16384", "dense:32768", "local4096:32768"],
                    help="dense:L, local4096:L (causal) or randomD:L (probe.py's block layout at density D)")
    ap.add_argument("--grans", nargs="+", default=["per_warp"])
    ap.add_argument("--per-key-ab", action="store_true",
                    help="also time the kernel with per-key K-scale multiplies (rounds alternate the two)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    try:
        from sageattention import sageattn
    except Exception as e:  # noqa: BLE001 - optional peer
        sageattn = None
        print("sageattention unavailable:", e)
    for case in a.cases:
        kind, L = case.split(":")
        L = int(L)
        B, H, D = 1, 32, 128
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        if kind.startswith("random"):  # probe.py's seeded random block layout, not causal
            lay, causal = layouts(L, kind)[0], False
        else:
            lay = None if kind == "dense" else patterns.local(L, 4096, device="cuda")
            causal = kind != "dense"
        kl = _kernel_layout(lay, causal, L, L, "cuda")
        flops = 4 * B * H * L * L * D * kl.density
        res = {"case": case, "density": kl.density}
        res["bf16_ms"] = ms(lambda: sparse_attn.attention(q, k, v, lay, causal=causal))
        for gran in a.grans:
            for name, mode in (("int8", 1), ("int8-fp8", 2)):
                res[f"{name}/{gran}_ms"] = ms(lambda: sparse_attn.attention(q, k, v, lay, causal=causal, quant=name,
                                                                              quant_granularity=gran))
                if a.per_key_ab:  # alternate the two paths over three rounds: the board's clocks drift alike
                    fold, per_key = kernel_only(q, k, v, kl, mode, gran), kernel_only(q, k, v, kl, mode, gran, True)
                    same = (fold()[0].float() - per_key()[0].float()).abs().max().item()
                    t = {"fold": [], "per_key": []}
                    for _ in range(3):
                        t["fold"].append(ms(fold))
                        t["per_key"].append(ms(per_key))
                    res[f"{name}/{gran}_kernel_ms"] = statistics.median(t["fold"])
                    res[f"{name}/{gran}_kernel_per_key_ms"] = statistics.median(t["per_key"])
                    res[f"{name}/{gran}_fold_vs_per_key_max_abs_diff"] = same
                else:
                    res[f"{name}/{gran}_kernel_ms"] = ms(kernel_only(q, k, v, kl, mode, gran))
        (qs, qp), (ks, kp) = GRANULARITY[a.grans[0]]
        res["quant_qk_ms"] = ms(lambda: (sage_launch.quantize_rows(q, qs, qp, None, False),
                                         sage_launch.quantize_rows(k, ks, kp, sage_launch.k_mean(k, False), False)))
        res["quant_v_fp8_ms"] = ms(lambda: sage_launch.quantize_v_fp8(v, False))
        if sageattn is not None and kind == "dense":
            try:
                res["sageattention_ms"] = ms(lambda: sageattn(q, k, v, is_causal=False))
            except Exception as e:  # noqa: BLE001
                res["sageattention_error"] = str(e)[-200:]
        for key in [k_ for k_ in res if k_.endswith("_ms") and not k_.startswith("quant")]:
            res[key.replace("_ms", "_tops")] = flops / res[key] / 1e9
        # the forward's autotune choices so far: (kind, blocks, head dim, variant) -> {key: config}; the key
        # leaves out sequence length, so a later length reuses the first length's pick
        res["autotune"] = bs_launch.autotune_picks("fwd")
        print(json.dumps({k_: round(v_, 3) if isinstance(v_, float) else v_ for k_, v_ in res.items()}), flush=True)
        rows.append(res)
    if a.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.date.today().isoformat(), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
