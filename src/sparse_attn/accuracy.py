"""Accuracy of adaptive (predicted) sparse attention against dense attention.

The logic behind ``sparse-attn quick`` and ``sparse-attn accuracy``: structured test inputs,
one evaluated case (dense vs :func:`sparse_attn.predict.adaptive_attention` on the same
inputs), the suite of cases, the threshold sweep, and the report files (markdown, JSON, PNGs).

Metrics (``sparse_attn.metrics``, fp64): cosine similarity and relative L1 ``sum|s - d| / sum|d|``
of the sparse output ``s`` against the dense output ``d`` (same dtype and device), RMSE.
Sparsity is reported twice: ``sparsity`` = fraction of the blocks the *dense baseline* computes
that the layout skips (for causal the baseline is the causal layout, so blocks above the diagonal
do not count as savings), and ``grid_sparsity`` = ``layout.sparsity`` (fraction of the whole
``Qb x Kb`` grid); the two are equal without ``causal``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import metrics, patterns
from .json_io import dumps
from .layout import BlockLayout
from .predict import SPARSE_LEVELS, adaptive_attention, level_params

DATA_DOC = """Structured inputs (structured_qkv): for each (batch, kv head) a latent sequence
z_t = (a_t + c_topic(t)) / sqrt(2), where a_t is an AR(1) drift (unit variance per dim, correlation
length 128 tokens) and c is one of 8 random topic vectors, the topic redrawn every 384 tokens (so
topics recur far apart). k_t = z_t + s_t e, q_i = z_p + s_p e' (p = i + Lk - Lq; the query heads of
a GQA group share z), v ~ N(0, 1), with a noise level s drawn from U(0.2, 1.8) per 64-token stretch.
Nearby and same-topic tokens attend to each other, so attention mass sits in a data-dependent set of
blocks, and the noisy stretches give blocks that are not self-similar. Pure N(0, 1) inputs (--random)
attend almost uniformly and are barely sparsifiable."""


# ----------------------------------------------------------------------------- inputs
def structured_qkv(batch: int, heads: int, seq_len: int, head_dim: int, *, kv_heads: int | None = None,
                   kv_len: int | None = None, seed: int = 0, dtype=torch.float32, device="cpu",
                   num_topics: int = 8, topic_len: int = 384, corr_len: float = 128.0,
                   noise: tuple[float, float] = (0.2, 1.8), noise_len: int = 64):
    """Sparsifiable q ``[B, Hq, Lq, D]``, k / v ``[B, Hkv, Lk, D]`` (see :data:`DATA_DOC`).

    Drawn in fp32 on the CPU from a generator seeded with ``seed`` (the same values on every
    device), then cast to ``dtype`` and moved to ``device``.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = seq_len if kv_len is None else kv_len
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}), which must be >= 1")
    g = torch.Generator().manual_seed(seed)
    B, H, D = batch, kv_heads, head_dim
    start = min(0, kv_len - seq_len)                  # first key-frame position any token needs
    n = max(kv_len, 1) - start                         # positions start .. kv_len - 1
    rho = math.exp(-1.0 / corr_len)
    steps = torch.randn(B, H, n, D, generator=g) * math.sqrt(1 - rho * rho)
    drift = torch.empty(B, H, n, D)
    drift[:, :, 0] = torch.randn(B, H, D, generator=g)
    for t in range(1, n):
        drift[:, :, t] = rho * drift[:, :, t - 1] + steps[:, :, t]
    topics = torch.randn(B, H, num_topics, D, generator=g)
    topic_of = torch.randint(0, num_topics, (B, H, n // topic_len + 1), generator=g)[:, :, torch.arange(n) // topic_len]
    latent = (drift + torch.gather(topics, 2, topic_of[..., None].expand(-1, -1, -1, D))) / math.sqrt(2.0)
    lo, hi = noise
    level = lo + (hi - lo) * torch.rand(B, H, n // noise_len + 1, generator=g)
    level = level[:, :, torch.arange(n) // noise_len, None]          # [B, Hkv, n, 1]
    kpos = torch.arange(kv_len) - start
    qpos = torch.arange(seq_len) + (kv_len - seq_len) - start
    group = heads // kv_heads
    k = latent[:, :, kpos] + level[:, :, kpos] * torch.randn(B, H, kv_len, D, generator=g)
    q = (latent[:, :, qpos].repeat_interleave(group, 1)
         + level[:, :, qpos].repeat_interleave(group, 1) * torch.randn(B, heads, seq_len, D, generator=g))
    v = torch.randn(B, H, kv_len, D, generator=g)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def random_qkv(batch: int, heads: int, seq_len: int, head_dim: int, *, kv_heads: int | None = None,
               kv_len: int | None = None, seed: int = 0, dtype=torch.float32, device="cpu"):
    """Standard-normal q/k/v (CPU generator, cast and moved): the hard, barely sparsifiable case."""
    from .testing import random_qkv as _random
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = seq_len if kv_len is None else kv_len
    q, k, v = _random(batch, heads, kv_heads, seq_len, kv_len, head_dim, seed=seed)
    return q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)


# ----------------------------------------------------------------------------- one evaluation
@dataclass(frozen=True)
class Thresholds:
    """Pass criteria of an accuracy case (strict inequalities)."""

    min_cosine: float = 0.95
    max_l1: float = 0.1
    min_sparsity: float = 0.05


# relative L1 of the sparse output against the fp64 oracle on the SAME layout ("numerics" check)
NUMERIC_L1 = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def baseline_blocks(layout, causal: bool) -> int:
    """Blocks the dense baseline computes over the layout's batch x heads rows (causal: the causal layout's)."""
    if causal:
        per_row = patterns.causal_block_count(layout.q_len, layout.kv_len, block_q=layout.block_q,
                                              block_k=layout.block_k)
    else:
        per_row = layout.num_q_blocks * layout.num_kv_blocks
    return per_row * layout.batch * layout.heads


def effective_sparsity(layout, causal: bool) -> float:
    """Fraction of the dense baseline's blocks (see :func:`baseline_blocks`) that the layout skips."""
    total = baseline_blocks(layout, causal)
    return 1.0 - layout.num_blocks / total if total else 0.0


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def evaluate(q, k, v, *, causal: bool = False, thresholds: Thresholds = Thresholds(),
             checks: tuple[str, ...] = ("finite", "numerics", "cosine", "l1", "sparsity"),
             oracle: bool = True, **meansim_kwargs) -> dict:
    """Dense vs adaptive-sparse attention on one input: metrics, both sparsities and check results.

    ``checks`` picks the pass criteria: ``finite`` (no NaN/inf in either output), ``numerics``
    (sparse output within :data:`NUMERIC_L1` relative L1 of the fp64 oracle on the same layout;
    needs ``oracle``), ``cosine`` / ``l1`` / ``sparsity`` (against ``thresholds``).
    Returns a flat dict (JSON-friendly) with ``passed`` and ``failed`` (names of failed checks).
    """
    import sparse_attn
    from .testing import oracle_attention
    t0 = time.perf_counter()
    dense = sparse_attn.attention(q, k, v, causal=causal)
    out, layout = adaptive_attention(q, k, v, causal=causal, **meansim_kwargs)
    _sync(q.device)
    m = metrics.compare(out, dense)
    row = {"cosine": m["cosine"], "relative_l1": m["relative_l1"], "rmse": m["rmse"],
           "max_abs_error": m["max_abs_error"], "finite": bool(m["finite"]),
           "sparsity": effective_sparsity(layout, causal), "grid_sparsity": layout.sparsity,
           "blocks": layout.num_blocks, "baseline_blocks": baseline_blocks(layout, causal)}
    if oracle:
        ref = oracle_attention(q, k, v, layout, causal=causal)
        row["oracle_l1"] = metrics.relative_l1(out, ref)
    ok = {"finite": row["finite"] and bool(torch.isfinite(dense).all()) and bool(torch.isfinite(out).all()),
          "cosine": row["cosine"] > thresholds.min_cosine,
          "l1": row["relative_l1"] < thresholds.max_l1,
          "sparsity": row["sparsity"] > thresholds.min_sparsity}
    if oracle:
        ok["numerics"] = row["oracle_l1"] <= NUMERIC_L1.get(q.dtype, 1e-2)
    failed = [c for c in checks if not ok.get(c, False)]
    row.update(passed=not failed, failed=failed, checks=list(checks), seconds=time.perf_counter() - t0)
    row["_layout"] = layout  # dropped before writing
    return row


# ----------------------------------------------------------------------------- the suite
ACCURACY_CHECKS = ("finite", "numerics", "cosine", "l1", "sparsity")
STABILITY_CHECKS = ("finite", "numerics")
EDGE_CHECKS = ("finite", "numerics", "cosine", "l1")


@dataclass
class Case:
    """One suite row: inputs (``structured_qkv`` times ``input_scale``) and predictor settings."""

    category: str
    name: str
    seq_len: int
    kv_len: int | None = None
    causal: bool = False
    level: str = "medium"
    params: dict = field(default_factory=dict)     # meansim overrides (e.g. topk, attention_sink)
    input_scale: float = 1.0
    heads: int = 4
    kv_heads: int | None = None
    checks: tuple[str, ...] = ACCURACY_CHECKS

    def meansim_kwargs(self) -> dict:
        kw = level_params(self.level)
        kw.update(self.params)
        if "topk" in kw:
            kw.pop("cdfthreshd")
        return kw


def suite_cases(quick: bool = False) -> list[Case]:
    """Sparse levels x lengths x causal, numerical stability, edge cases (smaller with ``quick``)."""
    L = 1024 if quick else 2048
    lengths = (512, 2048) if quick else (512, 1024, 4096, 8192)  # L itself is in the levels rows
    cases = [Case("levels", f"{lvl}", L, level=lvl) for lvl in SPARSE_LEVELS]
    cases.append(Case("levels", "topk 30%", L, params={"topk": 0.3}))
    cases += [Case("lengths", f"L={n}", n) for n in lengths]
    cases += [Case("causal", f"{lvl}, causal", L, causal=True, level=lvl) for lvl in SPARSE_LEVELS]
    cases += [Case("stability", "inputs x100", 1024, input_scale=100.0, checks=STABILITY_CHECKS),
              Case("stability", "inputs x1e-3", 1024, input_scale=1e-3, checks=STABILITY_CHECKS)]
    if not quick:
        cases.append(Case("stability", "inputs x100, causal", 1024, causal=True, input_scale=100.0,
                          checks=STABILITY_CHECKS))
    cases += [Case("edge", "L=1", 1, checks=EDGE_CHECKS),
              Case("edge", "L=1, causal", 1, causal=True, checks=EDGE_CHECKS),
              Case("edge", "L=1000 (tail block)", 1000, checks=EDGE_CHECKS),
              Case("edge", "L=1000 (tail), causal", 1000, causal=True, checks=EDGE_CHECKS),
              Case("edge", "Lq=300, Lk=1000, causal", 300, kv_len=1000, causal=True, checks=EDGE_CHECKS),
              Case("edge", "Lq=1000, Lk=300", 1000, kv_len=300, checks=EDGE_CHECKS),
              Case("edge", "GQA 8/2, L=777, causal, sink", 777, causal=True, heads=8, kv_heads=2,
                   params={"attention_sink": True}, checks=EDGE_CHECKS)]
    return cases


def run_case(case: Case, *, device="cpu", dtype=torch.float32, head_dim: int = 64, seed: int = 0,
             thresholds: Thresholds = Thresholds()) -> dict:
    q, k, v = structured_qkv(1, case.heads, case.seq_len, head_dim, kv_heads=case.kv_heads, kv_len=case.kv_len,
                             seed=seed, device=device)
    q, k, v = ((t * case.input_scale).to(dtype) for t in (q, k, v))
    kw = case.meansim_kwargs()
    row = {"category": case.category, "name": case.name, "q_len": case.seq_len,
           "kv_len": case.seq_len if case.kv_len is None else case.kv_len, "causal": case.causal,
           "heads": case.heads, "kv_heads": case.kv_heads or case.heads, "level": case.level,
           "input_scale": case.input_scale, **{k_: kw[k_] for k_ in sorted(kw)}}
    row.update(evaluate(q, k, v, causal=case.causal, thresholds=thresholds, checks=case.checks, **kw))
    return row


def run_suite(cases: list[Case], *, on_row=None, **kw) -> list[dict]:
    rows = []
    for case in cases:
        row = run_case(case, **kw)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


SWEEP_SIM = (0.4, 0.5, 0.6, 0.65, 0.7, 0.8)
SWEEP_CDF = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995)
SWEEP_SIM_QUICK = (0.4, 0.6, 0.8)
SWEEP_CDF_QUICK = (0.9, 0.98, 0.995)


def run_sweep(seq_len: int, *, sims=SWEEP_SIM, cdfs=SWEEP_CDF, causal: bool = False, device="cpu",
              dtype=torch.float32, heads: int = 4, head_dim: int = 64, seed: int = 0) -> list[dict]:
    """simthreshd1 x cdfthreshd grid on one structured input: sparsity, cosine, L1 per point."""
    q, k, v = structured_qkv(1, heads, seq_len, head_dim, seed=seed, dtype=dtype, device=device)
    rows = []
    for sim in sims:
        for cdf in cdfs:
            r = evaluate(q, k, v, causal=causal, checks=(), oracle=False, simthreshd1=sim, cdfthreshd=cdf)
            rows.append({"simthreshd1": sim, "cdfthreshd": cdf, "seq_len": seq_len, "causal": causal,
                         **{key: r[key] for key in ("sparsity", "grid_sparsity", "cosine", "relative_l1", "rmse")}})
    return rows


# ----------------------------------------------------------------------------- pictures
def attention_probs(q, k, layout=None, *, causal: bool = False) -> torch.Tensor:
    """Attention probabilities ``[Lq, Lk]`` of batch 0, head 0 through the reference (``V = I``): row i
    of the output is row i of the softmax, masked by ``layout`` / ``causal`` like the real call
    (``q [B, Hq, Lq, D]``, ``k [B, Hkv, Lk, D]``; the layout's batch 0, head 0 entry when it has more)."""
    from . import reference
    eye = torch.eye(k.shape[2], dtype=torch.float64, device=q.device)[None, None]
    if layout is not None and (layout.batch > 1 or layout.heads > 1):
        layout = head_layout(layout, 0, 0)
    return reference.attention(q[:1, :1].double(), k[:1, :1].double(), eye, layout, causal=causal)[0, 0]


MAX_MAP_TOKENS = 4096  # longest side of an attention map drawn: three fp64 [Lq, Lk] maps (384 MiB at 4096)


def comparison_inputs(q, k, v, head: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 ``[1, 1, L, D]`` q / k / v of query head ``head`` (its kv head under GQA) and batch row
    ``batch`` of caller tensors ``q [B, Hq, Lq, D]``, ``k / v [B, Hkv, Lk, D]`` (v None: N(0, 1))."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q and k must be [B, Hq, Lq, D] and [B, Hkv, Lk, D] with Hq a multiple of Hkv, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if not (0 <= batch < q.shape[0] and 0 <= head < q.shape[1]):
        raise ValueError(f"batch {batch} / head {head} out of range for q {tuple(q.shape)}")
    if max(q.shape[2], k.shape[2]) > MAX_MAP_TOKENS:
        raise ValueError(f"attention maps are drawn up to {MAX_MAP_TOKENS} tokens a side (three fp64 maps), got "
                         f"Lq={q.shape[2]}, Lk={k.shape[2]}: pass a slice, e.g. q[..., :{MAX_MAP_TOKENS}, :]")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"v must be [B, Hkv, Lk, Dv] like k {tuple(k.shape[:3])} in its first three dims, got "
                         f"{tuple(v.shape)}")
    kv_head = head // (q.shape[1] // k.shape[1])
    v = torch.randn_like(k[:, :, :, :1].expand(-1, -1, -1, 64), dtype=torch.float64) if v is None else v
    pick = lambda t, h: t[batch:batch + 1, h:h + 1].double()  # noqa: E731
    return pick(q, head), pick(k, kv_head), pick(v, kv_head)


def head_layout(layout: BlockLayout, batch: int, head: int) -> BlockLayout:
    """The ``[1, 1]`` layout of batch row ``batch`` and query head ``head`` of ``layout``."""
    b, h = min(batch, layout.batch - 1), min(head, layout.heads - 1)  # broadcast dims hold one row
    pick = lambda t: t[b:b + 1, h:h + 1]  # noqa: E731
    return BlockLayout(layout.block_q, layout.block_k, layout.q_len, layout.kv_len, pick(layout.kv_counts),
                       pick(layout.kv_indices), pick(layout.kv_mask_ids), layout.masks)


def plot_attention_comparison(path, *, seq_len: int = 768, block: int = 64, level: str = "medium",
                              causal: bool = False, seed: int = 0, dpi: int = 110, q=None, k=None, v=None,
                              head: int = 0, batch: int = 0, params: dict | None = None,
                              layout: BlockLayout | None = None) -> Path:
    """Dense vs sparse attention map vs |difference|: the adaptive layout (``level``) predicted and
    applied to one head. By default head 0 of a small structured input of ``seq_len`` tokens; given
    ``q [B, Hq, Lq, D]`` and ``k [B, Hkv, Lk, D]`` (and ``v``, else N(0, 1) for the output metrics),
    query head ``head`` of batch row ``batch`` of those (up to :data:`MAX_MAP_TOKENS` a side).
    ``params``: meansim keyword arguments instead of the level's (``block`` then comes from them).
    ``layout``: the layout a run over all of ``q``/``k`` used (``[B, Hq]`` or broadcast); its rows for
    (``batch``, ``head``) are drawn instead of predicting them again here (in fp64, which can keep other
    blocks near the thresholds than the run's own prediction in the inputs' dtype)."""
    from matplotlib.colors import LogNorm
    from .viz import _plt, save
    from .predict import meansim
    plt = _plt()
    if q is None or k is None:
        if q is not None or k is not None or v is not None:
            raise ValueError("give q and k together (v optional), or none of them for the built-in input")
        q, k, v = structured_qkv(1, 1, seq_len, 64, seed=seed, dtype=torch.float64)
        heading = f"head 0, L={seq_len}"
    else:
        q, k, v = comparison_inputs(q, k, v, head, batch)
        heading = f"your input: batch {batch}, head {head}, Lq={q.shape[2]}, Lk={k.shape[2]}"
    kw = dict(level_params(level), block=block) if params is None else dict(params)
    if layout is None:
        layout = meansim(q, k, causal=causal, **kw)
    else:
        if (layout.q_len, layout.kv_len) != (q.shape[2], k.shape[2]):
            raise ValueError(f"layout is for Lq={layout.q_len}, Lk={layout.kv_len}; the input has Lq={q.shape[2]}, "
                             f"Lk={k.shape[2]}")
        layout = head_layout(layout, batch, head)
    p_dense = attention_probs(q, k, causal=causal)
    p_sparse = attention_probs(q, k, layout, causal=causal)
    diff = (p_sparse - p_dense).abs()
    m = metrics.compare(p_sparse @ v[0, 0], p_dense @ v[0, 0])  # the outputs, from the same maps
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.0), layout="constrained")
    norm = LogNorm(vmin=1e-6, vmax=1.0)
    panels = ((p_dense, "dense attention P"), (p_sparse, "sparse attention P (predicted blocks)"),
              (diff, f"|difference| (max {float(diff.max()):.3g})"))
    for ax, (img, title) in zip(axes, panels):
        # the maps live on the inputs' device (quick --plot on CUDA): .numpy() needs a CPU tensor
        shown = ax.imshow(img.clamp(min=1e-6).cpu().numpy(), norm=norm, cmap="magma", interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        for x in range(layout.block_k, k.shape[2], layout.block_k):
            ax.axvline(x - 0.5, color="#4a90d9", linewidth=0.3, alpha=0.6)
        for y in range(layout.block_q, q.shape[2], layout.block_q):
            ax.axhline(y - 0.5, color="#4a90d9", linewidth=0.3, alpha=0.6)
    fig.colorbar(shown, ax=list(axes), shrink=0.9, label="probability (log scale)")
    rule = ", ".join(f"{name}={kw[name]}" for name in ("simthreshd1", "cdfthreshd", "topk") if name in kw)
    source = f"level {level}" if params is None else "thresholds"
    fig.suptitle(f"{heading}, blocks {layout.block_q}x{layout.block_k}, {source} ({rule})"
                 f"{', causal' if causal else ''}: sparsity {effective_sparsity(layout, causal):.1%}, output cosine "
                 f"{m['cosine']:.4f}, rel. L1 {m['relative_l1']:.4f}", fontsize=11)
    return save(fig, path, dpi=dpi)


def plot_block_pattern(path, layout, *, name: str, dpi: int = 110) -> Path:
    from . import viz
    return viz.save(viz.draw_layout(layout, name=name, max_heads=4, dpi=dpi), path)


def plot_sweep(path, rows: list[dict], thresholds: Thresholds = Thresholds(), dpi: int = 110) -> Path:
    """Accuracy vs sparsity: cosine and relative L1 per point, one line per simthreshd1 (cdfthreshd along it)."""
    from .viz import _plt, save
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    sims = sorted({r["simthreshd1"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for i, sim in enumerate(sims):
        pts = sorted((r for r in rows if r["simthreshd1"] == sim), key=lambda r: r["cdfthreshd"])
        color = cmap(i / max(len(sims) - 1, 1))
        for ax, key in zip(axes, ("cosine", "relative_l1")):
            ax.plot([p["sparsity"] for p in pts], [p[key] for p in pts], "o-", color=color, markersize=4,
                    label=f"simthreshd1={sim}")
            for p in pts:
                ax.annotate(f"{p['cdfthreshd']}", (p["sparsity"], p[key]), fontsize=6, alpha=0.7,
                            xytext=(2, 2), textcoords="offset points")
    axes[0].axhline(thresholds.min_cosine, color="#c0392b", linestyle="--", linewidth=0.8, label="threshold")
    axes[1].axhline(thresholds.max_l1, color="#c0392b", linestyle="--", linewidth=0.8, label="threshold")
    axes[0].set_ylabel("cosine similarity to dense (higher is better)")
    axes[1].set_ylabel("relative L1 error to dense (lower is better)")
    for ax in axes:
        ax.set_xlabel("sparsity (fraction of blocks skipped)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    r0 = rows[0]
    fig.suptitle(f"threshold sweep: L={r0['seq_len']}{', causal' if r0['causal'] else ''}, structured inputs "
                 "(labels: cdfthreshd)", fontsize=11)
    fig.tight_layout()
    return save(fig, path, dpi=dpi)


# ----------------------------------------------------------------------------- report files
def _clean(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def write_json(path, header: dict, rows: list[dict], sweep: list[dict] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"header": header, "cases": [_clean(r) for r in rows], "sweep": sweep or []}
    path.write_text(dumps(payload, default=str))
    return path


def _f(x, spec: str) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def case_table(rows: list[dict]) -> list[str]:
    lines = ["| category | case | Lq x Lk | causal | settings | sparsity (grid) | cosine | rel. L1 | RMSE | "
             "vs fp64 oracle | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        setting = f"topk={r['topk']}" if "topk" in r else f"sim={r['simthreshd1']}, cdf={r['cdfthreshd']}"
        if r.get("attention_sink"):
            setting += ", sink"
        result = "pass" if r["passed"] else "**FAIL** (" + ", ".join(r["failed"]) + ")"
        lines.append(f"| {r['category']} | {r['name']} | {r['q_len']} x {r['kv_len']} | {'yes' if r['causal'] else 'no'} "
                     f"| {setting} | {_f(r['sparsity'], '.1%')} ({_f(r['grid_sparsity'], '.1%')}) "
                     f"| {_f(r['cosine'], '.5f')} | {_f(r['relative_l1'], '.4f')} | {_f(r['rmse'], '.3g')} "
                     f"| {_f(r.get('oracle_l1'), '.1e')} | {result} |")
    return lines


def sweep_table(rows: list[dict]) -> list[str]:
    lines = ["| simthreshd1 | cdfthreshd | sparsity | cosine | rel. L1 |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['simthreshd1']} | {r['cdfthreshd']} | {_f(r['sparsity'], '.1%')} | "
                     f"{_f(r['cosine'], '.5f')} | {_f(r['relative_l1'], '.4f')} |")
    return lines


def write_markdown(path, header: dict, rows: list[dict], *, images: dict[str, Path],
                   sweep: list[dict] | None = None) -> Path:
    path = Path(path)
    th = header["thresholds"]
    n_pass = sum(r["passed"] for r in rows)
    lines = ["# Adaptive sparse attention: accuracy report", "",
             f"{n_pass} of {len(rows)} cases passed on {header['device']} ({header['dtype']}, torch "
             f"{header['torch']}, {header['seconds']:.1f} s{', --quick' if header['quick'] else ''}).", "",
             "Each case runs dense attention and `sparse_attn.predict.adaptive_attention` (meansim prediction, "
             "then the block-sparse call) on the same inputs, batch 1, head_dim "
             f"{header['head_dim']}, blocks {header['block']}x{header['block']}.", "",
             "Checks: `finite` (no NaN/inf), `numerics` (sparse output vs the fp64 reference on the same "
             "layout: relative L1 within the dtype's tolerance), `cosine` > "
             f"{th['min_cosine']}, `l1` (relative L1 vs dense) < {th['max_l1']}, `sparsity` > "
             f"{100 * th['min_sparsity']:g}%. Stability cases check only `finite` and `numerics`: scaling q and k "
             "by s scales the logits by s^2, which changes the attention itself (x100 is near-argmax "
             "attention, which pooled block prediction cannot follow token by token), so their accuracy "
             "against dense is reported, not judged. Edge cases do not require sparsity.", "",
             "Sparsity is the fraction of the dense baseline's blocks skipped (causal: of the causal "
             "blocks); in parentheses the fraction of the whole block grid (`layout.sparsity`).", "",
             "Sparse levels: " + ", ".join(f"`{k}` = (simthreshd1 {s}, cdfthreshd {c})"
                                           for k, (s, c) in header["levels"].items()) + ".", "",
             "## Cases", ""] + case_table(rows) + ["", "## Inputs", "", header["data"], ""]
    lines += ["## Pictures", ""]
    for title, img in images.items():
        lines += [f"### {title}", "", f"![{title}]({img.name})", ""]
    if sweep:
        lines += ["## Threshold sweep", "",
                  f"L = {sweep[0]['seq_len']}, {'causal' if sweep[0]['causal'] else 'non-causal'}, the same "
                  "structured input for every point.", ""]
        lines += sweep_table(sweep) + [""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
