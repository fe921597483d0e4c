"""The randomized cross-checks of tests/gpu/test_fuzz_gpu.py, small, on the Triton kernels under the
interpreter (CI): seeded configurations from sparse_attn.fuzz_cases (every pattern builder, unions /
intersections, broadcast layouts, GQA / MQA, odd and unequal lengths up to 96, d 16 / 32, blocks
16 / 32, fp16, custom scales, ``causal=True`` on a layout, x10 inputs), forward, LSE and backward
against the reference (DESIGN.md rule 3). The GPU bug these would have caught: NaN in dQ for rows
whose LSE is below -88 (benchmarks/NOTES.md, randomized cross-checks)."""
from __future__ import annotations

import os
import re

import pytest

import sparse_attn
from sparse_attn.fuzz_cases import INTERPRETER, NAMES, check_forward_backward, draw_case

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


# 0-11 drew 6 of the 11 builders and no batch-varying layout; 12-14, 21, 31 and 32 add the others
SEEDS = (*range(15), 21, 31, 32)


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_forward_backward_interpreted(seed, one_thread):
    check_forward_backward(draw_case(seed, INTERPRETER), "cpu", seed=seed, attention=_kernels)


def test_the_seeds_draw_what_the_docstring_lists():
    """Every builder (alone or in a union / intersection), both compositions, batch- and head-varying and
    broadcast layouts, GQA and MQA, unequal, odd and partial-block lengths, both head dims and blocks,
    a custom scale, causal on a layout, x10 inputs."""
    cases = [draw_case(seed, INTERPRETER) for seed in SEEDS]
    drawn = {name for c in cases for name in re.split(r"[|&]", c["name"])}
    assert drawn == set(NAMES), f"builders no seed draws: {sorted(set(NAMES) - drawn)}"
    want = {
        "union": lambda c: "|" in c["name"], "intersection": lambda c: "&" in c["name"],
        "batch-varying layout": lambda c: c["layout"].batch > 1, "head-varying layout": lambda c: c["layout"].heads > 1,
        "batch-broadcast layout": lambda c: c["layout"].batch == 1 < c["B"],
        "head-broadcast layout": lambda c: c["layout"].heads == 1 < c["hq"],
        "GQA": lambda c: c["hq"] > c["hkv"] > 1, "MQA": lambda c: c["hkv"] == 1 < c["hq"],
        "Lq < Lk": lambda c: c["lq"] < c["lk"], "Lq > Lk": lambda c: c["lq"] > c["lk"], "odd Lq": lambda c: c["lq"] % 2,
        "partial blocks": lambda c: c["lq"] % c["bq"] or c["lk"] % c["bk"], "d 16": lambda c: c["d"] == 16,
        "d 32": lambda c: c["d"] == 32, "block 16": lambda c: 16 in (c["bq"], c["bk"]),
        "block 32": lambda c: 32 in (c["bq"], c["bk"]), "custom scale": lambda c: c["scale"] is not None,
        "causal": lambda c: c["causal"], "x10 inputs": lambda c: c["in_scale"] == 10.0,
    }
    missing = [what for what, has in want.items() if not any(has(c) for c in cases)]
    assert not missing, f"no seed draws: {missing}"


def _lse_shifted(shift):
    """The CPU reference (sparse_attn.attention) with ``shift`` added to its LSE (-inf rows stay -inf)."""
    def run(q, k, v, layout, **kw):
        out, lse = sparse_attn.attention(q, k, v, layout, **kw)
        return out, lse + shift
    return run


@pytest.mark.parametrize("seed,shift", [(0, 0.005), (4, 0.5)])
def test_a_wrong_lse_fails_the_check(seed, shift):
    """The LSE bound was 2e-2 absolute, 2.0 at x10 inputs (seed 4): an LSE off by 0.5 there passed."""
    case = draw_case(seed, INTERPRETER)
    check_forward_backward(case, "cpu", seed=seed, attention=_lse_shifted(0.0))
    with pytest.raises(AssertionError, match="lse: error"):
        check_forward_backward(case, "cpu", seed=seed, attention=_lse_shifted(shift))
