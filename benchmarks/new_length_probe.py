"""What a decoding step costs when its cache length is new, as in real eager decoding, against a length seen before.

A model's ``generate()`` grows its cache by one token a step, and every layer of the step calls attention with
that length: the step's first layer meets a geometry nobody has seen (ours: the recipe derived from the previous
length's, or where that is refused the path and a recording of its launches; cuDNN's sdpa: a new graph for the new
shape), its later layers one seen a moment ago. The generate()
probes (hf_decode_ab.py, hf_step_split_probe.py) repeat their prompts each round, so without ``--new-lengths``
their steps meet lengths seen in the previous round. This probe times the two cases apart, per layer position,
for our ``attention(causal=True)`` (and with the replay off: every call on the path) and for
``F.scaled_dot_product_attention`` under each backend:

- ``new``: steps at lengths no call has seen (each provider gets lengths it never saw);
- ``seen``: the same steps again, every length now seen.

Each step calls LAYERS layers, each with its own q [1, 32, 1, 128] and K/V [1, 8, L, 128] (bf16, contiguous,
made before the timing as a cache's ``torch.cat`` makes them), times each call's host time with ``perf_counter``,
and synchronizes at the step's end (a step's wall time is the last column). With ``--profile`` it also writes the
top functions of one ``new`` pass of ours under cProfile; with ``--pieces`` the pieces of a new length's
derivation (ops.block_sparse.entry._derive) timed in tight loops.

    PYTHONPATH=src:benchmarks python benchmarks/new_length_probe.py --out OUT.json [--steps 48 --layers 4]
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
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparse_attn
from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse import replay

BACKENDS = {"sdpa-default": None, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}


def _call(provider: str):
    if provider == "sparse_attn":
        return lambda q, k, v: sparse_attn.attention(q, k, v, causal=True)
    if provider == "sparse_attn-noreplay":  # every call takes the path, nothing recorded or replayed
        def path(q, k, v):
            replay.ENABLED = False
            try:
                return sparse_attn.attention(q, k, v, causal=True)
            finally:
                replay.ENABLED = True
        return path
    backend = BACKENDS[provider]

    def sdpa(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return sdpa


def _inputs(lengths, layers: int):
    """Per step, per layer: (q, k, v) at the step's length."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    return [[(rnd(1, 32, 1, 128), rnd(1, 8, n, 128), rnd(1, 8, n, 128)) for _ in range(layers)] for n in lengths]


def _pass(fn, steps) -> dict:
    """Host us of each call by layer position (medians over steps) and wall us a step."""
    per_layer = [[] for _ in steps[0]]
    walls = []
    torch.cuda.synchronize()
    for step in steps:
        t_step = time.perf_counter()
        for i, (q, k, v) in enumerate(step):
            t0 = time.perf_counter()
            fn(q, k, v)
            per_layer[i].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t_step)
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)
    return {"first layer us": us(per_layer[0]),
            "later layers us": us([t for xs in per_layer[1:] for t in xs]) if len(per_layer) > 1 else None,
            "step wall us": us(walls)}


def _pieces(start: int, n: int = 400) -> dict:
    """Medians (us) of the pieces a call at a new length spends in ops.block_sparse.entry before its launches: one
    call per length, each length new (a rotation of ``n`` prepared lengths is never repeated within a loop)."""
    from sparse_attn.ops.block_sparse import entry, launch

    def med(fn, args_list):
        times = []
        for args in args_list:
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return round(statistics.median(times) * 1e6, 2)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    kvs = [(torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16),) * 2 for n in range(start, start + n)]
    for k, v in kvs[:3]:  # the family's first lengths take the path and record
        sparse_attn.attention(q, k, v, causal=True)
    k0, v0 = kvs[2]
    key0 = entry.key(q, k0, v0, True, None, False, None, 0)
    recipe = entry._keys.find(key0).peek()
    assert recipe is not None, "no recipe to derive from"
    head, tail = recipe.length_spec.plan_head, recipe.length_spec.plan_tail
    rows = {
        "entry.key": med(lambda k, v: entry.key(q, k, v, True, None, False, None, 0), kvs),
        "entry._family": med(lambda k, v: entry._family(key0, k.shape[2]), kvs),
        "launch._tma_ok": med(lambda k, v: launch._tma_ok(q, k, v), kvs),
        "launch.short_query_plan": med(lambda k, v: launch.short_query_plan(*head, k.shape[2] // 128, *tail), kvs),
        "launch.derive_for_length": med(lambda k, v: launch.derive_for_length(recipe, q, k, v), kvs),
    }
    entry.clear()
    fresh = [(torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16),) * 2
             for n in range(start + n, start + 2 * n)]
    for k, v in fresh[:3]:  # the family learnt again (the path, recorded) before the timing
        sparse_attn.attention(q, k, v, causal=True)
    rows["attention() at a new length, one call a length"] = med(
        lambda k, v: sparse_attn.attention(q, k, v, causal=True), fresh[3:])
    rows["attention() at a seen length"] = med(lambda k, v: sparse_attn.attention(q, k, v, causal=True),
                                               fresh[-1:] * len(fresh))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--start", type=int, default=4096, help="the first step's cache length")
    ap.add_argument("--providers", default="sparse_attn,sparse_attn-noreplay," + ",".join(BACKENDS))
    ap.add_argument("--profile", action="store_true", help="also cProfile one new pass of ours")
    ap.add_argument("--pieces", action="store_true",
                    help="also time the pieces of a new length's derivation (entry._derive) in tight loops")
    args = ap.parse_args()
    providers = args.providers.split(",")
    rows = []
    offset = 0
    for provider in providers:
        fn = _call(provider)
        warm = _inputs(range(args.start - 64, args.start - 64 + 3), args.layers)  # compiles; lengths never reused
        try:
            for step in warm:
                for q, k, v in step:
                    fn(q, k, v)
            torch.cuda.synchronize()
        except RuntimeError as e:
            rows.append({"provider": provider, "error": str(e).splitlines()[0]})
            continue
        for rep in range(2):
            # lengths no call of this provider has seen: each round further on
            lengths = range(args.start + offset, args.start + offset + args.steps)
            offset += args.steps
            steps = _inputs(lengths, args.layers)
            new = _pass(fn, steps)
            seen = _pass(fn, steps)
            rows.append({"provider": provider, "round": rep, "lengths": [lengths[0], lengths[-1]],
                         "new": new, "seen": seen})
            print(provider, rep, "new", new, "seen", seen, flush=True)
            del steps
    result = {**make_header("cuda", "new-length-probe"), "steps": args.steps, "layers": args.layers, "rows": rows}
    if args.profile and "sparse_attn" in providers:
        lengths = range(args.start + offset, args.start + offset + args.steps)
        steps = _inputs(lengths, args.layers)
        fn = _call("sparse_attn")
        prof = cProfile.Profile()
        prof.enable()
        _pass(fn, steps)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        result["profile_new_tottime"] = text.getvalue().splitlines()
        print(text.getvalue())
    if args.pieces:
        result["pieces_us"] = _pieces(args.start + offset + 2 * args.steps)
        print(result["pieces_us"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
