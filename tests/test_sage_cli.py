"""``sparse-attn sage-test`` (tiny CPU mode), its block-index helpers, the 8-bit bench providers and the
``sage`` bench suite. CPU only, a few seconds."""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, sage_suite
from sparse_attn.bench import expand, get_provider, get_suite, provider_names
from sparse_attn.bench.suites import suite_for_device
from sparse_attn.cli.main import main
from sparse_attn.layout import LayoutError


def _run_cli(tmp_path, *flags):
    return main(["sage-test", "--device", "cpu", "--out", str(tmp_path), "--no-progress", *flags])


# ----------------------------------------------------------------------------- the CLI
def test_cli_tiny_cpu_run_writes_json_and_markdown(tmp_path, capsys, one_thread):
    rc = _run_cli(tmp_path, "--test-correctness", "--test-patterns", "--benchmark-perf", "--quant", "int8",
                  "--seq-lens", "256", "--top-k-ratios", "0.5", "--reps", "1")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tiny sizes" in out and "0 failed" in out
    data = json.loads((tmp_path / "sage_test.json").read_text())
    hdr = data["header"]
    assert hdr["device"] == "cpu" and hdr["quant"] == "int8" and hdr["granularity"] == "per_warp"
    assert hdr["sizes"]["name"] == "cpu-tiny" and "tiny" in hdr["note"]
    assert hdr["thresholds"] == {"min_cosine": 0.999, "max_l1": 0.02}
    checks = data["checks"]
    assert {c["section"] for c in checks} == {"correctness", "patterns"}
    assert not [c for c in checks if c["passed"] is False]
    # the four patterns, one ratio each; every accuracy check measured and within the thresholds
    pats = [c for c in checks if c["section"] == "patterns"]
    assert sorted(c["extra"]["pattern"] for c in pats) == sorted(sage_suite.PATTERNS)
    acc = [c for c in checks if c["cosine"] is not None]
    assert len(acc) == len(pats) + 3
    assert all(c["cosine"] >= 0.999 and c["relative_l1"] <= 0.02 for c in acc)
    memory = [c for c in checks if c["name"].startswith("memory")]
    assert len(memory) == 1 and memory[0]["passed"] is None and "CUDA only" in memory[0]["detail"]
    assert sum(c["name"].startswith("block_index:") and c["passed"] for c in checks) == 6
    (row,) = data["benchmark"]
    assert row["seq_len"] == 256 and row["batch"] == 1 and row["heads"] == 2 and row["head_dim"] == 64
    assert row["dense_ms"] > 0 and row["sparse_ms"] > 0 and row["bf16_sparse_ms"] > 0
    assert row["top_k"] == 1 and row["k_blocks"] == 2 and row["block_savings"] == pytest.approx(0.5)
    assert row["speedup"] == pytest.approx(row["dense_ms"] / row["sparse_ms"])
    md = (tmp_path / "sage_test.md").read_text()
    assert "| section | check | result |" in md and "| L | top-k | dense ms | sparse ms | speedup |" in md
    assert "tiny sizes" in md and md.count("| patterns |") == 4


def test_cli_reports_int8_fp8_l1_failures_and_exits_1(tmp_path, capsys, one_thread):
    rc = _run_cli(tmp_path, "--quant", "int8-fp8", "--quant-gran", "per_thread", "--top-k-ratios", "0.5")
    assert rc == 1
    data = json.loads((tmp_path / "sage_test.json").read_text())
    checks = data["checks"]
    assert {c["section"] for c in checks} == {"correctness", "patterns"} and not data["benchmark"]  # the default
    failed = [c for c in checks if c["passed"] is False]
    # e4m3 P.V keeps the cosine but misses the L1 bar; the thresholds stay as they are
    assert {c["name"] for c in failed} == {c["name"] for c in checks if c["cosine"] is not None}
    assert len(failed) == 3 + len(sage_suite.PATTERNS)
    for c in failed:
        assert c["cosine"] >= 0.999 and c["relative_l1"] > 0.02
        assert f"rel. L1 {c['relative_l1']:.4f} > 0.02" in c["detail"]
    assert "FAILED" in capsys.readouterr().out


def test_cli_bad_options_exit_2(tmp_path):
    assert _run_cli(tmp_path, "--top-k-ratios", "1.5") == 2


def test_cli_pattern_without_the_patterns_section_is_refused(tmp_path, capsys):
    """--pattern selects the patterns section's layouts: with only --benchmark-perf (random top-k indices)
    it ran silently, exit 0, and the JSON header recorded patterns that never ran."""
    assert _run_cli(tmp_path, "--benchmark-perf", "--pattern", "local", "--seq-lens", "256") == 2
    assert "add --test-patterns" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "sage_test.json").exists()


def test_cli_exits_1_when_a_benchmark_row_failed(tmp_path, capsys, monkeypatch, one_thread):
    """Its help promises exit 1 when something fails; a failed benchmark row exited 0."""
    def broken(*a, **k):
        raise RuntimeError("no block index today")
    monkeypatch.setattr(sage_suite, "random_block_index", broken)
    rc = _run_cli(tmp_path, "--benchmark-perf", "--quant", "int8", "--seq-lens", "256", "--top-k-ratios", "0.5",
                  "--reps", "1", "--threads", "1")
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "1 of 1 benchmark rows failed, e.g. RuntimeError: no block index today" in out
    assert json.loads((tmp_path / "sage_test.json").read_text())["header"]["threads"] == 1


def test_cli_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["sage-test", "--help"])
    out = capsys.readouterr().out
    for flag in ("--test-correctness", "--test-patterns", "--benchmark-perf", "--quant-gran", "--stress", "--out",
                 "--batch-size", "--num-heads", "--head-dim", "--seq-lens", "--pattern"):
        assert flag in out
    flat = " ".join(out.split())  # each size flag says which sections it sizes
    assert "batch of all three sections: correctness, patterns, benchmark" in flat
    assert "lengths of all three sections" in flat and "patterns section only" in flat


def test_cli_size_and_pattern_flags_size_every_section(tmp_path, capsys, one_thread):
    """The seed's --batch_size/--num_heads/--head_dim/--seq_lens/--pattern: sage-test had none of the
    first four for the checks (--seq-lens sized only the benchmark) and no --pattern."""
    rc = _run_cli(tmp_path, "--test-correctness", "--test-patterns", "--benchmark-perf", "--quant", "int8",
                  "--batch_size", "2", "--num-heads", "1", "--head-dim", "32", "--seq-lens", "256", "512",
                  "--pattern", "block_diagonal", "strided", "--top-k-ratios", "0.75", "--reps", "1")
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    assert "checks B=2 H=1 L=256/512 D=32; benchmark B=2 H=1 L=[256, 512]" in out
    data = json.loads((tmp_path / "sage_test.json").read_text())
    hdr = data["header"]
    assert (hdr["sizes"]["batch"], hdr["sizes"]["heads"], hdr["sizes"]["head_dim"]) == (2, 1, 32)
    assert (hdr["sizes"]["bench_batch"], hdr["sizes"]["bench_heads"]) == (2, 1)
    assert hdr["check_lens"] == [256, 512] and hdr["patterns"] == ["strided", "block_diagonal"]
    checks = data["checks"]
    assert not [c for c in checks if c["passed"] is False]
    for L in (256, 512):  # the correctness section ran at each length, at the asked sizes
        assert any(c["name"] == f"runs: dense, L={L}" and f"q [2, 1, {L}, 32]" in c["detail"] for c in checks)
        assert sum(c["name"].startswith("block_index:") and c["name"].endswith(f"L={L}") for c in checks) == 6
    pats = [c["extra"] for c in checks if c["section"] == "patterns"]
    assert [(e["pattern"], e["seq_len"]) for e in pats] == [("strided", 256), ("block_diagonal", 256),
                                                           ("strided", 512), ("block_diagonal", 512)]
    assert all(e["block_index_shape"][:2] == [2, 1] for e in pats)
    assert [(r["seq_len"], r["batch"], r["heads"], r["head_dim"]) for r in data["benchmark"]] == \
        [(256, 2, 1, 32), (512, 2, 1, 32)]
    # benchmark labels: measured blocks per row (0.75 of 2 key blocks rounds down to 1)
    md = (tmp_path / "sage_test.md").read_text()
    assert "| 256 | 0.75 (1/2 per row, 50.0% kept) |" in md and "| 512 | 0.75 (3/4 per row, 75.0% kept) |" in md


def test_cli_header_sizes_are_the_lengths_that_ran(tmp_path, one_thread):
    """--seq-lens replaced the lengths of every section, but the JSON header's sizes kept the preset's
    (seq_len 512, bench_lens [256, 512] beside checks and rows at 200)."""
    from sparse_attn.cli.main import build_parser
    from sparse_attn.cli.sage_test import run_sizes
    rc = _run_cli(tmp_path, "--test-patterns", "--benchmark-perf", "--quant", "int8", "--seq-lens", "200",
                  "--pattern", "local", "--top-k-ratios", "0.5", "--reps", "1")
    assert rc == 0
    data = json.loads((tmp_path / "sage_test.json").read_text())
    sizes = data["header"]["sizes"]
    assert sizes["seq_len"] == 200 and sizes["bench_lens"] == [200] and data["header"]["check_lens"] == [200]
    assert [r["seq_len"] for r in data["benchmark"]] == [200]
    assert [c["extra"]["seq_len"] for c in data["checks"]] == [200]
    args = build_parser().parse_args(["sage-test", "--seq-lens", "300", "1k"])
    assert (run_sizes(args, "cpu").seq_len, run_sizes(args, "cpu").bench_lens) == (300, (300, 1024))


def test_cli_correctness_cases_fit_any_head_count_and_length(tmp_path, capsys, one_thread):
    """9 heads: the GQA case took H // 4 = 2 KV heads, which 9 is no multiple of, and the run failed;
    L=165: the 'odd length' case was L - 37 = 128, whole blocks."""
    rc = _run_cli(tmp_path, "--test-correctness", "--quant", "int8", "--num-heads", "9", "--head-dim", "32",
                  "--seq-lens", "165")
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0, out
    names = [c["name"] for c in json.loads((tmp_path / "sage_test.json").read_text())["checks"]]
    assert "runs: block_index, GQA 9/1, Lq=82, Lk=165" in names
    assert "runs: block_index, odd length L=138" in names


def test_cli_default_sizes_are_the_presets():
    from sparse_attn.cli.main import build_parser
    from sparse_attn.cli.sage_test import check_lens, run_sizes, selected_patterns
    for stress, preset in ((False, "cpu-tiny"), (True, "cpu-tiny-stress")):
        args = build_parser().parse_args(["sage-test"] + ["--stress"] * stress)
        sizes = run_sizes(args, "cpu")
        assert sizes == sage_suite.SIZES[preset] and check_lens(args, sizes) == (sizes.seq_len,)
        assert selected_patterns(args) == sage_suite.PATTERNS


@pytest.mark.parametrize("flags, flag, why", [
    (["--batch-size", "0"], "--batch-size", "positive integer, got '0'"),
    (["--num-heads", "-2"], "--num-heads", "positive integer, got '-2'"),
    (["--head-dim", "0"], "--head-dim", "positive integer, got '0'"),
    (["--head-dim", "40"], "--head-dim", "multiple of 16 and at least 32"),
    (["--head-dim", "16"], "--head-dim", "multiple of 16 and at least 32"),
    (["--head-dim", "512"], "--head-dim", "head_dim up to 256, got 512"),
    (["--seed", str(2 ** 64)], "--seed", "below 2**64"),
    (["--seed", "-1"], "--seed", "integer >= 0"),
    (["--pattern", "diagonal"], "--pattern", "invalid choice: 'diagonal'"),
])
def test_cli_bad_sizes_are_usage_errors_naming_the_flag(tmp_path, capsys, flags, flag, why):
    with pytest.raises(SystemExit) as e:
        _run_cli(tmp_path, *flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}: " in err and why in err, err


def test_cli_seq_lens_too_short_for_the_correctness_checks(tmp_path, capsys, one_thread):
    with pytest.raises(SystemExit) as e:
        _run_cli(tmp_path, "--seq-lens", "512", "128")  # the default sections include correctness
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--seq-lens 128: the correctness checks need L > 128" in err
    # the patterns alone run at one key block
    assert _run_cli(tmp_path, "--test-patterns", "--seq-lens", "128", "--pattern", "local", "--num-heads", "1",
                    "--top-k-ratios", "0.5") == 0
    (check,) = json.loads((tmp_path / "sage_test.json").read_text())["checks"]
    assert check["name"] == "local, L=128, top-k 0.5: 1 of 1 key blocks per row, 100.0% kept"


# ----------------------------------------------------------------------------- block indices
def test_invalid_block_index_error_names_the_index_and_the_range():
    bi = sage_suite.random_block_index(1, 2, 512, 2)  # Qb = 8, Kb = 4
    bi[0, 1, 7, 0] = 4
    with pytest.raises(LayoutError, match=r"block_index\[0,1,7,0\] = 4 is out of range: valid key-block indices "
                                          r"are 0\.\.3 \(kv_len=512, block_k=128\), or -1 for padding"):
        patterns.from_block_index(bi, seq_len=512)
    bi[0, 1, 7, 0] = -2
    with pytest.raises(LayoutError, match=r"block_index\[0,1,7,0\] = -2 .* 0\.\.3"):
        patterns.from_block_index(bi, seq_len=512)
    checks = list(sage_suite.index_checks(512))
    assert len(checks) == 6 and all(c.passed for c in checks), [c.detail for c in checks]


def test_random_block_index_properties():
    B, H, L, Lk, top_k = 2, 3, 1000, 1500, 5
    nq, nk = sage_suite.block_grid(L, Lk)
    assert (nq, nk) == (16, 12)
    bi = sage_suite.random_block_index(B, H, L, top_k, kv_len=Lk, seed=3)
    assert bi.shape == (B, H, nq, top_k) and bi.dtype == torch.int32
    assert int(bi.min()) >= 0 and int(bi.max()) <= nk - 1
    assert torch.all(bi[..., 1:] > bi[..., :-1])  # ascending, hence distinct: exactly top_k per row
    diag = sage_suite.diagonal_blocks(L, Lk)  # block of each row's last query (bottom-right aligned)
    assert diag[0] == (63 + 500) // 128 and diag[-1] == nk - 1
    assert torch.all((bi == diag[None, None, :, None].int()).any(-1))
    assert torch.equal(bi, sage_suite.random_block_index(B, H, L, top_k, kv_len=Lk, seed=3))
    assert not torch.equal(bi[0, 0], bi[0, 1]) and not torch.equal(bi, sage_suite.random_block_index(
        B, H, L, top_k, kv_len=Lk, seed=4))
    # uniform over the non-diagonal blocks: each is drawn (top_k - 1) / (nk - 1) of the time
    many = sage_suite.random_block_index(1, 64, L, top_k, kv_len=Lk, seed=0)
    hits = torch.zeros(nk)
    hits.index_add_(0, many.flatten().long(), torch.ones(many.numel()))
    off_diag = torch.ones(nk, dtype=torch.bool)
    off_diag[diag.unique()] = False
    rate = hits[off_diag] / (64 * nq)
    assert rate.min() > 0.2 and rate.max() < 0.6  # expectation ~(4/11) for most blocks
    layout = patterns.from_block_index(bi, seq_len=L, kv_len=Lk)
    assert layout.num_blocks == B * H * nq * top_k
    with pytest.raises(ValueError, match="top_k=13 must be in 1..12"):
        sage_suite.random_block_index(1, 1, L, 13, kv_len=Lk)
    # no keys: the error named seq_len as the kv_len (kv_len=0 is falsy)
    with pytest.raises(ValueError, match=r"top_k=1 must be in 1\.\.0 \(the key blocks of kv_len=0 at block_k=128\)"):
        sage_suite.random_block_index(1, 1, L, 1, kv_len=0)


@pytest.mark.parametrize("name", sage_suite.PATTERNS)
def test_pattern_block_index_is_valid_and_has_its_shape(name):
    B, H, L, top_k = 2, 2, 2048, 4
    nq, nk = sage_suite.block_grid(L)
    bi = sage_suite.pattern_block_index(name, B, H, L, top_k)
    assert bi.shape == (B, H, nq, top_k) and bi.dtype == torch.int32
    valid = bi >= 0
    assert torch.all(bi[~valid] == -1) and int(bi.max()) < nk
    counts = valid.sum(-1)
    assert counts.min() >= 1 and counts.float().mean() <= top_k + 1
    layout = patterns.from_block_index(bi, seq_len=L)  # distinct, in range
    assert layout.batch == B and layout.heads == H
    rows = [set(r[r >= 0].tolist()) for r in bi[0, 0]]
    if name == "block_diagonal":  # documents of top_k key blocks: query block qb sees exactly its own
        assert all(r == set(range(qb // 8 * 4, qb // 8 * 4 + 4)) for qb, r in enumerate(rows))
    if name in ("local", "strided"):  # both keep the diagonal block
        assert all(qb // 2 in r for qb, r in enumerate(rows))


def _measured(bi, nk):
    """Blocks per row (entries >= 0) of ``bi [B, H, Qb, K]`` and the fraction of the block grid kept,
    counted here independently of sage_suite.index_stats."""
    counts = (bi >= 0).sum(-1)
    return counts, counts.sum().item() / (counts.numel() * nk)


@pytest.mark.parametrize("L", [512, 4096])
@pytest.mark.parametrize("name", sage_suite.PATTERNS)
def test_pattern_rows_hold_top_k_blocks_and_labels_state_them(name, L):
    """Rows labelled "top-k 0.75 (24/32)" held 32/32 (strided), and local was ~62% dense at every
    ratio: each row now holds top_k blocks (block_diagonal's shorter last document fewer, which its
    label says) and the label states the blocks per row and the fraction kept, measured."""
    nq, nk = sage_suite.block_grid(L)
    sizes = sage_suite.with_sizes(sage_suite.SIZES["cpu-tiny"], batch=2, heads=3)
    diag = sage_suite.diagonal_blocks(L)
    for ratio in sage_suite.TOP_K_RATIOS:
        top_k = sage_suite.top_k_for(ratio, nk)
        bi, label, _ = sage_suite.pattern_case(name, ratio, dataclasses.replace(sizes, seq_len=L), seed=1)
        assert bi.shape == (2, 3, nq, top_k) and bi.dtype == torch.int32
        patterns.from_block_index(bi, seq_len=L)  # in range, no duplicates
        counts, kept = _measured(bi, nk)
        if name == "block_diagonal":  # documents of top_k blocks from block 0; the last holds Kb % top_k
            want = torch.clamp(nk - diag // top_k * top_k, max=top_k)
            assert torch.equal(counts, want.expand_as(counts))
        else:
            assert torch.all(counts == top_k) and kept == pytest.approx(top_k / nk)
            assert torch.all((bi == diag[:, None].int()).any(-1))  # the diagonal block is always kept
        lo, hi = int(counts.min()), int(counts.max())
        per_row = f"{lo}" if lo == hi else f"{lo} to {hi}"
        assert label == f"{name}, L={L}, top-k {ratio:g}: {per_row} of {nk} key blocks per row, {kept:.1%} kept"


def test_pattern_labels_at_4k():
    """The reported case: L=4096 (Kb=32), top-k 0.75 = 24 blocks."""
    sizes = dataclasses.replace(sage_suite.SIZES["cpu-tiny"], seq_len=4096)
    labels = {n: sage_suite.pattern_case(n, 0.75, sizes)[1] for n in sage_suite.PATTERNS}
    for n in ("random", "local", "strided"):
        assert labels[n].endswith("top-k 0.75: 24 of 32 key blocks per row, 75.0% kept")
    assert labels["block_diagonal"].endswith("top-k 0.75: 8 to 24 of 32 key blocks per row, 62.5% kept")


def test_local_and_strided_rows():
    nk, top_k = 32, 8
    diag = torch.arange(nk)
    local = sage_suite.local_rows(diag, nk, top_k)
    assert local[0].tolist() == list(range(8)) and local[-1].tolist() == list(range(24, 32))  # shifted at edges
    assert local[16].tolist() == list(range(12, 20))  # top_k // 2 blocks before the diagonal
    strided = sage_suite.strided_rows(diag, nk, top_k)
    assert strided[0].tolist() == [0, 4, 8, 12, 16, 20, 24, 28] and strided[5].tolist() == [1, 5, 9, 13, 17, 21, 25, 29]
    gaps = torch.diff(sage_suite.strided_rows(diag, nk, 24), dim=-1)  # 24 of 32: gaps of 1 or 2, never all dense
    assert set(gaps.unique().tolist()) == {1, 2}
    with pytest.raises(ValueError, match="top_k=33 must be in 1..32"):
        sage_suite.pattern_block_index("local", 1, 1, 4096, 33)


def test_top_k_for_follows_sageattention():
    assert [sage_suite.top_k_for(r, 8) for r in (0.25, 0.5, 0.75, 1.0)] == [2, 4, 6, 8]
    assert sage_suite.top_k_for(0.1, 4) == 1
    with pytest.raises(ValueError):
        sage_suite.top_k_for(0.0, 4)


# ----------------------------------------------------------------------------- providers
def test_8bit_providers_on_cpu():
    assert {"sparse_attn-int8", "sparse_attn-int8-fp8", "sageattention"} <= set(provider_names())
    cpu = torch.device("cpu")
    for name in ("sparse_attn-int8", "sparse_attn-int8-fp8"):
        prov = get_provider(name)
        assert prov.computes == "sparse" and prov.available(cpu)[0]
    sage = get_provider("sageattention")
    ok, why = sage.available(cpu)
    assert sage.computes == "dense" and not ok and ("sageattention" in why or "CUDA" in why)
    q, k, v = sage_suite.make_qkv(1, 2, 256, 32, dtype=torch.float32, seed=1)
    layout = patterns.from_block_index(sage_suite.random_block_index(1, 2, 256, 1), seq_len=256)
    for quant in ("int8", "int8-fp8"):
        out = get_provider(f"sparse_attn-{quant}").build(q, k, v, layout, True)()
        assert torch.equal(out, sparse_attn.attention(q, k, v, layout, causal=True, quant=quant))
        assert not torch.equal(out, sparse_attn.attention(q, k, v, layout, causal=True))


def test_sageattention_provider_keeps_the_shared_k(monkeypatch):
    calls = []

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True):
        k -= k.mean(dim=2, keepdim=True)  # what sageattention 1.0.6 does to its k argument
        calls.append((tensor_layout, is_causal))
        return torch.zeros_like(q)
    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    q, k, v = sage_suite.make_qkv(1, 2, 128, 64, dtype=torch.float32, outlier_keys=True)
    k0 = k.clone()
    forward = get_provider("sageattention").build(q, k, v, None, True)
    forward()
    forward()
    assert torch.equal(k, k0) and calls == [("HND", True)] * 2


# ----------------------------------------------------------------------------- the sage bench suite
def test_sage_suite_rows():
    suite = get_suite("sage")
    assert suite.name == "sage"
    dense_p = {"sparse_attn", "sparse_attn-int8", "sparse_attn-int8-fp8", "sageattention", "sdpa-cudnn"}
    sparse_p = {"sparse_attn", "sparse_attn-int8", "sparse_attn-int8-fp8", "flex"}
    want = {("dense", L, p) for L in (16384, 32768, 65536) for p in dense_p}
    want |= {("local-4096", L, p) for L in (32768, 131072) for p in sparse_p}
    want |= {(f"random-{d}", 32768, p) for d in (0.1, 0.25, 0.5) for p in sparse_p}
    points = expand(suite)
    assert {(p.case.pattern.name, p.seq_len, p.provider) for p in points} == want and len(points) == 35
    for p in points:
        c = p.case
        assert (c.batch, c.heads, p.kv_heads, c.head_dim, c.dtype, p.mode) == (1, 32, 32, 128, "bf16", "fwd")
    pats = {c.pattern.name: c.pattern for c in suite.cases}
    assert pats["local-4096"].causal and dict(pats["local-4096"].kwargs)["window"] == 4096
    assert all(dict(pats[f"random-{d}"].kwargs)["density"] == d for d in (0.1, 0.25, 0.5))
    assert {p.provider for p in points} <= set(provider_names())
    assert suite_for_device("sage", "cuda").cases == suite.cases


def test_bench_suite_sage_on_cpu_runs_its_tiny_stand_in(tmp_path, capsys, one_thread):
    tiny = suite_for_device("sage", "cpu")
    assert tiny.name == "sage-tiny" and max(L for c in tiny.cases for L in c.seq_lens) <= 512
    assert {c.providers for c in tiny.cases} == {c.providers for c in get_suite("sage").cases}
    rc = main(["bench", "--suite", "sage", "--device", "cpu", "--patterns", "dense", "--seq-lens", "256",
               "--providers", "sparse_attn,sparse_attn-int8,sageattention", "--reps", "2", "--warmup", "1",
               "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tiny stand-in sage-tiny" in out
    data = json.loads((tmp_path / "sage-tiny-cpu.json").read_text())
    assert data["header"]["suite"] == "sage-tiny" and "sageattention" in data["header"]["skipped_providers"]
    rows = {r["provider"]: r for r in data["rows"]}
    assert set(rows) == {"sparse_attn", "sparse_attn-int8"}
    bf16, int8 = rows["sparse_attn"], rows["sparse_attn-int8"]
    assert int8["error"] is None and int8["ms"] > 0
    # one FLOP count for both: effective TOPS ratios are time ratios
    assert int8["tflops"] * int8["ms"] == pytest.approx(bf16["tflops"] * bf16["ms"])


def test_benchmark_columns_name_the_16bit_dtype_that_ran():
    """With --dtype fp16 the comparison columns still said bf16."""
    row = {"seq_len": 256, "ratio": 0.5, "top_k": 1, "error": "x"}
    assert "| fp16 sparse ms | 8-bit vs fp16 |" in sage_suite.bench_table([row], "fp16")[0]
    assert "| bf16 sparse ms | 8-bit vs bf16 |" in sage_suite.bench_table([row])[0]
