"""The trimmed host path on the GPU: launches through ops.fast_launch and the one-sequence default layout
(api._one_sequence_layout) give the same bits as Triton's own launches and the patterns' layouts, on
decoding steps with a growing cache, prefill, backward and unaligned inputs; fresh random inputs, the
outputs checked against the fp64 reference (DESIGN.md rule 3)."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import api, patterns
from sparse_attn.ops import fast_launch
from sparse_attn.testing import assert_close_to_oracle, oracle_attention, reference_attention

pytestmark = pytest.mark.gpu


def _qkv(B, hq, hkv, lq, lk, d, dtype=torch.bfloat16, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, hq, lq, d), mk(B, hkv, lk, d), mk(B, hkv, lk, d)


def _both_ways(monkeypatch, fn):
    """``fn()`` with fast launches (twice: the second call takes the kept kernels) and with Triton's."""
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    fn()
    fast = fn()
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    slow = fn()
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    return fast, slow


def _equal(a, b):
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_installed_triton_allows_fast_launches():
    assert fast_launch._matches_triton()


@pytest.mark.parametrize("lq,lk,hkv,d", [(1, 8192 + 77, 8, 128), (1, 300, 8, 64), (5, 20001, 4, 128),
                                         (1000, 1000, 8, 128), (200, 3000, 2, 64)])
def test_fast_launches_give_triton_s_bits(monkeypatch, lq, lk, hkv, d):
    q, k, v = _qkv(1, 8, hkv, lq, lk, d, seed=lq + lk)
    fast, slow = _both_ways(monkeypatch, lambda: sparse_attn.attention(q, k, v, causal=True, return_lse=True))
    assert _equal(fast, slow)
    kept = [len(launcher.kernels) for launcher in fast_launch._LAUNCHERS.values()]
    assert sum(kept) > 0, "no kernel was kept: every launch took Triton's path"
    ref = reference_attention(q, k, v, causal=True)
    assert_close_to_oracle(fast[0], ref, oracle_attention(q, k, v, causal=True))


def test_fast_launches_in_backward_give_triton_s_bits(monkeypatch):
    q, k, v = _qkv(1, 8, 2, 700, 900, 128, seed=3, grad=True)
    do = torch.randn_like(q)

    def grads():
        for t in (q, k, v):
            t.grad = None
        sparse_attn.attention(q, k, v, patterns.random(700, kv_len=900, density=0.4, seed=1, device="cuda"),
                              ).backward(do)
        return q.grad.clone(), k.grad.clone(), v.grad.clone()
    fast, slow = _both_ways(monkeypatch, grads)
    # dK/dV are summed in a fixed order; dQ too under the split backward (the default)
    assert _equal(fast, slow)


def test_an_unaligned_input_after_an_aligned_one_takes_its_own_kernel(monkeypatch):
    """A view starting 8 bytes into its storage: Triton compiles it apart (and the forward leaves TMA); the
    fast launcher must not serve it the aligned call's kernel."""
    q, k, v = _qkv(1, 8, 8, 64, 512, 64, dtype=torch.float16, seed=5)
    sparse_attn.attention(q, k, v, causal=True)
    sparse_attn.attention(q, k, v, causal=True)
    buf = torch.empty(q.numel() + 4, device="cuda", dtype=q.dtype)
    q_off = buf[4:].view_as(q)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 != 0
    fast, slow = _both_ways(monkeypatch, lambda: sparse_attn.attention(q_off, k, v, causal=True))
    assert _equal(fast, slow)
    assert_close_to_oracle(fast, reference_attention(q, k, v, causal=True), oracle_attention(q, k, v, causal=True))


def test_a_growing_cache_runs_the_patterns_blocks():
    """Decoding steps through attention(causal=True) with the cache one token longer each call (the default
    layout is api._one_sequence_layout on CUDA): each step's bits equal the same call on
    patterns.causal's layout, across block edges."""
    torch.manual_seed(0)
    cache_k, cache_v = (torch.randn(2, 4, 4200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for lq in (1, 3):
        q = torch.randn(2, 16, lq, 128, device="cuda", dtype=torch.bfloat16)
        for n in range(4090, 4105):
            k, v = cache_k[:, :, :n], cache_v[:, :, :n]
            got = sparse_attn.attention(q, k, v, causal=True, return_lse=True)
            want = sparse_attn.attention(q, k, v, patterns.causal(lq, n, device="cuda"), return_lse=True)
            assert _equal(got, want), (lq, n)
        # forward-only steps plan in the kernel: no default layout built
        assert not any((True, lq, n, str(q.device)) in api._DEFAULT_LAYOUTS for n in range(4090, 4105))
    assert_close_to_oracle(got[0], reference_attention(q, k, v, causal=True), oracle_attention(q, k, v, causal=True))


@pytest.mark.parametrize("quant", [None, "int8", "int8-fp8"])
def test_a_layout_shared_by_forward_only_steps_gives_each_step_s_bits(monkeypatch, quant):
    """Forward-only calls at lengths of one plan: 8-bit ones run the layout built for the first of them,
    fp16/bf16 ones the kernels' device plan (no layout); each gives the bits of its own patterns layout, and
    a call needing gradients at such lengths gets a layout of its own lengths and the patterns layout's
    gradients."""
    monkeypatch.setattr(api, "_DEFAULT_LAYOUTS", {})  # (an earlier case's grad call left an exact layout)
    monkeypatch.setattr(api, "_SHARED_PLANS", api.PlanCache(api.DEFAULT_LAYOUTS_KEPT))
    q, k, v = _qkv(1, 32, 8, 5, 3000, 128, seed=4)
    with torch.no_grad():
        for n in (2950, 2977, 2999):
            got = sparse_attn.attention(q, k[:, :, :n], v[:, :, :n], causal=True, return_lse=True, quant=quant)
            want = sparse_attn.attention(q, k[:, :, :n], v[:, :, :n], patterns.causal(5, n, device="cuda"),
                                         return_lse=True, quant=quant)
            assert _equal(got, want), n
    key = (True, 5, 2999, str(q.device))
    if quant is not None:
        assert api._DEFAULT_LAYOUTS[key].kv_len == 2950
        return
    assert key not in api._DEFAULT_LAYOUTS
    x = [t.clone().requires_grad_() for t in (q, k[:, :, :2999], v[:, :, :2999])]
    y = [t.detach().clone().requires_grad_() for t in x]
    out = sparse_attn.attention(*x, causal=True)
    assert api._DEFAULT_LAYOUTS[key].kv_len == 2999
    want = sparse_attn.attention(*y, patterns.causal(5, 2999, device="cuda"))
    assert torch.equal(out, want)
    for a, b in zip(torch.autograd.grad(out.float().square().sum(), x),
                    torch.autograd.grad(want.float().square().sum(), y)):
        assert torch.equal(a, b)


def test_repeated_fast_calls_do_not_grow_memory():
    q, k, v = _qkv(1, 32, 8, 1, 32768, 128, seed=9)
    for _ in range(3):
        sparse_attn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        sparse_attn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_continuous_batching_steps_plan_on_the_device_and_give_each_step_s_bits(monkeypatch):
    """varlen_attention without layouts, 8 sequences (1-3 query rows) whose caches grow a token a step:
    forward-only steps run the kernels' device plan (no plan built on the host), and each step gives the
    bits of its own per-sequence patterns.causal layouts; the last step's output against the fp64 reference
    per sequence."""
    monkeypatch.setattr(api, "_VARLEN_PLANS", api.PlanCache(16))
    monkeypatch.setattr(api, "_SHARED_VARLEN_PLANS", api.PlanCache(16))
    g = torch.Generator(device="cuda").manual_seed(8)
    q_lens = [1, 3, 1, 2, 1, 1, 1, 3]
    base = [1000, 4090, 130, 2500, 3000, 700, 1900, 260]
    caches = [torch.randn(2, 2, n + 8, 128, device="cuda", generator=g).bfloat16() for n in base]  # k, v [Hkv, n, D]
    q = torch.randn(sum(q_lens), 16, 128, device="cuda", generator=g).bfloat16()

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    for step in range(8):  # 4090 + 7 keys: the second sequence's 33rd block
        k_lens = [n + step for n in base]
        k, v = (torch.cat([c[i, :, :n].transpose(0, 1) for c, n in zip(caches, k_lens)]) for i in (0, 1))
        args = (q, k, v, cu(q_lens), cu(k_lens), 3, max(k_lens))
        planned = len(api._VARLEN_PLANS)  # the pattern calls' (want, below)
        got = sparse_attn.varlen_attention(*args, causal=True, return_lse=True)
        assert len(api._VARLEN_PLANS) == planned and len(api._SHARED_VARLEN_PLANS) == 0, step
        want = sparse_attn.varlen_attention(*args, pattern=patterns.causal, return_lse=True)
        assert _equal(got, want), step
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    for i, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        qs = q[starts[i]:starts[i + 1]].transpose(0, 1)[None]
        ks, vs = (caches[i][j, :, :lk][None] for j in (0, 1))
        assert_close_to_oracle(got[0][starts[i]:starts[i + 1]].transpose(0, 1)[None],
                               reference_attention(qs, ks, vs, causal=True), oracle_attention(qs, ks, vs, causal=True))


@pytest.mark.parametrize("quant", [None, "int8"])
def test_varlen_offsets_on_the_cpu_give_the_same_bits_without_a_sync(quant):
    """cu_seqlens given on the CPU: the plan reads them without a sync (checked with CUDA's sync debug mode
    set to error, at lengths already planned and at new ones), the kernels get a copy, and outputs, LSE and
    gradients equal those of offsets on the GPU bit for bit; inside a graph capture the call refuses by name."""
    g = torch.Generator(device="cuda").manual_seed(12)
    q_lens, k_lens = [1, 2, 1, 3], [3000, 517, 4097, 1200]
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(sum(k_lens) + 8, 8, 128, device="cuda", generator=g).bfloat16() for _ in range(2))

    def offsets(lens, device):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)

    def call(q, k, v, lens, device, **kw):
        t = sum(lens)
        return sparse_attn.varlen_attention(q, k[:t], v[:t], offsets(q_lens, device), offsets(lens, device), 3,
                                            max(lens), causal=True, quant=quant, **kw)

    want = call(q, k, v, k_lens, "cuda", return_lse=True)
    assert _equal(call(q, k, v, k_lens, "cpu", return_lse=True), want)
    grown = [n + 2 for n in k_lens]
    want_grown = call(q, k, v, grown, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = call(q, k, v, k_lens, "cpu", return_lse=True)
        got_grown = call(q, k, v, grown, "cpu")  # a step at new lengths: planned here, from the host values
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _equal(got, want) and torch.equal(got_grown, want_grown)
    if quant is None:
        x, y = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
        a, b = call(*x, k_lens, "cpu"), call(*y, k_lens, "cuda")
        assert torch.equal(a, b)
        grads = (torch.autograd.grad(out.float().square().sum(), inputs) for out, inputs in ((a, x), (b, y)))
        assert all(torch.equal(ga, gb) for ga, gb in zip(*grads))
    # inside a capture: the 16-bit call plans on the device, but a copy of host offsets would be frozen; the
    # 8-bit call plans on the host
    refusal = (ValueError, "pass it on cuda") if quant is None else (RuntimeError, "cannot run inside CUDA graph capture")
    with pytest.raises(refusal[0], match=refusal[1]):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call(q, k, v, k_lens, "cpu")
    assert torch.equal(call(q, k, v, k_lens, "cpu"), want[0])  # CUDA still usable
