"""Where the eager decoding step's difference to sdpa lies: host time inside the attention and mask functions, and
GPU time of every kernel, for the integration's dense model and transformers' sdpa on the same random Llama and
prompts (hf_batch_probe.py's model; ``one``: the 4096-token prompt alone, ``padded``: 8 left-padded prompts).

Host time: each model's attention function (``sparse_attn``: integrations.transformers.sparse_attention_forward;
``sdpa``: transformers' sdpa_attention_forward) and mask function, wrapped with ``perf_counter`` and summed over
the decoding steps of a 64-token generate() (the prefill's calls left out: the first forward), medians of ROUNDS
generates alternated between the models; also per layer (a step's first layer meets a new cache length), and the
library call inside ours (api.attention, or a padded batch's _unpad.in_place). GPU time: one generate() per model under torch.profiler, each kernel's
device time summed by name over the decoding steps, per step. No cProfile: its per-call cost is what inflated the
integration's share in earlier profiles.

    PYTHONPATH=src:benchmarks python benchmarks/hf_step_split_probe.py --out OUT.json [--prompts one|padded] [--layers 4]
        [--new-lengths]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from hf_batch_probe import _model, padded_inputs

TOKENS = 64


def main() -> None:
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    from sparse_attn.bench.results import make_header
    from sparse_attn.integrations import _unpad
    from sparse_attn.integrations import transformers as integ
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", choices=("padded", "one"), default="one")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-lengths", action="store_true",
                    help="each round's prompts TOKENS + 1 tokens shorter than the last's: no step's cache length "
                         "recurs from an earlier round, as in real use (a step's first layer then records)")
    args = ap.parse_args()
    x, mask = padded_inputs()
    if args.prompts == "one":
        x, mask = x[:1], mask[:1]
    if args.new_lengths and (TOKENS + 1) * args.rounds >= x.shape[1]:
        raise SystemExit(f"--new-lengths: at most {(x.shape[1] - 1) // (TOKENS + 1)} rounds")
    models = {"sparse_attn": _model("sparse_attn", args.layers), "sdpa": _model("sdpa", args.layers)}
    integ.enable(models["sparse_attn"], integ.SparseAttnConfig("dense"))
    spent: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    forwards = [0]  # forwards of the running generate(): the first is the prefill

    def timed(name, fn, per_layer=False):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if forwards[0] > 1:
                took = time.perf_counter() - t0
                spent[name] += took
                calls[name] += 1
                if per_layer:  # a step's first layer sees a new cache length: its replay is recorded there
                    spent[f"{name} layer {a[0].layer_idx}"] += took
                    calls[f"{name} layer {a[0].layer_idx}"] += 1
            return out
        return call
    AttentionInterface.register("sdpa", timed("sdpa attention", sdpa_attention_forward, True))
    AttentionInterface.register(integ.NAME, timed("sparse_attn attention", integ.sparse_attention_forward, True))
    # inside the integration's attention function: the library call (attention(), or a padded batch's in place)
    integ._api.attention = timed("sparse_attn: api.attention", integ._api.attention, False)
    _unpad.in_place = timed("sparse_attn: _unpad.in_place", _unpad.in_place, False)
    AttentionMaskInterface.register("sdpa", timed("sdpa mask", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]))
    AttentionMaskInterface.register(integ.NAME, timed("sparse_attn mask", integ.sparse_attn_mask))

    def gen(m, cut=0):
        forwards[0] = 0
        hook = m.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        try:
            m.generate(x[:, cut:], attention_mask=mask[:, cut:], max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                       do_sample=False)
        finally:
            hook.remove()
    steps = TOKENS - 1
    rounds: dict = defaultdict(list)
    with torch.no_grad():
        for m in models.values():
            gen(m)
        for rnd in range(args.rounds):
            cut = (TOKENS + 1) * (rnd + 1) if args.new_lengths else 0
            for name, m in models.items():
                spent.clear()
                calls.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen(m, cut)
                torch.cuda.synchronize()
                rounds[f"{name} generate ms"].append((time.perf_counter() - t0) * 1e3)
                for part, s in spent.items():
                    rounds[f"{part} us a step"].append(s / steps * 1e6)
                    rounds[f"{part} calls a step"].append(calls[part] / steps)
        kernels = {}
        for name, m in models.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                gen(m)
            by_name: dict = defaultdict(float)
            for e in prof.key_averages():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    by_name[e.key] += e.self_device_time_total
            total = sum(by_name.values())
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
            # the whole generate() (prefill included) divided by its 64 forwards: the prefill is the same for both
            kernels[name] = {"gpu_us_per_forward": round(total / TOKENS, 1),
                             "top_us_per_forward": {k[:90]: round(v / TOKENS, 2) for k, v in top}}
    summary = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
    for k, v in summary.items():
        print(k, v)
    for name, kv in kernels.items():
        print(f"== {name} GPU {kv['gpu_us_per_forward']} us a forward")
        for k, v in kv["top_us_per_forward"].items():
            print(f"   {v:9.2f}  {k}")
    with open(args.out, "w") as f:
        header = make_header("cuda", "hf-step-split", transformers=transformers.__version__, prompts=args.prompts,
                             layers=args.layers, new_lengths=args.new_lengths)
        json.dump({**header, "summary": summary, "rounds": rounds, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
