"""Batched greedy decoding through the transformers integration, dense against local (or streaming), alternated in
one process, and where a decoding step's host time goes (cProfile, top functions by own time).

    python benchmarks/hf_decode_ab.py --out $OUT/hf-decode-ab.json [--window 1024] [--num-sink 64] [--rounds 3]
        [--prompts padded|one] [--no-profile] [--cache dynamic|static] [--impls dense,banded,sdpa]
        [--layers 4] [--hidden 2048] [--kv-heads 0] [--scale 1] [--sliding-window 0]
        [--profile-sort tottime|cumtime] [--profile-filter REGEX] [--profile-lines 25] [--replay-ab] [--entry-ab]
        [--new-lengths]

``--num-sink S`` runs ``streaming`` (window + S sinks) instead of ``local``. ``--cache static`` passes
``cache_implementation="static"``, with which transformers compiles the decoding step by itself on CUDA (inductor,
reduce-overhead: CUDA graphs; the integration's dense and window layers are traced, integrations._traced), and the
decoding time is taken as (64 tokens - 1 token) / 63, since a static cache's prefill is not the dynamic-cache forward
timed otherwise. ``--impls`` picks the models (compiled ones are best timed one a process). ``--layers``,
``--hidden`` and ``--scale`` (prompt lengths times SCALE) grow the model and the cache until a step is bound by
the GPU rather than by generate()'s host work; ``--kv-heads`` (default a quarter of the heads) set to the number of
heads gives MHA, where transformers' sdpa with a padding mask does not repeat K/V for grouped heads.
``--sliding-window W`` builds a Mistral of the same shape, every layer a causal window of W keys (a static cache keeps
W slots, rolled once the prompts pass them); ``dense`` then runs the model's window.

The model and prompts of hf_batch_probe.py (random 4-layer Llama, bf16, CUDA): ``padded``, 8 left-padded prompts of
512-4096 tokens (varlen calls), or ``one``, the 4096-token prompt alone (attention() calls); each generate() makes
64 tokens, and its prefill (the same for every impl) is timed apart and taken off.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch
from hf_batch_probe import _model, padded_inputs


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    import transformers

    from sparse_attn.bench.results import make_header
    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", choices=("padded", "one"), default="padded")
    ap.add_argument("--num-sink", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    ap.add_argument("--impls", default="dense,banded,sdpa",
                    help="which models to build and time, of dense, banded (local / streaming) and sdpa: compiled "
                         "models in one process interfere (sdpa's static decoding took 2.15 or 3.52 ms a token "
                         "beside ours), so time each alone")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--sliding-window", type=int, default=0)
    ap.add_argument("--profile-sort", choices=("tottime", "cumtime"), default="tottime")
    ap.add_argument("--profile-filter", default="", help="only functions whose file:line(name) matches this regex")
    ap.add_argument("--profile-lines", type=int, default=25)
    ap.add_argument("--replay-ab", action="store_true",
                    help="also time each sparse_attn model with ops.block_sparse.replay off (NAME-noreplay), "
                         "alternated with the others in each round")
    ap.add_argument("--new-lengths", action="store_true",
                    help="each round's prompts 65 tokens shorter than the last's, so that no step's cache length recurs "
                         "from an earlier round (a step's first layer would find its launches recorded then)")
    ap.add_argument("--entry-ab", action="store_true",
                    help="also time each sparse_attn model with the replay entry (ops.block_sparse.entry: at "
                         "attention() and at a padded batch's in-place call) off (NAME-noentry; the replay inside "
                         "launch.forward stays on), alternated likewise")
    args = ap.parse_args()
    x, mask = padded_inputs(args.scale)
    if args.new_lengths and (args.cache == "static" or 65 * args.rounds >= x.shape[1]):
        raise SystemExit("--new-lengths cuts 65 tokens a round off the prompts: not with --cache static (each length "
                         f"compiles again), and at most {(x.shape[1] - 1) // 65} rounds")
    if args.prompts == "one":  # the longest prompt, no padding
        x, mask = x[:1], mask[:1]
    models = {}
    if args.num_sink:
        banded = (f"streaming-{args.window}-{args.num_sink}",
                  SparseAttnConfig("streaming", {"window": args.window, "num_sink": args.num_sink}))
    else:
        banded = (f"local-{args.window}", SparseAttnConfig("local", {"window": args.window}))
    impls = args.impls.split(",")
    for key, (name, cfg) in (("dense", ("dense", SparseAttnConfig("dense"))), ("banded", banded)):
        if key in impls:
            models[name] = _model("sparse_attn", args.layers, args.hidden, args.kv_heads, args.sliding_window)
            enable(models[name], cfg)
    if "sdpa" in impls:
        models["sdpa"] = _model("sdpa", args.layers, args.hidden, args.kv_heads, args.sliding_window)
    static = {"cache_implementation": "static"} if args.cache == "static" else {}
    gen = lambda m, n=64, cut=0: m.generate(x[:, cut:], attention_mask=mask[:, cut:], max_new_tokens=n,
                                            min_new_tokens=n, do_sample=False, **static)
    from sparse_attn.ops.block_sparse import entry, replay
    entry_key = entry.key
    runs = [(name, m, True, True) for name, m in models.items()]  # (name, model, replay on, entry on)
    if args.replay_ab:
        runs += [(name + "-noreplay", m, False, True) for name, m in models.items() if name != "sdpa"]
    if args.entry_ab:
        runs += [(name + "-noentry", m, True, False) for name, m in models.items() if name != "sdpa"]
    times: dict = {name: {"generate": [], "prefill": []} for name, *_ in runs}
    with torch.no_grad():
        for m in models.values():
            gen(m)
            if static:
                gen(m, 1)
        for rnd in range(args.rounds):
            cut = 65 * (rnd + 1) if args.new_lengths else 0  # (past the 64 tokens a generate() adds)
            for name, m, replayed, entered in runs:
                replay.ENABLED = replayed
                entry.key = entry_key if entered else (lambda *a: None)
                times[name]["generate"].append(_ms(lambda m=m, cut=cut: gen(m, cut=cut)))
                if static:  # one generated token: the prefill alone (its logits give the token)
                    times[name]["prefill"].append(_ms(lambda m=m: gen(m, 1)))
                else:
                    times[name]["prefill"].append(_ms(lambda m=m, cut=cut: m(x[:, cut:], attention_mask=mask[:, cut:],
                                                                             use_cache=True)))
        replay.ENABLED, entry.key = True, entry_key
        profiles = {}
        for name, m in ({} if args.no_profile else models).items():
            pr = cProfile.Profile()
            pr.enable()
            gen(m)
            pr.disable()
            buf = io.StringIO()
            restrictions = [args.profile_filter] if args.profile_filter else []
            pstats.Stats(pr, stream=buf).sort_stats(args.profile_sort).print_stats(*restrictions, args.profile_lines)
            profiles[name] = buf.getvalue()
    rows = []
    for name, t in times.items():
        g, p = statistics.median(t["generate"]), statistics.median(t["prefill"])
        rows.append({"impl": name, "generate_ms": round(g, 2), "prefill_ms": round(p, 2),
                     "decode_ms_per_token": round((g - p) / 63, 3), "rounds": t})
        print(rows[-1]["impl"], rows[-1]["generate_ms"], rows[-1]["prefill_ms"], rows[-1]["decode_ms_per_token"])
    for name, text in profiles.items():
        print(f"===== {name}\n" + "\n".join(text.splitlines()[:args.profile_lines + 20]))
    with open(args.out, "w") as f:
        header = make_header("cuda", "hf-decode-ab", transformers=transformers.__version__, prompts=args.prompts,
                             window=args.window, num_sink=args.num_sink, cache=args.cache, layers=args.layers,
                             hidden=args.hidden, kv_heads=args.kv_heads, scale=args.scale,
                             sliding_window=args.sliding_window)
        json.dump({**header, "rows": rows, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
