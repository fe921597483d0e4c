"""sparse_attn.report: scaling tables, markdown, plots, and the demo's report."""
from __future__ import annotations

import json

import pytest

from sparse_attn import report
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
    assert md_rnd[4].startswith("| 16384 | - | OOM | - |")  # no dense row at 16384
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
