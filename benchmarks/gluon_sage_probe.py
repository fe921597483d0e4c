"""Gluon 8-bit forward (ops/sage/hopper_kernels.py, FA3's intra-warpgroup overlap) against the
Triton 8-bit kernel, both on the same pre-quantized dense inputs: agreement of outputs and LSE,
then kernel-alone times in alternating rounds (medians), effective TOPS = 4 B H L^2 D / time."""
import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

from sparse_attn.api import _kernel_layout
from sparse_attn.ops.sage import hopper_launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sage_probe import kernel_only, ms  # noqa: E402
from sparse_attn.ops.sage import launch as sage_launch  # noqa: E402
from sparse_attn.ops.sage.granularity import GRANULARITY  # noqa: E402


def quantized(q, k, v, gran, quant):
    (qs, qp), (ks, kp) = GRANULARITY[gran]
    q8, q_s = sage_launch.quantize_rows(q, qs, qp, None, False)
    k8, k_s = sage_launch.quantize_rows(k, ks, kp, sage_launch.k_mean(k, False), False)
    vq, v_s = sage_launch.quantize_v_fp8(v, False) if quant == 2 else (v.contiguous(), None)
    return q8, k8, vq, q_s, k_s, v_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--configs", nargs="+", default=["64,128,4,3", "128,128,8,3"])
    ap.add_argument("--quants", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    configs = [tuple(c.split(",")) if c.startswith("ws") else tuple(int(x) for x in c.split(",")) for c in a.configs]
    rows = []
    for L in a.lengths:
        B, H, D = 1, 32, 128
        torch.manual_seed(L)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k = k + 3 * torch.randn(1, 1, 1, D, device="cuda", dtype=torch.bfloat16)  # an offset smoothing removes
        kl = _kernel_layout(None, False, L, L, "cuda")
        flops = 4 * B * H * L * L * D
        scale = 1 / math.sqrt(D)
        for quant in a.quants:
            q8, k8, vq, q_s, k_s, v_s = quantized(q, k, v, "per_warp", quant)
            triton_fn = kernel_only(q, k, v, kl, quant, "per_warp")
            o_ref, lse_ref = triton_fn()[:2]
            res = {"L": L, "quant": quant}
            fns = {"triton": triton_fn}
            for cfg in configs:
                name = "gluon_" + "x".join(map(str, cfg))
                if cfg[0] == "ws":  # ws,<pp|nopp>,<slots>
                    fn = (lambda cfg=cfg: hopper_launch.forward_ws(q8, k8, vq, q_s, k_s, v_s, scale, quant,
                                                                   torch.bfloat16, cfg[1] == "pp", int(cfg[2])))
                else:
                    fn = (lambda cfg=cfg: hopper_launch.forward(q8, k8, vq, q_s, k_s, v_s, scale, quant,
                                                                torch.bfloat16, cfg))
                try:  # the first call writes into NaN-poisoned buffers: a tile left unwritten shows
                    o = torch.full_like(o_ref, float("nan"))
                    lse = torch.full(lse_ref.shape, float("nan"), device="cuda")
                    if cfg[0] == "ws":
                        hopper_launch.forward_ws(q8, k8, vq, q_s, k_s, v_s, scale, quant, torch.bfloat16,
                                                 cfg[1] == "pp", int(cfg[2]), out=o, lse=lse)
                    else:
                        hopper_launch.forward(q8, k8, vq, q_s, k_s, v_s, scale, quant, torch.bfloat16, cfg,
                                              out=o, lse=lse)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - record and go on
                    res[name + "_error"] = repr(e)[-300:]
                    print(name, "failed:", repr(e)[-300:], flush=True)
                    continue
                # agreement with the Triton kernel on the same quantized inputs
                d = (o.float() - o_ref.float())
                res[name + "_rel_l1_vs_triton"] = (d.abs().sum() / o_ref.float().abs().sum()).item()
                res[name + "_max_abs_vs_triton"] = d.abs().max().item()
                res[name + "_lse_max_abs_vs_triton"] = (lse - lse_ref.reshape(lse.shape)).abs().max().item()
                res[name + "_finite"] = bool(torch.isfinite(o).all().item())
                fns[name] = fn
            times = {n: [] for n in fns}
            for _ in range(a.rounds):
                for n, fn in fns.items():
                    times[n].append(ms(fn))
            for n, t in times.items():
                res[n + "_ms"] = statistics.median(t)
                res[n + "_tops"] = flops / res[n + "_ms"] / 1e9
            print(json.dumps({k_: round(v_, 5) if isinstance(v_, float) else v_ for k_, v_ in res.items()}), flush=True)
            rows.append(res)
    if a.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.date.today().isoformat(), "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
