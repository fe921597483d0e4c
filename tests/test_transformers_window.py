"""Padded batches whose layer pattern is one causal sliding window (``local`` or ``streaming`` on 128-token blocks,
or dense under the model's own window) run as one varlen_attention(window=[, num_sink=]) call, which needs no
per-sequence layout (on CUDA forward-only: planned in the kernel). Each row must still get what it gets alone,
and the layer stats must count the blocks its layouts would have. Tiny random models, no download; the reference
is each row alone."""
import pytest

transformers = pytest.importorskip("transformers")

import torch
from test_transformers_integration import tiny_llama, tiny_mistral
from test_transformers_padding import left_padded

from sparse_attn import patterns
from sparse_attn.integrations import transformers as sat
from sparse_attn.integrations.transformers import SparseAttnConfig, enable


@pytest.fixture
def varlen_calls(monkeypatch):
    """The keyword arguments of every varlen_attention call the integration makes."""
    calls = []
    real = sat._api.varlen_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sat._api, "varlen_attention", spy)
    return calls


def _rows_alone(model, x, lengths, width, out, cfg=None):
    """Each row's logits against the row run alone; the layer-1 blocks of those runs summed (with cfg)."""
    blocks = 0
    for b, n in enumerate(lengths):
        alone = model(x[b:b + 1, width - n:]).logits
        torch.testing.assert_close(out[b, width - n:], alone[0], atol=2e-5, rtol=2e-5)
        blocks += cfg.stats[1].blocks if cfg is not None else 0
    return blocks


def test_a_local_layer_runs_one_window_call_and_counts_its_layouts_blocks(varlen_calls):
    """Rows of 300, 200 and 40 tokens, window 100 on 128-token blocks: the window cuts blocks from the long rows,
    and the stats equal the rows' own layouts' (which runs them alone through attention())."""
    model = tiny_llama(layers=2)
    cfg = enable(model, SparseAttnConfig("local", {"window": 100}))
    lengths, width = [300, 200, 40], 300
    x, mask = left_padded(lengths, width, seed=5)
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        stats = cfg.stats[1]
        assert [c.get("window") for c in varlen_calls] == [100, 100] and all("layouts" not in c for c in varlen_calls)
        blocks = _rows_alone(model, x, lengths, width, out, cfg)
    assert stats.blocks == blocks == sum(patterns.local_block_count(n, 100) for n in lengths)
    causal = sum(patterns.causal_block_count(n) for n in lengths)
    assert stats.causal_sparsity == pytest.approx(1 - blocks / causal)


def test_a_streaming_layer_runs_one_window_call_with_sinks(varlen_calls):
    """Rows of 300, 200 and 40 tokens, window 100 and 20 sinks on 128-token blocks: one call with num_sink=20;
    each row as alone, and the stats the rows' own streaming layouts' block count."""
    model = tiny_llama(layers=2)
    cfg = enable(model, SparseAttnConfig("streaming", {"window": 100, "num_sink": 20}))
    lengths, width = [300, 200, 40], 300
    x, mask = left_padded(lengths, width, seed=9)
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        stats = cfg.stats[1]
        assert [(c.get("window"), c.get("num_sink")) for c in varlen_calls] == [(100, 20)] * 2
        assert all("layouts" not in c for c in varlen_calls)
        blocks = _rows_alone(model, x, lengths, width, out, cfg)
    assert stats.blocks == blocks == sum(patterns.streaming(n, 100, 20).num_blocks for n in lengths)
    assert blocks > sum(patterns.local_block_count(n, 100) for n in lengths)  # the sinks' blocks are counted


def test_the_model_s_window_runs_as_one_window_call(varlen_calls):
    """Mistral's window (20): a dense layer runs that window; a local layer the smaller of the two. Prefill and a
    cached decoding step per row against the row alone."""
    for pattern, kwargs, expect in (("dense", {}, 20), ("local", {"window": 12}, 12), ("local", {"window": 50}, 20),
                                    ("streaming", {"window": 50, "num_sink": 4}, 20)):
        model = tiny_mistral(window=20)
        enable(model, SparseAttnConfig(pattern, kwargs))
        lengths, width = [61, 30], 61
        x, mask = left_padded(lengths, width, seed=3)
        varlen_calls.clear()
        with torch.no_grad():
            out = model(x, attention_mask=mask).logits
            pre = model(x[:, :60], attention_mask=mask[:, :60], use_cache=True)
            step = model(x[:, 60:], attention_mask=mask, past_key_values=pre.past_key_values, use_cache=True).logits
            assert {c.get("window") for c in varlen_calls} == {expect}, pattern
            for b, n in enumerate(lengths):
                alone = model(x[b:b + 1, width - n:]).logits
                torch.testing.assert_close(out[b, width - n:], alone[0], atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(step[b, -1], alone[0, -1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("pattern,kwargs", [("local", {"window": 16}), ("streaming", {"window": 16, "num_sink": 3})])
def test_left_padded_generate_with_a_window_layer_matches_each_prompt_alone(pattern, kwargs, varlen_calls):
    """Batched greedy decoding (cache growing each step) with a window shorter than the prompts, sinks or not."""
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig(pattern, kwargs))
    lengths, width = [40, 25, 9], 40
    x, mask = left_padded(lengths, width, seed=6)
    with torch.no_grad():
        batch = model.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert varlen_calls and all(c.get("window") == 16 and c.get("num_sink") == kwargs.get("num_sink", 0)
                                    for c in varlen_calls)
        for b, n in enumerate(lengths):
            alone = model.generate(x[b:b + 1, width - n:], max_new_tokens=10, do_sample=False)
            assert torch.equal(batch[b, width:], alone[0, n:]), b


def test_other_layers_keep_their_per_sequence_layouts(varlen_calls):
    """A window on other blocks, a two-sided window, and streaming under a model window wider than its own (whose
    sinks the model's window cuts) are not one causal window on 128-token blocks: they keep the layouts (the spy
    sees layouts=, no window=)."""
    for pattern, kwargs, model_window in (("local", {"window": 8, "block_q": 64, "block_k": 64}, None),
                                          ("local", {"window": 8, "causal": False}, None),
                                          ("streaming", {"window": 8, "num_sink": 2, "block_k": 64}, None),
                                          ("streaming", {"window": 8, "num_sink": 2}, 12)):
        model = tiny_llama(layers=1) if model_window is None else tiny_mistral(window=model_window)
        enable(model, SparseAttnConfig(pattern, kwargs))
        x, mask = left_padded([20, 9], 20, seed=7)
        varlen_calls.clear()
        with torch.no_grad():
            model(x, attention_mask=mask)
        assert varlen_calls and all("layouts" in c and "window" not in c for c in varlen_calls), pattern


@pytest.mark.parametrize("pattern,kwargs,builder", [
    ("local", {"window": 100}, lambda lq, lk, device: patterns.local(lq, 100, kv_len=lk, device=device)),
    ("streaming", {"window": 100, "num_sink": 20},
     lambda lq, lk, device: patterns.streaming(lq, 100, 20, kv_len=lk, device=device)),
    ("dense", {}, lambda lq, lk, device: patterns.causal(lq, lk, device=device))])
def test_unpadded_window_and_dense_layers_run_without_layouts(pattern, kwargs, builder, monkeypatch):
    """Unpadded rows (one prompt, a cached step): local and dense layers call attention() without a layout
    (window= for local), and give the logits and the stats of the same layouts passed as a pattern callable
    (which runs them as layouts)."""
    calls = []
    real = sat._api.attention
    monkeypatch.setattr(sat._api, "attention", lambda *a, **kw: calls.append((len(a), kw)) or real(*a, **kw))
    x = torch.randint(1, 128, (2, 300), generator=torch.Generator().manual_seed(8))
    results = []
    for spec in (SparseAttnConfig(pattern, kwargs), SparseAttnConfig(builder)):
        model = tiny_llama(layers=2)
        cfg = enable(model, spec)
        calls.clear()
        with torch.no_grad():
            pre = model(x[:, :299], use_cache=True)
            step = model(x[:, 299:], past_key_values=pre.past_key_values, use_cache=True).logits
        stats = cfg.stats[1]
        results.append((pre.logits, step, (stats.blocks, stats.sparsity, stats.causal_sparsity), list(calls)))
    (pre, step, stats, calls_ours), (pre_ref, step_ref, stats_ref, calls_ref) = results
    assert all(n == 3 and (kw.get("window"), kw.get("num_sink", 0)) == (kwargs.get("window"), kwargs.get("num_sink", 0))
               for n, kw in calls_ours)  # no layout argument
    assert all(n == 4 for n, _ in calls_ref)
    torch.testing.assert_close(pre, pre_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(step, step_ref, atol=2e-5, rtol=2e-5)
    assert stats == pytest.approx(stats_ref)
