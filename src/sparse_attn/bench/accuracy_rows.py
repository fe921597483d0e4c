"""Optional accuracy rows for a benchmark suite: how far each sparse pattern is from dense.

For every pattern of a suite, at its smallest (or largest) sequence length (first Hkv, the case's B/H/D),
``sparse_attn.attention(q, k, v, layout, causal=...)`` is compared with dense attention computed
by the fp32 reference (``reference.attention(..., layout=None)``), causal-dense for a causal
pattern: the same baseline the benchmark's dense SDPA rows time. Inputs are ``torch.randn``
(seed 0) in fp32, so on the CPU this is the reference path at small sizes.

Each row is a plain dict (JSON-ready)::

    {pattern, seq_len, batch, heads, kv_heads, head_dim, causal, density, sparsity,
     cosine, relative_l1, error}

``density`` is the visited-block fraction of :func:`~sparse_attn.bench.flops.block_density`
(causal-aware, the same number as the bench rows) and ``sparsity = 1 - density``; ``error`` is
None or why the row failed. This does not touch the timing runner: call it next to it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..json_io import dumps
from .suites import Suite


def accuracy_rows(suite: Suite, device="cpu", *, at: str = "smallest", max_seq_len: int | None = None,
                  seed: int = 0) -> list[dict]:
    """One accuracy dict per distinct pattern name of ``suite`` (see the module docstring).

    ``at``: "smallest" (default) or "largest" of each case's lengths (at the small suite's
    L=256 a 256-token window is the whole causal row, so "largest" is more telling there);
    ``max_seq_len`` caps the length used."""
    if at not in ("smallest", "largest"):
        raise ValueError(f"at must be 'smallest' or 'largest', got {at!r}")
    import sparse_attn
    from sparse_attn import reference
    from sparse_attn.metrics import cosine_similarity, relative_l1

    from .flops import block_density

    device = torch.device(device)
    out: list[dict] = []
    seen: set[str] = set()
    for case in suite.cases:
        pat = case.pattern
        if pat.name in seen:
            continue
        seen.add(pat.name)
        L = min(case.seq_lens) if at == "smallest" else max(case.seq_lens)
        if max_seq_len is not None:
            L = min(L, max_seq_len)
        hkv = case.kv_heads[0]
        row = {"pattern": pat.name, "seq_len": L, "batch": case.batch, "heads": case.heads, "kv_heads": hkv,
               "head_dim": case.head_dim, "causal": pat.causal, "density": None, "sparsity": None,
               "cosine": None, "relative_l1": None, "error": None}
        try:
            layout = pat.build(L, heads=case.heads, block_q=case.block_q, block_k=case.block_k, device=device)
            row["density"] = block_density(layout, batch=case.batch, heads=case.heads, causal=pat.causal)
            row["sparsity"] = 1.0 - row["density"]
            g = torch.Generator(device=device).manual_seed(seed)

            q, k, v = (torch.randn(case.batch, h, L, case.head_dim, generator=g, device=device,
                                   dtype=torch.float32) for h in (case.heads, hkv, hkv))
            with torch.no_grad():
                got = sparse_attn.attention(q, k, v, layout, causal=pat.causal)
                ref = reference.attention(q, k, v, None, causal=pat.causal)
            row["cosine"] = cosine_similarity(got, ref)
            row["relative_l1"] = relative_l1(got, ref)
        except Exception as e:  # noqa: BLE001 - one pattern's failure must not stop the others
            from .runner import describe_error
            row["error"] = describe_error(e)
        out.append(row)
    return out


def write_accuracy_json(path, header: dict, rows: list[dict]) -> Path:
    """``{"header": header, "accuracy": rows}``; :func:`sparse_attn.report.load_results` reads it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps({"header": header, "accuracy": rows}))
    return path


__all__ = ["accuracy_rows", "write_accuracy_json"]
