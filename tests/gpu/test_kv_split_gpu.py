"""Split-KV forward on the GPU (launch.FWD_KV_SPLIT): decoding-shaped calls (a few query rows, a long
cache) against the reference (DESIGN.md rule 3), NaN-poisoned allocations, fresh random inputs; the
automatic split engages there (GQA's rows packed on shared layouts), matches the unsplit and unpacked
kernels, and replays bitwise in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, window_term
from sparse_attn.testing import capture_graph

pytestmark = pytest.mark.gpu


def _launch():
    from sparse_attn.ops.block_sparse import launch
    return launch


def _layout(kind, lq, lk, heads, bq=128, bk=128):
    if kind == "causal":
        return patterns.causal(lq, lk, block_q=bq, block_k=bk, device="cuda")
    if kind == "window":
        return patterns.local(lq, 4000, kv_len=lk, block_q=bq, block_k=bk, device="cuda")
    if kind == "streaming":
        mask = ElementMask((window_term(2047, 0), MaskTerm(k_lo=0, k_hi=5, right=0)))
        return BlockLayout.from_mask(mask, q_len=lq, kv_len=lk, block_q=bq, block_k=bk, device="cuda")
    return patterns.random(lq, kv_len=lk, density=0.3, heads=heads, seed=4, block_q=bq, block_k=bk, device="cuda")


def _plan(layout, B, H, hkv, lq, d):
    return _launch().layout_query_plan(layout, B, H, hkv, lq, d, torch.device("cuda"))


def _forward(monkeypatch, parts, q, k, v, layout, pack=True):
    monkeypatch.setattr(_launch(), "FWD_KV_SPLIT", parts)
    monkeypatch.setattr(_launch(), "PACK_GQA", pack)
    poison = torch.full((8, *q.shape), float("nan"), device="cuda", dtype=q.dtype)
    del poison  # the caching allocator hands this NaN-filled memory to the call's outputs and parts
    return sparse_attn.attention(q, k, v, layout, return_lse=True)


def _check_against_references(out, lse, o_or, o_lp, lse_or, what: str):
    """DESIGN.md rule 3: ``out`` within twice the same-dtype reference's error against fp64 (plus a
    floor); no NaN; the LSE -inf on the same rows and within 2e-3 elsewhere. Returns (that error bound,
    the rows with a finite LSE)."""
    assert not out.isnan().any() and not lse.isnan().any()
    e_got, e_ref = (out.double() - o_or).abs().max().item(), (o_lp.double() - o_or).abs().max().item()
    bound = 2.0 * e_ref + (2e-3 if out.dtype == torch.bfloat16 else 3e-4)
    assert e_got <= bound, f"{what} err {e_got:.3e} > 2 x ref err {e_ref:.3e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_or))
    fin = torch.isfinite(lse_or)
    assert (lse[fin].double() - lse_or[fin]).abs().max().item() < 2e-3
    return bound, fin


CASES = [
    # (pattern, B, Hq, Hkv, Lq, Lk, D, block_q, block_k); GQA on the shared layouts packs its rows
    ("causal", 1, 32, 8, 1, 8192 + 77, 128, 128, 128),   # one decoding step, GQA packed, partial last block
    ("causal", 2, 16, 16, 3, 20000, 64, 128, 128),       # MHA
    ("window", 1, 32, 4, 1, 30000, 128, 64, 128),        # contiguous run, masked edges, 8 heads packed
    ("streaming", 1, 8, 8, 16, 12345, 128, 128, 128),    # sinks + window, 16 rows: the last 16-row tile
    ("streaming", 2, 8, 2, 7, 12345, 128, 128, 128),     # 4 heads x 7 rows packed in a 32-row tile
    ("random", 1, 8, 2, 40, 9000, 128, 64, 128),         # per-head layout: not packed; 64-row tiles
    ("causal", 1, 8, 1, 1, 5000, 256, 128, 128),         # head dim 256 (64-key tiles), MQA packed
    ("causal", 8, 32, 8, 1, 30000, 128, 128, 128),       # 64 packed programs: 2 parts
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}-h{c[2]}/{c[3]}-L{c[4]}x{c[5]}-D{c[6]}")
def test_auto_split_decoding_matches_the_reference_and_the_unsplit_kernel(monkeypatch, case, dtype):
    kind, B, hq, hkv, lq, lk, d, bq, bk = case
    layout = _layout(kind, lq, lk, hq, bq, bk)
    plan = _plan(layout, B, hq, hkv, lq, d)
    assert plan.parts > 1, "the case must take the split path on this GPU"
    assert plan.pack == (hkv < hq and layout.heads == 1)
    q = torch.randn(B, hq, lq, d, device="cuda").to(dtype)
    k, v = (torch.randn(B, hkv, lk, d, device="cuda").to(dtype) for _ in range(2))
    out, lse = _forward(monkeypatch, "auto", q, k, v, layout)
    o_or, lse_or = sparse_attn.reference.attention(q.double(), k.double(), v.double(), layout, return_lse=True)
    o_lp = sparse_attn.reference.attention(q, k, v, layout, _lowp=True)
    bound, fin = _check_against_references(out, lse, o_or, o_lp, lse_or, "split kernel")
    for parts, pack in (("0", True), ("0", False)):  # the small tile unsplit, packed and not
        plain, plain_lse = _forward(monkeypatch, parts, q, k, v, layout, pack)
        assert (out.float() - plain.float()).abs().max().item() <= bound
        assert (lse - plain_lse)[fin].abs().max().item() < 1e-4


def test_more_parts_than_tiles_leave_empty_parts_that_weigh_nothing(monkeypatch):
    """64 parts forced on rows of 3 to 9 key tiles: most parts walk nothing (LSE -inf) and the rows
    that see no key at all (Lq > Lk, causal) stay zeros with LSE -inf."""
    layout = BlockLayout.from_mask(ElementMask((MaskTerm(right=0),)), q_len=1100, kv_len=1000, block_q=128,
                                   block_k=128, device="cuda")
    q = torch.randn(1, 4, 1100, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = _forward(monkeypatch, "64", q, k, v, layout)
    plain, plain_lse = _forward(monkeypatch, "0", q, k, v, layout)
    empty = torch.isinf(plain_lse)
    assert empty.any()
    assert torch.equal(torch.isinf(lse), empty) and not out.isnan().any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (out.float() - plain.float()).abs().max().item() < 2e-2
    assert (lse - plain_lse)[~empty].abs().max().item() < 1e-4


def test_split_decoding_replays_bitwise_in_a_cuda_graph():
    layout = sparse_attn.prepare(_layout("causal", 1, 40000, 32), backward=False)
    assert _plan(layout, 1, 32, 8, 1, 128).parts > 1
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 40000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    graph, captured = capture_graph(lambda: sparse_attn.attention(q, k, v, layout, return_lse=True))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    eager = sparse_attn.attention(q, k, v, layout, return_lse=True)
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


def test_repeated_split_calls_do_not_grow_memory():
    layout = _layout("window", 1, 30000, 32)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 30000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):  # the kernels' first launch, the recording, the first replay (which takes its scratch)
        sparse_attn.attention(q, k, v, layout)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        out = sparse_attn.attention(q, k, v, layout)
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def _packed_reference(q, k, v, q_lens, k_lens, causal):
    """Per-sequence references of a packed call, packed back: (fp64 out, same-dtype out, fp64 LSE [H, T])."""
    o_or, o_lp, lse_or = torch.zeros(q.shape, dtype=torch.float64, device="cuda"), torch.zeros_like(q), \
        torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device="cuda")
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        if lq and lk:  # else: no key, zeros and -inf as filled
            lay = (patterns.causal if causal else patterns.dense)(lq, lk, device="cuda")
            qs, ks, vs = (t[a:a + n].transpose(0, 1)[None] for t, a, n in ((q, q0, lq), (k, k0, lk), (v, k0, lk)))
            o, lse = sparse_attn.reference.attention(qs.double(), ks.double(), vs.double(), lay, return_lse=True)
            o_or[q0:q0 + lq], lse_or[:, q0:q0 + lq] = o[0].transpose(0, 1), lse[0]
            o_lp[q0:q0 + lq] = sparse_attn.reference.attention(qs, ks, vs, lay, _lowp=True)[0].transpose(0, 1)
        q0, k0 = q0 + lq, k0 + lk
    return o_or, o_lp, lse_or


VARLEN_CASES = [
    # (q_lens, k_lens, Hq, Hkv, D, causal): continuous batching, one plan per step
    ([1] * 6 + [0], [30000, 1, 5077, 12345, 0, 700, 40], 32, 8, 128, True),  # GQA packed and split; empty rows
    ([1, 4, 16, 2], [9000, 20000, 333, 64], 16, 16, 64, False),  # MHA, dense, 64 programs: split
    ([3] * 40, [4000 + 37 * i for i in range(40)], 32, 8, 128, True),  # 320 packed programs: the small tile alone
]


@pytest.mark.parametrize("host_plan", [True, False], ids=["plan-built-on-cpu", "plan-built-by-cuda-ops"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"S{len(c[0])}-h{c[2]}/{c[3]}-D{c[4]}-causal{c[5]}")
def test_varlen_decoding_matches_per_sequence_references(monkeypatch, case, dtype, host_plan):
    """varlen_attention without layouts= or pattern= builds its plan at once (varlen.stack_dense_or_causal,
    on the host and copied, or with the device's ops: HOST_PLAN_ENTRIES) for calls that need gradients, and
    the short-query forward runs it: outputs and LSE as each sequence's reference (DESIGN.md rule 3); a
    forward-only call (the kernels' device plan, no host plan) gives the same bits."""
    q_lens, k_lens, hq, hkv, d, causal = case
    from sparse_attn import api, varlen
    monkeypatch.setattr(varlen, "HOST_PLAN_ENTRIES", 1 << 30 if host_plan else 0)
    api._VARLEN_PLANS.clear()  # the plan is built here, as set
    launch = _launch()
    q = torch.randn(sum(q_lens), hq, d, device="cuda").to(dtype)
    k, v = (torch.randn(sum(k_lens), hkv, d, device="cuda").to(dtype) for _ in range(2))
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    plan = api._varlen_plan(q_lens, k_lens, None, None, causal, hq, max(q_lens), max(k_lens), q.device)
    assert plan.per_seq is None  # the one-shot plan
    assert launch.short_query_plan(len(q_lens), hq, hkv, max(q_lens), 128, 128, launch._d_pad(d), 1,
                                   plan.stacked.max_k, "tma", q.device) is not None
    poison = torch.full((8, *q.shape), float("nan"), device="cuda", dtype=q.dtype)
    del poison
    from sparse_attn.ops.block_sparse import varlen_attention_op
    out, lse = varlen_attention_op(q, k, v, plan.stacked, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens),
                                   plan.kv_lens, return_lse=True)
    _check_against_references(out, lse, *_packed_reference(q, k, v, q_lens, k_lens, causal), "varlen short-query")
    got = sparse_attn.varlen_attention(q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal=causal,
                                       return_lse=True)
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)


def test_decoding_thousands_of_sequences_on_a_split_grid():
    """2100 sequences x 32 heads is past CUDA's 65535 on grid axis 1: the short-query tile runs on the
    split grid (heads, sequences)."""
    launch = _launch()
    S, H, d = 2100, 32, 64
    g = torch.Generator().manual_seed(3)
    k_lens = torch.randint(1, 300, (S,), generator=g).tolist()
    assert launch.grid_rows(S, H)[1]
    q = torch.randn(S, H, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(k_lens), H, d, device="cuda", dtype=torch.float16) for _ in range(2))
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    out, lse = sparse_attn.varlen_attention(q, k, v, cu([1] * S), cu(k_lens), 1, max(k_lens), causal=True,
                                            return_lse=True)
    _check_against_references(out, lse, *_packed_reference(q, k, v, [1] * S, k_lens, True), "split-grid")
