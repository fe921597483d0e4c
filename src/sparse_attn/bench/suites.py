"""Benchmark suites: named lists of :class:`Case`.

A case is one pattern (a builder in :mod:`sparse_attn.patterns` plus its keyword arguments) run
at every combination of its ``seq_lens x kv_heads x modes x providers``, with fixed batch, query
heads, head dim and dtype. ``causal=True`` marks a causal pattern: the sparse providers get
``causal=True`` and the dense SDPA baselines run causal-dense.

    small      CPU-friendly: L 256..1024, B=1, H=2, D=32, fp32; reference, sdpa-math, sparse_attn;
               the report's pattern families at small sizes (what ``sparse-attn demo`` runs on a CPU)
    demo-gpu   a quick GPU look: bf16, B=1, H=16, D=128, L 4K..16K, forward (``sparse-attn demo --quick``)
    report-gpu the long-context report (``sparse-attn demo`` on a GPU): see :func:`_report_gpu`
    kernels   the H100 suite of the kernels issue: bf16, B=1, H=32 (Hkv 32 and 8), D=128;
              sparse patterns at 8K/32K/128K, dense and causal at 16K-64K, all forward, plus
              fwd+bwd at 16K/32K; providers sparse_attn, flex, sdpa-cudnn, sdpa-flash
    sage       the 8-bit issue's H100 suite (:func:`_sage`); on a CPU ``--suite sage`` runs its tiny
               stand-in ``sage-tiny`` (:func:`suite_for_device`)
    all       (device-dependent, :func:`suite_all`) small on the CPU; kernels + demo-gpu + report-gpu on CUDA

A pattern whose ``provider`` computes its own layout from the inputs (``adaptive``) still names a
builder: the layout the FLOPs and density are counted from (see the provider's docstring).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}[dtype]


@dataclass(frozen=True)
class PatternSpec:
    """A named pattern: ``patterns.<builder>(seq_len, **kwargs)``, OR'd with ``union`` specs.

    ``per_head=True`` passes ``heads=H`` (per-head patterns: random, bigbird). ``causal=True`` marks a
    causal pattern (the runner passes ``causal=True`` to the providers) and, where the builder takes a
    ``causal`` argument (random, strided, dilated, ...), builds its causal variant.
    """

    name: str
    builder: str
    kwargs: tuple[tuple[str, object], ...] = ()
    per_head: bool = False
    causal: bool = False
    union: tuple["PatternSpec", ...] = ()

    def build(self, seq_len: int, *, heads: int = 1, block_q: int = 128, block_k: int = 128, device=None):
        from sparse_attn import patterns
        fn = getattr(patterns, self.builder, None)
        if fn is None:
            raise AttributeError(f"sparse_attn.patterns has no builder {self.builder!r}")
        kw = dict(self.kwargs)
        if self.per_head:
            kw["heads"] = heads
        params = inspect.signature(fn).parameters
        for name, value in (("block_q", block_q), ("block_k", block_k), ("device", device)):
            if name in params:
                kw.setdefault(name, value)
        if self.causal and "causal" in params:
            kw.setdefault("causal", True)
        layout = fn(seq_len, **kw)
        for other in self.union:
            layout = layout | other.build(seq_len, heads=heads, block_q=block_q, block_k=block_k, device=device)
        return layout


def spec(name: str, builder: str | None = None, *, per_head: bool = False, causal: bool = False,
         union: tuple[PatternSpec, ...] = (), **kwargs) -> PatternSpec:
    """A :class:`PatternSpec` named ``name`` building ``patterns.<builder or name>(seq_len, **kwargs)``."""
    return PatternSpec(name, builder or name, tuple(sorted(kwargs.items())), per_head, causal, union)


@dataclass(frozen=True)
class Case:
    """One pattern timed at every ``seq_lens x kv_heads x modes x providers`` combination, with these
    batch / heads / head dim / dtype and layout blocks."""

    pattern: PatternSpec
    seq_lens: tuple[int, ...]
    providers: tuple[str, ...]
    modes: tuple[str, ...] = ("fwd",)
    batch: int = 1
    heads: int = 2
    kv_heads: tuple[int, ...] = (2,)
    head_dim: int = 32
    dtype: str = "fp32"
    block_q: int = 128
    block_k: int = 128

    def num_rows(self) -> int:
        return len(self.seq_lens) * len(self.kv_heads) * len(self.modes) * len(self.providers)


@dataclass(frozen=True)
class Suite:
    """A named tuple of :class:`Case` (see the module docstring for the built-in ones)."""

    name: str
    description: str
    cases: tuple[Case, ...] = field(default_factory=tuple)

    def num_rows(self) -> int:
        return sum(c.num_rows() for c in self.cases)


# The adaptive pattern predicts its layout from q/k inside the timed call (provider "adaptive"); on the
# runner's torch.randn inputs no block is self-similar, so it keeps every causal block: its FLOPs and
# density are those of the causal layout (the provider checks this), and its row shows the prediction's cost.
ADAPTIVE = spec("adaptive", "causal", causal=True)


# ----------------------------------------------------------------------------- small (CPU)
def _small() -> Suite:
    providers = ("reference", "sdpa-math", "sparse_attn")
    pats = [
        spec("dense"),
        spec("causal", causal=True),
        spec("local", window=256, causal=True),
        spec("streaming", window=256, num_sink=64, causal=True),
        spec("block_diagonal", block_size=256),
        spec("random", density=0.3, per_head=True, seed=0),
        spec("bigbird", num_global_blocks=1, window_blocks=1, num_random_blocks=1, per_head=True, seed=0),
        spec("dilated", window_blocks=2, dilation=2, causal=True),
        spec("strided", stride=4, local_blocks=1, causal=True),
        spec("random_topk", "random", top_k=2, per_head=True, seed=0, causal=True),
    ]
    cases = [Case(p, seq_lens=(256, 512, 1024), providers=providers) for p in pats]
    cases.append(Case(ADAPTIVE, seq_lens=(256, 512, 1024), providers=("sdpa-math", "adaptive")))
    cases.append(Case(spec("local", window=256, causal=True), seq_lens=(512,), providers=providers,
                      modes=("fwd+bwd",)))
    return Suite("small", "CPU-friendly: L 256-1024, B=1, H=2, D=32, fp32; reference / sdpa-math / sparse_attn",
                 tuple(cases))


# ----------------------------------------------------------------------------- demo on a GPU
def _demo_gpu() -> Suite:
    providers = ("sparse_attn", "flex", "sdpa-flash", "sdpa-cudnn")
    pats = [spec("dense"), spec("causal", causal=True), spec("local", window=2048, causal=True),
            spec("streaming", window=2048, num_sink=128, causal=True),
            spec("random", density=0.25, per_head=True, seed=0)]
    cases = [Case(p, seq_lens=(4096, 8192, 16384), providers=providers, heads=16, kv_heads=(16,),
                  head_dim=128, dtype="bf16") for p in pats]
    return Suite("demo-gpu", "GPU demo: bf16, B=1, H=16, D=128, L 4K-16K, forward", tuple(cases))


# ----------------------------------------------------------------------------- kernels (H100)
def _kernels() -> Suite:
    providers = ("sparse_attn", "flex", "sdpa-cudnn", "sdpa-flash")
    common = dict(providers=providers, heads=32, kv_heads=(32, 8), head_dim=128, dtype="bf16")
    sparse = [
        spec("local-4096", "local", window=4096, causal=True),
        spec("streaming-128+4096", "streaming", window=4096, num_sink=128, causal=True),
        spec("block_diagonal-4096", "block_diagonal", block_size=4096),
        spec("random-0.1", "random", density=0.1, per_head=True, seed=0),
        spec("random-0.25", "random", density=0.25, per_head=True, seed=0),
        spec("random-0.5", "random", density=0.5, per_head=True, seed=0),
    ]
    dense = [spec("dense"), spec("causal", causal=True)]
    cases = [Case(p, seq_lens=(8192, 32768, 131072), **common) for p in sparse]
    cases += [Case(p, seq_lens=(16384, 32768, 65536), **common) for p in dense]
    cases += [Case(p, seq_lens=(16384, 32768), modes=("fwd+bwd",), **common) for p in sparse + dense]
    return Suite("kernels", "H100 kernels suite: bf16, B=1, H=32, Hkv 32/8, D=128; "
                 "sparse 8K-128K, dense 16K-64K, fwd+bwd 16K-32K", tuple(cases))


# ----------------------------------------------------------------------------- the report (H100)
REPORT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
REPORT_FWDBWD_LENGTHS = (4096, 8192, 16384, 32768)
REPORT_LONG_LENGTHS = (262144, 524288, 1048576)
REPORT_DENSE_PROVIDERS = ("sparse_attn", "sdpa-cudnn", "sdpa-flash", "flex", "sdpa-math")


def report_patterns() -> list[PatternSpec]:
    """The sparse patterns of the report, each visiting about 4096 keys per query at long lengths
    (BigBird-ITC at its paper configuration visits fewer)."""
    return [
        spec("local-4096", "local", window=4096, causal=True),
        spec("streaming-128+4096", "streaming", window=4096, num_sink=128, causal=True),
        spec("block_diagonal-4096", "block_diagonal", block_size=4096),
        spec("bigbird", num_global_blocks=2, window_blocks=3, num_random_blocks=3, per_head=True, seed=0),
        spec("dilated-32x2", "dilated", window_blocks=32, dilation=2, causal=True),
        spec("strided-32+16", "strided", stride=32, local_blocks=16, causal=True),
        spec("random_topk-32", "random", top_k=32, per_head=True, seed=0, causal=True),
    ]


def _report_gpu() -> Suite:
    """The long-context report: bf16, B=1, H=32 (Hkv 32), D=128, blocks 128x128.

    dense, causal   providers sparse_attn, sdpa-cudnn, sdpa-flash, flex, sdpa-math (naive: it materialises
                    fp32 scores, 8 GiB at 8K and 32 GiB at 16K; where it runs out of memory the row
                    is recorded as OOM, not fatal);
                    L 4K-128K forward, 4K-32K forward+backward
    7 patterns      (:func:`report_patterns`) + adaptive: sparse_attn (adaptive: its own provider);
                    the same lengths and modes
    local, streaming  256K, 512K, 1M: forward, sparse_attn only; dense attention is not attempted there
                    (cuDNN would take ~30 s per forward at 1M; naive attention would need 128 TiB of scores)

    The dense baselines run once per (T, mode, causal) in the dense/causal cases; the report compares
    every pattern with them (causal patterns with causal-dense). Forward+backward stops at 32K so that
    the whole suite stays around 15-20 minutes on an H100 (:mod:`sparse_attn.bench.slices` estimates it
    row by row and cuts it into slices for machines that limit one command's time).
    """
    common = dict(heads=32, kv_heads=(32,), head_dim=128, dtype="bf16")
    cases = []
    for modes, lens in ((("fwd",), REPORT_LENGTHS), (("fwd+bwd",), REPORT_FWDBWD_LENGTHS)):
        cases += [Case(p, seq_lens=lens, providers=REPORT_DENSE_PROVIDERS, modes=modes, **common)
                  for p in (spec("dense"), spec("causal", causal=True))]
        cases += [Case(p, seq_lens=lens, providers=("sparse_attn",), modes=modes, **common)
                  for p in report_patterns()]
        cases.append(Case(ADAPTIVE, seq_lens=lens, providers=("adaptive",), modes=modes, **common))
    cases += [Case(p, seq_lens=REPORT_LONG_LENGTHS, providers=("sparse_attn",), **common)
              for p in report_patterns()[:2]]
    return Suite("report-gpu", "long-context report: bf16, B=1, H=32, D=128; dense baselines, 7 patterns + "
                 "adaptive at 4K-128K fwd / 4K-32K fwd+bwd; local and streaming to 1M (fwd)", tuple(cases))


SUITES = {"small": _small, "demo-gpu": _demo_gpu, "kernels": _kernels, "report-gpu": _report_gpu}


# ----------------------------------------------------------------------------- sage (8-bit, H100)
SAGE_DENSE_PROVIDERS = ("sparse_attn", "sparse_attn-int8", "sparse_attn-int8-fp8", "sageattention", "sdpa-cudnn")
SAGE_SPARSE_PROVIDERS = ("sparse_attn", "sparse_attn-int8", "sparse_attn-int8-fp8", "flex")


def _sage_cases(dense_lens, window: int, window_lens, random_lens, **common) -> tuple[Case, ...]:
    cases = [Case(spec("dense"), seq_lens=dense_lens, providers=SAGE_DENSE_PROVIDERS, **common),
             Case(spec(f"local-{window}", "local", window=window, causal=True), seq_lens=window_lens,
                  providers=SAGE_SPARSE_PROVIDERS, **common)]
    cases += [Case(spec(f"random-{d}", "random", density=d, per_head=True, seed=0), seq_lens=random_lens,
                   providers=SAGE_SPARSE_PROVIDERS, **common) for d in (0.1, 0.25, 0.5)]
    return tuple(cases)


def _sage() -> Suite:
    """The 8-bit issue's H100 suite: bf16 inputs, B=1, H=32, D=128, forward, blocks 128x128.

    dense 16K/32K/64K        sparse_attn (bf16), sparse_attn-int8, sparse_attn-int8-fp8, sageattention
                             (PyPI 1.0.6), sdpa-cudnn
    local-4096 (causal)      32K and 128K; random 0.1/0.25/0.5 at 32K: sparse_attn, sparse_attn-int8,
                             sparse_attn-int8-fp8, flex
    Every provider of a pattern gets the bf16 rows' FLOP count, so effective TOPS ratios are time ratios.
    """
    return Suite("sage", "8-bit attention on an H100: bf16 inputs, B=1, H=32, D=128, forward; dense 16K-64K vs "
                 "sageattention / cuDNN; local-4096 32K+128K, random 0.1-0.5 at 32K vs flex",
                 _sage_cases((16384, 32768, 65536), 4096, (32768, 131072), (32768,), heads=32, kv_heads=(32,),
                             head_dim=128, dtype="bf16"))


def _sage_cpu() -> Suite:
    """What ``--suite sage`` runs on a CPU: the same providers and pattern families at tiny sizes
    (fp32, B=1, H=2, D=64, L 256/512, window 128), the 8-bit rows being the PyTorch emulation."""
    return Suite("sage-tiny", "CPU stand-in for 'sage': fp32, B=1, H=2, D=64, L 256-512, window 128; the 8-bit "
                 "rows time the PyTorch emulation, not the kernels",
                 _sage_cases((256, 512), 128, (512,), (512,), heads=2, kv_heads=(2,), head_dim=64, dtype="fp32"))


SUITES["sage"] = _sage
# suites too large for a CPU that have a tiny stand-in there (see suite_for_device)
CPU_STAND_INS = {"sage": _sage_cpu}


def suite_for_device(name: str, device) -> Suite:
    """``get_suite(name)``, or on a non-CUDA device its tiny stand-in where it has one (``sage`` ->
    ``sage-tiny``)."""
    if torch.device(device).type != "cuda" and name in CPU_STAND_INS:
        return CPU_STAND_INS[name]()
    return get_suite(name)


ALL = "all"


def suite_all(device, *, stress: bool = False) -> Suite:
    """Every suite that fits ``device``: the CPU gets 'small'; CUDA 'kernels' + 'demo-gpu' + 'report-gpu'.

    ``stress=True`` extends every case with two longer lengths (2x and 4x its longest), to find
    where each provider runs out of memory (failed rows are recorded as "OOM", not fatal)."""
    names = ("kernels", "demo-gpu", "report-gpu") if torch.device(device).type == "cuda" else ("small",)
    cases = tuple(c for n in names for c in get_suite(n).cases)
    if stress:
        cases = tuple(replace(c, seq_lens=tuple(dict.fromkeys(c.seq_lens + (2 * max(c.seq_lens),
                                                                              4 * max(c.seq_lens)))))
                      for c in cases)
    desc = " + ".join(names) + (" (stress: + 2x, 4x the longest length)" if stress else "")
    return Suite(ALL, f"every suite that fits {torch.device(device).type}: {desc}", cases)


def get_suite(name: str) -> Suite:
    """The built-in suite ``name`` (:data:`SUITES`); KeyError listing the names."""
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; available: {', '.join(SUITES)}")
    return SUITES[name]()


def _match(spec_: PatternSpec, wanted) -> bool:
    """``spec_.name`` matches a shell glob ``w`` or is a variant ``w-...`` of it (``local`` matches
    ``local-4096``, not ``adaptive`` whose FLOP-count builder is ``causal``)."""
    from fnmatch import fnmatch
    return any(fnmatch(spec_.name, w) or fnmatch(spec_.name, w + "-*") for w in wanted)


BLOCK_OPTIONS = ("block_q", "block_k")  # Case fields, not builder arguments


# builder arguments that stand for each other (random takes exactly one of density= and top_k=): an option
# given for one drops the spec's other, as --top-k's help says ("instead of --density")
ALTERNATIVES = {"density": "top_k", "top_k": "density"}


def with_options(spec_: PatternSpec, options: dict) -> PatternSpec:
    """``spec_`` with the builder arguments in ``options`` that its builder (and each union part's)
    takes replaced, renamed ``NAME[k=v,...]`` after the values that changed (so rows of another
    parameterisation never merge with the suite's own). Options its builder lacks are ignored; an option
    replaces the spec's own value of its alternative (:data:`ALTERNATIVES`) unless both are given."""
    from sparse_attn import patterns
    params = inspect.signature(getattr(patterns, spec_.builder)).parameters
    kw = dict(spec_.kwargs)
    changed = {k: v for k, v in options.items() if k in params and k != "seq_len" and kw.get(k, object()) != v}
    kw.update(changed)
    for k in changed:
        alt = ALTERNATIVES.get(k)
        if alt is not None and alt not in options:
            kw.pop(alt, None)
    union = tuple(with_options(u, options) for u in spec_.union)
    if not changed and union == spec_.union:
        return spec_
    tag = ",".join(f"{k}={v}" for k, v in sorted(changed.items()))
    return replace(spec_, name=f"{spec_.name}[{tag}]" if tag else spec_.name, kwargs=tuple(sorted(kw.items())),
                   union=union)


def _takes(spec_: PatternSpec, option: str) -> bool:
    from sparse_attn import patterns
    return (option in inspect.signature(getattr(patterns, spec_.builder)).parameters
            or any(_takes(u, option) for u in spec_.union))


def _apply_pattern_options(cases: list[Case], options: dict) -> list[Case]:
    """Each case with ``options`` applied (:func:`with_options`; ``block_q`` / ``block_k`` set the
    case's blocks); an option no selected case takes is a ValueError naming the patterns."""
    blocks = {k: v for k, v in options.items() if k in BLOCK_OPTIONS}
    builder_opts = {k: v for k, v in options.items() if k not in BLOCK_OPTIONS}
    unused = [k for k in builder_opts if not any(_takes(c.pattern, k) for c in cases)]
    if unused:
        names = ", ".join(sorted({c.pattern.name for c in cases})) or "none"
        raise ValueError(f"pattern option(s) {', '.join(unused)} apply to none of the selected patterns ({names}); "
                         "select a pattern that takes them with --patterns")
    out = []
    for c in cases:
        c = replace(c, pattern=with_options(c.pattern, builder_opts), **blocks)
        if blocks:
            tag = ",".join(f"{k}={v}" for k, v in sorted(blocks.items()))
            c = replace(c, pattern=replace(c.pattern, name=f"{c.pattern.name}<{tag}>"))
        out.append(c)
    return out


def restrict(suite: Suite, *, providers=None, patterns=None, seq_lens=None, modes=None, dtype=None,
             batch=None, heads=None, kv_heads=None, head_dim=None, pattern_options=None) -> Suite:
    """The suite with cases selected by pattern (names, shell globs; a family name also selects its
    variants ``NAME-...``) and every other
    given field replacing the suite's own (providers, seq_lens, modes, dtype, batch, heads,
    kv_heads, head_dim). ``pattern_options`` (builder argument -> value, plus ``block_q`` /
    ``block_k``) re-parameterise the selected patterns that take them (:func:`with_options`).
    Rows that become duplicates are run once (see runner). ``dtype`` takes any :data:`DTYPES` name and
    is stored as its short name (``float32`` -> ``fp32``)."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        # one name per dtype: rows of --dtype float32 were not the suite's fp32 rows (--skip-done, the report)
        dtype = dtype_name(DTYPES[dtype])
    out = []
    for c in suite.cases:
        if patterns and not _match(c.pattern, patterns):
            continue
        upd = {}
        if providers:
            upd["providers"] = tuple(providers)
        if seq_lens:
            upd["seq_lens"] = tuple(L for L in seq_lens)
        if modes:
            upd["modes"] = tuple(modes)
        for name, value in (("dtype", dtype), ("batch", batch), ("heads", heads), ("head_dim", head_dim)):
            if value is not None:
                upd[name] = value
        if kv_heads:
            upd["kv_heads"] = tuple(kv_heads)
        c = replace(c, **upd)
        out.append(c)
    if pattern_options:
        out = _apply_pattern_options(out, pattern_options)
    return replace(suite, cases=tuple(dict.fromkeys(out)))
