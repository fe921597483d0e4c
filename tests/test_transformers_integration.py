"""The transformers attention backend on tiny random Llama/Mistral models built here (no download).

References are independent of sparse_attn: transformers' own eager attention, fed a token mask
written out the obvious way (causal / sliding window / sinks, bottom-right aligned).
"""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

import sparse_attn.api  # noqa: E402
from sparse_attn import patterns  # noqa: E402
from sparse_attn.integrations import transformers as sat  # noqa: E402
from sparse_attn.integrations.transformers import SparseAttnConfig, disable, enable  # noqa: E402

VOCAB, HQ, HKV, D = 128, 4, 2, 16
BLOCK = {"block_q": 16, "block_k": 16}


def tiny_llama(layers=3, attn="eager", seed=0, max_positions=512):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=max_positions,
                      initializer_range=0.1, attn_implementation=attn, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def ids(batch=1, length=80, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- obvious token masks
def causal_mask(lq, lk):
    p = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    return j <= p


def local_mask(window):
    def fn(lq, lk):
        p = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        return (j <= p) & (j > p - window)
    return fn


def streaming_mask(window, num_sink):
    def fn(lq, lk):
        p = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        return (j <= p) & ((j > p - window) | (j < num_sink))
    return fn


def block_sparsity(mask, block):
    """Skipped fraction of the block grid: blocks holding no allowed token."""
    lq, lk = mask.shape
    nq, nk = -(-lq // block), -(-lk // block)
    padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)
    padded[:lq, :lk] = mask
    visited = padded.view(nq, block, nk, block).any(3).any(1)
    return 1.0 - visited.float().mean().item(), int(visited.sum())


def additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]


# a reference attention implementation: transformers' eager attention with a per-layer token mask
REF_MASKS = {}


def _tiny_bert():
    from transformers import BertConfig, BertModel
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=128, attn_implementation="sdpa")).eval()


def test_bidirectional_modules_get_the_patterns_bidirectional_layout():
    """On a bidirectional module "local" and "streaming" were built with their builders' default causal=True:
    a BERT layer attended no key after the query, and a window wider than the sequence differed from dense
    attention by 0.07. The pattern "causal" ran dense there instead."""
    bert, x = _tiny_bert(), ids(length=48)
    with torch.no_grad():
        ref = bert(x).last_hidden_state
        for pattern, kwargs in (("local", {"window": 1000}), ("streaming", {"window": 1000, "num_sink": 4}),
                                ("local|random", {"window": 1000, "density": 0.1})):
            cfg = enable(bert, SparseAttnConfig(pattern, {**kwargs, "block_q": 16, "block_k": 16}))
            torch.testing.assert_close(bert(x).last_hidden_state, ref, atol=1e-5, rtol=1e-5)
            assert {s.blocks for s in cfg.stats.values()} == {9}, pattern  # every block of 48 x 48 in 16-blocks
        cfg = enable(bert, SparseAttnConfig("local", {"window": 8, "block_q": 16, "block_k": 16}))
        bert(x)
        (layout_stats,) = {(s.blocks, s.sparsity) for s in cfg.stats.values()}
        assert layout_stats[0] == 7  # both sides of the diagonal: 3 diagonal blocks and 4 neighbours
        cfg = enable(bert, SparseAttnConfig("causal", {"block_q": 16, "block_k": 16}))
        out = bert(x).last_hidden_state
        assert {s.blocks for s in cfg.stats.values()} == {6}
        enable(bert, SparseAttnConfig(causal=True))  # the module's attention forced causal: the same thing
        torch.testing.assert_close(out, bert(x).last_hidden_state, atol=1e-5, rtol=1e-5)


def test_modules_without_a_layer_index_run_the_pattern_and_every_module_has_its_stats():
    """Whisper's encoder attention has no layer_idx: enable() attached no config to it, so it ran through
    "sparse_attn" with the module-global default (dense), not the pattern enabled. In an encoder-decoder
    model the encoder's, the decoder's and the cross-attention share layer indices, so cfg.stats kept one
    of them per index; cfg.module_stats keys each module by name."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=32, max_target_positions=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, attn_implementation="sdpa")).eval()
    feats, dec = torch.randn(1, 16, 64), ids(length=10)
    enc_attn = model.model.encoder.layers[0].self_attn
    assert enc_attn.layer_idx is None
    with torch.no_grad():
        ref = model(input_features=feats, decoder_input_ids=dec).encoder_last_hidden_state
        cfg = enable(model, SparseAttnConfig(pattern_kwargs={"block_q": 16, "block_k": 16}))
        torch.testing.assert_close(model(input_features=feats, decoder_input_ids=dec).encoder_last_hidden_state,
                                   ref, atol=1e-5, rtol=1e-5)
        assert getattr(enc_attn, sat._ATTR) is cfg
        cfg = enable(model, SparseAttnConfig("local", {"window": 2, "block_q": 16, "block_k": 16}))
        out = model(input_features=feats, decoder_input_ids=dec).encoder_last_hidden_state
    assert not torch.allclose(out, ref, atol=1e-3)  # the pattern ran on the encoder
    enc = cfg.module_stats["model.encoder.layers.0.self_attn"]
    assert (enc.q_len, enc.kv_len, enc.pattern) == (32, 32, cfg.spec_for(None).describe())
    cross = cfg.module_stats["model.decoder.layers.1.encoder_attn"]
    own = cfg.module_stats["model.decoder.layers.1.self_attn"]
    assert (cross.q_len, cross.kv_len, own.q_len, own.kv_len) == (10, 32, 10, 10)
    assert len(cfg.module_stats) == 6 and None in cfg.stats  # 2 encoder, 2 decoder, 2 cross-attention modules
    with pytest.raises(ValueError, match="no layer_idx"):
        from transformers import DistilBertConfig, DistilBertModel
        enable(DistilBertModel(DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, hidden_dim=64)),
               SparseAttnConfig(layers=[0]))
    disable(model)
    assert not hasattr(enc_attn, sat._ATTR) and not hasattr(enc_attn, sat._NAME_ATTR)


def _masked_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    rule = REF_MASKS.get(module.layer_idx, causal_mask)
    bias = additive(rule(query.shape[2], key.shape[2])).to(query.device, query.dtype)
    return eager_attention_forward(module, query, key, value, bias, scaling=scaling, dropout=0.0)


AttentionInterface.register("sa_test_masked_eager", _masked_eager)


def reference_logits(model, x, rules, **kw):
    REF_MASKS.clear()
    REF_MASKS.update(rules)
    model.set_attn_implementation("sa_test_masked_eager")
    try:
        with torch.no_grad():
            return model(x, **kw).logits
    finally:
        model.set_attn_implementation("eager")


@pytest.fixture(autouse=True)
def _reset_default(monkeypatch):
    monkeypatch.setattr(sat, "_DEFAULT_CONFIG", None)


# ---------------------------------------------------------------------- one attention block
@pytest.mark.parametrize("lq,lk", [(48, 48), (1, 45), (7, 40)])
@pytest.mark.parametrize("rule", ["dense", "local"])
def test_attention_function_matches_eager(lq, lk, rule):
    model = tiny_llama(layers=1)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, HQ, lq, D, generator=g)
    k = torch.randn(2, HKV, lk, D, generator=g)
    v = torch.randn(2, HKV, lk, D, generator=g)
    cfg = SparseAttnConfig() if rule == "dense" else SparseAttnConfig("local", {"window": 12, **BLOCK})
    attn._sparse_attn_config = cfg
    out, weights = sat.sparse_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
    mask = causal_mask(lq, lk) if rule == "dense" else local_mask(12)(lq, lk)
    ref, _ = eager_attention_forward(attn, q, k, v, additive(mask), scaling=attn.scaling, dropout=0.0)
    assert weights is None
    assert out.shape == (2, lq, HQ, D)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert cfg.stats[0].q_len == lq and cfg.stats[0].kv_len == lk


def test_training_gradients_match_eager():
    """Fine-tuning through the integration on the CPU: a language-model loss's parameter gradients equal
    those of transformers' eager attention under the same token mask (streaming on layer 0, causal on
    the others). The backward runs sparse_attn.reference's recomputing autograd."""
    x = ids(batch=2, length=70)
    rules = {0: streaming_mask(20, 4)}
    ref = tiny_llama(layers=2).train()
    REF_MASKS.clear()
    REF_MASKS.update(rules)
    ref.set_attn_implementation("sa_test_masked_eager")
    ref(x, labels=x).loss.backward()
    model = tiny_llama(layers=2).train()
    enable(model, SparseAttnConfig(per_layer={0: ("streaming", {"window": 20, "num_sink": 4, **BLOCK})}))
    loss = model(x, labels=x).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=2e-6, rtol=1e-4, msg=name)


def test_decoder_block_matches_eager():
    """One LlamaDecoderLayer (attention + MLP + norms) switched between eager and sparse_attn."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    model = tiny_llama(layers=1)
    config = model.config
    torch.manual_seed(3)
    block = LlamaDecoderLayer(config, layer_idx=0).eval()
    rope = LlamaRotaryEmbedding(config)
    h = torch.randn(2, 40, 64)
    pos = torch.arange(40)[None].expand(2, -1)
    emb = rope(h, pos)
    with torch.no_grad():
        ref = block(h, attention_mask=additive(causal_mask(40, 40)), position_embeddings=emb)
        sat.register()
        block.self_attn._sparse_attn_config = SparseAttnConfig()
        config._attn_implementation = "sparse_attn"
        out = block(h, attention_mask=None, position_embeddings=emb)
    ref = ref[0] if isinstance(ref, tuple) else ref
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# ---------------------------------------------------------------------- whole models
def test_dense_matches_eager_and_sdpa():
    model = tiny_llama()
    x = ids(batch=2, length=70)
    with torch.no_grad():
        eager = model(x).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(x).logits
        cfg = enable(model, SparseAttnConfig())
        assert model.config._attn_implementation == "sparse_attn"
        ours = model(x).logits
        ours_mask = model(x, attention_mask=torch.ones_like(x)).logits  # an all-ones padding mask is fine
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_mask, ours, atol=0, rtol=0)
    assert sorted(cfg.sparsity) == [0, 1, 2]
    assert all(v == 0.0 for v in cfg.causal_sparsity.values())
    disable(model)
    assert model.config._attn_implementation == "sdpa"  # what it ran before enable()
    assert sat.get_config(model) is None


def test_bidirectional_encoder_and_cross_attention_follow_the_modules():
    """Causality comes from each attention module (as in transformers' sdpa): a BERT encoder is
    bidirectional (it once ran causal, silently), and BART's decoder mixes causal self-attention with
    cross-attention over the encoder states (it was refused with a message about caches)."""
    from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel
    bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=128, attn_implementation="sdpa")).eval()
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        attn_implementation="sdpa", pad_token_id=0)).eval()
    x, y = ids(length=40), ids(length=12, seed=2)
    with torch.no_grad():
        ref_bert = bert(x).last_hidden_state
        ref_bart = bart(input_ids=x, decoder_input_ids=y, use_cache=False).logits
        enable(bert)
        enable(bart)
        torch.testing.assert_close(bert(x).last_hidden_state, ref_bert, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bart(input_ids=x, decoder_input_ids=y, use_cache=False).logits, ref_bart,
                                   atol=1e-5, rtol=1e-5)
        # a dense bidirectional layer skips nothing of its own baseline (in 16-blocks it read -0.5 against causal)
        bert_cfg = enable(bert, SparseAttnConfig(pattern_kwargs={"block_q": 16, "block_k": 16}))
        bert(x)
        assert len(bert_cfg.causal_sparsity) == 2 and set(bert_cfg.causal_sparsity.values()) == {0.0}
        enable(bert, SparseAttnConfig(causal=True))  # forcing causal on an encoder is the caller's choice
        assert not torch.allclose(bert(x).last_hidden_state, ref_bert, atol=1e-3)


def test_config_options_cannot_change_after_it_is_made():
    """pattern / pattern_kwargs / per_layer were read once at construction: later edits ran the old
    pattern silently. They now raise, and the config still deep-copies and pickles (models are)."""
    import copy
    import pickle
    cfg = SparseAttnConfig("local", {"window": 8, **BLOCK}, per_layer={0: "dense"})
    with pytest.raises(AttributeError, match="build a new SparseAttnConfig"):
        cfg.pattern = "dense"
    with pytest.raises(TypeError, match="build a new SparseAttnConfig"):
        cfg.pattern_kwargs["window"] = 64
    with pytest.raises(TypeError, match="build a new SparseAttnConfig"):
        cfg.per_layer.update({1: "dense"})
    cfg.layers = [0]  # read on every call: still settable
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert twin.pattern_kwargs == {"window": 8, **BLOCK} and twin.spec_for(0).describe() == "dense"
    model = tiny_llama(layers=1)
    enable(model, cfg)
    copy.deepcopy(model)


def test_layers_set_after_the_config_is_made_are_checked_as_at_construction():
    """layers is read on every call and may be set later, but a later value skipped the checks made at
    construction: ["1"] (a split string) matched no layer and [5] on a 2-layer model named none, so every
    layer ran dense, silently; an int failed inside the forward."""
    model = tiny_llama(layers=2)
    cfg = enable(model, SparseAttnConfig("local", {"window": 16, **BLOCK}, layers=["0"]))
    cfg.layers = ["1"]
    assert cfg.layers == frozenset({1})
    with torch.no_grad():
        model(ids(length=64))
    assert cfg.stats[0].pattern == "dense(block_k=16, block_q=16)" and cfg.stats[1].pattern.startswith("local")
    with pytest.raises(ValueError, match=r"layer indices \[5\] are out of range: the model has 2"):
        cfg.layers = [1, 5]
    for bad in (1, [True], [1.5], "x"):
        with pytest.raises(TypeError, match="layers must be None or layer indices"):
            cfg.layers = bad
    with pytest.raises(TypeError, match="layers must be None or layer indices"):
        SparseAttnConfig(layers=[0.5])
    assert cfg.layers == frozenset({1})
    cfg.layers = None
    assert cfg.spec_for(0).name == "local"


def test_output_attentions_warns():
    sat._WARNED.clear()
    model = tiny_llama(layers=1)
    enable(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="does not return attention weights"):
        out = model(ids(length=20), output_attentions=True)
    assert not out.attentions or all(a is None for a in out.attentions)


def test_gqa_passes_kv_heads_without_repeat(monkeypatch):
    model = tiny_llama(layers=2)
    seen = []
    real = sparse_attn.api.attention

    def spy(q, k, v, layout=None, **kw):
        seen.append((q.shape[1], k.shape[1], v.shape[1], k.shape[2]))
        return real(q, k, v, layout, **kw)

    monkeypatch.setattr(sparse_attn.api, "attention", spy)
    x = ids(length=40)
    with torch.no_grad():
        ref = model(x).logits
        enable(model, SparseAttnConfig())
        out = model(x).logits
    assert seen == [(HQ, HKV, HKV, 40)] * 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern,kwargs,rule", [
    ("local", {"window": 16}, local_mask(16)),
    ("streaming", {"window": 16, "num_sink": 4}, streaming_mask(16, 4)),
])
def test_fixed_pattern_equals_masked_eager(pattern, kwargs, rule):
    model = tiny_llama()
    x = ids(batch=2, length=80)
    L = x.shape[1]
    with torch.no_grad():
        dense = model(x).logits
        masked = model(x, attention_mask=additive(rule(L, L))).logits  # eager with the pattern's token mask
        cfg = enable(model, SparseAttnConfig(pattern, {**kwargs, **BLOCK}))
        ours = model(x).logits
    torch.testing.assert_close(ours, masked, atol=1e-5, rtol=1e-5)
    # positions whose window still covers the whole prefix are untouched; later ones change
    w = kwargs["window"] + kwargs.get("num_sink", 0)  # sinks + window still cover every earlier key
    torch.testing.assert_close(ours[:, :w], dense[:, :w], atol=1e-5, rtol=1e-5)
    assert (ours[:, w:] - dense[:, w:]).abs().amax(-1).min() > 1e-4
    want, visited = block_sparsity(rule(L, L), 16)
    _, causal_visited = block_sparsity(causal_mask(L, L), 16)
    assert sorted(cfg.sparsity) == [0, 1, 2]
    for i in range(3):
        assert cfg.sparsity[i] == pytest.approx(want)
        assert cfg.causal_sparsity[i] == pytest.approx(1 - visited / causal_visited)
        assert cfg.stats[i].q_len == cfg.stats[i].kv_len == L
    assert 0 < want < 1


@pytest.mark.parametrize("how", ["per_layer", "layers"])
def test_per_layer_config(how):
    model = tiny_llama(layers=2)
    x = ids(length=80)
    local = {"window": 16, **BLOCK}
    if how == "per_layer":
        cfg = SparseAttnConfig("local", local, per_layer={0: ("dense", BLOCK)})
    else:
        cfg = SparseAttnConfig("local", local, layers={1})
    ref = reference_logits(model, x, {0: causal_mask, 1: local_mask(16)})
    all_local = reference_logits(model, x, {0: local_mask(16), 1: local_mask(16)})
    with torch.no_grad():
        enable(model, cfg)
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (out - all_local).abs().max() > 1e-3  # layer 0 really ran dense
    assert cfg.causal_sparsity[0] == 0.0 and cfg.causal_sparsity[1] > 0.3
    assert cfg.stats[0].pattern.startswith("dense") and cfg.stats[1].pattern.startswith("local")


def test_generation_dense_matches_stock():
    model = tiny_llama()
    x = ids(length=40)
    kw = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        stock = model.generate(x, **kw)
        cfg = enable(model, SparseAttnConfig())
        ours = model.generate(x, **kw)
    assert torch.equal(ours.sequences, stock.sequences)
    for a, b in zip(ours.logits, stock.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cfg.stats[0].q_len == 1 and cfg.stats[0].kv_len == 40 + 5  # the last decoding step


def test_generation_local_matches_masked_reference():
    model = tiny_llama()
    x = ids(length=40)
    kw = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    REF_MASKS.clear()
    REF_MASKS.update({i: local_mask(16) for i in range(3)})
    with torch.no_grad():
        model.set_attn_implementation("sa_test_masked_eager")
        ref = model.generate(x, **kw)
        enable(model, SparseAttnConfig("local", {"window": 16, **BLOCK}))
        ours = model.generate(x, **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kv_cache_step_is_bottom_right_aligned():
    """Prefill 40 tokens, decode 1 with the cache == the last position of a 41-token forward."""
    model = tiny_llama()
    x = ids(length=41)
    cfg = enable(model, SparseAttnConfig("streaming", {"window": 12, "num_sink": 3, **BLOCK}))
    with torch.no_grad():
        full = model(x).logits[:, -1]
        pre = model(x[:, :40], use_cache=True)
        step = model(x[:, 40:], past_key_values=pre.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    assert (cfg.stats[2].q_len, cfg.stats[2].kv_len) == (1, 41)


def test_padding_with_gaps_and_padded_four_dim_masks_are_refused():
    """Left and right padding run (tests/test_transformers_padding.py); a row whose real tokens are not one run,
    and a 4-D mask with padding written in, are refused by name."""
    model = tiny_llama(layers=2)
    x = ids(batch=2, length=32)
    enable(model, SparseAttnConfig("local", {"window": 8, **BLOCK}))
    gap = torch.ones_like(x)
    gap[1, 10:12] = 0
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="row 1 has padding between real tokens"):
            model(x, attention_mask=gap)
        custom = causal_mask(32, 32).clone()
        custom[10, 3] = False  # a 4-D mask that is not the plain causal one
        with pytest.raises(NotImplementedError, match="got a padded or custom mask"):
            model(x, attention_mask=additive(custom))
        model(x, attention_mask=additive(causal_mask(32, 32)))  # the plain causal 4-D mask is accepted


def test_sliding_window_model_matches_eager():
    """Mistral with sliding_window: the model's own window is intersected with the pattern."""
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, sliding_window=20,
                        max_position_embeddings=512, initializer_range=0.1, attn_implementation="eager")
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    x = ids(length=64)
    with torch.no_grad():
        ref = model(x).logits
        cfg = enable(model, SparseAttnConfig("dense", {"block_q": 16, "block_k": 16}))
        out = model(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # dense skips nothing the layer's own window does not: measured against causal-dense it read 0.5
    assert set(cfg.causal_sparsity.values()) == {0.0} and set(cfg.sparsity.values()) == {1 - 9 / 16}
    with torch.no_grad():  # a window of 8 inside the model's 20 skips a share of the window's blocks
        enable(model, SparseAttnConfig("local", {"window": 8, "block_q": 16, "block_k": 16}))
        model(x)
    band, local = (patterns.local(64, w, block_q=16, block_k=16).num_blocks for w in (20, 8))
    assert sat.get_config(model).causal_sparsity == {0: 1 - local / band, 1: 1 - local / band}


def tiny_mistral(window=20):
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, sliding_window=window,
                        max_position_embeddings=512, initializer_range=0.1, attn_implementation="eager")
    torch.manual_seed(0)
    return MistralForCausalLM(cfg).eval()


def test_sliding_window_mask_is_not_materialised(monkeypatch):
    """The sliding-window mask function is checked a row chunk at a time and comes back as a
    one-element marker, not an [B, 1, L, L] mask; prefill and KV-cached decoding stay exact."""
    model = tiny_mistral()
    x = ids(length=64)
    made = []
    real = sat.sparse_attn_mask
    monkeypatch.setattr(sat, "MASK_CHUNK", 5 * 64)  # 5 rows a chunk: 13 chunks on the prefill
    with torch.no_grad():
        ref = model(x).logits
        enable(model, SparseAttnConfig())
        from transformers.masking_utils import AttentionMaskInterface
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, sat.NAME,
                            lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
        out = model(x).logits
        pre = model(x[:, :40], use_cache=True)
        step = model(x[:, 40:41], past_key_values=pre.past_key_values, use_cache=True).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[:, -1], ref[:, 40], atol=1e-5, rtol=1e-5)
    bands = [m for m in made if m is not None]
    assert bands and all(m.untyped_storage().nbytes() == 1 for m in bands), [tuple(m.shape) for m in bands]
    assert [tuple(m.shape) for m in bands] == [(1, 1, 64, 64), (1, 1, 40, 40), (1, 1, 1, 20)]  # the sliding cache keeps 20 keys


def test_pattern_placing_keys_by_position_is_refused_once_a_sliding_cache_drops_keys():
    """A sliding-window cache keeps the last W keys, so on a decoding step key 0 of the call is token 21, not 0:
    streaming's sinks (tokens 0..3) landed on the oldest cached keys, and the step's logits came out 1.6 off the
    last row of a forward over the whole sequence, silently. Patterns placed relative to the diagonal (local,
    dense) stay exact; the others are refused once the cache has dropped keys (and still run before that). (Streaming
    with a window at least the model's is the model's window alone and runs: test_transformers_window.py.)"""
    model = tiny_mistral(window=20)
    x = ids(length=41)
    with torch.no_grad():
        enable(model, SparseAttnConfig("local", {"window": 8, **BLOCK}))
        full = model(x).logits[:, -1]
        pre = model(x[:, :40], use_cache=True)
        step = model(x[:, 40:], past_key_values=pre.past_key_values, use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
        enable(model, SparseAttnConfig(per_layer={1: ("streaming", {"window": 8, "num_sink": 4, **BLOCK})}))
        model(x)  # no cache: the keys start at token 0
        short = model(x[:, :10], use_cache=True)  # 11 of the 20 keys the cache keeps: nothing dropped yet
        model(x[:, 10:11], past_key_values=short.past_key_values, use_cache=True)
        pre = model(x[:, :40], use_cache=True)
        with pytest.raises(NotImplementedError, match=r"layer 1's pattern streaming\(.*keys 21\.\.40"):
            model(x[:, 40:], past_key_values=pre.past_key_values, use_cache=True)


def test_band_marker_only_fits_its_own_call():
    from transformers.masking_utils import sliding_window_causal_mask_function
    marker = sat.sparse_attn_mask(1, 48, 48, mask_function=sliding_window_causal_mask_function(10), local_size=10)
    assert marker.untyped_storage().nbytes() == 1 and not bool(marker.any())
    sat.check_mask(marker, 48, 48, True, 10)
    for lq, lk, causal, window in ((48, 48, True, None), (48, 48, True, 11), (48, 48, False, 10), (47, 48, True, 10)):
        with pytest.raises(NotImplementedError, match="sliding window of 10 keys"):
            sat.check_mask(marker, lq, lk, causal, window)
    # a window over every earlier key (from token 0) is plain causal: no mask
    assert sat.sparse_attn_mask(1, 8, 8, mask_function=sliding_window_causal_mask_function(64), local_size=64) is None


def band_mask(window):
    """Bidirectional sliding window as FlashAttention reads ``sliding_window``: keys less than ``window`` away."""
    def fn(lq, lk):
        p = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        return (j - p).abs() < window
    return fn


def test_bidirectional_sliding_window_layers_run_their_band():
    """ModernBERT-style encoders have bidirectional sliding-window layers (mask |i - j| <= half, attention
    called with sliding_window = half + 1). Their mask was refused as a padded batch; called with no mask,
    such a layer was cut to the causal window and attended no later key, silently. Now the mask interface
    recognises the band without materialising it and the layer runs it."""
    from transformers import ModernBertConfig, ModernBertModel
    from transformers.masking_utils import sliding_window_bidirectional_mask_function
    cfg = ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, global_attn_every_n_layers=3, local_attention=16,
                           max_position_embeddings=128, attn_implementation="sdpa", pad_token_id=0, sep_token_id=1,
                           cls_token_id=2, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    model = ModernBertModel(cfg).eval()
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"] and cfg.sliding_window == 8
    x = ids(length=70)
    with torch.no_grad():
        ref = model(x).last_hidden_state
        sparse = enable(model, SparseAttnConfig(pattern_kwargs=BLOCK))
        torch.testing.assert_close(model(x).last_hidden_state, ref, atol=1e-5, rtol=1e-5)
    # the window layers skip blocks, and against their own window (the baseline) a dense pattern skips none
    assert sparse.sparsity == {0: 0.0, 1: pytest.approx(block_sparsity(band_mask(9)(70, 70), 16)[0]), 2: sparse.sparsity[1]}
    assert sparse.sparsity[1] > 0.4 and set(sparse.causal_sparsity.values()) == {0.0}
    marker = sat.sparse_attn_mask(1, 70, 70, mask_function=sliding_window_bidirectional_mask_function(8),
                                  local_size=8)
    assert marker.untyped_storage().nbytes() == 1 and sat._band_of(marker) == (70, 70, 9, 0, False)
    sat.check_mask(marker, 70, 70, False, 9)
    for causal, window in ((True, 9), (False, 8), (False, None)):
        with pytest.raises(NotImplementedError, match="bidirectional with a sliding window of 9"):
            sat.check_mask(marker, 70, 70, causal, window)
    materialised = band_mask(9)(70, 70)[None, None]
    sat.check_mask(materialised, 70, 70, False, 9)
    with pytest.raises(NotImplementedError, match="padded or custom mask"):
        sat.check_mask(materialised, 70, 70, False, 8)
    # the attention function alone, no mask, a non-causal call: the band around each query, both sides
    attn = tiny_llama(layers=1).model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, HQ, 40, D, generator=g)
    k, v = (torch.randn(1, HKV, 40, D, generator=g) for _ in range(2))
    out, _ = sat.sparse_attention_forward(attn, q, k, v, None, scaling=0.25, sliding_window=5, is_causal=False)
    ref, _ = eager_attention_forward(attn, q, k, v, additive(band_mask(5)(40, 40)), scaling=0.25, dropout=0.0)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("length,new", [(30, 2), (10, 15)])
def test_static_cache_on_a_sliding_window_model_runs_past_its_window(length, new):
    """generate() with a static cache makes the masks itself, and transformers 5.24 copies them (.contiguous()):
    sparse_attn's one-element band marker became an all-False mask, refused by name (a prompt longer than the
    window, or a buffer rolled past it, without padding). The copy of the latest marker is now taken for that
    marker (check_mask, _adopt_marker_copy), so a 30-token prompt (window 20) and a 10-token one with 15 new tokens
    give eager attention's tokens and logits. transformers 5.17 does not copy the masks and ran them already."""
    static_generation_like_eager(ids(length=length), {"max_new_tokens": new, "min_new_tokens": new})


def static_generation_like_eager(x, gen: dict):
    """Greedy static-cache generation of a tiny Mistral (window 20) through sparse_attn, with ``gen``'s extra
    arguments, against the same model on transformers' eager attention: equal tokens, logits within 1e-5.
    Returns (the sparse_attn model, its output)."""
    gen = {"cache_implementation": "static", "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
           **gen}
    with torch.no_grad():
        ref = tiny_mistral().generate(x, **gen)
        model = tiny_mistral()
        enable(model, SparseAttnConfig())
        got = model.generate(x, **gen)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return model, got


def test_a_copied_band_marker_keeps_its_band_and_its_key_offset():
    """A copy of the latest band marker that allows no key is taken for the marker: check_mask accepts it on the
    marker's call and _key_offset gives the marker's kv_offset (so patterns placed by position still refuse after a
    sliding cache dropped keys: the static generation below, streaming on a rolled buffer). A copy with one key
    allowed, an all-False mask of another shape, or a copy on a call with another window stay refused."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    marker = sat.sparse_attn_mask(1, 1, 20, q_offset=25, kv_offset=6, mask_function=sliding_window_causal_mask_function(20),
                                  local_size=20)
    assert marker.untyped_storage().nbytes() == 1 and sat._key_offset(marker) == 6
    copy = marker.contiguous()
    sat.check_mask(copy, 1, 20, True, 20)
    assert sat._key_offset(copy) == 6
    copy2 = marker.contiguous()
    with pytest.raises(NotImplementedError, match="allows no key at all"):
        sat.check_mask(copy2, 1, 20, True, 5)  # the marker's shape, but this call's window is another
    holed = marker.contiguous().clone()
    holed[..., 3] = True
    with pytest.raises(NotImplementedError, match="padded or custom mask"):
        sat.check_mask(holed, 1, 20, True, 20)
    with pytest.raises(NotImplementedError, match="allows no key at all"):
        sat.check_mask(torch.zeros(1, 1, 2, 20, dtype=torch.bool), 2, 20, True, 20)
    model, x = tiny_mistral(), ids(length=10)
    enable(model, SparseAttnConfig(per_layer={1: ("streaming", {"window": 8, "num_sink": 4, **BLOCK})}))
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"layer 1's pattern streaming\(.*keys 1\.\.20"):
        model.generate(x, cache_implementation="static", max_new_tokens=15, min_new_tokens=15, do_sample=False)


def test_other_mask_functions_are_still_materialised_and_checked():
    from transformers.masking_utils import and_masks, causal_mask_function
    holes = and_masks(causal_mask_function, lambda b, h, q, kv: kv != 3)
    mask = sat.sparse_attn_mask(1, 40, 40, mask_function=holes, local_size=None)
    assert mask.untyped_storage().nbytes() >= 40 * 40 and not bool(mask[0, 0, 20, 3])
    with pytest.raises(NotImplementedError, match="or other custom mask functions"):
        sat.check_mask(mask, 40, 40, True, None)


def test_from_pretrained_with_registered_default(tmp_path):
    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path)
    x = ids(length=48)
    ref = reference_logits(model, x, {0: local_mask(16), 1: local_mask(16)})
    sat.register(SparseAttnConfig("local", {"window": 16, **BLOCK}))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_attn").eval()
    with torch.no_grad():
        out = loaded(x).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert sat._DEFAULT_CONFIG.sparsity[1] > 0


def test_layouts_are_cached_and_shared():
    model = tiny_llama()
    cfg = enable(model, SparseAttnConfig("local", {"window": 16, **BLOCK}))
    x = ids(length=64)
    with torch.no_grad():
        model(x)
        assert len(cfg._cache) == 1  # three layers, one (pattern, length, device)
        model(x)
        assert len(cfg._cache) == 1
        model(ids(length=48))
        assert len(cfg._cache) == 2


def test_config_errors():
    with pytest.raises(ValueError, match="needs window"):
        SparseAttnConfig("local")
    with pytest.raises(ValueError, match="unknown pattern"):
        SparseAttnConfig("nope", {})
    with pytest.raises(ValueError, match="density"):
        SparseAttnConfig("random", {})
    with pytest.raises(ValueError, match="may not set"):
        SparseAttnConfig("local", {"window": 4, "kv_len": 9})
    with pytest.raises(ValueError, match="out of range"):
        enable(tiny_llama(layers=2), SparseAttnConfig(per_layer={5: "dense"}))
    model = tiny_llama(layers=1)
    model.train()
    model.config.attention_dropout = 0.1
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    enable(model, SparseAttnConfig())
    with pytest.raises(NotImplementedError, match="dropout"):
        model(ids(length=8))


def test_pattern_options_no_builder_takes_are_refused_when_the_config_is_made():
    """An option none of the pattern's builders takes was dropped without a word, and still named in the
    stats: ("local", {"window": 16, "num_sink": 4}) ran plain local reported as "local(num_sink=4, ...)". A
    misspelt option, or one adaptive's predictor does not take, failed only inside the first forward."""
    for pattern, kwargs, words in [
        ("local", {"window": 16, "num_sink": 4}, "num_sink"),
        ("dense", {"window": 16}, "window"),
        ("local|random", {"window": 16, "density": 0.3, "stride": 2}, "stride"),
        ("local", {"window": 16, "windw": 3}, "windw"),
        ("adaptive", {"topk": 0.5, "windw": 3}, "windw"),
        ("adaptive", {"topk": 0.5, "causal": True}, "causal"),
    ]:
        with pytest.raises(ValueError, match=f"pattern_kwargs {words} .*{pattern.split('|')[0]}"):
            SparseAttnConfig(pattern, {**kwargs, **BLOCK})
        with pytest.raises(ValueError, match=f"pattern_kwargs {words} "):
            SparseAttnConfig(per_layer={0: (pattern, {**kwargs, **BLOCK})})
    SparseAttnConfig("local|random", {"window": 16, "density": 0.3, "seed": 1, "causal": True, **BLOCK})
    SparseAttnConfig("adaptive", {"topk": 0.5, "attention_sink": True, **BLOCK})


def test_additive_position_bias_is_refused_not_dropped():
    """T5 hands its relative-position bias to the attention function as position_bias=; it was ignored
    (logits 0.28 off eager's, no warning)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                decoder_start_token_id=0, attn_implementation="eager")
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    enable(model, SparseAttnConfig())
    with pytest.raises(NotImplementedError, match="position_bias is not supported .* relative-position bias"):
        model(input_ids=ids(length=9), decoder_input_ids=ids(length=5))


def test_attention_modules_holding_a_copy_of_the_config_are_switched_too():
    """Attention modules dispatch on their own ``config``; T5's stacks hold deep copies of the model's, which
    set_attn_implementation did not reach under transformers 5.17 (the GPU machine's): enable() reported
    the switch while every T5 attention ran eager, and T5's position_bias was never refused. The same
    copy on a Llama layer: that layer now runs sparse_attn, and disable() switches it back."""
    import copy
    model = tiny_llama(layers=2, attn="sdpa")
    attn = model.model.layers[1].self_attn
    attn.config = copy.deepcopy(model.config)
    cfg = enable(model, SparseAttnConfig("local", {"window": 16, **BLOCK}))
    assert attn.config._attn_implementation == "sparse_attn"
    with torch.no_grad():
        model(ids(length=64))
    assert sorted(cfg.stats) == [0, 1] and cfg.causal_sparsity[1] > 0
    disable(model)
    assert attn.config._attn_implementation == model.config._attn_implementation == "sdpa"


def test_random_pattern_per_head_runs():
    model = tiny_llama(layers=2)
    cfg = enable(model, SparseAttnConfig("local|random", {"window": 16, "density": 0.3, "heads": HQ, **BLOCK}))
    with torch.no_grad():
        out = model(ids(length=96)).logits
        gen = model.generate(ids(length=40), max_new_tokens=3, do_sample=False)
    assert torch.isfinite(out).all() and gen.shape == (1, 43)
    assert 0 < cfg.causal_sparsity[0] < 1


def _adaptive_available():
    import importlib.util
    try:
        return importlib.util.find_spec("sparse_attn.predict") is not None
    except ImportError:
        return False


def test_adaptive_missing_predictor_is_a_clear_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "sparse_attn.predict", None)  # as if the predictor were not there
    with pytest.raises(ImportError, match="sparse_attn.predict.meansim"):
        SparseAttnConfig("adaptive", {"simthreshd1": 0.5})


@pytest.mark.skipif(not _adaptive_available(), reason="sparse_attn.predict (adaptive predictor) not installed yet")
def test_adaptive_pattern_runs():
    from sparse_attn.predict import meansim
    model = tiny_llama(layers=2)
    x = ids(length=128)
    with torch.no_grad():
        dense = model(x).logits
        cfg = enable(model, SparseAttnConfig("adaptive", {"topk": 1.0, **BLOCK}))  # keeps every visible block
        everything = model(x).logits
        assert all(v == 0.0 for v in cfg.causal_sparsity.values())
        cfg = enable(model, SparseAttnConfig("adaptive", {"topk": 0.3, "simthreshd1": -1.0, **BLOCK}))
        sparse = model(x).logits
        prefill = dict(cfg.causal_sparsity)
        gen = model.generate(ids(length=40), max_new_tokens=2, do_sample=False)
    torch.testing.assert_close(everything, dense, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(sparse).all() and gen.shape == (1, 42)
    assert sorted(prefill) == [0, 1] and all(0.0 < v < 1.0 for v in prefill.values())
    assert cfg.stats[0].q_len == 1 and cfg.stats[0].kv_len == 41  # the last (decoding) call
    # one block: the integration runs exactly meansim's layout
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, HQ, 96, D, generator=g), torch.randn(1, HKV, 96, D, generator=g), \
        torch.randn(1, HKV, 96, D, generator=g)
    out, _ = sat.sparse_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
    lay = meansim(q, k, topk=0.3, simthreshd1=-1.0, causal=True, scale=attn.scaling, **BLOCK)
    ref = sparse_attn.api.attention(q, k, v, lay, causal=True, scale=attn.scaling)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-5)
    assert lay.sparsity > 0.3


# ---------------------------------------------------------------------- the Triton path (GPU)
def check_low_precision(device, length=1024):
    """bf16 through the integration vs the fp32 masked-eager reference: the error may be at most
    2x that of transformers' own bf16 eager attention with the same mask (DESIGN.md rule 3)."""
    import copy
    cases = [("dense", {}, causal_mask), ("local", {"window": 200}, local_mask(200)),
             ("streaming", {"window": 128, "num_sink": 16}, streaming_mask(128, 16))]
    base = tiny_llama(max_positions=2 * length).to(device)
    x = ids(length=length).to(device)
    for pattern, kwargs, rule in cases:
        rules = dict.fromkeys(range(3), rule)
        ref = reference_logits(base, x, rules).float()
        low = copy.deepcopy(base).to(torch.bfloat16)
        eager_err = (reference_logits(low, x, rules).float() - ref).abs().max().item()
        cfg = enable(low, SparseAttnConfig(pattern, kwargs))
        with torch.no_grad():
            ours = low(x).logits.float()
            gen = low.generate(x[:, :300], max_new_tokens=4, do_sample=False)
        err = (ours - ref).abs().max().item()
        assert torch.isfinite(ours).all() and err <= 2 * eager_err + 1e-2, (pattern, err, eager_err)
        assert gen.shape == (1, 304) and cfg.stats[0].q_len == 1


@pytest.mark.gpu
def test_bf16_on_cuda_kernels():
    check_low_precision("cuda")


def _band(lq, lk, keys):
    """bool [1, 1, lq, lk]: bottom-right causal within the last ``keys`` keys (self included)."""
    p = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    return ((j <= p) & (j > p - keys))[None, None]


def test_materialised_sliding_window_mask_must_match_the_layers_window_exactly():
    """A materialised mask (bool, or additive 0 / min) equal to the layer's causal sliding window of W keys
    (transformers' sliding_window: W keys, self included) is accepted; one key more or fewer is refused,
    since sparse_attn would apply its own W-key window instead."""
    for lq, lk in ((40, 40), (12, 40)):
        good = _band(lq, lk, 10)
        sat.check_mask(good, lq, lk, True, 10)
        additive = torch.zeros(good.shape).masked_fill(~good, torch.finfo(torch.float32).min)
        sat.check_mask(additive, lq, lk, True, 10)
        for keys in (9, 11):
            with pytest.raises(NotImplementedError, match="padded or custom mask"):
                sat.check_mask(_band(lq, lk, keys), lq, lk, True, 10)


def test_additive_mask_with_finite_bias_values_is_refused():
    """An additive mask is accepted only as 0 (allowed) / a huge negative number (masked). A small
    negative bias where the causal mask would mask (-1.0: the model still attends there, a little) or
    any non-zero value on an allowed key is a bias sparse_attn cannot apply, even when its zero/non-zero
    pattern equals the causal one."""
    band = _band(24, 24, 24)
    soft = torch.zeros(band.shape).masked_fill(~band, -1.0)
    with pytest.raises(NotImplementedError, match="additive attention biases"):
        sat.check_mask(soft, 24, 24, True, None)
    biased = torch.zeros(band.shape).masked_fill(~band, torch.finfo(torch.float32).min)
    biased[..., 5, 2] = 0.5
    with pytest.raises(NotImplementedError, match="additive attention biases"):
        sat.check_mask(biased, 24, 24, True, None)


def test_mask_interface_on_keys_that_do_not_end_at_the_last_query():
    """A static cache's key buffer runs past the last query (q at 0..7 of 64 key slots): bottom-right causal
    over the buffer would be wrong, so the slots after the last query come back marked unwritten (int8 key
    states: 1 real, -1 unwritten; the attention function then runs keys 0..7 only, queries bottom-right of them;
    tests/test_transformers_padding.py generates with static caches);
    a sliding-window layer's buffer gets them too while its window holds every written key, and is refused past
    that. Keys ending at the last query give None (sparse_attn applies causal itself), and a bidirectional mask
    has no alignment to keep."""
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        sliding_window_causal_mask_function,
    )
    written = sat.sparse_attn_mask(1, 8, 64, q_offset=0, kv_offset=0, mask_function=causal_mask_function)
    assert written.shape == (1, 64) and written[0].tolist() == [1] * 8 + [-1] * 56
    packing = sat._unpad.from_padding(written, 8)
    assert (packing.k_lens, packing.q_lens, packing.q_starts, packing.kv_len) == ((8,), (8,), (0,), 8)
    sliding = sat.sparse_attn_mask(1, 8, 64, q_offset=0, kv_offset=0,
                                   mask_function=sliding_window_causal_mask_function(16), local_size=16)
    assert torch.equal(sliding, written)  # queries 0..7 see keys 0..7 whole: the causal mask's key states
    with pytest.raises(NotImplementedError, match="full-attention layers only"):  # query 23 sees keys 8..23 only
        sat.sparse_attn_mask(1, 8, 64, q_offset=16, kv_offset=0, mask_function=sliding_window_causal_mask_function(16),
                             local_size=16)
    assert sat.sparse_attn_mask(1, 8, 64, q_offset=56, kv_offset=0, mask_function=causal_mask_function) is None
    assert sat.sparse_attn_mask(1, 8, 64, q_offset=0, kv_offset=0, mask_function=bidirectional_mask_function) is None


def test_a_mask_changed_in_place_is_checked_again():
    """check_mask remembers the last mask it accepted (not re-checked in every layer), but a mask
    written in place afterwards (padding added to the same tensor) must be checked again."""
    mask = _band(16, 16, 16).clone()
    sat.check_mask(mask, 16, 16, True, None)
    sat.check_mask(mask, 16, 16, True, None)
    mask[..., 2] = False  # key 2 now padded
    with pytest.raises(NotImplementedError, match="padded or custom mask"):
        sat.check_mask(mask, 16, 16, True, None)
