"""Benchmark suites: named lists of :class:`Case`.

A case is one pattern (a builder in :mod:`sparse_attn.patterns` plus its keyword arguments) run
at every combination of its ``seq_lens x kv_heads x modes x providers``, with fixed batch, query
heads, head dim and dtype. ``causal=True`` marks a causal pattern: the sparse providers get
``causal=True`` and the dense SDPA baselines run causal-dense.

    small     CPU-friendly: L 256..1024, B=1, H=2, D=32, fp32; reference, sdpa-math, sparse_attn
    demo-gpu  what ``sparse-attn demo`` runs on a GPU: bf16, B=1, H=16, D=128, L 4K..16K, forward
    kernels   the H100 suite of the kernels issue: bf16, B=1, H=32 (Hkv 32 and 8), D=128;
              sparse patterns at 8K/32K/128K, dense and causal at 16K-64K, all forward, plus
              fwd+bwd at 16K/32K; providers sparse_attn, flex, sdpa-cudnn, sdpa-flash
    all       (device-dependent, :func:`suite_all`) small on the CPU; kernels + demo-gpu on CUDA
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

    ``per_head=True`` passes ``heads=H`` (per-head patterns: random, bigbird).
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
        layout = fn(seq_len, **kw)
        for other in self.union:
            layout = layout | other.build(seq_len, heads=heads, block_q=block_q, block_k=block_k, device=device)
        return layout


def spec(name: str, builder: str | None = None, *, per_head: bool = False, causal: bool = False,
         union: tuple[PatternSpec, ...] = (), **kwargs) -> PatternSpec:
    return PatternSpec(name, builder or name, tuple(sorted(kwargs.items())), per_head, causal, union)


@dataclass(frozen=True)
class Case:
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
    name: str
    description: str
    cases: tuple[Case, ...] = field(default_factory=tuple)

    def num_rows(self) -> int:
        return sum(c.num_rows() for c in self.cases)


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
    ]
    cases = [Case(p, seq_lens=(256, 512, 1024), providers=providers) for p in pats]
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


SUITES = {"small": _small, "demo-gpu": _demo_gpu, "kernels": _kernels}


ALL = "all"


def suite_all(device, *, stress: bool = False) -> Suite:
    """Every suite that fits ``device``: the CPU gets 'small'; CUDA 'kernels' + 'demo-gpu'.

    ``stress=True`` extends every case with two longer lengths (2x and 4x its longest), to find
    where each provider runs out of memory (failed rows are recorded as "OOM", not fatal)."""
    names = ("kernels", "demo-gpu") if torch.device(device).type == "cuda" else ("small",)
    cases = tuple(c for n in names for c in get_suite(n).cases)
    if stress:
        cases = tuple(replace(c, seq_lens=tuple(dict.fromkeys(c.seq_lens + (2 * max(c.seq_lens),
                                                                              4 * max(c.seq_lens)))))
                      for c in cases)
    desc = " + ".join(names) + (" (stress: + 2x, 4x the longest length)" if stress else "")
    return Suite(ALL, f"every suite that fits {torch.device(device).type}: {desc}", cases)


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; available: {', '.join(SUITES)}")
    return SUITES[name]()


def _match(spec_: PatternSpec, wanted) -> bool:
    from fnmatch import fnmatch
    return any(fnmatch(spec_.name, w) or fnmatch(spec_.builder, w) for w in wanted)


def restrict(suite: Suite, *, providers=None, patterns=None, seq_lens=None, modes=None, dtype=None,
             batch=None, heads=None, kv_heads=None, head_dim=None) -> Suite:
    """The suite with cases selected by pattern (name or builder, shell globs) and every other
    given field replacing the suite's own (providers, seq_lens, modes, dtype, batch, heads,
    kv_heads, head_dim). Rows that become duplicates are run once (see runner)."""
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
    return replace(suite, cases=tuple(dict.fromkeys(out)))
