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
    assert rc == 2 and "unknown provider" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


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
    assert main(["viz", pattern, "--seq-len", "1024", "--heads", "2", "--out", str(out)]) == 0
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
    assert "unknown pattern 'nonsense'" in capsys.readouterr().out
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
    out = capsys.readouterr().out
    assert f"skipping {len(want)} rows" in out and "nothing to run" in out
    assert main(args + ["--slice", "4/3"]) == 2
    assert "1 <= K <= N" in capsys.readouterr().out


def test_bench_plan_prints_slices(capsys):
    assert main(["bench", "--suite", "report-gpu", "--plan", "4"]) == 0
    out = capsys.readouterr().out
    assert "186 rows in 4 slices" in out and "total estimate" in out
    for k in range(1, 5):
        assert f"{k}/4" in out
    assert "streaming-128+4096 L=1048576 Hkv=32 fwd sparse_attn" in out  # the last row of the last slice
