"""The kernels' device plan (launch.forward ``device_plan``, kernels.fwd_kernel DEVICE_PLAN): forward-only
dense / causal varlen calls whose rows the kernel plans from the offsets, with no host plan. It must give the
host plan's bits, keep bad offsets inside the tensors, and be what a captured varlen call runs. Under
TRITON_INTERPRET=1 (conftest.py) on small fp16 cases."""
from __future__ import annotations

import os
import random

import pytest
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.ops.block_sparse import launch, varlen_attention_op, varlen_device_plan_op
from sparse_attn.varlen import stack_dense_or_causal

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="interpreter tests run only without a GPU")


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def _packed(q_lens, k_lens, seed: int, hq: int = 4, hkv: int = 2, d: int = 32):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).half()  # noqa: E731
    return mk(sum(q_lens), hq), mk(sum(k_lens), hkv), mk(sum(k_lens), hkv)


def _host_plan(q, k, v, q_lens, k_lens, causal, max_q, max_k):
    """The same call on the host's plan (what a call that needs gradients runs)."""
    layout = stack_dense_or_causal(q_lens, k_lens, causal, max_q, max_k, "cpu")
    return varlen_attention_op(q, k, v, layout, _cu(q_lens), _cu(k_lens), max_q, max_k, tuple(k_lens),
                               return_lse=True)


def test_the_device_plan_gives_the_host_plan_s_bits():
    """Random batches over the plan's cases: empty sequences (no queries, no keys), more queries than keys
    (causal rows with no key), key lengths around the 128-key block (a cut last block before, at and
    after the causal edge), several query blocks, GQA, and max_seqlen above the longest sequence."""
    rnd = random.Random(0)
    for trial in range(10):
        n_seqs = rnd.randint(1, 3)
        q_lens = [rnd.choice([0, 1, 2, 3, 17, 128, 130]) for _ in range(n_seqs)]
        k_lens = [rnd.choice([0, 1, 5, 127, 128, 129, 200, 257]) for _ in range(n_seqs)]
        causal = trial % 3 != 0
        max_q, max_k = max(q_lens) + rnd.choice([0, 5]), max(k_lens) + rnd.choice([0, 9])
        q, k, v = _packed(q_lens, k_lens, trial)
        got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, causal, return_lse=True)
        want = _host_plan(q, k, v, q_lens, k_lens, causal, max_q, max_k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (q_lens, k_lens, causal)


def test_the_device_plan_s_causal_edge_and_cut_blocks_are_masked():
    """Not only equal to the host plan: equal to the per-sequence patterns layouts through the API, where
    a wrong edge (a causal block walked unmasked, a cut block's keys past the end) would show. Sequences:
    two query blocks on a cut key block, one query on 129 keys, queries past their keys."""
    q_lens, k_lens = [130, 1, 5], [200, 129, 3]
    q, k, v = _packed(q_lens, k_lens, 7)
    for causal in (False, True):
        got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), 130, 200, causal, return_lse=True)
        builder = patterns.causal if causal else patterns.dense
        want = sparse_attn.varlen_attention(q.float(), k.float(), v.float(), _cu(q_lens), _cu(k_lens), 130, 200,
                                            pattern=lambda lq, lk: builder(lq, lk), return_lse=True)
        assert torch.allclose(got[0].float(), want[0], atol=2e-3), causal
        finite = torch.isfinite(want[1])
        assert torch.equal(finite, torch.isfinite(got[1])), causal  # causal rows with no key: LSE -inf
        assert torch.allclose(got[1][finite], want[1][finite], atol=1e-3), causal


def test_offsets_past_the_tensors_are_cut_to_them():
    """Offsets the host never read (inside a CUDA graph capture) may be wrong; the kernels then cut each
    sequence to the packed tensors (_clamped_bounds) instead of reading or writing past them: the result is
    the call on the cut offsets."""
    q_lens, k_lens = [3, 2], [40, 30]
    q, k, v = _packed(q_lens, k_lens, 3)
    bad_q = torch.tensor([0, 3, 1000], dtype=torch.int32)  # 5 query tokens
    bad_k = torch.tensor([-7, 40, 90], dtype=torch.int32)  # 70 key tokens
    got = varlen_device_plan_op(q, k, v, bad_q, bad_k, 8, 64, True, return_lse=True)
    want = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), 8, 64, True, return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_launch_refuses_a_device_plan_it_cannot_run():
    q, k, v = _packed([2], [9], 0)
    cu_q, cu_k = _cu([2]), _cu([9])
    for kwargs, blocks in (({"device_plan": 3}, (128, 128)), ({"device_plan": 1}, (64, 128)),
                           ({"device_plan": 2, "quant": 1}, (128, 128))):
        with pytest.raises(ValueError, match="a device plan is dense"):
            launch.forward(q, k, v, cu_q, None, None, None, None, True, None, 0, cu_q, cu_k, *blocks, 0.1, 2, 9,
                           **kwargs)


def _kernels_on_cpu(monkeypatch, capture: bool):
    """varlen_attention as on CUDA (the kernels, here interpreted), with a CUDA graph capture faked."""
    from sparse_attn import api, validation, varlen
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    monkeypatch.setattr(api, "_plans_on_host", lambda device: True)
    monkeypatch.setattr(api, "_VARLEN_PLANS", api.PlanCache(16))
    for module in (validation, varlen):
        monkeypatch.setattr(module, "capturing", lambda t: capture)
    return api


def test_a_captured_forward_only_call_reads_no_offsets_on_the_host(monkeypatch):
    """Inside a capture (faked) a forward-only dense / causal call runs the device plan without reading the
    offsets' values (a host read is what capture forbids) and builds no plan; calls that need the host's
    plan (gradients, a pattern, quant) are refused by name, as are offsets on the CPU (a replay would keep
    the copy made at capture)."""
    api = _kernels_on_cpu(monkeypatch, capture=True)
    q_lens, k_lens = [1, 2], [70, 130]
    q, k, v = _packed(q_lens, k_lens, 4)
    want = _host_plan(q, k, v, q_lens, k_lens, True, 2, 130)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    read = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: read.append(t) or tolist(t))
    got = sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 2, 130, causal=True, return_lse=True)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert read == [] and len(api._VARLEN_PLANS) == 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    refused = {"gradients": dict(grad=True), "pattern": dict(pattern=patterns.causal), "quant": dict(quant="int8")}
    for why, kwargs in refused.items():
        grad = kwargs.pop("grad", False)
        qg = q.clone().requires_grad_(grad)
        with pytest.raises(RuntimeError, match="cannot run inside CUDA graph capture.*forward-only calls"):
            sparse_attn.varlen_attention(qg, k, v, cu_q, cu_k, 2, 130, causal=why != "pattern", **kwargs)


def test_a_captured_call_refuses_offsets_it_would_have_to_copy(monkeypatch):
    """Offsets on the CPU reach the kernels by a copy from host memory, which a replay would not redo."""
    from sparse_attn import varlen
    monkeypatch.setattr(varlen, "capturing", lambda t: True)
    with pytest.raises(ValueError, match="inside CUDA graph capture pass it on cuda"):
        varlen.check_cu_seqlens("cu_seqlens_q", _cu([1, 2]), 3, 2, torch.device("cuda"), plan_on_device=True)
    assert varlen.check_cu_seqlens("cu_seqlens_q", _cu([1, 2]), 3, 2, torch.device("cpu"), plan_on_device=True) is None
    with pytest.raises(TypeError, match="max_seqlen for cu_seqlens_q must be an int"):
        varlen.check_cu_seqlens("cu_seqlens_q", _cu([1, 2]), 3, 2.0, torch.device("cpu"), plan_on_device=True)


def test_attention_without_a_layout_plans_on_the_device_with_the_patterns_bits(monkeypatch):
    """attention() without a layout, nothing requiring grad: the kernels' device plan on padded inputs (the
    lengths are the tensors'), for several query blocks, Lq above and below Lk (bottom-right causal rows with
    no key), cut last blocks and GQA; the bits of the same call on the patterns' layout, no default layout
    built. With grad the call builds and runs the host's layout."""
    api = _kernels_on_cpu(monkeypatch, capture=False)
    monkeypatch.setattr(api, "_DEFAULT_LAYOUTS", {})
    from sparse_attn.ops.block_sparse import attention_op
    g = torch.Generator().manual_seed(9)
    for lq, lk in ((130, 257), (257, 130), (200, 200), (1, 1), (3, 129)):
        q = torch.randn(2, 4, lq, 32, generator=g).half()
        k, v = (torch.randn(2, 2, lk, 32, generator=g).half() for _ in range(2))
        for causal in (False, True):
            got = sparse_attn.attention(q, k, v, causal=causal, return_lse=True)
            assert api._DEFAULT_LAYOUTS == {}, (lq, lk, causal)
            builder = patterns.causal if causal else patterns.dense
            want = attention_op(q, k, v, builder(lq, lk), return_lse=True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lq, lk, causal)
    qg = q.clone().requires_grad_()
    assert torch.equal(sparse_attn.attention(qg, k, v, causal=True), want[0])
    assert (True, lq, lk, "cpu") in api._DEFAULT_LAYOUTS
