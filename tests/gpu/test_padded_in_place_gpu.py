"""A padded batch read and written in place on the GPU (integrations._unpad.in_place): bit for bit the packed
call (gathered tokens, one varlen call, scattered output) on bf16 / fp16 batches the size of a decoding
step's (split-KV parts and their merge included) and of a prefill (padded queries: zeros), and each row within
twice SDPA's error (same dtype) of the fp64 oracle (DESIGN.md's rule 3). Fresh random inputs each case; the
in-place call's outputs are allocated where NaN-filled memory was just freed."""
from __future__ import annotations

import random

import pytest
import torch

import sparse_attn
from sparse_attn.integrations import _unpad
from sparse_attn.testing import assert_close_to_oracle, naive_masked_attention

pytestmark = pytest.mark.gpu


def _batch(lengths, width, lq, seed, dtype, hq=32, hkv=8, d=128, q_blhd=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lengths)
    mask = torch.zeros(batch, width, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lengths):
        mask[b, width - n:] = True
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 3).to(dtype)  # noqa: E731
    query = mk(batch, lq, hq, d).transpose(1, 2) if q_blhd else mk(batch, hq, lq, d)
    return _unpad.from_padding(mask, lq), query, mk(batch, hkv, width, d), mk(batch, hkv, width, d)


def _rule(lq: int, lk: int, causal: bool, window, num_sink: int, device="cuda") -> torch.Tensor:
    """[lq, lk] True where query i (position p = i + lk - lq) sees key j: causal, its window and the sinks."""
    p = torch.arange(lq, device=device)[:, None] + lk - lq
    j = torch.arange(lk, device=device)[None, :]
    allowed = j <= p if causal else torch.ones(lq, lk, dtype=torch.bool, device=device)
    if window:
        allowed &= (j > p - window) | (j < num_sink)
    return allowed


def check_rows(got, query, key, value, lengths, key_end: int, causal: bool, window, num_sink: int, label: str):
    """Each row of a padded call's output ``got`` [B, Lq, Hq, D]: zeros at its padded queries, and its real queries
    (the last of the ``Lq``) within twice SDPA's error (same dtype) of the fp64 oracle on its real keys, the
    ``lengths[b]`` keys before ``key_end``."""
    lq = query.shape[2]
    for b, n in enumerate(lengths):
        first_q = max(lq - n, 0) if n else lq
        assert bool((got[b, :first_q] == 0).all())
        if first_q == lq:
            continue
        sl = slice(key_end - n, key_end)
        allowed = _rule(lq - first_q, n, causal, window, num_sink, query.device)
        qr, kr, vr = query[b:b + 1, :, first_q:], key[b:b + 1, :, sl], value[b:b + 1, :, sl]
        same_dtype = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed, enable_gqa=True)
        assert_close_to_oracle(got[b:b + 1, first_q:].transpose(1, 2), same_dtype,
                               naive_masked_attention(qr, kr, vr, allowed), name=f"{label} row {b}")


CASES = [  # (lengths, width, lq, causal, window, num_sink)
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4096, 1, True, None, 0),  # a decoding step: split-KV parts
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4096, 1, True, 1024, 64),
    ([700, 0, 1000, 129], 1000, 1000, True, None, 0),  # a prefill with a row of padding only
    ([700, 5, 1000, 129], 1000, 1000, True, 300, 0),
    ([700, 5, 1000, 129], 1000, 1000, True, 300, 200),
    ([333, 1000], 1000, 1000, False, None, 0),  # a padded encoder batch
    ([17, 64, 9], 64, 4, True, None, 0),  # a few queries a row (speculative decoding's shape)
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_in_place_gives_the_packed_call_s_bits(case, dtype):
    lengths, width, lq, causal, window, num_sink = CASES[case]
    p, query, key, value = _batch(lengths, width, lq, case, dtype, q_blhd=case % 2 == 0)
    kw = {"causal": causal, "window": window, "num_sink": num_sink}
    poison = torch.full((4, *query.shape), float("nan"), device="cuda", dtype=dtype)
    del poison  # the caching allocator hands this NaN-filled memory to the call's outputs and split parts
    got = _unpad.in_place(p, query, key, value, **kw)
    assert not got.isnan().any()
    q, k, v = p.pack(query, False), p.pack(key, True), p.pack(value, True)
    want = p.unpack(sparse_attn.varlen_attention(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, **kw))
    assert torch.equal(got, want), CASES[case]
    check_rows(got, query, key, value, lengths, width, causal, window, num_sink, f"case {case}")


def test_a_padded_decoding_loop_copies_its_pairs_once_a_step():
    """Every layer of a step reuses the step's pairs (built once by the step's Packing)."""
    p, query, key, value = _batch([300, 1000, 17], 1000, 1, 0, torch.bfloat16)
    first = [t.data_ptr() for t in p.pairs_on(query.device, 1, key.shape[1] * key.shape[2])]
    for _ in range(4):
        _unpad.in_place(p, query, key, value, causal=True)
    again = [t.data_ptr() for t in p.pairs_on(query.device, 1, key.shape[1] * key.shape[2])]
    assert first == again and [k[0] for k in p._built].count("pairs") == 1


def test_random_padded_batches_match_the_packed_call():
    """GQA groups 1-8, head dims 64 / 96 / 128, both 16-bit dtypes, widths around the 128-key block."""
    rnd = random.Random(5)
    for trial in range(24):
        width = rnd.choice([1, 127, 128, 129, 640, 2000])
        lq = rnd.choice([1, 1, 3, width])
        lengths = [rnd.choice([0, 1, width // 3, width]) for _ in range(rnd.randint(1, 6))]
        causal = rnd.random() < 0.8
        window = rnd.choice([None, 1, 100, 700]) if causal else None
        num_sink = rnd.choice([0, 4, 300]) if window else 0
        p, query, key, value = _batch(lengths, width, lq, 100 + trial, rnd.choice([torch.bfloat16, torch.float16]),
                                      hq=8, hkv=rnd.choice([1, 2, 8]), d=rnd.choice([64, 96, 128]),
                                      q_blhd=rnd.random() < 0.7)
        if p is None or not p.q_lens:  # no padding at all, or nothing real
            continue
        kw = {"causal": causal, "window": window, "num_sink": num_sink}
        got = _unpad.in_place(p, query, key, value, **kw)
        want = p.unpack(sparse_attn.varlen_attention(p.pack(query, False), p.pack(key, True), p.pack(value, True),
                                                     p.cu_q, p.cu_k, p.max_q, p.max_k, **kw))
        assert torch.equal(got, want), (lengths, width, lq, kw)
