"""Benchmark rows, their JSON/CSV files and the summary table.

JSON: ``{"header": {gpu, torch, triton, date, device, suite, ...}, "rows": [row, ...]}``;
CSV: one line per row with the columns of :data:`ROW_FIELDS`. ``ms``/``tflops`` are null (empty
in CSV) on a failed row, whose ``error`` says why ("OOM", or the exception).
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import platform
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ..json_io import dumps, write_text_atomic

HEADER_FIELDS = ("gpu", "torch", "triton", "date", "device", "suite")


@dataclass
class Row:
    """One measured row: the case (pattern, sizes, dtype, mode, causal, density in whole blocks), the
    provider, and median ms, effective TFLOP/s and peak extra bytes, or the error that stopped it."""

    provider: str
    pattern: str
    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    mode: str
    causal: bool
    density: float | None
    ms: float | None = None
    tflops: float | None = None
    peak_mem_bytes: int | None = None
    error: str | None = None

    def key(self) -> tuple:
        """Everything but the provider and the measurements: rows with one key are comparable."""
        return (self.pattern, self.seq_len, self.batch, self.heads, self.kv_heads, self.head_dim,
                self.dtype, self.mode, self.causal)


ROW_FIELDS = tuple(f.name for f in fields(Row))


def make_header(device, suite: str, **extra) -> dict:
    """A result file's header: GPU name, torch / triton versions, UTC date, device, suite, host and CPU,
    plus ``extra``."""
    device = torch.device(device)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = {"gpu": gpu, "torch": torch.__version__, "triton": triton_version,
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "device": str(device), "suite": suite, "host": platform.node(),
              "cpu": platform.processor() or platform.machine()}
    header.update(extra)
    return header


def write_json(path, header: dict, rows: list[Row]) -> Path:
    """``{"header": header, "rows": [...]}`` as strict JSON (json_io), written atomically."""
    return write_text_atomic(path, dumps({"header": header, "rows": [asdict(r) for r in rows]}))


def write_csv(path, rows: list[Row]) -> Path:
    """The rows as CSV with :data:`ROW_FIELDS` as columns (None as an empty cell)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in asdict(r).items()})
    return path


def read_result(path) -> tuple[dict, list[Row], list[dict]]:
    """(header, bench rows, accuracy dicts) of one result JSON; ValueError naming the file when it is
    not one (a list, another tool's JSON, a malformed row)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or not ("rows" in data or "accuracy" in data):
        raise ValueError(f"{path}: not a bench or accuracy result (a JSON object with 'rows' and/or 'accuracy'), "
                         f"got {type(data).__name__}" + (f" with keys {sorted(data)[:6]}" if isinstance(data, dict)
                                                         else ""))
    try:  # keys beyond the row's fields are annotations (merge_results.py's 'slice', a probe's 'run')
        rows = [Row(**{k: v for k, v in r.items() if k in ROW_FIELDS}) for r in data.get("rows") or []]
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{path}: a row is not a bench row ({e})") from None
    acc = list(data.get("accuracy") or [])
    if any(not isinstance(a, dict) or "pattern" not in a for a in acc):
        raise ValueError(f"{path}: an accuracy entry has no 'pattern'")
    return dict(data.get("header") or {}), rows, acc


def load_json(path) -> tuple[dict, list[Row]]:
    """(header, rows) of a bench result JSON (:func:`read_result`)."""
    header, rows, _ = read_result(path)
    return header, rows


# ----------------------------------------------------------------------------- summary
BASELINE_PREFERENCE = ("sdpa-cudnn", "sdpa-flash", "sdpa-math", "reference")


def pick_baseline(rows: list[Row], preferred: str | None = None) -> str | None:
    names = {r.provider for r in rows}
    if preferred:
        return preferred if preferred in names else None
    return next((p for p in BASELINE_PREFERENCE if p in names), None)


def speedups(rows: list[Row], baseline: str) -> dict[int, float | None]:
    """id(row) -> baseline ms / row ms on the same key (None where either is missing)."""
    base = {r.key(): r.ms for r in rows if r.provider == baseline}
    out = {}
    for r in rows:
        b = base.get(r.key())
        out[id(r)] = b / r.ms if b and r.ms else None
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def eight_bit(provider: str) -> bool:
    """Whether a provider runs 8-bit products (ours with quant=, PyPI sageattention)."""
    return "int8" in provider or provider == "sageattention"


def summary_table(rows: list[Row], baseline: str | None = None, title: str | None = None):
    """A rich Table: pattern, L, (Hkv, mode when they vary), provider, ms, TFLOP/s, speedup."""
    from rich.table import Table
    from rich.text import Text
    baseline = pick_baseline(rows, baseline)
    sp = speedups(rows, baseline) if baseline else {}
    vary = {name: len({getattr(r, name) for r in rows}) > 1
            for name in ("kv_heads", "mode", "dtype", "heads", "head_dim", "batch")}
    labels = {"batch": "B=", "heads": "H=", "kv_heads": "Hkv=", "head_dim": "D=", "dtype": "", "mode": "mode="}
    fixed = " ".join(f"{labels[n]}{getattr(rows[0], n)}" for n in labels if rows and not vary[n])
    t = Table(title=title, caption=fixed or None, show_lines=False)
    t.add_column("pattern")
    t.add_column("L", justify="right")
    for name, label in (("batch", "B"), ("heads", "H"), ("kv_heads", "Hkv"), ("head_dim", "D"),
                        ("dtype", "dtype"), ("mode", "mode")):
        if vary[name]:
            t.add_column(label, justify="right")
    t.add_column("density", justify="right")
    t.add_column("provider")
    t.add_column("ms", justify="right")
    # 8-bit rows do integer / FP8 operations: the same count, in TOPS (the suites' and README's word)
    t.add_column("TFLOP/s (TOPS 8-bit)" if any(eight_bit(r.provider) for r in rows) else "TFLOP/s", justify="right")
    t.add_column(f"vs {baseline}" if baseline else "speedup", justify="right")
    any_error = any(r.error for r in rows)
    if any_error:
        t.add_column("error", max_width=60)
    prev = None
    for r in rows:
        group = r.key()
        if prev is not None and group != prev:
            t.add_section()
        prev = group
        cells = [r.pattern, str(r.seq_len)]
        for name in ("batch", "heads", "kv_heads", "head_dim", "dtype", "mode"):
            if vary[name]:
                cells.append(str(getattr(r, name)))
        s = sp.get(id(r))
        cells += [_fmt(r.density, ".3f"), r.provider, _fmt(r.ms, ".3f"),
                  _fmt(r.tflops, ".3f" if (r.tflops or 0) < 1 else ".1f"), "-" if s is None else f"{s:.2f}x"]
        if any_error:
            cells.append(r.error or "")
        t.add_row(*(Text(c) for c in cells))  # Text: no rich markup in error messages
    return t
