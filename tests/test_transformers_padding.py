"""Padded and packed batches through the transformers integration (tiny random models, no download).

The reference for every row is the same model run on that row's real tokens alone, unpadded and unpacked:
a padded or packed batch must give each sequence exactly what it gets by itself, whatever the pattern.
"""
import pytest

transformers = pytest.importorskip("transformers")

import torch
from test_transformers_integration import BLOCK, VOCAB, ids, static_generation_like_eager, tiny_llama, tiny_mistral

from sparse_attn.integrations import _unpad
from sparse_attn.integrations import transformers as sat
from sparse_attn.integrations.transformers import SparseAttnConfig, enable

PATTERNS = [("dense", {}), ("local", {"window": 8}), ("streaming", {"window": 8, "num_sink": 3}),
            ("adaptive", {"topk": 0.5})]


def left_padded(lengths, width, seed=1):
    """(ids [B, width] with pad id 0 before each row's real tokens, the [B, width] attention mask)."""
    x = ids(batch=len(lengths), length=width, seed=seed)
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    return x, mask


@pytest.mark.parametrize("pattern,kwargs", PATTERNS)
def test_left_padded_forward_gives_each_row_what_it_gets_alone(pattern, kwargs):
    """Streaming's sinks are the sequence's first real tokens, not the padding: a row padded by 27 tokens
    equals that row run alone; adaptive predicts each row's layout from its own q / k. The layer stats sum
    the rows' own layouts. (position_ids as generate() makes them, so each row's q / k are its own.)"""
    model = tiny_llama(layers=2)
    cfg = enable(model, SparseAttnConfig(pattern, {**kwargs, **BLOCK}))
    lengths, width = [40, 29, 13], 40
    x, mask = left_padded(lengths, width)
    with torch.no_grad():
        out = model(x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        batch_stats = cfg.stats[1]
        blocks = 0
        for b, n in enumerate(lengths):
            alone = model(x[b:b + 1, width - n:]).logits
            torch.testing.assert_close(out[b, width - n:], alone[0], atol=2e-5, rtol=2e-5)
            blocks += cfg.stats[1].blocks
    assert (batch_stats.q_len, batch_stats.kv_len, batch_stats.blocks) == (width, width, blocks)


def test_right_padded_forward_and_its_gradients_match_the_rows_alone():
    """Training with right padding: the logits of the real tokens and the gradients of a loss over them
    equal the sum over rows run alone."""
    lengths, width = [24, 17, 6], 24
    x = ids(batch=3, length=width, seed=4)
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1

    def loss_of(model, batch_logits):
        return sum(batch_logits[b, :n].square().mean() for b, n in enumerate(lengths))

    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig("local", {"window": 8, **BLOCK}))
    loss_of(model, model(x, attention_mask=mask, use_cache=False).logits).backward()
    batched = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for b, n in enumerate(lengths):
        total = total + model(x[b:b + 1, :n], use_cache=False).logits[0].square().mean()
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(batched[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_left_padded_generate_matches_each_prompt_alone():
    """Batched greedy decoding of prompts of 30, 21 and 9 tokens (streaming, cache growing each step)
    produces each prompt's own continuation."""
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig("streaming", {"window": 8, "num_sink": 2, **BLOCK}))
    lengths, width = [30, 21, 9], 30
    x, mask = left_padded(lengths, width, seed=2)
    with torch.no_grad():
        batch = model.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False)
        for b, n in enumerate(lengths):
            alone = model.generate(x[b:b + 1, width - n:], max_new_tokens=12, do_sample=False)
            assert torch.equal(batch[b, width:], alone[0, n:]), b


def test_sliding_window_model_with_padding_matches_rows_alone():
    """Mistral's own window (20) with left padding, prefill and a cached decoding step that has dropped keys
    (local pattern: placed relative to the diagonal, so dropped keys do not matter)."""
    model = tiny_mistral(window=20)
    enable(model, SparseAttnConfig("local", {"window": 12, **BLOCK}))
    lengths, width = [41, 30], 41
    x, mask = left_padded(lengths, width, seed=3)
    with torch.no_grad():
        out = model(x, attention_mask=mask).logits
        pre = model(x[:, :40], attention_mask=mask[:, :40], use_cache=True)
        step = model(x[:, 40:], attention_mask=mask, past_key_values=pre.past_key_values, use_cache=True).logits
        for b, n in enumerate(lengths):
            alone = model(x[b:b + 1, width - n:]).logits
            torch.testing.assert_close(out[b, width - n:], alone[0], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(step[b, -1], alone[0, -1], atol=2e-5, rtol=2e-5)


def test_packed_rows_by_position_ids_match_the_sequences_alone():
    """Padding-free training (transformers' DataCollatorWithFlattening: one row, position_ids restarting at
    0): each sequence attends its own tokens only, forward and gradients; the mask interface hands over a
    one-element marker, not an [B, 1, L, L] mask."""
    seqs = [17, 9, 14]
    z = ids(batch=1, length=sum(seqs), seed=7)
    pos = torch.cat([torch.arange(n) for n in seqs])[None]
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig("streaming", {"window": 8, "num_sink": 2, **BLOCK}))
    made = []
    real = sat.sparse_attn_mask
    from transformers.masking_utils import AttentionMaskInterface
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(AttentionMaskInterface._global_mapping, sat.NAME,
                   lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
        out = model(z, position_ids=pos, use_cache=False).logits
    assert len(made) == 1 and made[0].untyped_storage().nbytes() == 1
    out.square().mean().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total, s = 0, 0
    for n in seqs:
        alone = model(z[:, s:s + n], use_cache=False).logits
        torch.testing.assert_close(out[0, s:s + n], alone[0], atol=2e-5, rtol=2e-5)
        total = total + alone.square().sum() / out.numel()
        s += n
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_flash_attention_offsets_run_packed_and_must_agree_with_position_ids():
    """cu_seq_lens_q / cu_seq_lens_k (FlashAttention's keyword arguments) give the same result as position_ids;
    offsets naming other sequences than position_ids, one without the other, or several rows are refused."""
    seqs = [12, 20]
    z = ids(batch=1, length=sum(seqs), seed=8)
    pos = torch.cat([torch.arange(n) for n in seqs])[None]
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig("local", {"window": 8, **BLOCK}))
    fa = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 20, "max_length_k": 20}
    with torch.no_grad():
        by_pos = model(z, position_ids=pos, use_cache=False).logits
        by_offsets = model(z, use_cache=False, **fa).logits
        both = model(z, position_ids=pos, use_cache=False, **fa).logits
        # without position_ids the rotary positions run on across the row: equal up to rounding (RoPE is relative)
        torch.testing.assert_close(by_offsets, by_pos, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(both, by_pos, atol=0, rtol=0)
        other = torch.tensor([0, 16, 32], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"name sequences of \[16, 16\].*gives \[12, 20\]"):
            model(z, position_ids=pos, use_cache=False, cu_seq_lens_q=other, cu_seq_lens_k=other)
        with pytest.raises(ValueError, match="only one of cu_seq_lens_q / cu_seq_lens_k"):
            model(z, use_cache=False, cu_seq_lens_q=cu)
        with pytest.raises(ValueError, match="packed in one row, but the batch has 2 rows"):
            model(torch.cat([z, z]), use_cache=False, **fa)


def test_rows_without_real_queries_give_zeros():
    """An all-padding row, and rows whose real tokens all lie before a decoding step's query (right padding),
    have no sequence: their outputs are zeros, and the other rows are unaffected."""
    q = torch.randn(3, 4, 1, 16)
    k, v = torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1] = 0         # all padding
    mask[2, 6:] = 0     # right padding: the query (position 9) is padding
    module = torch.nn.Module()
    out, _ = sat.sparse_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert out.shape == (3, 1, 4, 16)
    assert bool((out[1:] == 0).all())
    ref, _ = sat.sparse_attention_forward(module, q[:1], k[:1], v[:1], None, scaling=0.25)
    torch.testing.assert_close(out[:1], ref, atol=1e-6, rtol=1e-6)


def test_from_padding_places_queries_bottom_right():
    """Three rows of 10 keys, 4 queries (positions 6..9): left padding 3, right padding after 8, none."""
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, 8:] = False
    p = _unpad.from_padding(mask, 4)
    assert (p.q_lens, p.k_lens) == ((4, 2, 4), (7, 8, 10))
    assert p.cu_q.tolist() == [0, 4, 6, 10] and p.cu_k.tolist() == [0, 7, 15, 25]
    q_rows, q_pos = p.token_ranges(False, "cpu")
    assert q_rows.tolist() == [0] * 4 + [1] * 2 + [2] * 4 and q_pos.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3]
    assert p.token_ranges(True, "cpu")[1].tolist() == list(range(3, 10)) + list(range(8)) + list(range(10))
    assert _unpad.from_padding(torch.ones(2, 5), 5) is None
    x = torch.randn(3, 2, 4, 8)
    packed = p.pack(x, keys=False)
    assert torch.equal(p.unpack(packed)[1, :2], x[1, :, :2].transpose(0, 1))
    assert bool((p.unpack(packed)[1, 2:] == 0).all())


def _padding_by_rows(mask: torch.Tensor, q_len: int):
    """from_padding's answer read row by row on the host: (rows, q_starts, q_lens, k_starts, k_lens), or "gap" when a
    row's real tokens are not one run; ``mask`` bool or int8 key states (UNWRITTEN slots last)."""
    kv_len = int((mask >= 0).sum(1).max()) if mask.dtype != torch.bool else mask.shape[1]
    q0, got = kv_len - q_len, ([], [], [], [], [])
    for row, values in enumerate(mask.tolist()):
        real = [j for j, x in enumerate(values) if x > 0]
        if real and real != list(range(real[0], real[-1] + 1)):
            return "gap"
        if real and real[-1] + 1 > max(real[0], q0):
            qs = max(real[0], q0)
            for part, value in zip(got, (row, qs - q0, real[-1] + 1 - qs, real[0], len(real))):
                part.append(value)
    return tuple(tuple(part) for part in got)


def test_from_padding_matches_a_row_by_row_reading():
    """Random left / right / both-sided padding, rows with no real token or no real query, key states with unwritten
    slots, and rows with a gap (refused, naming the row and its first and last real positions)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        batch, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        written = width if trial % 3 else int(torch.randint(1, width + 1, (1,), generator=g))
        mask = torch.zeros(batch, width, dtype=torch.int8)
        for row in range(batch):
            a, b = sorted(torch.randint(0, written + 1, (2,), generator=g).tolist())
            mask[row, a:b] = 1
            if trial % 7 == 0 and b - a > 2:
                mask[row, a + 1] = 0  # a gap
        mask[:, written:] = _unpad.UNWRITTEN
        if written == width and trial % 2:
            mask = mask > 0  # a bool padding mask
        q_len = int(torch.randint(1, written + 1, (1,), generator=g))
        want = _padding_by_rows(mask, q_len)
        if want == "gap":
            with pytest.raises(NotImplementedError, match="has padding between real tokens"):
                _unpad.from_padding(mask, q_len)
            continue
        p = _unpad.from_padding(mask, q_len)
        if bool((mask > 0).all()):
            assert p is None
            continue
        assert (p.rows, p.q_starts, p.q_lens, p.k_starts, p.k_lens) == want, (mask, q_len)
        assert p.kv_len == written and p.cu_q.tolist() == [0, *torch.tensor(p.q_lens, dtype=torch.int64).cumsum(0)]
    gap = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 1]], dtype=torch.bool)
    with pytest.raises(NotImplementedError, match=r"row 1 has padding between real tokens \(2 real tokens spread over "
                                                  r"positions 1..3\)"):
        _unpad.from_padding(gap, 1)


def test_the_mask_interface_reads_the_padding_once_for_every_layer(monkeypatch):
    """The padding marker carries the Packing the mask interface read (one host read a forward): the attention
    function finds it for every layer and reads nothing again, a marker changed in place is read again, and a
    padding with a gap is refused by the attention function only (a mask no layer runs raises nothing)."""
    from transformers.masking_utils import causal_mask_function
    pad = torch.ones(3, 12, dtype=torch.bool)
    pad[1, :5] = False
    pad[2, 9:] = False
    reads = []
    real_read = _unpad._read_rows
    monkeypatch.setattr(_unpad, "_read_rows", lambda mask: reads.append(1) or real_read(mask))
    marker = sat.sparse_attn_mask(3, 1, 12, q_offset=11, mask_function=causal_mask_function, attention_mask=pad)
    assert len(reads) == 1
    packing = sat._mask_packing(marker, 1, 12)
    assert packing is sat._mask_packing(marker, 1, 12) and len(reads) == 1
    assert (packing.rows, packing.q_lens, packing.k_lens) == ((0, 1), (1, 1), (12, 7))
    marker[0, 11] = False  # changed in place: the kept Packing is not used
    assert sat._mask_packing(marker, 1, 12).rows == (1,) and len(reads) == 2
    gap = pad.clone()
    gap[0, 4] = False
    refused = sat.sparse_attn_mask(3, 1, 12, q_offset=11, mask_function=causal_mask_function, attention_mask=gap)
    with pytest.raises(NotImplementedError, match="row 0 has padding between real tokens"):
        sat._mask_packing(refused, 1, 12)


def test_mask_interface_returns_the_padding_and_keeps_refusing_custom_functions():
    """No padding: None (plain causal). Padding: the [B, Lk] padding of the call's keys, registered with the
    call's band so another call cannot take it. A custom mask function with padding is still materialised,
    and refused by the attention function."""
    from transformers.masking_utils import and_masks, causal_mask_function
    pad = torch.ones(2, 12, dtype=torch.bool)
    assert sat.sparse_attn_mask(2, 12, 12, mask_function=causal_mask_function, attention_mask=pad) is None
    pad[1, :5] = False
    got = sat.sparse_attn_mask(2, 12, 12, mask_function=causal_mask_function, attention_mask=pad)
    assert got.shape == (2, 12) and torch.equal(got, pad) and got is not pad
    sat.check_mask(got, 12, 12, True, None)
    with pytest.raises(NotImplementedError, match="over q_len=12, kv_len=12"):
        sat.check_mask(got, 12, 12, False, None)
    odd = and_masks(causal_mask_function, lambda b, h, q, kv: (q - kv) != 3)
    materialised = sat.sparse_attn_mask(2, 12, 12, mask_function=odd, attention_mask=pad)
    with pytest.raises(NotImplementedError, match="got a padded or custom mask"):
        sat.check_mask(materialised, 12, 12, True, None)



def _packed_causal(seqs):
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
    )
    pos = torch.cat([torch.arange(n) for n in seqs])[None]
    return and_masks(causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(pos)))


def test_a_packed_mask_with_one_key_more_is_materialised_and_refused(monkeypatch):
    """The sequences are read off the mask at (i, i - 1) only, so the whole mask is then checked against them
    (a few rows a chunk here): one extra key across sequences, invisible to that probe, falls back to the
    materialised mask, which the attention function refuses."""
    from transformers.masking_utils import or_masks
    monkeypatch.setattr(sat, "MASK_CHUNK", 3 * 40)
    seqs = [15, 10, 15]
    plain = sat.sparse_attn_mask(1, 40, 40, mask_function=_packed_causal(seqs))
    assert plain.untyped_storage().nbytes() == 1
    assert _unpad.from_segments(sat._PACKED[0][1], 40).q_lens == (15, 10, 15)
    leak = or_masks(_packed_causal(seqs), lambda b, h, q, kv: (q == 37) & (kv == 2))
    got = sat.sparse_attn_mask(1, 40, 40, mask_function=leak)
    assert got.untyped_storage().nbytes() >= 40 * 40 and bool(got[0, 0, 37, 2])
    with pytest.raises(NotImplementedError, match="got a padded or custom mask"):
        sat.check_mask(got, 40, 40, True, None)


def test_packed_rows_on_a_sliding_window_model_match_the_sequences_alone():
    """Mistral's window (20) inside packed sequences of 30, 9 and 25 tokens: the band within each sequence."""
    model = tiny_mistral(window=20)
    enable(model, SparseAttnConfig("dense", BLOCK))
    seqs = [30, 9, 25]
    z = ids(batch=1, length=sum(seqs), seed=9)
    pos = torch.cat([torch.arange(n) for n in seqs])[None]
    with torch.no_grad():
        out = model(z, position_ids=pos, use_cache=False).logits
        s = 0
        for n in seqs:
            torch.testing.assert_close(out[0, s:s + n], model(z[:, s:s + n], use_cache=False).logits[0],
                                       atol=2e-5, rtol=2e-5)
            s += n


def test_padded_encoder_batch_matches_eager_attention():
    """A bidirectional encoder (BERT) with right padding: the real tokens' states equal transformers' eager
    attention under the padding mask (each row's real tokens attend each other, no padding key)."""
    from transformers import BertConfig, BertModel
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    x = ids(batch=3, length=30, seed=11)
    mask = torch.ones_like(x)
    mask[1, 20:] = 0
    mask[2, 7:] = 0
    with torch.no_grad():
        ref = model(x, attention_mask=mask).last_hidden_state
        enable(model, SparseAttnConfig("dense", BLOCK))
        out = model(x, attention_mask=mask).last_hidden_state
    for b, n in enumerate([30, 20, 7]):
        torch.testing.assert_close(out[b, :n], ref[b, :n], atol=2e-5, rtol=2e-5)


def test_dense_block_counts_match_the_causal_layouts():
    """The stats of dense / causal packed calls are counted without layouts: the blocks of the causal
    layouts each sequence would run, summed, for any lengths (Lq above Lk included)."""
    import random

    from sparse_attn import patterns
    rng = random.Random(3)
    for _ in range(60):
        lens = [(rng.randint(1, 700), rng.randint(1, 900)) for _ in range(2)]
        bq, bk = rng.choice([16, 64, 128]), rng.choice([16, 32, 128])
        layouts = [patterns.causal(nq, nk, block_q=bq, block_k=bk) for nq, nk in lens]
        q_lens, k_lens = zip(*lens)
        visited, grid, baseline = sat._dense_counts(q_lens, k_lens, bq, bk, True, True)
        assert visited == baseline == sum(lay.num_blocks for lay in layouts), (lens, bq, bk)
        assert grid == sum(lay.num_q_blocks * lay.num_kv_blocks for lay in layouts)
        assert sat._dense_counts(q_lens, k_lens, bq, bk, False, False) == (grid, grid, grid)


@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("streaming", {"window": 8, "num_sink": 2})])
def test_static_cache_generation_matches_the_dynamic_cache(pattern, kwargs):
    """generate(cache_implementation="static"): the key buffer runs past the last query, and its unwritten
    slots are treated as padding; one prompt and a left-padded batch give the dynamic cache's tokens and
    logits."""
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig(pattern, {**kwargs, **BLOCK}))
    x, mask = left_padded([30, 21, 9], 30, seed=12)
    gen = {"max_new_tokens": 10, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.no_grad():
        for rows, m in ((x[:1], None), (x, mask)):
            dynamic = model.generate(rows, attention_mask=m, **gen)
            static = model.generate(rows, attention_mask=m, cache_implementation="static", **gen)
            assert torch.equal(static.sequences, dynamic.sequences)
            for a, b in zip(static.logits, dynamic.logits):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern,kwargs", [("dense", {}), ("streaming", {"window": 8, "num_sink": 2})])
def test_compiled_static_cache_generation_matches_eager(pattern, kwargs):
    """On CUDA, generate(cache_implementation="static") compiles the decoding step by itself. Traced, the
    attention function's host-side state (the last mask's Packing, a static cache's query end) froze into
    the graph: with the attention function traced, a left-padded batch's logits came out 0.44 off (the
    compile forced here on the CPU, with Dynamo's eager backend: the trace alone shows it). The attention
    and mask functions now run eagerly inside a compiled model, and its logits are the uncompiled ones."""
    from transformers import CompileConfig
    model = tiny_llama(layers=2)
    enable(model, SparseAttnConfig(pattern, kwargs))
    x, mask = left_padded([30, 21, 9], 30)
    gen = {"attention_mask": mask, "max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False,
           "cache_implementation": "static", "output_logits": True, "return_dict_in_generate": True}
    compile_config = CompileConfig(backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles by itself only on accelerators
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(x, disable_compile=True, **gen)
        compiled = model.generate(x, compile_config=compile_config, **gen)
    assert hasattr(model, "_compiled_call")  # the step was compiled
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("padded", [True, False])
def test_static_cache_on_sliding_window_layers_while_the_window_holds_every_key(padded, compiled):
    """A static cache's sliding-window layer (transformers' StaticSlidingWindowLayer: 20 slots, filled from token 0,
    then rolled) was refused until its buffer filled. While the window holds every written key the layer's mask is
    the causal one, so the buffer runs as a full-attention layer's does: prompts of 10 / 7 / 4 tokens (left-padded,
    or the first alone) and 10 new tokens fill it to its last slot. Tokens and logits equal transformers' eager
    attention's; compiled (the step traced, the sliding mask at a graph break), the eager generate's. (Rolled, a
    batch without padding keeps the band marker: test_transformers_integration's
    test_static_cache_on_a_sliding_window_model_runs_past_its_window.)"""
    from transformers import CompileConfig
    x, mask = left_padded([10, 7, 4], 10, seed=5)
    if not padded:
        x, mask = x[:1], None
    gen = {"attention_mask": mask, "max_new_tokens": 10, "min_new_tokens": 10}
    model, eager = static_generation_like_eager(x, {**gen, "disable_compile": True})
    if compiled:
        config = CompileConfig(backend="eager")
        config._compile_all_devices = True  # transformers compiles by itself only on accelerators
        torch._dynamo.reset()
        with torch.no_grad():
            got = model.generate(x, compile_config=config, do_sample=False, cache_implementation="static",
                                 output_logits=True, return_dict_in_generate=True, **gen)
        assert hasattr(model, "_compiled_call")
        assert torch.equal(got.sequences, eager.sequences)
        for a, b in zip(got.logits, eager.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths,new", [([10, 7, 4], 15), ([22, 10, 21], 4)])
def test_a_padded_batch_on_a_rolled_sliding_window_buffer(lengths, new):
    """Once a static sliding-window buffer rolls (keys from token kv_offset > 0), a padded batch's mask is a padding
    marker, and generate() hands it to the model's forward, which makes the masks again from it: read as a padding
    mask it was cut at kv_offset once more, one slot off, and the logits came out 2-4 off with no error (prompts
    longer than the window did so before this session too). Given back, the marker is now this call's answer as it
    stands. Prompts of 10 / 7 / 4 tokens with 15 new ones, and of 22 / 10 / 21 (longer than the 20-key window)
    with 4: tokens and logits equal transformers' eager attention's."""
    x, mask = left_padded(lengths, max(lengths), seed=5)
    static_generation_like_eager(x, {"attention_mask": mask, "max_new_tokens": new, "min_new_tokens": new,
                                     "disable_compile": True})


def test_a_sliding_mask_is_the_causal_one_only_where_it_holds_every_key():
    """The mask interface answers a sliding-window mask function as the causal one when its window holds every
    key written so far (key states on a static buffer, None without padding) and only after evaluating it: a
    function narrower than its ``local_size`` claims, or keys past the window, keep the old answers."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    states = sat.sparse_attn_mask(2, 1, 20, q_offset=11, mask_function=sliding_window_causal_mask_function(20),
                                  local_size=20)  # a decoding step at position 11 of a 20-slot buffer
    causal = sat.sparse_attn_mask(2, 1, 20, q_offset=11, mask_function=causal_mask_function)
    assert torch.equal(states, causal) and states.tolist()[0] == [1] * 12 + [-1] * 8
    assert sat.sparse_attn_mask(1, 12, 12, mask_function=sliding_window_causal_mask_function(20),
                                local_size=20) is None
    with pytest.raises(NotImplementedError, match="pre-allocated caches"):  # it sees 5 keys, not 20
        sat.sparse_attn_mask(2, 1, 20, q_offset=11, mask_function=sliding_window_causal_mask_function(5),
                             local_size=20)
    band = sat.sparse_attn_mask(1, 30, 30, mask_function=sliding_window_causal_mask_function(20), local_size=20)
    assert band is not None and band.untyped_storage().nbytes() == 1  # the band marker, as before


def test_masks_made_in_inference_mode_are_checked():
    """Tensors made under torch.inference_mode have no version counter: check_mask read it to remember the
    last plain mask and failed (RuntimeError) on a plain 4-D causal mask; it now checks such masks each time,
    and a padded one still runs."""
    with torch.inference_mode():
        plain = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
        padding = torch.ones(2, 12, dtype=torch.long)
        padding[1, :4] = 0
        q, k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
        for _ in range(2):
            sat.check_mask(plain, 12, 12, True, None)
        out, _ = sat.sparse_attention_forward(torch.nn.Module(), q, k, v, padding, scaling=0.25)
    assert bool((out[1, :4] == 0).all()) and torch.isfinite(out).all()


def test_mixed_layers_read_each_padding_mask_once_a_forward(monkeypatch):
    """Gemma 3's sliding-window and full-attention layers get one padding mask each a forward, and its layers alternate
    between them. Eager padded generate() gives transformers' eager attention's tokens and logits, and each forward
    reads the padding twice, in the mask interface (one read a mask), never in a layer: the attention function's
    one-mask cache used to read one mask's rows again at every alternation."""
    from test_traced_sliding_window import tiny_gemma3
    x, mask = left_padded([10, 7, 4], 10, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ref = tiny_gemma3().generate(x, **kwargs)
        model = tiny_gemma3()
        enable(model, SparseAttnConfig())
        reads, forwards = [], []
        real_read = _unpad._read_rows
        monkeypatch.setattr(_unpad, "_read_rows", lambda m: reads.append(1) or real_read(m))
        model.model.register_forward_hook(lambda *_: forwards.append(1))
        got = model.generate(x, **kwargs)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(forwards) == 6 and len(reads) == 2 * len(forwards), (len(reads), len(forwards))
