"""The sparse-attn command line: bench, viz, demo."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from sparse_attn import viz
from sparse_attn.bench import ROW_FIELDS
from sparse_attn.cli._common import tokens
from sparse_attn.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path, min_w=200, min_h=200):
    import matplotlib.image as mpimg
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= min_h and img.shape[1] >= min_w
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_tokens_parser():
    assert tokens("4096") == 4096 and tokens("8k") == 8192 and tokens("128K") == 131072 and tokens("1M") == 1 << 20
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="8k"):
        tokens("eight")


def test_help_texts(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("bench", "viz", "demo", "examples"):
        assert word in out
    for cmd in ("bench", "viz", "demo"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "usage: sparse-attn " + cmd in capsys.readouterr().out


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "sparse_attn.cli.main", "--version"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "sparse_attn" in r.stdout
    exe = shutil.which("sparse-attn")
    if exe is not None:  # console script installed by `pip install -e .`
        r = subprocess.run([exe, "viz", "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "PATTERN" in r.stdout


def test_bench_cpu_end_to_end(tmp_path, capsys):
    rc = main(["bench", "--device", "cpu", "--seq-lens", "256", "--patterns", "causal", "local",
               "--providers", "reference,sdpa-math", "sparse_attn", "--modes", "fwd", "--reps", "2",
               "--head-dim", "16", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "vs sdpa-math" in out and "TFLOP/s" in out and "small-cpu.json" in out
    data = json.loads((tmp_path / "small-cpu.json").read_text())
    hdr = data["header"]
    assert hdr["device"] == "cpu" and hdr["gpu"] == "cpu" and hdr["suite"] == "small"
    assert hdr["torch"] == torch.__version__ and hdr["date"]
    rows = data["rows"]
    assert {(r["pattern"], r["provider"]) for r in rows} == {
        (p, q) for p in ("causal", "local") for q in ("reference", "sdpa-math", "sparse_attn")}
    assert len(rows) == 6
    for r in rows:
        assert tuple(r) == ROW_FIELDS
        assert r["seq_len"] == 256 and r["head_dim"] == 16 and r["error"] is None and r["ms"] > 0
        assert r["causal"] is True and r["mode"] == "fwd"
    csv_lines = (tmp_path / "small-cpu.csv").read_text().strip().splitlines()
    assert csv_lines[0].split(",") == list(ROW_FIELDS) and len(csv_lines) == 7


def test_bench_interleave_flag_is_recorded(tmp_path, capsys):
    args = ["bench", "--device", "cpu", "--seq-lens", "256", "--patterns", "causal", "--providers", "reference",
            "sdpa-math", "--reps", "2", "--head-dim", "16", "--no-progress"]
    for flag, timing in (([], "blocks"), (["--interleave"], "interleaved")):
        out_dir = tmp_path / timing
        assert main(args + flag + ["--out-dir", str(out_dir)]) == 0
        data = json.loads((out_dir / "small-cpu.json").read_text())
        assert data["header"]["timing"] == timing
        assert [r["provider"] for r in data["rows"]] == ["reference", "sdpa-math"]
        assert all(r["error"] is None and r["ms"] > 0 for r in data["rows"])


def test_bench_rejects_unknown_provider(tmp_path, capsys):
    rc = main(["bench", "--device", "cpu", "--providers", "nope", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 2 and "unknown provider" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_plan_rejects_unknown_provider(capsys):
    """--plan estimated the rows first and failed with a KeyError traceback inside the cost model."""
    assert main(["bench", "--device", "cpu", "--plan", "1", "--providers", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown provider(s) nope" in err and "Traceback" not in err


def test_bench_plan_and_slice_together_are_refused(capsys):
    """--plan 2 --slice 1/2 planned two slices of slice 1/2 and printed a command (--slice K/2 of the
    whole suite) that ran other rows."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--plan", "2", "--slice", "1/2"])
    assert e.value.code == 2
    assert "give one of the two" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--plan", "2"]) == 0


def test_bench_stress_refuses_seq_lens(tmp_path, capsys):
    """--stress adds 2x and 4x each case's longest length; --seq-lens replaced the lengths after it, so the
    stress rows silently vanished (a run of only the given lengths, recorded as a stress run)."""
    assert main(["bench", "--suite", "all", "--stress", "--seq-lens", "256", "--device", "cpu", "--plan", "1"]) == 2
    err = capsys.readouterr().err
    assert "--stress" in err and "--seq-lens" in err
    assert main(["bench", "--suite", "all", "--stress", "--device", "cpu", "--patterns", "local", "--plan", "1"]) == 0


def test_bench_skips_unavailable_provider(tmp_path, capsys):
    rc = main(["bench", "--device", "cpu", "--providers", "sdpa-cudnn", "reference", "--seq-lens", "128",
               "--patterns", "dense", "--modes", "fwd", "--reps", "1", "--out-dir", str(tmp_path), "--name", "x",
               "--no-progress"])
    assert rc == 0
    assert "skipping provider sdpa-cudnn: needs a CUDA device" in capsys.readouterr().out
    data = json.loads((tmp_path / "x.json").read_text())
    assert [r["provider"] for r in data["rows"]] == ["reference"]
    assert "sdpa-cudnn" in data["header"]["skipped_providers"]


def test_bench_list(capsys):
    assert main(["bench", "--list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for word in ("sdpa-cudnn", "needs a CUDA device", "kernels", "small", "sparse_attn"):
        assert word in out


@pytest.mark.parametrize("pattern", viz.pattern_names() + ["local|random", "bigbird&causal"])
def test_viz_writes_png(tmp_path, pattern, capsys):
    out = tmp_path / "p.png"
    heads = ["--heads", "2"] if "random" in pattern or "bigbird" in pattern else []  # only they take it
    assert main(["viz", pattern, "--seq-len", "1024", *heads, "--out", str(out)]) == 0
    assert_png(out)
    assert "density" in capsys.readouterr().out


def test_viz_every_documented_pattern_is_a_choice():
    expected = {"dense", "causal", "local", "streaming", "block_diagonal", "strided", "dilated", "random", "bigbird"}
    assert expected <= set(viz.pattern_names())


def test_viz_options_reach_the_builder(tmp_path, capsys):
    out = tmp_path / "s.png"
    assert main(["viz", "streaming", "--seq-len", "2k", "--window", "256", "--num-sink", "64", "--block-q", "64",
                 "--close-up", "1024", "0", "256", "1280", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    from sparse_attn import patterns
    expected = patterns.streaming(2048, window=256, num_sink=64, block_q=64).density
    assert f"density {expected:.4f}" in text and "blocks 64x128" in text
    assert_png(out)


def test_viz_bad_pattern(capsys, tmp_path):
    assert main(["viz", "nonsense", "--out", str(tmp_path / "n.png")]) == 2
    assert "unknown pattern 'nonsense'" in capsys.readouterr().err
    assert main(["viz"]) == 2


def test_viz_gallery(tmp_path):
    md = tmp_path / "gallery.md"
    assert main(["viz", "--gallery", str(tmp_path / "g"), "--markdown", str(md), "--seq-len", "1024"]) == 0
    pngs = sorted((tmp_path / "g").glob("*.png"))
    names = {p.stem for p in pngs}
    assert {"dense", "causal", "local", "streaming", "block_diagonal", "strided", "dilated", "random", "bigbird",
            "topk", "local_or_random"} == names
    text = md.read_text()
    for p in pngs:
        assert f"](g/{p.name})" in text
        assert_png(p)
    with pytest.raises(SystemExit) as e:  # a PATTERN beside --gallery was ignored without a word
        main(["viz", "local", "--gallery", str(tmp_path / "g2")])
    assert e.value.code == 2


def test_demo_quick(tmp_path, capsys):
    assert main(["demo", "--quick", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "device cpu" in out and "'small'" in out
    data = json.loads((tmp_path / "bench" / "demo-cpu.json").read_text())
    assert data["rows"] and all(r["error"] is None for r in data["rows"])
    assert {r["provider"] for r in data["rows"]} == {"reference", "sdpa-math", "sparse_attn"}
    assert len(list((tmp_path / "gallery").glob("*.png"))) == 11
    assert (tmp_path / "gallery" / "gallery.md").exists()
    assert str(tmp_path / "gallery") in out


# ----------------------------------------------------------------------------- the report suite: demo, slices
def test_demo_suite_on_cuda_is_the_report():
    from sparse_attn.bench import expand
    from sparse_attn.cli.demo import demo_suite
    assert demo_suite("cuda", quick=False).name == "report-gpu"
    quick = demo_suite("cuda", quick=True)
    assert quick.name == "demo-gpu"
    assert {(p.case.pattern.name, p.seq_len) for p in expand(quick)} == {("dense", 4096), ("local", 4096)}
    assert demo_suite("cpu", quick=False).name == "small"
    from sparse_attn.cli.demo import accuracy_length
    assert accuracy_length(demo_suite("cuda", quick=False), "cuda") == 8192  # accuracy rows of a GPU run: 8K, on CPU
    assert accuracy_length(quick, "cuda") == 4096 and accuracy_length(demo_suite("cpu", False), "cpu") is None


def test_bench_slice_runs_its_rows_only(tmp_path, capsys):
    from sparse_attn.bench import expand, get_suite, restrict
    from sparse_attn.bench.slices import plan
    args = ["bench", "--device", "cpu", "--patterns", "local", "causal", "--seq-lens", "256", "--modes", "fwd",
            "--providers", "reference", "sdpa-math", "--head-dim", "16", "--reps", "1", "--out-dir", str(tmp_path),
            "--no-progress"]
    assert main(args + ["--slice", "2/3"]) == 0
    data = json.loads((tmp_path / "small-cpu-2-of-3.json").read_text())
    assert data["header"]["slice"] == "2/3" and data["header"]["suite"] == "small"
    suite = restrict(get_suite("small"), patterns=["local", "causal"], seq_lens=[256], modes=["fwd"],
                     providers=["reference", "sdpa-math"], head_dim=16)
    want = [(p.case.pattern.name, p.provider) for p in expand(plan(suite, 3)[1])]
    assert [(r["pattern"], r["provider"]) for r in data["rows"]] == want and want
    # running the same slice again with --skip-done over its results runs nothing
    capsys.readouterr()
    assert main(args + ["--slice", "2/3", "--skip-done", str(tmp_path), "--name", "again"]) == 1
    captured = capsys.readouterr()
    assert f"skipping {len(want)} rows" in captured.out and "nothing to run" in captured.err
    assert main(args + ["--slice", "4/3"]) == 2
    assert "1 <= K <= N" in capsys.readouterr().err


def test_bench_plan_prints_slices(capsys):
    assert main(["bench", "--suite", "report-gpu", "--plan", "4"]) == 0
    out = capsys.readouterr().out
    assert "186 rows in 4 slices" in out and "total estimate" in out
    for k in range(1, 5):
        assert f"{k}/4" in out
    assert "streaming-128+4096 L=1048576 Hkv=32 fwd sparse_attn" in out  # the last row of the last slice


# ----------------------------------------------------------------------------- option checks (adversarial pass)
def _tiny_bench(out_dir, *extra):
    return ["bench", "--device", "cpu", "--patterns", "local", "--seq-lens", "128", "256", "--modes", "fwd",
            "--providers", "reference", "sdpa-math", "--head-dim", "16", "--reps", "1", "--warmup", "0",
            "--out-dir", str(out_dir), "--no-progress", *extra]


def test_bench_skip_done_over_its_own_folder_keeps_the_rows_it_skips(tmp_path, capsys):
    """A slice cut off and run again with --skip-done over its own --out-dir: the file is rewritten with
    the earlier rows kept (it held only the rows run the second time)."""
    assert main(_tiny_bench(tmp_path, "--slice", "1/1")) == 0
    path = tmp_path / "small-cpu-1-of-1.json"
    data = json.loads(path.read_text())
    assert len(data["rows"]) == 4
    first = data["rows"][:2]
    data["rows"] = first  # as if the slice had been cut off after two rows
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(_tiny_bench(tmp_path, "--slice", "1/1", "--skip-done", str(tmp_path))) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert "skipping 2 rows" in out and "keeping its 2 earlier rows" in out
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 4 and rows[:2] == first
    assert {(r["seq_len"], r["provider"]) for r in rows} == {(L, p) for L in (128, 256) for p in ("reference",
                                                                                                 "sdpa-math")}
    assert len((tmp_path / "small-cpu-1-of-1.csv").read_text().strip().splitlines()) == 5
    with pytest.raises(SystemExit) as e:  # a typo in the folder re-ran everything
        main(_tiny_bench(tmp_path, "--skip-done", str(tmp_path / "nosuch")))
    assert e.value.code == 2 and "no such folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag, value", [
    (["bench", "--seq-lens", "0"], "--seq-lens", "0"),
    (["bench", "--seq-lens", "256", "-256"], "--seq-lens", "-256"),
    (["bench", "--batch", "0"], "--batch", "0"),
    (["bench", "--heads", "-1"], "--heads", "-1"),
    (["bench", "--kv-heads", "0"], "--kv-heads", "0"),
    (["bench", "--head-dim", "0"], "--head-dim", "0"),
    (["bench", "--reps", "0"], "--reps", "0"),
    (["bench", "--threads", "-1"], "--threads", "-1"),
    (["demo", "--threads", "-2"], "--threads", "-2"),
    (["quick", "--seq-len", "-5"], "--seq-len", "-5"),
    (["quick", "--kv-len", "0"], "--kv-len", "0"),
    (["quick", "--kv-heads", "0"], "--kv-heads", "0"),
    (["quick", "--threads", "-1"], "--threads", "-1"),
    (["accuracy", "--head-dim", "0"], "--head-dim", "0"),
    (["viz", "local", "--seq-len", "0"], "--seq-len", "0"),
    (["viz", "local", "--show-heads", "0"], "--show-heads", "0"),
    (["viz", "local", "--close-up", "0", "-5", "64"], "--close-up", "-5"),
    (["report", "--from", "x", "--accuracy-len", "-5"], "--accuracy-len", "-5"),
    (["report", "--from", "x", "--name", "report.md"], "--name", "report.md"),  # overwritten by the report
    (["report", "--from", "x", "--name", "accuracy.json"], "--name", "accuracy.json"),  # the saved accuracy rows
    (["viz", "local", "--seed", str(2 ** 64)], "--seed", str(2 ** 64)),
    (["eval-model", "--lengths", "-256"], "--lengths", "-256"),
    (["eval-model", "--lengths", "0"], "--lengths", "0"),
    (["eval-model", "--texts", "0"], "--texts", "0"),
    (["eval-model", "--new-tokens", "-1"], "--new-tokens", "-1"),
    (["eval-model", "--heads", "0"], "--heads", "0"),
    (["sage-test", "--seq-lens", "0"], "--seq-lens", "0"),
    (["sage-test", "--reps", "0"], "--reps", "0"),
    (["bench", "--batch", "two"], "--batch", "two"),
])
def test_sizes_below_range_are_argument_errors(argv, flag, value, capsys):
    from sparse_attn.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and repr(value) in err


def test_zero_where_zero_means_something():
    from sparse_attn.cli._common import nonneg_int, positive_tokens
    from sparse_attn.cli.main import build_parser
    args = build_parser().parse_args(["eval-model", "--new-tokens", "0", "--lengths", "1k"])
    assert args.new_tokens == 0 and args.lengths == [1024]
    assert build_parser().parse_args(["bench", "--warmup", "0", "--threads", "0"]).threads == 0
    assert build_parser().parse_args(["viz", "local", "--close-up", "0", "0", "64"]).close_up == [0, 0, 64]
    assert nonneg_int("0") == 0 and positive_tokens("8k") == 8192


@pytest.mark.parametrize("cmd", [["bench"], ["demo"], ["quick"], ["accuracy"], ["eval-model"], ["sage-test"]])
def test_device_is_checked_when_parsed(cmd, capsys, monkeypatch):
    from sparse_attn.cli.main import build_parser
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, why in (("cuda", "torch.cuda.is_available() is False"), ("cuda:1", "is_available() is False"),
                        ("tpu", "expected cpu or cuda[:N], got 'tpu'"), ("meta", "expected cpu or cuda")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(cmd + ["--device", device])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "argument --device" in err and why in err, (device, err)
    assert build_parser().parse_args(cmd + ["--device", "cpu"]).device == "cpu"


def test_unwritable_output_fails_before_the_work(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for argv, flag in ((_tiny_bench(afile), "--out-dir"),
                       (_tiny_bench(afile / "sub"), "--out-dir"),
                       (["demo", "--quick", "--device", "cpu", "--out-dir", str(afile), "--no-progress"], "--out-dir"),
                       (["accuracy", "--quick", "--device", "cpu", "--out-dir", str(afile)], "--out-dir"),
                       (["sage-test", "--device", "cpu", "--out", str(afile), "--no-progress"], "--out"),
                       (["viz", "local", "--seq-len", "512", "--out", str(afile / "x.png")], "--out"),
                       (["viz", "--gallery", str(afile)], "--gallery")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        captured = capsys.readouterr()
        assert e.value.code == 2 and f"{flag} {afile}" in captured.err, argv
        assert "suite" not in captured.out and "wrote" not in captured.out  # nothing ran
    assert afile.read_text() == "not a folder"


def test_viz_output_format_and_close_up_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["viz", "local", "--seq-len", "512", "--out", str(tmp_path / "x.txt")])
    assert e.value.code == 2 and "cannot write '.txt' files" in capsys.readouterr().err
    assert main(["viz", "local", "--seq-len", "512", "--out", str(tmp_path / "noext")]) == 0
    assert f"wrote {tmp_path / 'noext.png'}" in capsys.readouterr().out
    assert_png(tmp_path / "noext.png")
    for close_up, why in ((["2000", "0", "64"], "outside the 1024 x 1024"), (["0", "0", "0"], "must be positive")):
        assert main(["viz", "streaming", "--seq-len", "1k", "--close-up", *close_up,
                     "--out", str(tmp_path / "c.png")]) == 2
        assert why in capsys.readouterr().err


def test_bench_gpu_suites_refuse_the_cpu(tmp_path, capsys):
    for suite in ("kernels", "report-gpu", "demo-gpu"):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--suite", suite, "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--suite {suite} is a GPU suite" in err and "--suite small" in err
    assert not list(tmp_path.iterdir())
    assert main(["bench", "--suite", "kernels", "--device", "cpu", "--plan", "2"]) == 0  # a plan runs nothing


def test_bench_baseline_must_be_a_provider_of_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(_tiny_bench(tmp_path, "--baseline", "nosuch"))
    assert e.value.code == 2 and "--baseline nosuch" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.fixture
def broken_provider():
    from sparse_attn.bench import register_provider
    from sparse_attn.bench.registry import unregister_provider

    @register_provider("test-always-fails")
    def broken(q, k, v, layout, causal):
        raise RuntimeError("this provider always fails")
    yield "test-always-fails"
    unregister_provider("test-always-fails")


def test_bench_exits_1_when_every_row_failed(tmp_path, capsys, broken_provider):
    argv = ["bench", "--device", "cpu", "--patterns", "local", "--seq-lens", "128", "--modes", "fwd",
            "--head-dim", "16", "--reps", "1", "--out-dir", str(tmp_path), "--no-progress", "--providers"]
    assert main(argv + [broken_provider]) == 1
    assert "all 1 rows failed, e.g. RuntimeError: this provider always fails" in capsys.readouterr().err
    assert main(argv + [broken_provider, "reference"]) == 0  # one row measured: not a failed run
    assert "1 of 2 rows failed" in capsys.readouterr().out


def test_demo_exits_1_when_every_row_failed(tmp_path, capsys, monkeypatch, broken_provider):
    from sparse_attn.bench import get_suite, restrict
    from sparse_attn.cli import demo
    monkeypatch.setattr(demo, "demo_suite", lambda device, quick: restrict(
        get_suite("small"), patterns=["local"], seq_lens=[128], modes=["fwd"], providers=[broken_provider]))
    monkeypatch.setattr(viz, "write_gallery", lambda *a, **k: [])
    assert main(["demo", "--quick", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"]) == 1
    assert "every benchmark row failed" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_cpu_timing_runs_on_one_thread_by_default_and_says_so(tmp_path, capsys):
    before = torch.get_num_threads()
    argv = ["bench", "--device", "cpu", "--patterns", "local", "--seq-lens", "128", "--modes", "fwd",
            "--providers", "reference", "--head-dim", "16", "--reps", "1", "--no-progress"]
    assert main(argv + ["--out-dir", str(tmp_path / "a")]) == 0
    assert "CPU timings are indicative only" in capsys.readouterr().out
    header = json.loads((tmp_path / "a" / "small-cpu.json").read_text())["header"]
    assert header["threads"] == 1 and "indicative only" in header["note"]
    assert main(argv + ["--out-dir", str(tmp_path / "b"), "--threads", "2"]) == 0
    assert json.loads((tmp_path / "b" / "small-cpu.json").read_text())["header"]["threads"] == 2
    assert torch.get_num_threads() == before  # restored


def test_underscore_flags_of_the_seed_tools_are_accepted():
    """Command lines copied from SageAttention's / SpargeAttn's READMEs (underscored flags) parse as
    the hyphenated ones; values and anything after a bare -- are left alone."""
    from sparse_attn.cli.main import build_parser, hyphenate_options
    parser = build_parser()

    def parse(argv):
        return vars(parser.parse_args(hyphenate_options(argv)))
    seed = ["sage-test", "--test_correctness", "--benchmark_perf", "--quant_gran", "per_thread", "--seq_lens", "1k",
            "--top_k_ratios", "0.5"]
    assert parse(seed) == parse([a.replace("_", "-") if a.startswith("--") else a for a in seed])
    assert parse(["quick", "--seq_len=512", "--sparse_level", "high"]) == \
        parse(["quick", "--seq-len=512", "--sparse-level", "high"])
    assert hyphenate_options(["viz", "--out=my_file.png", "--", "--keep_me"]) == \
        ["viz", "--out=my_file.png", "--", "--keep_me"]
    with pytest.raises(SystemExit):  # plain argparse rejects them, as before this rewrite
        parser.parse_args(["quick", "--seq_len", "512"])


def test_viz_exponential_dilation_and_repeated_pattern_options(tmp_path, capsys):
    from sparse_attn import patterns
    out = tmp_path / "d.png"
    assert main(["viz", "dilated", "--seq-len", "2k", "--window-blocks", "5", "--dilation", "1", "--exponential",
                 "--out", str(out)]) == 0
    expected = patterns.dilated(2048, 5, 1, exponential=True).density
    assert expected != patterns.dilated(2048, 5, 1).density
    assert f"density {expected:.4f}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # argparse kept the last value, so both builders drew dilation 2
        main(["viz", "dilated|dilated", "--dilation", "1", "--dilation", "2", "--out", str(out)])
    assert e.value.code == 2 and "--dilation given twice" in capsys.readouterr().err


def test_bench_pattern_options_reparameterise_the_selected_patterns(tmp_path, capsys):
    """Seed 002's `streaming_att 1024 64 16` / `block_sparse_att 512 64 16`: pattern options replace
    the suite's values where the builder takes them; rows are renamed after them and their density
    is the new layout's; the header records them, so a report compares against these rows."""
    from sparse_attn import patterns
    from sparse_attn.bench import get_suite, restrict
    rc = main(["bench", "--device", "cpu", "--seq-lens", "512", "--patterns", "streaming", "block_diagonal",
               "--window", "64", "--num-sink", "16", "--block-size", "16", "--block-q", "64", "--block-k", "64",
               "--providers", "sparse_attn", "--reps", "2", "--head-dim", "16", "--out-dir", str(tmp_path),
               "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "small-cpu.json").read_text())
    got = {r["pattern"]: r["density"] for r in data["rows"]}
    want = {"streaming[num_sink=16,window=64]<block_k=64,block_q=64>":
            patterns.streaming(512, 64, 16, block_q=64, block_k=64).density,
            "block_diagonal[block_size=16]<block_k=64,block_q=64>":
            patterns.block_diagonal(512, 16, block_q=64, block_k=64).density}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want)
    restricted = data["header"]["restricted"]
    assert restricted["pattern_options"] == {"block_q": 64, "block_k": 64, "window": 64, "num_sink": 16,
                                             "block_size": 16}
    again = restrict(get_suite("small"), **restricted)
    assert {c.pattern.name for c in again.cases} == set(want)
    # an option none of the selected patterns takes is an error, not silently ignored
    assert main(["bench", "--device", "cpu", "--patterns", "causal", "--window", "64", "--out-dir",
                 str(tmp_path), "--no-progress"]) == 2
    assert "apply to none of the selected patterns (causal)" in capsys.readouterr().err


def test_bench_patterns_selecting_nothing_is_an_error_listing_the_cases(capsys):
    """--plan crashed with an IndexError on such a selection; a run said only "nothing to run"."""
    for extra in (["--plan"], []):
        assert main(["bench", "--suite", "report-gpu", "--patterns", "nosuch*", "--device", "cpu"] + extra) == 2
        err = capsys.readouterr().err
        assert "selects no case of suite report-gpu" in err and "local-4096" in err


# ----------------------------------------------------------------------------- second adversarial pass (CLI audit)
def test_bench_skip_done_over_another_folder_does_not_duplicate_the_rows_run_again(tmp_path, capsys):
    """--skip-done DIR beside an --out-dir that already held the result: the rows run again were also
    kept from the old file (Point.key() ends with the provider; it was appended a second time)."""
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()
    assert main(_tiny_bench(out)) == 0
    assert main(_tiny_bench(out, "--skip-done", str(empty))) == 0
    rows = json.loads((out / "small-cpu.json").read_text())["rows"]
    assert len(rows) == 4 and len({(r["seq_len"], r["provider"]) for r in rows}) == 4  # was 8
    assert len((out / "small-cpu.csv").read_text().strip().splitlines()) == 5
    assert "earlier rows" not in capsys.readouterr().out


def test_bench_plan_names_the_suite_given(capsys):
    """On a CPU --suite sage runs its stand-in sage-tiny: the plan told to run --suite sage-tiny, no choice."""
    assert main(["bench", "--suite", "sage", "--device", "cpu", "--plan", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "`sparse-attn bench --suite sage --slice K/2`" in out and "--suite sage-tiny" not in out
    assert main(["bench", "--suite", "small", "--device", "cpu", "--patterns", "local", "--plan", "1"]) == 0
    assert "--suite small --slice K/1` with this plan's other options" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("extra, words", [
    (["--heads", "4", "--kv-heads", "2", "3"], ["--heads 4 and --kv-heads 2 3", "4 query heads with 3 key/value"]),
    (["--heads", "3"], ["--heads 3 and the suite's key/value heads", "3 query heads with 2 key/value heads"]),
])
def test_bench_refuses_query_heads_that_are_no_multiple_of_kv_heads(tmp_path, capsys, extra, words):
    """They ran, every such row failed with an internal error, and the command exited 0."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--patterns", "local", "--seq-lens", "128", "--modes", "fwd",
              "--out-dir", str(tmp_path), "--no-progress", *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and all(w in err for w in words), err
    assert not list(tmp_path.iterdir())


def test_builtin_suites_pair_heads_that_divide():
    from sparse_attn.bench import SUITES
    for name, make in SUITES.items():
        assert all(c.heads % hkv == 0 for c in make().cases for hkv in c.kv_heads), name


def test_bench_help_names_both_row_renamings(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps (and may break at a comma)
    assert "NAME[option=value,...]" in text and "NAME<block_k=K,block_q=Q>" in text
    assert "local[window=64]<block_k=64,block_q=64>" in text


@pytest.mark.parametrize("argv", [["bench", "--name", "sub/x"], ["eval-model", "--name", "sub/x"],
                                  ["report", "--from", "x", "--name", "sub/merged.json"], ["bench", "--name", ""]])
def test_name_is_a_file_name_not_a_path(argv, capsys):
    """--name sub/x ended in FileNotFoundError after the whole run (eval-model, report) or the first row."""
    from sparse_attn.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --name" in err and "without a folder" in err and "--out-dir" in err


def test_errors_go_to_stderr(tmp_path, capsys):
    """`sparse-attn viz foo >/dev/null` printed nothing: the error went to stdout with the results."""
    assert main(["viz", "foo", "--out", str(tmp_path / "f.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown pattern 'foo'" in captured.err
    assert main(["bench", "--device", "cpu", "--providers", "nosuch", "--out-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "unknown provider(s) nosuch" in captured.err and "nosuch" not in captured.out


@pytest.mark.parametrize("argv, flags", [
    (["dense", "--window", "5"], "--window"),
    (["local", "--density", "0.5"], "--density"),
    (["dense", "--causal"], "--causal"),
    (["local", "--exponential"], "--exponential"),
    (["local", "--heads", "4"], "--heads"),
    (["local|dense", "--top-k", "2", "--num-sink", "4"], "--num-sink, --top-k"),
])
def test_viz_refuses_pattern_options_no_builder_takes(tmp_path, capsys, argv, flags):
    """Each was dropped without a word: `viz dense --window 5` drew plain dense, exit 0."""
    out = tmp_path / "x.png"
    with pytest.raises(SystemExit) as e:
        main(["viz", *argv, "--seq-len", "512", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"pattern option(s) {flags} apply to no builder of {argv[0]!r}" in err
    assert not out.exists()


def test_viz_options_a_builder_takes_still_work(tmp_path, capsys):
    for argv in (["local|random", "--window", "64", "--density", "0.3", "--heads", "2"],
                 ["local", "--no-causal", "--window-right", "64"], ["random", "--top-k", "2", "--seed", "3"]):
        assert main(["viz", *argv, "--seq-len", "512", "--out", str(tmp_path / "ok.png")]) == 0, argv
    assert "blocks 128x128" in capsys.readouterr().out  # the builders' default blocks when not given


@pytest.mark.parametrize("extra, words", [
    (["--block-q", "100"], "--block-q must be a multiple of 16"),  # a LayoutError traceback, exit 1
    (["--block-q", "64", "--block-k", "32"], "does not use --block-k"),  # the page said 64x64 blocks
    (["--kv-len", "512", "--window", "64", "--out", "x.png", "--close-up", "0", "0", "64", "--show-heads", "2"],
     "does not use --kv-len, --window, --out, --close-up, --show-heads"),
])
def test_viz_gallery_refuses_what_it_does_not_use(tmp_path, capsys, extra, words):
    gallery = tmp_path / "g"
    with pytest.raises(SystemExit) as e:
        main(["viz", "--gallery", str(gallery), "--seq-len", "256", *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and words in err, err
    assert not gallery.exists()


def test_viz_gallery_takes_square_blocks_and_markdown_needs_it(tmp_path, capsys):
    md = tmp_path / "g.md"
    assert main(["viz", "--gallery", str(tmp_path / "g"), "--seq-len", "256", "--block-q", "64", "--block-k", "64",
                 "--markdown", str(md)]) == 0
    assert "with 64x64 blocks" in md.read_text()
    with pytest.raises(SystemExit) as e:  # exited 0 without writing m.md
        main(["viz", "local", "--markdown", str(tmp_path / "m.md"), "--out", str(tmp_path / "m.png")])
    assert e.value.code == 2 and "give it with --gallery DIR" in capsys.readouterr().err
    assert not (tmp_path / "m.md").exists() and not (tmp_path / "m.png").exists()
