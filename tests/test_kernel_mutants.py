"""Kernel-layer cases found missing by mutation testing (TRITON_INTERPRET=1 on the CPU, set by
conftest.py): paths the other interpreter tests leave unexercised. Small fp32 cases, forward and
backward against the float64 reference."""
from __future__ import annotations

import os

import pytest
import torch

from sparse_attn import reference
from sparse_attn.layout import BlockLayout
from sparse_attn.masks import ElementMask, MaskTerm, causal_term, document_term

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU"),
]


def _op():
    from sparse_attn.ops.block_sparse import attention_op
    return attention_op


def _qkv(hq, hkv, lq, lk, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_(True)  # noqa: E731
    return mk(1, hq, lq, d), mk(1, hkv, lk, d), mk(1, hkv, lk, d)


def _check(layout, q, k, v, do=None, tol=1e-4):
    """fp32 kernels vs the fp64 reference: output, LSE and (q, k, v) gradients."""
    out, lse = _op()(q, k, v, layout, return_lse=True)
    oracle = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = reference.attention(*oracle, layout, return_lse=True)
    assert (out.double() - o_ref).abs().max() < tol
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse.double()[fin] - lse_ref[fin]).abs().max() < tol
    g = torch.Generator().manual_seed(11)
    do = torch.randn(out.shape, generator=g) if do is None else do
    out.backward(do)
    o_ref.backward(do.double())
    for name, a, b in zip("qkv", (q, k, v), oracle):
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err < tol, f"d{name}: max error {err:.2e}"


def test_mask_term_bounded_in_query_position():
    """A term limited to query positions <= q_hi (global rows), its bound inside a masked block: the
    kernels' interval check must keep row q_hi and drop q_hi + 1."""
    mask = ElementMask((causal_term(), MaskTerm(q_hi=20)))
    layout = BlockLayout.from_mask(mask, q_len=48, kv_len=48, block_q=16, block_k=16)
    _check(layout, *_qkv(2, 2, 48, 48, 16, seed=1))


def test_backward_takes_a_gradient_not_contiguous_in_the_head_dim():
    """dO with a non-unit head-dim stride (a transposed view) is read as the values it holds."""
    layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=40, kv_len=40, block_q=16, block_k=16)
    q, k, v = _qkv(2, 2, 40, 40, 16, seed=2)
    do = torch.randn(1, 2, 16, 40, generator=torch.Generator().manual_seed(3)).transpose(-1, -2)
    assert do.stride(-1) != 1
    _check(layout, q, k, v, do=do)


def test_document_mask_with_more_queries_than_keys():
    """Lq > Lk: the leading query rows sit at negative positions p = i + Lk - Lq, whose document is
    floor(p / doc) < 0 (no key's): they see no key. Truncating division would put p in (-doc, 0)
    in document 0."""
    layout = BlockLayout.from_mask(ElementMask((document_term(10),)), q_len=48, kv_len=30, block_q=16, block_k=16)
    _check(layout, *_qkv(2, 1, 48, 30, 16, seed=4))


@pytest.mark.parametrize("kind", ["indexed", "runs", "causal"])
def test_layout_blocks_larger_than_the_kernel_tiles(kind):
    """64-token layout blocks: the interpreter's tiles are 32 wide, so each block is walked in two tiles
    (SUB = 2) by the forward, dK/dV and dQ loops: by index (rows and columns not one run), by
    arithmetic (one run per row and column, no element mask; partial last blocks), and with element
    masks (causal, partial last blocks). GQA."""
    if kind == "causal":
        lq, lk = 140, 130
        layout = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=lq, kv_len=lk, block_q=64, block_k=64)
    else:
        if kind == "indexed":  # whole blocks: a partial last block would go last and leave a run
            lq, lk = 192, 192
            bm = [[[1, 0, 1], [0, 1, 1], [1, 1, 0]], [[1, 1, 1], [1, 0, 1], [0, 1, 0]]]
        else:
            lq, lk = 140, 130
            bm = [[[1, 1, 0], [1, 1, 1], [0, 1, 1]]] * 2
        layout = BlockLayout.from_block_mask(torch.tensor(bm, dtype=torch.bool)[None], block_q=64, block_k=64,
                                             q_len=lq, kv_len=lk)
    _check(layout, *_qkv(2, 1, lq, lk, 16, seed=5))


def test_pv_threshold_keeps_a_tile_that_one_row_of_the_query_tile_needs():
    """pv_threshold drops a key tile only when it is negligible for every row of the query tile. Here
    alternate rows prefer opposite halves of the keys (scores +-40): every tile is negligible for half
    the rows and needed by the other half, so nothing may be dropped."""
    L, D = 64, 32
    g = torch.Generator().manual_seed(3)
    u = torch.zeros(D)
    u[0] = 1.0
    sign = torch.where(torch.arange(L) % 2 == 0, 1.0, -1.0)[:, None]
    q = torch.randn(1, 1, L, D, generator=g) * 0.1 + sign * u * 8.0
    k = torch.randn(1, 1, L, D, generator=g) * 0.1
    k[:, :, : L // 2] += u * 5.0 * D ** 0.5
    k[:, :, L // 2:] -= u * 5.0 * D ** 0.5
    v = torch.randn(1, 1, L, D, generator=g)
    layout = BlockLayout.from_mask(ElementMask((MaskTerm(),)), q_len=L, kv_len=L, block_q=16, block_k=16)
    out, lse = _op()(q, k, v, layout, pv_threshold=1e-12, return_lse=True)
    want, want_lse = reference.attention(q.double(), k.double(), v.double(), layout, return_lse=True)
    assert (out.double() - want).abs().max() < 1e-4
    assert (lse.double() - want_lse).abs().max() < 1e-4


@pytest.mark.parametrize("rows_are_runs", [True, False])
def test_backward_walks_each_schedule_by_its_own_contiguity(rows_are_runs):
    """The forward rows (dQ's walk) and the transposed rows (dK/dV's) are contiguous or not each on
    its own: here one is a run per row and the other is not, so each kernel must take its own flag."""
    bm = [[1, 0, 0], [0, 1, 0], [1, 1, 1]]  # rows: one run each; column 0: blocks 0 and 2
    bm = torch.tensor(bm, dtype=torch.bool)
    bm = bm if rows_are_runs else bm.T.contiguous()
    layout = BlockLayout.from_block_mask(bm, block_q=16, block_k=16, q_len=48, kv_len=48)
    _check(layout, *_qkv(2, 2, 48, 48, 16, seed=8))


def test_int8_kernel_per_thread_k_scales_match_the_twin(one_thread):
    """per_thread K scales vary within a kernel tile (keys equal mod 8 share one), so the kernel must
    apply them per key, not fold one per tile into the row factor (only per_block / per_warp K groups
    span whole tiles). Keys 3 mod 8 are 8x larger: their group's scale differs from the others'."""
    from sparse_attn.ops.sage import reference as twin
    from sparse_attn.ops.sage import sage_attention_op
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    k[:, :, 3::8] *= 8.0
    q, k, v = q.half(), k.half(), v.half()
    layout = BlockLayout.from_mask(ElementMask((MaskTerm(),)), q_len=64, kv_len=64, block_q=32, block_k=32)
    out, _ = sage_attention_op(q, k, v, layout, quant="int8", granularity="per_thread", smooth_k=True)
    want = twin.attention(q, k, v, layout, quant="int8", granularity="per_thread")
    assert (out.float() - want.float()).abs().max() < 4e-3


def test_fp8_v_dequantizes_to_v():
    """quantize_v_fp8 (dense): V^T in e4m3 times its per-channel scale (amax / 448) gives back V. The
    values are e4m3 grid points times the scale, so no rounding is involved (triton 3.9's interpreter
    rounds some fp32 -> e4m3 conversions a binade low, e.g. 31.3 -> 16); the padded columns are zero."""
    from sparse_attn.ops.sage import launch
    grid = torch.tensor([448.0, 256.0, 224.0, -96.0, 16.0, 1.0, -3.0, 0.5, 0.0, -448.0])  # e4m3 values, |max| 448
    amax = 7.0 * 2.0 ** torch.arange(-3, 5).repeat(4)  # [32] per-channel amax, exact in fp16
    v = (grid[:, None] * (amax / 448.0)[None, :]).expand(1, 2, 10, 32).half()
    vt, scale = launch.quantize_v_fp8(v, False)
    assert torch.equal(scale, (amax / 448.0).expand(1, 2, 32))
    assert torch.equal(vt.float()[..., :10] * scale[..., None], v.float().transpose(-1, -2))
    assert torch.all(vt.float()[..., 10:] == 0)
