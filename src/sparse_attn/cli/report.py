"""``sparse-attn report``: merge benchmark result files (a suite run in slices) into one report."""
from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from ..json_io import dumps
from ._common import console, error, file_stem, positive_tokens, usage_error, writable_dir

DESCRIPTION = """Merge the JSON files of a suite run in slices (`sparse-attn bench --slice K/N`) and write
OUT/report.md with its plots, plus OUT/NAME (the merged rows, header and accuracy).

A row found in several files (a re-run slice) is taken from the last slice/date. Rows of the suite
that no file holds are listed at the top of the report. Accuracy against dense is read from the
inputs or OUT/accuracy.json (when that was made for the same suite at the same --accuracy-len and
holds a row that did not fail); when there is none it is computed here on the CPU (fp32 reference, the
suite's patterns at --accuracy-len with 2 heads: the patterns' approximation error, which does not
depend on the GPU) and saved to OUT/accuracy.json.

example:
  sparse-attn bench --suite report-gpu --slice 1/3 --out-dir runs/   (and 2/3, 3/3, on the GPU)
  sparse-attn report --from runs/ --out-dir out/report"""


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="merge sliced benchmark results into report.md + plots",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="inputs", nargs="+", type=Path, required=True, metavar="PATH",
                   help="result JSON files, or folders whose *.json are read")
    p.add_argument("--out-dir", type=Path, default=Path("out/report"), help="where report.md goes (default out/report)")
    p.add_argument("--name", type=merged_name, default="results.json",
                   help="file name of the merged JSON (default results.json; .json, not accuracy.json)")
    p.add_argument("--accuracy-len", type=positive_tokens, default=8192, metavar="L",
                   help="sequence length of the accuracy rows computed here (default 8k)")
    p.add_argument("--no-accuracy", action="store_true", help="do not compute missing accuracy rows")
    p.add_argument("--gallery", help="link to the pattern gallery, relative to OUT (e.g. ../../../docs/gallery.md)")
    p.set_defaults(func=run)


def merged_name(text: str) -> str:
    """An argparse type for --name: a .json file name the report does not write itself. ``--name
    report.md`` wrote the merged JSON where report.md then went (the merged rows lost, a traceback
    reading it back); ``accuracy.json`` overwrote the saved accuracy rows."""
    name = file_stem(text)
    if not name.endswith(".json") or name == ".json":
        raise argparse.ArgumentTypeError(f"expected a .json file name, got {text!r}")
    if name == "accuracy.json":
        raise argparse.ArgumentTypeError(f"{text!r} is where the report keeps its accuracy rows; choose another name")
    return name


# the bench options (recorded in a result header's "restricted") that decide which layouts a report's
# accuracy rows describe: the patterns selected and their parameters; the rest (providers, lengths,
# heads, modes, dtype) do not change a layout's approximation error, or are set by report_accuracy
ACCURACY_RESTRICTION = ("patterns", "pattern_options")


def accuracy_restriction(header: dict) -> dict:
    """The part of ``header["restricted"]`` that selects and parameterises the patterns."""
    restricted = header.get("restricted") or {}
    return {k: restricted[k] for k in ACCURACY_RESTRICTION if restricted.get(k)}


def report_accuracy(suite, seq_len: int | None = None, heads: int = 2) -> list[dict]:
    """Accuracy vs dense of every pattern of ``suite``, on the CPU in fp32 (the pattern's approximation
    error, not a kernel's rounding): with ``heads`` query and key/value heads (the suite's own B and D),
    at ``seq_len`` (default: each case's largest length)."""
    from ..bench import restrict
    from ..bench.accuracy_rows import accuracy_rows
    small = restrict(suite, heads=heads, kv_heads=[heads], seq_lens=[seq_len] if seq_len else None)
    return accuracy_rows(small, "cpu", at="largest")


def input_files(inputs, exclude=()) -> list[Path]:
    """The JSON files named or inside the given folders (sorted), without ``exclude``."""
    skip = {Path(p).resolve() for p in exclude}
    files = []
    for p in inputs:
        p = Path(p)
        found = sorted(p.glob("*.json")) if p.is_dir() else [p]
        files += [f for f in found if f.resolve() not in skip]
    return files


def reusable_accuracy(acc_path: Path, suite_name, accuracy_len: int | None, con,
                      restriction: dict | None = None) -> bool:
    """Whether the saved ``acc_path`` may stand in for computing accuracy rows: made for ``suite_name`` at
    ``accuracy_len`` (any length when None: nothing would be computed), for the same pattern selection
    (``restriction``, :func:`accuracy_restriction`), with at least one row that did not fail. A cache
    made at another --accuracy-len, or of error rows only, was reused silently before."""
    if not acc_path.exists():
        return False
    from ..bench.results import read_result
    try:
        head, _, acc = read_result(acc_path)
    except ValueError as e:
        why = f"not an accuracy file ({e})"
    else:
        why = None
        if head.get("suite") != suite_name:
            why = f"made for suite {head.get('suite')}, not {suite_name}"
        elif accuracy_len and head.get("seq_len") != accuracy_len:
            why = f"made at T={head.get('seq_len')}, not --accuracy-len {accuracy_len}"
        elif (head.get("restricted") or {}) != (restriction or {}):
            why = f"made for the patterns {head.get('restricted') or 'of the whole suite'}, not {restriction or 'all'}"
        elif not any(isinstance(a, dict) and a.get("error") is None for a in acc):
            why = "every row in it failed"
    if why:
        con.print(f"[yellow]not reusing {acc_path}: {why}[/yellow]")
    return why is None


def build_report(inputs, out_dir: Path, *, name: str = "results.json", accuracy_len: int | None = 8192,
                 gallery: str | None = None, con=None):
    """Merge ``inputs``, add accuracy rows, write OUT/NAME and OUT/report.md + plots.

    Returns (report path, png paths, merged JSON path, missing row labels); raises ValueError when the
    inputs hold no benchmark rows."""
    from .. import report
    from ..bench import SUITES, get_suite
    con = con or console()
    out_dir = Path(out_dir)
    merged_path, acc_path = out_dir / name, out_dir / "accuracy.json"
    files = input_files(inputs, exclude=[merged_path, acc_path])
    header, rows, acc = report.merge_results(files)
    restriction = accuracy_restriction(header)
    if reusable_accuracy(acc_path, header.get("suite"), accuracy_len, con, restriction):
        header, rows, acc = report.merge_results(files + [acc_path])
    if not rows:
        raise ValueError(f"no benchmark rows in {', '.join(map(str, inputs))} "
                         f"({len(files)} JSON files; run `sparse-attn bench ... --out-dir DIR` first)")
    suite_name = header.get("suite")
    if not acc and accuracy_len and suite_name in SUITES:
        from ..bench import restrict
        # the patterns the rows were run with: a --patterns streaming --window 64 run got accuracy rows for
        # every pattern of the suite at its own options, and none for the layout it had timed
        suite = restrict(get_suite(suite_name), **restriction)
        con.print(f"computing accuracy vs dense on the CPU (suite {suite_name}"
                  f"{', as restricted' if restriction else ''}, T={accuracy_len}, fp32)...")
        acc = report_accuracy(suite, accuracy_len)
        from ..bench.accuracy_rows import write_accuracy_json
        write_accuracy_json(acc_path, {"device": "cpu", "suite": suite_name, "seq_len": accuracy_len,
                                       **({"restricted": restriction} if restriction else {})}, acc)
    missing = report.missing_rows(header, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged_path.write_text(dumps({"header": header, "rows": [asdict(r) for r in rows], "accuracy": acc}))
    md, pngs = report.write_report(out_dir, header, rows, acc, gallery=gallery, missing=missing)
    return md, pngs, merged_path, missing


def run(args) -> int:
    from rich.markup import escape

    from .. import report
    con = console()
    for p in args.inputs:
        if not p.exists():
            usage_error(f"--from {p}: no such file or folder")
    writable_dir(args.out_dir, "--out-dir")
    try:
        md, pngs, merged, missing = build_report(args.inputs, args.out_dir, name=args.name,
                                                 accuracy_len=None if args.no_accuracy else args.accuracy_len,
                                                 gallery=args.gallery, con=con)
    except ValueError as e:
        return error(escape(str(e)))
    header, rows, acc = report.load_results([merged])
    report.print_tables(rows, acc, con=con, header=header)
    if missing:
        con.print(f"[yellow]{len(missing)} rows of suite {header.get('suite')} are missing, e.g. "
                  f"{escape('; '.join(missing[:3]))}[/yellow]")
    con.print(f"wrote {md} (+ {len(pngs)} plots) and {merged}")
    return 0
