"""The transformers integration while torch.compile traces a model (integrations._traced): the mask function
returns int8 key states, the attention function one custom op that reads them on the device, so a compiled
decoding step (generate(cache_implementation="static")) has no graph break and could replay as one CUDA graph.
The device-side reading must agree with the host's (Packing), and compiled generation with eager generation.
Kernel cases run under TRITON_INTERPRET=1 (conftest.py) on small fp16 inputs."""
from __future__ import annotations

import os
import random

import pytest
import torch

from sparse_attn import api
from sparse_attn.integrations import _traced, _unpad

transformers = pytest.importorskip("transformers")
from test_transformers_integration import tiny_llama  # noqa: E402
from test_transformers_padding import left_padded  # noqa: E402

from sparse_attn.integrations import transformers as sat  # noqa: E402
from sparse_attn.integrations.transformers import SparseAttnConfig, enable  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter tests run only without a GPU")


def _random_states(rnd: random.Random, batch: int, width: int, lq: int) -> torch.Tensor:
    """Key states ``[batch, width]``: each row a run of real tokens (left / right padding, or none at all), and
    maybe a static cache's unwritten slots after ``q_end``."""
    q_end = width if rnd.random() < 0.5 else rnd.randint(lq, width)
    padding = torch.zeros(batch, width, dtype=torch.bool)
    for b in range(batch):
        if rnd.random() < 0.15:
            continue  # a row of padding only
        first = rnd.randint(0, q_end - 1)
        end = q_end if rnd.random() < 0.7 else rnd.randint(first + 1, q_end)
        padding[b, first:end] = True
    return _unpad.key_states(padding, batch, width, q_end, "cpu")


def _pairs(spans, q_row, k_row):
    """in_place_spans' numbering of the spans in token views of row strides q_row / k_row."""
    q = torch.add(spans[:, 0:2], spans[:, 4:5], alpha=q_row).flatten()
    return q, torch.add(spans[:, 2:4], spans[:, 4:5], alpha=k_row).flatten()


@pytest.mark.parametrize("seed", range(40))
def test_row_spans_are_the_host_packing_s(seed):
    """_unpad.row_spans (tensor ops, no host read), numbered in token views of any row strides, gives the pairs and
    free queries from_padding's Packing gives; rows without a real query get empty query ranges, and their
    outputs zeros."""
    rnd = random.Random(seed)
    batch, width = rnd.randint(1, 5), rnd.randint(1, 300)
    lq = rnd.choice([1, 1, rnd.randint(1, width), width])
    states = _random_states(rnd, batch, width, lq)
    q_row, k_row = lq + rnd.choice([0, 3]), width * rnd.choice([1, 2])
    spans, drop, fill = _unpad.row_spans(states, lq, torch.float16)
    q_pairs, k_pairs = _pairs(spans, q_row, k_row)
    assert spans.dtype == torch.int32 and fill.dtype == torch.float16 and bool((fill == 0).all())
    packing = _unpad.from_padding(states, lq)
    want_free = torch.zeros(batch * lq, 1, 1, dtype=torch.bool)
    if packing is None:  # no padding: every row's pairs are the whole row
        for b in range(batch):
            assert q_pairs[2 * b:2 * b + 2].tolist() == [b * q_row, b * q_row + lq]
            assert k_pairs[2 * b:2 * b + 2].tolist() == [b * k_row, b * k_row + width]
    else:
        pq, pk = packing.pairs_on("cpu", q_row, k_row)
        for i, row in enumerate(packing.rows):
            assert q_pairs[2 * row:2 * row + 2].tolist() == pq[2 * i:2 * i + 2].tolist(), (states, lq)
            assert k_pairs[2 * row:2 * row + 2].tolist() == pk[2 * i:2 * i + 2].tolist(), (states, lq)
        for row in set(range(batch)) - set(packing.rows):
            assert q_pairs[2 * row] == q_pairs[2 * row + 1]  # no query
        if packing.free_queries_on("cpu") is not None:
            want_free = packing.free_queries_on("cpu")
    assert torch.equal(drop, want_free)


def test_rows_with_padding_between_real_tokens_are_flagged_not_read():
    """from_padding refuses a row whose real tokens are not one run; on the device (no host read) such a row gets
    no queries to run, and NaN to fill its outputs."""
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="row 0 has padding between real tokens"):
        _unpad.from_padding(mask, 1)
    spans, drop, fill = _unpad.row_spans(mask, 1, torch.float32)
    assert spans[0, :2].tolist() == [0, 0] and drop.flatten().tolist() == [True, False]
    assert fill[0].isnan().all() and fill[1].item() == 0


def test_key_states_place_the_queries_before_the_unwritten_slots():
    """A static cache's buffer of 10 slots with 6 written: the queries are slots 4 and 5, and the Packing is what
    the written slots alone give."""
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
    states = _unpad.key_states(padding, 2, 10, 6, "cpu")
    assert states.dtype == torch.int8 and states[0].tolist() == [0, 0, 1, 1, 1, 1, -1, -1, -1, -1]
    p = _unpad.from_padding(states, 2)
    alone = _unpad.from_padding(padding[:, :6].bool(), 2)
    assert (p.kv_len, p.rows, p.q_starts, p.q_lens, p.k_starts, p.k_lens) == \
        (6, alone.rows, alone.q_starts, alone.q_lens, alone.k_starts, alone.k_lens) == \
        (6, (0, 1), (0, 0), (2, 1), (2, 0), (4, 5))


def _batch(seed, lq, width, batch=3, hq=4, hkv=2, d=32):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, lq, hq, d, generator=g).half().transpose(1, 2)
    key, value = (torch.randn(batch, hkv, width, d, generator=g).half() for _ in range(2))
    return query, key, value


def _in_place_from_mask(mask, query, key, value, **kw):
    """What the traced attention function runs on the kernels: row_spans, then in_place_spans (the op's body)."""
    return _unpad.in_place_spans(query, key, value, *_unpad.row_spans(mask, query.shape[2], query.dtype), **kw)


@interpreted
@pytest.mark.parametrize("case", range(6))
def test_in_place_from_mask_gives_the_host_plan_s_result(monkeypatch, case):
    """The kernels over pairs read off the mask on the device against the same kernels over the host Packing's
    pairs (in_place): decoding steps and prefills, static caches' unwritten slots, rows of padding only, dense /
    causal / window / sinks. The two plans differ in max_q / max_k (the buffer's against the longest sequence's),
    which may split the keys differently, hence a tolerance."""
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    rnd = random.Random(100 + case)
    width = rnd.choice([9, 130, 200])
    lq = rnd.choice([1, width])
    states = _random_states(rnd, 3, width, lq)
    if lq == width:  # a prefill: no unwritten slots
        states = states.clamp(min=0)
    query, key, value = _batch(case, lq, width)
    causal = case % 3 != 0
    window = rnd.choice([3, 100]) if causal and case % 2 else None
    kw = {"causal": causal, "window": window, "num_sink": rnd.choice([0, 2]) if window else 0}
    got = _in_place_from_mask(states, query, key, value, **kw)
    packing = _unpad.from_padding(states, lq)
    want = _unpad.in_place(packing, query, key, value, **kw) if packing is not None and packing.q_lens else None
    if packing is None:
        want = api.attention(query, key, value, **kw).transpose(1, 2)
    elif not packing.q_lens:
        want = torch.zeros_like(got)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@interpreted
def test_a_broken_row_comes_out_nan(monkeypatch):
    """A row whose real tokens are not one run gives NaN outputs, the others their results."""
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    query, key, value = _batch(0, 1, 4, batch=2)
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.int8)
    out = _in_place_from_mask(mask, query, key, value, causal=True)
    assert out[0].isnan().all() and torch.isfinite(out[1]).all()
    plain = torch.tensor([[0, 1, 1, 1], [0, 0, 1, -1]], dtype=torch.int8)  # opcheck compares outputs: no NaN here
    spans = _unpad.row_spans(plain, 1, query.dtype)
    torch.library.opcheck(_traced.spans_attention, (query, key, value, *spans, True, 0, 0, None))


def test_the_custom_op_is_the_eager_attention_function_s_result():
    """padded_attention's host branch (no kernels) against the eager attention function on the same mask, and
    torch.library.opcheck (fake shapes, schema, no aliasing)."""
    query, key, value = (t.float() for t in _batch(3, 1, 12))
    states = _unpad.key_states(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]] * 2 + [[1] * 12]), 3, 12, 8,
                               "cpu")
    module = torch.nn.Module()
    for args in ((states, True, 0, 0), (states, True, 3, 1), (None, False, 0, 0)):
        got = _traced.padded_attention(query, key, value, *args, 0.3)
        mask, causal, window, sinks = args
        cfg = SparseAttnConfig("streaming" if window else "dense",
                               {"window": window, "num_sink": sinks, "block_q": 128, "block_k": 128} if window else {},
                               causal=causal)
        module._sparse_attn_config = cfg
        if mask is not None:
            sat._registered(mask, (1, 12, None, 0, True))
        want, _ = sat.sparse_attention_forward(module, query, key, value, mask, scaling=0.3)
        assert torch.equal(got, want), args
        torch.library.opcheck(_traced.padded_attention, (query, key, value, *args, 0.3))


def _generate(model, x, mask, compile_config=None, new=6):
    gen = {"attention_mask": mask, "max_new_tokens": new, "min_new_tokens": new, "do_sample": False,
           "cache_implementation": "static", "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        if compile_config is None:
            return model.generate(x, disable_compile=True, **gen)
        return model.generate(x, compile_config=compile_config, **gen)


def _compile_config():
    from transformers import CompileConfig
    config = CompileConfig(backend="eager", fullgraph=True)  # fullgraph: a graph break fails the test
    config._compile_all_devices = True  # transformers compiles by itself only on accelerators
    return config


def counting_compile_config(graphs: list):
    """A CompileConfig that fails on any graph break (fullgraph) and appends to ``graphs`` how many times each graph
    dynamo compiles reads its non-tensor inputs (the cache's Python-int lengths)."""
    from transformers import CompileConfig

    def backend(gm, example_inputs, **options):  # (transformers passes mode="reduce-overhead")
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append(sum(len(n.users) for n, x in zip(inputs, example_inputs) if not isinstance(x, torch.Tensor)))
        return gm.forward
    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles by itself only on accelerators
    return config


def compiled_generation(model, x, mask, new) -> tuple[list, object]:
    """(each compiled graph's reads of its int inputs, output) of a compiled static generation, from a fresh dynamo
    state."""
    graphs = []
    torch._dynamo.reset()
    out = _generate(model, x, mask, counting_compile_config(graphs), new)
    assert hasattr(model, "_compiled_call")
    return graphs, out


def test_compiled_static_decoding_compiles_no_more_graphs_than_sdpa():
    """The last step of a static generate() fills the buffer exactly (max_cache_len = prompt + new tokens - 1), where
    the mask interface returned None (no unwritten slot, no padding) instead of key states: a new kind of graph
    input, so dynamo compiled the step again for the last token (two graphs, sdpa's one). A replayed step now gets
    key states at every step."""
    x = left_padded([30, 21, 9], 30)[0][:1]  # one prompt: no padding, so only the unwritten slots make a mask
    counts = []
    for attn in ("sdpa", "sparse_attn"):
        model = tiny_llama(layers=2)
        if attn == "sdpa":
            model.set_attn_implementation("sdpa")
        else:
            enable(model, SparseAttnConfig())
        counts.append(len(compiled_generation(model, x, None, 6)[0]))
    assert counts[1] <= counts[0], counts


@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("streaming", {"window": 8, "num_sink": 2}),
                                            ("local", {"window": 5})])
def test_compiled_static_decoding_traces_whole_and_matches_eager(pattern, kwargs):
    """The compiled decoding step of a left-padded batch has no graph break (fullgraph=True): the traced mask
    and attention functions run (the custom op's host branch here), and the tokens and logits are the
    uncompiled ones."""
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig(pattern, kwargs))
    x, mask = left_padded([30, 21, 9], 30)
    torch._dynamo.reset()
    eager = _generate(model, x, mask)
    compiled = _generate(model, x, mask, _compile_config())
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_layers_the_trace_does_not_take_still_run_eagerly():
    """A random-blocks layer needs a layout (host work): under the trace it breaks the graph and runs eagerly on
    the traced key states, with the uncompiled tokens."""
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig("dense", per_layer={1: ("random", {"density": 0.5, "block_q": 16,
                                                                        "block_k": 16, "seed": 3})}))
    x, mask = left_padded([30, 21, 9], 30)
    torch._dynamo.reset()
    eager = _generate(model, x, mask)
    config = _compile_config()
    config.fullgraph = False
    compiled = _generate(model, x, mask, config)
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@interpreted
def test_compiled_static_decoding_on_the_kernels(monkeypatch):
    """The same with the kernels (interpreted, a tiny fp16 Llama): the compiled step reads the key states on the
    device (row_spans traced, in_place_spans in the op), the uncompiled one the host Packing (in_place)."""
    monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    model = tiny_llama(layers=2).half()
    enable(model, SparseAttnConfig("streaming", {"window": 130, "num_sink": 3}))
    x, mask = left_padded([140, 9, 1], 140)
    ran = []
    real = _unpad.in_place_spans
    monkeypatch.setattr(_unpad, "in_place_spans", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    torch._dynamo.reset()
    eager = _generate(model, x, mask, new=3)
    assert not ran
    compiled = _generate(model, x, mask, _compile_config(), new=3)
    assert len(ran) == 4  # two layers, two compiled steps (the prefill is not compiled)
    for a, b in zip(compiled.logits, eager.logits):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=interpreted)])
def test_a_compiled_padded_forward_traces_whole(monkeypatch, kernels):
    """torch.compile(model, fullgraph=True) of a left-padded forward without a cache (a prefill, queries = keys):
    the traced mask gives key states without unwritten slots, and the logits are the eager forward's, on the
    reference (the host op) and on the interpreted kernels (the spans op; fp16)."""
    if kernels:
        monkeypatch.setattr(api, "_use_kernels", lambda t: True)
    model = tiny_llama(layers=2)
    if kernels:
        model = model.half()
    enable(model, SparseAttnConfig("streaming", {"window": 130, "num_sink": 3}))
    x, mask = left_padded([140, 9, 1], 140)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x, attention_mask=mask, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")(x, attention_mask=mask, use_cache=False).logits
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(compiled, eager, atol=2e-2 if kernels else 1e-5, rtol=0)
