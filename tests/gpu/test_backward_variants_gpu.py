"""Both backward schedules on the GPU: "fused" (dQ by TMA reduce-adds or pointer atomics inside the
dK/dV kernel) and "split" (separate dQ kernel, the default), and the dK/dV kernel's two issue orders.
Rule 3 against the fp64 oracle for each, split bitwise reproducible, fused within rounding of split,
the issue orders bitwise equal. Inputs are fresh random draws per case."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, causal_term, window_term
from sparse_attn.ops.block_sparse import attention_op, launch
from sparse_attn.testing import assert_layout_grads_close_to_oracle, grads_per_launch_setting, split_and_fused_grads

pytestmark = pytest.mark.gpu

CASES = [  # mask, Lq, Lk, Hq, Hkv, D, block_q, block_k
    ("causal", 1000, 1000, 8, 2, 128, 128, 128),   # GQA, sequence end inside a tile
    ("causal", 333, 777, 4, 4, 96, 64, 128),       # Lq < Lk; D=96: the descriptor clips padded columns
    ("window", 700, 700, 4, 1, 64, 64, 64),        # MQA, partial window blocks
    ("causal", 257, 257, 2, 2, 256, 64, 64),       # d256: 64x64 tiles
]


def _layout(kind, lq, lk, bq, bk):
    mask = ElementMask((causal_term(),)) if kind == "causal" else ElementMask((window_term(150, 0),))
    return BlockLayout.from_mask(mask, q_len=lq, kv_len=lk, block_q=bq, block_k=bk, device="cuda")


# "split-dvfirst": dV issued before dP (launch.BWD_DKDV_ORDER), the default before the fourteenth session;
# "split-deltaacc": delta through dP's accumulator in every dK/dV walk (launch.BWD_DKDV_DELTA_ACC "1");
# "split-deep": deep per-iteration index loads in every indexed walk (launch.BWD_IDX_DEEP "1")
@pytest.mark.parametrize("variant", ["fused", "fused-ptr", "split", "split-dvfirst", "split-deltaacc", "split-deep"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}x{c[2]}-h{c[3]}/{c[4]}-D{c[5]}-b{c[6]}x{c[7]}")
def test_backward_variant_meets_rule3(variant, case, monkeypatch):
    schedule, _, option = variant.partition("-")
    monkeypatch.setattr(launch, "BWD_VARIANT", schedule)
    monkeypatch.setattr(launch, "BWD_DKDV_ORDER", "dv-first" if option == "dvfirst" else "dp-first")
    monkeypatch.setattr(launch, "BWD_DKDV_DELTA_ACC", "1" if option == "deltaacc" else "auto")
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "1" if option == "deep" else "auto")
    kind, lq, lk, hq, hkv, d, bq, bk = case
    layout = _layout(kind, lq, lk, bq, bk)
    mk = lambda h, n: torch.randn(1, h, n, d, device="cuda").bfloat16().requires_grad_()  # noqa: E731
    q, k, v = mk(hq, lq), mk(hkv, lk), mk(hkv, lk)
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)


def test_split_reproducible_fused_within_rounding(monkeypatch):
    # the same dK/dV arithmetic in both schedules: "auto" seeds dP with delta in the split schedule's
    # GQA walk only (test_delta_in_dp_accumulator_within_rounding covers that difference)
    monkeypatch.setattr(launch, "BWD_DKDV_DELTA_ACC", "0")
    layout = _layout("causal", 4096, 4096, 128, 128)
    q = torch.randn(1, 8, 4096, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 4096, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn(1, 8, 4096, 128, device="cuda").bfloat16()
    first, second, fused = split_and_fused_grads(q, k, v, layout, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(fused[1], first[1]) and torch.equal(fused[2], first[2])
    scale = first[0].abs().max().item()
    assert (fused[0] - first[0]).abs().max().item() <= 1e-2 * scale  # bf16 rounding of an fp32 sum


@pytest.mark.parametrize("kind", ["causal", "random"])
def test_dkdv_issue_orders_are_bitwise_equal(kind, monkeypatch):
    """launch.BWD_DKDV_ORDER only reorders the issue of two products: the same bits either way (GQA,
    a sequence end inside a tile, masked diagonal blocks; random blocks, rows with gaps)."""
    if kind == "causal":
        layout = _layout("causal", 1000, 1000, 128, 128)
    else:
        bm = torch.rand(1, 8, 8, 8, generator=torch.Generator().manual_seed(1)) < 0.5
        layout = BlockLayout.from_block_mask(bm, block_q=128, block_k=128, q_len=1000, kv_len=1000).to("cuda")
    q = torch.randn(1, 8, 1000, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 1000, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn_like(q)
    grads = {}
    for order in ("dp-first", "dv-first"):
        monkeypatch.setattr(launch, "BWD_DKDV_ORDER", order)
        grads[order] = torch.autograd.grad(attention_op(q, k, v, layout), (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in grads["dp-first"])
    assert all(torch.equal(a, b) for a, b in zip(grads["dp-first"], grads["dv-first"]))


def test_varlen_split_matches_fused(monkeypatch):
    """Packed sequences (one of a single token) through both schedules: the split dK/dV kernel reads
    each sequence's Q / dO rows through per-sequence TMA descriptors, the fused one by pointers. A
    descriptor placed at the wrong rows would differ by O(1), not by bf16 rounding."""
    lens = [300, 1, 777, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lens)
    q = torch.randn(T, 8, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(T, 2, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn(T, 8, 128, device="cuda").bfloat16()
    grads = {}
    for variant in ("fused", "split"):
        monkeypatch.setattr(launch, "BWD_VARIANT", variant)
        out = sparse_attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        grads[variant] = torch.autograd.grad(out, (q, k, v), do)
    for a, b in zip(grads["fused"], grads["split"]):
        assert torch.isfinite(b).all()
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item()


@pytest.mark.parametrize("kind", ["dense", "block_diagonal", "causal", "window"])
def test_contiguous_backward_walk_bitwise_equal(kind):
    """launch.BWD_CONTIGUOUS: on contiguous schedules the backward kernels walk each row's unmasked run
    by arithmetic; the same blocks in the same order as the indexed walk, so gradients bitwise equal.
    GQA, odd lengths (the last block crosses the end), Lq != Lk for causal."""
    from sparse_attn import patterns

    lq, lk = (1000, 1400) if kind == "causal" else (1000, 1000)
    layout = {"dense": lambda: patterns.dense(lq, lk),
              "block_diagonal": lambda: patterns.block_diagonal(lq, 256),
              "causal": lambda: patterns.causal(lq, lk),
              "window": lambda: patterns.local(lq, 384)}[kind]().to("cuda")
    mk = lambda h, n: torch.randn(1, h, n, 128, device="cuda").bfloat16().requires_grad_()  # noqa: E731
    q, k, v = mk(8, lq), mk(2, lk), mk(2, lk)
    do = torch.randn_like(q)
    indexed, walked = grads_per_launch_setting(q, k, v, layout, do, "BWD_CONTIGUOUS", (False, True))
    assert all(torch.isfinite(g).all() for g in walked)
    assert all(torch.equal(a, b) for a, b in zip(indexed, walked))
    assert_layout_grads_close_to_oracle(attention_op, q, k, v, layout)  # rule 3, contiguous walk (default) on


def _random_blocks_case(L: int, hkv: int, seed: int):
    """(layout, q, k, v, do): random 128-token blocks at density 0.3 plus the diagonal, per head (H=32,
    D=128, bf16); L need not be a multiple of the block (the last one crosses the end)."""
    H, n = 32, -(-L // 128)
    bm = torch.rand(1, H, n, n, generator=torch.Generator().manual_seed(seed)) < 0.3
    bm |= torch.eye(n, dtype=torch.bool)
    layout = BlockLayout.from_block_mask(bm, block_q=128, block_k=128, q_len=L, kv_len=L).to("cuda")
    q = torch.randn(1, H, L, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(1, hkv, L, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    return layout, q, k, v, torch.randn_like(q)


@pytest.mark.parametrize("hkv", [32, 8])
def test_wave_order_backward_within_rounding_of_grid_order(hkv):
    """launch.BWD_WAVE at a size where the rotation takes every phase (16K, random blocks of 128 at
    density 0.3: 4096 dQ programs and 1024-4096 dK/dV programs against the GPU's ~132 resident, rows
    of ~38 slots; with Hkv 8 a dK/dV program walks its 4 query heads' rows as one, split at h0): the
    same blocks in another order, so gradients within bf16 rounding of grid order's (fp32 sums, one
    rounding), and not bitwise equal (the rotation ran). Rule 3 with the order on (the default): the
    fuzz tests' random, streaming, strided and BigBird layouts against the fp64 oracle."""
    layout, q, k, v, do = _random_blocks_case(16384, hkv, seed=7)
    wave, plain = grads_per_launch_setting(q, k, v, layout, do, "BWD_WAVE", ("1", "0"))
    for name, a, b in zip(("dq", "dk", "dv"), wave, plain):
        assert torch.isfinite(a).all(), name
        assert not torch.equal(a, b), f"{name}: bitwise equal to grid order, so no rotation ran"
        err = (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()
        assert err <= 8e-3, f"{name}: max difference {err:.2e} of the largest gradient, beyond bf16 rounding"


@pytest.mark.parametrize("kind, hkv", [("dense", 32), ("causal", 8)])
def test_delta_in_dp_accumulator_within_rounding(kind, hkv):
    """launch.BWD_DKDV_DELTA_ACC: -delta seeds dP's accumulator in the dK/dV kernel instead of being
    subtracted after the product (the default "auto" does so on these two walks: the arithmetic MHA one
    and GQA's heads inside). dQ comes from the other kernel and dV does not involve delta: both
    bitwise equal. dK: the fp32 sum dP - delta is rounded in another order, so within bf16 rounding,
    and not bitwise equal (the seeded path ran)."""
    L, H = 4096, 32
    layout = (BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=L, block_q=128, block_k=128, device="cuda")
              if kind == "causal" else sparse_attn.patterns.dense(L, device="cuda"))
    q = torch.randn(1, H, L, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(1, hkv, L, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn_like(q)
    seeded, subtracted = grads_per_launch_setting(q, k, v, layout, do, "BWD_DKDV_DELTA_ACC", ("1", "0"))
    assert torch.equal(seeded[0], subtracted[0]) and torch.equal(seeded[2], subtracted[2])
    assert torch.isfinite(seeded[1]).all()
    assert not torch.equal(seeded[1], subtracted[1]), "dK bitwise equal: the seeded accumulator did not run"
    err = (seeded[1].float() - subtracted[1].float()).abs().max().item() / subtracted[1].float().abs().max().item()
    assert err <= 8e-3, f"dk: max difference {err:.2e} of the largest gradient, beyond bf16 rounding"


@pytest.mark.parametrize("hkv", [32, 8])
def test_deep_index_loads_bitwise_equal_to_register_chunks(hkv, monkeypatch):
    """launch.BWD_IDX_DEEP: one block index load per iteration, pipelined two levels deep, instead of
    indices picked from register chunks ("auto" takes it here: random blocks, head dim 128, no element
    masks). The same blocks in the same (wave) order and the same products, with delta through dP's
    accumulator in both: gradients bitwise equal. An odd length puts the last block through the
    masked pass (one load per iteration, not deep). Rule 3 with the default on random layouts: the
    fuzz tests (tests/gpu/test_fuzz_gpu.py) and "split-deep" above."""
    monkeypatch.setattr(launch, "BWD_DKDV_DELTA_ACC", "1")
    layout, q, k, v, do = _random_blocks_case(8192 - 37, hkv, seed=17)
    deep, chunks = grads_per_launch_setting(q, k, v, layout, do, "BWD_IDX_DEEP", ("auto", "0"))
    for name, a, b in zip(("dq", "dk", "dv"), deep, chunks):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between deep index loads and register chunks"


@pytest.mark.parametrize("kind", ["random-mha", "random-gqa", "causal", "window-gqa", "block_diagonal"])
def test_row_terms_by_tma_bitwise_equal_to_pointer_loads(kind):
    """launch.BWD_TERMS: the dK/dV kernel reads each query tile's row terms (LSE2, delta) through TMA
    descriptors ("tma", the default) or pointer loads ("ptr"): the same values, so gradients bitwise
    equal on every walk. Random blocks walk the deep indexed loop (an odd length puts the last block
    through the masked pass); causal with Lq != Lk and GQA's window the arithmetic walk and the
    one-stage masked pass; block-diagonal the pipelined pass. Rule 3 with the default: the cases above
    and tests/gpu/test_fuzz_gpu.py."""
    from sparse_attn import patterns

    if kind.startswith("random"):
        layout, q, k, v, do = _random_blocks_case(4096 - 37, 32 if kind == "random-mha" else 8, seed=23)
    else:
        lq, lk, hkv = {"causal": (1000, 1400, 8), "window-gqa": (1500, 1500, 2),
                       "block_diagonal": (2048, 2048, 8)}[kind]
        layout = {"causal": lambda: patterns.causal(lq, lk),
                  "window-gqa": lambda: patterns.local(lq, 384),
                  "block_diagonal": lambda: patterns.block_diagonal(lq, 512)}[kind]().to("cuda")
        mk = lambda h, n: torch.randn(1, h, n, 128, device="cuda").bfloat16().requires_grad_()  # noqa: E731
        q, k, v = mk(8, lq), mk(hkv, lk), mk(hkv, lk)
        do = torch.randn_like(q)
    assert launch.terms_by_tma(launch._tma_ok(q, do)), "the TMA branch must run on these inputs"
    by_tma, by_pointer = grads_per_launch_setting(q, k, v, layout, do, "BWD_TERMS", ("tma", "ptr"))
    for name, a, b in zip(("dq", "dk", "dv"), by_tma, by_pointer):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between the row terms by TMA and by pointer loads"


@pytest.mark.parametrize("hkv, block_k", [(32, 128), (8, 128), (8, 256)])
def test_longest_walks_first_bitwise_equal_to_grid_order(hkv, block_k):
    """launch.BWD_TILE_ORDER "work": the dK/dV programs of a (batch, kv head) row take its key tiles
    longest walk first (launch.tile_order); block_k 256 holds two of the kernel's 128-key tiles, and
    the odd length leaves the last block's second tile past the end. Each tile's walk is unchanged, so
    gradients are bitwise those of grid order; a tile left out or taken twice would change dK/dV."""
    L, H = 4096 - 37, 32
    nq, nk = -(-L // 128), -(-L // block_k)
    bm = torch.rand(1, H, nq, nk, generator=torch.Generator().manual_seed(29)) < torch.linspace(0.1, 0.5, nk)
    bm |= torch.eye(nq, nk, dtype=torch.bool)
    layout = BlockLayout.from_block_mask(bm, block_q=128, block_k=block_k, q_len=L, kv_len=L).to("cuda")
    q = torch.randn(1, H, L, 128, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(1, hkv, L, 128, device="cuda").bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn_like(q)
    work, grid = grads_per_launch_setting(q, k, v, layout, do, "BWD_TILE_ORDER", ("work", "grid"))
    for name, a, b in zip(("dq", "dk", "dv"), work, grid):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{name} differs between longest-first and grid order"
