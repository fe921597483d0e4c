"""A readable long-context benchmark report from bench result JSON files.

    from sparse_attn.report import load_results, write_report
    header, rows, acc = load_results(["out/bench/demo-cpu.json", "out/bench/accuracy-cpu.json"])
    write_report("out", header, rows, acc)       # out/report.md + out/report-*.png

or ``python -m sparse_attn.report out/bench/*.json --out-dir out``; a suite run in slices (one JSON
file each) is merged by :func:`merge_results` (``sparse-attn report --from DIR``).

report.md holds: a summary (speedup over dense, pattern x T, per mode); the dense baselines side
by side (time and peak memory, OOM shown); for every pattern and config a scaling table
``T | Dense (ms) | Pattern (ms) | Speedup | density | TFLOP/s | Peak mem (MiB) | Dense peak (MiB)``
(:mod:`sparse_attn.report_tables` says how each number is chosen); accuracy against dense; the plots
(:mod:`sparse_attn.report_plots`: runtime, speedup, memory vs T per mode, accuracy vs sparsity) and a
link to the pattern gallery. Everything from rows to markdown / figures is a pure function, so it is
testable without running a benchmark.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from .bench.results import Row, read_result
from .report_plots import plot_accuracy, plot_memory, plot_runtime, plot_speedup
from .report_tables import (DENSE_PREFERENCE, PATTERN_PROVIDERS, ScalingRow, ScalingTable, baseline_grid,
                            baseline_tables, best_dense, config_text, configs_by_mode, main_config,
                            markdown_grid, markdown_table, not_run_note, scaling_tables, speedup_matrix,
                            speedup_text, t_text, table_cells, table_columns, table_title)

CPU_NOTE = ("**CPU run: this is the PyTorch reference path at small sizes (correctness-sized), "
            "not kernel performance.** Timings below say nothing about the Triton kernels on a GPU.")
PATTERN_NOTES = {
    "adaptive": ("Adaptive predicts its layout from q/k on every call (`predict.meansim`, level `medium`); "
                 "the time includes the prediction. On these random inputs no block is self-similar, so the "
                 "prediction keeps every causal block: this row shows what predicting costs on top of causal "
                 "attention, not the sparsity found on a real model's activations (`sparse-attn eval-model`)."),
}


# ----------------------------------------------------------------------------- loading and merging
def load_results(paths) -> tuple[dict, list[Row], list[dict]]:
    """(first header, all bench rows, all accuracy dicts) of JSON files holding ``rows`` and/or
    ``accuracy`` (bench results and :func:`~sparse_attn.bench.accuracy_rows.write_accuracy_json`)."""
    header: dict = {}
    rows: list[Row] = []
    acc: list[dict] = []
    for p in paths:
        h, bench, a = read_result(p)
        header = header or h
        rows += bench
        acc += a
    return header, rows, acc


def _slice_index(header: dict) -> int:
    try:
        return int(str(header.get("slice", "0/0")).split("/")[0])
    except ValueError:
        return 0


def merge_results(paths) -> tuple[dict, list[Row], list[dict]]:
    """Merge the JSON files of one suite run in slices (and its accuracy file).

    Files are taken in (date, slice index) order; a row measured in several files (a re-run slice, or
    a later run of some rows) is taken from the newest, in the position it first had; accuracy rows
    likewise by pattern. (Ordered by slice first, an unsliced re-run counted as slice 0 and lost to
    the stale rows it re-measured.) The header is the first bench file's that ran its whole suite or
    slice (no ``restricted`` options: a restricted re-run's header made the missing-row count check
    only the re-run's rows), with ``slices``: one entry per bench file (file, slice, date, rows,
    gpu) and ``merged: True``."""
    loaded = [(Path(p), *read_result(p)) for p in paths]
    loaded.sort(key=lambda x: (str(x[1].get("date", "")), _slice_index(x[1])))
    rows: dict[tuple, Row] = {}
    acc: dict[str, dict] = {}
    header: dict = {}
    slices = []
    suites = sorted({str(h.get("suite")) for _, h, bench, _ in loaded if bench})
    whole = [h for _, h, bench, _ in loaded if bench and not h.get("restricted")]
    for path, h, bench, accuracy in loaded:
        if bench:
            if not header:
                header = {k: v for k, v in (whole[0] if whole else h).items() if k != "slice"}
            slices.append({"file": path.name, "slice": h.get("slice"), "date": h.get("date"),
                           "rows": len(bench), "gpu": h.get("gpu")})
        for r in bench:
            rows[r.key() + (r.provider,)] = r
        for a in accuracy:
            acc[a["pattern"]] = a
    header.update(slices=slices, merged=True)
    if len(suites) > 1:  # files of several suites: say so rather than label them all as the first one
        header["suite"] = " + ".join(suites)
    gpus = sorted({str(s["gpu"]) for s in slices})
    if len(gpus) > 1:  # slices timed on different machines: ratios across them compare machines
        header["gpu"] = " + ".join(gpus)
        header["mixed_devices"] = True
    return header, list(rows.values()), list(acc.values())


def missing_rows(header: dict, rows: list[Row]) -> list[str]:
    """Labels of the rows of the header's suite (when it is a registered suite, restricted as the
    header's ``restricted`` options say) that ``rows`` lack."""
    from .bench import SUITES, expand, get_suite, restrict
    if header.get("suite") not in SUITES:
        return []
    have = {r.key() + (r.provider,) for r in rows}
    skipped = set(header.get("skipped_providers") or {})
    suite = restrict(get_suite(header["suite"]), **(header.get("restricted") or {}))
    return [p.label() for p in expand(suite) if p.key() not in have and p.provider not in skipped]


def is_cpu(header: dict, rows: list[Row] | None = None) -> bool:
    return header.get("gpu") == "cpu" or str(header.get("device", "")).startswith("cpu")


# ----------------------------------------------------------------------------- markdown
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
        threads = f" ({header['threads']} CPU thread(s))" if header.get("threads") else ""
        lines += [f"> {CPU_NOTE}{threads}", ""]
    lines.append(f"- device: {header.get('gpu', '?')} ({header.get('device', '?')})"
                 + (f", cpu {header['cpu']}" if header.get("cpu") and is_cpu(header) else ""))
    if header.get("mixed_devices"):
        lines += [f"> **The slices ran on different devices ({header['gpu']}): a speedup whose two times come from "
                  "different slices compares machines, not kernels.** Re-run the slices on one device.", ""]
    lines.append(f"- torch {header.get('torch', '?')}, triton {header.get('triton') or 'not installed'}")
    lines.append(f"- date: {header.get('date', '?')}; suite: {header.get('suite', '?')}")
    slices = header.get("slices") or []
    if len(slices) > 1:
        dates = sorted(str(s.get("date")) for s in slices if s.get("date"))
        lines.append(f"- run in {len(slices)} slices ({dates[0] if dates else '?'} to {dates[-1] if dates else '?'}), "
                     f"{sum(s.get('rows', 0) for s in slices)} rows")
    return lines


LEGEND = ("Pattern = provider `sparse_attn` (`adaptive` for the adaptive pattern); Dense = the best available "
          f"dense SDPA provider at the same T and mode (first of {', '.join(DENSE_PREFERENCE)} that ran; "
          "causal-dense for causal patterns). Speedup = Dense ms / Pattern ms. TFLOP/s are effective (blocks "
          "the layout visits). Peak memory is the extra memory one call allocates beyond its inputs. Failed "
          "rows show their error (OOM); `not run` = not part of the suite at that length.")


def summary_section(tables: list[ScalingTable]) -> list[str]:
    out = []
    for cfg in configs_by_mode(tables):
        cols, cells = speedup_matrix(tables, cfg)
        if len(cells) < 2:
            continue
        out += [f"## Summary: speedup over dense, {cfg['mode']}", "",
                f"{config_text(cfg)}; dense = SDPA (causal-dense for causal patterns).", "",
                markdown_grid(cols, cells, align_first_left=True), ""]
    return out


def baselines_section(rows: list[Row]) -> list[str]:
    bts = baseline_tables(rows)
    if not bts:
        return []
    intro = ("Every dense provider on the same inputs: SDPA backends, FlexAttention and sparse_attn given the "
             "dense (or causal) layout, and naive attention (SDPA math: the full score matrix in memory).")
    out = ["## Dense baselines", "", intro, ""]
    for bt in bts:
        out += [f"### {bt.title()}", "", markdown_grid(*baseline_grid(bt, "ms")), ""]
        if any(r.peak_mem_bytes is not None for by in bt.cells.values() for r in by.values()):
            out += ["Peak extra memory:", "", markdown_grid(*baseline_grid(bt, "mem")), ""]
    return out


def pattern_section(t: ScalingTable, acc_line: str | None) -> list[str]:
    out = [f"## {table_title(t)}", ""]
    dp = t.dense_providers()
    if len(dp) == 1:
        out += [f"Dense baseline: `{dp[0]}`{' (causal-dense)' if t.causal else ''}.", ""]
    if t.pattern in PATTERN_NOTES:
        out += [PATTERN_NOTES[t.pattern], ""]
    out += [markdown_table(t), ""]
    note = not_run_note(t)
    if note:
        out += [note, ""]
    errs = sorted({r.pattern_error for r in t.rows if r.pattern_error and r.pattern_error != "OOM"})
    out += [f"- pattern error: `{e}`" for e in errs] + ([""] if errs else [])
    if acc_line:
        out += [acc_line, ""]
    return out


def accuracy_section(acc: list[dict]) -> list[str]:
    out = ["## Accuracy vs dense", "",
           ("`sparse_attn.attention(q, k, v, layout)` against dense attention (fp32 reference; "
            "causal-dense for causal patterns), random inputs."), "",
           "| pattern | T | sparsity | cosine | relative L1 |", "|---|---:|---:|---:|---:|"]
    for a in acc:
        if a.get("error"):
            out.append(f"| {a['pattern']} | {a['seq_len']} | - | error | {a['error']} |")
        else:
            out.append(f"| {a['pattern']} | {a['seq_len']} | {_num(a.get('sparsity'), '.3f')} | "
                       f"{_num(a.get('cosine'), '.4f')} | {_num(a.get('relative_l1'), '.4f')} |")
    return out + [""]


def render_markdown(header: dict, rows: list[Row], acc: list[dict] | None = None,
                    images: dict[str, str] | None = None, gallery: str | None = None,
                    missing: list[str] | None = None) -> str:
    """The whole report as markdown (``images``: title -> relative path, embedded at the end;
    ``gallery``: a link to the pattern gallery; ``missing``: labels of rows the run lacks)."""
    acc_by = accuracy_by_pattern(acc or [])
    tables = scaling_tables(rows)
    out = ["# sparse_attn long-context benchmark report", ""]
    out += header_lines(header, rows)
    out += ["", LEGEND, ""]
    if missing:
        out += [(f"**Incomplete: {len(missing)} rows of suite `{header.get('suite')}` are missing** "
                 f"(e.g. {'; '.join(missing[:3])})."), ""]
    if not tables:
        out += [f"_No rows of a pattern provider ({', '.join(PATTERN_PROVIDERS)}) in the results._", ""]
    out += summary_section(tables) + baselines_section(rows)
    done_acc: set[str] = set()
    for t in tables:
        line = accuracy_line(acc_by[t.pattern]) if t.pattern in acc_by and t.pattern not in done_acc else None
        done_acc.add(t.pattern)
        out += pattern_section(t, line)
    if acc:
        out += accuracy_section(acc)
    if images:
        out += ["## Plots", ""]
        for title, rel in images.items():
            out += [f"![{title}]({rel})", ""]
    if gallery:
        out += ["## Pattern gallery", "", f"What each pattern family looks like: [{gallery}]({gallery}).", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- terminal
def rich_tables(rows: list[Row], acc: list[dict] | None = None) -> list:
    """The scaling tables as rich Tables (for the terminal)."""
    from rich.table import Table
    from rich.text import Text
    acc_by = accuracy_by_pattern(acc or [])
    out = []
    for t in scaling_tables(rows):
        caption = accuracy_line(acc_by[t.pattern]) if t.pattern in acc_by else None
        # as Text: a plain string is rich markup, which took "[window=64]" of a re-parameterised
        # pattern's name for a style tag and dropped it (two windows' tables had one title)
        rt = Table(title=Text(table_title(t)), caption=None if caption is None else Text(caption))
        for c in table_columns(t):
            rt.add_column(c, justify="right")
        for cells in table_cells(t):
            rt.add_row(*(Text(c) for c in cells))
        out.append(rt)
    return out


def rich_summary(rows: list[Row]) -> list:
    """The speedup matrices as rich Tables (the run's summary)."""
    from rich.table import Table
    from rich.text import Text
    tables = scaling_tables(rows)
    out = []
    for cfg in configs_by_mode(tables):
        cols, cells = speedup_matrix(tables, cfg)
        rt = Table(title=f"speedup over dense: {config_text(cfg)}")
        for i, c in enumerate(cols):
            rt.add_column(c, justify="left" if i == 0 else "right")
        for line in cells:
            rt.add_row(*(Text(c) for c in line))
        out.append(rt)
    return out


def print_tables(rows: list[Row], acc: list[dict] | None = None, con=None, header: dict | None = None) -> None:
    """Every scaling table, then the summary (speedup matrices)."""
    if con is None:
        from rich.console import Console
        con = Console()
    if header is not None and is_cpu(header):
        con.print("[bold yellow]CPU run: PyTorch reference path at small sizes, not kernel performance[/bold yellow]")
    for t in rich_tables(rows, acc) + rich_summary(rows):
        con.print(t)


# ----------------------------------------------------------------------------- files
PLOTS = (("runtime vs T", "report-runtime.png"), ("speedup vs T", "report-speedup.png"),
         ("peak memory vs T", "report-memory.png"), ("accuracy vs sparsity", "report-accuracy.png"))


def _mode_slug(mode: str) -> str:
    return mode.replace("+", "")


def write_report(out_dir, header: dict, rows: list[Row], acc: list[dict] | None = None,
                 name: str = "report.md", gallery: str | None = None,
                 missing: list[str] | None = None) -> tuple[Path, list[Path]]:
    """Write OUT_DIR/report.md and its PNGs next to it; returns (markdown path, png paths).

    The main config (the first forward one) gets report-runtime/-speedup/-memory.png; every other
    mode report-runtime-MODE.png etc. (``fwd+bwd`` -> ``fwdbwd``); accuracy rows report-accuracy.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = scaling_tables(rows)
    main = main_config(tables)
    cpu = ", CPU reference path" if is_cpu(header) else ""
    pngs: list[Path] = []
    images: dict[str, str] = {}
    for cfg in configs_by_mode(tables) or [None]:
        suffix = f"\n({config_text(cfg)}{cpu})" if cfg else ""
        tag = "" if cfg is None or cfg == main else f"-{_mode_slug(cfg['mode'])}"
        for (title, fn), plot in zip(PLOTS[:3], (plot_runtime, plot_speedup, plot_memory)):
            path = plot(rows, out_dir / fn.replace(".png", f"{tag}.png"), suffix, config=cfg)
            pngs.append(path)
            images[title + (f" ({cfg['mode']})" if tag else "")] = path.name
    if acc:
        pngs.append(plot_accuracy(acc, out_dir / PLOTS[3][1]))
        images[PLOTS[3][0]] = PLOTS[3][1]
    md = out_dir / name
    md.write_text(render_markdown(header, rows, acc, images, gallery=gallery, missing=missing))
    return md, pngs


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


__all__ = ["load_results", "merge_results", "missing_rows", "is_cpu", "render_markdown", "rich_tables",
           "rich_summary", "print_tables", "write_report", "PLOTS", "ScalingRow", "ScalingTable", "best_dense",
           "scaling_tables", "markdown_table", "speedup_text", "t_text", "plot_runtime", "plot_speedup",
           "plot_memory", "plot_accuracy"]

if __name__ == "__main__":
    raise SystemExit(main())
