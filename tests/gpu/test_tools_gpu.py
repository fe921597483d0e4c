"""GPU checks of tools and compile behaviour that the CPU tests cannot see: the torch-sparse benchmark
provider on CUDA, and torch.compile of the host-planned entry points (graph breaks, documented)."""
from __future__ import annotations

import warnings

import pytest
import torch

import sparse_attn
from sparse_attn import Group, patterns, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def test_torch_sparse_provider_on_cuda_fp32_and_a_clear_bf16_error():
    from sparse_attn.bench import get_provider
    provider = get_provider("torch-sparse")
    ok, why = provider.available(DEV)
    assert ok and "fp32 / fp64 only" in why
    layout = patterns.local(1000, 256, block_q=128, block_k=64, device=DEV)
    q, k, v = (torch.randn(1, h, 1000, 64, device=DEV) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = provider.build(q, k, v, layout, True)()
    want = reference.attention(q.double(), k.double(), v.double(), layout, causal=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no torch.bfloat16 CUDA kernel"):
        provider.build(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, True)


def test_grouped_and_varlen_compile_with_graph_breaks_on_cuda():
    """Their docstrings: graph breaks under torch.compile on CUDA (fullgraph=False equals eager)."""
    q, k, v = (torch.randn(160, 4, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    groups = [Group(0, 60, 0, 100), Group(60, 160, 40, 160)]
    cu = torch.tensor([0, 50, 160], dtype=torch.int32, device=DEV)

    def grouped(q, k, v):
        return sparse_attn.grouped_attention(q, k, v, groups, causal=True) * 2

    def varlen(q, k, v):
        return sparse_attn.varlen_attention(q, k, v, cu, cu, 110, 110, causal=True) * 2

    for fn in (grouped, varlen):
        torch.testing.assert_close(torch.compile(fn)(q, k, v), fn(q, k, v), rtol=0, atol=0)
