"""The report's figures: runtime, speedup and peak memory against sequence length, accuracy vs sparsity.

Each ``plot_*`` takes benchmark rows (or accuracy dicts) and a path and writes one PNG. The plots
against length show one config (B, H, Hkv, D, dtype, mode; default: the first forward one): one line
per pattern, plus the dense baselines. Rows that ran out of memory are drawn as ``x`` marks at the top
of the memory plot, labelled OOM, so the length where dense or naive attention stops fitting shows.
"""
from __future__ import annotations

from pathlib import Path

from .bench.results import Row
from .report_tables import (DENSE_PREFERENCE, PROVIDER_NAMES, ScalingTable, config_of, main_config, scaling_tables,
                            t_text)

NAIVE = "sdpa-math"


def plot_tables(rows: list[Row], config: dict | None = None) -> list[ScalingTable]:
    """The scaling tables of one config (default: :func:`~sparse_attn.report_tables.main_config`)."""
    tables = scaling_tables(rows)
    cfg = config if config is not None else main_config(tables)
    return [t for t in tables if t.config == cfg]


def _dense_lines(tables: list[ScalingTable], attr: str) -> dict[str, list[tuple[int, object, str | None]]]:
    """'dense SDPA' / 'dense SDPA (causal)' -> [(T, value, error)] from the tables' dense columns."""
    out: dict[str, dict[int, tuple]] = {}
    for t in tables:
        label = "dense SDPA (causal)" if t.causal else "dense SDPA"
        for r in t.rows:
            if r.dense_provider is not None:
                out.setdefault(label, {}).setdefault(r.seq_len, (r.seq_len, getattr(r, attr), r.dense_error))
    return {k: sorted(v.values()) for k, v in out.items()}


def provider_series(rows: list[Row], config: dict | None, providers, attr: str) -> dict[str, list[tuple]]:
    """Display name -> [(T, value, error)] for each dense provider at ``config``: its non-causal rows
    where it has any, else its causal ones (the memory of a dense call does not depend on causality)."""
    if config is None:
        return {}
    by: dict[tuple, dict[int, tuple]] = {}
    for r in rows:
        if r.provider in providers and config_of(r) == config:
            by.setdefault((r.provider, r.causal), {}).setdefault(r.seq_len, (r.seq_len, getattr(r, attr), r.error))
    out = {}
    for prov in providers:
        causal = (prov, False) not in by
        if (prov, causal) in by:
            out[PROVIDER_NAMES.get(prov, prov) + (" (causal)" if causal else "")] = sorted(by[(prov, causal)].values())
    return out


def _new_fig(title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def _length_label(x: float, _pos=None) -> str:
    """Tick label of a sequence length: 4096 -> 4K, 1048576 -> 1M."""
    return t_text(int(round(x))) if x >= 1 else ""


def _save(fig, path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
    for ax in fig.axes:
        if ax.get_xscale() == "log":
            ax.xaxis.set_major_formatter(FuncFormatter(_length_label))
            ax.xaxis.set_minor_formatter(NullFormatter())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _finish_vs_length(fig, ax, path, *, has_data: bool, ylabel: str, empty_msg: str, log_y: bool = False,
                      legend_outside: bool = False) -> Path:
    """Common ending of the plots against sequence length: log2 x axis (and log y), legend (inside, or
    right of the axes), labels."""
    if has_data:
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        if legend_outside:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.legend(fontsize=7, ncol=2)
    else:
        _no_data(ax, empty_msg)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(ylabel)
    return _save(fig, path)


def _pattern_label(t: ScalingTable) -> str:
    """A pattern's line label: its causal variant says so (as in the summary)."""
    return t.pattern + (" (causal)" if t.causal and t.pattern != "causal" else "")


def _plot_pattern_lines(ax, tables, attr: str) -> bool:
    """One line per pattern table of ``attr`` (a row field) against sequence length, skipping rows
    without it; True if any line was drawn."""
    drawn = False
    for t in tables:
        pts = [(r.seq_len, getattr(r, attr)) for r in t.rows if getattr(r, attr)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=_pattern_label(t))
            drawn = True
    return drawn


def plot_runtime(rows: list[Row], path, title_suffix: str = "", config: dict | None = None) -> Path:
    """Runtime vs T, log-log: one line per pattern, the best dense baseline and naive attention."""
    tables = plot_tables(rows, config)
    cfg = tables[0].config if tables else None
    fig, ax = _new_fig(f"runtime vs sequence length{title_suffix}")
    any_line = False
    for label, pts in _dense_lines(tables, "dense_ms").items():
        pts = [(L, v) for L, v, _ in pts if v]
        if pts:
            ax.plot(*zip(*pts), "k--" if "causal" in label else "k-", lw=2, marker="s", label=label)
            any_line = True
    for label, pts in provider_series(rows, cfg, (NAIVE,), "ms").items():
        pts = [(L, v) for L, v, _ in pts if v]
        if pts:
            ax.plot(*zip(*pts), color="grey", ls=":", lw=2, marker="x", label=label)
            any_line = True
    any_line = _plot_pattern_lines(ax, tables, "pattern_ms") or any_line
    return _finish_vs_length(fig, ax, path, has_data=any_line, ylabel="ms", empty_msg="no timed rows", log_y=True)


def plot_speedup(rows: list[Row], path, title_suffix: str = "", config: dict | None = None) -> Path:
    """Speedup over dense vs T, one line per pattern; 1x marked."""
    tables = plot_tables(rows, config)
    fig, ax = _new_fig(f"speedup over dense vs sequence length{title_suffix}")
    any_line = _plot_pattern_lines(ax, tables, "speedup")
    ax.axhline(1.0, color="k", lw=1, ls=":")
    return _finish_vs_length(fig, ax, path, has_data=any_line, ylabel="dense ms / pattern ms",
                             empty_msg="no speedups (no dense or no pattern timings)", log_y=any_line)


def plot_memory(rows: list[Row], path, title_suffix: str = "", config: dict | None = None) -> Path:
    """Peak extra memory vs T: every dense baseline and every pattern; OOM rows as x marks at the top."""
    tables = plot_tables(rows, config)
    cfg = tables[0].config if tables else None
    series: list[tuple[str, list, list, str]] = []  # label, [(T, MiB)], [T of OOM], style
    for (label, pts), style in zip(provider_series(rows, cfg, DENSE_PREFERENCE, "peak_mem_bytes").items(),
                                   ("k-", "k--", "k-.", "k:")):
        series.append((label, [(L, v / 2**20) for L, v, _ in pts if v is not None],
                       [L for L, _, e in pts if e == "OOM"], "k:" if label.startswith("naive") else style))
    for t in tables:
        series.append((_pattern_label(t), [(r.seq_len, r.peak_mem_bytes / 2**20) for r in t.rows
                                   if r.peak_mem_bytes is not None],
                       [r.seq_len for r in t.rows if r.pattern_error == "OOM"], "-"))
    fig, ax = _new_fig(f"peak memory vs sequence length{title_suffix}")
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
                             log_y=bool(values) and min(values) > 0,
                             # OOM marks line the top, dense lines the left and patterns the rest: placed 'best'
                             # inside, the legend covered two of the committed report's three OOM marks
                             legend_outside=True)


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


__all__ = ["plot_tables", "provider_series", "plot_runtime", "plot_speedup", "plot_memory", "plot_accuracy"]
