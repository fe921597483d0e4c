"""The traced integration on the GPU (integrations._traced): the rows' spans read off the key states on the device
(_unpad.row_spans) and the kernels run over them in place (the spans_attention op) against each row's fp64 oracle
under DESIGN.md's rule 3, a CUDA graph of the two replayed on other masks, and a compiled static-cache generate()
(inductor, reduce-overhead) that runs the traced op, against an uncompiled forward."""
from __future__ import annotations

import pytest
import torch

from sparse_attn.integrations import _traced, _unpad
from sparse_attn.testing import assert_close_to_oracle, naive_masked_attention

pytestmark = pytest.mark.gpu

CASES = [  # (row lengths, buffer width, written slots q_end, lq, causal, window, num_sink)
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4160, 4096, 1, True, None, 0),  # a static cache's decoding step
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4160, 4096, 1, True, 1024, 64),
    ([4096, 512, 0, 33], 4096, 4096, 1, True, None, 0),  # a dynamic cache's step, a row of padding only
    ([700, 5, 1000, 129], 1000, 1000, 1000, True, 300, 200),  # a prefill
    ([17, 64, 9], 96, 64, 4, True, None, 0),  # a few queries a row
]


def _rule(lq: int, lk: int, causal: bool, window, num_sink: int) -> torch.Tensor:
    p = torch.arange(lq, device="cuda")[:, None] + lk - lq
    j = torch.arange(lk, device="cuda")[None, :]
    allowed = j <= p if causal else torch.ones(lq, lk, dtype=torch.bool, device="cuda")
    if window:
        allowed &= (j > p - window) | (j < num_sink)
    return allowed


def _inputs(lengths, width, q_end, lq, seed, dtype, hq=32, hkv=8, d=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lengths)
    padding = torch.zeros(batch, width, dtype=torch.bool, device="cuda")
    for b, n in enumerate(lengths):
        padding[b, q_end - n:q_end] = True
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 3).to(dtype)  # noqa: E731
    states = _unpad.key_states(padding, batch, width, q_end, "cuda")
    return states, mk(batch, lq, hq, d).transpose(1, 2), mk(batch, hkv, width, d), mk(batch, hkv, width, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_pairs_read_on_the_device_give_each_row_its_oracle(case, dtype):
    lengths, width, q_end, lq, causal, window, num_sink = CASES[case]
    states, query, key, value = _inputs(lengths, width, q_end, lq, case, dtype)
    poison = torch.full((4, *query.shape), float("nan"), device="cuda", dtype=dtype)
    del poison  # NaN-filled memory for the call's outputs and split parts
    spans = _unpad.row_spans(states, lq, dtype)
    got = _traced.spans_attention(query, key, value, *spans, causal, window or 0, num_sink, None)
    assert got.shape == (len(lengths), lq, 32, 128) and not got.isnan().any()
    for b, n in enumerate(lengths):
        first_q = max(lq - n, 0) if n else lq  # queries are the lq slots before q_end
        assert bool((got[b, :first_q] == 0).all())
        if first_q == lq:
            continue
        sl = slice(q_end - n, q_end)
        allowed = _rule(lq - first_q, n, causal, window, num_sink)
        qr, kr, vr = query[b:b + 1, :, first_q:], key[b:b + 1, :, sl], value[b:b + 1, :, sl]
        same_dtype = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed, enable_gqa=True)
        assert_close_to_oracle(got[b:b + 1, first_q:].transpose(1, 2), same_dtype,
                               naive_masked_attention(qr, kr, vr, allowed), name=f"case {case} row {b}")


def test_a_captured_call_follows_the_mask_it_is_replayed_on():
    """One CUDA graph of the op, replayed after the key states (and the cache) changed in place: each replay gives
    the eager call's result on that step's mask, as a compiled decoding loop's replays must."""
    lengths, width = [900, 17, 400], 1024
    states, query, key, value = _inputs(lengths, width, 900, 1, 0, torch.bfloat16)
    run = lambda: _traced.spans_attention(query, key, value, *_unpad.row_spans(states, 1, query.dtype),  # noqa: E731
                                          True, 0, 0, None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step, q_end in enumerate((901, 950, 1024)):
        fresh, q2, k2, v2 = _inputs([n + q_end - 900 for n in lengths], width, q_end, 1, 10 + step, torch.bfloat16)
        for dst, src in ((states, fresh), (query, q2), (key, k2), (value, v2)):
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out, run(), atol=0, rtol=0)


@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("local", {"window": 128})])
@torch.no_grad()
def test_compiled_static_decoding_runs_the_traced_op(monkeypatch, pattern, kwargs):
    """generate(cache_implementation="static") compiles the decoding step (inductor, reduce-overhead) with the op
    inside (counted through in_place_spans), and each step's logits match one uncompiled forward over the
    generated tokens (teacher forcing; per-row cosine above 0.9995)."""
    from test_transformers_padding_gpu import VOCAB, _model

    from sparse_attn.integrations.transformers import SparseAttnConfig, enable
    ran = []
    real = _unpad.in_place_spans
    monkeypatch.setattr(_unpad, "in_place_spans", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    torch._dynamo.reset()
    model = _model().eval()
    enable(model, SparseAttnConfig(pattern, kwargs))
    lengths, width, new = [300, 129, 17], 300, 12
    x = torch.randint(1, VOCAB, (len(lengths), width), generator=torch.Generator().manual_seed(4)).cuda()
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    static = model.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    assert hasattr(model, "_compiled_call") and ran  # compiled, with the traced op (warm-up runs call it eagerly)
    tokens = static.sequences[:, :-1]
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new - 1])], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    forced = model(tokens, attention_mask=full_mask, position_ids=pos).logits
    for step in range(new):
        got, want = static.logits[step].float(), forced[:, width - 1 + step].float()
        assert torch.isfinite(got).all()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert bool((cos > 0.9995).all()), (pattern, step, cos.tolist())
