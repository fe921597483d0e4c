"""Compiled decoding on sliding-window layers (integrations._traced._sliding_window): a static cache's sliding buffer
(transformers' StaticSlidingWindowLayer) gets key states, made by the traced mask function and read by the traced
attention, so a compiled decoding step of a Mistral-style model has no graph break, before the buffer rolls and
after, padded or not. Before, the mask (and, once rolled without padding, every layer's attention) broke the graph
at every step, and its offsets, read on the host, made dynamo compile the step again at every step."""
from __future__ import annotations

import pytest
import torch

from sparse_attn.integrations import _traced, _unpad

transformers = pytest.importorskip("transformers")
from test_transformers_integration import BLOCK, ids, tiny_mistral  # noqa: E402
from test_transformers_padding import left_padded  # noqa: E402
from test_traced_integration import _generate, compiled_generation, counting_compile_config  # noqa: E402
from transformers.masking_utils import and_masks, sliding_window_causal_mask_function  # noqa: E402

from sparse_attn.integrations import transformers as sat  # noqa: E402
from sparse_attn.integrations.transformers import SparseAttnConfig, enable  # noqa: E402

WINDOW = 20  # tiny_mistral's sliding window: its static cache keeps 20 slots


CASES = {  # name: (prompt lengths (left-padded) or one unpadded prompt's, new tokens)
    "before the buffer rolls, padded": ([10, 7, 4], 8),
    "before the buffer rolls, one prompt": ([10], 8),
    "rolled, padded (prompts past the window)": ([22, 10, 21], 6),
    "rolled, one prompt": ([30], 6),
    "rolling during generation, padded": ([10, 7, 4], 16),
}


@pytest.mark.parametrize("case", CASES)
def test_compiled_static_generation_on_sliding_window_layers_traces_whole(case):
    """fullgraph=True (a graph break fails); no more graphs over the steps than transformers' sdpa compiles on the same
    case (two: before and after the buffer rolls; three when it rolls during the generation), and none reading the
    cache's int lengths more than sdpa's do (only to count tokens: read into the attention's tensors, they are inputs
    of its kernels, and CUDA graph trees recorded a new graph at every step, 12.9 against 1.7 ms a token on the
    H200); the tokens and logits of transformers' own eager attention."""
    lengths, new = CASES[case]
    x, mask = left_padded(lengths, max(lengths), seed=5)
    if len(lengths) == 1:
        x, mask = ids(length=lengths[0]), None
    traced_like_eager_and_sdpa(tiny_mistral, x, mask, new)


def traced_like_eager_and_sdpa(build, x, mask, new: int) -> None:
    """Compiled static generation through sparse_attn of the model ``build()`` makes (transformers' eager attention)
    against the same model uncompiled on eager attention (equal tokens, logits within 1e-5), and compiled on sdpa: no
    more graphs, none reading the cache's ints more often."""
    ref = _generate(build(), x, mask, new=new)
    sdpa = build()
    sdpa.set_attn_implementation("sdpa")
    sdpa_graphs, _ = compiled_generation(sdpa, x, mask, new)
    model = build()
    enable(model, SparseAttnConfig())
    graphs, got = compiled_generation(model, x, mask, new)
    assert 1 <= len(graphs) <= len(sdpa_graphs) and sum(graphs) <= sum(sdpa_graphs), (graphs, sdpa_graphs)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def tiny_gemma3():
    """A tiny Gemma 3 text model: sliding-window and full-attention layers mixed (generate() makes one mask per layer
    type, which the model takes as they are: no second mask call of its own, unlike Mistral)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                           max_position_embeddings=512, attn_implementation="eager", pad_token_id=0,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention"])
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("lengths,new", [([10, 7, 4], 16), ([30], 6)])
def test_a_model_of_mixed_layers_traces_whole_too(lengths, new):
    """Gemma 3's mixed layers, rolling during generation (padded) and rolled from the prompt (one prompt): traced
    whole, no more graphs than sdpa's, eager attention's tokens and logits."""
    x, mask = left_padded(lengths, max(lengths), seed=5)
    if len(lengths) == 1:
        mask = None
    traced_like_eager_and_sdpa(tiny_gemma3, x, mask, new)


def _family(name: str):
    """A builder of a tiny model of another family with sliding-window layers: Qwen 2 (its first two layers sliding,
    ``max_window_layers``), Phi 3 (all), Cohere 2 (three sliding, one full)."""
    import transformers as tf
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, attn_implementation="eager", pad_token_id=0,
                 sliding_window=WINDOW)
    cls, cfg = {
        "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(use_sliding_window=True, max_window_layers=2, **shape)),
        "phi3": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(**shape)),
        "cohere2": lambda: (tf.Cohere2ForCausalLM, tf.Cohere2Config(
            head_dim=16, layer_types=["sliding_attention"] * 3 + ["full_attention"], **shape)),
    }[name]()

    def build():
        torch.manual_seed(0)
        return cls(cfg).eval()
    return build


@pytest.mark.parametrize("name", ["qwen2", "phi3", "cohere2"])
def test_other_families_with_sliding_window_layers_trace_whole_too(name):
    """Rolling during generation, padded, on three more families: traced whole, no more graphs than sdpa's, eager
    attention's tokens and logits."""
    lengths, new = CASES["rolling during generation, padded"]
    x, mask = left_padded(lengths, max(lengths), seed=5)
    traced_like_eager_and_sdpa(_family(name), x, mask, new)


def test_compiled_through_inductor_too():
    """The same case rolling during generation through inductor (the GPU's backend, on the CPU here, without CUDA
    graphs): a first version compared two bool tensors with != in the traced mask, which Dynamo's eager backend runs
    but inductor's value-range analysis fails on (seen on the H200)."""
    from transformers import CompileConfig
    lengths, new = CASES["rolling during generation, padded"]
    x, mask = left_padded(lengths, max(lengths), seed=5)
    ref = _generate(tiny_mistral(), x, mask, new=new)
    model = tiny_mistral()
    enable(model, SparseAttnConfig())
    config = CompileConfig(backend="inductor", fullgraph=True, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    got = _generate(model, x, mask, config, new)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_patterns_placed_by_position_refuse_a_rolled_buffer_under_compile():
    """A streaming layer (sinks: keys placed from token 0) cannot run on a buffer that dropped its first keys. Under
    compile its call leaves the trace for the eager attention function, which finds the key states' offset (they
    were registered when generate() made them) and refuses by name once the buffer rolls, as uncompiled. Key states
    made while traced (a model compiled by hand, its masks made inside the graph) are not registered: their SHIFTED
    keys alone make it refuse, without the offset."""
    model = tiny_mistral()
    enable(model, SparseAttnConfig(per_layer={1: ("streaming", {"window": 8, "num_sink": 4, **BLOCK})}))
    graphs = []
    config = counting_compile_config(graphs)
    config.fullgraph = False  # the streaming layer breaks the graph
    torch._dynamo.reset()
    with pytest.raises(NotImplementedError, match=r"streaming\(.*holds only keys 1\.\.20 \(the first 1 were"):
        _generate(model, ids(length=10), None, config, 15)
    layer = model.model.layers[1].self_attn
    q, k, v = (torch.randn(1, n, length, 16) for n, length in ((4, 1), (2, WINDOW), (2, WINDOW)))
    traced = _unpad.key_states(None, 1, WINDOW, WINDOW, "cpu", shifted=True)  # unregistered, as made traced
    with pytest.raises(NotImplementedError, match=r"streaming\(.*holds only its last 20 keys"):
        sat.sparse_attention_forward(layer, q, k, v, traced, scaling=0.25, sliding_window=WINDOW)
    sat.sparse_attention_forward(model.model.layers[0].self_attn, q, k, v, traced, scaling=0.25,
                                 sliding_window=WINDOW)  # a dense layer runs it


def _decode_by_hand(model, x, mask, steps: int, compiled: bool) -> torch.Tensor:
    """Greedy decoding with a StaticCache passed by hand and a growing 2-D mask, the decoding forward compiled
    (fullgraph, Dynamo's eager backend) or not: the model then makes its masks inside the graph, from the 2-D mask.
    Each step's last logits ``[steps, B, vocab]``."""
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=x.shape[1] + steps)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    forward = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
    logits = []
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            out = forward(token, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("lengths,steps", [([22, 10, 21], 4), ([10, 7, 4], 14)])
def test_a_decoding_forward_compiled_by_hand_traces_its_sliding_mask(lengths, steps):
    """A model compiled by hand, fed a growing 2-D padding mask, makes its sliding-window masks inside the graph: the
    traced mask serves them (_traced._sliding_window; without it the mask breaks the graph), on a rolled buffer and
    rolling during the steps, with eager attention's logits."""
    x, mask = left_padded(lengths, max(lengths), seed=5)
    want = _decode_by_hand(tiny_mistral(), x, mask, steps, compiled=False)
    model = tiny_mistral()
    enable(model, SparseAttnConfig())
    torch._dynamo.reset()
    torch.testing.assert_close(_decode_by_hand(model, x, mask, steps, compiled=True), want, atol=1e-5, rtol=1e-5)


def _states(mask_function, batch=3, padding=None, q_offset=25, kv_offset=6):
    """The traced mask's answer for one decoding step of a rolled 20-slot buffer (query at position q_offset, keys
    from kv_offset), computed outside a trace."""
    handled, states = _traced.mask(batch, 1, WINDOW, q_offset, kv_offset, mask_function, padding, "cpu",
                                   {"local_size": WINDOW, "allow_is_causal_skip": False, "use_vmap": False})
    assert handled
    return states


def test_the_traced_mask_marks_a_rolled_buffer_shifted_and_refuses_other_mask_functions():
    """The window's own mask function: SHIFTED at real keys once the buffer dropped keys (REAL before), 0 at
    padding. A narrower window, or a function that drops a batch row, is not the causal mask over the buffer: its
    rows are REFUSED, which the traced attention fills with NaN (row_spans) and the host refuses by name
    (from_padding)."""
    plain = sliding_window_causal_mask_function(WINDOW)
    padding = torch.ones(3, 26, dtype=torch.bool)
    padding[1, :9] = False  # row 1: padding up to token 8, so slots 0..2 of keys 6..25
    states = _states(plain, padding=padding)
    want = torch.full((3, WINDOW), _unpad.SHIFTED, dtype=torch.int8)
    want[1, :3] = 0
    assert torch.equal(states, want)
    before = _states(plain, q_offset=12, kv_offset=0)  # keys from token 0, query at slot 12: later slots unwritten
    assert before[0, :13].eq(_unpad.REAL).all() and before[0, 13:].eq(_unpad.UNWRITTEN).all()
    assert _unpad.from_padding(states, 1) is not None and _unpad.shifted(states) and not _unpad.shifted(before)

    narrower = _states(sliding_window_causal_mask_function(5))
    assert narrower.eq(_unpad.REFUSED).all()
    not_row_1 = _states(and_masks(plain, lambda b, h, q, k: b != 1))
    assert not_row_1[1].eq(_unpad.REFUSED).all() and not_row_1[[0, 2]].eq(_unpad.SHIFTED).all()
    spans, drop, fill = _unpad.row_spans(not_row_1, 1, torch.float32)
    assert fill[:, 0, 0].isnan().tolist() == [False, True, False] and drop[1].all()
    with pytest.raises(NotImplementedError, match="row 1 was made by a sliding-window mask function that allows "
                                                  "other keys"):
        _unpad.from_padding(not_row_1, 1)


def test_the_eager_mask_gives_key_states_only_at_steps_transformers_replays():
    """Eagerly, a rolled buffer's decoding step gets SHIFTED key states registered with its offset where transformers
    asks a mask it can replay (allow_is_causal_skip False: a compileable cache, one query), so that its compiled step
    reads them, in a [B, 1, 1, Lk] container (a model's own mask call passes 4-D masks through); a dynamic cache's
    step keeps the one-element band marker (no host read of a mask in the attention)."""
    kwargs = {"q_offset": 25, "kv_offset": 6, "mask_function": sliding_window_causal_mask_function(WINDOW),
              "local_size": WINDOW}
    marker = sat.sparse_attn_mask(2, 1, WINDOW, **kwargs)
    assert marker.untyped_storage().nbytes() == 1 and sat._key_offset(marker) == 6
    states = sat.sparse_attn_mask(2, 1, WINDOW, allow_is_causal_skip=False, **kwargs)
    assert states.shape == (2, 1, 1, WINDOW) and states.dtype == torch.int8 and states.eq(_unpad.SHIFTED).all()
    assert sat._key_offset(states) == 6 and _unpad.key_states_of(states).shape == (2, WINDOW)
    sat.check_mask(states, 1, WINDOW, True, WINDOW)


def test_a_padding_mask_given_back_is_not_cut_twice():
    """call_padding cuts a whole sequence's mask at kv_offset and keeps one that is already the call's keys (as wide
    as kv_length while kv_offset > 0: the interface's own answer, which the model makes its masks again from)."""
    whole = torch.arange(30)[None, :] >= 4  # 4 padding tokens, then real ones
    cut = _unpad.call_padding(whole, 20, 10)
    assert torch.equal(cut, whole[:, 10:30])
    assert _unpad.call_padding(cut, 20, 10) is cut
    assert torch.equal(_unpad.call_padding(whole[:, :26], 20, 0), whole[:, :20])
