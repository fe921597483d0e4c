"""The host path of a kernel call (benchmarks/host_overhead_probe.py): what was trimmed from it must not
change what runs. Under TRITON_INTERPRET=1 (conftest.py) on small fp16 cases."""
from __future__ import annotations

import os

import pytest
import torch
import triton

from sparse_attn import patterns
from sparse_attn.ops.block_sparse import attention_op, function, launch

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter tests run only without a GPU")


def test_host_integer_helpers_match_triton():
    """_cdiv / _next_pow2 stand in for triton.cdiv / triton.next_power_of_2 in launch code."""
    for n in range(0, 3000):
        assert launch._next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 129):
            assert launch._cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: (torch.randn(*s, generator=g) * 2).half().requires_grad_(grad)  # noqa: E731
    return mk(1, 4, 3, 32), mk(1, 2, 80, 32), mk(1, 2, 80, 32)


def _spy_function(monkeypatch) -> list:
    """Count the calls that go through the autograd Function."""
    calls, apply = [], function._EagerForward.apply
    monkeypatch.setattr(function._EagerForward, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


@interpreted
def test_forward_without_grad_skips_the_autograd_function(monkeypatch):
    """Inference calls run the implementation directly and return what the Function returns, bit for bit;
    a call whose inputs require grad still goes through the Function and gets gradients."""
    layout = patterns.causal(3, 80, block_q=16, block_k=16)
    calls = _spy_function(monkeypatch)
    q, k, v = _inputs(grad=True)
    out_grad, lse_grad = attention_op(q, k, v, layout, return_lse=True)
    assert len(calls) == 1 and out_grad.grad_fn is not None
    out_grad.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0

    with torch.no_grad():  # inputs that require grad, grad mode off
        out_ng, lse_ng = attention_op(q, k, v, layout, return_lse=True)
    plain = tuple(t.detach() for t in (q, k, v))  # grad mode on, no input requires grad
    out_plain, lse_plain = attention_op(*plain, layout, return_lse=True)
    assert len(calls) == 1  # neither went through the Function
    for out, lse in ((out_ng, lse_ng), (out_plain, lse_plain)):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, out_grad.detach()) and torch.equal(lse, lse_grad.detach())


@interpreted
def test_layout_edit_after_a_call_is_still_seen():
    """The leaner fingerprint still notices an in-place edit of a layout's indices: the second call runs
    the edited layout (here: every block dropped, so zeros), not the cached schedule."""
    layout = patterns.dense(32, 64, block_q=16, block_k=16)
    q, k, v = _inputs(grad=False)
    q = q[:, :, :1].expand(1, 4, 32, 32).contiguous()
    first = attention_op(q, k[:, :, :64], v[:, :, :64], layout)
    assert first.abs().sum() > 0
    layout.kv_counts.zero_()
    second = attention_op(q, k[:, :, :64], v[:, :, :64], layout)
    assert torch.equal(second, torch.zeros_like(second))


def _schedule_rows(layout):
    from sparse_attn.ops.block_sparse.schedule import schedule
    s = schedule(layout)
    live = torch.arange(s.indices.shape[-1]) < s.counts[..., None]
    return (s.counts, s.n_full, torch.where(s.n_full > 0, s.full_start, 0), torch.where(live, s.indices, -1),
            torch.where(live, s.mask_ids, -1) >= 0, s.contiguous)


@pytest.mark.parametrize("causal", [False, True])
def test_one_sequence_layout_is_the_patterns_layout(causal):
    """A CUDA call without a layout runs api._one_sequence_layout (built here on the CPU): the blocks, mask
    terms and forward schedule of patterns.dense / causal on decoding, prefill and Lq > Lk shapes."""
    from sparse_attn import api
    builder = patterns.causal if causal else patterns.dense
    for lq, lk in [(1, 1), (1, 127), (1, 128), (1, 32769), (4, 300), (16, 4096), (300, 300), (129, 1000),
                   (1000, 129), (256, 256), (2, 0), (640, 5000)]:
        fast = api._one_sequence_layout(causal, lq, lk, "cpu")
        slow = builder(lq, lk, block_q=128, block_k=128)
        assert (fast.q_len, fast.kv_len, fast.block_q, fast.block_k) == (slow.q_len, slow.kv_len, 128, 128)
        rows = _schedule_rows(fast)
        for a, b in zip(rows, _schedule_rows(slow)):
            assert (a == b) if isinstance(a, bool) else torch.equal(a, b), (lq, lk)
        # the causal term, unless no block is partial (patterns.causal then leaves it out; unused, it changes nothing)
        assert set(fast.masks) == set(slow.masks) or not rows[4].any(), (lq, lk)
        assert (patterns.causal_cut(fast) is fast) == causal  # marked as its own causal cut


@interpreted
@pytest.mark.parametrize("lq,lk", [(1, 300), (3, 257), (130, 200)])
def test_one_sequence_layout_runs_as_the_patterns_layout(lq, lk):
    """The kernels give the same bits on both layouts (the causal term aligned bottom-right)."""
    from sparse_attn import api
    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).half() for n in (lq, lk, lk))
    fast = attention_op(q, k, v, api._one_sequence_layout(True, lq, lk, "cpu"), return_lse=True)
    slow = attention_op(q, k, v, patterns.causal(lq, lk), return_lse=True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_plan_tensors_start_on_16_byte_boundaries():
    """A host-built plan's tensors share one copy; each starts 16-byte aligned whatever the plan's sizes,
    or a decoding loop compiles a new kernel variant (pointer alignment) as its cache grows."""
    from sparse_attn import api, varlen
    from sparse_attn.ops.block_sparse.schedule import schedule
    for lk in range(1000, 1000 + 129 * 5, 129):
        for layout in (api._one_sequence_layout(True, 1, lk, "cpu"),
                       varlen.stack_dense_or_causal([1, 2, 3], [lk, lk + 7, 5], True, 3, lk + 7, "cpu")):
            s = schedule(layout, [lk] if layout.batch == 1 else [lk, lk + 7, 5])
            for t in (s.counts, s.n_full, s.full_start, s.indices, s.mask_ids):
                assert t.data_ptr() % 16 == 0, (lk, tuple(t.shape))
