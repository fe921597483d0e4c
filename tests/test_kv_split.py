"""Split-KV forward (launch.FWD_KV_SPLIT, kernels.fwd_kernel KV_SPLIT + split_merge_kernel): the
decoding path, where a grid of a few query tiles cannot fill the GPU and each tile's key walk is cut
into parts merged by their LSE. Under TRITON_INTERPRET=1 (conftest.py) on small fp16/fp32 cases,
against the fp64 reference (DESIGN.md rule 3); the policy (kv_splits) on a stand-in SM count."""
from __future__ import annotations

import os

import pytest
import torch

from sparse_attn import patterns, reference
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, window_term
from sparse_attn.testing import assert_close_to_oracle, assert_grads_close_to_oracle, launch_import_stderr

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter tests run only without a GPU")


def _launch():
    from sparse_attn.ops.block_sparse import launch
    return launch


def _qkv(B, hq, hkv, lq, lk, d, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, hq, lq, d), mk(B, hkv, lk, d), mk(B, hkv, lk, d)


def _layout(kind, lq, lk, heads):
    if kind == "causal":  # bottom-right: the decoding rows see the whole cache, the last block partial
        return patterns.causal(lq, lk, block_q=32, block_k=32)
    if kind == "window":  # contiguous run with element masks on its edges
        return patterns.local(lq, 100, kv_len=lk, block_q=32, block_k=32)
    if kind == "streaming":  # sinks + window: two terms
        mask = ElementMask((window_term(60, 0), MaskTerm(k_lo=0, k_hi=3, right=0)))
        return BlockLayout.from_mask(mask, q_len=lq, kv_len=lk, block_q=32, block_k=32)
    return patterns.random(lq, kv_len=lk, density=0.4, heads=heads, seed=5, block_q=32, block_k=32)


def _spy_merges(monkeypatch) -> list:
    """The grids of split_merge_kernel's launches from now on (the split path must have run)."""
    from sparse_attn.ops.block_sparse import kernels
    merges, merge = [], kernels.split_merge_kernel

    class Counting:
        def __getitem__(self, grid):
            merges.append(grid)
            return merge[grid]
    monkeypatch.setattr(kernels, "split_merge_kernel", Counting())
    return merges


def _spy_plans(monkeypatch) -> list:
    """What launch.short_query_plan returns from now on, call by call."""
    launch = _launch()
    plans, plan = [], launch.short_query_plan
    monkeypatch.setattr(launch, "short_query_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    return plans


def _run(monkeypatch, parts, q, k, v, layout, pack=True):
    """(out, lse) of the kernels' forward with FWD_KV_SPLIT = ``parts`` and PACK_GQA = ``pack``, and how
    many merges ran."""
    from sparse_attn.ops.block_sparse import attention_op
    launch = _launch()
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", parts)
    monkeypatch.setattr(launch, "PACK_GQA", pack)
    merges = _spy_merges(monkeypatch)
    out, lse = attention_op(q, k, v, layout, return_lse=True)
    return out, lse, len(merges)


def _check_against_reference(out, lse, q, k, v, layout):
    """Rule 3 on the output against the fp64 reference, the LSE within 1e-3 and -inf on the same rows;
    returns the rows with a finite LSE."""
    o_or, lse_or = reference.attention(q.double(), k.double(), v.double(), layout, return_lse=True)
    o_lp = reference.attention(q, k, v, layout, _lowp=True)
    assert_close_to_oracle(out, o_lp, o_or, name="out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_or))
    fin = torch.isfinite(lse_or)
    assert (lse[fin].double() - lse_or[fin]).abs().max() < 1e-3
    return fin


@interpreted
@pytest.mark.parametrize("kind,lq,lk,hq,hkv,parts", [
    ("causal", 1, 333, 2, 1, "3"),       # decoding, MQA, the cache's last tile partial
    ("causal", 5, 300, 4, 2, "64"),      # more parts asked than the row has tiles: capped
    ("window", 3, 400, 2, 2, "4"),       # contiguous run, masked edges
    ("streaming", 2, 350, 2, 1, "5"),    # sinks + window: the masked phase split too
    ("random", 20, 290, 2, 2, "3"),      # indexed rows, two query tiles
])
def test_split_forward_matches_the_reference(monkeypatch, kind, lq, lk, hq, hkv, parts):
    layout = _layout(kind, lq, lk, hq)
    q, k, v = _qkv(1, hq, hkv, lq, lk, 32, torch.float16, seed=lq * 1000 + lk)
    out, lse, merges = _run(monkeypatch, parts, q, k, v, layout)
    assert merges == 1
    fin = _check_against_reference(out, lse, q, k, v, layout)
    plain, plain_lse, none = _run(monkeypatch, "0", q, k, v, layout)
    assert none == 0
    assert (out.float() - plain.float()).abs().max() < 2e-3  # another summation order, the same result
    assert (lse - plain_lse)[fin].abs().max() < 1e-4


@interpreted
def test_rows_with_no_key_give_zeros_and_minus_inf_when_split(monkeypatch):
    """Causal with Lq > Lk: the leading rows see no key, so every part of theirs is empty (LSE -inf),
    which the merge must turn into zeros and -inf, not NaN; the last rows see the whole cache."""
    layout = BlockLayout.from_mask(ElementMask((MaskTerm(right=0),)), q_len=310, kv_len=300, block_q=32, block_k=32)
    q, k, v = _qkv(1, 2, 2, 310, 300, 16, torch.float32, seed=7)
    out, lse, merges = _run(monkeypatch, "4", q, k, v, layout)
    assert merges == 1
    o_or, lse_or = reference.attention(q.double(), k.double(), v.double(), layout, return_lse=True)
    empty = torch.isinf(lse_or)
    assert empty.any() and (~empty).any()
    assert torch.equal(torch.isinf(lse), empty) and not torch.isnan(lse).any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (out.double() - o_or).abs().max() < 1e-5


@interpreted
def test_gradients_through_a_split_forward(monkeypatch):
    """The backward reads the merged output and LSE: gradients as the reference's."""
    from sparse_attn.ops.block_sparse import attention_op
    monkeypatch.setattr(_launch(), "FWD_KV_SPLIT", "3")
    layout = _layout("causal", 4, 260, 2)
    q, k, v = _qkv(1, 2, 1, 4, 260, 16, torch.float32, seed=11, grad=True)
    out = attention_op(q, k, v, layout)
    oracle = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    lowp = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o_or = reference.attention(*oracle, layout)
    o_lp = reference.attention(*lowp, layout, _lowp=True)
    assert_grads_close_to_oracle((out, o_lp, o_or), torch.randn_like(out), (q, k, v), lowp, oracle)


@interpreted
@pytest.mark.parametrize("kind,lq,lk,hq,hkv,parts", [
    ("causal", 1, 333, 4, 1, "3"),       # MQA: the four heads' rows in one tile, split
    ("causal", 3, 290, 6, 2, "0"),       # 3 rows x 3 heads = 9 rows of a 16-row tile, unsplit
    ("window", 2, 400, 8, 2, "4"),       # masked edges at each packed row's own position
    ("streaming", 5, 350, 4, 2, "2"),    # two terms
])
def test_packed_gqa_rows_match_the_reference_and_the_unpacked_kernel(monkeypatch, kind, lq, lk, hq, hkv, parts):
    """PACK_GQA: one tile holds the rows of the G query heads of a kv head (query i of head g in row
    g * lq + i), on a layout shared by every head."""
    plans = _spy_plans(monkeypatch)
    layout = _layout(kind, lq, lk, hq)
    assert layout.heads == 1
    q, k, v = _qkv(1, hq, hkv, lq, lk, 32, torch.float16, seed=lq * 100 + lk)
    out, lse, _ = _run(monkeypatch, parts, q, k, v, layout)
    assert plans[-1].pack and plans[-1].heads == hkv and plans[-1].tiles == 1
    fin = _check_against_reference(out, lse, q, k, v, layout)
    unpacked, unpacked_lse, _ = _run(monkeypatch, parts, q, k, v, layout, pack=False)
    assert not plans[-1].pack
    assert (out.float() - unpacked.float()).abs().max() < 2e-3
    assert (lse - unpacked_lse)[fin].abs().max() < 1e-4


def test_short_query_plan_packs_only_what_one_tile_may_hold(monkeypatch):
    launch = _launch()
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "auto")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")

    def plan(B=1, H=32, hkv=8, lq=1, block_q=128, layout_heads=1, max_k=256):
        return launch.short_query_plan(B, H, hkv, lq, block_q, 128, 128, layout_heads, max_k, "tma", cpu)
    p = plan()  # Llama-style decoding: 4 query heads a kv head, 8 programs, 16 parts each
    assert (p.pack, p.heads, p.tiles, p.parts, p.config.kwargs["BLOCK_M"]) == (True, 8, 1, 16, 16)
    assert plan(lq=16).config.kwargs["BLOCK_M"] == 64          # 64 packed rows
    assert not plan(lq=17).pack and plan(lq=17).tiles == 1      # 68 rows: over PACK_GQA_MAX_ROWS
    assert not plan(layout_heads=32).pack                       # per-head layouts: rows of other blocks
    assert plan(block_q=16, lq=3, hkv=16).pack                  # 2 heads x 3 rows, all in query block 0
    assert not plan(block_q=16, lq=17, hkv=32).pack             # queries past the first query block
    assert not plan(hkv=32).pack                                # MHA: nothing to pack
    assert plan(B=8).parts == 2 and plan(B=16).parts == 1       # 64 / 128 programs
    assert plan(B=16, lq=200, hkv=32) is None                   # long queries on a full grid: autotuned kernel
    assert plan(lq=0) is None                                   # no query row: the autotuned kernel's empty grid
    monkeypatch.setattr(launch, "PACK_GQA", False)
    assert not plan().pack and plan().heads == 32 and plan().parts == 4


def test_auto_policy_splits_only_grids_that_leave_most_sms_idle(monkeypatch):
    launch = _launch()
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "auto")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert launch.kv_splits(32, 1024, cpu) == 4      # decoding B=1, H=32: one wave of 128 programs
    assert launch.kv_splits(8, 1024, cpu) == 16
    assert launch.kv_splits(1, 4096, cpu) == launch.KV_SPLIT_MAX
    assert launch.kv_splits(32, 16, cpu) == 2        # each part keeps KV_SPLIT_MIN_TILES tiles
    assert launch.kv_splits(32, 15, cpu) == 1
    assert launch.kv_splits(67, 1024, cpu) == 1      # over half the SMs busy: no split
    assert launch.kv_splits(66, 1024, cpu) == 2
    assert launch.kv_splits(0, 1024, cpu) == 1       # no query row: an empty grid, nothing to split


def test_uneven_rows_take_two_waves_of_long_parts(monkeypatch):
    """Packed calls (rows of different lengths) split into two waves' worth of parts where each part keeps
    KV_SPLIT_LONG_MIN_TILES tiles, so a grid the one-wave rule leaves whole (or nearly) gets parts too; equal
    rows keep the one-wave rule."""
    launch = _launch()
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "auto")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert launch.kv_splits(64, 129, cpu) == 2                   # 8 rows x 8 kv heads, 16K cache: one wave
    assert launch.kv_splits(64, 129, cpu, uneven=True) == 4      # two waves of 32-tile parts
    assert launch.kv_splits(128, 257, cpu) == 1                  # 4 rows x 32 heads: the grid fills the SMs
    assert launch.kv_splits(128, 257, cpu, uneven=True) == 2
    assert launch.kv_splits(132, 1024, cpu, uneven=True) == 2
    assert launch.kv_splits(133, 1024, cpu, uneven=True) == 1    # over one wave already: no split
    assert launch.kv_splits(64, 127, cpu, uneven=True) == 3      # parts of at least 32 tiles: 127 // 32
    assert launch.kv_splits(8, 64, cpu, uneven=True) == 8        # short rows: the one-wave count is larger
    assert launch.kv_splits(1, 4096, cpu, uneven=True) == launch.KV_SPLIT_MAX
    monkeypatch.setattr(launch, "KV_SPLIT_LONG_WAVES", 0)        # off: the one-wave rule alone
    assert launch.kv_splits(64, 129, cpu, uneven=True) == 2


def test_only_short_packed_calls_take_two_waves(monkeypatch):
    """short_query_plan passes ``uneven`` on for packed calls of at most SMALL_Q_ROWS query rows (decoding, where
    it was measured); longer packed calls split as plain ones."""
    launch = _launch()
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "auto")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "INTERPRET", True)  # split_config's tiles: 16 query rows, 32 keys (1024 a row)
    cpu = torch.device("cpu")

    def parts(lq, B, uneven):  # 8 heads, no GQA; 256 key blocks of 128
        return launch.short_query_plan(B, 8, 8, lq, 128, 128, 128, 1, 256, "tma", cpu, uneven).parts
    assert (parts(1, 8, False), parts(1, 8, True)) == (2, 4)        # 64 programs: one wave 2, two waves 4
    assert (parts(64, 1, False), parts(64, 1, True)) == (4, 8)      # 4 query tiles x 8 heads
    assert (parts(128, 1, False), parts(128, 1, True)) == (2, 2)    # past SMALL_Q_ROWS: one wave either way


def test_forced_and_disabled_settings_and_a_clear_error(monkeypatch):
    launch = _launch()
    cpu = torch.device("cpu")
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "0")
    assert launch.kv_splits(1, 4096, cpu) == 1
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "8")
    assert launch.kv_splits(10_000, 4096, cpu) == 8  # forced: even on a full grid
    assert launch.kv_splits(1, 5, cpu) == 5          # capped by the row's tiles
    for bad in ("yes", "-2"):
        monkeypatch.setattr(launch, "FWD_KV_SPLIT", bad)
        with pytest.raises(ValueError, match="SPARSE_ATTN_FWD_KV_SPLIT must be 'auto', '0' or a number of parts"):
            launch.kv_splits(1, 64, cpu)
    assert "SPARSE_ATTN_FWD_KV_SPLIT must be 'auto', '0' or a number of parts, got 'on'" in launch_import_stderr(
        "SPARSE_ATTN_FWD_KV_SPLIT", "on")


def test_split_tile_follows_the_query_rows(monkeypatch):
    """16-row query tiles for up to 16 query rows (decoding), else 64; always dividing block_q; packed
    GQA rows take the least power of two from 16 that holds them."""
    launch = _launch()
    monkeypatch.setattr(launch, "INTERPRET", False)
    pick = lambda bq, bk, d, lq: (lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages))(  # noqa: E731
        launch.split_config(bq, bk, d, lq, "tma"))
    assert pick(128, 128, 128, 1) == (16, 128, 3)
    assert pick(128, 128, 128, 17) == (64, 128, 3)
    assert pick(32, 128, 128, 100) == (32, 128, 3)
    assert pick(128, 128, 256, 1) == (16, 64, 2)
    assert pick(128, 64, 64, 1) == (16, 64, 3)
    assert launch.split_config(16, 128, 128, 40, "tma", packed=True).kwargs["BLOCK_M"] == 64
    assert launch.split_config(128, 128, 128, 3, "tma", packed=True).kwargs["BLOCK_M"] == 16


def _varlen_case(kind, hq, hkv, seed):
    """Packed decoding-style inputs: sequences of 0-3 query rows against caches of 0-300 keys, and the
    stacked layout the kernels get: one-shot causal (varlen.stack_dense_or_causal, what the API builds on
    CUDA) or per-sequence streaming layouts (sinks + window, element masks)."""
    from sparse_attn import varlen
    from sparse_attn.testing import random_packed_qkv
    q_lens, k_lens = [1, 2, 0, 1, 3], [300, 17, 50, 0, 129]
    q, k, v = random_packed_qkv(sum(q_lens), sum(k_lens), hq, hkv, 32, seed=seed, requires_grad=False)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    max_q, max_k = max(q_lens), max(k_lens)
    if kind == "causal":
        stacked, pattern = varlen.stack_dense_or_causal(q_lens, k_lens, True, max_q, max_k, "cpu", 32), None
    else:
        pattern = lambda lq, lk: _layout("streaming", lq, lk, hq)  # noqa: E731
        stacked = varlen.stack(varlen.build_layouts(q_lens, k_lens, None, pattern, False), max_q, max_k, hq)
    return q, k, v, cu(q_lens), cu(k_lens), max_q, max_k, k_lens, stacked, pattern


@interpreted
@pytest.mark.parametrize("kind,hq,hkv,pack,parts", [
    ("causal", 4, 1, True, "3"),      # MQA rows packed, split: empty parts and an empty cache
    ("causal", 4, 2, False, "4"),     # unpacked, split
    ("causal", 2, 1, True, "0"),      # packed, small tile unsplit
    ("streaming", 2, 2, True, "5"),   # per-sequence masks, split
])
def test_varlen_short_queries_match_the_reference(monkeypatch, kind, hq, hkv, pack, parts):
    """Packed (varlen) calls with few query rows take the short-query plan too: small tile, split-KV
    merged as T rows, GQA packing with each sequence's own q_len."""
    import sparse_attn
    from sparse_attn.ops.block_sparse import varlen_attention_op
    launch = _launch()
    q, k, v, cq, ck, max_q, max_k, k_lens, stacked, pattern = _varlen_case(kind, hq, hkv, seed=hq * 10 + hkv)
    plans, merges = _spy_plans(monkeypatch), _spy_merges(monkeypatch)
    monkeypatch.setattr(launch, "PACK_GQA", pack)

    def run(n_parts):
        monkeypatch.setattr(launch, "FWD_KV_SPLIT", n_parts)
        return varlen_attention_op(q, k, v, stacked, cq, ck, max_q, max_k, tuple(k_lens), return_lse=True)
    out, lse = run(parts)
    assert plans[-1] is not None and plans[-1].pack == (pack and hq > hkv and kind == "causal")
    assert len(merges) == (parts != "0")
    o_ref, lse_ref = sparse_attn.varlen_attention(q.double(), k.double(), v.double(), cq, ck, max_q, max_k,
                                                  pattern=pattern, causal=kind == "causal", return_lse=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)) and not torch.isnan(out).any()
    fin = torch.isfinite(lse_ref)
    assert (out.double() - o_ref).abs().max() < 5e-3
    assert (lse.double() - lse_ref)[fin].abs().max() < 1e-3
    plain, plain_lse = run("0")
    assert (out.float() - plain.float()).abs().max() < 2e-3
    assert (lse - plain_lse)[fin].abs().max() < 1e-4


@interpreted
@pytest.mark.parametrize("pack", [True, False])
def test_short_queries_on_a_split_grid_equal_the_usual_grid(monkeypatch, pack):
    """Decoding thousands of packed sequences puts heads and sequences on grid axes 1 and 2
    (launch.SPLIT_GRID_ABOVE, lowered here so every launch splits): the short-query tile runs there too,
    bit for bit as on the usual grid."""
    from sparse_attn.ops.block_sparse import varlen_attention_op
    launch = _launch()
    q, k, v, cq, ck, max_q, max_k, k_lens, stacked, _ = _varlen_case("causal", 4, 2, seed=3)
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "0")
    monkeypatch.setattr(launch, "PACK_GQA", pack)
    plans = _spy_plans(monkeypatch)
    run = lambda: varlen_attention_op(q, k, v, stacked, cq, ck, max_q, max_k, tuple(k_lens), return_lse=True)  # noqa: E731
    usual = run()
    monkeypatch.setattr(launch, "SPLIT_GRID_ABOVE", 1)
    assert launch.grid_rows(5, 2) == ((2, 5), True)
    split = run()
    assert len(plans) == 2 and plans[1] is not None and plans[1].pack == pack
    for a, b in zip(usual, split):
        assert torch.equal(a, b)
