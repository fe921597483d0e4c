"""The benchmark harness: FLOP counting, providers, timing, runner, result files."""
import csv
import json
import math
from collections import Counter

import pytest
import torch

from sparse_attn import BlockLayout, patterns
from sparse_attn.bench import (MODES, ROW_FIELDS, Case, Row, attention_flops, block_density, check_providers,
                               expand, get_provider, get_suite, load_json, make_header, provider_names,
                               register_provider, restrict, run_suite, spec, summary_table, visited_blocks,
                               write_csv, write_json)
from sparse_attn.bench.registry import unregister_provider
from sparse_attn.bench.results import HEADER_FIELDS, speedups
from sparse_attn.bench.suites import Suite
from sparse_attn.bench.timing import peak_memory, time_cpu, time_interleaved


def ones_layout(nq, nk, block=128, **kw):
    return BlockLayout.from_block_mask(torch.ones(nq, nk, dtype=torch.bool), block_q=block, block_k=block, **kw)


# ----------------------------------------------------------------------------- FLOPs
def test_dense_flops_exact():
    B, H, D, L = 2, 4, 32, 256
    lay = patterns.dense(L)
    fwd = 4 * B * H * D * L * L  # 2x2 blocks of 128x128 = the whole 256x256 matrix
    assert fwd == 4 * 2 * 4 * 32 * 65536 == 67_108_864
    assert attention_flops(lay, batch=B, heads=H, head_dim=D, mode="fwd") == fwd
    assert attention_flops(lay, batch=B, heads=H, head_dim=D, mode="bwd") == int(2.5 * fwd)
    assert attention_flops(lay, batch=B, heads=H, head_dim=D, mode="fwd+bwd") == int(3.5 * fwd)
    assert attention_flops(ones_layout(2, 2), batch=B, heads=H, head_dim=D) == fwd


def test_causal_counts_whole_blocks():
    B, H, D = 1, 2, 64
    per_block = 4 * B * H * D * 128 * 128
    lay = patterns.causal(256)  # blocks (0,0) partial, (1,0) full, (1,1) partial: 3 whole blocks
    assert lay.num_blocks == 3
    assert attention_flops(lay, batch=B, heads=H, head_dim=D) == 3 * per_block
    # a dense layout run with causal=True counts the same blocks
    assert attention_flops(patterns.dense(256), batch=B, heads=H, head_dim=D, causal=True) == 3 * per_block
    assert block_density(patterns.dense(256), batch=B, heads=H, causal=True) == pytest.approx(0.75)
    # L=1024: 8 query blocks -> 8*9/2 = 36 blocks, not the 32 of an exact half
    assert visited_blocks(patterns.dense(1024), batch=1, heads=1, causal=True) == 36


def test_causal_bottom_right_for_short_queries():
    # q_len 128, kv_len 256: the single query block sits at positions 128..255 -> sees both key blocks
    lay = BlockLayout.from_block_mask(torch.ones(1, 2, dtype=torch.bool), block_q=128, block_k=128,
                                      q_len=128, kv_len=256)
    assert visited_blocks(lay, batch=1, heads=1, causal=True) == 2
    lay = BlockLayout.from_block_mask(torch.ones(2, 1, dtype=torch.bool), block_q=128, block_k=128,
                                      q_len=256, kv_len=128)
    # q_len > kv_len: query block 0 sits at positions -128..-1 and sees nothing
    assert visited_blocks(lay, batch=1, heads=1, causal=True) == 1


def test_broadcast_and_per_head_counts():
    m = torch.zeros(1, 2, 2, 2, dtype=torch.bool)
    m[0, 0, 0, 0] = True                 # head 0: 1 block
    m[0, 1, 0, :] = m[0, 1, 1, 1] = True  # head 1: 3 blocks
    lay = BlockLayout.from_block_mask(m, block_q=128, block_k=128)
    assert visited_blocks(lay, batch=3, heads=2) == 3 * (1 + 3)
    assert block_density(lay, batch=3, heads=2) == pytest.approx(4 / 8)
    shared = ones_layout(2, 2)  # Bl = Hl = 1: counted for every (b, h)
    assert visited_blocks(shared, batch=3, heads=5) == 3 * 5 * 4
    with pytest.raises(ValueError, match="cannot broadcast"):
        visited_blocks(lay, batch=1, heads=3)


def test_ragged_length_counts_whole_blocks():
    lay = patterns.dense(200)  # 2x2 blocks, the last ones ragged, still counted whole
    assert attention_flops(lay, batch=1, heads=1, head_dim=16) == 4 * 16 * 4 * 128 * 128


def test_random_density_flops_match_layout():
    lay = patterns.random(1024, density=0.25, heads=4, seed=1)
    f = attention_flops(lay, batch=1, heads=4, head_dim=32)
    assert f == 4 * 32 * 128 * 128 * lay.num_blocks
    assert block_density(lay, batch=1, heads=4) == pytest.approx(lay.density)


# ----------------------------------------------------------------------------- registry + providers
def test_registry_decorator_and_modes():
    calls = []

    @register_provider("test-matmul", description="toy")
    def build(q, k, v, layout, causal):
        calls.append(causal)
        return lambda: (q @ k.transpose(-1, -2)).softmax(-1) @ v

    try:
        assert "test-matmul" in provider_names()
        prov = get_provider("test-matmul")
        assert prov.description == "toy" and prov.computes == "sparse"
        with pytest.raises(ValueError, match="already registered"):
            register_provider("test-matmul")(build)
        q, k, v = (torch.randn(1, 1, 16, 8, requires_grad=True) for _ in range(3))
        out = prov.make_run(q, k, v, None, True, "fwd").fn()
        assert out.shape == (1, 1, 16, 8) and calls == [True]
        run = prov.make_run(q, k, v, None, False, "bwd")
        assert run.grad_to_none == (q, k, v)
        run.fn()
        assert q.grad is not None and q.grad.abs().sum() > 0
        run.fn()  # retain_graph: backward can be timed repeatedly
        for t in run.grad_to_none:
            t.grad = None
        prov.make_run(q, k, v, None, False, "fwd+bwd").fn()
        assert k.grad is not None
        with pytest.raises(ValueError, match="mode must be one of"):
            prov.make_run(q, k, v, None, False, "backward")
        with pytest.raises(ValueError, match="requires_grad"):
            prov.make_run(q.detach(), k.detach(), v.detach(), None, False, "bwd")
    finally:
        unregister_provider("test-matmul")
    with pytest.raises(KeyError, match="registered: .*reference"):
        get_provider("test-matmul")


def test_builtin_providers_registered():
    names = provider_names()
    for name in ("sparse_attn", "reference", "flex", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math"):
        assert name in names
    assert {get_provider(n).computes for n in names if n.startswith("sdpa-")} == {"dense"}
    assert get_provider("sparse_attn").computes == "sparse"


def test_availability_reasons_on_cpu():
    cpu = torch.device("cpu")
    for name in ("sdpa-cudnn", "sdpa-efficient"):
        ok, why = get_provider(name).available(cpu)
        assert ok is False and "CUDA" in why
    for name in ("reference", "sparse_attn", "sdpa-math"):
        ok, why = get_provider(name).available(cpu)
        assert ok is True and "cpu" in why
    ok, why = get_provider("flex").available(cpu)
    assert isinstance(ok, bool) and why  # it runs eagerly on this torch, or says why not
    usable, skipped = check_providers(["reference", "sdpa-cudnn", "reference"], "cpu")
    assert usable == ["reference"] and set(skipped) == {"sdpa-cudnn"}


def _outputs(names, q, k, v, layout, causal):
    return {n: get_provider(n).make_run(q, k, v, layout, causal, "fwd").fn() for n in names}


@pytest.mark.parametrize("hkv", [4, 2])
def test_providers_agree_on_causal(hkv):
    q = torch.randn(1, 4, 256, 32)
    k, v = torch.randn(1, hkv, 256, 32), torch.randn(1, hkv, 256, 32)
    names = ["reference", "sparse_attn", "sdpa-math"]
    if get_provider("flex").available("cpu")[0]:
        names.append("flex")
    outs = _outputs(names, q, k, v, patterns.causal(256), True)
    for n in names[1:]:
        torch.testing.assert_close(outs[n], outs["reference"], atol=1e-5, rtol=1e-5, msg=n)


def test_sdpa_repeats_kv_when_backend_lacks_gqa(monkeypatch):
    from sparse_attn.bench import providers
    real = providers._sdpa_probe
    monkeypatch.setattr(providers, "_sdpa_probe", lambda b, d, dt, gqa: "no GQA" if gqa else real(b, d, dt, gqa))
    q, k, v = torch.randn(1, 4, 128, 16), torch.randn(1, 1, 128, 16), torch.randn(1, 1, 128, 16)
    outs = _outputs(["reference", "sdpa-math"], q, k, v, patterns.dense(128), False)
    torch.testing.assert_close(outs["sdpa-math"], outs["reference"], atol=1e-5, rtol=1e-5)


def test_flex_sparse_pattern_matches_reference():
    if not get_provider("flex").available("cpu")[0]:
        pytest.skip(get_provider("flex").available("cpu")[1])
    q, k, v = torch.randn(1, 2, 512, 16), torch.randn(1, 2, 512, 16), torch.randn(1, 2, 512, 16)
    lay = patterns.streaming(512, window=100, num_sink=20)
    outs = _outputs(["reference", "flex"], q, k, v, lay, True)
    torch.testing.assert_close(outs["flex"], outs["reference"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- timing
def test_time_cpu_median_and_reps():
    n = {"calls": 0}
    x = torch.randn(64, 64, requires_grad=True)
    x.grad = torch.ones_like(x)

    def fn():
        n["calls"] += 1
        assert x.grad is None  # reset before every call
        return x @ x

    ms = time_cpu(fn, reps=5, warmup=1, grad_to_none=(x,))
    assert ms > 0 and n["calls"] == 1 + 1 + 5  # first call, warm-up, timed
    assert peak_memory(fn, torch.device("cpu")) is None


def test_time_interleaved_alternates_repetitions_and_resets_each_fns_grads():
    log = []
    xs = [torch.randn(8, requires_grad=True) for _ in range(2)]

    def make(i):
        def fn():
            assert xs[i].grad is None  # this fn's tensors are reset before each of its calls
            xs[i].grad = torch.ones(8)
            log.append(i)
        return fn

    ms = time_interleaved([make(0), make(1)], "cpu", reps=4, warmup=1, grad_to_none=[(xs[0],), (xs[1],)])
    assert len(ms) == 2 and all(m > 0 for m in ms)
    # estimate (two calls each, one fn after the other), then one warm-up round and four timed rounds
    # that interleave the fns
    assert log[:4] == [0, 0, 1, 1] and log[4:] == [0, 1] + [0, 1] * 4
    with pytest.raises(ValueError, match="grad_to_none has 1 entries for 2 functions"):
        time_interleaved([make(0), make(1)], "cpu", grad_to_none=[()])


@pytest.mark.parametrize("n", [3, 4, 5])
def test_time_interleaved_gives_every_fn_each_other_as_predecessor_equally_often(n):
    """With the order rotated a place per round, four fns A B C D had A follow D in most rounds and
    never B: the power state a kernel inherits was not spread evenly."""
    log = []
    fns = [lambda i=i: log.append(i) for i in range(n)]
    ms = time_interleaved(fns, "cpu", reps=5, warmup=0)
    assert len(ms) == n
    timed = log[2 * n:]  # after the estimate (two calls each)
    counts = Counter(timed)
    assert len(set(counts.values())) == 1 and counts[0] >= 5 and counts[0] % (n - 1) == 0
    pairs = Counter(zip(timed, timed[1:] + timed[:1]))  # cyclic: the order repeats whole
    assert not any(a == b for a, b in pairs)
    assert len(set(pairs.values())) == 1 and len(pairs) == n * (n - 1)


def test_time_interleaved_warms_every_fn_up_as_often_as_asked():
    """Warm-up took the cycle's first warmup * n calls: with four fns and --warmup 1 (the kernels suite's four
    providers) fn 1 got no warm-up call and fn 3 two."""
    for n, warmup in ((4, 1), (4, 2), (5, 1), (5, 3)):
        log = []
        fns = [lambda i=i: log.append(i) for i in range(n)]
        time_interleaved(fns, "cpu", reps=n - 1, warmup=warmup)
        assert Counter(log[2 * n:2 * n + warmup * n]) == {i: warmup for i in range(n)}, (n, warmup)
        assert Counter(log[2 * n + warmup * n:]) == {i: n - 1 for i in range(n)}  # then the timed cycle

# ----------------------------------------------------------------------------- runner
def tiny_suite(providers=("reference", "sdpa-math"), patterns_=("dense", "causal")) -> Suite:
    cases = tuple(Case(spec(p, causal=p == "causal"), seq_lens=(256,), providers=providers, heads=2, kv_heads=(1,),
                       head_dim=16) for p in patterns_)
    return Suite("tiny", "test", cases)


@pytest.mark.parametrize("interleave", [False, True])
def test_run_suite_rows(interleave):
    rows = run_suite(tiny_suite(), "cpu", reps=2, progress=False, interleave=interleave)
    assert [(r.pattern, r.provider) for r in rows] == [("dense", "reference"), ("dense", "sdpa-math"),
                                                       ("causal", "reference"), ("causal", "sdpa-math")]
    for r in rows:
        assert r.error is None and r.ms > 0 and r.peak_mem_bytes is None
        assert r.kv_heads == 1 and r.dtype == "fp32" and r.mode == "fwd"
        flops = 4 * 1 * 2 * 16 * 128 * 128 * (4 if r.pattern == "dense" else 3)
        assert r.tflops == pytest.approx(flops / (r.ms * 1e-3) / 1e12)
    assert rows[0].density == 1.0 and rows[2].density == 0.75 and rows[2].causal is True


def test_dense_provider_timing_shared_across_patterns():
    suite = Suite("t", "", (Case(spec("dense"), (256,), ("sdpa-math",), head_dim=16),
                            Case(spec("block_diagonal", block_size=128), (256,), ("sdpa-math",), head_dim=16)))
    a, b = run_suite(suite, "cpu", reps=2, progress=False)
    assert a.ms == b.ms  # SDPA computes the same dense attention: measured once
    assert b.tflops == pytest.approx(a.tflops / 2)  # but credited with the pattern's FLOPs (2 of 4 blocks)


def test_oom_and_errors_are_recorded_not_raised():
    @register_provider("test-oom")
    def oom(q, k, v, layout, causal):
        def fn():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return fn

    @register_provider("test-broken")
    def broken(q, k, v, layout, causal):
        raise ValueError("head_dim 16 is not supported\nsecond line")

    try:
        rows = run_suite(tiny_suite(providers=("test-oom", "test-broken", "reference"), patterns_=("dense",)),
                         "cpu", reps=1, progress=False)
    finally:
        unregister_provider("test-oom")
        unregister_provider("test-broken")
    by = {r.provider: r for r in rows}
    assert by["test-oom"].error == "OOM" and by["test-oom"].ms is None and by["test-oom"].tflops is None
    assert by["test-broken"].error == "ValueError: head_dim 16 is not supported"
    assert by["reference"].error is None and by["reference"].ms > 0


@pytest.mark.parametrize("interleave", [False, True])
def test_provider_failing_while_timed_loses_only_its_own_row(interleave):
    """The first (untimed) call passes, a later one fails: the error lands on the failing provider's
    row only (interleaved, the row's timing gives way to one-by-one timing)."""
    @register_provider("test-flaky")
    def flaky(q, k, v, layout, causal):
        calls = {"n": 0}

        def fn():
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("failed on call 3")
            return q
        return fn

    try:
        rows = run_suite(tiny_suite(providers=("reference", "test-flaky"), patterns_=("dense",)), "cpu", reps=2,
                         progress=False, interleave=interleave)
    finally:
        unregister_provider("test-flaky")
    by = {r.provider: r for r in rows}
    assert by["test-flaky"].error == "RuntimeError: failed on call 3" and by["test-flaky"].ms is None
    assert by["reference"].error is None and by["reference"].ms > 0


def test_layout_failure_recorded():
    suite = Suite("t", "", (Case(spec("nope", "no_such_builder"), (256,), ("reference",)),))
    (row,) = run_suite(suite, "cpu", reps=1, progress=False)
    assert row.error.startswith("layout: AttributeError") and row.ms is None


def test_expand_drops_duplicate_rows():
    suite = restrict(get_suite("small"), patterns=["local"], seq_lens=[256], modes=["fwd"])
    points = expand(suite)
    keys = [p.key() for p in points]
    assert len(keys) == len(set(keys)) == 3  # two local cases collapse to one row per provider


# ----------------------------------------------------------------------------- suites
def test_small_suite_is_cpu_sized():
    suite = get_suite("small")
    names = {c.pattern.builder for c in suite.cases}
    assert {"dense", "causal", "local", "streaming", "block_diagonal", "random", "bigbird", "dilated",
            "strided"} <= names
    for c in suite.cases:
        if c.pattern.name == "adaptive":  # predicts its own layout: its provider, against the naive dense one
            assert c.providers == ("sdpa-math", "adaptive") and c.pattern.causal
        else:
            assert set(c.providers) == {"reference", "sdpa-math", "sparse_attn"}
        assert max(c.seq_lens) <= 1024 and c.batch == 1 and c.heads == 2 and c.head_dim == 32 and c.dtype == "fp32"
        assert set(c.modes) <= set(MODES)
    # the report's pattern families, at small sizes: every GPU report pattern has a small namesake
    from sparse_attn.bench.suites import report_patterns
    small_names = {c.pattern.name for c in suite.cases}
    assert {p.name.split("-")[0] for p in report_patterns()} | {"adaptive"} <= small_names


# ----------------------------------------------------------------------------- the report suite
def _report_points():
    return expand(get_suite("report-gpu"))


def test_report_gpu_suite_definition():
    from sparse_attn.bench.suites import REPORT_DENSE_PROVIDERS
    suite = get_suite("report-gpu")
    points = _report_points()
    assert len(points) == suite.num_rows() == 186  # no duplicate rows
    for c in suite.cases:
        assert (c.batch, c.heads, c.kv_heads, c.head_dim, c.dtype, c.block_q, c.block_k) == (1, 32, (32,), 128, "bf16",
                                                                                          128, 128)
    assert {p.provider for p in points} <= set(provider_names())
    builders = {p.case.pattern.builder for p in points}
    assert {"dense", "causal", "local", "streaming", "block_diagonal", "bigbird", "dilated", "strided",
            "random"} <= builders
    names = sorted({p.case.pattern.name for p in points})
    fwd_lens = (4096, 8192, 16384, 32768, 65536, 131072)
    for name in names:
        mine = [p for p in points if p.case.pattern.name == name]
        assert tuple(sorted({p.seq_len for p in mine if p.mode == "fwd" and p.seq_len <= 131072})) == fwd_lens
        assert tuple(sorted({p.seq_len for p in mine if p.mode == "fwd+bwd"})) == fwd_lens[:4]
        assert {p.mode for p in mine} == {"fwd", "fwd+bwd"}
    dense_rows = [p for p in points if p.case.pattern.name in ("dense", "causal")]
    assert {p.provider for p in dense_rows} == set(REPORT_DENSE_PROVIDERS) >= {"sdpa-cudnn", "sdpa-flash", "flex",
                                                                           "sdpa-math"}
    assert len(dense_rows) == 2 * len(REPORT_DENSE_PROVIDERS) * (6 + 4)
    # every sparse pattern is measured by a pattern provider only (its dense baseline is the dense/causal rows)
    for p in points:
        if p.case.pattern.name not in ("dense", "causal"):
            assert p.provider == ("adaptive" if p.case.pattern.name == "adaptive" else "sparse_attn")
    random_topk = next(p.case.pattern for p in points if p.case.pattern.name.startswith("random_topk"))
    assert dict(random_topk.kwargs)["top_k"] == 32 and random_topk.causal


def test_report_gpu_long_rows_are_sparse_forward_only():
    long = [p for p in _report_points() if p.seq_len > 131072]
    assert {p.seq_len for p in long} == {262144, 524288, 1 << 20}
    assert {p.case.pattern.builder for p in long} == {"local", "streaming"}
    assert all(p.mode == "fwd" and p.provider == "sparse_attn" for p in long)
    assert len(long) == 2 * 3
    # dense attention is never attempted past 128K, by any provider
    assert all(get_provider(p.provider).computes == "sparse" for p in long)


def test_report_patterns_visit_about_4096_keys():
    from sparse_attn.bench.suites import report_patterns
    L = 32768
    for pat in report_patterns():
        layout = pat.build(L, heads=2)
        keys_per_query = block_density(layout, batch=1, heads=2, causal=pat.causal) * L
        if pat.builder == "bigbird":  # BigBird-ITC at its paper configuration: 8 blocks a row + global rows
            assert 1024 < keys_per_query < 2048, keys_per_query
        else:
            assert 2048 <= keys_per_query <= 4096 + 2 * 128, (pat.name, keys_per_query)


def test_causal_spec_builds_the_causal_variant():
    # random top-k with causal=True picks its blocks among the visible ones: every row keeps top_k blocks
    pat = spec("random_topk", "random", top_k=4, per_head=True, seed=0, causal=True)
    layout = pat.build(4096, heads=2)
    counts = layout.kv_counts.flatten().tolist()
    assert counts == [min(4, qb + 1) for _ in range(2) for qb in range(32)]


# ----------------------------------------------------------------------------- slices
def test_slices_cover_every_row_exactly_once():
    from sparse_attn.bench.slices import plan, slice_suite
    suite = get_suite("report-gpu")
    keys = [p.key() for p in expand(suite)]
    for n in (1, 2, 3, 4, 7):
        parts = plan(suite, n)
        assert len(parts) == n and all(expand(part) for part in parts)
        got = [p.key() for part in parts for p in expand(part)]
        assert got == keys  # every row once, in run order (contiguous slices)
        assert all(part.name == "report-gpu" for part in parts)
    assert [p.key() for p in expand(slice_suite(suite, 2, 3))] == [p.key() for p in expand(plan(suite, 3)[1])]
    with pytest.raises(ValueError, match="K/N"):
        slice_suite(suite, 4, 3)
    with pytest.raises(ValueError, match="cannot cut"):
        plan(restrict(suite, patterns=["dense"], seq_lens=[4096], modes=["fwd"]), 6)  # 5 rows


def test_report_slices_fit_a_ten_minute_command():
    from sparse_attn.bench.slices import estimate_seconds, plan, slices_needed
    suite = get_suite("report-gpu")
    total = estimate_seconds(suite)
    assert 600 < total < 1800  # ~15-20 minutes on an H100: more than one 10-minute command, bounded
    n = slices_needed(suite, 420)
    assert 2 <= n <= 4
    parts = plan(suite, 4)
    assert max(estimate_seconds(p) for p in parts) <= 420 < 540  # the recommended 4 slices: well under 9 minutes
    # balanced: no slice is more than twice another
    est = [estimate_seconds(p) for p in parts]
    assert max(est) < 2 * min(est)


def test_cost_model():
    from sparse_attn.bench.runner import Point
    from sparse_attn.bench.slices import call_ms, density, row_seconds, runs_out_of_memory
    suite = get_suite("report-gpu")
    dense_case = next(c for c in suite.cases if c.pattern.name == "dense" and c.modes == ("fwd",))
    local_case = next(c for c in suite.cases if c.pattern.name == "local-4096" and c.modes == ("fwd",))
    cudnn_128k = call_ms(Point(dense_case, 131072, 32, "fwd", "sdpa-cudnn"))
    assert cudnn_128k == pytest.approx(4 * 32 * 131072**2 * 128 / 580e12 * 1e3)  # ~485 ms (measured: 463)
    assert runs_out_of_memory(Point(dense_case, 32768, 32, "fwd", "sdpa-math"))
    assert not runs_out_of_memory(Point(dense_case, 8192, 32, "fwd", "sdpa-math"))
    assert row_seconds(Point(dense_case, 131072, 32, "fwd", "sdpa-math")) < 2  # fails at once
    # past 32K the density is extrapolated (quadratic in T through 8K/16K/32K): exact for these patterns
    for case in (local_case, next(c for c in suite.cases if c.pattern.name.startswith("strided"))):
        built = block_density(case.pattern.build(131072), batch=1, heads=1, causal=True)
        assert density(case.pattern, 131072) == pytest.approx(built, rel=1e-9)
    assert density(local_case.pattern, 1 << 20) == pytest.approx(0.00402, rel=0.01)  # measured layout: 0.0040205
    ms = [call_ms(Point(local_case, L, 32, "fwd", "sparse_attn")) for L in (32768, 131072)]
    assert 3 < ms[1] / ms[0] < 5  # linear in T


def test_drop_done(tmp_path):
    from sparse_attn.bench.slices import drop_done
    suite = restrict(get_suite("small"), patterns=["local"], seq_lens=[256, 512], modes=["fwd"])
    points = expand(suite)
    done = [Row(p.provider, p.case.pattern.name, p.seq_len, p.case.batch, p.case.heads, p.kv_heads,
                p.case.head_dim, p.case.dtype, p.mode, p.case.pattern.causal, 0.5, 1.0) for p in points[:2]]
    write_json(tmp_path / "a.json", make_header("cpu", "small"), done)
    left, n = drop_done(suite, tmp_path)
    assert n == 2 and [p.key() for p in expand(left)] == [p.key() for p in points[2:]]
    assert drop_done(suite, tmp_path / "missing")[1] == 0


def test_restrict_names_each_dtype_one_way(tmp_path):
    """--dtype float32 / bfloat16 (accepted aliases) labelled the rows 'float32' / 'bfloat16', so the same rows as
    'fp32' / 'bf16' ones were run again under --skip-done and formed another config in the report."""
    from sparse_attn.bench.slices import drop_done
    suite = restrict(get_suite("small"), patterns=["local"], seq_lens=[256], modes=["fwd"])
    done = [Row(p.provider, p.case.pattern.name, p.seq_len, p.case.batch, p.case.heads, p.kv_heads,
                p.case.head_dim, p.case.dtype, p.mode, p.case.pattern.causal, 0.5, 1.0) for p in expand(suite)]
    write_json(tmp_path / "a.json", make_header("cpu", "small"), done)
    again = restrict(get_suite("small"), patterns=["local"], seq_lens=[256], modes=["fwd"], dtype="float32")
    assert {p.case.dtype for p in expand(again)} == {"fp32"}
    assert drop_done(again, tmp_path)[1] == len(done) == 3
    assert {c.dtype for c in restrict(get_suite("kernels"), dtype="bfloat16").cases} == {"bf16"}
    with pytest.raises(ValueError, match="dtype must be one of .*bf16"):
        restrict(get_suite("small"), dtype="int8")

def test_drop_done_reads_annotated_rows(tmp_path):
    """Rows with annotation keys (merge_results.py's 'slice') load everywhere else (results.read_result);
    --skip-done over such a file refused the folder with 'unexpected keyword argument'."""
    from dataclasses import asdict

    from sparse_attn.bench.slices import drop_done
    suite = restrict(get_suite("small"), patterns=["local"], seq_lens=[256], modes=["fwd"])
    points = expand(suite)
    p = points[0]
    row = Row(p.provider, p.case.pattern.name, p.seq_len, p.case.batch, p.case.heads, p.kv_heads, p.case.head_dim,
              p.case.dtype, p.mode, p.case.pattern.causal, 0.5, 1.0)
    (tmp_path / "merged.json").write_text(json.dumps({"header": {}, "rows": [{**asdict(row), "slice": "k-1"}]}))
    left, n = drop_done(suite, tmp_path)
    assert n == 1 and [q.key() for q in expand(left)] == [q.key() for q in points[1:]]


# ----------------------------------------------------------------------------- adaptive provider
def test_adaptive_provider_times_prediction_and_checks_its_flops():
    ok = Suite("t", "", (Case(spec("adaptive", "causal", causal=True), (512,), ("adaptive",), head_dim=16),))
    (row,) = run_suite(ok, "cpu", reps=1, progress=False)
    assert row.error is None and row.ms > 0 and row.provider == "adaptive"
    assert row.density == pytest.approx(block_density(patterns.causal(512), batch=1, heads=2, causal=True))
    # a count layout the prediction does not make is refused, so effective TFLOP/s never lie
    bad = Suite("t", "", (Case(spec("local", window=128, causal=True), (512,), ("adaptive",), head_dim=16),))
    (row,) = run_suite(bad, "cpu", reps=1, progress=False)
    assert row.ms is None and row.error.startswith("ValueError: adaptive: the prediction visits")


def test_kernels_suite_definition():
    suite = get_suite("kernels")
    import sparse_attn.patterns as pat
    for c in suite.cases:
        assert hasattr(pat, c.pattern.builder)
        assert c.dtype == "bf16" and c.batch == 1 and c.heads == 32 and c.kv_heads == (32, 8) and c.head_dim == 128
        assert {"sparse_attn", "flex", "sdpa-cudnn", "sdpa-flash"} == set(c.providers)
        if "fwd+bwd" in c.modes:
            assert set(c.seq_lens) == {16384, 32768}
    fwd_sparse = {c.pattern.name: c.seq_lens for c in suite.cases if c.modes == ("fwd",)}
    assert fwd_sparse["random-0.1"] == (8192, 32768, 131072)
    assert fwd_sparse["dense"] == (16384, 32768, 65536)
    assert {"random-0.1", "random-0.25", "random-0.5", "local-4096", "block_diagonal-4096"} <= set(fwd_sparse)
    dens = {c.pattern.name: dict(c.pattern.kwargs).get("density") for c in suite.cases}
    assert dens["random-0.25"] == 0.25
    # every row the suite asks for has a registered provider
    assert {p for c in suite.cases for p in c.providers} <= set(provider_names())


def test_pattern_option_replaces_the_builder_argument_it_stands_for():
    """random takes exactly one of density= and top_k=: --top-k on a density pattern ('instead of --density',
    its help says) and --density on a top-k one failed every row with a layout error."""
    suite = restrict(get_suite("small"), patterns=["random*"], pattern_options={"top_k": 3})
    by = {c.pattern.name: c.pattern for c in suite.cases}
    assert set(by) == {"random[top_k=3]", "random_topk[top_k=3]"}
    assert by["random[top_k=3]"].build(1024, heads=2).kv_counts.flatten().tolist() == [3] * 16
    assert by["random_topk[top_k=3]"].build(1024, heads=2).kv_counts.flatten().tolist() == [
        min(3, qb + 1) for _ in range(2) for qb in range(8)]
    (case,) = restrict(get_suite("small"), patterns=["random_topk"], pattern_options={"density": 1.0}).cases
    assert case.pattern.name == "random_topk[density=1.0]"
    assert visited_blocks(case.pattern.build(1024, heads=2), batch=1, heads=2) == 2 * 8 * 9 // 2  # causal, all
    (case,) = restrict(get_suite("small"), patterns=["random"], pattern_options={"density": 0.5, "top_k": 2}).cases
    with pytest.raises(ValueError, match="exactly one of density= .* and top_k="):  # both given: the user's error
        case.pattern.build(1024, heads=2)


def test_suite_patterns_build():
    for name in ("small", "kernels", "demo-gpu", "report-gpu"):
        for c in get_suite(name).cases:
            lay = c.pattern.build(1024, heads=c.heads)
            assert lay.q_len == 1024 and lay.heads in (1, c.heads)


# ----------------------------------------------------------------------------- results
def test_json_csv_schema(tmp_path):
    rows = [Row("reference", "dense", 256, 1, 2, 2, 16, "fp32", "fwd", False, 1.0, 1.5, 0.001, None, None),
            Row("flex", "dense", 256, 1, 2, 2, 16, "fp32", "fwd+bwd", False, 1.0, None, None, None, "OOM")]
    header = make_header("cpu", "tiny")
    assert set(HEADER_FIELDS) <= set(header) and header["gpu"] == "cpu" and header["suite"] == "tiny"
    assert header["torch"] == torch.__version__
    write_json(tmp_path / "r.json", header, rows)
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == {"header", "rows"}
    assert all(list(r) == list(ROW_FIELDS) for r in data["rows"])
    assert data["rows"][1]["error"] == "OOM" and data["rows"][1]["ms"] is None
    h2, rows2 = load_json(tmp_path / "r.json")
    assert h2 == header and rows2 == rows
    write_csv(tmp_path / "r.csv", rows)
    with open(tmp_path / "r.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == ROW_FIELDS
        lines = list(reader)
    assert lines[0]["ms"] == "1.5" and lines[1]["ms"] == "" and lines[1]["error"] == "OOM"
    assert set(ROW_FIELDS) >= {"provider", "pattern", "seq_len", "batch", "heads", "kv_heads", "head_dim", "dtype",
                               "mode", "causal", "density", "ms", "tflops", "peak_mem_bytes", "error"}


def test_summary_table_speedups():
    from rich.console import Console
    rows = [Row("sdpa-math", "local", 512, 1, 2, 2, 16, "fp32", "fwd", True, 0.5, 4.0, 0.1),
            Row("reference", "local", 512, 1, 2, 2, 16, "fp32", "fwd", True, 0.5, 2.0, 0.2),
            Row("reference", "local", 1024, 1, 2, 2, 16, "fp32", "fwd", True, 0.3, 2.0, 0.2)]
    sp = speedups(rows, "sdpa-math")
    assert sp[id(rows[0])] == 1.0 and sp[id(rows[1])] == 2.0 and sp[id(rows[2])] is None
    con = Console(record=True, width=200)
    con.print(summary_table(rows))
    text = con.export_text()
    assert "vs sdpa-math" in text and "2.00x" in text and "1.00x" in text and "TOPS" not in text
    rows.append(Row("sparse_attn-int8", "local", 512, 1, 2, 2, 16, "fp32", "fwd", True, 0.5, 1.0, 0.4))
    con = Console(record=True, width=200)
    con.print(summary_table(rows))  # 8-bit rows' effective operations are TOPS (they sat under TFLOP/s)
    assert "TFLOP/s (TOPS 8-bit)" in con.export_text()


def test_time_interleaved_caps_default_warmup_on_the_cpu():
    """--warmup's help says at most 2 default warm-up calls on a CPU; interleaved timing made up to 10."""
    calls = []
    fns = [lambda: calls.append(0), lambda: calls.append(1)]
    time_interleaved(fns, "cpu", reps=4)
    assert len(calls) == 2 * 2 + 2 * 2 + 4 * 2  # the estimate (two each), two warm-up rounds, four timed


def test_peak_memory_cuda_only():
    assert peak_memory(lambda: torch.ones(10), "cpu") is None


@pytest.mark.gpu
def test_cuda_rows_have_memory_and_time():
    rows = run_suite(tiny_suite(providers=("sdpa-math", "reference")), "cuda", reps=3, progress=False)
    for r in rows:
        assert r.error is None and r.ms > 0 and r.peak_mem_bytes is not None and r.peak_mem_bytes >= 0
        assert math.isfinite(r.tflops)


@pytest.mark.gpu
def test_hide_host_times_the_gpu_not_the_host():
    """A call whose host side (3 ms of Python) outlasts its kernel (a few microseconds): plain timing
    measures the host, hide_host the GPU, and host_issue_ms the host's 3 ms."""
    import time
    from sparse_attn.bench.timing import host_issue_ms, time_cuda
    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(0.003)
        x.add_(1)
    plain = time_cuda(call, reps=10, warmup=1)
    hidden = time_cuda(call, reps=10, warmup=1, hide_host=True)
    assert plain > 2.5, plain  # the events waited for the host
    assert hidden < 0.5, hidden
    assert 2.9 < host_issue_ms(call, reps=3) < 30


def test_sage_benchmark_table_has_the_host_column():
    from sparse_attn import sage_suite
    row = dict(seq_len=1024, ratio=0.5, top_k=4, k_blocks=8, blocks_per_row_min=4, blocks_per_row_max=4, kept=0.5,
               dense_ms=1.0, sparse_ms=0.5, speedup=2.0, block_savings=0.5, dense_peak_bytes=None, sparse_tops=10.0,
               bf16_sparse_ms=0.6, speedup_vs_bf16=1.2, sparse_host_ms=0.45)
    header, _, line = sage_suite.bench_table([row])
    assert header.endswith("| sparse host ms |") and line.endswith("| 1.20x | 0.450 |")
    assert sage_suite.bench_table([dict(row, sparse_host_ms=None)])[2].endswith("| 1.20x | - |")  # CPU rows


@pytest.mark.parametrize("case", ["local-gqa", "random-per-head-causal", "none-causal", "streaming", "empty"])
def test_torch_sparse_provider_is_exact(case):
    """The seed's torch.sparse baseline: token-exact CSR attention equals the reference, rows without
    keys give 0, and its pattern holds exactly the allowed token pairs."""
    import warnings
    from sparse_attn import patterns, reference
    from sparse_attn.bench import get_provider
    from sparse_attn.bench.torch_sparse import token_csr
    from sparse_attn.layout import BlockLayout
    from sparse_attn.masks import ElementMask
    L, hq, hkv, causal = 192, 2, 2, False
    layout = {"local-gqa": patterns.local(L, 48, block_q=32, block_k=64),
              "random-per-head-causal": patterns.random(L, density=0.3, heads=4, seed=1, block_q=64, block_k=64),
              "none-causal": None, "streaming": patterns.streaming(L, 40, 8, block_q=64, block_k=32),
              "empty": BlockLayout.from_mask(ElementMask(()), q_len=L, block_q=64, block_k=64)}[case]
    if case == "local-gqa":
        hq, hkv = 4, 2
    if case == "random-per-head-causal":
        hq, hkv, causal = 4, 1, True
    if case == "none-causal":
        causal = True
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, L, 16, generator=g) for h in (hq, hkv, hkv))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = get_provider("torch-sparse").build(q, k, v, layout, causal)()
    torch.testing.assert_close(out, reference.attention(q, k, v, layout, causal=causal), rtol=1e-5, atol=1e-5)
    if layout is not None:
        tok = layout.to_token_mask()[0, min(1, layout.heads - 1)] & (torch.ones(L, L, dtype=torch.bool).tril()
                                                                      if causal else True)
        crow, col, _ = token_csr(layout, 0, 1, L, L, causal, "cpu")
        assert int(crow[-1]) == col.numel() == int(tok.sum())
        assert torch.equal(torch.zeros(L, L, dtype=torch.bool).index_put_(
            (torch.repeat_interleave(torch.arange(L), crow.diff()), col), torch.tensor(True)), tok)
