"""sparse_attn.report: scaling tables, markdown, plots, and the demo's report."""
from __future__ import annotations

import dataclasses
import json

import pytest

from sparse_attn import report, report_tables
from sparse_attn.bench import Row, get_suite, restrict
from sparse_attn.bench.accuracy_rows import accuracy_rows, write_accuracy_json
from sparse_attn.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def row(provider, pattern, L, ms, *, causal=False, mode="fwd", error=None, peak=None, density=0.5, tflops=None):
    return Row(provider, pattern, L, 1, 2, 2, 32, "fp32", mode, causal, density, ms=ms, tflops=tflops,
               peak_mem_bytes=peak, error=error)


def synthetic_rows():
    return [
        # local: sdpa-math and sdpa-cudnn both present -> cudnn preferred; cudnn fails at 4096 -> math used
        row("sdpa-cudnn", "local", 1024, 8.0, causal=True, peak=2**20),
        row("sdpa-math", "local", 1024, 16.0, causal=True, peak=2**21),
        row("sparse_attn", "local", 1024, 2.0, causal=True, peak=2**19, tflops=1.5),
        row("sdpa-cudnn", "local", 4096, None, causal=True, error="RuntimeError: no"),
        row("sdpa-math", "local", 4096, 100.0, causal=True, peak=2**22),
        row("sparse_attn", "local", 4096, 4.0, causal=True, peak=2**20, tflops=3.0),
        row("reference", "local", 4096, 50.0, causal=True),  # not a dense provider: ignored
        # random: dense OOM at 8192, pattern OOM at 16384
        row("sdpa-math", "random", 2048, 30.0, peak=2**23),
        row("sparse_attn", "random", 2048, 10.0, peak=2**21),
        row("sdpa-math", "random", 8192, None, error="OOM"),
        row("sparse_attn", "random", 8192, 40.0, peak=2**22),
        row("sparse_attn", "random", 16384, None, error="OOM"),
    ]


def test_scaling_tables_exact_speedups():
    tables = report.scaling_tables(synthetic_rows())
    assert [t.pattern for t in tables] == ["local", "random"]
    local, rnd = tables
    assert [r.seq_len for r in local.rows] == [1024, 4096]
    assert [r.speedup for r in local.rows] == [4.0, 25.0]  # 8/2 (cudnn), 100/4 (math: cudnn failed)
    assert [r.dense_provider for r in local.rows] == ["sdpa-cudnn", "sdpa-math"]
    assert [r.speedup for r in rnd.rows] == [3.0, None, None]
    assert rnd.rows[1].dense_error == "OOM" and rnd.rows[2].pattern_error == "OOM"


def test_markdown_table_cells_and_oom():
    tables = report.scaling_tables(synthetic_rows())
    md_local = report.markdown_table(tables[0])
    lines = md_local.splitlines()
    assert lines[0].startswith("| T | Dense (ms) | Pattern (ms) | Speedup |")
    assert "Peak mem (MiB)" in lines[0] and "dense via" in lines[0]  # two dense providers -> named
    assert lines[2].startswith("| 1024 | 8.000 | 2.000 | 4.00x |")
    assert lines[3].startswith("| 4096 | 100.000 | 4.000 | 25.00x |")
    assert "| 0.5 |" in lines[2]  # 2**19 bytes = 0.5 MiB
    md_rnd = report.markdown_table(tables[1]).splitlines()
    assert md_rnd[2].startswith("| 2048 | 30.000 | 10.000 | 3.00x |")
    assert md_rnd[3].startswith("| 8192 | OOM | 40.000 | - |")
    assert md_rnd[4].startswith("| 16384 | not run | OOM | - |")  # no dense row at 16384: not part of the run
    assert "dense via" not in md_rnd[0]


def test_render_markdown_cpu_header_and_accuracy():
    acc = [{"pattern": "random", "seq_len": 2048, "sparsity": 0.5, "density": 0.5, "cosine": 0.75,
            "relative_l1": 0.25, "error": None}]
    cpu = {"gpu": "cpu", "device": "cpu", "torch": "2.x", "triton": None, "date": "2026-01-01", "suite": "small"}
    md = report.render_markdown(cpu, synthetic_rows(), acc)
    first = md.splitlines()[2]
    assert "CPU run" in first and "reference path" in first and "not kernel performance" in first
    assert "## random: B=1 H=2 Hkv=2 D=32 fp32 fwd" in md
    assert "## local (causal)" in md
    assert "cosine 0.7500, relative L1 0.2500, sparsity 0.500" in md
    assert "| random | 2048 | 0.500 | 0.7500 | 0.2500 |" in md
    gpu = dict(cpu, gpu="NVIDIA H100", device="cuda")
    assert "CPU run" not in report.render_markdown(gpu, synthetic_rows(), acc)


def test_write_report_pngs_and_load(tmp_path):
    rows = synthetic_rows()
    header = {"gpu": "NVIDIA H100", "device": "cuda", "torch": "2.x", "triton": "3.x", "date": "d", "suite": "t"}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"header": header, "rows": [r.__dict__ for r in rows]}))
    acc = [{"pattern": "random", "seq_len": 2048, "sparsity": 0.5, "cosine": 0.75, "relative_l1": 0.25,
            "error": None}]
    acc_path = write_accuracy_json(tmp_path / "acc.json", {}, acc)
    h, rows2, acc2 = report.load_results([bench, acc_path])
    assert h == header and len(rows2) == len(rows) and acc2 == acc
    md, pngs = report.write_report(tmp_path / "out", h, rows2, acc2)
    assert md == tmp_path / "out" / "report.md"
    assert [p.name for p in pngs] == ["report-runtime.png", "report-speedup.png", "report-memory.png",
                                      "report-accuracy.png"]
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
        assert f"]({p.name})" in md.read_text()


def test_memory_plot_marks_oom(tmp_path, monkeypatch):
    notes = []
    import matplotlib.axes
    orig = matplotlib.axes.Axes.annotate

    def spy(self, text, *a, **k):
        notes.append(text)
        return orig(self, text, *a, **k)
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", spy)
    # the plots show the first fwd config; only 'random' rows so both OOMs (dense 8192, pattern 16384) show
    rows = [r for r in synthetic_rows() if r.pattern == "random"]
    p = report.plot_memory(rows, tmp_path / "mem.png")
    assert p.read_bytes()[:8] == PNG_MAGIC
    assert notes.count("OOM") == 2


@pytest.mark.parametrize("plot", ["plot_runtime", "plot_speedup", "plot_memory"])
def test_plots_label_a_patterns_causal_variant(tmp_path, monkeypatch, plot):
    """The memory plot labelled a pattern's causal and non-causal lines alike ('random' twice), where the
    runtime and speedup plots (and the summary) say '(causal)'."""
    from sparse_attn import report_plots
    labels = []
    save = report_plots._save

    def spy(fig, path):
        labels.extend(fig.axes[0].get_legend_handles_labels()[1])
        return save(fig, path)
    monkeypatch.setattr(report_plots, "_save", spy)
    rows = [row("sdpa-cudnn", "random", 1024, 8.0, peak=2**20), row("sparse_attn", "random", 1024, 2.0, peak=2**19),
            row("sdpa-cudnn", "random", 1024, 5.0, causal=True, peak=2**20),
            row("sparse_attn", "random", 1024, 1.0, causal=True, peak=2**18)]
    getattr(report_plots, plot)(rows, tmp_path / "p.png")
    assert "random" in labels and "random (causal)" in labels


def test_memory_plots_legend_leaves_the_oom_marks_visible(tmp_path, monkeypatch):
    """OOM marks sit at the top of the memory plot; the legend, placed 'best' inside the axes, covered two of
    the three in the committed report's plot once its labels said '(causal)'. No measured point is under it."""
    import matplotlib.figure
    seen = {}
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        out = savefig(fig, *a, **k)  # drawn: the legend's place is final
        ax = fig.axes[0]
        seen["legend"], seen["figure"] = ax.get_legend().get_window_extent(), fig.bbox
        seen["marks"] = [ax.transData.transform(p) for c in ax.collections for p in c.get_offsets()]
        seen["points"] = [ax.transData.transform(p) for line in ax.lines for p in line.get_xydata()]
        return out
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    from pathlib import Path
    committed = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "report-h100" / "report-h100.json"
    if not committed.exists():
        pytest.skip("no committed report")
    _, rows, _ = report.load_results([committed])
    report.plot_memory(rows, tmp_path / "mem.png", "\n(B=1 H=32 Hkv=32 D=128 bf16 fwd)")
    assert len(seen["marks"]) == 3
    assert not any(seen["legend"].contains(x, y) for x, y in seen["marks"] + seen["points"])
    legend, figure = seen["legend"], seen["figure"]  # outside the axes, still inside the picture
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0 and legend.y1 <= figure.y1


def test_accuracy_rows_small_suite():
    suite = restrict(get_suite("small"), patterns=["dense", "local", "random"], seq_lens=[512])
    acc = {a["pattern"]: a for a in accuracy_rows(suite, "cpu")}
    assert set(acc) == {"dense", "local", "random"}
    assert all(a["error"] is None and a["seq_len"] == 512 for a in acc.values())
    assert acc["dense"]["cosine"] == pytest.approx(1.0, abs=1e-9) and acc["dense"]["relative_l1"] < 1e-6
    assert acc["dense"]["sparsity"] == 0.0
    assert 0.0 < acc["random"]["sparsity"] < 1.0 and acc["random"]["cosine"] < 0.99
    assert acc["local"]["sparsity"] > 0.0 and acc["local"]["cosine"] < 1.0


def test_demo_quick_writes_report(tmp_path, capsys):
    assert main(["demo", "--quick", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    md = tmp_path / "report.md"
    assert md.exists() and str(md) in out
    text = md.read_text()
    assert "CPU run" in text.splitlines()[2]
    assert "| T | Dense (ms) | Pattern (ms) | Speedup |" in text
    assert "Dense (ms)" in out and "Speedup" in out  # tables printed to the terminal too
    for name in ("report-runtime.png", "report-speedup.png", "report-memory.png", "report-accuracy.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    acc = json.loads((tmp_path / "bench" / "accuracy-cpu.json").read_text())["accuracy"]
    assert {a["pattern"] for a in acc} == {"dense", "causal", "local", "random"}


def test_suite_all_cpu_and_stress(tmp_path):
    from sparse_attn.bench.suites import suite_all
    small = get_suite("small")
    s = suite_all("cpu")
    assert s.name == "all" and s.cases == small.cases
    stressed = suite_all("cpu", stress=True)
    assert all(c.seq_lens[-2:] == (2 * max(o.seq_lens), 4 * max(o.seq_lens))
               for c, o in zip(stressed.cases, small.cases))
    assert main(["bench", "--suite", "all", "--device", "cpu", "--patterns", "dense", "--seq-lens", "256",
                 "--providers", "sdpa-math", "--reps", "1", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "all-cpu.json").read_text())
    assert data["header"]["suite"] == "all" and len(data["rows"]) == 1 and data["rows"][0]["ms"] > 0
    assert (tmp_path / "all-cpu.csv").exists()
    assert main(["bench", "--suite", "small", "--stress", "--device", "cpu", "--out-dir", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------- report-gpu run in slices, merged
def fake_row(p) -> Row:
    """A stand-in for a GPU measurement of point ``p`` (times by a formula; naive attention OOM from 16K)."""
    from sparse_attn.bench import get_provider
    c, L = p.case, p.seq_len
    scale = (L / 4096) ** 2 * (0.5 if c.pattern.causal else 1.0) * (1.0 if p.mode == "fwd" else 3.5)
    if get_provider(p.provider).computes == "dense" or c.pattern.name in ("dense", "causal", "adaptive"):
        ms = {"sdpa-cudnn": 0.5, "sdpa-flash": 0.9, "flex": 0.7, "sdpa-math": 14.0}.get(p.provider, 0.6) * scale
    else:
        ms = 0.3 * L / 4096 * (1.0 if p.mode == "fwd" else 3.5)
    oom = p.provider == "sdpa-math" and L >= 16384
    return Row(p.provider, c.pattern.name, L, c.batch, c.heads, p.kv_heads, c.head_dim, c.dtype, p.mode,
               c.pattern.causal, 0.5, None if oom else ms, None if oom else 100.0,
               None if oom else L * 2**10, "OOM" if oom else None)


def write_fake_slices(folder, n=4, keep=None):
    """report-gpu cut into ``n`` slices (the real plan), each written as its GPU run would write it."""
    from sparse_attn.bench import expand, make_header, write_json
    from sparse_attn.bench.slices import plan
    parts = plan(get_suite("report-gpu"), n)
    for k, part in enumerate(parts, 1):
        if keep is not None and k not in keep:
            continue
        header = dict(make_header("cpu", "report-gpu", slice=f"{k}/{n}"), gpu="NVIDIA H100 80GB HBM3", device="cuda",
                      date=f"2026-01-01T00:0{k}:00+00:00")
        write_json(folder / f"report-gpu-cuda-{k}-of-{n}.json", header, [fake_row(p) for p in expand(part)])
    return parts


def test_report_merges_slices_into_one_report(tmp_path, capsys):
    from sparse_attn.bench import expand
    runs, out = tmp_path / "runs", tmp_path / "out"
    parts = write_fake_slices(runs)
    # slice 2 run again later (e.g. after a cut-off): its rows win
    from sparse_attn.bench import make_header, write_json
    again = [fake_row(p) for p in expand(parts[1])[:1]]
    again[0].ms = 123.0
    write_json(runs / "report-gpu-cuda-2-of-4-b.json",
               dict(make_header("cpu", "report-gpu", slice="2/4"), gpu="NVIDIA H100 80GB HBM3", device="cuda",
                    date="2026-01-02T00:00:00+00:00"), again)
    assert main(["report", "--from", str(runs), "--out-dir", str(out), "--accuracy-len", "512"]) == 0
    merged = json.loads((out / "results.json").read_text())
    suite_rows = expand(get_suite("report-gpu"))
    assert len(merged["rows"]) == len(suite_rows) == 186
    assert merged["header"]["merged"] and len(merged["header"]["slices"]) == 5
    assert merged["header"]["gpu"] == "NVIDIA H100 80GB HBM3" and "slice" not in merged["header"]
    by_key = {(r["pattern"], r["seq_len"], r["mode"], r["provider"]): r for r in merged["rows"]}
    p0 = expand(parts[1])[0]
    assert by_key[(p0.case.pattern.name, p0.seq_len, p0.mode, p0.provider)]["ms"] == 123.0
    text = (out / "report.md").read_text()
    assert "Incomplete" not in text and "- run in 5 slices" in text
    assert "## Summary: speedup over dense, fwd\n" in text and "## Summary: speedup over dense, fwd+bwd" in text
    names = sorted({p.case.pattern.name for p in suite_rows})
    assert len(names) == 10
    for name in names:  # a scaling table per pattern and mode
        for mode in ("fwd", "fwd+bwd"):
            heading = [ln for ln in text.splitlines() if ln.startswith(f"## {name}") and ln.endswith(f"bf16 {mode}")]
            assert len(heading) == 1, (name, mode)
    assert text.count("| T | Dense (ms) | Pattern (ms) | Speedup |") == 20
    # 1M: dense not run (and said so, with an estimate), the pattern timed
    local = text.split("## local-4096 (causal): B=1 H=32 Hkv=32 D=128 bf16 fwd\n", 1)[1].split("\n## ", 1)[0]
    assert "| 1048576 | not run | 76.800 | - |" in local
    assert "Dense attention was not run at T = 256K, 512K, 1M" in local and "estimates, not measurements" in local
    # naive attention runs out of memory from 16K: the dense baselines say OOM there, time and memory
    base = text.split("### non-causal: B=1 H=32 Hkv=32 D=128 bf16 fwd\n", 1)[1].split("\n### ", 1)[0]
    assert "naive (SDPA math) (ms)" in base and "FlexAttention (ms)" in base and "SDPA flash (FA2) (ms)" in base
    assert "| 8192 | 2.000 | 3.600 | 2.800 | 56.000 | 2.400 |" in base
    assert "| 16384 | 8.000 | 14.400 | 11.200 | OOM | 9.600 |" in base
    # accuracy computed on the CPU for every pattern, saved, and reused by the next merge
    acc = json.loads((out / "accuracy.json").read_text())["accuracy"]
    assert sorted(a["pattern"] for a in acc) == names and all(a["error"] is None for a in acc)
    for png in ("report-runtime.png", "report-speedup.png", "report-memory.png", "report-runtime-fwdbwd.png",
                "report-memory-fwdbwd.png", "report-accuracy.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC and f"]({png})" in text
    mtime = (out / "accuracy.json").stat().st_mtime
    assert main(["report", "--from", str(runs), "--out-dir", str(out), "--accuracy-len", "512"]) == 0
    assert (out / "accuracy.json").stat().st_mtime == mtime
    assert "computing accuracy" not in capsys.readouterr().out.split("wrote")[-1]


def test_report_recomputes_accuracy_made_at_another_length_or_failed(tmp_path, capsys, one_thread):
    """OUT/accuracy.json is reused only when made at the asked --accuracy-len with a row that did not fail
    (a report at 512 said T=256, and a cache of error rows, e.g. from --accuracy-len -5, stuck)."""
    from sparse_attn.bench import expand, make_header, write_json
    runs, out = tmp_path / "runs", tmp_path / "out"
    suite = restrict(get_suite("small"), patterns=["local"], seq_lens=[256], modes=["fwd"])
    write_json(runs / "small-cpu.json", make_header("cpu", "small"), [fake_row(p) for p in expand(suite)])
    argv = ["report", "--from", str(runs), "--out-dir", str(out), "--accuracy-len"]

    def saved():
        data = json.loads((out / "accuracy.json").read_text())
        acc = data["accuracy"]
        return data["header"]["seq_len"], {a["seq_len"] for a in acc}, [a["error"] for a in acc]

    assert main(argv + ["256"]) == 0 and saved()[:2] == (256, {256})
    capsys.readouterr()
    assert main(argv + ["512"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "made at T=256, not --accuracy-len 512" in text and "computing accuracy" in text
    assert saved()[:2] == (512, {512}) and "Accuracy vs dense (T=512, fp32)" in (out / "report.md").read_text()
    assert main(argv + ["512"]) == 0 and "computing accuracy" not in capsys.readouterr().out  # same length: reused
    head = {"device": "cpu", "suite": "small", "seq_len": 512}
    write_accuracy_json(out / "accuracy.json", head, [{"pattern": "local", "seq_len": 512, "error": "ValueError"}])
    assert main(argv + ["512"]) == 0
    assert "every row in it failed" in " ".join(capsys.readouterr().out.split())
    length, _, errors = saved()
    assert length == 512 and len(errors) > 1 and not any(errors)


def test_report_inputs_and_out_dir_are_checked_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--from", str(tmp_path / "nonexist"), "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2 and "no such file or folder" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["report", "--from", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "afile")])
    assert e.value.code == 2 and f"--out-dir {tmp_path / 'afile'}" in capsys.readouterr().err


def test_report_lists_missing_slices(tmp_path, capsys):
    from sparse_attn.bench import expand
    parts = write_fake_slices(tmp_path / "runs", keep={1, 2, 3})
    assert main(["report", "--from", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out"),
                 "--no-accuracy"]) == 0
    n_missing = len(expand(parts[3]))
    assert f"{n_missing} rows of suite report-gpu are missing" in capsys.readouterr().out
    assert f"**Incomplete: {n_missing} rows of suite `report-gpu` are missing**" in (tmp_path / "out" / "report.md").read_text()


def test_report_without_rows_is_an_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", "--from", str(tmp_path / "empty"), "--out-dir", str(tmp_path / "out")]) == 2
    assert "no benchmark rows" in capsys.readouterr().err


def test_not_run_note_extrapolates_and_says_so():
    rows = [row("sdpa-cudnn", "local", 1024, 1.0, causal=True), row("sdpa-cudnn", "local", 2048, 4.0, causal=True),
            row("sparse_attn", "local", 1024, 0.5, causal=True), row("sparse_attn", "local", 2048, 1.0, causal=True),
            row("sparse_attn", "local", 8192, 4.0, causal=True)]
    (t,) = report.scaling_tables(rows)
    assert [r.dense_provider for r in t.rows] == ["sdpa-cudnn", "sdpa-cudnn", None]
    note = report_tables.not_run_note(t)
    # 4 ms at 2K x (8K/2K)^2 = 64 ms; the pattern 4 ms: 16x; fp32 scores 1*2*8192^2*4 bytes
    assert "not run at T = 8K" in note and "(T/2K)²" in note and "about 64.0 ms" in note and "about 16x less" in note
    assert "not measurements" in note and "0.5 GiB for its fp32 scores" in note  # 2 * 8192^2 * 4 bytes; was 0 TiB
    assert report_tables.not_run_note(report.scaling_tables(rows[:4])[0]) is None


def test_not_run_note_keeps_small_estimates_readable_and_says_when_the_pattern_is_slower():
    """At CPU sizes the estimate read 'about 0.0 s', '0.0 GiB' of scores and, for a pattern slower
    than the extrapolated dense call, 'about 0x less'."""
    rows = [row("sdpa-math", "adaptive", 256, 0.4, causal=True), row("adaptive", "adaptive", 256, 1.2, causal=True),
            row("adaptive", "adaptive", 1024, 20.0, causal=True)]
    (t,) = report.scaling_tables(rows)
    note = report_tables.not_run_note(t)
    # 0.4 ms x (1K/256)^2 = 6.4 ms; the pattern's 20 ms is 3.1x that; scores 1*2*1024^2*4 bytes = 8 MiB
    assert "about 6.4 ms" in note and "about 3.1x more" in note and "8.0 MiB for its fp32 scores" in note
    assert "0.0 s" not in note and "0x" not in note and "0.0 GiB" not in note
    faster = [dataclasses.replace(rows[2], ms=2.0)]  # 6.4 / 2 = 3.2x less
    note = report_tables.not_run_note(report.scaling_tables(rows[:2] + faster)[0])
    assert "(the pattern: 2.0 ms, about 3.2x less)" in note


def test_rows_with_annotations_load(tmp_path):
    """kernels-h100.json's rows carry merge_results.py's 'slice' (a probe's, 'run'): the reader refused
    the whole file; a row missing a field is still refused."""
    from sparse_attn.bench.results import read_result
    good = dataclasses.asdict(row("flex", "local", 1024, 1.0))
    (tmp_path / "a.json").write_text(json.dumps({"header": {}, "rows": [dict(good, slice="gqa", run=2)]}))
    assert read_result(tmp_path / "a.json")[1] == [row("flex", "local", 1024, 1.0)]
    del good["pattern"]
    (tmp_path / "b.json").write_text(json.dumps({"header": {}, "rows": [good]}))
    with pytest.raises(ValueError, match="b.json: a row is not a bench row.*pattern"):
        read_result(tmp_path / "b.json")


def test_a_newer_unsliced_rerun_wins_and_keeps_the_suites_header(tmp_path):
    """An unsliced re-run of some rows counted as slice 0, the oldest: the stale rows won, and its
    restricted header made the missing-row count check only the re-run's rows."""
    from sparse_attn.bench import make_header, write_json
    write_fake_slices(tmp_path, keep={1, 2})
    first = json.loads((tmp_path / "report-gpu-cuda-1-of-4.json").read_text())["rows"][0]
    again = Row(**dict(first, ms=999.0))
    write_json(tmp_path / "rerun.json", dict(make_header("cpu", "report-gpu", restricted={"patterns": [first["pattern"]]}),
                                            date="2026-02-01T00:00:00+00:00"), [again])
    header, rows, _ = report.merge_results(sorted(tmp_path.glob("*.json")))
    assert next(r for r in rows if r.key() + (r.provider,) == again.key() + (again.provider,)).ms == 999.0
    assert "restricted" not in header
    header2, rows2, _ = report.merge_results([p for p in tmp_path.glob("*-of-4.json")])
    assert len(report.missing_rows(header, rows)) == len(report.missing_rows(header2, rows2)) > 0


def test_the_summary_keeps_a_patterns_causal_variant():
    rows = [row("sdpa-cudnn", "dense", 4096, 10.0), row("sdpa-cudnn", "causal", 4096, 6.0, causal=True),
            row("sparse_attn", "random", 4096, 5.0), row("sparse_attn", "random", 4096, 4.0, causal=True)]
    tables = report.scaling_tables(rows)
    cols, cells = report_tables.speedup_matrix(tables, report_tables.configs_by_mode(tables)[0])
    assert sorted(cells) == [["random", "2.00x"], ["random (causal)", "1.50x"]]  # the causal line was dropped


def test_speedup_matrix_and_baselines():
    rows = synthetic_rows() + [row("flex", "dense", 1024, 3.0), row("sdpa-math", "dense", 1024, 6.0),
                               row("sparse_attn", "dense", 1024, 2.5)]
    tables = report.scaling_tables(rows)
    cols, cells = report_tables.speedup_matrix(tables, report_tables.configs_by_mode(tables)[0])
    assert cols == ["pattern", "1K", "2K", "4K", "8K", "16K"]
    assert cells[0] == ["local (causal)", "4.00x", "", "25.00x", "", ""]
    assert cells[1] == ["random", "", "3.00x", "", "dense OOM", "OOM"]
    assert cells[2] == ["dense", "2.40x", "", "", "", ""]
    bts = report_tables.baseline_tables(rows)
    non_causal = next(b for b in bts if not b.causal)
    assert non_causal.providers == ["flex", "sdpa-math", "sparse_attn"]
    cols, cells = report_tables.baseline_grid(non_causal, "ms")
    assert cols == ["T", "FlexAttention (ms)", "naive (SDPA math) (ms)", "sparse_attn (ms)"]
    assert cells[0] == ["1024", "3.000", "6.000", "2.500"]
    assert ["8192", "not run", "OOM", "not run"] in cells
    _, mem = report_tables.baseline_grid(non_causal, "mem")
    assert ["8192", "not run", "OOM", "not run"] in mem


def test_speedup_matrix_names_a_failed_dense_row():
    """A dense row that failed other than by OOM left a bare '-' in the summary (the scaling table says
    'error'), as if nothing had been run."""
    rows = [row("sdpa-cudnn", "random", 1024, None, error="RuntimeError: cuDNN broke"),
            row("sparse_attn", "random", 1024, 2.0), row("sdpa-cudnn", "random", 2048, None, error="OOM"),
            row("sparse_attn", "random", 2048, 4.0)]
    tables = report.scaling_tables(rows)
    assert report_tables.table_cells(tables[0])[0][:4] == ["1024", "error", "2.000", "-"]
    cols, cells = report_tables.speedup_matrix(tables, report_tables.configs_by_mode(tables)[0])
    assert cells == [["random", "dense error", "dense OOM"]]


def test_merge_results_script_writes_readme_section(tmp_path):
    import importlib.util
    from pathlib import Path
    spec_ = importlib.util.spec_from_file_location(
        "merge_results", Path(__file__).resolve().parent.parent / "benchmarks" / "merge_results.py")
    mr = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mr)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{mr.REPORT_BEGIN}\nold\n{mr.REPORT_END}\noutro\n")
    write_fake_slices(tmp_path / "runs", keep={1, 2, 3, 4})
    from sparse_attn.cli.report import build_report
    _, _, merged, missing = build_report([tmp_path / "runs"], tmp_path / "out", accuracy_len=None)
    assert missing == []
    section = mr.report_section(merged)
    assert "[benchmarks/results/report-h100/report.md](benchmarks/results/report-h100/report.md)" in section
    assert "| local-4096 (causal) |" in section and "| not run |" in section
    assert mr.write_readme_section(mr.REPORT_BEGIN, mr.REPORT_END, section, readme)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{mr.REPORT_END}\noutro\n") and "old" not in text
    assert section in text
    assert not mr.write_readme_section("<!-- nope -->", mr.REPORT_END, "x", readme)


def test_malformed_inputs_are_errors_naming_the_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"header": {"suite": "small"}, "rows": [asdict_row(r) for r in synthetic_rows()[:2]]}))
    cases = {"list.json": "[1, 2]", "other.json": json.dumps({"header": {}, "texts": []}), "bad.json": "{not json",
             "badrow.json": json.dumps({"rows": [{"provider": "x"}]})}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{name}: "):
            report.merge_results([good, tmp_path / name])
        with pytest.raises(ValueError, match=rf"{name}: "):
            report.load_results([tmp_path / name])


def test_merging_two_suites_says_so_in_the_header(tmp_path):
    rows = synthetic_rows()
    for suite in ("small", "sage-tiny"):
        (tmp_path / f"{suite}.json").write_text(json.dumps({"header": {"suite": suite}, "rows": [asdict_row(rows[0])]}))
    header, _, _ = report.merge_results(sorted(tmp_path.glob("*.json")))
    assert header["suite"] == "sage-tiny + small"


def asdict_row(r):
    from dataclasses import asdict
    return asdict(r)


def test_speedup_matrix_shows_only_its_captions_config():
    """A pattern measured only at another config (Hkv 8 here) stays out of the matrix captioned with
    the main config (Hkv 32): its numbers once appeared there."""
    rows = [row("sdpa-cudnn", "local", 4096, 2.0), row("sparse_attn", "local", 4096, 1.0)]
    rows += [dataclasses.replace(r, kv_heads=8, pattern="random", ms=r.ms / 10) for r in rows]
    tables = report.scaling_tables(rows)
    main = report_tables.configs_by_mode(tables)[0]
    _, cells = report_tables.speedup_matrix(tables, main)
    assert [c[0] for c in cells] == ["local"], cells


def test_a_restricted_run_is_compared_with_the_rows_it_asked_for(tmp_path, one_thread):
    """bench --patterns/--seq-lens records its restriction: the report then lists no rows of the
    full suite as missing (a run of a few rows read "Incomplete: 91 rows missing")."""
    out = tmp_path / "b"
    assert main(["bench", "--device", "cpu", "--patterns", "local", "--seq-lens", "256", "--modes", "fwd",
                 "--providers", "sparse_attn", "--reps", "1", "--no-progress", "--out-dir", str(out)]) == 0
    (path,) = out.glob("*.json")
    header, rows, _ = report.load_results([path])
    assert header["restricted"] == {"providers": ["sparse_attn"], "patterns": ["local"], "seq_lens": [256],
                                    "modes": ["fwd"]}
    assert rows and report.missing_rows(header, rows) == []
    assert report.missing_rows(header, rows[:0])  # what it does lack is still listed


def test_a_restricted_runs_report_has_accuracy_for_the_layouts_it_timed(tmp_path, one_thread, capsys):
    """Seed 002's streaming benchmark (--patterns streaming --window 64 --num-sink 16): the report computed
    accuracy for every pattern of the suite at the suite's options, and none for the layout timed; and
    an accuracy.json made for another selection was reused."""
    from sparse_attn.cli.report import build_report
    runs = tmp_path / "b"
    assert main(["bench", "--device", "cpu", "--patterns", "streaming", "--window", "64", "--num-sink", "16",
                 "--seq-lens", "256", "--modes", "fwd", "--providers", "sparse_attn", "--reps", "1", "--no-progress",
                 "--out-dir", str(runs)]) == 0
    header, rows, _ = report.load_results(list(runs.glob("*.json")))
    (timed,) = {r.pattern for r in rows}
    assert timed == "streaming[num_sink=16,window=64]"
    out = tmp_path / "r"
    build_report([runs], out, accuracy_len=256)
    _, _, acc = report.load_results([out / "accuracy.json"])
    assert [a["pattern"] for a in acc] == [timed]
    (expected,) = accuracy_rows(restrict(get_suite("small"), patterns=["streaming"], heads=2, kv_heads=[2],
                                         seq_lens=[256], pattern_options={"window": 64, "num_sink": 16}),
                                "cpu", at="largest")
    assert acc[0]["sparsity"] == pytest.approx(expected["sparsity"]) and acc[0]["sparsity"] > 0
    # an accuracy.json of the whole suite in that folder is not taken for this selection
    write_accuracy_json(out / "accuracy.json", {"device": "cpu", "suite": "small", "seq_len": 256},
                        [dict(acc[0], pattern="local")])
    build_report([runs], out, accuracy_len=256)
    assert "not reusing" in capsys.readouterr().out
    _, _, acc = report.load_results([out / "accuracy.json"])
    assert [a["pattern"] for a in acc] == [timed]


def test_terminal_tables_keep_a_re_parameterised_patterns_name():
    """rich read "[window=64]" in a table's title as markup and dropped it: the tables of two windows had
    the same title "local (causal)"."""
    from rich.console import Console
    rows = [row(p, f"local[window={w}]", 1024, ms, causal=True) for w in (64, 128)
            for p, ms in (("sdpa-math", 8.0), ("sparse_attn", 2.0))]
    acc = [{"pattern": "local[window=64]", "seq_len": 1024, "error": "ValueError: [bad] input"}]
    con = Console(record=True, width=200)
    for t in report.rich_tables(rows, acc):
        con.print(t)
    text = " ".join(con.export_text().split())  # the caption wraps at the table's width
    assert "local[window=64] (causal)" in text and "local[window=128] (causal)" in text
    assert "failed: ValueError: [bad] input" in text


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as jq, JSON.parse or serde_json do."""
    def refuse(const):
        raise ValueError(f"non-JSON constant {const}")
    return json.loads(text, parse_constant=refuse)


def test_result_files_are_strict_json_with_non_finite_values_as_null(tmp_path, capsys):
    from sparse_attn import accuracy, sage_suite
    from sparse_attn.bench import make_header, write_json
    from sparse_attn.bench.results import read_result
    nan, inf = float("nan"), float("inf")
    rows = synthetic_rows()[:2]
    rows[0].ms, rows[1].tflops = nan, inf
    header = dict(make_header("cpu", "custom"), gpu="NVIDIA H100 80GB HBM3", device="cuda")
    write_json(tmp_path / "runs" / "bench.json", header, rows)
    data = _strict_json((tmp_path / "runs" / "bench.json").read_text())
    assert data["rows"][0]["ms"] is None and data["rows"][1]["tflops"] is None
    _, back, _ = read_result(tmp_path / "runs" / "bench.json")
    assert back[0].ms is None and back[1].ms == rows[1].ms
    acc_row = {"pattern": "local", "cosine": nan, "relative_l1": -inf, "error": None, "seq_len": 64, "sparsity": 0.5}
    write_accuracy_json(tmp_path / "acc.json", {"suite": "x"}, [acc_row])
    assert _strict_json((tmp_path / "acc.json").read_text())["accuracy"][0]["cosine"] is None
    accuracy.write_json(tmp_path / "accuracy-cli.json", {"x": nan}, [{"cosine": nan, "nested": [inf, 1.0]}])
    data = _strict_json((tmp_path / "accuracy-cli.json").read_text())
    assert data["header"]["x"] is None and data["cases"][0]["nested"] == [None, 1.0]
    check = sage_suite.Check("correctness", "nan", False, "cosine nan", nan, inf, {})
    sage_suite.write_json(tmp_path / "sage.json", {}, [check], [{"speedup": nan}])
    data = _strict_json((tmp_path / "sage.json").read_text())
    assert data["checks"][0]["cosine"] is None and data["benchmark"][0]["speedup"] is None
    # the report's merged results.json, and its markdown shows the missing time as "-"
    assert main(["report", "--from", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "out")]) == 0
    merged = _strict_json((tmp_path / "out" / "results.json").read_text())
    assert merged["rows"][0]["ms"] is None


def test_json_writes_numpy_and_torch_scalars_as_numbers():
    """A NaN inside a numpy or torch scalar went out as the string 'nan' / 'tensor(nan)' (default=str)."""
    import numpy as np
    import torch

    from sparse_attn.json_io import dumps
    text = dumps({"a": torch.tensor(float("nan")), "b": np.float32("inf"), "c": [np.float64(1.5), torch.tensor(2)],
                  "d": np.array(3.0), "e": np.bool_(True)}, default=str)
    assert json.loads(text) == {"a": None, "b": None, "c": [1.5, 2], "d": 3.0, "e": True}
