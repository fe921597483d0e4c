"""The predictor's sync-free packing (predict/pack.py) and pooling kernel (ops/block_pool).

layout_from_keep must give the same layout as the coordinate path it replaces
(``BlockLayout.from_block_mask(keep) & patterns.causal``), mark itself as its own causal cut, and
seed the same schedule that ``schedule._build`` derives from it; the Triton pooling kernel (run in
the interpreter on the CPU) must match its PyTorch twin.
"""
from __future__ import annotations

import os

import pytest
import torch

import sparse_attn
from sparse_attn import BlockLayout, LayoutError, patterns, viz
from sparse_attn.ops.block_pool import reference as pool_reference
from sparse_attn.ops.block_sparse.schedule import _build, schedule, schedule_key
from sparse_attn.predict.pack import layout_from_keep

GRIDS = [  # Lq, Lk, block_q, block_k
    (100, 100, 16, 16), (77, 130, 16, 32), (130, 50, 32, 16), (1, 1, 16, 16), (160, 160, 32, 32),
    (256, 200, 64, 16), (1, 300, 16, 64), (96, 64, 32, 32)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "Lq{}Lk{}_b{}x{}".format(*g))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_layout_from_keep_matches_coordinate_path_and_schedule(grid, causal):
    Lq, Lk, bq, bk = grid
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    g = torch.Generator().manual_seed(Lq * 7 + Lk)
    keep = torch.rand(2, 3, nq, nk, generator=g) < 0.4
    if causal:  # predictors always keep the diagonal block (pack relies on it for the masks tuple)
        qb = torch.arange(nq)
        d = sparse_attn.patterns._common.diagonal_block(qb, Lq, Lk, bq, bk)
        rows = (d >= 0) & (d < nk)
        keep[..., qb[rows], d[rows]] = True
    layout = layout_from_keep(keep, q_len=Lq, kv_len=Lk, block_q=bq, block_k=bk, causal=causal, schedule=True)
    packed = layout._derived[schedule_key(None)]
    layout.validate()
    assert layout._validated and layout.max_k == nk
    ref = BlockLayout.from_block_mask(keep, block_q=bq, block_k=bk, q_len=Lq, kv_len=Lk)
    if causal:
        ref = ref & patterns.causal(Lq, Lk, block_q=bq, block_k=bk)
        assert patterns.causal_cut(layout) is layout  # marked: attention(causal=True) runs it as it is
    assert torch.equal(viz.block_states(layout), viz.block_states(ref))
    assert torch.equal(layout.to_token_mask(), ref.to_token_mask())
    assert len(layout.masks) == len(ref.masks)
    seeded = schedule(layout)
    assert seeded is packed  # still the seeded one: the layout did not change, so no cache was dropped
    built = _build(layout, None, True)
    assert torch.equal(seeded.indices, built.indices) and torch.equal(seeded.mask_ids, built.mask_ids)
    assert torch.equal(seeded.n_full, built.n_full)
    has_full = built.n_full > 0
    assert torch.equal(seeded.full_start[has_full], built.full_start[has_full])
    assert not seeded.contiguous  # a claim the packer never makes (False is always safe)


def test_layout_from_keep_skips_schedule_on_cpu_by_default():
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    layout = layout_from_keep(keep, q_len=64, kv_len=64, block_q=16, block_k=16, causal=False)
    assert schedule_key(None) not in layout._derived
    assert layout.num_blocks == 16 and layout.masks == ()


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")
@pytest.mark.parametrize("case", [(1, 2, 100, 16, 16, torch.float32), (2, 3, 77, 24, 32, torch.float16),
                                  (1, 1, 130, 64, 48, torch.float32), (1, 2, 256, 128, 128, torch.bfloat16)],
                         ids=lambda c: "B{}H{}L{}D{}_b{}_{}".format(*c[:5], str(c[5])[6:]))
def test_block_pool_kernel_matches_reference(case):
    from sparse_attn.ops.block_pool.launch import block_pool
    B, H, L, D, block, dtype = case
    g = torch.Generator().manual_seed(L)
    x = (torch.randn(B, L, H, D, generator=g) * torch.rand(B, L, H, 1, generator=g)).to(dtype).transpose(1, 2)
    x[0, 0, 3] = 0  # a token of norm 0 adds nothing
    pooled, sim = block_pool(x, block)  # strided input, read in place
    want_pooled, want_sim = pool_reference.block_pool_sim(x, block, torch.float32)
    assert pooled.dtype == sim.dtype == torch.float32
    torch.testing.assert_close(pooled, want_pooled, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sim, want_sim, rtol=1e-5, atol=1e-6)


def test_predict_overhead_benchmark_runs_on_cpu(tmp_path):
    import importlib.util
    import json
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "predict_overhead.py"
    spec = importlib.util.spec_from_file_location("predict_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "po.json"
    assert mod.main(["--device", "cpu", "--lengths", "128", "--heads", "2", "--head-dim", "16", "--reps", "2",
                     "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["seq_len"], r["causal"]) for r in report["results"]] == [(128, True), (128, False)]
    row = report["results"][0]
    for key in ("meansim_ms", "attention_ms", "end_to_end_ms", "overhead_pct", "sparsity"):
        assert isinstance(row[key], float)
    assert row["host_reads"]["meansim"] == {}  # the predictor reads nothing back to the host


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_pool_kernel_cuda(dtype):
    from sparse_attn.ops.block_pool import block_pool_sim
    x = (torch.randn(2, 1000, 3, 128, device="cuda") * 3).to(dtype).transpose(1, 2)  # strided, tail block
    for block in (64, 128, 48):
        pooled, sim = block_pool_sim(x, block, torch.float32)
        want_pooled, want_sim = pool_reference.block_pool_sim(x, block, torch.float32)
        torch.testing.assert_close(pooled, want_pooled, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sim, want_sim, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_meansim_cuda_path_makes_no_host_sync():
    """A fresh prediction and everything the kernels derive from it run without reading the GPU back."""
    from sparse_attn import api
    from sparse_attn.accuracy import structured_qkv
    from sparse_attn.ops.block_sparse import layout_inputs
    from sparse_attn.predict import level_params, meansim
    q, k, _ = structured_qkv(1, 4, 2048, 64, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    for causal in (True, False):  # warm-up: kernel compile, the causal mask table's one copy
        meansim(q, k, causal=causal)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for causal in (True, False):
            layout = meansim(q, k, causal=causal, **level_params("high"))
            kernel_layout = api._kernel_layout(layout, causal, 2048, 2048, q.device)
            assert kernel_layout is layout
            layout_inputs(kernel_layout, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0.0 < layout.sparsity < 1.0


def test_layout_from_keep_checks_its_grid_against_the_lengths():
    # the result is marked validated, so a grid for other lengths reached the reference (an IndexError)
    with pytest.raises(LayoutError, match="keep has a 2 x 2 block grid; q_len=100, kv_len=100 .* need 7 x 7"):
        layout_from_keep(torch.ones(1, 1, 2, 2, dtype=torch.bool), q_len=100, kv_len=100, block_q=16, block_k=16,
                         causal=False)
    with pytest.raises(TypeError, match="keep must be a bool"):
        layout_from_keep(torch.ones(1, 1, 7, 7), q_len=100, kv_len=100, block_q=16, block_k=16, causal=False)
