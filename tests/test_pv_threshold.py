"""pv_threshold: the kernels drop a key tile whose probabilities are all negligible (SpargeAttn's
second stage). Interpreter tests (CPU) and API checks; the GPU speed/accuracy figures are in
benchmarks/results/pv-skip-h100.json (benchmarks/pv_skip_probe.py).

The construction: every query prefers the first half of the keys by a wide margin (scores ~+40
there, ~-40 in the second half), and the second half's values are NaN. A dropped tile never
touches its values, so with a threshold above e^-80 the output is attention over the first half
alone; with one below it the NaN values are multiplied in and the output is NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import BlockLayout, patterns, reference

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="runs the Triton kernel: in the interpreter (no GPU) or on CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _two_halves(L=128, D=32, H=2, dtype=torch.float32 if DEVICE == "cpu" else torch.float16):
    g = torch.Generator().manual_seed(3)
    u = torch.zeros(D)
    u[0] = 1.0
    q = torch.randn(1, H, L, D, generator=g) * 0.1 + u * 8.0
    k = torch.randn(1, H, L, D, generator=g) * 0.1
    shift = u * 40.0 * D ** 0.5 / 8.0  # q . shift / sqrt(D) = 40: scaled scores ~ +40 / -40
    k[:, :, : L // 2] += shift
    k[:, :, L // 2:] -= shift
    v = torch.randn(1, H, L, D, generator=g)
    v[:, :, L // 2:] = float("nan")
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


@interpreter
def test_negligible_tiles_are_dropped_and_others_kept():
    from sparse_attn.ops.block_sparse import attention_op
    q, k, v = _two_halves()
    L = q.shape[2]
    dense = patterns.dense(L, L, block_q=16, block_k=16).to(DEVICE)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    gap = (scores[..., : L // 2].min() - scores[..., L // 2:].max()).item()
    assert gap > 60  # every second-half probability is below e^-60 of its row's max
    out, lse = attention_op(q, k, v, dense, pv_threshold=1e-12, return_lse=True)
    first = BlockLayout.from_block_mask(torch.arange(L // 16)[None, :].expand(L // 16, -1) < L // 32,
                                        block_q=16, block_k=16, q_len=L, kv_len=L).to(DEVICE)
    want, want_lse = reference.attention(q.float(), k.float(), v.float().nan_to_num(), first, return_lse=True)
    assert torch.isfinite(out).all()
    tol = 1e-4 if q.dtype == torch.float32 else 3e-3  # fp16 on the GPU: its rounding of P and the output
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    kept = attention_op(q, k, v, dense, pv_threshold=1e-40)   # below e^-80: nothing is negligible
    assert torch.isnan(kept).all(dim=-1).any()


@interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_a_threshold_no_tile_reaches_changes_nothing(causal):
    from sparse_attn.ops.block_sparse import attention_op
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 80, 32, generator=g).to(DEVICE, torch.float16) for _ in range(3))
    layout = (patterns.causal(80, 80, block_q=16, block_k=16) if causal
              else patterns.dense(80, 80, block_q=16, block_k=16)).to(DEVICE)
    plain = attention_op(q, k, v, layout)
    skip = attention_op(q, k, v, layout, pv_threshold=1e-30)  # random scores are within e^-20 of the max
    assert torch.equal(plain, skip)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, True, "1e-3", float("nan")])
def test_bad_threshold_is_refused(value):
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="pv_threshold must be a number in"):
        sparse_attn.attention(q, q, q, pv_threshold=value)


def test_numpy_thresholds_are_numbers():
    """A numpy float32 threshold was refused as 'must be a number in (0, 1)' (only Python floats passed), unlike
    scale= and the block sizes, which take numpy scalars; it now reaches the next check (the kernels' device)."""
    import numpy as np
    q = torch.randn(1, 1, 16, 16)
    for value in (np.float32(1e-3), np.float64(1e-3)):
        if torch.cuda.is_available():
            q = q.cuda().half()
            assert torch.equal(sparse_attn.attention(q, q, q, pv_threshold=value),
                               sparse_attn.attention(q, q, q, pv_threshold=float(value)))
        else:
            with pytest.raises(ValueError, match="inside the CUDA kernels"):
                sparse_attn.attention(q, q, q, pv_threshold=value)
    with pytest.raises(ValueError, match="pv_threshold must be a number in"):
        sparse_attn.attention(q, q, q, pv_threshold=np.float32(1.5))


def test_threshold_needs_the_kernels_no_grad_and_no_quant():
    q = torch.randn(1, 1, 16, 16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="inside the CUDA kernels"):
            sparse_attn.attention(q, q, q, pv_threshold=1e-3)
        return
    q = q.cuda().half()
    with pytest.raises(ValueError, match="drop quant="):
        sparse_attn.attention(q, q, q, pv_threshold=1e-3, quant="int8")
    with pytest.raises(ValueError, match="for inference"):
        sparse_attn.attention(q.requires_grad_(), q, q, pv_threshold=1e-3)
