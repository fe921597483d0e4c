"""A readable long-context benchmark report from bench result JSON files.

    from sparse_attn.report import load_results, write_report
    header, rows, acc = load_results(["out/bench/demo-cpu.json", "out/bench/accuracy-cpu.json"])
    write_report("out", header, rows, acc)       # out/report.md + out/report-*.png

or ``python -m sparse_attn.report out/bench/*.json --out-dir out``.

For every pattern (and every distinct B/H/Hkv/D/dtype/mode config of it) a scaling table
``T | Dense (ms) | Pattern (ms) | Speedup | TFLOP/s | Peak mem (MiB)``: *Pattern* is the
``sparse_attn`` provider's row, *Dense* the best available dense SDPA row at the same key (first
of :data:`DENSE_PREFERENCE` that has a time; causal-dense for a causal pattern), Speedup = dense
ms / pattern ms. Failed rows show their error ("OOM"). Accuracy rows (see
:mod:`sparse_attn.bench.accuracy_rows`) are joined by pattern name. Everything from rows to
markdown / figures is a pure function (:func:`scaling_tables`, :func:`render_markdown`,
:func:`plot_*`), so it is testable without running a benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .bench.results import Row

PATTERN_PROVIDER = "sparse_attn"
DENSE_PREFERENCE = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math")
CPU_NOTE = ("**CPU run: this is the PyTorch reference path at small sizes (correctness-sized), "
            "not kernel performance.** Timings below say nothing about the Triton kernels on a GPU.")
CONFIG_FIELDS = ("batch", "heads", "kv_heads", "head_dim", "dtype", "mode")


# ----------------------------------------------------------------------------- loading
def load_results(paths) -> tuple[dict, list[Row], list[dict]]:
    """(first header, all bench rows, all accuracy dicts) of JSON files holding ``rows`` and/or
    ``accuracy`` (bench results and :func:`~sparse_attn.bench.accuracy_rows.write_accuracy_json`)."""
    header: dict = {}
    rows: list[Row] = []
    acc: list[dict] = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not header and data.get("header"):
            header = dict(data["header"])
        rows += [Row(**r) for r in data.get("rows", [])]
        acc += list(data.get("accuracy", []))
    return header, rows, acc


def is_cpu(header: dict, rows: list[Row] | None = None) -> bool:
    return header.get("gpu") == "cpu" or str(header.get("device", "")).startswith("cpu")


# ----------------------------------------------------------------------------- tables
@dataclass
class ScalingRow:
    seq_len: int
    dense_ms: float | None
    pattern_ms: float | None
    speedup: float | None
    tflops: float | None
    peak_mem_bytes: int | None
    density: float | None
    dense_provider: str | None = None
    dense_error: str | None = None
    pattern_error: str | None = None
    dense_peak_mem_bytes: int | None = None


@dataclass
class ScalingTable:
    pattern: str
    causal: bool
    config: dict
    rows: list[ScalingRow] = field(default_factory=list)

    def dense_providers(self) -> list[str]:
        return list(dict.fromkeys(r.dense_provider for r in self.rows if r.dense_provider))


def _dense_key(r: Row) -> tuple:
    """Dense rows do not depend on the pattern's layout, only on the shapes and causality."""
    return (r.seq_len, r.batch, r.heads, r.kv_heads, r.head_dim, r.dtype, r.mode, r.causal)


def best_dense(rows: list[Row]) -> dict[tuple, Row]:
    """key (of :func:`_dense_key`, plus pattern) -> the preferred dense row: first of
    :data:`DENSE_PREFERENCE` with a time; else the first such row with an error (so OOM shows)."""
    by: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.provider in DENSE_PREFERENCE:
            by.setdefault(_dense_key(r), {}).setdefault(r.provider, r)
    out = {}
    for key, provs in by.items():
        ordered = [provs[p] for p in DENSE_PREFERENCE if p in provs]
        timed = [r for r in ordered if r.ms]
        out[key] = timed[0] if timed else ordered[0]
    return out


def scaling_tables(rows: list[Row], pattern_provider: str = PATTERN_PROVIDER) -> list[ScalingTable]:
    """One :class:`ScalingTable` per (pattern, config), in first-seen order, rows sorted by T."""
    dense = best_dense(rows)
    tables: dict[tuple, ScalingTable] = {}
    for r in rows:
        if r.provider != pattern_provider:
            continue
        cfg = {f: getattr(r, f) for f in CONFIG_FIELDS}
        tkey = (r.pattern, r.causal) + tuple(cfg.values())
        t = tables.setdefault(tkey, ScalingTable(r.pattern, r.causal, cfg))
        d = dense.get(_dense_key(r))
        dms = d.ms if d is not None else None
        sp = dms / r.ms if dms and r.ms else None
        t.rows.append(ScalingRow(r.seq_len, dms, r.ms, sp, r.tflops, r.peak_mem_bytes, r.density,
                                 d.provider if d is not None else None, d.error if d is not None else None,
                                 r.error, d.peak_mem_bytes if d is not None else None))
    for t in tables.values():
        t.rows.sort(key=lambda x: x.seq_len)
    return list(tables.values())


def _ms(x: float | None, err: str | None) -> str:
    if x is not None:
        return f"{x:.3f}"
    return "OOM" if err == "OOM" else ("error" if err else "-")


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _tf(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 1 else f"{x:.1f}")


def speedup_text(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}x"


def table_columns(t: ScalingTable) -> list[str]:
    cols = ["T", "Dense (ms)", "Pattern (ms)", "Speedup", "density", "TFLOP/s"]
    if not any(r.tflops is not None for r in t.rows):
        cols.remove("TFLOP/s")
    if any(r.peak_mem_bytes is not None or r.dense_peak_mem_bytes is not None for r in t.rows):
        cols += ["Peak mem (MiB)", "Dense peak (MiB)"]
    if len(t.dense_providers()) > 1:
        cols.append("dense via")
    return cols


def table_cells(t: ScalingTable) -> list[list[str]]:
    cols = table_columns(t)
    out = []
    for r in t.rows:
        cell = {"T": str(r.seq_len), "Dense (ms)": _ms(r.dense_ms, r.dense_error),
                "Pattern (ms)": _ms(r.pattern_ms, r.pattern_error), "Speedup": speedup_text(r.speedup),
                "density": "-" if r.density is None else f"{r.density:.3f}", "TFLOP/s": _tf(r.tflops),
                "Peak mem (MiB)": "OOM" if r.pattern_error == "OOM" else _mib(r.peak_mem_bytes),
                "Dense peak (MiB)": "OOM" if r.dense_error == "OOM" else _mib(r.dense_peak_mem_bytes),
                "dense via": r.dense_provider or "-"}
        out.append([cell[c] for c in cols])
    return out


def config_text(cfg: dict) -> str:
    return (f"B={cfg['batch']} H={cfg['heads']} Hkv={cfg['kv_heads']} D={cfg['head_dim']} "
            f"{cfg['dtype']} {cfg['mode']}")


def table_title(t: ScalingTable) -> str:
    return f"{t.pattern}{' (causal)' if t.causal else ''}: {config_text(t.config)}"


def markdown_table(t: ScalingTable) -> str:
    cols = table_columns(t)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in table_cells(t)]
    return "\n".join(lines)


def accuracy_by_pattern(acc: list[dict]) -> dict[str, dict]:
    return {a["pattern"]: a for a in acc}


def _num(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def accuracy_line(a: dict) -> str:
    if a.get("error"):
        return f"Accuracy vs dense (T={a['seq_len']}): failed: {a['error']}"
    return (f"Accuracy vs dense (T={a['seq_len']}, fp32): cosine {_num(a.get('cosine'), '.4f')}, "
            f"relative L1 {_num(a.get('relative_l1'), '.4f')}, sparsity {_num(a.get('sparsity'), '.3f')}")


def header_lines(header: dict, rows: list[Row]) -> list[str]:
    lines = []
    if is_cpu(header, rows):
        lines += [f"> {CPU_NOTE}", ""]
    lines.append(f"- device: {header.get('gpu', '?')} ({header.get('device', '?')})"
                 + (f", cpu {header['cpu']}" if header.get("cpu") and is_cpu(header) else ""))
    lines.append(f"- torch {header.get('torch', '?')}, triton {header.get('triton') or 'not installed'}")
    lines.append(f"- date: {header.get('date', '?')}; suite: {header.get('suite', '?')}")
    return lines


def render_markdown(header: dict, rows: list[Row], acc: list[dict] | None = None,
                    images: dict[str, str] | None = None) -> str:
    """The whole report as markdown (``images``: title -> relative path, embedded at the end)."""
    acc_by = accuracy_by_pattern(acc or [])
    tables = scaling_tables(rows)
    out = ["# sparse_attn long-context benchmark report", ""]
    out += header_lines(header, rows)
    legend = ("Pattern = provider `sparse_attn`; Dense = the best available dense SDPA provider at the same "
              f"T and mode (first of {', '.join(DENSE_PREFERENCE)} that ran; causal-dense for causal "
              "patterns). Speedup = Dense ms / Pattern ms. TFLOP/s are effective (blocks the layout visits). "
              "Failed rows show their error (OOM).")
    out += ["", legend, ""]
    if not tables:
        out += ["_No `sparse_attn` rows in the results._", ""]
    done_acc = set()
    for t in tables:
        out += [f"## {table_title(t)}", ""]
        dp = t.dense_providers()
        if len(dp) == 1:
            out += [f"Dense baseline: `{dp[0]}`{' (causal-dense)' if t.causal else ''}.", ""]
        out += [markdown_table(t), ""]
        errs = sorted({r.pattern_error for r in t.rows if r.pattern_error and r.pattern_error != "OOM"})
        for e in errs:
            out += [f"- pattern error: `{e}`"]
        if errs:
            out.append("")
        if t.pattern in acc_by and t.pattern not in done_acc:
            out += [accuracy_line(acc_by[t.pattern]), ""]
            done_acc.add(t.pattern)
    if acc:
        out += ["## Accuracy vs dense", "",
                ("`sparse_attn.attention(q, k, v, layout)` against dense attention (fp32 reference; "
                 "causal-dense for causal patterns), random inputs."), "",
                "| pattern | T | sparsity | cosine | relative L1 |", "|---|---:|---:|---:|---:|"]
        for a in acc:
            if a.get("error"):
                out.append(f"| {a['pattern']} | {a['seq_len']} | - | error | {a['error']} |")
            else:
                out.append(f"| {a['pattern']} | {a['seq_len']} | {_num(a.get('sparsity'), '.3f')} | "
                           f"{_num(a.get('cosine'), '.4f')} | {_num(a.get('relative_l1'), '.4f')} |")
        out.append("")
    if images:
        out += ["## Plots", ""]
        for title, rel in images.items():
            out += [f"![{title}]({rel})", ""]
    return "\n".join(out)


def rich_tables(rows: list[Row], acc: list[dict] | None = None) -> list:
    """The scaling tables as rich Tables (for the terminal)."""
    from rich.table import Table
    from rich.text import Text
    acc_by = accuracy_by_pattern(acc or [])
    out = []
    for t in scaling_tables(rows):
        caption = accuracy_line(acc_by[t.pattern]) if t.pattern in acc_by else None
        rt = Table(title=table_title(t), caption=caption)
        for c in table_columns(t):
            rt.add_column(c, justify="right")
        for cells in table_cells(t):
            rt.add_row(*(Text(c) for c in cells))
        out.append(rt)
    return out


# ----------------------------------------------------------------------------- plots
def _main_config(tables: list[ScalingTable]) -> dict | None:
    """The config the plots show: the first fwd one (else the first)."""
    if not tables:
        return None
    fwd = [t for t in tables if t.config["mode"] == "fwd"]
    return (fwd or tables)[0].config


def _plot_tables(rows: list[Row]) -> list[ScalingTable]:
    tables = scaling_tables(rows)
    cfg = _main_config(tables)
    return [t for t in tables if t.config == cfg]


def _dense_lines(tables: list[ScalingTable], attr: str) -> dict[str, list[tuple[int, object, str | None]]]:
    """'dense SDPA' / 'dense SDPA (causal)' -> [(T, value, error)] from the tables' dense columns."""
    out: dict[str, dict[int, tuple]] = {}
    for t in tables:
        label = "dense SDPA (causal)" if t.causal else "dense SDPA"
        for r in t.rows:
            out.setdefault(label, {}).setdefault(r.seq_len, (r.seq_len, getattr(r, attr), r.dense_error))
    return {k: sorted(v.values()) for k, v in out.items()}


def _new_fig(title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _save(fig, path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter
    for ax in fig.axes:
        if ax.get_xscale() == "log":
            ax.xaxis.set_major_formatter(ScalarFormatter())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _finish_vs_length(fig, ax, path, *, has_data: bool, ylabel: str, empty_msg: str, log_y: bool = False) -> Path:
    """Common ending of the plots against sequence length: log2 x axis (and log y), legend, labels."""
    if has_data:
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    else:
        _no_data(ax, empty_msg)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def plot_runtime(rows: list[Row], path, title_suffix: str = "") -> Path:
    """Runtime vs T, log-log: one line per pattern (sparse_attn) plus the dense baseline(s)."""
    tables = _plot_tables(rows)
    fig, ax = _new_fig(f"runtime vs sequence length{title_suffix}")
    any_line = False
    for label, pts in _dense_lines(tables, "dense_ms").items():
        pts = [(L, v) for L, v, _ in pts if v]
        if pts:
            ax.plot(*zip(*pts), "k--" if "causal" in label else "k-", lw=2, marker="s", label=label)
            any_line = True
    for t in tables:
        pts = [(r.seq_len, r.pattern_ms) for r in t.rows if r.pattern_ms]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=t.pattern)
            any_line = True
    return _finish_vs_length(fig, ax, path, has_data=any_line, ylabel="ms", empty_msg="no timed rows", log_y=True)


def plot_speedup(rows: list[Row], path, title_suffix: str = "") -> Path:
    """Speedup over dense vs T, one line per pattern; 1x marked."""
    tables = _plot_tables(rows)
    fig, ax = _new_fig(f"speedup over dense vs sequence length{title_suffix}")
    any_line = False
    for t in tables:
        pts = [(r.seq_len, r.speedup) for r in t.rows if r.speedup]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=t.pattern)
            any_line = True
    ax.axhline(1.0, color="k", lw=1, ls=":")
    return _finish_vs_length(fig, ax, path, has_data=any_line, ylabel="dense ms / pattern ms",
                             empty_msg="no speedups (no dense or no pattern timings)")


def plot_memory(rows: list[Row], path, title_suffix: str = "") -> Path:
    """Peak extra memory vs T; rows that ran out of memory are points at the top, labelled OOM."""
    tables = _plot_tables(rows)
    fig, ax = _new_fig(f"peak memory vs sequence length{title_suffix}")
    series: list[tuple[str, list, list, str]] = []  # label, [(T, MiB)], [T of OOM], style
    for label, pts in _dense_lines(tables, "dense_peak_mem_bytes").items():
        series.append((label, [(L, v / 2**20) for L, v, _ in pts if v is not None],
                       [L for L, _, e in pts if e == "OOM"], "k--" if "causal" in label else "k-"))
    for t in tables:
        series.append((t.pattern, [(r.seq_len, r.peak_mem_bytes / 2**20) for r in t.rows
                                   if r.peak_mem_bytes is not None],
                       [r.seq_len for r in t.rows if r.pattern_error == "OOM"], "-"))
    values = [v for _, pts, _, _ in series for _, v in pts]
    ooms = [L for _, _, o, _ in series for L in o]
    if values or ooms:
        top = max(values) * 2 if values else 1.0
        for label, pts, oom, style in series:
            color = None
            if pts:
                (line,) = ax.plot(*zip(*pts), style, marker="o", label=label)
                color = line.get_color()
            if oom:
                ax.scatter(oom, [top] * len(oom), marker="x", s=60, color=color or "red",
                           label=None if pts else label, zorder=5)
                for L in oom:
                    ax.annotate("OOM", (L, top), textcoords="offset points", xytext=(0, 6), ha="center",
                                fontsize=8, color=color or "red")
    return _finish_vs_length(fig, ax, path, has_data=bool(values or ooms), ylabel="peak extra memory (MiB)",
                             empty_msg="no peak memory measured (CPU runs do not record it)",
                             log_y=bool(values) and min(values) > 0)


def plot_accuracy(acc: list[dict], path) -> Path:
    """Cosine vs dense against sparsity, one labelled point per pattern."""
    fig, ax = _new_fig("accuracy vs sparsity (cosine similarity to dense)")
    pts = [a for a in acc if not a.get("error") and a.get("cosine") is not None and a.get("sparsity") is not None]
    if pts:
        for a in pts:
            ax.scatter([a["sparsity"]], [a["cosine"]], s=40)
            ax.annotate(f"{a['pattern']} (T={a['seq_len']})", (a["sparsity"], a["cosine"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlim(-0.05, 1.05)
    else:
        _no_data(ax, "no accuracy rows")
    ax.set_xlabel("sparsity (1 - visited block fraction)")
    ax.set_ylabel("cosine similarity to dense")
    return _save(fig, path)


# ----------------------------------------------------------------------------- all together
PLOTS = (("runtime vs T", "report-runtime.png"), ("speedup vs T", "report-speedup.png"),
         ("peak memory vs T", "report-memory.png"), ("accuracy vs sparsity", "report-accuracy.png"))


def write_report(out_dir, header: dict, rows: list[Row], acc: list[dict] | None = None,
                 name: str = "report.md") -> tuple[Path, list[Path]]:
    """Write OUT_DIR/report.md and the four PNGs next to it; returns (markdown path, png paths)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = scaling_tables(rows)
    cfg = _main_config(tables)
    suffix = f"\n({config_text(cfg)}{', CPU reference path' if is_cpu(header) else ''})" if cfg else ""
    pngs = [plot_runtime(rows, out_dir / PLOTS[0][1], suffix), plot_speedup(rows, out_dir / PLOTS[1][1], suffix),
            plot_memory(rows, out_dir / PLOTS[2][1], suffix)]
    if acc:
        pngs.append(plot_accuracy(acc, out_dir / PLOTS[3][1]))
    images = {title: fn for title, fn in PLOTS if (out_dir / fn) in pngs}
    md = out_dir / name
    md.write_text(render_markdown(header, rows, acc, images))
    return md, pngs


def print_tables(rows: list[Row], acc: list[dict] | None = None, con=None, header: dict | None = None) -> None:
    if con is None:
        from rich.console import Console
        con = Console()
    if header is not None and is_cpu(header):
        con.print("[bold yellow]CPU run: PyTorch reference path at small sizes, not kernel performance[/bold yellow]")
    for t in rich_tables(rows, acc):
        con.print(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparse_attn.report",
                                description="Build OUT_DIR/report.md + plots from bench result JSON files.")
    p.add_argument("files", nargs="+", type=Path, help="bench JSON files (and accuracy JSON files)")
    p.add_argument("--out-dir", type=Path, default=Path("out"))
    args = p.parse_args(argv)
    header, rows, acc = load_results(args.files)
    print_tables(rows, acc, header=header)
    md, pngs = write_report(args.out_dir, header, rows, acc)
    print(f"wrote {md} and {len(pngs)} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
