"""Varlen (continuous-batching) decoding: each call packs S sequences of a few query rows against caches
of different lengths (``varlen_attention(..., causal=True)``), and every step the caches grow, so no
plan is ever reused. What a call costs with the one-shot dense / causal plan (varlen.stack_dense_or_causal)
and the short-query forward, against the per-sequence plan (the path before this probe; it is still what
``pattern=`` takes) and the forward before short_query_plan.

    python benchmarks/varlen_decode_probe.py --out $OUT/varlen-decode.json [--cases 8:1:8:1024:32768 ...]

A case is S:Lq:Hkv:Kmin:Kmax (32 query heads, head dim 128, bf16): S sequences of Lq query rows, key
lengths spread evenly over [Kmin, Kmax]. Timings per provider:
- ``us_per_step``: eager calls as a decoder makes them, each step with caches one token longer
  (STEPS distinct steps cycled, the plan cache cleared before each), host work included: the GPU
  stream's time for CALLS calls (bench.timing.time_interleaved), which counts its waits for the host;
- ``us_per_step_wall``: the same calls back to back, host clock, synchronized at the end;
- ``us_per_call_gpu``: the kernels alone, CALLS calls on step 0's plan captured in a CUDA graph
  (varlen_attention_op: the API refuses capture, since it plans on the host).
FlexAttention's row is GPU time only, a document + bottom-right causal mask_mod on the packed tokens
with its block mask built once (a decoder would rebuild it every step); not past FLEX_MAX_QUERIES.
Each output is compared with the per-sequence plan's unsplit forward on the same inputs.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

import sparse_attn
from sparse_attn import api, patterns
from sparse_attn.bench.providers import _flex_fn
from sparse_attn.bench.timing import time_interleaved
from sparse_attn.ops.block_sparse import varlen_attention_op
from sparse_attn.testing import capture_graph, launch_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_probe import probe_parser, save_rows  # noqa: E402

H, D = 32, 128
CALLS = 10
STEPS = 40
DEFAULT_CASES = ["8:1:8:1024:32768", "32:1:8:1024:32768", "64:1:8:256:4096", "8:16:8:4096:16384",
                 "2100:1:32:256:256"]
BEFORE = dict(FWD_KV_SPLIT="0", PACK_GQA=False, SMALL_Q_ROWS=0)  # the forward before short_query_plan
# FlexAttention's graph replay hit an illegal memory access at 2100 packed queries x 537K keys (H200,
# torch 2.11; eager calls and our kernels ran): past this many packed queries its row is left out
FLEX_MAX_QUERIES = 1024


def causal_per_sequence(lq: int, lk: int):
    """The per-sequence plan's layout (what pattern= runs): the same blocks as causal=True."""
    return patterns.causal(lq, lk)


def cu(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def flex_call(q, k, v, q_lens, k_lens):
    """FlexAttention over the packed tokens [1, H, T, D]: query t of sequence s sees key j of the same
    sequence at or before its bottom-right position."""
    from torch.nn.attention.flex_attention import create_block_mask
    doc_q = torch.repeat_interleave(torch.arange(len(q_lens), device="cuda"), torch.tensor(q_lens, device="cuda"))
    doc_k = torch.repeat_interleave(torch.arange(len(k_lens), device="cuda"), torch.tensor(k_lens, device="cuda"))
    q0, k0 = cu(q_lens)[:-1].long(), cu(k_lens)[:-1].long()
    shift = torch.tensor(k_lens, device="cuda") - torch.tensor(q_lens, device="cuda")

    def mask_mod(b, h, i, j):
        s = doc_q[i]
        return (s == doc_k[j]) & (j - k0[s] <= i - q0[s] + shift[s])
    mask = create_block_mask(mask_mod, 1, 1, q.shape[0], k.shape[0], device="cuda")
    flex = _flex_fn("cuda")
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1)


def main():
    a = probe_parser(DEFAULT_CASES).parse_args()
    rows = []
    for spec in a.cases:
        S, lq, hkv, kmin, kmax = (int(x) for x in spec.split(":"))
        row = dict(case=spec, sequences=S, q_len=lq, heads=H, kv_heads=hkv, k_min=kmin, k_max=kmax, head_dim=D)
        print(spec, flush=True)
        try:
            torch.manual_seed(0)
            k_lens = [kmin + (kmax - kmin) * i // max(S - 1, 1) for i in range(S)]
            q_lens = [lq] * S
            steps = [[n + s for n in k_lens] for s in range(STEPS)]  # each step: every cache one token longer
            q = torch.randn(S * lq, H, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(sum(steps[-1]), hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            cq, cks = cu(q_lens), [cu(lens) for lens in steps]
            max_k = max(steps[-1])

            def eager(pattern, causal, settings):
                state = {"i": 0}

                def call(step=None):  # None: the next step
                    i = state["i"] = (state["i"] + 1) % STEPS if step is None else step
                    api._VARLEN_PLANS.clear()  # a decoder's every step plans anew (providers share the cache)
                    n = int(sum(steps[i]))
                    with launch_settings(**settings):
                        return sparse_attn.varlen_attention(q, k[:n], v[:n], cq, cks[i], lq, max_k, pattern=pattern,
                                                            causal=causal)
                return call

            providers = {
                "sparse_attn": eager(None, True, {}),
                "sparse_attn-per-seq-plan": eager(causal_per_sequence, False, {}),
                "before": eager(causal_per_sequence, False, BEFORE),  # per-sequence plan, autotuned tile
            }
            n0 = int(sum(steps[0]))
            ref = providers["before"](0).float()
            fast_plan = api._varlen_plan(q_lens, steps[0], None, None, True, H, lq, max_k, q.device)
            slow_plan = api._varlen_plan(q_lens, steps[0], None, causal_per_sequence, False, H, lq, max_k, q.device)
            row["fast_plan_is_one_shot"] = fast_plan.per_seq is None

            def kernels(plan, settings):
                def call():
                    with launch_settings(**settings):
                        return varlen_attention_op(q, k[:n0], v[:n0], plan.stacked, cq, cks[0], lq, max_k,
                                                   plan.kv_lens)
                return call
            # "one-wave": the split-KV rule before packed calls took two waves (launch.kv_splits ``uneven``)
            gpu_only = {"sparse_attn": kernels(fast_plan, {}),
                        "one-wave": kernels(fast_plan, {"KV_SPLIT_LONG_WAVES": 0}),
                        "before": kernels(slow_plan, BEFORE)}
            try:
                if S * lq <= FLEX_MAX_QUERIES:
                    gpu_only["flex"] = flex_call(q, k[:n0], v[:n0], q_lens, steps[0])
            except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
                row["flex_error"] = f"{type(e).__name__}: {e}"[:300]
            diffs, graphs, errors = {}, {}, {}
            for name, call in providers.items():
                diffs[name] = (call(0).float() - ref).abs().max().item()
            for name, call in gpu_only.items():
                try:
                    diffs[f"{name}-gpu"] = (call().float() - ref).abs().max().item()
                    graphs[name], _ = capture_graph(lambda call=call: [call() for _ in range(CALLS)])
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            names = list(providers)
            ms = time_interleaved([lambda c=providers[n]: [c() for _ in range(CALLS)] for n in names], "cuda")
            row["us_per_step"] = {n: 1e3 * t / CALLS for n, t in zip(names, ms)}
            host = {}
            for name, call in providers.items():  # the host's own time a call, synchronized at the end
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    call()
                torch.cuda.synchronize()
                host[name] = 1e6 * (time.perf_counter() - t0) / CALLS
            row["us_per_step_wall"] = host
            gnames = list(graphs)
            gms = time_interleaved([graphs[n].replay for n in gnames], "cuda")
            row["us_per_call_gpu"] = {n: 1e3 * t / CALLS for n, t in zip(gnames, gms)}
            row.update(max_abs_diff_vs_before=diffs, errors=errors, steps=STEPS)
            print(json.dumps(row), flush=True)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-1500:]
            print(row["error"], file=sys.stderr, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
        save_rows(a.out, "varlen-decode-probe", rows)


if __name__ == "__main__":
    main()
