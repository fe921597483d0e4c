"""The one-launch grouped kernel path (``sparse_attn.grouped``: stacked per-group layouts, (start, end)
bound pairs, dK/dV scratch) under TRITON_INTERPRET=1 on the CPU, forward and backward, against a
per-group reference loop (DESIGN.md rule 3: the kernel's error against the fp64 oracle may be at most
2x the same-dtype reference's). Plus the plan itself (no kernel needed). fp16 and fp32 only: the
interpreter's bf16 dot is broken (bf16 runs in tests/gpu/test_grouped_gpu.py)."""
from __future__ import annotations

import os
import random

import pytest
import torch

import sparse_attn
from sparse_attn import Group, grouped, patterns, reference
from sparse_attn.grouped import grouped_plan, groups_from_cu_seqlens
from sparse_attn.layout import LayoutError
from sparse_attn.testing import assert_close_to_oracle, assert_grads_close_to_oracle, random_packed_qkv

_no_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                     reason="interpreter tests run only without a GPU")


def interpreted(fn):
    """A test that runs the kernels under the Triton interpreter (CPU tensors on the kernel path)."""
    return pytest.mark.interpreter(_no_interpreter(pytest.mark.usefixtures("kernels")(fn)))


@pytest.fixture
def kernels(monkeypatch, one_thread):
    """CPU tensors take the kernel path (the Triton interpreter), on one intra-op thread (conftest);
    the loop prototype must not run."""
    monkeypatch.setattr(grouped, "FORCE_KERNELS", True)

    def no_loop(*a, **kw):
        raise AssertionError("the kernel path fell back to grouped_attention_loop")
    monkeypatch.setattr(grouped, "grouped_attention_loop", no_loop)


def _qkv(tq, tk, hq, hkv, d=16, dtype=torch.float16, seed=0, grad=True):
    return random_packed_qkv(tq, tk, hq, hkv, d, seed=seed, dtype=dtype, requires_grad=grad)


def _ref(q, k, v, groups, causal, layouts, lowp):
    """One reference call per group (fp32 math, or the same-dtype ``_lowp`` twin), assembled out of
    place so autograd reaches q, k, v; zero / -inf for query rows in no group."""
    tq, hq = q.shape[:2]
    out = torch.zeros(tq, hq, v.shape[-1], dtype=q.dtype) + (q[:0].sum() + k[:0].sum() + v[:0].sum()).to(q.dtype)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64)
    for i, g in enumerate(groups):
        if g.q_len == 0 or g.k_len == 0:
            continue
        lay = None if layouts is None else layouts[i]
        o, l_ = reference.attention(q[g.q_start:g.q_end].transpose(0, 1)[None], k[g.k_start:g.k_end].transpose(0, 1)[None],
                                    v[g.k_start:g.k_end].transpose(0, 1)[None], lay, causal=causal, return_lse=True,
                                    _lowp=lowp)
        rows = torch.arange(g.q_start, g.q_end)
        out = out.index_copy(0, rows, o[0].transpose(0, 1).to(q.dtype))
        lse[:, g.q_start:g.q_end] = l_[0].double()
    return out, lse


def _free(groups, tq):
    free = torch.ones(tq, dtype=torch.bool)
    for g in groups:
        if g.k_len > 0:
            free[g.q_start:g.q_end] = False
    return free


def _check(q, k, v, groups, *, causal=True, pattern=None, layouts=None, bwd=True):
    out, lse = sparse_attn.grouped_attention(q, k, v, groups, causal=causal, pattern=pattern, layouts=layouts,
                                             return_lse=True)
    if pattern is not None:
        layouts = [pattern(g.q_len, g.k_len) if g.q_len and g.k_len else None for g in groups]
    oracle = [t.detach().double().requires_grad_(bwd) for t in (q, k, v)]
    lowp = [t.detach().clone().requires_grad_(bwd) for t in (q, k, v)]
    o_or, lse_or = _ref(*oracle, groups, causal, layouts, lowp=False)
    o_lp, _ = _ref(*lowp, groups, causal, layouts, lowp=True)
    assert out.shape == o_or.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert_close_to_oracle(out, o_lp, o_or, name="out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_or)) and not torch.isnan(lse).any()
    fin = torch.isfinite(lse_or)
    if fin.any():  # (no row may see a key)
        assert (lse[fin].double() - lse_or[fin]).abs().max() < 1e-2
    free = _free(groups, q.shape[0])
    assert torch.equal(out[free], torch.zeros_like(out[free]))  # never written by the kernel: filled
    if bwd:
        assert_grads_close_to_oracle((out, o_lp, o_or), torch.randn_like(out), (q, k, v), lowp, oracle)
        assert torch.equal(q.grad[free], torch.zeros_like(q.grad[free]))  # dQ rows in no group: exactly 0
    return out, lse


# ----------------------------------------------------------------------------- kernel path (interpreter)
@interpreted
def test_groups_overlap_gqa_single_token_empty_and_gaps():
    """GQA 4/2; three running groups with different K/V lengths, overlapping K/V; a single-token group;
    a group with q_len 0 and one with k_len 0 (its queries: output 0, LSE -inf, dq 0); uncovered rows."""
    groups = [Group(0, 40, 0, 70), Group(45, 46, 10, 11), Group(50, 110, 30, 100), Group(110, 110, 0, 5),
              Group(110, 118, 4, 4)]
    q, k, v = _qkv(120, 100, 4, 2, seed=1)
    _, lse = _check(q, k, v, groups, causal=True)
    assert torch.isneginf(lse[:, 110:]).all() and torch.isneginf(lse[:, 40:45]).all()
    assert torch.isfinite(lse[:, :40]).all()  # causal, q_len 40 < k_len 70: every row sees a key
    # K rows 0..10 come from group 0 only, 30..70 from groups 0 and 2, 70..100 from group 2 only
    assert k.grad[:100].abs().sum(-1).min() > 0


@interpreted
@pytest.mark.parametrize("causal", [True, False])
def test_four_varlen_groups_tiling_kv_write_dk_in_place(causal):
    """Consecutive groups whose K/V slices tile k exactly: no scratch buffer (dK/dV written in place).
    Causal with q_len > k_len: leading rows see no key."""
    q_lens, k_lens = [33, 1, 20, 50], [20, 17, 64, 30]
    cq = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    groups = groups_from_cu_seqlens(cq, ck)
    q, k, v = _qkv(sum(q_lens), sum(k_lens), 2, 1, seed=2)
    assert grouped_plan(groups, q.shape[0], k.shape[0], causal=causal, heads=2).dk_rows is None
    _, lse = _check(q, k, v, groups, causal=causal)
    if causal:
        assert torch.isneginf(lse[:, :13]).all() and torch.isfinite(lse[:, 13:33]).all()


@interpreted
def test_zigzag_prefixes_with_a_window_pattern_fp32():
    """A zigzag-llama3 rank (chunks 0 and 3 of 4, each attending the K/V prefix ending at its chunk)
    with a 16x16-block sliding-window pattern, fp32; the result equals full causal windowed attention."""
    chunk = 24
    q, k, v = _qkv(2 * chunk, 4 * chunk, 2, 2, dtype=torch.float32, seed=3)
    groups = [Group(0, chunk, 0, chunk), Group(chunk, 2 * chunk, 0, 4 * chunk)]
    pattern = lambda lq, lk: patterns.local(lq, 20, kv_len=lk, block_q=16, block_k=16)  # noqa: E731
    out, _ = _check(q, k, v, groups, causal=True, pattern=pattern)
    full_q = torch.zeros(4 * chunk, 2, 16)
    full_q[:chunk], full_q[3 * chunk:] = q[:chunk].detach(), q[chunk:].detach()
    full = reference.attention(full_q.transpose(0, 1)[None], k.detach().transpose(0, 1)[None],
                               v.detach().transpose(0, 1)[None], pattern(4 * chunk, 4 * chunk),
                               causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(out.detach(), torch.cat([full[:chunk], full[3 * chunk:]]), rtol=1e-4, atol=1e-4)


@interpreted
def test_long_groups_d32_explicit_layouts():
    """A 300-token group and a 120-token one on shared K/V (D 32), explicit per-group layouts; forward
    (the backward of long groups runs on the GPU)."""
    groups = [Group(0, 300, 0, 300), Group(300, 420, 100, 300)]
    q, k, v = _qkv(420, 300, 1, 1, d=32, seed=4, grad=False)
    layouts = [patterns.causal(300, block_q=64, block_k=64), patterns.dense(120, 200, block_q=64, block_k=64)]
    _check(q, k, v, groups, causal=False, layouts=layouts, bwd=False)


def _random_groups(rng: random.Random, tk: int) -> tuple[list[Group], int]:
    """1-4 groups: query slices in order with random gaps (some empty), K/V slices anywhere in [0, tk)
    (overlapping, some empty). Returns (groups, tq)."""
    groups, q0 = [], rng.choice((0, 0, 3))
    for _ in range(rng.randint(1, 4)):
        ql = rng.choice((0, 1, rng.randint(2, 40)))
        a = rng.randint(0, tk)
        b = a if rng.random() < 0.1 else rng.randint(a, tk)
        groups.append(Group(q0, q0 + ql, a, b))
        q0 += ql + rng.choice((0, 0, 2))
    return groups, q0 + rng.choice((0, 5))


@interpreted
@pytest.mark.parametrize("seed", range(8))
def test_fuzz_random_groups(seed):
    """Seeded random groups (sparse_attn.fuzz_cases builds the per-group patterns): GQA/MQA, d 16/32,
    causal or not, dense or one pattern family per call, fp16, forward and backward against rule 3."""
    from sparse_attn.fuzz_cases import NAMES, one_pattern
    rng = random.Random(30_000 + seed)
    tk = rng.randint(1, 90)
    groups, tq = _random_groups(rng, tk)
    hkv = rng.choice((1, 2))
    hq = hkv * rng.choice((1, 2))
    bq, bk = rng.choice((16, 32)), rng.choice((16, 32))
    name = rng.choice((None,) + tuple(n for n in NAMES if n != "bigbird"))
    pseed = rng.randint(0, 10**6)
    pattern = None if name is None else (lambda lq, lk: one_pattern(random.Random(pseed), name, lq, lk, bq, bk, 1, 1))
    q, k, v = _qkv(max(tq, 1), tk, hq, hkv, d=rng.choice((16, 32)), seed=seed)
    try:
        _check(q, k, v, groups, causal=rng.random() < 0.5, pattern=pattern)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: groups {groups}, tq {tq}, tk {tk}, hq {hq}, hkv {hkv}, pattern {name} "
                             f"blocks {bq}x{bk}\n{e}") from None


@interpreted
def test_single_group_equals_attention_op():
    from sparse_attn.api import _kernel_layout
    from sparse_attn.ops.block_sparse import attention_op
    q, k, v = _qkv(40, 50, 2, 1, seed=5, grad=False)
    for causal in (True, False):
        out, lse = sparse_attn.grouped_attention(q, k, v, [Group(0, 40, 0, 50)], causal=causal, return_lse=True)
        o, l_ = attention_op(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             _kernel_layout(None, causal, 40, 50, "cpu"), return_lse=True)
        torch.testing.assert_close(out, o[0].transpose(0, 1), rtol=0, atol=1e-3)
        torch.testing.assert_close(lse, l_[0], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- no kernel launch needed
@pytest.mark.usefixtures("kernels")
def test_no_group_with_queries_and_keys_gives_zeros_and_zero_grads():
    q, k, v = _qkv(10, 8, 2, 1)
    out, lse = sparse_attn.grouped_attention(q, k, v, [Group(0, 0, 0, 8), Group(2, 6, 3, 3)], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all() and lse.shape == (2, 10)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_plan_bounds_scratch_and_cache():
    groups = [Group(0, 5, 0, 40), Group(5, 5, 0, 9), Group(7, 20, 10, 30), Group(20, 22, 3, 3)]
    plan = grouped_plan(groups, 25, 40, causal=True, heads=4)
    assert plan.run == (0, 2)
    assert plan.cu_q.dtype == plan.cu_k.dtype == plan.cu_dk.dtype == torch.int32
    assert plan.cu_q.tolist() == [0, 5, 7, 20] and plan.cu_k.tolist() == [0, 40, 10, 30]
    assert plan.cu_dk.tolist() == [0, 40, 40, 60]
    assert plan.dk_rows.dtype == torch.int64
    assert plan.dk_rows.tolist() == list(range(40)) + list(range(10, 30))
    assert plan.free_rows.tolist() == [5, 6, 20, 21, 22, 23, 24]
    assert (plan.max_q, plan.max_k, plan.kv_lens) == (13, 40, (40, 20))
    assert plan.stacked.batch == 2 and (plan.stacked.q_len, plan.stacked.kv_len) == (13, 40)
    assert grouped_plan(list(groups), 25, 40, causal=True, heads=4) is plan  # cached per signature
    assert grouped_plan(groups, 25, 40, causal=False, heads=4) is not plan
    # heaviest group (most blocks visited) first in the launch
    imb = grouped_plan([Group(0, 10, 0, 10), Group(10, 300, 0, 300)], 300, 300, heads=1)
    assert imb.run == (1, 0) and imb.cu_q.tolist() == [10, 300, 0, 10] and imb.kv_lens == (300, 10)
    assert imb.cu_dk.tolist() == [0, 300, 300, 310] and imb.dk_rows.tolist() == list(range(300)) + list(range(10))
    # groups covering q, K/V slices tiling k: nothing to fill, no scratch
    tiled = grouped_plan([Group(0, 10, 20, 30), Group(10, 30, 0, 20)], 30, 30, heads=1)
    assert tiled.free_rows is None and tiled.cu_dk is None and tiled.dk_rows is None
    # a K/V gap (row 20..25 in no group) needs the scratch path, so those rows get dK = 0
    assert grouped_plan([Group(0, 10, 0, 20), Group(10, 30, 25, 30)], 30, 30, heads=1).dk_rows is not None


@pytest.mark.usefixtures("kernels")
def test_kernel_path_layout_errors():
    q, k, v = _qkv(20, 30, 2, 1, grad=False)
    groups = [Group(0, 10, 0, 30), Group(10, 20, 0, 15)]
    with pytest.raises(ValueError, match="either layouts= or pattern="):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=[None, None], pattern=patterns.dense)
    with pytest.raises(ValueError, match="got 1 layouts for 2 groups"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=[patterns.dense(10, 30)])
    with pytest.raises(LayoutError, match="layout 1 was built for q_len=10, kv_len=30"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=[patterns.dense(10, 30), patterns.dense(10, 30)])
    with pytest.raises(LayoutError, match="same block_q x block_k .* 16x16 and 32x16"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=[patterns.dense(10, 30, block_q=16, block_k=16),
                                                                patterns.dense(10, 15, block_q=32, block_k=16)])
    with pytest.raises(TypeError, match="one BlockLayout per group"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=patterns.dense(10, 30))


@interpreted
def test_kernel_path_lse_alone_backward_and_none_layouts():
    """The kernel path's twins of two CPU-loop checks (no launch happens in either): an LSE from a call
    where no group runs is in the graph, and None is refused for a group that runs."""
    q, k, v = _qkv(5, 4, 2, 2)
    out, lse = sparse_attn.grouped_attention(q, k, v, [Group(0, 5, 3, 3)], return_lse=True)
    torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))
    q, k, v = _qkv(40, 40, 2, 2)
    lay = patterns.local(20, 4, kv_len=20, block_q=16, block_k=16)
    with pytest.raises(TypeError, match=r"layouts\[1\] is None but group 1 has 20 query and 40 key tokens"):
        sparse_attn.grouped_attention(q, k, v, [Group(0, 20, 0, 20), Group(20, 40, 0, 40)], layouts=[lay, None])


@interpreted
def test_split_grid_gives_the_usual_grids_results_bit_for_bit(monkeypatch):
    """Past 65535 (sequence, head) pairs the kernels put heads and sequences on grid axes 1 and 2
    (launch.SPLIT_GRID_ABOVE, lowered to 1 here so every launch splits). The grouped path reads each
    program's (start, end) pairs by its sequence (seq_step 2) and, with overlapping K/V, sums dK/dV
    through the scratch rows: outputs, LSE and gradients equal the usual grid's bit for bit. GQA 4/2, a
    single-token group, an empty one and uncovered rows."""
    from sparse_attn.ops.block_sparse import launch
    groups = [Group(0, 40, 0, 70), Group(45, 46, 10, 11), Group(50, 110, 30, 100), Group(110, 118, 4, 4)]
    q, k, v = _qkv(120, 100, 4, 2, seed=5)
    assert grouped_plan(groups, 120, 100, causal=True, heads=4).dk_rows is not None  # the scratch path
    g = torch.Generator().manual_seed(6)
    do, dl = torch.randn(q.shape, generator=g), torch.randn(4, 120, generator=g)

    def run():
        out, lse = sparse_attn.grouped_attention(q, k, v, groups, causal=True, return_lse=True)
        loss = (out.float() * do).sum() + (lse.float().nan_to_num(0.0, 0.0, 0.0) * dl).sum()
        return (out, lse) + torch.autograd.grad(loss, (q, k, v))

    usual = run()
    monkeypatch.setattr(launch, "SPLIT_GRID_ABOVE", 1)
    assert launch.grid_rows(4, 4) == ((4, 4), True)
    for a, b in zip(usual, run()):
        assert torch.equal(a, b)
