"""``sparse-attn quick`` and ``sparse-attn accuracy`` on the CPU, through their own argparse parsers
(the lead registers the modules in cli/main.py)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from sparse_attn.cli import accuracy as accuracy_cli
from sparse_attn.cli import quick as quick_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sparse-attn")
    sub = parser.add_subparsers(dest="command", required=True)
    module.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def assert_png(path, min_w=300, min_h=200):
    import matplotlib.image as mpimg
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= min_h and img.shape[1] >= min_w
    assert img[..., :3].std() > 0.05  # not a blank canvas


TINY = ["quick", "--seq-len", "384", "--block", "32", "--batch", "1", "--heads", "2", "--head-dim", "32"]


def test_quick_passes_and_prints_metrics(capsys):
    rc = run_cli(quick_cli, TINY + ["--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for word in ("Cossim:", "L1:", "RMSE:", "sparsity:", "PASSED"):
        assert word in out
    assert "FAIL" not in out


def test_quick_fails_with_exit_code_1(capsys):
    rc = run_cli(quick_cli, TINY + ["--device", "cpu", "--max-l1", "1e-9"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL relative L1" in out and "FAILED" in out
    # pure random inputs are barely sparsifiable: the sparsity check fails
    rc = run_cli(quick_cli, TINY + ["--device", "cpu", "--random"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL sparsity" in out


def test_quick_causal_gqa_benchmark(capsys):
    rc = run_cli(quick_cli, TINY + ["--device", "cpu", "--causal", "--kv-heads", "1", "--sparse-level", "medium",
                                    "--benchmark", "--attention-sink"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "causal blocks skipped" in out and "CPU reference timings" in out and "dense" in out


def test_quick_bad_arguments_exit_2(capsys):
    assert run_cli(quick_cli, TINY + ["--device", "cpu", "--cdfthreshd", "1.5"]) == 2
    assert "cdfthreshd" in capsys.readouterr().err
    assert run_cli(quick_cli, TINY + ["--device", "cpu", "--cdfthreshd", "0.5", "--topk", "0.3"]) == 2
    assert "not both" in capsys.readouterr().err  # --cdfthreshd was dropped silently
    with pytest.raises(SystemExit):
        run_cli(quick_cli, ["quick", "--sparse-level", "extreme"])


def test_accuracy_quick_writes_report(tmp_path, capsys):
    out_dir = tmp_path / "acc"
    rc = run_cli(accuracy_cli, ["accuracy", "--quick", "--sweep", "--device", "cpu", "--out-dir", str(out_dir)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("attention_comparison.png", "block_pattern.png", "block_pattern_causal.png", "sweep.png"):
        assert_png(out_dir / name)
    data = json.loads((out_dir / "accuracy.json").read_text())
    cases = data["cases"]
    assert {c["category"] for c in cases} == {"levels", "lengths", "causal", "stability", "edge"}
    assert all(c["passed"] for c in cases)
    names = {c["name"] for c in cases}
    assert {"inputs x100", "inputs x1e-3", "L=1", "Lq=300, Lk=1000, causal", "L=1000 (tail block)"} <= names
    for c in cases:
        assert 0.0 <= c["sparsity"] <= 1.0 and c["finite"]
    assert len(data["sweep"]) == 9 and {"simthreshd1", "cdfthreshd", "sparsity", "cosine", "relative_l1"} <= set(
        data["sweep"][0])
    md = (out_dir / "accuracy_report.md").read_text()
    assert md.count("| pass |") == len(cases)
    assert "![" in md and "Threshold sweep" in md and "simthreshd1" in md
    assert (out_dir / "sweep.csv").read_text().startswith("simthreshd1,cdfthreshd")


def test_quick_on_your_own_qkv_file_with_a_plot(tmp_path, capsys):
    """Seed 004's "test your own data": q/k/v saved from a model run through quick, with the attention
    maps of one head drawn (GQA: the head's kv head); bad files are exit-2 errors naming the file."""
    from sparse_attn import accuracy
    q, k, v = accuracy.structured_qkv(1, 4, 320, 32, kv_heads=2, seed=5)
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "mine.pt")
    png = tmp_path / "maps.png"
    rc = run_cli(quick_cli, ["quick", "--device", "cpu", "--qkv", str(tmp_path / "mine.pt"), "--block", "32",
                             "--plot", str(png), "--head", "3", "--causal", "--min-sparsity", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "q [1, 4, 320, 32], k/v [1, 2, 320, 32]" in out and "mine.pt" in out
    assert_png(png)
    torch.save((q, k), tmp_path / "two.pt")
    torch.save({"q": q}, tmp_path / "dict.pt")
    for name, words in (("two.pt", "tuple (q, k, v)"), ("dict.pt", "keys q, k, v"), ("none.pt", "no such file")):
        assert run_cli(quick_cli, ["quick", "--device", "cpu", "--qkv", str(tmp_path / name)]) == 2
        assert words in capsys.readouterr().err
    assert run_cli(quick_cli, ["quick", "--device", "cpu", "--qkv", str(tmp_path / "mine.pt"), "--plot",
                               str(png), "--head", "9"]) == 2
    captured = capsys.readouterr()
    assert "head 9 out of range" in captured.err and "PASS" not in captured.out  # refused before the run


def test_the_plot_draws_the_runs_own_layout(tmp_path, monkeypatch):
    """quick --plot predicted the head's layout again from fp64 copies; on bf16 inputs that kept 49
    blocks where the run kept 51. Given the run's layout, the plot draws that head's rows of it."""
    import sparse_attn.predict
    from sparse_attn import accuracy
    from sparse_attn.predict import adaptive_attention, level_params
    q, k, v = accuracy.structured_qkv(2, 8, 1024, 64, seed=0, dtype=torch.bfloat16)
    kw = dict(level_params("medium"), block=128, attention_sink=False)
    _, layout = adaptive_attention(q, k, v, **kw)
    drawn, probs = [], accuracy.attention_probs
    monkeypatch.setattr(accuracy, "attention_probs", lambda q, k, lay=None, **o: drawn.append(lay) or probs(q, k, lay, **o))
    monkeypatch.setattr(sparse_attn.predict, "meansim", lambda *a, **o: pytest.fail("predicted again"))
    accuracy.plot_attention_comparison(tmp_path / "p.png", q=q, k=k, v=v, head=7, params=kw, layout=layout)
    assert torch.equal(drawn[1].to_block_mask()[0, 0], layout.to_block_mask()[0, 7])
    assert_png(tmp_path / "p.png")


def test_attention_comparison_of_given_tensors_matches_their_head():
    """The map drawn for head h is head h's: its dense probabilities equal a softmax of that head."""
    from sparse_attn import accuracy
    q, k, v = accuracy.structured_qkv(2, 4, 96, 16, kv_heads=2, seed=1)
    hq, hk, hv = accuracy.comparison_inputs(q, k, v, head=3, batch=1)
    assert torch.equal(hq[0, 0], q[1, 3].double()) and torch.equal(hk[0, 0], k[1, 1].double())
    p = accuracy.attention_probs(hq, hk)
    want = torch.softmax(q[1, 3].double() @ k[1, 1].double().T / 4.0, -1)
    torch.testing.assert_close(p, want)
    with pytest.raises(ValueError, match="up to 4096 tokens"):
        accuracy.comparison_inputs(torch.zeros(1, 1, 5000, 8), torch.zeros(1, 1, 5000, 8), None, 0, 0)
    with pytest.raises(ValueError, match="v must be \\[B, Hkv, Lk, Dv\\]"):
        accuracy.comparison_inputs(q, k, v[:, :, :50], head=3, batch=1)


def test_attention_probs_takes_the_layout_of_the_real_call():
    """A layout of B batches and Hq heads (what the real call runs) gives the probabilities of its
    batch 0, head 0 entry; it was refused (the 1-head frame check)."""
    from sparse_attn import BlockLayout, accuracy
    q, k, _ = accuracy.structured_qkv(2, 3, 64, 16, seed=2)
    grid = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    grid[..., 0] = True  # every row sees a key
    many = BlockLayout.from_block_mask(grid, block_q=16, block_k=16)
    one = BlockLayout.from_block_mask(grid[:1, :1], block_q=16, block_k=16)
    p = accuracy.attention_probs(q, k, many)
    torch.testing.assert_close(p, accuracy.attention_probs(q, k, one), rtol=0, atol=0)
    mask = one.to_token_mask()[0, 0]
    assert bool((p[~mask] == 0).all()) and bool((p.sum(-1) - 1).abs().max() < 1e-12)


def test_quick_plot_path_is_checked_first_and_reported_as_written(tmp_path, capsys):
    """--plot noext wrote noext.png and said "wrote noext"; a file in place of its folder was a
    FileExistsError traceback after the whole run."""
    rc = run_cli(quick_cli, TINY + ["--device", "cpu", "--plot", str(tmp_path / "noext"), "--min-sparsity", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"wrote {tmp_path / 'noext.png'}" in " ".join(out.split()) and (tmp_path / "noext.png").is_file()
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as e:
        run_cli(quick_cli, TINY + ["--device", "cpu", "--plot", str(afile / "p.png")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and f"--plot {afile}" in captured.err and "Cossim" not in captured.out


def test_thresholds_print_with_the_digits_they_have(tmp_path, capsys):
    """--min-sparsity 0.005 read "> 0%" (quick's check line and the accuracy report)."""
    run_cli(quick_cli, TINY + ["--device", "cpu", "--min-sparsity", "0.005"])
    assert "> 0.5%" in capsys.readouterr().out
    from sparse_attn import accuracy
    header = {"device": "cpu", "dtype": "fp32", "torch": torch.__version__, "seconds": 0.0, "quick": True,
              "head_dim": 32, "block": 128, "thresholds": {"min_cosine": 0.95, "max_l1": 0.1, "min_sparsity": 0.005},
              "levels": {}, "data": ""}
    md = accuracy.write_markdown(tmp_path / "r.md", header, [], images={}).read_text()
    assert "`sparsity` > 0.5%" in md


@pytest.mark.parametrize("shape_q, shape_kv, what", [((1, 2, 0, 32), (1, 2, 64, 32), "q has shape [1, 2, 0, 32], empty in L"),
                                                     ((1, 2, 64, 32), (1, 2, 0, 32), "k has shape [1, 2, 0, 32], empty in L"),
                                                     ((0, 2, 64, 32), (0, 2, 64, 32), "empty in B"),
                                                     ((1, 2, 64, 0), (1, 2, 64, 0), "empty in D")])
def test_quick_refuses_empty_qkv(tmp_path, capsys, shape_q, shape_kv, what):
    """An empty q or k passed every check on "0 of 0 blocks" (as --seq-len 0 is refused)."""
    torch.save({"q": torch.zeros(shape_q), "k": torch.zeros(shape_kv), "v": torch.zeros(shape_kv)}, tmp_path / "e.pt")
    assert run_cli(quick_cli, ["quick", "--device", "cpu", "--qkv", str(tmp_path / "e.pt")]) == 2
    captured = capsys.readouterr()
    assert what in captured.err and "Cossim" not in captured.out


@pytest.mark.parametrize("cli, flag, value", [
    (quick_cli, "--min-cosine", "1"), (quick_cli, "--min-cosine", "nan"), (quick_cli, "--max-l1", "-1"),
    (quick_cli, "--min-sparsity", "1"), (accuracy_cli, "--min-cosine", "1.5"), (accuracy_cli, "--max-l1", "0"),
])
def test_thresholds_no_result_can_meet_are_usage_errors(cli, flag, value, capsys):
    """They ran and failed whatever the attention did (eval-model already refused them)."""
    name = "quick" if cli is quick_cli else "accuracy"
    with pytest.raises(SystemExit) as e:
        run_cli(cli, [name, flag, value])
    assert e.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


@pytest.mark.parametrize("cli, extra, words", [
    (accuracy_cli, ["--dtype", "fp32"], "--dtype fp32"), (quick_cli, ["--dtype", "fp32"], "--dtype fp32"),
    (accuracy_cli, ["--head-dim", "512"], "--head-dim 512"), (quick_cli, ["--head-dim", "512"], "--head-dim 512"),
])
def test_inputs_the_cuda_kernels_cannot_take_are_refused_before_the_run(cli, extra, words, tmp_path, capsys):
    """On CUDA the kernels take fp16/bf16 and head dims up to 256: ``accuracy --dtype fp32`` (offered by
    --dtype) ended in a TypeError traceback at the first case, quick in a message about casting tensors.
    Refused before any input is made (on this CPU-only machine "cuda" is reached past --device's check)."""
    name = "quick" if cli is quick_cli else "accuracy"
    parser = argparse.ArgumentParser(prog="sparse-attn")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([name, "--out-dir", str(tmp_path)] if cli is accuracy_cli else [name])
    for flag, value in zip(extra[::2], extra[1::2]):
        setattr(args, flag[2:].replace("-", "_"), value if flag == "--dtype" else int(value))
    with pytest.raises(SystemExit) as e:
        if cli is quick_cli:
            quick_cli.check(args, "cuda", quick_cli.console())
        else:
            accuracy_cli.run_suite(args, "cuda")
    captured = capsys.readouterr()
    assert e.value.code == 2 and words in captured.err and "--device cpu" in captured.err
    assert "Cossim" not in captured.out and "pass" not in captured.out


@pytest.mark.gpu
def test_quick_plot_of_cuda_inputs(tmp_path, capsys):
    """quick --plot on CUDA (the default device there) drew maps computed on the inputs' device with
    ``.numpy()``: 'can't convert cuda:0 device type tensor to numpy' after the checks had printed."""
    png = tmp_path / "maps.png"
    rc = run_cli(quick_cli, TINY + ["--device", "cuda", "--plot", str(png), "--head", "1", "--min-sparsity", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert_png(png)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool])
def test_quick_refuses_qkv_that_are_not_real_floats(tmp_path, capsys, dtype):
    """A complex q (e.g. captured after a complex-number RoPE) lost its imaginary part in the cast to --dtype
    (only a UserWarning) and integer or bool tensors were read as numbers: results of other inputs."""
    q = torch.ones(1, 2, 64, 16, dtype=dtype)
    torch.save({"q": q, "k": torch.randn(1, 2, 64, 16), "v": torch.randn(1, 2, 64, 16)}, tmp_path / "t.pt")
    assert run_cli(quick_cli, ["quick", "--device", "cpu", "--qkv", str(tmp_path / "t.pt"), "--block", "16"]) == 2
    captured = capsys.readouterr()
    assert f"q is {dtype}" in captured.err and "Cossim" not in captured.out


def test_report_says_whether_the_sweep_was_causal(tmp_path):
    """write_markdown called every sweep "non-causal", also one of run_sweep(causal=True) (its JSON and
    CSV rows say causal)."""
    from sparse_attn import accuracy
    header = {"device": "cpu", "dtype": "fp32", "torch": torch.__version__, "seconds": 0.0, "quick": True,
              "head_dim": 16, "block": 128, "thresholds": {"min_cosine": 0.95, "max_l1": 0.1, "min_sparsity": 0.05},
              "levels": {}, "data": ""}
    for causal in (False, True):
        sweep = accuracy.run_sweep(256, sims=(0.6,), cdfs=(0.9,), causal=causal, heads=1, head_dim=16)
        assert sweep[0]["causal"] is causal
        md = accuracy.write_markdown(tmp_path / "r.md", header, [], images={}, sweep=sweep).read_text()
        line = next(s for s in md.splitlines() if s.startswith("L = 256"))
        assert ("non-causal" in line) is not causal and ("causal" in line)
