"""A padded batch read and written in place (integrations._unpad.in_place): the kernels' device plan over each
sequence's (start, end) token pairs in the padded tensors, instead of gathering the real tokens into packed
tensors and scattering the output back. It must give the packed call's bits, zeros at padded queries, and
one copy of the pairs for every layer of a forward. Kernel cases run under TRITON_INTERPRET=1 (conftest.py)
on small fp16 inputs; the rest anywhere."""
from __future__ import annotations

import os
import random

import pytest
import torch

import sparse_attn
from sparse_attn import api, varlen
from sparse_attn.integrations import _unpad
from sparse_attn.plan_cache import LastOne

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter tests run only without a GPU")


@pytest.mark.parametrize("shape,make", [
    ((3, 2, 5, 8), lambda s: torch.randn(s)),  # [B, H, L, D] contiguous: a KV cache, r = H * L
    ((3, 2, 5, 8), lambda s: torch.randn(s[0], s[2], s[1], s[3]).transpose(1, 2)),  # queries as models make them
    ((3, 2, 5, 8), lambda s: torch.randn(s[0], s[1], 9, s[3])[:, :, :5]),  # a static cache's first 5 slots
    ((1, 2, 5, 8), lambda s: torch.randn(s)),
    ((3, 2, 1, 8), lambda s: torch.randn(s)),  # one query a row in [B, H, 1, D] memory: r = 1
])
def test_token_view_numbers_each_row_s_tokens_without_a_copy(shape, make):
    t = make(shape)
    view, r = _unpad.token_view(t)
    assert view.data_ptr() == t.data_ptr() and r >= shape[2] and (r == 1) == (shape[2] == 1)
    for b in range(shape[0]):
        for i in range(shape[2]):
            assert torch.equal(view[b * r + i], t[b, :, i])


def test_token_view_refuses_what_it_cannot_number():
    t = torch.randn(3, 2, 5, 8)
    assert _unpad.token_view(t[..., ::2]) is None  # no unit stride in D
    odd = torch.randn(300).as_strided((3, 2, 5, 8), (85, 40, 8, 1))  # a batch stride of 85: no multiple of 8
    assert _unpad.token_view(odd) is None


def _left_right_padded_packing():
    """Three rows of 10 keys, 4 queries (positions 6..9): left padding 3, right padding after 8, none."""
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 8:] = False
    return _unpad.from_padding(mask, 4)


def test_pairs_and_free_queries_of_a_padded_batch():
    p = _left_right_padded_packing()
    q_pairs, k_pairs = p.pairs_on("cpu", 4, 10)
    assert q_pairs.tolist() == [0, 4, 4, 6, 8, 12] and k_pairs.tolist() == [3, 10, 10, 18, 20, 30]
    assert p.pairs_on("cpu", 4, 10)[0] is q_pairs  # built once for every layer
    assert p.free_queries_on("cpu").flatten().nonzero().flatten().tolist() == [6, 7]  # row 1's queries 8, 9
    full = _unpad.from_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]), 1)
    assert full.free_queries_on("cpu") is None  # a decoding step: every query is real


def test_offsets_are_copied_once_while_the_same_tensors_come_back(monkeypatch):
    """varlen.offsets_on keeps the last copy: the same CPU tensors, unchanged, reuse it; a new tensor or an in-place
    change copies again. (On the CPU the copy is varlen._to_device_aligned's, counted here on a 'meta' device.)"""
    calls = []
    real = varlen._to_device_aligned
    monkeypatch.setattr(varlen, "_to_device_aligned", lambda ts, d: calls.append(1) or real(ts, d))
    monkeypatch.setattr(varlen, "_LAST_COPY", LastOne())
    cu_q, cu_k = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    first = varlen.offsets_on("meta", cu_q, cu_k)
    again = varlen.offsets_on("meta", cu_q, cu_k)
    assert len(calls) == 1 and all(a is b for a, b in zip(first, again))
    cu_k[2] = 10  # in place: its version moves
    varlen.offsets_on("meta", cu_q, cu_k)
    varlen.offsets_on("meta", cu_q, cu_k.clone())
    assert len(calls) == 3
    with torch.inference_mode():
        frozen = torch.tensor([0, 1], dtype=torch.int32)
    varlen.offsets_on("meta", frozen)
    varlen.offsets_on("meta", frozen)
    assert len(calls) == 5  # inference tensors have no version: never kept


def _padded_batch(lengths, width, lq, seed, hq=4, hkv=2, d=32, q_blhd=True):
    """(packing, query [B, Hq, lq, D] (in [B, lq, Hq, D] memory when q_blhd), key, value [B, Hkv, width, D]):
    row b's real tokens are the last lengths[b] of ``width`` (left padding)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = True
    query = (torch.randn(batch, lq, hq, d, generator=g).half().transpose(1, 2) if q_blhd
             else torch.randn(batch, hq, lq, d, generator=g).half())
    key, value = (torch.randn(batch, hkv, width, d, generator=g).half() for _ in range(2))
    return _unpad.from_padding(mask, lq), query, key, value


def _packed_call(p, query, key, value, **kw):
    """What the integration ran before: the real tokens gathered, one varlen call, the output scattered."""
    out = sparse_attn.varlen_attention(p.pack(query, False), p.pack(key, True), p.pack(value, True), p.cu_q, p.cu_k,
                                       p.max_q, p.max_k, **kw)
    return p.unpack(out)


@interpreted
@pytest.mark.parametrize("case", range(8))
def test_in_place_gives_the_packed_call_s_bits(monkeypatch, case):
    """Decoding steps (one query a row) and prefills (queries = keys, so padded queries get zeros), rows dropped
    whole (no real token), dense / causal / window / window with sinks, queries in either memory order."""
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    rnd = random.Random(case)
    width = rnd.choice([9, 130, 200])
    lq = rnd.choice([1, width])
    lengths = [rnd.choice([0, 1, 5, width // 2, width]) for _ in range(rnd.randint(1, 3))] + [width]
    rnd.shuffle(lengths)
    causal = case % 4 != 0
    window = rnd.choice([3, 100, 150]) if causal and case % 2 else None
    num_sink = rnd.choice([0, 2, 129]) if window else 0
    p, query, key, value = _padded_batch(lengths, width, lq, case, q_blhd=case % 3 != 2)
    kw = {"causal": causal, "window": window, "num_sink": num_sink}
    got = _unpad.in_place(p, query, key, value, **kw)
    want = _packed_call(p, query, key, value, **kw)
    assert got is not None and got.shape == want.shape
    assert torch.equal(got, want), (lengths, width, lq, kw)
    real = torch.zeros(len(lengths), lq, dtype=torch.bool)
    for b, n in enumerate(lengths):
        real[b, max(lq - n, 0):] = n > 0
    assert bool((got[~real] == 0).all())  # padded queries: zeros, as unpack gives


@interpreted
def test_in_place_copies_what_it_cannot_place_and_refuses_nothing_silently(monkeypatch):
    """A key cache whose batch stride is no multiple of its token stride is copied to [B, L, H, D] first, and the
    result is the same."""
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    p, query, key, value = _padded_batch([3, 9], 9, 1, 7)
    # a batch stride that is no multiple of the token stride (32)
    odd_key = torch.empty(4096, dtype=torch.half).as_strided(key.shape, (2 * 9 * 32 + 16, 9 * 32, 32, 1))
    odd_key.copy_(key)
    assert _unpad.token_view(odd_key) is None
    got = _unpad.in_place(p, query, odd_key, value, causal=True)
    assert torch.equal(got, _packed_call(p, query, key, value, causal=True))


def test_in_place_leaves_what_the_device_plan_does_not_run_to_the_caller():
    """On the CPU's reference (no kernels) and with gradients the caller packs: None."""
    p, query, key, value = _padded_batch([3, 9], 9, 1, 7)
    assert _unpad.in_place(p, query, key, value, causal=True) is None
    packed = _unpad.from_segments([[0, 4, 9], [0, 9]], 9)
    assert _unpad.in_place(packed, query, key, value, causal=True) is None  # not padded: packed already


@interpreted
@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("streaming", {"window": 130, "num_sink": 3})])
def test_a_padded_model_runs_in_place_with_the_packed_bits(monkeypatch, pattern, kwargs):
    """Through the transformers integration (a tiny fp16 Llama, its kernels interpreted): a left-padded prefill and
    the cached decoding step after it run in place (each layer's call) and give the logits the packed calls give,
    bit for bit."""
    pytest.importorskip("transformers")
    from test_transformers_integration import tiny_llama
    from test_transformers_padding import left_padded

    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    model = tiny_llama(layers=2).half()
    enable(model, SparseAttnConfig(pattern, kwargs))
    x, mask = left_padded([140, 9, 1], 140)
    ran = []
    real_in_place = _unpad.in_place

    def logits(in_place):
        monkeypatch.setattr(_unpad, "in_place", in_place)
        with torch.no_grad():
            first = model(x, attention_mask=mask, use_cache=True)
            step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            nxt = first.logits[:, -1:].argmax(-1)
            step = model(nxt, attention_mask=step_mask, past_key_values=first.past_key_values)
        return first.logits, step.logits

    in_place = logits(lambda *a, **kw: ran.append(1) or real_in_place(*a, **kw))
    packed = logits(lambda *a, **kw: None)
    assert len(ran) == 4  # two layers, prefill and step
    for got, want in zip(in_place, packed):
        assert torch.isfinite(want).all() and torch.equal(got, want)
