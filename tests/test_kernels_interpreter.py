"""The Triton kernels under TRITON_INTERPRET=1 on the CPU (set by conftest.py when there is no GPU):
small fp16/fp32 cases, forward and backward, against the reference (DESIGN.md rule 3)."""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import reference
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, causal_term, document_term, window_term
from sparse_attn.testing import (assert_close_to_oracle, assert_grads_close_to_oracle, check_non_finite_spread,
                                 random_packed_qkv)

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]

MASKS = {
    "dense": ElementMask((MaskTerm(),)),
    "causal": ElementMask((causal_term(),)),
    "streaming": ElementMask((window_term(20, 0), MaskTerm(k_lo=0, k_hi=2, right=0))),
    "two_sided": ElementMask((window_term(9, 13),)),
    "block_diag": ElementMask((document_term(23),)),
}


def _ops():
    from sparse_attn.ops.block_sparse import attention_op, varlen_attention_op
    return attention_op, varlen_attention_op


def _qkv(B, hq, hkv, lq, lk, d, dtype, grad):
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, hq, lq, d), mk(B, hkv, lk, d), mk(B, hkv, lk, d)


def _check_fwd_bwd(layout, q, k, v, bwd=True):
    attention_op, _ = _ops()
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    oracle = [t.detach().double().requires_grad_(bwd) for t in (q, k, v)]
    lowp = [t.detach().clone().requires_grad_(bwd) for t in (q, k, v)]
    o_or, lse_or = reference.attention(*oracle, layout, return_lse=True)
    o_lp = reference.attention(*lowp, layout, _lowp=True)
    assert_close_to_oracle(out, o_lp, o_or, name="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_or))
    fin = torch.isfinite(lse_or)
    assert (lse[fin].double() - lse_or[fin]).abs().max() < 1e-2
    if bwd:
        assert_grads_close_to_oracle((out, o_lp, o_or), torch.randn_like(out), (q, k, v), lowp, oracle)


@pytest.mark.parametrize("kind,lq,lk,bq,bk,hq,hkv", [
    ("dense", 40, 40, 16, 16, 2, 2),
    ("causal", 50, 30, 32, 16, 4, 2),      # Lq > Lk: leading rows see no key; GQA
    ("causal", 37, 70, 16, 32, 2, 1),      # Lq < Lk; MQA; tails
    ("streaming", 45, 45, 16, 16, 2, 2),
    ("two_sided", 33, 47, 16, 16, 2, 2),
    ("block_diag", 49, 49, 16, 32, 2, 2),
])
def test_patterns_fp16_fwd_bwd(kind, lq, lk, bq, bk, hq, hkv):
    layout = BlockLayout.from_mask(MASKS[kind], q_len=lq, kv_len=lk, block_q=bq, block_k=bk)
    _check_fwd_bwd(layout, *_qkv(1, hq, hkv, lq, lk, 16, torch.float16, True))


def test_fp32_per_head_random_layout_with_broadcast_batch():
    g = torch.Generator().manual_seed(3)
    bm = torch.rand(1, 4, 3, 3, generator=g) < 0.5
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=41, kv_len=35)
    _check_fwd_bwd(layout, *_qkv(2, 4, 2, 41, 35, 16, torch.float32, True))


def test_wave_order_changes_only_the_summation_order(monkeypatch):
    """Indexed rows start their walk at (program id mod resident programs) / resident programs of the
    row (launch.FWD_WAVE): the same blocks, another order. Against the reference, and different bits
    from the plain order (so the rotation ran), on a random layout with GQA, partial last blocks and
    rows of 1-6 blocks. The interpreter stands in 3 SMs of 2 programs: 6 phases over 28 programs."""
    from sparse_attn.ops.block_sparse import launch
    g = torch.Generator().manual_seed(5)
    bm = torch.rand(1, 4, 7, 6, generator=g) < 0.6
    bm[..., 0] = True  # no empty row: each has a first block to rotate away from
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=100, kv_len=90)
    q, k, v = _qkv(1, 4, 2, 100, 90, 16, torch.float32, True)
    _check_fwd_bwd(layout, q, k, v)
    attention_op, _ = _ops()
    with torch.no_grad():
        wave = attention_op(q, k, v, layout, return_lse=True)
        monkeypatch.setattr(launch, "FWD_WAVE", False)
        plain = attention_op(q, k, v, layout, return_lse=True)
    assert not torch.equal(wave[1], plain[1])
    assert (wave[0] - plain[0]).abs().max() < 1e-5 and (wave[1] - plain[1]).abs().max() < 1e-5


_CLOCK_ARGS = dict(d_pad=128, elem_bytes=2, quant=0, block_q=128, block_k=128, lk=131072, max_k=512)


@pytest.mark.parametrize("setting, changes, expect", [
    ("auto", {}, 512 * 1950),                            # one kv head's K+V (bf16 d128, 128K): 64 MiB > 50 MiB
    ("auto", dict(lk=65536), 0),                         # 32 MiB: inside the L2, keep the grid-position phase
    ("auto", dict(elem_bytes=1, quant=2), 0),            # 8-bit: not measured
    ("auto", dict(d_pad=64, lk=262144), 0),              # head dim 64: not measured
    ("auto", dict(block_q=64, block_k=64), 0),           # 64-token blocks: not measured
    ("auto", dict(block_k=256, max_k=256), 512 * 1950),  # the period counts 128 x 128 blocks
    ("auto", dict(max_k=0), 0),                          # no indexed block at all
    ("1", dict(lk=1024, block_q=64, block_k=64), 512 * 1950 // 4),
    ("0", {}, 0),
    # contiguous runs: the keys the running neighbours share are a run's own blocks
    ("auto", dict(contiguous=True, max_k=1024), 1024 * 1950),  # dense / causal 128K: 64 MiB of K+V
    ("auto", dict(contiguous=True, max_k=33), 0),              # a 4096-token window at 128K: 2 MiB
    ("1", dict(contiguous=True, max_k=33), 33 * 1950)])
def test_forward_wave_phase_from_the_gpu_clock_where_kv_outgrow_the_l2(monkeypatch, setting, changes, expect):
    """launch.fwd_wave_clock: the wave order's period in ns (one row's duration at WAVE_NS_PER_BLOCK
    per 128 x 128 block), "auto" only where measured (Hopper, 16-bit, head dim 128, 128-token blocks) and
    where the keys the running rows read outgrow the L2 (the interpreter stands in 50 MiB): all of
    one kv head's for indexed rows, a run's own for contiguous ones; 0 keeps the phase of the grid
    position (indexed rows) or no rotation (contiguous runs)."""
    from sparse_attn.ops.block_sparse import launch
    monkeypatch.setattr(launch, "FWD_WAVE_CLOCK", setting)
    assert launch.fwd_wave_clock(torch.device("cpu"), **{**_CLOCK_ARGS, **changes}) == expect


def test_forward_wave_clock_auto_only_on_hopper(monkeypatch):
    """WAVE_NS_PER_BLOCK was measured on the H100: "auto" leaves other architectures on the grid phase."""
    from sparse_attn.ops.block_sparse import launch
    monkeypatch.setattr(launch, "FWD_WAVE_CLOCK", "auto")
    assert launch.fwd_wave_clock(torch.device("cpu"), **_CLOCK_ARGS) > 0
    for major in (8, 10):
        monkeypatch.setattr(launch, "_sm_major", lambda device, major=major: major)
        assert launch.fwd_wave_clock(torch.device("cpu"), **_CLOCK_ARGS) == 0


def test_forward_wave_clock_off_under_deterministic_algorithms(monkeypatch):
    """The clock's phase makes the summation order depend on timing, so "auto" leaves it off when the
    caller asks torch for deterministic algorithms."""
    from sparse_attn.ops.block_sparse import launch
    monkeypatch.setattr(launch, "FWD_WAVE_CLOCK", "auto")
    from sparse_attn.testing import deterministic_algorithms
    assert launch.fwd_wave_clock(torch.device("cpu"), **_CLOCK_ARGS) > 0
    with deterministic_algorithms():
        assert launch.fwd_wave_clock(torch.device("cpu"), **_CLOCK_ARGS) == 0
    assert launch.fwd_wave_clock(torch.device("cpu"), **_CLOCK_ARGS) > 0  # the caller's setting is back


def test_unknown_forward_wave_clock_setting_is_a_clear_error():
    from sparse_attn.testing import launch_import_stderr
    stderr = launch_import_stderr("SPARSE_ATTN_FWD_WAVE_CLOCK", "on")
    assert "SPARSE_ATTN_FWD_WAVE_CLOCK must be 'auto', '0' or '1', got 'on'" in stderr


def test_composed_layout_with_different_masks_per_block():
    a = BlockLayout.from_mask(MASKS["streaming"], q_len=48, block_q=16, block_k=16)
    b = BlockLayout.from_mask(MASKS["block_diag"], q_len=48, block_q=16, block_k=16)
    _check_fwd_bwd(a | b, *_qkv(1, 2, 2, 48, 48, 16, torch.float16, True))


def test_empty_layout_gives_zeros_and_minus_inf():
    layout = BlockLayout.from_mask(ElementMask(()), q_len=20, block_q=16, block_k=16)
    attention_op, _ = _ops()
    q, k, v = _qkv(1, 2, 2, 20, 20, 16, torch.float16, False)
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_a_nan_in_k_reaches_only_the_rows_that_see_it_one_in_v_its_visiting_blocks():
    """The README's non-finite rule on the kernels (sparse_attn.testing.check_non_finite_spread)."""
    attention_op, _ = _ops()
    layout = BlockLayout.from_mask(MASKS["streaming"], q_len=80, block_q=16, block_k=16)
    q, k, v = _qkv(1, 1, 1, 80, 80, 16, torch.float16, False)
    check_non_finite_spread(lambda q, k, v: attention_op(q, k, v, layout), layout, q, k, v, key=37)


def test_varlen_matches_per_sequence_reference():
    _, varlen_attention_op = _ops()
    from sparse_attn import varlen
    q_lens, k_lens = [17, 1, 40], [30, 5, 40]
    hq, hkv, d = 4, 2, 16
    q, k, v = random_packed_qkv(sum(q_lens), sum(k_lens), hq, hkv, d, seed=7)
    cq = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    ck = torch.tensor([0, 30, 35, 75], dtype=torch.int32)
    pattern = lambda lq, lk: BlockLayout.from_mask(MASKS["streaming"], q_len=lq, kv_len=lk,  # noqa: E731
                                                   block_q=16, block_k=16)
    per_seq = varlen.build_layouts(q_lens, k_lens, None, pattern, causal=True)
    stacked = varlen.stack(per_seq, max(q_lens), max(k_lens), hq)
    out = varlen_attention_op(q, k, v, stacked, cq, ck, max(q_lens), max(k_lens), torch.tensor(k_lens))
    ref = sparse_attn.varlen_attention(q.double(), k.double(), v.double(), cq, ck, max(q_lens), max(k_lens),
                                       pattern=pattern, causal=True)
    assert (out.double() - ref).abs().max() < 5e-3
    do = torch.randn_like(out)
    out.backward(do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    sparse_attn.varlen_attention(qd, kd, vd, cq, ck, max(q_lens), max(k_lens), pattern=pattern,
                                 causal=True).backward(do.double())
    for a, b in ((q, qd), (k, kd), (v, vd)):
        assert (a.grad.double() - b.grad).abs().max() < 1e-2


def _lse_loss(out, lse, do, dl):
    """A loss that uses the LSE as well as the output (rows with no key: LSE -inf, left out)."""
    return (out.float() * do).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dl).sum()


@pytest.mark.parametrize("kind,lq,lk,hq,hkv", [("causal", 50, 30, 4, 2), ("streaming", 45, 45, 2, 2)])
def test_lse_gradient_matches_the_reference(kind, lq, lk, hq, hkv):
    """d LSE / d s = P: the kernels fold the LSE's gradient into delta (bwd_delta_kernel), so a loss that
    uses the LSE (merging partial attentions) gets the reference's gradients. Causal with Lq > Lk has
    rows with no key (LSE -inf)."""
    attention_op, _ = _ops()
    layout = BlockLayout.from_mask(MASKS[kind], q_len=lq, kv_len=lk, block_q=16, block_k=16)
    q, k, v = _qkv(1, hq, hkv, lq, lk, 16, torch.float32, True)
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    g = torch.Generator().manual_seed(5)
    do, dl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    _lse_loss(out, lse, do, dl).backward()
    oracle = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_or, lse_or = reference.attention(*oracle, layout, return_lse=True)
    _lse_loss(o_or, lse_or, do.double(), dl.double()).backward()
    for name, a, b in zip("qkv", (q, k, v), oracle):
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err < 2e-3, f"d{name}: max error {err:.2e}"
    # the LSE's term matters: without it the gradients differ
    qn, kn, vn = (t.detach().double().requires_grad_() for t in (q, k, v))
    (reference.attention(qn, kn, vn, layout).float() * do).sum().backward()
    assert (qn.grad - oracle[0].grad).abs().max() > 0.05


def test_unused_outputs_pass_no_gradient_tensor_and_an_lse_only_loss_works(monkeypatch):
    """Eager autograd hands None for an unused output (set_materialize_grads(False)): a loss on the
    output alone reaches the backward with dlse None (no HAS_DLSE load of a zero tensor), and a loss on
    the LSE alone (do None) gets the reference's gradients."""
    from sparse_attn.ops.block_sparse import launch
    attention_op, _ = _ops()
    seen = []
    real = launch.backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dlse"))
        return real(*args, **kwargs)
    monkeypatch.setattr(launch, "backward", spy)
    layout = BlockLayout.from_mask(MASKS["causal"], q_len=40, kv_len=40, block_q=16, block_k=16)
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, torch.float32, True)
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    out.sum().backward()
    assert seen == [None]
    for t in (q, k, v):
        t.grad = None
    _, lse = attention_op(q, k, v, layout, return_lse=True)
    dl = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2))
    (lse * dl).sum().backward()
    assert seen[-1] is not None
    oracle = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (reference.attention(*oracle, layout, return_lse=True)[1] * dl.double()).sum().backward()
    for name, a, b in zip("qkv", (q, k, v), oracle):
        want = torch.zeros_like(b) if b.grad is None else b.grad  # the LSE does not depend on v
        assert (a.grad.double() - want).abs().max() < 2e-3, name


def test_lse_gradient_of_varlen_and_grouped_kernels(monkeypatch):
    from sparse_attn import Group, grouped, varlen
    _, varlen_attention_op = _ops()
    loop = grouped.grouped_attention_loop
    monkeypatch.setattr(grouped, "FORCE_KERNELS", True)
    monkeypatch.setattr(grouped, "grouped_attention_loop", None)  # the kernel path must not fall back
    q_lens, k_lens = [17, 1, 40], [30, 5, 40]
    q, k, v = random_packed_qkv(58, 75, 4, 2, 16, seed=3, dtype=torch.float32, requires_grad=True)
    cq = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    ck = torch.tensor([0, 30, 35, 75], dtype=torch.int32)
    stacked = varlen.stack(varlen.build_layouts(q_lens, k_lens, None, None, causal=True, block=16), 40, 40, 4)
    groups = [Group(0, 17, 0, 30), Group(17, 18, 20, 35), Group(18, 58, 0, 75)]  # overlapping K/V
    g = torch.Generator().manual_seed(9)
    do, dl = torch.randn(58, 4, 16, generator=g), torch.randn(4, 58, generator=g)
    cases = {
        "varlen": (lambda q, k, v: varlen_attention_op(q, k, v, stacked, cq, ck, 40, 40, torch.tensor(k_lens),
                                                       return_lse=True),
                   lambda q, k, v: sparse_attn.varlen_attention(q, k, v, cq, ck, 40, 40, causal=True,
                                                                return_lse=True)),
        "grouped": (lambda q, k, v: grouped.grouped_attention(q, k, v, groups, causal=True, return_lse=True),
                    lambda q, k, v: loop(q, k, v, groups, causal=True, return_lse=True)),
    }
    for what, (kernel, ref) in cases.items():
        for t in (q, k, v):
            t.grad = None
        _lse_loss(*kernel(q, k, v), do, dl).backward()
        oracle = [t.detach().double().requires_grad_() for t in (q, k, v)]
        _lse_loss(*ref(*oracle), do.double(), dl.double()).backward()
        for name, a, b in zip("qkv", (q, k, v), oracle):
            err = (a.grad.double() - b.grad).abs().max().item()
            assert err < 2e-3, f"{what} d{name}: max error {err:.2e}"


def _causal_layout(lq, lk, block=16):
    return BlockLayout.from_mask(MASKS["causal"], q_len=lq, kv_len=lk, block_q=block, block_k=block)


def test_compiled_kernels_take_transposed_inputs():
    """The forward op's fake returned q's strides while the op returns a contiguous output: a compiled
    graph over [B, L, H, D] inputs viewed as [B, H, L, D] failed ("view size is not compatible")."""
    attention_op, _ = _ops()
    B, H, L, D = 1, 2, 32, 16
    lay = _causal_layout(L, L)
    x = [torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3)]

    def f(q, k, v):
        return attention_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lay).transpose(1, 2).reshape(
            B, L, H * D) * 1.0

    want = f(*x)
    grads = torch.autograd.grad(want.square().sum(), x)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(*x)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.square().sum(), x), grads):
        torch.testing.assert_close(g, w)


def test_strided_cu_seqlens_are_read_as_their_values():
    """A stride-2 cu_seqlens view was read as if packed: other sequences' offsets, writes past the output."""
    _, varlen_attention_op = _ops()
    from sparse_attn import varlen
    q, k, v = random_packed_qkv(58, 75, 2, 1, 16, seed=7, dtype=torch.float32)
    cq, ck = torch.tensor([0, 17, 18, 58], dtype=torch.int32), torch.tensor([0, 30, 35, 75], dtype=torch.int32)
    strided = [torch.stack([c, c.roll(-1)], 1).flatten()[::2] for c in (cq, ck)]
    assert strided[0].stride(0) == 2 and torch.equal(strided[0], cq)
    stacked = varlen.stack(varlen.build_layouts([17, 1, 40], [30, 5, 40], None, None, causal=True, block=16), 40, 40, 2)
    want = sparse_attn.varlen_attention(q.double(), k.double(), v.double(), cq, ck, 40, 40, causal=True)
    got = varlen_attention_op(q, k, v, stacked, *strided, 40, 40, (30, 5, 40))
    assert (got.double() - want).abs().max() < 1e-5


def test_kernel_gradients_refuse_a_second_backward():
    """create_graph=True gave a dq that was silently detached (the Triton backward records no graph), so a
    gradient penalty was dropped; it now raises, as a once-differentiable function does."""
    attention_op, _ = _ops()
    q, k, v = _qkv(1, 1, 1, 35, 35, 16, torch.float32, True)
    out = attention_op(q, k, v, _causal_layout(35, 35))
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gq.square().sum().backward()


def test_forward_into_refuses_an_output_its_kernels_cannot_write():
    """out[..., ::2] was written as if its channels were contiguous: wrong values, its neighbours overwritten."""
    from sparse_attn.ops.block_sparse import forward_into
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, torch.float32, False)
    lay = _causal_layout(40, 40)
    buf = torch.full((1, 2, 40, 32), 7.0)
    with pytest.raises(ValueError, match="unit stride in its last dim"):
        forward_into(q, k, v, lay, buf[..., ::2], torch.empty(1, 2, 40))
    out, lse = buf[..., :16], torch.empty(1, 2, 40)  # a unit-stride view of a wider buffer is fine
    forward_into(q, k, v, lay, out, lse)
    assert (out - reference.attention(q, k, v, lay)).abs().max() < 1e-5 and (buf[..., 16:] == 7).all()


def test_forward_into_refuses_an_lse_its_kernels_cannot_write():
    """The LSE buffer's shape and dtype went unchecked: one shorter than the rows was written past its end (a view
    of 20 of a [2, 40] buffer's entries had the other 60 overwritten), a bf16 one got the fp32 LSE rounded."""
    from sparse_attn.ops.block_sparse import forward_into
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, torch.float32, False)
    lay = _causal_layout(40, 40)
    out, buf = torch.empty(1, 2, 40, 16), torch.full((2, 40), 7.0)
    for bad in (buf[:1, :20].view(1, 1, 20), torch.empty(1, 2, 40, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="lse shaped"):
            forward_into(q, k, v, lay, out, bad)
    assert (buf == 7).all()
    lse = buf.view(40, 2).t()[None]  # [1, 2, 40] of any strides is fine
    forward_into(q, k, v, lay, out, lse)
    _, want = reference.attention(q, k, v, lay, return_lse=True)
    assert (lse - want).abs().max() < 1e-5
    # packed [T, H, D] inputs take an [H, T] LSE
    cu = torch.tensor([0, 40], dtype=torch.int32)
    qp, kp, vp = (t[0].transpose(0, 1) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"lse shaped \(2, 40\)"):
        forward_into(qp, kp, vp, lay, out[0].transpose(0, 1), torch.empty(1, 2, 40), cu_q=cu, cu_k=cu, max_q=40,
                     max_k=40, kv_lens=(40,))


def test_more_sequences_or_heads_than_cuda_allows_is_a_clear_error():
    """The grid's axes 1 and 2 hold heads and sequences, 65535 each at most in CUDA (both on one axis,
    B x H = 2048 x 32 failed at launch with a bare 'Triton Error [CUDA]: invalid argument' on the
    H100): more of either is refused before any launch, saying how to split."""
    attention_op, varlen_op = _ops()
    from sparse_attn.ops.sage import sage_attention_op
    lay = _causal_layout(1, 1)
    many_seqs, many_heads = torch.zeros(65536, 1, 1, 16), torch.zeros(1, 65536, 1, 16)
    with pytest.raises(ValueError, match="65536 sequences is over CUDA's 65535; split the call into batches of at "
                                         "most 65535 sequences"):
        attention_op(many_seqs, many_seqs, many_seqs, lay)
    with pytest.raises(ValueError, match="65536 heads is over CUDA's 65535"):
        attention_op(many_heads, many_heads, many_heads, lay)
    eight_bit = torch.zeros(65536, 1, 1, 32)
    with pytest.raises(ValueError, match="65536 sequences is over CUDA's 65535"):
        sage_attention_op(eight_bit, eight_bit, eight_bit, lay, quant="int8", granularity="per_warp", smooth_k=True)
    packed = torch.zeros(65536, 1, 16)
    cu = torch.arange(65537, dtype=torch.int32)
    with pytest.raises(ValueError, match="65536 sequences is over CUDA's 65535"):
        varlen_op(packed, packed, packed, lay, cu, cu, 1, 1, None)


def _split_and_usual(monkeypatch, run):
    """``run()``'s tensors on the usual grid and with every launch split (launch.SPLIT_GRID_ABOVE lowered
    from 65535 to 1: heads on grid axis 1, sequences on axis 2, as past 65535 (sequence, head) pairs)."""
    from sparse_attn.ops.block_sparse import launch
    usual = run()
    monkeypatch.setattr(launch, "SPLIT_GRID_ABOVE", 1)
    assert launch.grid_rows(2, 3) == ((3, 2), True)
    return usual, run()


def test_split_grid_gives_the_usual_grids_results_bit_for_bit(monkeypatch):
    """Each program finds its (sequence, head) on the split grid, and its place in the grid order (the
    wave order's phase) is the one it had: outputs, LSE and gradients are equal, on an indexed layout
    with element masks, GQA, a loss on the LSE (the row-terms kernel's dLSE) and the wave order in both
    backward kernels."""
    from sparse_attn.ops.block_sparse import launch
    monkeypatch.setattr(launch, "BWD_WAVE", "1")
    attention_op, _ = _ops()
    g = torch.Generator().manual_seed(11)
    n = 5
    eye = torch.eye(n, dtype=torch.bool).expand(2, 4, n, n)
    bm = (torch.rand(2, 4, n, n, generator=g) < 0.5).tril() | eye
    bm[..., 4, :4] = torch.tensor([True, False, True, True])  # a gap: indexed rows, which the wave order rotates
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, partial=eye, mask=MASKS["causal"])
    q, k, v = _qkv(2, 4, 2, 80, 80, 16, torch.float16, True)
    do, dl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)

    def run():
        out, lse = attention_op(q, k, v, layout, return_lse=True)
        return (out, lse) + torch.autograd.grad(_lse_loss(out, lse, do, dl), (q, k, v))

    for a, b in zip(*_split_and_usual(monkeypatch, run)):
        assert torch.equal(a, b)


def test_split_grid_gives_the_usual_grids_results_on_packed_and_8_bit_inputs(monkeypatch, one_thread):
    """The packed kernels (sequence bounds from cu_seqlens by the program's sequence) and the 8-bit
    quantization kernels (row scales, K's per-sequence mean, the attention on int8 Q/K)."""
    from sparse_attn import varlen
    from sparse_attn.ops.sage import sage_attention_op, sage_varlen_attention_op
    _, varlen_op = _ops()
    lens = [17, 1, 40]
    cu = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    stacked = varlen.stack(varlen.build_layouts(lens, lens, None, None, causal=True, block=16), 40, 40, 4)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(58, 4, 32, generator=g).half().requires_grad_()
    k, v = (torch.randn(58, 2, 32, generator=g).half().requires_grad_() for _ in range(2))
    qd, kd, vd = (torch.randn(2, 4, 40, 32, generator=g).half() for _ in range(3))
    dense = _causal_layout(40, 40)

    def run():
        out = varlen_op(q, k, v, stacked, cu, cu, 40, 40, tuple(lens))
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        packed8, _ = sage_varlen_attention_op(q.detach(), k.detach(), v.detach(), stacked, cu, cu, 40, 40, tuple(lens),
                                              quant="int8", granularity="per_warp", smooth_k=True)
        dense8, _ = sage_attention_op(qd, kd, vd, dense, quant="int8", granularity="per_thread", smooth_k=True)
        return (out,) + grads + (packed8, dense8)

    for a, b in zip(*_split_and_usual(monkeypatch, run)):
        assert torch.equal(a, b)


def test_compiled_attention_without_a_layout_on_the_kernel_path(monkeypatch):
    """attention(q, k, v) with no layout runs a default dense / causal layout cached per shape. The cache was a
    functools.lru_cache, which Dynamo ignores: it traced the builder, and torch.compile(fullgraph=True) failed on a
    data-dependent guard (on the H100 too), even after an eager call had built the layout. Compiled now equals
    eager, forward and backward; a training call at a shape that never ran eagerly is an error that says what to
    do, while a forward-only one compiles without it (the kernel plans its rows: the device plan)."""
    monkeypatch.setattr(sparse_attn.api, "_use_kernels", lambda q: True)  # the kernels' path, interpreted
    monkeypatch.setattr(sparse_attn.api, "_DEFAULT_LAYOUTS", {})  # no shape built by an earlier test
    for causal in (False, True):
        q, k, v = _qkv(1, 2, 1, 40, 56, 16, torch.float32, True)

        def f(q, k, v):
            return sparse_attn.attention(q, k, v, causal=causal, return_lse=True)

        out, lse = f(q, k, v)
        grads = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
        c_out, c_lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
        assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
        for got, want in zip(torch.autograd.grad(c_out.square().sum() + c_lse.sum(), (q, k, v)), grads):
            assert torch.equal(got, want)
    # a shape that never ran eagerly: forward-only, the kernel plans its rows (no layout: nothing to build);
    # with grad, the layout the backward needs is built on first use, so the compile asks for an eager call
    q, k, v = _qkv(1, 1, 1, 24, 24, 16, torch.float32, False)
    f = lambda q, k, v: sparse_attn.attention(q, k, v)  # noqa: E731
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))
    assert not sparse_attn.api._DEFAULT_LAYOUTS.get((False, 24, 24, "cpu"))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="once eagerly"):  # Dynamo's error holds the message
        torch.compile(f, backend="aot_eager", fullgraph=True)(q.clone().requires_grad_(), k, v)
