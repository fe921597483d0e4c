"""The checks and benchmark behind ``sparse-attn sage-test`` (8-bit attention on block-sparse layouts).

Sparse layouts come in SageAttention's format: ``block_index [B, H, Qb, top_k]`` (int32, -1 padded)
with query blocks of 64 and key blocks of 128 tokens, turned into a BlockLayout by
:func:`sparse_attn.patterns.from_block_index`. Every check compares the 8-bit attention
(``quant="int8"`` or ``"int8-fp8"``) with the fp16/bf16 attention on the SAME layout:

    correctness   runs, output shape/dtype, finite, inputs untouched, no memory growth over repeated
                  calls (CUDA), invalid block indices rejected with an error naming the index and the
                  valid range, accuracy on normal inputs and on keys with a large per-channel offset
                  and outlier channels
    patterns      random, local, strided, block_diagonal block indices at each top-k ratio: accuracy;
                  each row holds exactly top_k key blocks (block_diagonal: its shorter last document
                  fewer), and every label states the blocks per row and fraction kept as measured
                  on the index (index_stats)
    benchmark     dense vs sparse (random top-k) 8-bit attention: ms, speedup, blocks skipped, peak
                  memory (CUDA), effective TOPS, and the bf16 attention on the same sparse layout

Accuracy passes when cosine >= 0.999 and relative L1 <= 0.02 (``int8-fp8`` usually misses the L1
bar: e4m3 P and V carry ~3% relative rounding error; it is reported as a failure, not excused).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Callable, Iterator

import torch

from .json_io import dumps

BLOCK_Q, BLOCK_K = 64, 128
MIN_COSINE, MAX_L1 = 0.999, 0.02
PATTERNS = ("random", "local", "strided", "block_diagonal")
TOP_K_RATIOS = (0.25, 0.5, 0.75)


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run: checks at ``batch x heads x seq_len x head_dim``, the benchmark at
    ``bench_batch x bench_heads x L x head_dim`` for L in ``bench_lens``."""

    name: str
    batch: int
    heads: int
    head_dim: int
    seq_len: int
    bench_batch: int
    bench_heads: int
    bench_lens: tuple[int, ...]


SIZES = {
    "gpu": Sizes("gpu", 2, 8, 128, 4096, 4, 32, (1024, 2048, 4096, 8192, 16384, 32768)),
    "gpu-stress": Sizes("gpu-stress", 2, 32, 128, 32768, 4, 32, (1024, 2048, 4096, 8192, 16384, 32768, 65536)),
    "cpu-tiny": Sizes("cpu-tiny", 1, 2, 64, 512, 1, 2, (256, 512)),
    "cpu-tiny-stress": Sizes("cpu-tiny-stress", 1, 4, 64, 1024, 1, 2, (256, 512, 1024, 2048)),
}


def sizes_for(device, stress: bool = False) -> Sizes:
    """The issue's sizes on CUDA (B=4, H=32, D=128, L 1K-32K for the benchmark); tiny ones elsewhere,
    where the 8-bit path is the PyTorch emulation."""
    gpu = torch.device(device).type == "cuda"
    return SIZES[("gpu" if gpu else "cpu-tiny") + ("-stress" if stress else "")]


def with_sizes(sizes: Sizes, *, batch: int | None = None, heads: int | None = None,
               head_dim: int | None = None) -> Sizes:
    """``sizes`` with the given batch / heads (checks and benchmark alike) and head dim; None keeps
    the preset's value."""
    new = {k: v for k, v in (("batch", batch), ("bench_batch", batch), ("heads", heads), ("bench_heads", heads),
                             ("head_dim", head_dim)) if v is not None}
    return replace(sizes, **new)


def default_quant(device) -> str:
    """``int8-fp8`` on GPUs with FP8 tensor cores (compute capability 8.9+), else ``int8``."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return "int8-fp8"
    return "int8"


# ----------------------------------------------------------------------------- block indices
def block_grid(seq_len: int, kv_len: int | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """(query blocks, key blocks) of ``seq_len`` x ``kv_len`` tokens."""
    kv_len = seq_len if kv_len is None else kv_len
    return -(-seq_len // block_q), -(-kv_len // block_k)


def top_k_for(ratio: float, num_k_blocks: int) -> int:
    """Key blocks per row at ``ratio``: ``floor(ratio * Kb)``, at least 1 (SageAttention's rule)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
    return max(1, min(num_k_blocks, int(ratio * num_k_blocks + 1e-9)))


def diagonal_blocks(seq_len: int, kv_len: int | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """int64 ``[Qb]``: the key block holding each query block's last row (key frame, bottom-right
    aligned: query ``i`` sits at ``i + Lk - Lq``), clamped to ``0 .. Kb - 1``."""
    kv_len = seq_len if kv_len is None else kv_len
    nq, nk = block_grid(seq_len, kv_len, block_q, block_k)
    last = torch.clamp((torch.arange(nq) + 1) * block_q, max=seq_len) - 1 + (kv_len - seq_len)
    return torch.div(last, block_k, rounding_mode="floor").clamp(0, max(nk - 1, 0))


def _check_top_k(top_k: int, nk: int, kv_len: int, block_k: int) -> None:
    if not 1 <= top_k <= nk:
        raise ValueError(f"top_k={top_k} must be in 1..{nk} (the key blocks of kv_len={kv_len} "
                         f"at block_k={block_k})")


def random_block_index(batch: int, heads: int, seq_len: int, top_k: int, *, kv_len: int | None = None,
                       block_q: int = BLOCK_Q, block_k: int = BLOCK_K, seed: int = 0, include_diagonal: bool = True,
                       device=None) -> torch.Tensor:
    """int32 ``[batch, heads, Qb, top_k]``: per (b, h, query block) ``top_k`` distinct key blocks
    drawn uniformly, ascending (with ``include_diagonal`` the row's diagonal block, see
    :func:`diagonal_blocks`, is always one of them). ``1 <= top_k <= Kb``.

    Drawn on the CPU from a generator seeded with ``seed`` (the same indices on every device), one
    batch entry at a time: memory O(heads * Qb * Kb). Like ``patterns.random(top_k=...)`` (that builder
    samples row by row, ~100x slower at 32K) in a fixed ``[B, H, Qb, top_k]`` width, with one forced block
    a row: where a query block's rows straddle a key-block edge (``Lk - Lq`` not a multiple of
    ``block_k``), that builder also forces the earlier block and may keep ``top_k + 1``; this one does not
    (the suite runs these indices without causal, where every row sees its blocks' keys).
    """
    nq, nk = block_grid(seq_len, kv_len, block_q, block_k)
    _check_top_k(top_k, nk, seq_len if kv_len is None else kv_len, block_k)  # (kv_len 0 is no key, not seq_len)
    gen = torch.Generator().manual_seed(seed)
    diag = diagonal_blocks(seq_len, kv_len, block_q, block_k)
    out = torch.empty(batch, heads, nq, top_k, dtype=torch.int32)
    for b in range(batch):
        scores = torch.rand(heads, nq, nk, generator=gen)
        if include_diagonal:
            scores[:, torch.arange(nq), diag] = 2.0  # above every draw in [0, 1)
        out[b] = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    return out.to(device)


def local_rows(diag: torch.Tensor, nk: int, top_k: int) -> torch.Tensor:
    """int64 ``[Qb, top_k]``: for each row a band of ``top_k`` consecutive key blocks holding its
    diagonal block ``diag [Qb]``, ``top_k // 2`` of them before it. At the edges the band is shifted
    inwards, not cut, so every row keeps exactly ``top_k`` blocks (the token window of
    ``(top_k // 2) * 128`` either side used before touched up to ``top_k + 1`` blocks mid-sequence,
    fewer at the edges, and at Kb=4 the same 2-3 blocks for every ratio)."""
    start = (diag - top_k // 2).clamp(min=0).clamp(max=nk - top_k)
    return start[:, None] + torch.arange(top_k)


def strided_rows(diag: torch.Tensor, nk: int, top_k: int) -> torch.Tensor:
    """int64 ``[Qb, top_k]``, ascending: the diagonal block ``diag [Qb]`` and ``top_k - 1`` more at
    offsets ``floor(i * Kb / top_k)`` from it, wrapping past the last key block. The offsets are
    distinct and below Kb (Kb / top_k >= 1), so every row has exactly ``top_k`` blocks (the integer
    stride ``Kb // top_k`` used before kept more than ``top_k``: at Kb=32, top_k=24 stride 1 kept all 32)."""
    offsets = torch.arange(top_k) * nk // top_k
    return ((diag[:, None] + offsets) % nk).sort(dim=-1).values


def block_diagonal_rows(diag: torch.Tensor, nk: int, top_k: int) -> torch.Tensor:
    """int64 ``[Qb, top_k]``: the key blocks of the row's document, documents being ``top_k``
    consecutive key blocks from block 0. When ``top_k`` does not divide Kb the LAST document is
    shorter (``Kb % top_k`` blocks) and its rows are -1 padded: they truly see fewer blocks."""
    blocks = (diag // top_k * top_k)[:, None] + torch.arange(top_k)
    return torch.where(blocks < nk, blocks, -1)


PATTERN_ROWS = {"local": local_rows, "strided": strided_rows, "block_diagonal": block_diagonal_rows}


def pattern_block_index(name: str, batch: int, heads: int, seq_len: int, top_k: int, *, seed: int = 0,
                        device=None) -> torch.Tensor:
    """int32 ``[batch, heads, Qb, top_k]`` of a named block pattern (q block 64, k block 128), every
    row holding exactly ``top_k`` key blocks (``1 <= top_k <= Kb``) except where noted:

        random          :func:`random_block_index` (diagonal included)
        local           :func:`local_rows`: a band of ``top_k`` blocks around the diagonal
        strided         :func:`strided_rows`: the diagonal plus blocks spaced ``Kb / top_k`` apart
        block_diagonal  :func:`block_diagonal_rows`: documents of ``top_k`` key blocks; the rows of
                        a shorter last document (``Kb % top_k`` blocks) are -1 padded
    Measure what an index keeps with :func:`index_stats`.
    """
    if name == "random":
        return random_block_index(batch, heads, seq_len, top_k, seed=seed, device=device)
    if name not in PATTERN_ROWS:
        raise ValueError(f"unknown pattern {name!r}; choose one of {', '.join(PATTERNS)}")
    _, nk = block_grid(seq_len)
    _check_top_k(top_k, nk, seq_len, BLOCK_K)
    rows = PATTERN_ROWS[name](diagonal_blocks(seq_len), nk, top_k).to(torch.int32)  # [Qb, top_k]
    return rows.expand(batch, heads, -1, -1).contiguous().to(device)


@dataclass(frozen=True)
class IndexStats:
    """What a block index ``[B, H, Qb, K]`` keeps, counted from its entries (not from its label)."""

    min_per_row: int
    max_per_row: int
    mean_per_row: float
    kept: float  # fraction of the B*H*Qb*Kb block grid listed

    def label(self, nk: int) -> str:
        return f"{per_row(self.min_per_row, self.max_per_row)} of {nk} key blocks per row, {self.kept:.1%} kept"


def per_row(lo: int, hi: int) -> str:
    """``"3"`` or, when rows differ, ``"1 to 3"``."""
    return f"{lo}" if lo == hi else f"{lo} to {hi}"


def index_stats(block_index: torch.Tensor, nk: int) -> IndexStats:
    """Blocks per row (entries >= 0) of ``block_index [B, H, Qb, K]`` and the fraction of the
    ``Kb = nk`` wide block grid they cover."""
    counts = (block_index >= 0).sum(-1)
    return IndexStats(int(counts.min()), int(counts.max()), float(counts.float().mean()),
                      float(counts.sum()) / (counts.numel() * nk))


# ----------------------------------------------------------------------------- inputs
def make_qkv(batch: int, heads: int, seq_len: int, head_dim: int, *, kv_heads: int | None = None,
             kv_len: int | None = None, dtype=torch.bfloat16, device="cpu", seed: int = 0,
             outlier_keys: bool = False):
    """Normal q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` drawn on ``device``. ``outlier_keys``:
    k gets a per-channel offset ``8 * N(0, 1)`` (what smoothing removes) and 4 outlier channels
    ``2 k + 25`` (a wider spread smoothing cannot remove), as real models' keys look."""
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = seq_len if kv_len is None else kv_len
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)
    q, k, v = randn(batch, heads, seq_len, head_dim), randn(batch, kv_heads, kv_len, head_dim), \
        randn(batch, kv_heads, kv_len, head_dim)
    if outlier_keys:
        k = k + 8.0 * randn(head_dim)
        k[..., :4] = k[..., :4] * 2.0 + 25.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


# ----------------------------------------------------------------------------- checks
@dataclass
class Check:
    """One line of the report. ``passed`` None: skipped (``detail`` says why)."""

    section: str
    name: str
    passed: bool | None
    detail: str = ""
    cosine: float | None = None
    relative_l1: float | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Quant:
    """The 8-bit settings under test."""

    quant: str
    granularity: str = "per_warp"

    def attention(self, q, k, v, layout=None, **kw):
        import sparse_attn
        return sparse_attn.attention(q, k, v, layout, quant=self.quant, quant_granularity=self.granularity, **kw)


def accuracy_check(section: str, name: str, qz: Quant, q, k, v, layout, **extra) -> Check:
    """8-bit vs fp16/bf16 attention on ``layout``: pass when finite, cosine >= 0.999, rel. L1 <= 0.02."""
    import sparse_attn
    from . import metrics
    m = metrics.compare(qz.attention(q, k, v, layout), sparse_attn.attention(q, k, v, layout))
    failed = [what for what, ok in (("non-finite output", m["finite"]),
                                    (f"cosine {m['cosine']:.5f} < {MIN_COSINE}", m["cosine"] >= MIN_COSINE),
                                    (f"rel. L1 {m['relative_l1']:.4f} > {MAX_L1}", m["relative_l1"] <= MAX_L1))
              if not ok]
    return Check(section, name, not failed, "; ".join(failed), m["cosine"], m["relative_l1"], extra)


def _guard(section: str, name: str, fn: Callable[[], Check]) -> Check:
    """``fn()``, or a failed check carrying the exception."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a crashing check is a failed check, not a crashed suite
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Check(section, name, False, f"{type(e).__name__}: {first}"[:300])


def run_check(qz: Quant, q, k, v, layout, name: str) -> Check:
    """Runs; ``out [B, Hq, Lq, D]`` in q's dtype, finite; lse fp32 ``[B, Hq, Lq]``; inputs untouched."""
    before = [t.clone() for t in (q, k, v)]
    out, lse = qz.attention(q, k, v, layout, return_lse=True)
    want = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    problems = []
    if tuple(out.shape) != want or out.dtype != q.dtype:
        problems.append(f"out {tuple(out.shape)} {out.dtype}, expected {want} {q.dtype}")
    if tuple(lse.shape) != want[:3] or lse.dtype != torch.float32:
        problems.append(f"lse {tuple(lse.shape)} {lse.dtype}, expected {want[:3]} torch.float32")
    if not bool(torch.isfinite(out).all()):
        problems.append("non-finite values in out")
    if not all(torch.equal(a, b) for a, b in zip(before, (q, k, v))):
        problems.append("q, k or v was modified in place")
    shapes = f"q {list(q.shape)}, k/v {list(k.shape)} -> out {list(out.shape)} {str(out.dtype).replace('torch.', '')}"
    return Check("correctness", name, not problems, "; ".join(problems) or shapes)


def memory_check(qz: Quant, q, k, v, layout, calls: int = 20) -> Check:
    """CUDA: allocated memory after ``calls`` calls equals that after the first (outputs discarded)."""
    name = f"memory: no growth over {calls} calls, L={q.shape[2]}"
    if q.device.type != "cuda":
        return Check("correctness", name, None, "skipped: CUDA only (the allocator is measured)")
    for _ in range(2):
        qz.attention(q, k, v, layout)
    torch.cuda.synchronize(q.device)
    base = torch.cuda.memory_allocated(q.device)
    for _ in range(calls):
        qz.attention(q, k, v, layout)
    torch.cuda.synchronize(q.device)
    grown = torch.cuda.memory_allocated(q.device) - base
    return Check("correctness", name, grown <= 0, f"{grown} bytes more allocated after {calls} calls",
                 extra={"growth_bytes": grown})


def index_error_cases(seq_len: int) -> list[tuple[str, torch.Tensor, dict, tuple[str, ...]]]:
    """(name, block_index, from_block_index kwargs, substrings the error must contain) of invalid
    SageAttention-format block indices at ``seq_len`` (> 128 tokens: two key blocks at least)."""
    nq, nk = block_grid(seq_len)
    good = random_block_index(1, 2, seq_len, 2, seed=1)
    where, rng = f"block_index[0,1,{nq - 1},0]", f"0..{nk - 1}"

    def with_entry(value):
        bi = good.clone()
        bi[0, 1, nq - 1, 0] = value
        return bi
    dup = good.clone()
    dup[0, 0, 0] = nk - 1
    short = seq_len // 2
    return [
        (f"index {nk} (= key blocks) rejected", with_entry(nk), {}, (where, f"= {nk}", rng)),
        ("index -2 rejected", with_entry(-2), {}, (where, "= -2", rng, "-1 for padding")),
        (f"indices past a shorter kv_len={short} rejected", good, {"kv_len": short},
         ("block_index[", "out of range", f"0..{block_grid(seq_len, short)[1] - 1}", f"kv_len={short}")),
        ("duplicate key block rejected", dup, {}, ("block_index[0,0,0]", f"key block {nk - 1} twice")),
        ("wrong number of query-block rows rejected", good[:, :, :-1], {}, (f"{nq - 1} query-block rows", str(nq))),
        ("float dtype rejected", good.float(), {}, ("integer dtype", "float32")),
    ]


def index_checks(seq_len: int) -> Iterator[Check]:
    """Each invalid ``block_index`` raises a LayoutError whose text names the entry and the range."""
    from .layout import LayoutError
    from .patterns import from_block_index
    for name, bi, kw, needed in index_error_cases(seq_len):
        try:
            from_block_index(bi, seq_len=seq_len, **kw)
        except LayoutError as e:
            missing = [s for s in needed if s not in str(e)]
            yield Check("correctness", f"block_index: {name}, L={seq_len}", not missing,
                        str(e) if not missing else f"error text lacks {missing}: {e}")
        else:
            yield Check("correctness", f"block_index: {name}, L={seq_len}", False, "accepted without an error")


def correctness_steps(qz: Quant, sizes: Sizes, *, dtype, device, seed: int = 0) -> list[tuple[str, Callable]]:
    """(label, zero-argument function returning a Check or a list of Checks) of the correctness section."""
    from .patterns import from_block_index
    B, H, L, D = sizes.batch, sizes.heads, sizes.seq_len, sizes.head_dim
    nk = block_grid(L)[1]
    half = top_k_for(0.5, nk)

    def layout_for(lq, lk=None, hq=H, batch=B):
        bi = random_block_index(batch, hq, lq, top_k_for(0.5, block_grid(lq, lk)[1]), kv_len=lk, seed=seed,
                                device=device)
        return from_block_index(bi, seq_len=lq, kv_len=lk)

    def inputs(**kw):
        return make_qkv(B, H, L, D, dtype=dtype, device=device, seed=seed, **kw)

    odd = L - 37 if (L - 37) % 64 else L - 27  # a partial last block (64 is the index's q block)
    kv = next(d for d in range(max(1, H // 4), 0, -1) if H % d == 0)  # a KV head count that divides H
    heads = f"GQA {H}/{kv}" if kv < H else f"heads {H}/{kv} (one head: no GQA to test)"
    runs = [
        (f"runs: dense, L={L}", lambda: run_check(qz, *inputs(), None, f"runs: dense, L={L}")),
        (f"runs: random top-k {half}/{nk}, L={L}",
         lambda: run_check(qz, *inputs(), layout_for(L), f"runs: block_index top-k {half}/{nk}, L={L}")),
        (f"runs: odd length L={odd}", lambda: run_check(
            qz, *make_qkv(B, H, odd, D, dtype=dtype, device=device, seed=seed), layout_for(odd),
            f"runs: block_index, odd length L={odd}")),
        (f"runs: {heads}, Lq={L // 2} < Lk={L}", lambda: run_check(
            qz, *make_qkv(B, H, L // 2, D, kv_heads=kv, kv_len=L, dtype=dtype, device=device, seed=seed),
            layout_for(L // 2, L), f"runs: block_index, {heads}, Lq={L // 2}, Lk={L}")),
        ("memory", lambda: memory_check(qz, *inputs(), layout_for(L))),
        ("block_index validation", lambda: list(index_checks(L))),
        ("accuracy: dense", lambda: accuracy_check("correctness", f"accuracy: dense, L={L}", qz, *inputs(), None)),
        ("accuracy: random top-k", lambda: accuracy_check(
            "correctness", f"accuracy: block_index top-k {half}/{nk}, L={L}", qz, *inputs(), layout_for(L))),
        ("accuracy: outlier keys", lambda: accuracy_check(
            "correctness", f"accuracy: K offset + outlier channels, top-k {half}/{nk}, L={L}", qz,
            *inputs(outlier_keys=True), layout_for(L))),
    ]
    return [(label, (lambda fn=fn, label=label: _guard("correctness", label, fn))) for label, fn in runs]


def pattern_case(pattern: str, ratio: float, sizes: Sizes, *, seed: int = 0, device=None):
    """(block_index ``[B, H, Qb, top_k]``, its check name, its measured IndexStats) of ``pattern`` at
    top-k ``ratio`` and ``sizes.seq_len``. The name states what the index really keeps."""
    L = sizes.seq_len
    nk = block_grid(L)[1]
    bi = pattern_block_index(pattern, sizes.batch, sizes.heads, L, top_k_for(ratio, nk), seed=seed, device=device)
    stats = index_stats(bi, nk)
    return bi, f"{pattern}, L={L}, top-k {ratio:g}: {stats.label(nk)}", stats


def pattern_steps(qz: Quant, sizes: Sizes, ratios=TOP_K_RATIOS, *, dtype, device, seed: int = 0,
                  names=PATTERNS) -> list[tuple[str, Callable]]:
    """Accuracy of each pattern in ``names`` at each top-k ratio (B x H x L x D of ``sizes``)."""
    from .patterns import from_block_index
    B, H, L, D = sizes.batch, sizes.heads, sizes.seq_len, sizes.head_dim
    nk = block_grid(L)[1]

    def one(pattern, ratio):
        bi, name, stats = pattern_case(pattern, ratio, sizes, seed=seed, device=device)
        layout = from_block_index(bi, seq_len=L)
        q, k, v = make_qkv(B, H, L, D, dtype=dtype, device=device, seed=seed)
        return accuracy_check("patterns", name, qz, q, k, v, layout, pattern=pattern, ratio=ratio, seq_len=L,
                              top_k=top_k_for(ratio, nk), k_blocks=nk, blocks_per_row_min=stats.min_per_row,
                              blocks_per_row_max=stats.max_per_row, kept=stats.kept, density=layout.density,
                              block_index_shape=list(bi.shape))
    steps = []
    for pattern in names:
        for ratio in ratios:
            label = f"{pattern}, L={L}, top-k {ratio:g}"
            steps.append((label, lambda p=pattern, r=ratio, label=label: _guard("patterns", label,
                                                                              lambda: one(p, r))))
    return steps


# ----------------------------------------------------------------------------- benchmark
def benchmark_steps(qz: Quant, sizes: Sizes, ratios=TOP_K_RATIOS, seq_lens=None, *, dtype, device,
                    seed: int = 0, reps: int | None = None) -> list[tuple[str, Callable[[], list[dict]]]]:
    """One step per length: the 8-bit attention dense and on random top-k block indices at every
    ratio (plus the bf16 attention on the same sparse layout). Each step returns one row per ratio.
    On CUDA the times are the GPU's (``time_cuda(hide_host=True)``: the host's issue time is kept out)
    and ``sparse_host_ms`` is the host's time to issue one 8-bit sparse call: at 1K-4K tokens it
    exceeded the GPU's, and eager calls there are bound by the host."""
    lens = tuple(seq_lens) if seq_lens else sizes.bench_lens
    return [(f"L={L}", (lambda L=L: benchmark_length(qz, sizes, L, ratios, dtype=dtype, device=device, seed=seed,
                                                     reps=reps))) for L in lens]


def benchmark_length(qz: Quant, sizes: Sizes, seq_len: int, ratios, *, dtype, device, seed: int = 0,
                     reps: int | None = None) -> list[dict]:
    import sparse_attn
    from .bench.flops import attention_flops, tflops
    from .bench.runner import describe_error
    from .bench.timing import host_issue_ms, peak_memory, time_fn
    from .patterns import dense, from_block_index
    B, H, D = sizes.bench_batch, sizes.bench_heads, sizes.head_dim
    device = torch.device(device)
    nk = block_grid(seq_len)[1]
    base = dict(seq_len=seq_len, batch=B, heads=H, head_dim=D, quant=qz.quant, granularity=qz.granularity)
    try:
        q, k, v = make_qkv(B, H, seq_len, D, dtype=dtype, device=device, seed=seed)
        dense_flops = attention_flops(dense(seq_len, block_q=BLOCK_Q, block_k=BLOCK_K), batch=B, heads=H, head_dim=D)

        def dense_fn():
            return qz.attention(q, k, v)
        dense_ms = time_fn(dense_fn, device, reps=reps, hide_host=True)
        dense_peak = peak_memory(dense_fn, device)
    except Exception as e:  # noqa: BLE001 - e.g. OOM at the longest length: recorded, not fatal
        return [dict(base, ratio=r, top_k=top_k_for(r, nk), error="dense: " + describe_error(e)) for r in ratios]
    rows = []
    for ratio in ratios:
        top_k = top_k_for(ratio, nk)
        row = dict(base, ratio=ratio, top_k=top_k, k_blocks=nk, dense_ms=dense_ms, dense_peak_bytes=dense_peak,
                   dense_tops=tflops(dense_flops, dense_ms))
        try:
            bi = random_block_index(B, H, seq_len, top_k, seed=seed, device=device)
            stats = index_stats(bi, nk)  # what the row's label prints: measured, not assumed
            row.update(blocks_per_row_min=stats.min_per_row, blocks_per_row_max=stats.max_per_row, kept=stats.kept)
            layout = from_block_index(bi, seq_len=seq_len)
            flops = attention_flops(layout, batch=B, heads=H, head_dim=D)

            def sparse_fn(layout=layout):
                return qz.attention(q, k, v, layout)
            row["sparse_ms"] = time_fn(sparse_fn, device, reps=reps, hide_host=True)
            row["sparse_host_ms"] = host_issue_ms(sparse_fn) if device.type == "cuda" else None
            row["sparse_peak_bytes"] = peak_memory(sparse_fn, device)
            row["bf16_sparse_ms"] = time_fn(lambda layout=layout: sparse_attn.attention(q, k, v, layout), device,
                                            reps=reps, hide_host=True)
            row.update(speedup=dense_ms / row["sparse_ms"], block_savings=1.0 - layout.density,
                       layout_bytes=layout.nbytes, sparse_tops=tflops(flops, row["sparse_ms"]),
                       speedup_vs_bf16=row["bf16_sparse_ms"] / row["sparse_ms"])
        except Exception as e:  # noqa: BLE001
            row["error"] = describe_error(e)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report files
def _f(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def status(check: Check) -> str:
    return "skipped" if check.passed is None else ("pass" if check.passed else "FAIL")


def tally(checks: list[Check]) -> str:
    counts = {s: sum(status(c) == s for c in checks) for s in ("pass", "FAIL", "skipped")}
    return f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped"


def checks_table(checks: list[Check]) -> list[str]:
    lines = ["| section | check | result | cosine | rel. L1 | detail |", "| --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        result = status(c) if c.passed is not False else "**FAIL**"
        lines.append(f"| {c.section} | {c.name} | {result} | {_f(c.cosine, '.5f')} | {_f(c.relative_l1, '.4f')} "
                     f"| {detail} |")
    return lines


def bench_top_k(row: dict) -> str:
    """The top-k cell of a benchmark row: the ratio asked for, then the blocks per row and the fraction
    kept as measured on its block index (``kept`` etc., see :func:`benchmark_length`)."""
    if "kept" not in row:  # the row failed before its index was built
        return f"{row['ratio']:g} ({row['top_k']})"
    blocks = per_row(row["blocks_per_row_min"], row["blocks_per_row_max"])
    return f"{row['ratio']:g} ({blocks}/{row['k_blocks']} per row, {row['kept']:.1%} kept)"


def bench_table(rows: list[dict], dtype: str = "bf16") -> list[str]:
    """Markdown rows; ``dtype``: the inputs' (``bf16`` / ``fp16``), which the 16-bit comparison ran in (the
    JSON keys say bf16 whatever it was: ``bf16_sparse_ms``, ``speedup_vs_bf16``)."""
    lines = ["| L | top-k | dense ms | sparse ms | speedup | blocks skipped | dense / sparse peak MiB | sparse TOPS "
             f"| {dtype} sparse ms | 8-bit vs {dtype} | sparse host ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    mib = 1 << 20
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['seq_len']} | {bench_top_k(r)} | error: {r['error']} ||||||||")
            continue
        peaks = ("-" if r.get("dense_peak_bytes") is None else
                 f"{r['dense_peak_bytes'] / mib:.0f} / {r['sparse_peak_bytes'] / mib:.0f}")
        lines.append(f"| {r['seq_len']} | {bench_top_k(r)} | {_f(r['dense_ms'], '.3f')} "
                     f"| {_f(r['sparse_ms'], '.3f')} | {_f(r['speedup'], '.2f')}x | {_f(r['block_savings'], '.1%')} "
                     f"| {peaks} | {_f(r['sparse_tops'], '.3g')} | {_f(r['bf16_sparse_ms'], '.3f')} "
                     f"| {_f(r['speedup_vs_bf16'], '.2f')}x | {_f(r.get('sparse_host_ms'), '.3f')} |")
    return lines


def write_json(path, header: dict, checks: list[Check], bench: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"header": header, "checks": [asdict(c) for c in checks], "benchmark": bench}
    path.write_text(dumps(payload, default=str))
    return path


def write_markdown(path, header: dict, checks: list[Check], bench: list[dict]) -> Path:
    path = Path(path)
    lines = ["# Sparse SageAttention test suite (sparse_attn 8-bit attention)", "",
             f"quant `{header['quant']}`, granularity `{header['granularity']}`, {header['dtype']} inputs, on "
             f"{header['gpu']} (torch {header['torch']}, triton {header['triton']}), sizes `{header['sizes']['name']}`, "
             f"{header['seconds']:.1f} s.", ""]
    if header.get("note"):
        lines += [f"**{header['note']}**", ""]
    lines += [f"Block indices in SageAttention's `[B, H, q_blocks, top_k]` format, q block {BLOCK_Q}, k block "
              f"{BLOCK_K}, via `patterns.from_block_index`. Accuracy: the 8-bit attention against the "
              f"{header['dtype']} attention on the same layout; pass when cosine >= {MIN_COSINE} and relative "
              f"L1 <= {MAX_L1}.", ""]
    if checks:
        lines += [f"## Checks: {tally(checks)}", ""] + checks_table(checks) + [""]
    if bench:
        s = header["sizes"]
        lines += ([f"## Benchmark: dense vs random top-k block indices (B={s['bench_batch']}, H={s['bench_heads']}, "
                  f"D={s['head_dim']}, forward)", "",
                  "dense and sparse ms: the 8-bit attention; speedup = dense / sparse; blocks skipped = 1 - "
                  "density (key/value blocks neither loaded nor computed); peak MiB: extra memory one call "
                  "allocates (CUDA); TOPS: effective, 4*B*H*D*64*128 per visited block; "
                  f"{header['dtype']} sparse ms: the {header['dtype']} attention on the same layout.", ""]
                  + bench_table(bench, header["dtype"]) + [""])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
