"""The adaptive predictor's rank-select-pack kernel (ops/block_select) against its PyTorch twin.

Both branches of ``predict.meansim.rank_and_pack`` run from the same pooled statistics, so every
difference is the kernel's: the kept blocks, their packed order, the causal mask ids and the seeded
schedule must all be equal. The one place they may differ is a row whose CDF mass lands within
rounding of its threshold (the kernel's scan and torch's cumsum add in different orders): about 1
row in 10^4 at 32K on the GPU (benchmarks/NOTES.md); these small fixed-seed cases have none.
"""
from __future__ import annotations

import os

import pytest
import torch

from sparse_attn import viz
from sparse_attn.accuracy import structured_qkv
from sparse_attn.ops.block_pool import block_pool_sim
from sparse_attn.ops.block_sparse.schedule import _build, schedule
from sparse_attn.predict.meansim import _per_head, rank_and_pack

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="runs the Triton kernel: in the interpreter (no GPU) or on CUDA")

CASES = [  # B, Hq, Hkv, Lq, Lk, block_q, block_k
    (1, 2, 2, 256, 256, 16, 16), (2, 4, 2, 200, 333, 32, 16), (1, 2, 1, 333, 150, 16, 32),
    (1, 2, 1, 64, 1000, 32, 64), (1, 2, 2, 17, 17, 16, 16)]
RULES = {  # (simthreshd1, cdfthreshd, topk, attention_sink); lists: per-head values, cycled over the heads
    "cdf0.9": (0.6, 0.9, None, False), "cdf0.5-sink": (0.5, 0.5, None, True), "topk0.3": (0.6, None, 0.3, False),
    "cdf1": (0.6, 1.0, None, False), "per-head": ([0.2, 0.9], [0.7, 0.95], None, False),
    "topk-per-head": (0.4, None, [0.1, 0.6], True)}


def _both(case, rule, causal, device, nan_sims=False):
    B, Hq, Hkv, Lq, Lk, bq, bk = case
    sim, cdf, topk, sink = ((v * Hq)[:Hq] if isinstance(v, list) else v for v in RULES[rule])  # per head: cycled
    q, k, _ = structured_qkv(B, Hq, max(Lq, Lk), 32, kv_heads=Hkv, dtype=torch.float32, device=device)
    q, k = q[:, :, :Lq], k[:, :, :Lk]
    mq, sq = block_pool_sim(q, bq, torch.float32)
    mk, sk = block_pool_sim(k, bk, torch.float32)
    raw = torch.einsum("bhgqd,bhkd->bhgqk", mq.view(B, Hkv, Hq // Hkv, mq.shape[2], 32), mk)
    raw = raw.reshape(B, Hq, mq.shape[2], mk.shape[2])
    if nan_sims:  # what an inf token makes of its block's similarity (its fp32 norms overflow)
        sq[:, :, 1], sk[:, :, -1] = float("nan"), float("nan")
    sim_t = _per_head("simthreshd1", sim, Hq, device, torch.float32)
    cdf_t = None if cdf is None else _per_head("cdfthreshd", cdf, Hq, device, torch.float32, 0.0, 1.0)
    topk_t = None if topk is None else _per_head("topk", topk, Hq, device, torch.float32, 0.0, 1.0)
    kw = dict(q_len=Lq, kv_len=Lk, block_q=bq, block_k=bk, scale=32 ** -0.5, causal=causal, sink=sink)
    kernel = rank_and_pack(raw, sq, sk, sim_t, cdf_t, topk_t, kernel=True, **kw)
    twin = rank_and_pack(raw.cpu(), sq.cpu(), sk.cpu(), sim_t.cpu(), None if cdf_t is None else cdf_t.cpu(),
                         None if topk_t is None else topk_t.cpu(), kernel=False, **kw)
    return kernel, twin


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}x{}_Lq{}Lk{}_b{}x{}".format(*c))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_select_pack_kernel_equals_twin(case, rule, causal):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, twin = _both(case, rule, causal, device)
    kernel = kernel.to("cpu")
    assert torch.equal(viz.block_states(kernel), viz.block_states(twin))
    assert torch.equal(kernel.kv_counts, twin.kv_counts)
    assert torch.equal(kernel.kv_indices, twin.kv_indices)
    assert torch.equal(kernel.kv_mask_ids, twin.kv_mask_ids)
    assert kernel.masks == twin.masks
    built = _build(twin, None, True)
    assert torch.equal(schedule(kernel).n_full.cpu(), built.n_full)
    if rule != "cdf1" and twin.max_k >= 8:  # rows long enough that the rule prunes: the case tests ranking
        assert 0.0 < twin.sparsity < 1.0


@pytest.mark.parametrize("rule", ["cdf0.9", "topk0.3"])
def test_select_pack_nan_similarity_keeps_blocks_as_the_twin(rule):
    # a NaN self-similarity is not ">= threshold": the twin keeps the query block's whole row and the
    # key block's column; the kernel once read it as self-similar and pruned the row
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernel, twin = _both((2, 4, 2, 200, 333, 32, 16), rule, False, device, nan_sims=True)
    states = viz.block_states(twin)
    assert bool((states[:, :, 1] > 0).all()) and bool((states[..., -1] > 0).all())
    assert torch.equal(viz.block_states(kernel.to("cpu")), states)
    assert torch.equal(kernel.kv_indices.cpu(), twin.kv_indices)


def test_select_pack_rejects_rows_longer_than_it_ranks():
    from sparse_attn.ops.block_select import MAX_KEY_BLOCKS, fits, select_pack
    assert fits(MAX_KEY_BLOCKS) and not fits(MAX_KEY_BLOCKS + 1) and not fits(0)
    z = torch.zeros(1, 1, 1, MAX_KEY_BLOCKS + 1)
    with pytest.raises(ValueError, match="key blocks"):
        select_pack(z, z[..., 0], z[0], torch.ones(1), torch.ones(1), topk=False, q_len=16, kv_len=16, block_q=16,
                    block_k=16, scale=1.0, causal=False, sink=False, has_mask=False)


@pytest.mark.parametrize("grid", [(200, 333, 32, 16), (256, 256, 64, 16), (333, 150, 16, 32)],
                         ids=lambda g: "Lq{}Lk{}_b{}x{}".format(*g))
def test_select_pack_causal_keeps_every_rows_own_key(grid):
    # rows of a query block that straddles key blocks (Lk - Lq not a multiple of block_k, or block_q >
    # block_k): the kernel forces only the block of the query block's last row, so the first rows kept
    # no key (output 0); the blocks holding the other rows' own keys are added after it, as the twin keeps them
    Lq, Lk, bq, bk = grid
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, 1, 32, generator=g)
    q = (base + 0.05 * torch.randn(1, 2, Lq, 32, generator=g)).to(device)
    k = (base * torch.linspace(0.5, 2.0, Lk)[:, None] + 0.05 * torch.randn(1, 2, Lk, 32, generator=g)).to(device)
    mq, sq = block_pool_sim(q, bq, torch.float32)
    mk, sk = block_pool_sim(k, bk, torch.float32)
    raw = mq @ mk.transpose(-1, -2)                 # later key blocks score higher: the diagonal's ranks first
    sim_t = _per_head("simthreshd1", 0.5, 2, device, torch.float32)
    cdf_t = _per_head("cdfthreshd", 0.5, 2, device, torch.float32, 0.0, 1.0)
    kw = dict(q_len=Lq, kv_len=Lk, block_q=bq, block_k=bk, scale=32 ** -0.5, causal=True, sink=False)
    layout = rank_and_pack(raw, sq, sk, sim_t, cdf_t, None, kernel=True, **kw).to("cpu")
    tok = layout.to_token_mask()
    rows = torch.arange(Lq)
    pos = rows + Lk - Lq
    sees = pos >= 0
    assert layout.sparsity > 0.3 and bool(tok[:, :, rows[sees], pos[sees]].all())
    assert torch.equal(schedule(layout).n_full, _build(layout, None, True).n_full)


@pytest.mark.parametrize("rule", ["cdf0.9", "topk0.3"])
def test_select_pack_nan_token_with_every_block_self_similar(rule):
    # simthreshd1 <= 0 took a NaN token's block as self-similar (its sim read 0): its NaN pooled scores
    # reached the ranking, where the twin kept one block of each row and the kernel every block
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, _ = structured_qkv(1, 2, 256, 32, dtype=torch.float32, device=device)
    q[0, 0, 40, 3], k[0, 1, 200, 5] = float("nan"), float("nan")
    mq, sq = block_pool_sim(q, 32, torch.float32)
    mk, sk = block_pool_sim(k, 32, torch.float32)
    raw = mq @ mk.transpose(-1, -2)
    thr = [_per_head(*a) for a in (("simthreshd1", -1.0, 2, device, torch.float32),
                                   ("t", RULES[rule][1] or RULES[rule][2], 2, device, torch.float32, 0.0, 1.0))]
    cdf_t, topk_t = (thr[1], None) if rule == "cdf0.9" else (None, thr[1])
    kw = dict(q_len=256, kv_len=256, block_q=32, block_k=32, scale=32 ** -0.5, causal=False, sink=False)
    kernel = rank_and_pack(raw, sq, sk, thr[0], cdf_t, topk_t, kernel=True, **kw).to("cpu")
    twin = rank_and_pack(raw.cpu(), sq.cpu(), sk.cpu(), thr[0].cpu(), None if cdf_t is None else cdf_t.cpu(),
                         None if topk_t is None else topk_t.cpu(), kernel=False, **kw)
    states = viz.block_states(twin)
    assert bool((states[0, 0, 1] > 0).all()) and bool((states[0, 1, :, 6] > 0).all())  # row / column kept
    assert 0.0 < twin.sparsity < 1.0
    assert torch.equal(viz.block_states(kernel), states)
