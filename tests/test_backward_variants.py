"""The backward's two schedules under TRITON_INTERPRET=1: "fused" (dQ by atomic adds inside the dK/dV
kernel) and "split" (a separate dQ kernel, deterministic; the default), and the row-terms pre-pass.
Both schedules, with block indices loaded per iteration or read in register chunks, must meet rule 3
against the fp64 oracle on GQA, odd lengths, partial blocks, varlen."""
from __future__ import annotations

import math
import os

import pytest
import torch

from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term, window_term
from sparse_attn.ops.block_sparse import launch
from sparse_attn.testing import (assert_layout_grads_close_to_oracle, grads_per_launch_setting, launch_import_stderr,
                                 random_packed_qkv, split_and_fused_grads)

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]


# (schedule, IDX_CHUNK[, dK/dV issue order or "deep"]): block indices per iteration (0), or in register
# chunks of 2 blocks, so the tiny layouts here span several chunks (the default chunk, 64, would hold
# every row in one); "dv-first": dV issued before dP (launch.BWD_DKDV_ORDER), the default before the
# fourteenth session; "deep": per-iteration index loads pipelined two levels deep (launch.BWD_IDX_DEEP
# "1"; "auto" keeps them to head dim 128, which these tests do not use)
@pytest.fixture(params=[("fused", 2), ("split", 2), ("fused", 0), ("split", 0), ("split", 2, "dv-first"),
                        ("split", 2, "deep")],
                ids=lambda p: "-".join([p[0], f"chunk{p[1]}", *p[2:]]))
def variant(request, monkeypatch):
    schedule, chunk, *extra = request.param
    monkeypatch.setattr(launch, "BWD_VARIANT", schedule)
    monkeypatch.setattr(launch, "BWD_IDX_CHUNK", chunk)
    monkeypatch.setattr(launch, "BWD_DKDV_ORDER", "dv-first" if extra == ["dv-first"] else "dp-first")
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "1" if extra == ["deep"] else "0")
    return "-".join([schedule, f"chunk{chunk}", *extra])


def _qkv(hq, hkv, lq, lk, d, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(1, hq, lq, d), mk(1, hkv, lk, d), mk(1, hkv, lk, d)


def _log2_lse(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(lse == float("-inf"), float("inf"), lse / math.log(2))


def test_row_terms_dense_are_padded_to_whole_query_blocks():
    g = torch.Generator().manual_seed(5)
    out, do = (torch.randn(2, 3, 37, 40, generator=g).half() for _ in range(2))
    lse = torch.randn(2, 3, 37, generator=g)
    lse[..., 5] = float("-inf")  # a row that sees no key: +inf, so its probabilities are 0
    delta, lse2, strides, starts = launch._row_terms(out, do, lse, 16)
    assert delta.shape == lse2.shape == (2, 3, 48) and delta.dtype == lse2.dtype == torch.float32
    assert strides == delta.stride()[:2] and starts is None
    torch.testing.assert_close(delta[..., :37], (out.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2[..., :37], _log2_lse(lse), rtol=1e-6, atol=1e-6)
    # rows past the end (read unmasked by the dK/dV loop) give probabilities 0 and no delta
    assert (delta[..., 37:] == 0).all() and (lse2[..., 37:] == float("inf")).all()


@pytest.mark.parametrize("seq_step", [1, 2], ids=["cu_seqlens", "pairs"])
def test_row_terms_packed_start_each_sequence_at_a_block_boundary(seq_step):
    g = torch.Generator().manual_seed(6)
    out, do = (torch.randn(60, 3, 40, generator=g).half() for _ in range(2))
    lse = torch.randn(3, 60, generator=g)
    lse[1, 20] = float("-inf")
    if seq_step == 1:  # sequences [0, 19), [19, 20), [20, 53)
        spans = [(0, 19), (19, 20), (20, 53)]
        cu = torch.tensor([0, 19, 20, 53], dtype=torch.int32)
    else:  # grouped attention's pairs: any order, gaps between query slices
        spans = [(30, 60), (2, 19), (19, 19)]
        cu = torch.tensor([x for sp in spans for x in sp], dtype=torch.int32)
    delta, lse2, strides, starts = launch._row_terms(out, do, lse, 16, cu, seq_step, max(e - b for b, e in spans))
    padded = [-(-(e - b) // 16) * 16 for b, e in spans]
    assert starts.tolist() == [sum(padded[:i]) for i in range(len(spans))]
    assert strides == (0, delta.stride(0)) and delta.stride(0) % 16 == 0 and delta.shape[1] >= sum(padded)
    want = (out.float() * do.float()).sum(-1).transpose(0, 1)
    for (b, e), s0, n in zip(spans, starts.tolist(), padded):
        torch.testing.assert_close(delta[:, s0:s0 + e - b], want[:, b:e], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse2[:, s0:s0 + e - b], _log2_lse(lse[:, b:e]), rtol=1e-6, atol=1e-6)
        assert (delta[:, s0 + e - b:s0 + n] == 0).all() and (lse2[:, s0 + e - b:s0 + n] == float("inf")).all()


@pytest.mark.parametrize("mask,lq,lk,hq,hkv", [
    (ElementMask((causal_term(),)), 50, 37, 4, 2),   # Lq > Lk: leading rows see nothing; GQA
    (ElementMask((window_term(11, 0),)), 45, 45, 3, 1),  # MQA, partial blocks on both window edges
])
def test_backward_meets_rule3(variant, mask, lq, lk, hq, hkv):
    from sparse_attn.ops.block_sparse import attention_op
    layout = BlockLayout.from_mask(mask, q_len=lq, kv_len=lk, block_q=16, block_k=16)
    q, k, v = _qkv(hq, hkv, lq, lk, 24, seed=lq + lk)
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)


def test_rows_with_very_negative_lse_keep_finite_gradients(variant):
    """Every score of a row far below 0 puts its LSE below -88. A key tile crossing the sequence end
    loads its missing keys as zeros, score 0, so P = 2**-lse2 overflowed to inf there and inf * 0 made
    NaN in dQ (both schedules; tests/gpu/test_fuzz_gpu.py found it). Those keys' P is now 0."""
    from sparse_attn.ops.block_sparse import attention_op
    lq, lk, d = 40, 5, 16  # 5 keys: the 16-key tile crossing the end has 11 missing keys
    g = torch.Generator().manual_seed(3)
    q = (6 + torch.rand(1, 2, lq, d, generator=g)).half().requires_grad_(True)
    k = -(6 + torch.rand(1, 2, lk, d, generator=g)).half()
    k = k.requires_grad_(True)
    v = torch.randn(1, 2, lk, d, generator=g).half().requires_grad_(True)
    # a two-sided window: its rule allows the missing keys too (a causal one would mask them anyway)
    layout = BlockLayout.from_mask(ElementMask((window_term(30, 30),)), q_len=lq, kv_len=lk, block_q=16, block_k=16)
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    seen = torch.isfinite(lse)
    assert seen.any() and (lse[seen] < -100).all()  # scores ~ -6.5**2 * 16 / 4 = -169: past the -88 line
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)


def test_varlen_backward_matches_fp64_reference(variant):
    import sparse_attn
    from sparse_attn import varlen
    from sparse_attn.ops.block_sparse import varlen_attention_op
    q_lens = k_lens = [19, 1, 33]
    hq, hkv, d = 4, 2, 16
    q, k, v = random_packed_qkv(sum(q_lens), sum(k_lens), hq, hkv, d, seed=11)
    cu = torch.tensor([0, 19, 20, 53], dtype=torch.int32)
    pattern = lambda lq, lk: BlockLayout.from_mask(ElementMask((window_term(12, 0),)), q_len=lq, kv_len=lk,  # noqa: E731
                                                   block_q=16, block_k=16)
    stacked = varlen.stack(varlen.build_layouts(q_lens, k_lens, None, pattern, causal=True), 33, 33, hq)
    out = varlen_attention_op(q, k, v, stacked, cu, cu, 33, 33, torch.tensor(k_lens))
    do = torch.randn_like(out)
    out.backward(do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    sparse_attn.varlen_attention(qd, kd, vd, cu, cu, 33, 33, pattern=pattern, causal=True).backward(do.double())
    for name, a, b in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err < 1e-2, f"{variant} {name}: max error {err}"


def test_split_is_bitwise_reproducible_and_fused_agrees_with_it():
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=40, block_q=16, block_k=16)
    q, k, v = _qkv(2, 1, 40, 40, 16, seed=3)
    do = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(4)).half()
    first, second, fused = split_and_fused_grads(q, k, v, layout, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(fused[1], first[1]) and torch.equal(fused[2], first[2])  # dK/dV: same code path
    torch.testing.assert_close(fused[0], first[0], rtol=2e-3, atol=2e-3)  # dQ: another summation order


def _mixed_rows_layout(n_heads: int) -> BlockLayout:
    """60 tokens, 16-token blocks, heads with different rows (the first n_heads of): a window
    (contiguous runs, masked edges), rows with gaps, their mirror image, every block."""
    mask = ElementMask((window_term(20, 0),))
    window = BlockLayout.from_mask(mask, q_len=60, block_q=16, block_k=16)._block_map()[0, 0]  # -1 full, 0 masked
    gapped = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    bm = torch.stack([window >= -1, gapped, gapped.flip(1), torch.ones_like(gapped)][:n_heads])[None]
    partial = torch.stack(([window >= 0] + [torch.zeros_like(gapped)] * 3)[:n_heads])[None]
    return BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=60, kv_len=60, partial=partial, mask=mask)


def _grads_per_setting(attr: str, values: tuple, hq: int, hkv: int, seed: int) -> dict:
    """{value: (dq, dk, dv)} of one backward per value of launch.<attr>, same inputs and layout."""
    layout = _mixed_rows_layout(hq)
    q, k, v = _qkv(hq, hkv, 60, 60, 16, seed=seed)
    do = torch.randn(1, hq, 60, 16, generator=torch.Generator().manual_seed(seed + 1)).half()
    return dict(zip(values, grads_per_launch_setting(q, k, v, layout, do, attr, values)))


def test_dkdv_issue_order_does_not_change_gradients():
    """The two issue orders of dV and dP (launch.BWD_DKDV_ORDER) compute the same products and sums in
    the same order: gradients bitwise equal. The rows: a window and a head whose rows have gaps."""
    grads = _grads_per_setting("BWD_DKDV_ORDER", ("dp-first", "dv-first"), hq=2, hkv=1, seed=5)
    assert all(torch.isfinite(g).all() for g in grads["dp-first"])
    assert all(torch.equal(a, b) for a, b in zip(grads["dp-first"], grads["dv-first"]))


@pytest.mark.parametrize("hkv", [4, 2])
def test_dkdv_head_loop_placement_does_not_change_gradients(hkv):
    """The dK/dV kernel's loop over a kv head's query heads inside or outside the two phases
    (launch.BWD_DKDV_HEADS) visits the same (head, block) pairs. One query head per kv head: the
    same order, gradients bitwise equal. Two (GQA): only dK/dV's fp32 summation order differs, so
    they agree to rounding, and dQ (another kernel) is bitwise equal."""
    grads = _grads_per_setting("BWD_DKDV_HEADS", ("inside", "outside"), hq=4, hkv=hkv, seed=7)
    (dq_in, dk_in, dv_in), (dq_out, dk_out, dv_out) = grads["inside"], grads["outside"]
    assert all(torch.isfinite(g).all() for g in grads["inside"])
    assert torch.equal(dq_in, dq_out)
    if hkv == 4:
        assert torch.equal(dk_in, dk_out) and torch.equal(dv_in, dv_out)
    else:
        torch.testing.assert_close(dk_in, dk_out, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(dv_in, dv_out, rtol=2e-3, atol=2e-3)


def test_unknown_dkdv_head_loop_placement_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_DKDV_HEADS", "middle")
    assert "SPARSE_ATTN_BWD_DKDV_HEADS must be 'auto', 'inside' or 'outside', got 'middle'" in stderr


def test_unknown_backward_variant_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD", "fast")
    assert "SPARSE_ATTN_BWD must be 'fused' or 'split'" in stderr


def test_unknown_dkdv_issue_order_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_DKDV_ORDER", "fast")
    assert "SPARSE_ATTN_BWD_DKDV_ORDER must be 'dp-first' or 'dv-first', got 'fast'" in stderr


@pytest.mark.parametrize("kind, lq, lk, hq, hkv", [
    ("dense", 70, 70, 2, 1),            # no element masks: both kernels walk the run by arithmetic
    ("block_diagonal", 96, 96, 2, 2),   # several runs, one per document
    ("causal", 50, 75, 2, 1),           # element masks, Lq < Lk bottom-right
    ("local", 90, 90, 4, 2),            # window; GQA
])
def test_contiguous_backward_walk_does_not_change_gradients(kind, lq, lk, hq, hkv):
    """On contiguous schedules the backward kernels walk each row's unmasked run by arithmetic
    (launch.BWD_CONTIGUOUS) instead of reading block indices: the same blocks in the same order, so
    gradients bitwise equal to the indexed walk, which the fp64 oracle checks elsewhere."""
    from sparse_attn import patterns
    from sparse_attn.ops.block_sparse import layout_inputs

    build = {"dense": lambda: patterns.dense(lq, lk, block_q=16, block_k=16),
             "block_diagonal": lambda: patterns.block_diagonal(lq, 32, block_q=16, block_k=16),
             "causal": lambda: patterns.causal(lq, lk, block_q=16, block_k=16),
             "local": lambda: patterns.local(lq, 48, block_q=16, block_k=16)}[kind]
    layout = build()
    ins = layout_inputs(layout, True)
    assert ins[5] and ins[10], "the layout's forward and transposed schedules must both be contiguous"
    assert (ins[1] > 1).any() and (ins[7] > 1).any(), "rows must have runs of unmasked blocks to walk"
    q, k, v = _qkv(hq, hkv, lq, lk, 16, seed=11)
    do = torch.randn(1, hq, lq, 16, generator=torch.Generator().manual_seed(12)).half()
    indexed, walked = grads_per_launch_setting(q, k, v, layout, do, "BWD_CONTIGUOUS", (False, True))
    assert all(torch.isfinite(g).all() for g in walked)
    assert all(torch.equal(a, b) for a, b in zip(indexed, walked))


def _forward_and_grads(call, q, k, v, do):
    """(out, lse, dq, dk, dv) of ``call(q, k, v)`` (returning out and lse) for the output gradient ``do``."""
    out, lse = call(q, k, v)
    return (out.detach(), lse, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("kind", ["causal", "causal-packed", "random-gqa"])
def test_reversed_row_order_changes_only_which_program_runs_a_tile(monkeypatch, kind):
    """launch.ROW_ORDER "reverse" hands the forward's and the dQ kernel's query tiles to the grid's
    programs last tile first (kernels._query_tile REVERSE; the default, "reverse-dq", the dQ
    kernel's only). Each tile's arithmetic is its own, so output, LSE and gradients are bitwise those
    of grid order; with 16-row blocks over 75 and 33 rows, a tile map off by one leaves a tile
    unwritten or writes a row twice. The wave orders, which place a walk by the program's position,
    are off here (they differ by position, not tile)."""
    from sparse_attn import patterns, varlen
    from sparse_attn.ops.block_sparse import attention_op, varlen_attention_op
    monkeypatch.setattr(launch, "FWD_WAVE", False)
    monkeypatch.setattr(launch, "BWD_WAVE", "0")
    if kind == "causal-packed":
        lens = [33, 5, 47]
        q, k, v = random_packed_qkv(sum(lens), sum(lens), 2, 1, 16, seed=21)
        cu = torch.tensor([0, 33, 38, 85], dtype=torch.int32)
        stacked = varlen.stack(varlen.build_layouts(lens, lens, None, None, causal=True, block=16),
                               47, 47, 2)
        call = lambda q, k, v: varlen_attention_op(q, k, v, stacked, cu, cu, 47, 47, torch.tensor(lens),  # noqa: E731
                                                   return_lse=True)
    else:
        hq, hkv, lq, lk = (2, 1, 75, 90) if kind == "causal" else (4, 2, 75, 75)
        q, k, v = _qkv(hq, hkv, lq, lk, 16, seed=21)
        layout = (patterns.causal(lq, lk, block_q=16, block_k=16) if kind == "causal" else
                  patterns.random(lq, density=0.5, heads=hq, block_q=16, block_k=16, seed=3))
        call = lambda q, k, v: attention_op(q, k, v, layout, return_lse=True)  # noqa: E731
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(22)).to(q.dtype)
    results = []
    for order in ("grid", "reverse", "reverse-dq"):
        monkeypatch.setattr(launch, "ROW_ORDER", order)
        results.append(_forward_and_grads(call, q, k, v, do))
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.isfinite(a).any(), f"{name}: nothing finite under grid order"
        assert torch.equal(a, b) and torch.equal(a, c), f"{kind} {name}: a reversed row order changed it"


def test_unknown_row_order_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(launch, "ROW_ORDER", "backwards")
    q, k, v = _qkv(1, 1, 16, 16, 16, seed=1)
    from sparse_attn import patterns
    from sparse_attn.ops.block_sparse import attention_op
    with pytest.raises(ValueError, match="ROW_ORDER must be 'reverse-dq', 'reverse' or 'grid', got 'backwards'"):
        attention_op(q, k, v, patterns.dense(16, 16, block_q=16, block_k=16))
    assert "SPARSE_ATTN_ROW_ORDER must be 'reverse-dq', 'reverse' or 'grid', got 'up'" in launch_import_stderr(
        "SPARSE_ATTN_ROW_ORDER", "up")


@pytest.mark.parametrize("chunk", [2, 64, "deep"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_wave_order_changes_only_the_summation_order_of_the_backward(monkeypatch, chunk, hkv):
    """The backward kernels' indexed walks in the wave order (launch.BWD_WAVE): each program starts
    its row's unmasked slots at (program id mod resident programs) / resident programs and wraps
    around, also across register chunks (chunk 2: rows of up to 6 blocks span three) and with one
    index load per iteration ("deep", launch.BWD_IDX_DEEP); with two query heads per kv head (hkv 2)
    the dK/dV program walks both heads' rows as one, the first head's in two pieces. The same blocks
    in another order: gradients meet rule 3 against the fp64 oracle, agree with the plain order to
    fp32 rounding, and differ from it in some bits (so the rotation ran). The forward's wave is off,
    so only the backward's order differs. The interpreter stands in 3 SMs of 2 programs: 6 phases
    over 24 (dQ) and 12 or 24 (dK/dV) programs."""
    monkeypatch.setattr(launch, "BWD_IDX_CHUNK", 64 if chunk == "deep" else chunk)
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "1" if chunk == "deep" else "0")
    monkeypatch.setattr(launch, "FWD_WAVE", False)
    g = torch.Generator().manual_seed(8)
    bm = torch.rand(1, 4, 6, 6, generator=g) < 0.6
    bm[..., 0] = True  # no empty forward row
    bm[..., 0, :] = True  # nor transposed one: every row has a first block to rotate away from
    eye = torch.eye(6, dtype=torch.bool).expand(1, 4, 6, 6)
    # causal diagonal blocks: masked blocks, walked after the rotated unmasked ones (phase 1)
    layout = BlockLayout.from_block_mask(bm | eye, block_q=16, block_k=16, q_len=90, kv_len=90, partial=eye,
                                         mask=ElementMask((causal_term(),)))
    q, k, v = _qkv(4, hkv, 90, 90, 16, seed=9, dtype=torch.float32)
    from sparse_attn.ops.block_sparse import attention_op
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)
    do = torch.randn(1, 4, 90, 16, generator=torch.Generator().manual_seed(10))
    wave, plain = grads_per_launch_setting(q, k, v, layout, do, "BWD_WAVE", ("1", "0"))
    for name, a, b in zip(("dq", "dk", "dv"), wave, plain):
        assert not torch.equal(a, b), f"{name}: bitwise equal to the plain order, so no rotation ran"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, lq, lk, hq, hkv", [
    ("dense", 70, 70, 2, 2),            # the arithmetic walk, one query head per kv head
    ("causal", 50, 75, 4, 2),           # GQA (heads inside), masked blocks, Lq < Lk bottom-right
    ("random", 90, 90, 4, 1),           # MQA, indexed walk in the wave order, partial last block
])
def test_delta_through_dp_accumulator_keeps_the_gradients(kind, lq, lk, hq, hkv, monkeypatch):
    """The dK/dV kernel can seed dP's accumulator with -delta (launch.BWD_DKDV_DELTA_ACC) instead of
    subtracting delta after the product. Gradients meet rule 3 against the fp64 oracle that way. The
    interpreter adds a product's accumulator after the whole product, so -delta + dP rounds exactly as
    dP - delta: the gradients must be bitwise those of the subtraction (on the GPU only summation
    order differs; tests/gpu covers it)."""
    from sparse_attn import patterns
    from sparse_attn.ops.block_sparse import attention_op

    if kind == "random":
        g = torch.Generator().manual_seed(3)
        bm = (torch.rand(1, hq, 6, 6, generator=g) < 0.5) | torch.eye(6, dtype=torch.bool)
        layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=lq, kv_len=lk)
    else:
        layout = {"dense": lambda: patterns.dense(lq, lk, block_q=16, block_k=16),
                  "causal": lambda: patterns.causal(lq, lk, block_q=16, block_k=16)}[kind]()
    q, k, v = _qkv(hq, hkv, lq, lk, 16, seed=13, dtype=torch.float32)
    monkeypatch.setattr(launch, "BWD_DKDV_DELTA_ACC", "1")
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)
    do = torch.randn(1, hq, lq, 16, generator=torch.Generator().manual_seed(14))
    seeded, subtracted = grads_per_launch_setting(q, k, v, layout, do, "BWD_DKDV_DELTA_ACC", ("1", "0"))
    assert all(torch.isfinite(g).all() for g in seeded)
    for name, a, b in zip(("dq", "dk", "dv"), seeded, subtracted):
        assert torch.equal(a, b), f"{name} differs between delta in dP's accumulator and delta subtracted"


def test_unknown_delta_accumulator_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_DKDV_DELTA_ACC", "yes")
    assert "SPARSE_ATTN_BWD_DKDV_DELTA_ACC must be 'auto', '0' or '1', got 'yes'" in stderr


def test_deep_index_loads_where_measured_faster(monkeypatch):
    """launch.BWD_IDX_DEEP "auto" takes the deep per-iteration index loads only where the H100 measured
    them faster (benchmarks/NOTES.md, backward 24): head dim 128, no element masks, not packed, split
    schedule. "1" takes them on every split call, "0" on none; the fused schedule never does."""
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "auto")
    assert launch.deep_index_loads(False, 128, 0, False)
    assert not launch.deep_index_loads(False, 128, 1, False)  # element masks: causal, streaming
    assert not launch.deep_index_loads(False, 64, 0, False)
    assert not launch.deep_index_loads(False, 128, 0, True)
    assert not launch.deep_index_loads(True, 128, 0, False)
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "1")
    assert launch.deep_index_loads(False, 64, 2, True) and not launch.deep_index_loads(True, 128, 0, False)
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "0")
    assert not launch.deep_index_loads(False, 128, 0, False)
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", False)  # a bool set by hand: refused, not read as "auto"
    with pytest.raises(ValueError, match="launch.BWD_IDX_DEEP must be one of 'auto', '0', '1', got False"):
        launch.deep_index_loads(False, 128, 0, False)


@pytest.mark.parametrize("setting, walk_q, walk_k, expect", [
    ("auto", 65536, 65536, (False, False)),  # one head's Q+dO (K+V): 32 MiB, inside a 50 MiB L2
    ("auto", 131072, 131072, (True, True)),  # 64 MiB: outgrows it
    ("auto", 131072, 16384, (True, False)),  # each kernel by its own walked operands
    ("auto", 16384, 131072, (False, True)),
    ("1", 1024, 1024, (True, True)), ("0", 131072, 131072, (False, False)),
    ("dq", 1024, 1024, (False, True)), ("dkdv", 1024, 1024, (True, False))])
def test_backward_wave_order_where_the_walked_operands_outgrow_the_l2(monkeypatch, setting, walk_q, walk_k, expect):
    """launch.bwd_wave: "auto" rotates a backward kernel's indexed walks only where one head's walked
    operands (bf16, head dim 128 here) exceed the L2, where the wave order was measured faster (H100:
    128K faster, 16K-64K 2-7% slower with deep index loads); the interpreter stands in a 50 MiB L2."""
    monkeypatch.setattr(launch, "BWD_WAVE", setting)
    assert launch.bwd_wave(torch.device("cpu"), 128, 2, walk_q, walk_k) == expect


def test_unknown_wave_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_WAVE", "on")
    assert "SPARSE_ATTN_BWD_WAVE must be 'auto', '1', '0', 'dq' or 'dkdv', got 'on'" in stderr


@pytest.mark.parametrize("name, value", [("BWD_WAVE", False), ("BWD_DKDV_DELTA_ACC", True),
                                         ("BWD_VARIANT", "fast"), ("BWD_DKDV_HEADS", 1),
                                         ("BWD_DKDV_MASKED", "1"), ("BWD_TERMS", True),
                                         ("BWD_TILE_ORDER", "longest")])
def test_backward_refuses_settings_assigned_outside_their_choices(name, value, monkeypatch):
    """The backward's string settings reassigned at run time (as probes and tests do) to a value
    outside their choices: a clear error before any launch, never a silently chosen branch (a bool
    False for BWD_WAVE would have read as "on", since only "0" turns it off)."""
    from sparse_attn.ops.block_sparse import attention_op
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=32, block_q=16, block_k=16)
    q, k, v = _qkv(2, 1, 32, 32, 16, seed=1)
    out = attention_op(q, k, v, layout)
    monkeypatch.setattr(launch, name, value)
    with pytest.raises(ValueError, match=f"launch.{name} must be one of .*, got {value!r}"):
        out.sum().backward()


@pytest.mark.parametrize("kind, lq, lk, hq, hkv", [
    ("causal", 50, 75, 2, 1),            # one masked block per transposed row, Lq < Lk bottom-right
    ("local", 90, 90, 4, 2),             # two per row (window edge and diagonal); GQA, heads inside
    ("block-diagonal", 96, 96, 2, 2),    # documents of 40 tokens: their edges inside blocks
    ("causal-packed", None, None, 2, 1),  # packed sequences
])
def test_one_stage_masked_pass_does_not_change_gradients(kind, lq, lk, hq, hkv, monkeypatch):
    """On contiguous schedules the dK/dV kernel's masked pass (the blocks with an element mask or past
    the sequence end) may load one index an iteration, unpipelined (launch.BWD_DKDV_MASKED "one-stage";
    "auto", the default, where the layout has element masks or GQA's heads loop inside), instead of
    register chunks at NUM_STAGES: the same blocks in the same order, so gradients bitwise equal, and
    the oracle checks them elsewhere (test_backward_meets_rule3 and the varlen tests run the default)."""
    from sparse_attn import patterns, varlen
    from sparse_attn.ops.block_sparse import attention_op, layout_inputs, varlen_attention_op
    if kind == "causal-packed":
        lens = [33, 5, 47]
        q, k, v = random_packed_qkv(sum(lens), sum(lens), hq, hkv, 16, seed=31)
        cu = torch.tensor([0, 33, 38, 85], dtype=torch.int32)
        stacked = varlen.stack(varlen.build_layouts(lens, lens, None, None, causal=True, block=16), 47, 47, hq)
        call = lambda: varlen_attention_op(q, k, v, stacked, cu, cu, 47, 47, torch.tensor(lens))  # noqa: E731
    else:
        layout = {"causal": lambda: patterns.causal(lq, lk, block_q=16, block_k=16),
                  "local": lambda: patterns.local(lq, 48, block_q=16, block_k=16),
                  "block-diagonal": lambda: patterns.block_diagonal(lq, 40, block_q=16, block_k=16)}[kind]()
        ins = layout_inputs(layout, True)
        assert ins[10], "the transposed schedule must be contiguous"
        assert (ins[6] > ins[7]).any(), "some transposed row must have a masked pass to walk"
        q, k, v = _qkv(hq, hkv, lq, lk, 16, seed=31)
        call = lambda: attention_op(q, k, v, layout)  # noqa: E731
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(32)).half()
    grads = []
    for value in ("pipelined", "one-stage"):
        monkeypatch.setattr(launch, "BWD_DKDV_MASKED", value)
        grads.append(torch.autograd.grad(call(), (q, k, v), do))
    pipelined, one_stage = grads
    assert all(torch.isfinite(g).all() for g in one_stage)
    assert all(torch.equal(a, b) for a, b in zip(pipelined, one_stage))


def test_unknown_masked_pass_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_DKDV_MASKED", "fast")
    assert "SPARSE_ATTN_BWD_DKDV_MASKED must be 'auto', 'one-stage' or 'pipelined', got 'fast'" in stderr


def test_unknown_deep_index_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_IDX_DEEP", "yes")
    assert "SPARSE_ATTN_BWD_IDX_DEEP must be 'auto', '0' or '1', got 'yes'" in stderr


def test_unknown_terms_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_TERMS", "desc")
    assert "SPARSE_ATTN_BWD_TERMS must be 'ptr' or 'tma', got 'desc'" in stderr


@pytest.mark.parametrize("setting, qdo_tma, expect", [("tma", True, True), ("tma", False, False),
                                                      ("ptr", True, False), ("ptr", False, False)])
def test_row_terms_go_by_tma_only_beside_qdo_by_tma(setting, qdo_tma, expect, monkeypatch):
    """launch.terms_by_tma: the dK/dV kernel's row terms take TMA descriptors only where Q/dO do
    (their checks: sm_90+, alignment, the descriptor allocator), and never under BWD_TERMS "ptr"."""
    monkeypatch.setattr(launch, "BWD_TERMS", setting)
    assert launch.terms_by_tma(qdo_tma) is expect


# transposed-schedule counts [batch 1, 4 query heads, 4 key blocks]: kv heads of two query heads sum to
# [3, 3, 2, 4] and [5, 4, 1, 1]
_TILE_COUNTS = ((1, 3, 2, 3), (2, 0, 0, 1), (0, 4, 1, 1), (5, 0, 0, 0))


def test_tile_order_puts_each_rows_longest_walks_first():
    """launch.tile_order: per (batch, kv head) row, the key blocks sorted by the walk a dK/dV program
    makes there (the transposed schedule's counts summed over the kv head's query heads), longest first,
    ties in block order; a layout broadcast over batch or heads gives stride 0 on that axis."""
    counts = torch.tensor([_TILE_COUNTS], dtype=torch.int32)
    order, ob, oh = launch.tile_order(counts, 2)  # heads 0-1 and 2-3 share a kv head
    assert order.dtype == torch.int32 and order.shape == (1, 2, 4)
    assert order.tolist() == [[[3, 0, 1, 2], [0, 1, 2, 3]]]  # row sums [3, 3, 2, 4] and [5, 4, 1, 1]
    assert (ob, oh) == (0, order.stride(1))


def test_tile_order_sums_over_the_kv_heads_query_heads():
    counts = torch.tensor([_TILE_COUNTS], dtype=torch.int32)
    order, _, _ = launch.tile_order(counts, 2)
    sums = counts.view(1, 2, 2, 4).sum(2)  # [[3, 3, 2, 4], [5, 4, 1, 1]]
    for row, s in zip(order[0].tolist(), sums[0].tolist()):
        assert [s[i] for i in row] == sorted(s, reverse=True)
        assert row == sorted(range(4), key=lambda i: -s[i])  # stable: ties keep block order
    broadcast, ob, oh = launch.tile_order(counts[:, :1], 4)  # one layout row for every head and batch
    assert broadcast.tolist() == [[[1, 3, 2, 0]]] and (ob, oh) == (0, 0)


@pytest.mark.parametrize("hq, hkv, block_k", [(4, 2, 32), (4, 4, 64), (4, 1, 64)])
def test_longest_walks_first_does_not_change_gradients(hq, hkv, block_k):
    """launch.BWD_TILE_ORDER "work": the dK/dV programs take their row's key tiles longest walk first
    (block_k 64 holds two 32-key tiles of the interpreter's config, so a place maps to a block and a
    tile within it, and the grid spans whole blocks: the last block's second tile lies past the 200
    keys and returns). Each key tile's walk is the same, so gradients are bitwise those of grid order; a
    tile left out or taken twice would change dK/dV."""
    g = torch.Generator().manual_seed(41)
    L = 200  # a partial last key block
    nq, nk = -(-L // 16), -(-L // block_k)
    # later key blocks denser, so that longest-first is far from grid order
    bm = torch.rand(1, hq, nq, nk, generator=g) < torch.linspace(0.2, 0.8, nk)
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=block_k, q_len=L, kv_len=L)
    from sparse_attn.ops.block_sparse import layout_inputs
    t_counts = layout_inputs(layout, True)[6]
    order, _, _ = launch.tile_order(t_counts, hkv)  # it must differ from grid order, or the test proves nothing
    assert not torch.equal(order, torch.arange(nk, dtype=torch.int32).expand_as(order))
    q, k, v = _qkv(hq, hkv, L, L, 16, seed=42, dtype=torch.float32)
    do = torch.randn(1, hq, L, 16, generator=torch.Generator().manual_seed(43))
    work, grid = grads_per_launch_setting(q, k, v, layout, do, "BWD_TILE_ORDER", ("work", "grid"))
    for name, a, b in zip(("dq", "dk", "dv"), work, grid):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between longest-first and grid order"


def test_unknown_tile_order_setting_is_a_clear_error():
    stderr = launch_import_stderr("SPARSE_ATTN_BWD_TILE_ORDER", "lpt")
    assert "SPARSE_ATTN_BWD_TILE_ORDER must be 'auto', 'grid' or 'work', got 'lpt'" in stderr


@pytest.mark.parametrize("setting, indexed, varlen, fused, heads, hkv, expect", [
    ("auto", True, False, False, 32, 8, True),    # GQA on random blocks: measured 7-10% faster
    ("auto", True, False, False, 32, 1, True),    # MQA
    ("auto", True, False, False, 32, 32, False),  # MHA: 2% slower at 32K, grid order kept
    ("auto", False, False, False, 32, 8, False),  # contiguous schedules walk by arithmetic
    ("auto", True, True, False, 32, 8, False),    # packed rows' lengths differ by sequence
    ("auto", True, False, True, 32, 8, False),    # the fused variant
    ("work", True, False, False, 32, 32, True),
    ("work", False, False, False, 32, 32, False),
    ("grid", True, False, False, 32, 8, False),
])
def test_longest_walks_first_where_the_setting_and_schedule_allow(setting, indexed, varlen, fused, heads, hkv,
                                                                  expect, monkeypatch):
    monkeypatch.setattr(launch, "BWD_TILE_ORDER", setting)
    assert launch.longest_walks_first(indexed, varlen, fused, heads, hkv) is expect


def test_tile_order_is_sorted_once_per_layout(monkeypatch):
    """The default ("auto") takes GQA's key tiles longest first; the order is computed once per transposed
    schedule (cached on its counts tensor, which the layout caches), not on every backward, and kept apart
    per kv head count."""
    calls = []
    real = launch.tile_order
    monkeypatch.setattr(launch, "tile_order", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(launch, "BWD_TILE_ORDER", "auto")
    bm = torch.rand(1, 4, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.6
    bm |= torch.eye(4, dtype=torch.bool)
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=64, kv_len=64)
    from sparse_attn.ops.block_sparse import attention_op
    for hkv in (2, 2, 1, 2, 4):  # 4: MHA, grid order, no sort
        q, k, v = _qkv(4, hkv, 64, 64, 16, seed=hkv)
        torch.autograd.grad(attention_op(q, k, v, layout).sum(), (q, k, v))
    assert calls == [2, 1]
