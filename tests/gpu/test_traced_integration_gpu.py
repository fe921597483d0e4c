"""The traced integration on the GPU (integrations._traced): the rows' spans read off the key states on the device
(_unpad.row_spans) and the kernels run over them in place (the spans_attention op) against each row's fp64 oracle
under DESIGN.md's rule 3, and a CUDA graph of the two replayed on other masks. Compiled static-cache generation
with the op inside: test_transformers_padding_gpu.py."""
from __future__ import annotations

import pytest
import torch
from test_padded_in_place_gpu import check_rows

from sparse_attn.integrations import _traced, _unpad

pytestmark = pytest.mark.gpu

CASES = [  # (row lengths, buffer width, written slots q_end, lq, causal, window, num_sink)
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4160, 4096, 1, True, None, 0),  # a static cache's decoding step
    ([4096, 512, 3000, 1, 2049, 4096, 77, 1500], 4160, 4096, 1, True, 1024, 64),
    ([4096, 512, 0, 33], 4096, 4096, 1, True, None, 0),  # a dynamic cache's step, a row of padding only
    ([700, 5, 1000, 129], 1000, 1000, 1000, True, 300, 200),  # a prefill
    ([17, 64, 9], 96, 64, 4, True, None, 0),  # a few queries a row
]


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
    check_rows(got, query, key, value, lengths, q_end, causal, window, num_sink, f"case {case}")


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
