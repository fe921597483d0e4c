"""sparse_attn.metrics (values, fp64 computation, NaN policy) and the sparse_attn.testing helpers."""
from __future__ import annotations

import math

import pytest
import torch

from sparse_attn import metrics
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term
from sparse_attn.testing import (assert_close_to_oracle, causal_token_mask, default_atol_floor,
                                 naive_masked_attention, oracle_attention, random_qkv)

ERROR_METRICS = [metrics.cosine_similarity, metrics.relative_l1, metrics.rmse, metrics.max_abs_error]


# ----------------------------------------------------------------------------- values
def test_values_on_a_literal():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = torch.tensor([1.0, 2.0, 2.0, 6.0])
    assert metrics.max_abs_error(a, b) == 2.0
    assert metrics.rmse(a, b) == pytest.approx(math.sqrt((0 + 0 + 1 + 4) / 4))
    assert metrics.relative_l1(a, b) == pytest.approx(3.0 / 11.0)
    assert metrics.relative_l1(b, a) == pytest.approx(3.0 / 10.0)  # b is the reference: not symmetric
    dot, na, nb = 1 + 4 + 6 + 24, math.sqrt(30), math.sqrt(45)
    assert metrics.cosine_similarity(a, b) == pytest.approx(dot / (na * nb))


@pytest.mark.parametrize("shapes", [((3, 5, 7), (3, 5, 7)), ((2, 1, 9), (1, 4, 9)), ((41,), (41,))])
def test_chunked_passes_equal_one_float64_pass(monkeypatch, shapes):
    """The metrics run over chunks of CHUNK elements; with chunks of 8 they must equal the plain
    float64 formulas on the whole tensors, and a NaN in the last chunk still makes every one nan."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(*shapes[0], generator=g, dtype=torch.float32)
    b = (torch.randn(*shapes[1], generator=g) * 3).to(torch.float16)
    x, y = torch.broadcast_tensors(a.double(), b.double())
    d = x - y
    want = {"cosine": float((x * y).sum() / (x.norm() * y.norm())), "relative_l1": float(d.abs().sum() / y.abs().sum()),
            "rmse": float(d.square().mean().sqrt()), "max_abs_error": float(d.abs().max())}
    monkeypatch.setattr(metrics, "CHUNK", 8)
    got = metrics.compare(a, b)
    assert got["finite"] is True
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    a.reshape(-1)[-1] = float("nan")
    bad = metrics.compare(a, b)
    assert bad["finite"] is False and all(math.isnan(bad[name]) for name in want)


def test_precision_metric_uses_spargeattn_names(capsys):
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 2.0, 6.0])
    m = metrics.compare(a, b)
    assert metrics.precision_metric(a, b, verbose=True) == {"Cossim": m["cosine"], "L1": m["relative_l1"],
                                                            "RMSE": m["rmse"]}
    assert capsys.readouterr().out.strip() == f"Cossim: {round(m['cosine'], 4)}, L1: 0.2727, RMSE: 1.118"


def test_identical_and_opposite():
    x = torch.randn(3, 4, 5, 8)
    assert metrics.cosine_similarity(x, x) == pytest.approx(1.0)
    assert metrics.cosine_similarity(x, -x) == pytest.approx(-1.0)
    assert metrics.cosine_similarity(3 * x, x) == pytest.approx(1.0)  # scale invariant
    for m in (metrics.relative_l1, metrics.rmse, metrics.max_abs_error):
        assert m(x, x) == 0.0
    assert metrics.relative_l1(2 * x, x) == pytest.approx(1.0)


def test_zero_inputs():
    z, x = torch.zeros(10), torch.ones(10)
    assert metrics.cosine_similarity(z, z) == 1.0
    assert metrics.cosine_similarity(z, x) == 0.0 and metrics.cosine_similarity(x, z) == 0.0
    assert metrics.relative_l1(z, z) == 0.0
    assert metrics.relative_l1(x, z) == math.inf
    assert metrics.relative_l1(z, x) == 1.0


def test_empty_inputs():
    e = torch.zeros(0, 4)
    assert metrics.cosine_similarity(e, e) == 1.0
    assert metrics.relative_l1(e, e) == 0.0
    assert metrics.rmse(e, e) == 0.0 and metrics.max_abs_error(e, e) == 0.0


def test_broadcast_and_return_type():
    a, b = torch.ones(2, 3), torch.ones(3) * 2
    assert metrics.max_abs_error(a, b) == 1.0
    for m in ERROR_METRICS:
        assert type(m(a, b)) is float


def test_computed_in_float64():
    """fp16/bf16 inputs: sums that overflow or lose all precision in the input dtype stay exact."""
    a = torch.full((4096,), 60000.0, dtype=torch.float16)  # sum 2.4e8 overflows fp16
    b = torch.full((4096,), 59968.0, dtype=torch.float16)
    assert metrics.relative_l1(a, b) == pytest.approx(32.0 / 59968.0, rel=1e-12)
    assert metrics.rmse(a, b) == pytest.approx(32.0, rel=1e-12)
    assert metrics.cosine_similarity(a, b) == pytest.approx(1.0, abs=1e-12)
    x = torch.ones(1 << 20, dtype=torch.bfloat16)
    y = x.clone()
    y[0] = 2.0
    assert metrics.relative_l1(y, x) == pytest.approx(1.0 / (1 << 20), rel=1e-12)
    # small differences between nearly equal fp32 vectors: cosine must not round to exactly 1
    u = torch.randn(1000, dtype=torch.float64)
    w = u + 1e-5 * torch.randn(1000, dtype=torch.float64)
    exact = float((u * w).sum() / (u.norm() * w.norm()))
    assert metrics.cosine_similarity(u.float(), w.float()) == pytest.approx(exact, abs=1e-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["a", "b"])
@pytest.mark.parametrize("metric", ERROR_METRICS, ids=lambda m: m.__name__)
def test_non_finite_is_nan_and_never_good(metric, where, bad):
    a, b = torch.randn(50), torch.randn(50)
    (a if where == "a" else b)[7] = bad
    got = metric(a, b)
    assert math.isnan(got)
    assert not got <= 1e9 and not got >= -1e9, "a NaN metric must fail every threshold"


def test_nan_in_low_precision():
    a = torch.randn(20).bfloat16()
    b = a.clone()
    b[3] = float("nan")
    assert all(math.isnan(m(a, b)) for m in ERROR_METRICS)


def test_compare_dict():
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    got = metrics.compare(a, b)
    assert set(got) == {"cosine", "relative_l1", "rmse", "max_abs_error", "finite"}
    assert got["cosine"] == metrics.cosine_similarity(a, b)
    assert got["relative_l1"] == metrics.relative_l1(a, b)
    assert got["rmse"] == metrics.rmse(a, b)
    assert got["max_abs_error"] == metrics.max_abs_error(a, b)
    assert got["finite"] is True
    a[0, 0] = float("nan")
    bad = metrics.compare(a, b)
    assert bad["finite"] is False
    assert all(math.isnan(bad[k]) for k in ("cosine", "relative_l1", "rmse", "max_abs_error"))


def test_sparsity():
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=64, block_q=16, block_k=16)
    assert metrics.sparsity(layout) == pytest.approx(6 / 16)
    assert metrics.sparsity(layout) == layout.sparsity
    mask = causal_token_mask(4, 4)
    assert metrics.sparsity(mask) == pytest.approx(6 / 16)
    assert metrics.sparsity(torch.ones(3, 5, dtype=torch.bool)) == 0.0
    assert metrics.sparsity(torch.zeros(2, 2, 7, dtype=torch.bool)) == 1.0
    with pytest.raises(TypeError, match=r"bool tensor, got a torch\.float32 tensor"):
        metrics.sparsity(torch.ones(3))
    with pytest.raises(TypeError, match=r"got list"):
        metrics.sparsity([True])
    # an empty grid skips nothing, for a layout as for a mask (the layout said 1.0)
    empty = BlockLayout.from_block_mask(torch.ones(0, 0, dtype=torch.bool), block_q=16, block_k=16)
    assert empty.sparsity == metrics.sparsity(empty) == metrics.sparsity(torch.zeros(0, dtype=torch.bool)) == 0.0


def test_complex_inputs_are_refused():
    with pytest.raises(TypeError, match="real tensors, got torch.complex64"):  # the imaginary part was dropped
        metrics.compare(torch.tensor([1 + 1j]), torch.tensor([1 + 0j]))


# ----------------------------------------------------------------------------- testing helpers
def test_random_qkv_shapes_seed_and_dtype():
    q, k, v = random_qkv(2, 8, 2, 10, 12, 16, torch.bfloat16, "cpu", seed=3, Dv=4)
    assert (q.shape, k.shape, v.shape) == ((2, 8, 10, 16), (2, 2, 12, 16), (2, 2, 12, 4))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    q2, k2, v2 = random_qkv(2, 8, 2, 10, 12, 16, torch.float32, "cpu", seed=3, Dv=4)
    assert torch.equal(q, q2.bfloat16()) and torch.equal(v, v2.bfloat16())
    q3, _, _ = random_qkv(2, 8, 2, 10, 12, 16, torch.float32, "cpu", seed=4, Dv=4)
    assert not torch.equal(q2, q3)
    qs, _, _ = random_qkv(2, 8, 2, 10, 12, 16, torch.float32, "cpu", scale=0.5, seed=3, Dv=4)
    assert torch.equal(qs, q2 * 0.5)
    qg, _, _ = random_qkv(1, 1, 1, 3, 3, 4, torch.float32, "cpu", requires_grad=True)
    assert qg.requires_grad and qg.is_leaf


def test_naive_masked_attention_by_hand():
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])
    v = torch.tensor([[[[10.0], [20.0]]]])
    mask = torch.tensor([[True, True], [False, True], [False, False]])
    out, lse = naive_masked_attention(q, k, v, mask, scale=1.0, return_lse=True)
    assert out.dtype == torch.float64
    p0 = torch.softmax(torch.tensor([1.0, 0.0], dtype=torch.float64), 0)
    assert out[0, 0, 0, 0].item() == pytest.approx(float(p0 @ torch.tensor([10.0, 20.0], dtype=torch.float64)))
    assert out[0, 0, 1, 0].item() == pytest.approx(20.0)
    assert out[0, 0, 2, 0].item() == 0.0 and lse[0, 0, 2].item() == -math.inf
    assert lse[0, 0, 0].item() == pytest.approx(math.log(math.e + 1))
    assert lse[0, 0, 1].item() == pytest.approx(2.0)


def test_naive_empty_row_gradient_is_zero_not_nan():
    q, k, v = random_qkv(1, 1, 1, 3, 4, 2, torch.float64, "cpu", seed=1, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    out, lse = naive_masked_attention(q, k, v, mask, return_lse=True)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert not torch.isnan(q.grad).any() and not torch.isnan(k.grad).any()
    assert torch.equal(q.grad[0, 0, 1], torch.zeros(2, dtype=torch.float64))


def test_naive_gqa_repeats_kv_heads():
    q, k, v = random_qkv(1, 4, 2, 5, 6, 3, torch.float64, "cpu", seed=2)
    out = naive_masked_attention(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    for h in range(4):
        p = torch.softmax(q[0, h] @ k[0, h // 2].T / math.sqrt(3), -1)
        torch.testing.assert_close(out[0, h], p @ v[0, h // 2], rtol=0, atol=1e-14)


def test_oracle_attention_is_fp64_reference():
    q, k, v = random_qkv(1, 2, 1, 20, 30, 8, torch.bfloat16, "cpu", seed=5)
    out = oracle_attention(q, k, v, causal=True)
    assert out.dtype == torch.float64
    want = naive_masked_attention(q, k, v, causal_token_mask(20, 30))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def _triple(dtype=torch.bfloat16, seed=6):
    q, k, v = random_qkv(1, 2, 1, 64, 64, 16, dtype, "cpu", seed=seed)
    oracle = oracle_attention(q, k, v)
    ref = oracle.to(dtype)
    return ref, oracle


def test_assert_close_passes_within_factor():
    ref, oracle = _triple()
    assert_close_to_oracle(ref.clone(), ref, oracle)
    # slightly worse than the reference but inside 2x
    worse = (oracle + (ref.double() - oracle) * 1.8).to(ref.dtype)
    assert_close_to_oracle(worse, ref, oracle, factor=2.0, atol_floor=0.0)


def test_assert_close_fails_beyond_factor_with_both_errors_in_message():
    ref, oracle = _triple(torch.float32)
    bad = ref.clone()
    bad[0, 0, 0, 0] += 1e-2
    with pytest.raises(AssertionError, match=r"(?s)too far from the fp64 oracle.*max_abs_error: kernel 1\.0\d+e-02 "
                                             r"vs fp64 oracle, same-dtype reference \d\.\d+e-0\d.*rmse"):
        assert_close_to_oracle(bad, ref, oracle)


def test_assert_close_floor_and_factor():
    ref, oracle = _triple(torch.float32)
    off = ref + 5e-6
    assert_close_to_oracle(off, ref, oracle, atol_floor=1e-5)
    with pytest.raises(AssertionError):
        assert_close_to_oracle(off, ref, oracle, atol_floor=0.0)
    assert_close_to_oracle(off, ref, oracle, factor=1e4, atol_floor=0.0)
    assert default_atol_floor(torch.bfloat16) > default_atol_floor(torch.float16) > default_atol_floor(torch.float32)


@pytest.mark.parametrize("where", ["out", "ref", "oracle"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_assert_close_never_passes_non_finite(where, bad):
    ref, oracle = _triple()
    out = ref.clone()
    t = {"out": out, "ref": ref, "oracle": oracle}[where]
    t[0, 1, 2, 3] = bad
    with pytest.raises(AssertionError, match=r"is not finite \((1|0) NaN, (0|1) inf of 2048\)"):
        assert_close_to_oracle(out, ref, oracle, factor=1e9, atol_floor=1e9)


def test_assert_close_shape_mismatch():
    ref, oracle = _triple()
    with pytest.raises(AssertionError, match=r"shape mismatch"):
        assert_close_to_oracle(ref[..., :8], ref, oracle)


def test_cosine_similarity_stays_within_minus_one_and_one():
    """The cosine of a vector with itself (or its negative) rounds to 1 +- an ulp; the metric is
    clamped to [-1, 1], so ``cos <= 1`` holds and a self-comparison never reads above a perfect match."""
    g = torch.Generator().manual_seed(0)
    for n in range(1, 60):
        a = torch.randn(n, dtype=torch.float64, generator=g)
        same, opposite = metrics.cosine_similarity(a, a), metrics.cosine_similarity(a, -2.5 * a)
        assert -1.0 <= same <= 1.0 and same == pytest.approx(1.0, abs=1e-15), (n, same)
        assert -1.0 <= opposite <= 1.0 and opposite == pytest.approx(-1.0, abs=1e-15), (n, opposite)


def test_cosine_similarity_of_inputs_of_very_different_magnitude():
    """Each side is scaled by its own largest magnitude: a reference 1e-170 times smaller than the
    output (its squares underflow at the output's scale) still gives the true cosine, not +-1."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, dtype=torch.float64, generator=g), torch.randn(64, dtype=torch.float64, generator=g)
    want = float(a @ b / (a.norm() * b.norm()))
    assert abs(want) < 0.9
    assert metrics.cosine_similarity(a, b * 1e-170) == pytest.approx(want, abs=1e-12)
    assert metrics.cosine_similarity(a * 1e-170, b) == pytest.approx(want, abs=1e-12)
