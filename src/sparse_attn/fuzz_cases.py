"""Seeded random attention configurations for the randomized cross-checks of the kernels against the
reference (tests/gpu/test_fuzz_gpu.py on the GPU, tests/test_fuzz_interpreter.py under the Triton
interpreter). One seed gives one configuration on every machine: every pattern builder (and unions /
intersections of two), batch- and head-broadcast layouts, GQA / MQA, unequal and odd lengths, head
dims, layout blocks, dtypes, a custom scale, ``causal=True`` on top of a layout, x10 inputs.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from . import patterns, reference
from .testing import assert_close_to_oracle, assert_grads_close_to_oracle

NAMES = ("dense", "causal", "local", "streaming", "block_diagonal", "strided", "dilated", "random", "bigbird",
         "block_index", "topk")


@dataclass(frozen=True)
class Sizes:
    """What a draw may pick: the longest length, head dims, layout blocks and dtypes (repeats weight)."""
    max_len: int = 1500
    dims: tuple = (32, 64, 64, 96, 128, 128, 256)
    blocks: tuple = (16, 32, 64, 128, 256)
    dtypes: tuple = (torch.float16, torch.bfloat16)


GPU = Sizes()
INTERPRETER = Sizes(max_len=96, dims=(16, 32), blocks=(16, 32), dtypes=(torch.float16,))  # bf16 dots misbehave there


def _lengths(rng: random.Random, n: int) -> tuple[int, int]:
    """Lq up to ``n``, Lk up to 16/15 ``n``: 1 and 17 often, Lq == Lk half of the time, Lk = 1 sometimes."""
    r = rng.random()
    lq = 1 if r < 0.06 else 17 if r < 0.12 else rng.randint(2, n * 7 // 15) if r < 0.5 else rng.randint(n * 2 // 15, n)
    r = rng.random()
    lk = lq if r < 0.5 else 1 if r < 0.55 else rng.randint(2, n * 3 // 5) if r < 0.75 else rng.randint(n // 5, n * 16 // 15)
    return lq, lk


def one_pattern(rng: random.Random, name: str, lq: int, lk: int, bq: int, bk: int, batch: int, heads: int):
    """One builder's layout for (lq, lk) with blocks (bq, bk); batch / heads > 1 only where it varies."""
    causal = rng.random() < 0.5
    kw = dict(kv_len=lk, block_q=bq, block_k=bk)
    if name == "dense":
        return patterns.dense(lq, **kw)
    if name == "causal":
        return patterns.causal(lq, **kw)
    if name == "local":
        w = rng.randint(1, max(1, lk))
        return patterns.local(lq, w, causal=causal, window_right=None if causal else rng.randint(0, lk), **kw)
    if name == "streaming":
        return patterns.streaming(lq, rng.randint(1, max(1, lk)), rng.randint(0, 40), causal=causal, **kw)
    if name == "block_diagonal":
        return patterns.block_diagonal(lq, rng.randint(1, max(1, lk)), causal=causal, **kw)
    if name == "strided":
        return patterns.strided(lq, rng.randint(1, 6), local_blocks=rng.randint(1, 3), causal=causal, **kw)
    if name == "dilated":
        return patterns.dilated(lq, rng.randint(1, 4), rng.randint(1, 3), causal=causal, **kw)
    if name == "random":
        return patterns.random(lq, density=rng.choice((0.1, 0.3, 0.6, 1.0)), batch=batch, heads=heads,
                               seed=rng.randint(0, 10**6), causal=causal, include_diagonal=rng.random() < 0.7, **kw)
    if name == "bigbird":
        return patterns.bigbird(lq, num_global_blocks=rng.randint(0, 2), window_blocks=rng.choice((1, 3, 5)),
                                num_random_blocks=rng.randint(0, 3), heads=heads, seed=rng.randint(0, 10**6), **kw)
    if name == "block_index":  # [B, H, q_blocks, top_k], -1 for unused slots, as SpargeAttn's kernels take it
        nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
        top = rng.randint(1, nk)
        g = torch.Generator().manual_seed(rng.randint(0, 10**6))
        idx = torch.rand(batch, heads, nq, nk, generator=g).argsort(-1)[..., :top]
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        return patterns.from_block_index(idx.int(), seq_len=lq, **kw)
    if name == "topk":
        nq, nk = math.ceil(lq / bq), math.ceil(lk / bk)
        g = torch.Generator().manual_seed(rng.randint(0, 10**6))
        return patterns.topk(torch.rand(batch, heads, nq, nk, generator=g), ratio=rng.choice((0.2, 0.5, 0.9)),
                             seq_len=lq, causal=causal, **kw)
    raise ValueError(f"unknown pattern name {name!r}; one of {NAMES}")


def draw_case(seed: int, sizes: Sizes = GPU) -> dict:
    """One configuration: ``name``, ``layout`` (on the CPU), ``B``, ``hq``, ``hkv``, ``lq``, ``lk``, ``d``,
    ``bq``, ``bk``, ``dtype``, ``causal``, ``scale`` (None = 1/sqrt(d)), ``in_scale`` (q/k multiplier)."""
    rng = random.Random(seed)
    hkv = rng.choice((1, 2, 4))
    hq = hkv * rng.choice((1, 1, 2, 4))
    B = rng.choice((1, 1, 2))
    lq, lk = _lengths(rng, sizes.max_len)
    bq, bk = rng.choice(sizes.blocks), rng.choice(sizes.blocks)
    d = rng.choice(sizes.dims)
    batch = rng.choice((1, B))
    heads = rng.choice((1, hq))
    name = rng.choice(NAMES)
    if name == "bigbird":
        lk = lq  # BigBird's window and globals are defined for Lq == Lk
    layout = one_pattern(rng, name, lq, lk, bq, bk, batch, heads)
    if rng.random() < 0.25:  # composition: union or intersection with a second pattern on the same grid
        other_name = rng.choice([n for n in NAMES if n != "bigbird" or lq == lk])
        other = one_pattern(rng, other_name, lq, lk, bq, bk, batch, heads)
        # two block-diagonal patterns intersect only at one document size (a clear NotImplementedError)
        union = rng.random() < 0.5 or name == other_name == "block_diagonal"
        layout = layout | other if union else layout & other
        name = f"{name}{'|' if union else '&'}{other_name}"
    return dict(name=name, layout=layout, B=B, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d, bq=bq, bk=bk,
                dtype=rng.choice(sizes.dtypes), causal=rng.random() < 0.3,
                scale=rng.choice((None, None, 0.05, 0.3)), in_scale=rng.choice((1.0, 1.0, 10.0)))


def describe(case: dict) -> str:
    """The drawn configuration in one line (for failure messages)."""
    keys = ("name", "B", "hq", "hkv", "lq", "lk", "d", "bq", "bk", "dtype", "causal", "scale", "in_scale")
    return ", ".join(f"{k}={case[k]}" for k in keys)


def check_forward_backward(case: dict, device, *, seed: int | None = None, attention=None) -> None:
    """Run ``case`` (from :func:`draw_case`) through ``attention`` (default :func:`sparse_attn.attention`;
    called as ``attention(q, k, v, layout, causal=, scale=, return_lse=True)``) on fresh random inputs on
    ``device`` and check against the reference (the tolerance rule of sparse_attn.testing): output, LSE (rows
    with no key -inf and output exactly 0), dq, dk, dv. Raises AssertionError starting with the seed and
    configuration."""
    if attention is None:
        from .api import attention
    dtype = case["dtype"]

    def rand(shape, scale=1.0):
        return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_()

    layout = case["layout"].to(device)
    q = rand((case["B"], case["hq"], case["lq"], case["d"]), case["in_scale"])
    k = rand((case["B"], case["hkv"], case["lk"], case["d"]), case["in_scale"])
    v = rand((case["B"], case["hkv"], case["lk"], case["d"]))
    do = torch.randn(q.shape, device=device).to(dtype)
    kw = dict(causal=case["causal"], scale=case["scale"], return_lse=True)
    out, lse = attention(q, k, v, layout, **kw)
    qo, ko, vo = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_or, lse_or = reference.attention(qo, ko, vo, layout, **kw)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o_lp, _ = reference.attention(ql, kl, vl, layout, _lowp=True, **kw)
    try:
        assert_close_to_oracle(out, o_lp, o_or, name="out")
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_or)), "rows with no key: lse -inf, others finite"
        assert not torch.isnan(lse).any(), "NaN in lse"
        fin = torch.isfinite(lse_or)
        if fin.any():  # the kernels keep scores and LSE in fp32: <= 8e-7 of |lse| on 300 interpreter seeds (the
            # bound was 2e-2 absolute, 2.0 at x10 inputs: an LSE off by 1 passed)
            err = ((lse[fin].double() - lse_or[fin]).abs() / lse_or[fin].abs().clamp(min=1.0)).max().item()
            assert err < 1e-4, f"lse: error {err:.2e} of max(1, |lse|), allowed 1e-4"
        empty = torch.isinf(lse_or)
        if empty.any():
            assert (out.float()[empty] == 0).all(), "rows with no key must be exactly 0"
        assert_grads_close_to_oracle((out, o_lp, o_or), do, (q, k, v), (ql, kl, vl), (qo, ko, vo))
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {describe(case)}\n{e}") from None
