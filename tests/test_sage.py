"""8-bit attention (quant="int8" / "int8-fp8") on the CPU: the PyTorch twin through the public API,
and the Triton kernels under the interpreter (int8 only: the interpreter's float8 conversion
misrounds ~1% of values, e.g. 124.8 -> 64, so FP8 is checked on the GPU, tests/gpu/test_sage_gpu.py).

Accuracy is measured against the full-precision attention on the same layout. The issue's bar is
cosine >= 0.999 and relative L1 <= 0.02. int8 meets it; int8-fp8 meets the cosine but its relative
L1 is ~0.03 on random normal inputs: e4m3 keeps 3 mantissa bits, so each rounded P and V value
carries up to 1/16 relative error, which averages to ~3% (SageAttention2 reports the same figure
for E4M3 P.V). Its bound here is 0.045.
"""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import metrics, patterns, reference
from sparse_attn.ops.sage import reference as twin
from sparse_attn.ops.sage.granularity import GRANULARITY
from sparse_attn.testing import QUANT_L1_BOUND as L1_BOUND  # why int8-fp8 gets 0.045: there

GRANS = tuple(GRANULARITY)


def _qkv(hq, hkv, lq, lk, d, *, k_offset=0.0, outliers=0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, lq, d, generator=g)
    k = torch.randn(1, hkv, lk, d, generator=g)
    v = torch.randn(1, hkv, lk, d, generator=g)
    if k_offset:
        k = k + k_offset * torch.randn(d, generator=g)  # large per-channel offset, as in real models
    if outliers:
        # a few outlier channels, as in LLM keys: a large consistent magnitude (here +25, what smoothing
        # removes) and a wider spread (x2, what it cannot remove; x8 puts int8 K at L1 ~0.04)
        k[..., :outliers] = k[..., :outliers] * 2.0 + 25.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


LAYOUTS = {
    "dense": lambda lq, lk: None,
    "local": lambda lq, lk: patterns.local(lq, 48, kv_len=lk, block_q=32, block_k=32),
    "random": lambda lq, lk: patterns.random(lq, kv_len=lk, density=0.5, heads=4, block_q=32, block_k=64),
    "block_diagonal": lambda lq, lk: patterns.block_diagonal(lq, 70, kv_len=lk, block_q=32, block_k=32),
}


def _accuracy(out, ref):
    return metrics.cosine_similarity(out, ref), metrics.relative_l1(out, ref)


@pytest.mark.parametrize("quant", ["int8", "int8-fp8"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("pattern", list(LAYOUTS))
def test_twin_accuracy_against_full_precision(quant, gran, pattern):
    q, k, v = _qkv(4, 2, 200, 230, 64)
    lay = LAYOUTS[pattern](200, 230)
    ref = reference.attention(q, k, v, lay, causal=pattern == "local")
    out = sparse_attn.attention(q, k, v, lay, causal=pattern == "local", quant=quant, quant_granularity=gran)
    cos, l1 = _accuracy(out, ref)
    assert cos >= 0.999 and l1 <= L1_BOUND[quant], (cos, l1)


@pytest.mark.parametrize("quant", ["int8", "int8-fp8"])
def test_twin_accuracy_with_offset_and_outlier_channels(quant):
    q, k, v = _qkv(2, 2, 256, 256, 64, k_offset=6.0, outliers=3)
    ref = reference.attention(q, k, v, causal=True)
    for gran in GRANS:
        cos, l1 = _accuracy(sparse_attn.attention(q, k, v, causal=True, quant=quant, quant_granularity=gran), ref)
        assert cos >= 0.999 and l1 <= L1_BOUND[quant], (gran, cos, l1)


def test_e4m3_rounding_of_p_and_v_alone_misses_the_issues_l1_bar():
    """Why int8-fp8 is held to QUANT_L1_BOUND's 0.045, not the issue's 0.02: with everything else exact
    (fp64 scores and softmax, no int8), rounding only P (scaled to 448, as the kernel does) and only V
    (per-channel scale, as the kernel does) to e4m3 each already gives relative L1 above 0.02 on random
    normal inputs, and both together ~0.035, while the cosine stays above 0.999. So no FP8 P.V kernel can
    meet 0.02 there; the bound is the format's, not the kernel's."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 1024, 128, generator=g, dtype=torch.float64) for _ in range(3))
    p = torch.exp((s := q @ k.transpose(-1, -2) / 128 ** 0.5) - s.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)  # the kernel sums P before rounding it
    exact = p @ v / row_sum
    p_fp8 = (p * 448).to(torch.float8_e4m3fn).double() / 448
    v_scale = v.abs().amax(-2, keepdim=True) / 448
    v_fp8 = (v / v_scale).to(torch.float8_e4m3fn).double() * v_scale
    errors = {name: _accuracy(pp @ vv / row_sum, exact)
              for name, pp, vv in (("p", p_fp8, v), ("v", p, v_fp8), ("both", p_fp8, v_fp8))}
    assert all(l1 > 0.02 for _, l1 in errors.values()), errors
    assert 0.03 < errors["both"][1] < L1_BOUND["int8-fp8"] and errors["both"][0] > 0.999, errors


def test_smoothing_k_is_what_makes_offsets_harmless():
    q, k, v = _qkv(2, 2, 256, 256, 64, k_offset=20.0)
    ref = reference.attention(q, k, v)
    smooth = _accuracy(sparse_attn.attention(q, k, v, quant="int8", quant_granularity="per_block"), ref)
    raw = _accuracy(sparse_attn.attention(q, k, v, quant="int8", quant_granularity="per_block", smooth_k=False), ref)
    assert smooth[1] <= 0.02 < raw[1], (smooth, raw)


def test_lse_is_that_of_the_unsmoothed_scores():
    q, k, v = _qkv(4, 1, 100, 130, 32, k_offset=4.0)
    lay = LAYOUTS["local"](100, 130)
    _, lse_ref = reference.attention(q, k, v, lay, return_lse=True)
    _, lse = sparse_attn.attention(q, k, v, lay, quant="int8", return_lse=True)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max() < 0.05


def test_gradients_are_exactly_those_of_the_full_precision_path():
    q, k, v = _qkv(4, 2, 96, 96, 32)
    lay = LAYOUTS["random"](96, 96)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    out_q = sparse_attn.attention(*a, lay, causal=True, quant="int8-fp8")
    out_f = sparse_attn.attention(*b, lay, causal=True)
    assert not torch.equal(out_q, out_f)  # the value is the 8-bit one...
    # out_hp + (out_8bit - out_hp) equals out_8bit up to one rounding
    torch.testing.assert_close(out_q.detach(), sparse_attn.attention(q, k, v, lay, causal=True, quant="int8-fp8"),
                               rtol=0, atol=1e-6)
    do = torch.randn_like(out_f)
    out_q.backward(do)
    out_f.backward(do)
    for x, y in zip(a, b):  # ...the gradient the full-precision one
        assert torch.equal(x.grad, y.grad)


def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = _qkv(2, 2, 64, 64, 32)
    lay = patterns.from_block_mask(torch.tensor([[True, False], [False, False]]), block_q=32, block_k=32)
    out, lse = sparse_attn.attention(q, k, v, lay, quant="int8", return_lse=True)
    assert torch.all(out[:, :, 32:] == 0) and torch.all(lse[:, :, 32:] == float("-inf"))
    assert torch.isfinite(lse[:, :, :32]).all()


def test_varlen_quant_equals_per_sequence_calls():
    lens = [37, 100, 1]
    cu = torch.tensor([0, 37, 137, 138], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(138, 4, 32, generator=g) for _ in range(3))
    out = sparse_attn.varlen_attention(q, k, v, cu, cu, 100, 100, causal=True, quant="int8")
    for b, n in enumerate(lens):
        s = slice(int(cu[b]), int(cu[b + 1]))
        per = sparse_attn.attention(*(t[s].transpose(0, 1)[None] for t in (q, k, v)), causal=True, quant="int8")
        assert torch.equal(out[s], per[0].transpose(0, 1))


def test_bad_quant_arguments_are_clear_errors():
    q, k, v = _qkv(2, 2, 32, 32, 32)
    with pytest.raises(ValueError, match="quant='int4' is not supported.*'int8', 'int8-fp8'"):
        sparse_attn.attention(q, k, v, quant="int4")
    with pytest.raises(ValueError, match="quant_granularity='per_row'.*'per_block', 'per_warp', 'per_thread'"):
        sparse_attn.attention(q, k, v, quant="int8", quant_granularity="per_row")
    # without quant a typo was ignored, and smooth_k="no" (truthy) smoothed
    with pytest.raises(ValueError, match="quant_granularity='per_row'"):
        sparse_attn.attention(q, k, v, quant_granularity="per_row")
    assert torch.equal(sparse_attn.attention(q, k, v, quant_granularity="per_thread"), sparse_attn.attention(q, k, v))
    with pytest.raises(TypeError, match="smooth_k must be True or False, got str 'no'"):
        sparse_attn.attention(q, k, v, quant="int8", smooth_k="no")
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        sparse_attn.attention(q, k, v, return_lse="no")
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="quant_granularity='per_row'"):
        sparse_attn.varlen_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 32, 32,
                                     quant_granularity="per_row")


def test_kernel_shape_limits_are_clear_errors():
    """What the 8-bit MMAs cannot take fails in validation, before any launch: head dims below 32 (an
    int8 MMA reads 32 channels at a time; the compile failed) and, for FP8 P.V, key blocks below 32
    (an FP8 MMA reads 32 keys at a time; kernel tiles divide the layout's blocks). Both found by
    tests/gpu/test_fuzz_gpu.py."""
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.sage import sage_attention_op
    q, k, v = _qkv(2, 2, 64, 64, 16, dtype=torch.float16)
    lay = _kernel_layout(None, False, 64, 64, "cpu")
    with pytest.raises(ValueError, match="head_dim a multiple of 16 and at least 32.*got 16"):
        sage_attention_op(q, k, v, lay, quant="int8", granularity="per_warp", smooth_k=True)
    q, k, v = _qkv(2, 2, 64, 64, 32, dtype=torch.float16)
    lay = patterns.local(64, 20, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="block_k a multiple of 32.*got block_k=16.*quant='int8'"):
        sage_attention_op(q, k, v, lay, quant="int8-fp8", granularity="per_warp", smooth_k=True)
    # 48 >= 32, but no tile of 32 keys or more divides it: the launcher fell back to 16-key FP8 tiles
    q, k, v = _qkv(2, 2, 96, 96, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_k a multiple of 32.*got block_k=48"):
        sage_attention_op(q, k, v, patterns.local(96, 40, block_q=48, block_k=48), quant="int8-fp8",
                          granularity="per_warp", smooth_k=True)


@pytest.mark.parametrize("d", [8, 24])
def test_the_cpu_twin_refuses_what_the_kernels_cannot_run(d):
    """The public entries check the kernels' shape limits on every device, so a call tried on a CPU
    does not first fail on the GPU (the twin used to accept head_dim 8 and FP8 with block_k 16)."""
    q, k, v = _qkv(1, 1, 32, 32, d, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"head_dim a multiple of 16 and at least 32.*got {d}"):
        sparse_attn.attention(q, k, v, quant="int8")
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"head_dim a multiple of 16 and at least 32.*got {d}"):
        sparse_attn.varlen_attention(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 32, 32, quant="int8")
    q, k, v = _qkv(1, 1, 32, 32, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_k a multiple of 32.*got block_k=16"):
        sparse_attn.attention(q, k, v, patterns.local(32, 4, block_q=16, block_k=16), quant="int8-fp8")
    assert sparse_attn.attention(q, k, v, patterns.local(32, 4, block_q=16, block_k=16), quant="int8").shape == q.shape
    v48 = torch.randn(1, 1, 32, 48)  # the 8-bit kernels need Dv == D; the twin ran it
    with pytest.raises(ValueError, match="v's head_dim equal to q/k's, got 48 and 32"):
        sparse_attn.attention(q, k, v48, quant="int8")
    with pytest.raises(ValueError, match="v's head_dim equal to q/k's, got 48 and 32"):
        sparse_attn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v48[0].transpose(0, 1), cu, cu, 32, 32,
                                     quant="int8")


@pytest.mark.parametrize("d", [272, 512])
def test_the_cpu_twin_refuses_head_dims_above_the_kernels_limit(d):
    """head_dim 272 / 512 ran on the CPU twin while the kernels refuse anything above 256."""
    q = torch.randn(1, 1, 32, d)
    with pytest.raises(ValueError, match=f"head_dim up to 256, got {d}"):
        sparse_attn.attention(q, q, q, quant="int8")


@pytest.mark.parametrize("gran", GRANS)
def test_group_amax_shares_one_scale_per_group(gran):
    (qs, qp), (ks, kp) = GRANULARITY[gran]
    for span, period in ((qs, qp), (ks, kp)):
        x = torch.randn(3, 300, 16)
        _, scale = twin.quantize_rows(x, span, period)
        amax = x.abs().amax(-1)
        for r in (0, 5, 131, 299):
            base = r - r % span
            group = [i for i in range(base, min(base + span, 300)) if i % period == r % period]
            assert torch.allclose(scale[:, r], amax[:, group].amax(-1) / 127)


# --------------------------------------------------------------------- the kernels, interpreted
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")


@interp
@pytest.mark.interpreter
@pytest.mark.parametrize("gran", GRANS)
def test_quantize_kernel_matches_twin_exactly(gran):
    from sparse_attn.ops.sage import launch
    (qs, qp), (ks, kp) = GRANULARITY[gran]
    _, k, _ = _qkv(2, 3, 8, 200, 32, k_offset=3.0, dtype=torch.float16)
    mean = launch.k_mean(k, False)
    k8, s = launch.quantize_rows(k, ks, kp, mean, False)
    torch.testing.assert_close(mean, k.float().mean(-2), rtol=1e-6, atol=1e-6)
    r8, rs = twin.quantize_rows(k, ks, kp, mean)  # the kernel's own mean: the rows, not the sum, are tested
    assert torch.equal(k8, r8) and torch.equal(s, rs)
    # packed: each sequence's groups start at its first token, as if it were quantized alone
    packed = k[0].transpose(0, 1).contiguous()  # [T, H, D]
    cu = torch.tensor([0, 21, 150, 200], dtype=torch.int32)
    p8, ps = launch.quantize_rows(packed, qs, qp, None, True, cu, 129)
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        r8, rs = twin.quantize_rows(k[0, :, a:e], qs, qp)
        assert torch.equal(p8[a:e], r8.transpose(0, 1)) and torch.equal(ps[:, a:e], rs)
    with pytest.raises(ValueError, match="cu_seqlens"):
        launch.quantize_rows(packed, qs, qp, None, True)


@interp
@pytest.mark.interpreter
def test_packed_fp8_v_starts_every_sequence_at_an_aligned_column():
    """The packed FP8 V^T puts sequence b at column vt_column0 (a multiple of 16, for TMA), zeros up
    to its next multiple of 16; values and channel scales equal those of the sequence quantized alone."""
    from sparse_attn.ops.sage import launch
    lens = [1, 21, 16, 130]
    cu = torch.tensor([0, 1, 22, 38, 168], dtype=torch.int32)
    v = torch.randn(168, 2, 32, dtype=torch.float16) * torch.tensor([1.0, 5.0])[:, None]
    vt, scale = launch.quantize_v_fp8(v, True, cu, max(lens))
    assert scale.shape == (4, 2, 32) and vt.shape[-1] == launch.vt_columns(168, 4)
    ends = []
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        alone, alone_scale = launch.quantize_v_fp8(v[a:a + n].transpose(0, 1)[None], False)  # [1, H, D, Lp]
        assert torch.equal(scale[b], alone_scale[0])
        c0 = (a + 16 * b + 15) // 16 * 16
        assert c0 % 16 == 0 and c0 >= (ends[-1] if ends else 0)
        assert torch.equal(vt[..., c0:c0 + n].view(torch.uint8), alone[0, ..., :n].view(torch.uint8))
        pad = -n % 16
        assert torch.all(vt[..., c0 + n:c0 + n + pad].float() == 0)
        ends.append(c0 + n + pad)
    assert ends[-1] <= vt.shape[-1]


@interp
@pytest.mark.interpreter
@pytest.mark.parametrize("case", [("dense", 2, 1, 70, 70), ("local", 4, 2, 100, 90), ("random", 4, 4, 64, 128),
                                  ("block_diagonal", 2, 2, 96, 96)])
def test_int8_kernel_matches_twin(case, one_thread):
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.sage import sage_attention_op
    pattern, hq, hkv, lq, lk = case
    q, k, v = _qkv(hq, hkv, lq, lk, 32, k_offset=2.0, dtype=torch.float16)
    lay = LAYOUTS[pattern](lq, lk)
    causal = pattern == "local"
    out, lse = sage_attention_op(q, k, v, _kernel_layout(lay, causal, lq, lk, "cpu"), quant="int8",
                                 granularity="per_warp", smooth_k=True)
    ref = twin.attention(q, k, v, lay, causal=causal, quant="int8")
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert (out.float() - ref.float()).abs().max() < 4e-3
    cos, l1 = _accuracy(out.float(), reference.attention(q.float(), k.float(), v.float(), lay, causal=causal))
    assert cos >= 0.999 and l1 <= 0.02


@interp
@pytest.mark.interpreter
def test_kernel_lse_with_unsmoothed_lse_is_that_of_the_scores(one_thread):
    """The 8-bit kernel's LSE is that of the smoothed scores; ``unsmoothed_lse`` adds back what
    smoothing removed (with the K mean the quantization took), dense and packed alike. A K offset of
    4 moves the smoothed LSE far from the true one, so the flag must matter."""
    from sparse_attn import varlen
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.sage import sage_attention_op, sage_varlen_attention_op
    q, k, v = _qkv(4, 2, 40, 70, 32, k_offset=4.0, dtype=torch.float16)
    lay = LAYOUTS["local"](40, 70)
    _, lse_ref = reference.attention(q.float(), k.float(), v.float(), lay, causal=True, return_lse=True)
    kl = _kernel_layout(lay, True, 40, 70, "cpu")
    _, smoothed = sage_attention_op(q, k, v, kl, quant="int8", granularity="per_warp", smooth_k=True)
    _, lse = sage_attention_op(q, k, v, kl, quant="int8", granularity="per_warp", smooth_k=True, unsmoothed_lse=True)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse)) and fin.any()
    assert (lse[fin] - lse_ref[fin]).abs().max() < 0.05
    assert (smoothed[fin] - lse_ref[fin]).abs().max() > 1.0
    # packed: each sequence's rows shifted by that sequence's own K mean (one has a single token)
    lens = [37, 1, 26]
    cu = torch.tensor([0, 37, 38, 64], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    shift = 4.0 * torch.randn(32, generator=g)
    q, k, v = (torch.randn(64, 2, 32, generator=g) for _ in range(3))
    k = k + shift
    q, k, v = (t.half() for t in (q, k, v))
    per_seq = varlen.build_layouts(lens, lens, None, None, causal=True)
    stacked = varlen.stack(per_seq, max(lens), max(lens), 2)
    _, lse = sage_varlen_attention_op(q, k, v, stacked, cu, cu, max(lens), max(lens), tuple(lens), quant="int8",
                                      granularity="per_warp", smooth_k=True, unsmoothed_lse=True)
    assert lse.shape == (2, 64)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        _, want = reference.attention(*(t[a:e].transpose(0, 1)[None].float() for t in (q, k, v)), per_seq[b],
                                      return_lse=True)
        assert (lse[:, a:e] - want[0]).abs().max() < 0.05, b


@interp
@pytest.mark.interpreter
def test_packed_statistics_are_per_sequence():
    """K's mean and V's channel amax of packed inputs are taken per sequence (an empty one: 0)."""
    from sparse_attn.ops.sage import launch
    cu = torch.tensor([0, 3, 3, 1500, 1501], dtype=torch.int32)  # 1497 tokens: two chunks of 1024
    x = torch.randn(1501, 2, 48, dtype=torch.float16) + torch.arange(48) / 8
    mean = launch.k_mean(x, True, cu, 1497)
    both = launch.kv_stats(x, x, True, cu, 1497)
    assert torch.equal(both[0], mean)
    amax = both[1] * 448.0  # the V scale: amax / 448 (an empty sequence's: 1)
    assert mean.shape == amax.shape == (4, 2, 48)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seg = x[a:e].float()
        want_mean = seg.mean(0) if e > a else torch.zeros(2, 48)
        want_amax = seg.abs().amax(0) if e > a else torch.full((2, 48), 448.0)
        torch.testing.assert_close(mean[b], want_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(amax[b], want_amax, rtol=1e-6, atol=0)


@interp
@pytest.mark.interpreter
@pytest.mark.parametrize("gran", ["per_warp", "per_thread"])
def test_int8_varlen_kernel_equals_per_sequence_calls(gran, one_thread):
    """Packed sequences are quantized as if alone: scale groups start at each sequence (the kernel
    then takes one K scale per key tile there too) and K's mean is the sequence's own. Without
    smoothing each sequence's output is bit for bit that of a call on it alone; with it, up to the
    mean's summation order (a chunked sum here, torch's mean there)."""
    from sparse_attn import varlen
    from sparse_attn.ops.sage import sage_attention_op, sage_varlen_attention_op
    lens = [37, 1, 90]
    cu = torch.tensor([0, 37, 38, 128], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(128, 2, 32, generator=g).half() for _ in range(3))
    per_seq = varlen.build_layouts(lens, lens, None, None, causal=True)
    stacked = varlen.stack(per_seq, max(lens), max(lens), 2)
    for smooth in (False, True):
        out, _ = sage_varlen_attention_op(q, k, v, stacked, cu, cu, max(lens), max(lens), tuple(lens), quant="int8",
                                          granularity=gran, smooth_k=smooth)
        for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            one, _ = sage_attention_op(*(t[a:e].transpose(0, 1)[None] for t in (q, k, v)), per_seq[b],
                                       quant="int8", granularity=gran, smooth_k=smooth)
            one = one[0].transpose(0, 1)
            if smooth:
                assert metrics.relative_l1(out[a:e], one) <= 1e-3, b
            else:
                assert torch.equal(out[a:e], one), b


@interp
@pytest.mark.interpreter
def test_one_k_scale_per_tile_equals_per_key_scales(one_thread):
    """K groups spanning whole tiles (per_block / per_warp: 128 keys) let the kernel fold the tile's K
    scale into the row factor (kernels._scores, KS_PER_TILE); the per-key path must give the same
    output. The layout's last block (keys 64..127 of 70) has a tile wholly past the sequence end, and
    the scale row is poisoned with NaN past its 70 keys: the folded path must not read there."""
    import math

    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.block_sparse import forward_layout_inputs
    from sparse_attn.ops.block_sparse import launch as bs_launch
    from sparse_attn.ops.sage import launch
    (qs, qp), (ks, kp) = GRANULARITY["per_warp"]
    assert (ks, kp) == (128, 1)
    lq, lk = 50, 70
    q, k, v = _qkv(2, 1, lq, lk, 32, k_offset=2.0, dtype=torch.float16)
    lay = _kernel_layout(patterns.local(lq, 40, kv_len=lk, block_q=32, block_k=64), True, lq, lk, "cpu")
    q8, q_s = launch.quantize_rows(q, qs, qp, None, False)
    k8, k_s = launch.quantize_rows(k, ks, kp, launch.k_mean(k, False), False)
    poisoned = torch.full((1, 1, 256), float("nan"))
    poisoned[..., :lk] = k_s
    rows = forward_layout_inputs(lay)
    outs = []
    for span, scales in ((0, k_s), (ks, poisoned[..., :lk])):
        out, lse = bs_launch.forward(q8, k8, v, *rows, None, None, lay.block_q, lay.block_k,
                                     1 / math.sqrt(32), lq, lk, 1, (q_s, scales, None), 1, q.dtype, k_scale_span=span)
        assert not out.isnan().any() and not lse.isnan().any()
        outs.append(out.float())
    assert (outs[0] - outs[1]).abs().max() < 2e-3
    ref = twin.attention(q, k, v, patterns.local(lq, 40, kv_len=lk, block_q=32, block_k=64), causal=True, quant="int8")
    assert (outs[1] - ref.float()).abs().max() < 4e-3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_shows_in_its_scale_group_only(bad):
    """A NaN or inf went silently into its group's scale (NaN -> scale 1, every row rounded to whole
    numbers; inf -> every value 0): now that group's rows come out NaN, as a NaN row does without
    quantization, and every other row is untouched."""
    q, k, v = _qkv(2, 2, 64, 64, 32)
    q[0, 0, 5, 3] = bad
    out = sparse_attn.attention(q, k, v, quant="int8", quant_granularity="per_warp")
    clean = q.clone()
    clean[0, 0, 5, 3] = 0.0
    ref = sparse_attn.attention(clean, k, v, quant="int8", quant_granularity="per_warp")
    nan_rows = out[0, 0].isnan().any(-1).nonzero()[:, 0].tolist()
    assert nan_rows == list(range(16))  # the 16-row per_warp group of row 5
    assert torch.equal(out[0, 0, 16:], ref[0, 0, 16:]) and torch.equal(out[0, 1], ref[0, 1])
    v[0, 1, 7, 2] = bad  # an FP8 V channel with it: NaN, not rounded at scale 1
    fp8 = sparse_attn.attention(clean, k, v, quant="int8-fp8")
    assert fp8[0, 1, :, 2].isnan().all() and not fp8[0, 0].isnan().any()
    # as the README says: the channel's scale covers all keys, so rows that never see key 7 get it too
    local = patterns.local(64, 4, block_q=16, block_k=32)
    assert not local.to_token_mask()[0, 0, 40:, 7].any()
    fp8 = sparse_attn.attention(clean, k, v, local, quant="int8-fp8")
    assert fp8[0, 1, :, 2].isnan().all() and not fp8[0, 1, :, [0, 1, 3]].isnan().any()


@pytest.mark.parametrize("quant", ["int8", "int8-fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_does_not_spread_through_the_smoothing_mean(quant, bad):
    """K smoothing subtracted K's mean over all tokens: one NaN / inf key made the mean, hence every
    key, hence every row of the head non-finite (256 of 256 rows). That channel is now left
    unsmoothed, so the bad key reaches only the rows that visit its scale group's keys (128 keys),
    the same rows as with smooth_k=False."""
    q, k, v = _qkv(2, 2, 256, 256, 32)
    k[0, 0, 250, 5] = bad
    out = sparse_attn.attention(q, k, v, causal=True, quant=quant)
    unsmoothed = sparse_attn.attention(q, k, v, causal=True, quant=quant, smooth_k=False)
    bad_rows = (~torch.isfinite(out[0, 0])).any(-1)
    assert torch.equal(bad_rows, (~torch.isfinite(unsmoothed[0, 0])).any(-1))
    assert not bad_rows[:128].any() and bool(bad_rows[250:].all())  # causal rows < 128 never see key 250
    assert torch.isfinite(out[0, 1]).all()


@interp
@pytest.mark.interpreter
def test_kernel_k_mean_leaves_non_finite_channels_unsmoothed(one_thread):
    from sparse_attn.ops.sage import launch as sage_launch
    k = torch.randn(1, 2, 40, 32)
    k[0, 1, 7, 3] = float("nan")
    mean = sage_launch.k_mean(k, False)
    want = k.mean(2)
    assert mean[0, 1, 3] == 0 and torch.isfinite(mean).all()
    want[0, 1, 3] = 0.0
    torch.testing.assert_close(mean, want)
    packed = k[0].transpose(0, 1).contiguous()  # [T, H, D], two sequences of 20 tokens
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    seq_mean = sage_launch.k_mean(packed, True, cu, 20)
    assert seq_mean[0, 1, 3] == 0 and seq_mean[1, 1, 3] != 0  # only the sequence holding the NaN


def test_fp8_without_keys_gives_zeros():
    q, k, v = _qkv(2, 2, 5, 0, 32)
    out, lse = sparse_attn.attention(q, k, v, quant="int8-fp8", return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool(lse.isneginf().all())


@interp
@pytest.mark.interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
# the kernel casts a bad group's values to int8 as they are (NaN included: numpy warns under the
# interpreter); the group's NaN scale means they are never used, so no per-element clean-up is paid
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_row_quantization_kernel_flags_non_finite_groups_as_the_twin_does(bad, one_thread):
    from sparse_attn.ops.sage import launch as sage_launch
    x = torch.randn(1, 2, 40, 32)
    x[0, 1, 20, 4] = bad
    xq, scale = sage_launch.quantize_rows(x, 16, 1, None, False)
    tq, tscale = twin.quantize_rows(x, 16, 1)
    assert torch.equal(scale.isnan(), tscale.isnan()) and scale[0, 1, 16:32].isnan().all()
    fin = ~tscale.isnan()
    torch.testing.assert_close(scale[fin], tscale[fin])
    assert torch.equal(xq[fin], tq[fin])


def test_lse_is_that_of_the_unsmoothed_scores_with_gqa():
    """The smoothing shift added back to the LSE uses each query head's own kv head (h // group):
    with 2 kv heads whose K carry different large offsets, every query head's 8-bit LSE stays close to
    the full-precision one (dense, padded and varlen calls alike)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 100, 32, generator=g)
    k = torch.randn(1, 2, 130, 32, generator=g)
    v = torch.randn(1, 2, 130, 32, generator=g)
    k = k + torch.stack([4.0 * torch.randn(32, generator=g), -6.0 * torch.randn(32, generator=g)])[None, :, None]
    lay = patterns.local(100, 48, kv_len=130, block_q=32, block_k=32)
    _, lse_ref = reference.attention(q, k, v, lay, return_lse=True)
    _, lse = sparse_attn.attention(q, k, v, lay, quant="int8", return_lse=True)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - lse_ref[fin]).abs().max() < 0.05
    # packed: [T, H, D], one sequence of 100 queries over 130 keys
    cu_q, cu_k = torch.tensor([0, 100], dtype=torch.int32), torch.tensor([0, 130], dtype=torch.int32)
    pq, pk, pv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    _, lse_v = sparse_attn.varlen_attention(pq, pk, pv, cu_q, cu_k, 100, 130, layouts=[lay], quant="int8",
                                            return_lse=True)
    assert (lse_v[fin[0]] - lse_ref[0][fin[0]]).abs().max() < 0.05


def test_int8_fp8_twin_rounds_the_probabilities_of_pv_to_e4m3():
    """The int8-fp8 twin (what the FP8 P.V kernel is held to) rounds P = exp(s - rowmax), times 448, to
    e4m3 in P.V, but normalises with the unrounded row sum: a dense case computed step by step."""
    from sparse_attn.ops.sage import reference as twin
    from sparse_attn.ops.sage.granularity import FP8_MAX, GRANULARITY
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    (qs, qp), (ks, kp) = GRANULARITY["per_warp"]
    mean = k.mean(-2)
    q8, q_scale = twin.quantize_rows(q, qs, qp)
    k8, k_scale = twin.quantize_rows(k, ks, kp, mean)
    qd, kd = q8.float() * q_scale[..., None], k8.float() * k_scale[..., None]
    vd = twin.quantize_v_fp8(v)[0]
    s = qd @ kd.transpose(-1, -2) / 32 ** 0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    want = (twin.fp8_round(e * FP8_MAX) / FP8_MAX) @ vd / e.sum(-1, keepdim=True)
    got = twin.attention(q, k, v, quant="int8-fp8")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_packed_lse_shift_uses_each_query_heads_own_kv_head_and_sequence():
    """packed_lse_shift (what the packed 8-bit kernels add back to the LSE): for token t of sequence s
    and query head h, scale * q[t, h] . mean[s, h // group], here with GQA (4 query heads, 2 kv heads)."""
    from sparse_attn.ops.sage import reference as twin
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q = torch.randn(12, 4, 32, generator=g)
    mean = torch.randn(3, 2, 32, generator=g)
    got = twin.packed_lse_shift(q, mean, cu, None)
    want = torch.empty(4, 12)
    for s, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(a, e):
            for h in range(4):
                want[h, t] = (q[t, h] @ mean[s, h // 2]) / 32 ** 0.5
    torch.testing.assert_close(got, want)


def test_int8_varlen_with_other_key_lengths_equals_per_sequence_calls():
    """Packed 8-bit attention on the CPU, sequences whose key lengths differ from their query lengths:
    each sequence equals its own sparse_attn.attention(quant='int8') call (its own K/V slice)."""
    g = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0, 20, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 40, 110], dtype=torch.int32)
    q = torch.randn(50, 4, 32, generator=g)
    k, v = torch.randn(110, 2, 32, generator=g), torch.randn(110, 2, 32, generator=g)
    out, lse = sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 30, 70, causal=True, quant="int8", return_lse=True)
    for (a, e), (c, f) in zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        o1, l1 = sparse_attn.attention(q[a:e].transpose(0, 1)[None], k[c:f].transpose(0, 1)[None],
                                       v[c:f].transpose(0, 1)[None], causal=True, quant="int8", return_lse=True)
        torch.testing.assert_close(out[a:e], o1[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, a:e], l1[0])


@interp
@pytest.mark.interpreter
def test_compiled_8bit_kernels_take_transposed_inputs(one_thread):
    """The 8-bit op's fake gave the output q's strides (empty_like) while the op returns it contiguous: a
    compiled graph over [B, L, H, D] activations viewed as [B, H, L, D] failed (inductor's stride assert on
    the H100; here the reshape after attention), for dense and packed inputs alike."""
    import sparse_attn
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.sage import sage_attention_op, sage_varlen_attention_op
    B, L, H, D = 1, 40, 2, 32
    lay = sparse_attn.prepare(_kernel_layout(None, True, L, L, "cpu"), backward=False)
    x = [torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(i)).half() for i in range(3)]

    def dense(q, k, v):
        out, _ = sage_attention_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lay, quant="int8",
                                   granularity="per_warp", smooth_k=True)
        return out.transpose(1, 2).reshape(B, L, H * D)

    cu = torch.tensor([0, L], dtype=torch.int32)

    def packed(q, k, v):  # [T, H, D] views of [H, T, D] tensors
        out, _ = sage_varlen_attention_op(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                          lay, cu, cu, L, L, (L,), quant="int8", granularity="per_warp",
                                          smooth_k=True)
        return out.transpose(0, 1).reshape(H * L, D)

    for fn, inputs in ((dense, x), (packed, [t.transpose(1, 2).contiguous() for t in x])):
        want = fn(*inputs)  # eager first: it also caches the packed call's schedule
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
        assert torch.equal(got, want), fn.__name__


@interp
@pytest.mark.interpreter
def test_fp8_kernels_without_keys_give_zeros(one_thread):
    """quant='int8-fp8' on the kernels with no keys (Lk = 0) failed in V's channel amax (torch.aminmax over an
    empty token dim: IndexError) where the twin and quant='int8' give output 0 and LSE -inf."""
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.sage import sage_attention_op
    q, k, v = _qkv(2, 2, 5, 0, 32, dtype=torch.float16)
    for quant in ("int8", "int8-fp8"):
        out, lse = sage_attention_op(q, k, v, _kernel_layout(None, False, 5, 0, "cpu"), quant=quant,
                                     granularity="per_warp", smooth_k=True, unsmoothed_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and bool(lse.isneginf().all()), quant


@interp
@pytest.mark.interpreter
def test_int8_varlen_kernels_read_strided_cu_seqlens_as_their_values(one_thread):
    """A stride-2 cu_seqlens view (which varlen_attention accepts: it reads the offsets on the host) reached the
    8-bit kernels as it was, read as if packed: other sequences' bounds, outputs off by 3e4. The fp16/bf16 op
    made its offsets unit-stride (_offsets); the 8-bit op now does too."""
    from sparse_attn import varlen
    from sparse_attn.ops.sage import sage_varlen_attention_op
    lens = [17, 1, 40]
    cu = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    strided = torch.stack([cu, cu.roll(-1)], 1).flatten()[::2]
    assert strided.stride(0) == 2 and torch.equal(strided, cu)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(58, 2, 32, generator=g).half() for _ in range(3))
    stacked = varlen.stack(varlen.build_layouts(lens, lens, None, None, causal=True), 40, 40, 2)
    for smooth in (False, True):
        want, want_lse = sage_varlen_attention_op(q, k, v, stacked, cu, cu, 40, 40, tuple(lens), quant="int8",
                                                  granularity="per_warp", smooth_k=smooth, unsmoothed_lse=True)
        got, lse = sage_varlen_attention_op(q, k, v, stacked, strided, strided, 40, 40, tuple(lens), quant="int8",
                                            granularity="per_warp", smooth_k=smooth, unsmoothed_lse=True)
        assert torch.equal(got, want) and torch.equal(lse, want_lse), smooth


def test_the_8bit_lse_is_fp32_under_autocast():
    """With smooth_k the LSE gets back scale * q . mean_k, an einsum that CPU autocast ran in bf16: the
    int8 LSE was 0.10 off under autocast against 0.006 without, its dtype still float32, the output
    unchanged. Packed (varlen) inputs alike."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 128, 64, generator=g)
    k = torch.randn(1, 2, 128, 64, generator=g) + 8 * torch.randn(64, generator=g)  # a per-channel K offset
    v = torch.randn(1, 2, 128, 64, generator=g)
    _, plain = sparse_attn.attention(q, k, v, quant="int8", return_lse=True)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 128], dtype=torch.int32)
    _, plain_packed = sparse_attn.varlen_attention(*packed, cu, cu, 128, 128, quant="int8", return_lse=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, lse = sparse_attn.attention(q, k, v, quant="int8", return_lse=True)
        _, lse_packed = sparse_attn.varlen_attention(*packed, cu, cu, 128, 128, quant="int8", return_lse=True)
    assert lse.dtype == torch.float32 and lse_packed.dtype == torch.float32
    assert (lse - plain).abs().max().item() < 1e-5
    assert (lse_packed - plain_packed).abs().max().item() < 1e-5


@interp
@pytest.mark.interpreter
@pytest.mark.parametrize("varlen", [False, True])
def test_kv_stats_take_k_mean_and_v_scale_in_one_pass(varlen, one_thread):
    """kv_stats' launches give what torch's separate reductions give: K's smoothing mean and V's FP8
    channel scale, per batch row (or packed sequence) and head, a NaN in V kept (the hardware max
    drops it: the channel would have been rounded at a finite scale, silently), an all-zero channel
    scale 1."""
    from sparse_attn.ops.sage import launch as sage_launch
    k = torch.randn(2, 3, 1100, 40) + torch.arange(40) / 4  # two chunks of 1024 rows, D padded to 64
    v = torch.randn(2, 3, 1100, 40) * torch.linspace(0.1, 9, 40)
    v[1, 2, 1050, 7] = float("nan")
    v[0, 0, :, 0] = 0.0  # an all-zero channel: scale 1
    k[0, 1, 3, 5] = float("inf")
    if varlen:
        cu = torch.tensor([0, 1100, 2200], dtype=torch.int32)
        pk, pv = (x.transpose(1, 2).reshape(2200, 3, 40) for x in (k, v))
        mean, scale = sage_launch.kv_stats(pk, pv, True, cu, 1100)
    else:
        mean, scale = sage_launch.kv_stats(k, v, False)
    want_mean = k.mean(2)
    want_mean[0, 1, 5] = 0.0  # a non-finite channel is not smoothed
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-5)
    want = twin.v_channel_scale(v.abs().amax(2))
    assert want[1, 2, 7].isnan() and want[0, 0, 0] == 1.0
    assert torch.allclose(scale, want, equal_nan=True, rtol=0, atol=0)
    assert sage_launch.kv_stats(None, None, varlen)[0] is None
