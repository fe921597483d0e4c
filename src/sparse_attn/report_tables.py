"""The report's tables: pure functions from benchmark rows to table cells (no files, no plotting).

* Scaling table, one per pattern and config (B, H, Hkv, D, dtype, mode):
  ``T | Dense (ms) | Pattern (ms) | Speedup | density | TFLOP/s [| Peak mem (MiB) | Dense peak (MiB)] [| dense via]``.
  *Pattern* is the row of a pattern provider (:data:`PATTERN_PROVIDERS`: ``sparse_attn``, or
  ``adaptive`` which predicts its own layout); *Dense* the best dense SDPA row at the same T, shapes,
  mode and causality (first of :data:`DENSE_PREFERENCE` with a time, else the first that failed, so
  OOM shows; causal-dense for a causal pattern); Speedup = dense ms / pattern ms. A length with no
  dense row says ``not run``.
* Dense baselines, one per causality and config: every dense provider side by side (SDPA backends,
  and FlexAttention / sparse_attn on the ``dense`` / ``causal`` patterns), time or peak memory.
* Speedup matrix, one per mode: pattern x T.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .bench.results import Row

PATTERN_PROVIDERS = ("sparse_attn", "adaptive")
DENSE_PREFERENCE = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "sdpa-math")
DENSE_PATTERNS = ("dense", "causal")
BASELINE_ORDER = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "sdpa-math", "sparse_attn")
PROVIDER_NAMES = {"sdpa-cudnn": "SDPA cuDNN", "sdpa-flash": "SDPA flash (FA2)", "sdpa-efficient": "SDPA efficient",
                  "flex": "FlexAttention", "sdpa-math": "naive (SDPA math)", "sparse_attn": "sparse_attn",
                  "reference": "reference", "adaptive": "adaptive"}
CONFIG_FIELDS = ("batch", "heads", "kv_heads", "head_dim", "dtype", "mode")
MODE_ORDER = ("fwd", "fwd+bwd", "bwd")
NOT_RUN = "not run"


# ----------------------------------------------------------------------------- scaling tables
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
    provider: str = "sparse_attn"

    def dense_providers(self) -> list[str]:
        return list(dict.fromkeys(r.dense_provider for r in self.rows if r.dense_provider))


def config_of(r: Row) -> dict:
    return {f: getattr(r, f) for f in CONFIG_FIELDS}


def dense_key(r: Row) -> tuple:
    """Dense rows do not depend on the pattern's layout, only on the shapes and causality."""
    return (r.seq_len, r.batch, r.heads, r.kv_heads, r.head_dim, r.dtype, r.mode, r.causal)


def best_dense(rows: list[Row]) -> dict[tuple, Row]:
    """:func:`dense_key` -> the preferred dense row: first of :data:`DENSE_PREFERENCE` with a time;
    else the first such row with an error (so OOM shows)."""
    by: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.provider in DENSE_PREFERENCE:
            by.setdefault(dense_key(r), {}).setdefault(r.provider, r)
    out = {}
    for key, provs in by.items():
        ordered = [provs[p] for p in DENSE_PREFERENCE if p in provs]
        timed = [r for r in ordered if r.ms]
        out[key] = timed[0] if timed else ordered[0]
    return out


def scaling_tables(rows: list[Row], pattern_providers=PATTERN_PROVIDERS) -> list[ScalingTable]:
    """One :class:`ScalingTable` per (pattern, provider, config), in first-seen order, rows sorted by T."""
    if isinstance(pattern_providers, str):
        pattern_providers = (pattern_providers,)
    dense = best_dense(rows)
    tables: dict[tuple, ScalingTable] = {}
    for r in rows:
        if r.provider not in pattern_providers:
            continue
        cfg = config_of(r)
        tkey = (r.pattern, r.causal, r.provider) + tuple(cfg.values())
        t = tables.setdefault(tkey, ScalingTable(r.pattern, r.causal, cfg, provider=r.provider))
        d = dense.get(dense_key(r))
        dms = d.ms if d is not None else None
        sp = dms / r.ms if dms and r.ms else None
        t.rows.append(ScalingRow(r.seq_len, dms, r.ms, sp, r.tflops, r.peak_mem_bytes, r.density,
                                 d.provider if d is not None else None, d.error if d is not None else None,
                                 r.error, d.peak_mem_bytes if d is not None else None))
    for t in tables.values():
        t.rows.sort(key=lambda x: x.seq_len)
    return list(tables.values())


def main_config(tables: list[ScalingTable]) -> dict | None:
    """The config the plots show by default: the first fwd one (else the first)."""
    if not tables:
        return None
    fwd = [t for t in tables if t.config["mode"] == "fwd"]
    return (fwd or tables)[0].config


def configs_by_mode(tables: list[ScalingTable]) -> list[dict]:
    """The first config of each mode present, in :data:`MODE_ORDER` (the main config first)."""
    firsts: dict[str, dict] = {}
    for t in tables:
        firsts.setdefault(t.config["mode"], t.config)
    main = main_config(tables)
    rest = [firsts[m] for m in MODE_ORDER if m in firsts and firsts[m] != main]
    return ([main] if main else []) + rest


# ----------------------------------------------------------------------------- cell text
def t_text(L: int) -> str:
    """4096 -> 4K, 1048576 -> 1M (exact multiples only)."""
    if L >= 1 << 20 and L % (1 << 20) == 0:
        return f"{L >> 20}M"
    if L >= 1024 and L % 1024 == 0:
        return f"{L >> 10}K"
    return str(L)


def ms_text(x: float | None, err: str | None, missing: str = "-") -> str:
    if x is not None:
        return f"{x:.3f}"
    if err is None:
        return missing
    return "OOM" if err == "OOM" else "error"


def mib_text(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def tflops_text(x: float | None) -> str:
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
        dense_missing = NOT_RUN if r.dense_provider is None else "-"
        cell = {"T": str(r.seq_len), "Dense (ms)": ms_text(r.dense_ms, r.dense_error, dense_missing),
                "Pattern (ms)": ms_text(r.pattern_ms, r.pattern_error), "Speedup": speedup_text(r.speedup),
                "density": "-" if r.density is None else f"{r.density:.3f}", "TFLOP/s": tflops_text(r.tflops),
                "Peak mem (MiB)": "OOM" if r.pattern_error == "OOM" else mib_text(r.peak_mem_bytes),
                "Dense peak (MiB)": ("OOM" if r.dense_error == "OOM" else
                                     (NOT_RUN if r.dense_provider is None else mib_text(r.dense_peak_mem_bytes))),
                "dense via": r.dense_provider or "-"}
        out.append([cell[c] for c in cols])
    return out


def markdown_grid(cols: list[str], cells: list[list[str]], align_first_left: bool = False) -> str:
    first = "---" if align_first_left else "---:"
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join([first] + ["---:"] * (len(cols) - 1)) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines)


def markdown_table(t: ScalingTable) -> str:
    return markdown_grid(table_columns(t), table_cells(t))


def config_text(cfg: dict) -> str:
    return (f"B={cfg['batch']} H={cfg['heads']} Hkv={cfg['kv_heads']} D={cfg['head_dim']} "
            f"{cfg['dtype']} {cfg['mode']}")


def table_title(t: ScalingTable) -> str:
    via = f" via `{t.provider}`" if t.provider not in ("sparse_attn", t.pattern) else ""
    return f"{t.pattern}{' (causal)' if t.causal else ''}{via}: {config_text(t.config)}"


# ----------------------------------------------------------------------------- dense not run: extrapolation
def not_run_note(t: ScalingTable) -> str | None:
    """For lengths without a dense row: what dense attention would cost, extrapolated from the longest
    measured dense time of the table by (T / T0)^2 (clearly an estimate, never put in the table)."""
    missing = [r for r in t.rows if r.dense_provider is None]
    measured = [r for r in t.rows if r.dense_ms]
    if not missing or not measured:
        return None
    base = max(measured, key=lambda r: r.seq_len)
    longest = max(missing, key=lambda r: r.seq_len)
    est_ms = base.dense_ms * (longest.seq_len / base.seq_len) ** 2
    cfg = t.config
    scores = cfg["batch"] * cfg["heads"] * longest.seq_len ** 2 * 4  # bytes
    # units that show the amount ('0 TiB' once; at CPU sizes '0.0 GiB' and 'about 0.0 s')
    scores_text = (f"{scores / 2**40:,.0f} TiB" if scores >= 2**40 else
                   f"{scores / 2**30:,.1f} GiB" if scores >= 2**30 / 10 else f"{scores / 2**20:,.1f} MiB")
    est_text = f"{est_ms / 1e3:.1f} s" if est_ms >= 1e3 else f"{est_ms:.1f} ms"
    text = (f"Dense attention was not run at T = {', '.join(t_text(r.seq_len) for r in missing)}. "
            f"Extrapolated from `{base.dense_provider}` at {t_text(base.seq_len)} by (T/{t_text(base.seq_len)})², "
            f"one call at {t_text(longest.seq_len)} would take about {est_text}")
    if longest.pattern_ms:
        ratio = est_ms / longest.pattern_ms  # a pattern slower than the estimate read 'about 0x less'
        times = f"{1 / ratio:.1f}x more" if ratio < 1 else f"{ratio:.0f}x less" if ratio >= 10 else f"{ratio:.1f}x less"
        text += f" (the pattern: {longest.pattern_ms:.1f} ms, about {times})"
    return text + (f"; naive attention would need {scores_text} for its fp32 scores alone. "
                   "These are estimates, not measurements.")


# ----------------------------------------------------------------------------- dense baselines
@dataclass
class BaselineTable:
    causal: bool
    config: dict
    providers: list[str]
    cells: dict[int, dict[str, Row]]  # T -> provider -> row

    def title(self) -> str:
        return f"{'causal' if self.causal else 'non-causal'}: {config_text(self.config)}"


def _is_baseline(r: Row) -> bool:
    return r.provider in DENSE_PREFERENCE or (r.pattern in DENSE_PATTERNS and r.provider in BASELINE_ORDER)


def baseline_tables(rows: list[Row]) -> list[BaselineTable]:
    """Dense providers side by side, one table per (causality, config) with at least two of them."""
    groups: dict[tuple, BaselineTable] = {}
    for r in rows:
        if not _is_baseline(r):
            continue
        cfg = config_of(r)
        bt = groups.setdefault((r.causal,) + tuple(cfg.values()), BaselineTable(r.causal, cfg, [], {}))
        bt.cells.setdefault(r.seq_len, {}).setdefault(r.provider, r)
    out = []
    for bt in groups.values():
        present = {p for by in bt.cells.values() for p in by}
        bt.providers = [p for p in BASELINE_ORDER if p in present]
        if len(bt.providers) >= 2:
            bt.cells = dict(sorted(bt.cells.items()))
            out.append(bt)
    return out


def baseline_grid(bt: BaselineTable, what: str = "ms") -> tuple[list[str], list[list[str]]]:
    """(columns, cells) of a baseline table: ``what`` = "ms" (time) or "mem" (peak extra MiB)."""
    unit = "ms" if what == "ms" else "MiB"
    cols = ["T"] + [f"{PROVIDER_NAMES.get(p, p)} ({unit})" for p in bt.providers]
    cells = []
    for L, by in bt.cells.items():
        line = [str(L)]
        for p in bt.providers:
            r = by.get(p)
            if r is None:
                line.append(NOT_RUN)
            elif what == "ms":
                line.append(ms_text(r.ms, r.error))
            else:
                line.append("OOM" if r.error == "OOM" else (mib_text(r.peak_mem_bytes) if r.error is None else "error"))
        cells.append(line)
    return cols, cells


# ----------------------------------------------------------------------------- speedup matrix
def speedup_matrix(tables: list[ScalingTable], config: dict) -> tuple[list[str], list[list[str]]]:
    """(columns, cells): one line per pattern measured at ``config`` (one of :func:`configs_by_mode`,
    the caption the matrix is shown under), speedup over dense per T. Patterns measured only at
    another config are left out: their numbers once appeared under this caption."""
    chosen: dict[tuple, ScalingTable] = {}
    for t in tables:
        if t.config == config:
            chosen.setdefault((t.pattern, t.causal, t.provider), t)  # a causal variant is its own line
    lengths = sorted({r.seq_len for t in chosen.values() for r in t.rows})
    cols = ["pattern"] + [t_text(L) for L in lengths]
    cells = []
    for t in chosen.values():
        by = {r.seq_len: r for r in t.rows}
        line = [t.pattern + (" (causal)" if t.causal and t.pattern != "causal" else "")]
        for L in lengths:
            r = by.get(L)
            if r is None:
                line.append("")
            elif r.speedup is not None:
                line.append(speedup_text(r.speedup))
            elif r.pattern_error:
                line.append("OOM" if r.pattern_error == "OOM" else "error")
            elif r.dense_provider is None:
                line.append(NOT_RUN)
            elif r.dense_error:  # a failed dense row was a bare '-' here ('error' in the scaling table)
                line.append("dense OOM" if r.dense_error == "OOM" else "dense error")
            else:
                line.append("-")
        cells.append(line)
    return cols, cells


__all__ = ["PATTERN_PROVIDERS", "DENSE_PREFERENCE", "DENSE_PATTERNS", "BASELINE_ORDER", "PROVIDER_NAMES",
           "CONFIG_FIELDS", "NOT_RUN", "ScalingRow", "ScalingTable", "config_of", "dense_key", "best_dense",
           "scaling_tables", "main_config", "configs_by_mode", "t_text", "ms_text", "speedup_text",
           "table_columns", "table_cells", "markdown_grid", "markdown_table", "config_text", "table_title",
           "not_run_note", "BaselineTable", "baseline_tables", "baseline_grid", "speedup_matrix"]
