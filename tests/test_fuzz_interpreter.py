"""The randomized cross-checks of tests/gpu/test_fuzz_gpu.py, small, on the Triton kernels under the
interpreter (CI): seeded configurations from sparse_attn.fuzz_cases (every pattern builder, unions /
intersections, broadcast layouts, GQA / MQA, odd and unequal lengths up to 96, d 16 / 32, blocks
16 / 32, fp16, custom scales, ``causal=True`` on a layout, x10 inputs), forward, LSE and backward
against the reference (DESIGN.md rule 3). The GPU bug these would have caught: NaN in dQ for rows
whose LSE is below -88 (benchmarks/NOTES.md, randomized cross-checks)."""
from __future__ import annotations

import os

import pytest

from sparse_attn.fuzz_cases import INTERPRETER, check_forward_backward, draw_case

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]


def _kernels(q, k, v, layout, *, causal, scale, return_lse):
    """The Triton kernels themselves (on the CPU, sparse_attn.attention runs the reference)."""
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.block_sparse import attention_op
    return attention_op(q, k, v, _kernel_layout(layout, causal, q.shape[2], k.shape[2], q.device), scale=scale,
                        return_lse=return_lse)


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_forward_backward_interpreted(seed, one_thread):
    check_forward_backward(draw_case(seed, INTERPRETER), "cpu", seed=seed, attention=_kernels)
