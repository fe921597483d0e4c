"""Inputs inside torch.autocast (validation.autocast_inputs): under CUDA autocast, CUDA inputs are cast to its
dtype as SDPA's are (an fp32 model's rotary q / k next to a bf16 v); under CPU autocast, mixed CPU inputs are
promoted to one dtype (the reference computes in fp32 there anyway). CUDA autocast cannot be switched on
without a GPU, so the end-to-end tests point the kernel-side rule at the CPU's autocast
(``validation.KERNEL_AUTOCAST``): the same code, the CPU's reference behind it. tests/gpu/test_kernels_gpu.py
runs the real thing."""
from __future__ import annotations

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, validation
from sparse_attn.grouped import Group

BF16 = torch.bfloat16


@pytest.fixture
def cpu_as_kernel_autocast(monkeypatch):
    monkeypatch.setattr(validation, "KERNEL_AUTOCAST", "cpu")


def _qkv(shape_q, shape_kv, seed=0):
    """fp32 q and k, as a rotary embedding returns them, next to a bf16 v; all leaves."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g).requires_grad_()
    k = torch.randn(*shape_kv, generator=g).requires_grad_()
    v = torch.randn(*shape_kv, generator=g).to(BF16).requires_grad_()
    return q, k, v


def test_outside_autocast_the_inputs_come_back_as_they_are(cpu_as_kernel_autocast):
    q, k, v = torch.randn(2, 3), torch.randn(2, 3).half(), torch.randn(2, 3).double()
    got = validation.autocast_inputs(q, k, v)
    assert got[0] is q and got[1] is k and got[2] is v
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        got = validation.autocast_inputs(q, k, v)
    assert got[0] is q and got[1] is k and got[2] is v


def test_kernel_autocast_casts_every_float_input_but_float64(cpu_as_kernel_autocast):
    """SDPA's rule: fp32 and fp16 become autocast's dtype, float64 stays (the checks then refuse the mix by
    name), a non-tensor is left for the checks to report, another device type's tensor is left to its autocast."""
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=BF16):
        q, k, v = validation.autocast_inputs(x, x.half(), x.bfloat16())
        assert (q.dtype, k.dtype, v.dtype) == (BF16, BF16, BF16)
        assert torch.equal(q, x.to(BF16)) and torch.equal(k, x.half().to(BF16))
        d, n, elsewhere = x.double(), [1.0], torch.empty(4, 5, device="meta")
        got = validation.autocast_inputs(d, n, elsewhere)
        assert got[0] is d and got[1] is n and got[2] is elsewhere  # (a tensor on another device type)


def test_kernel_autocast_leaves_other_devices_inputs_alone():
    """With the default rule (CUDA's autocast) CPU tensors are never cast to autocast's dtype: under CPU
    autocast one dtype stays as it is (fp32 keeps its fp32 reference result, test_reference)."""
    x = torch.randn(4, 5)
    with torch.autocast("cpu", dtype=BF16):
        got = validation.autocast_inputs(x, x, x)
    assert all(t is x for t in got)


def test_cpu_autocast_promotes_mixed_inputs_to_one_dtype():
    """An fp32 model under CPU autocast: fp32 q / k and a bf16 v ran into "q, k, v must share a dtype"; now
    the reference gets them all in fp32 and gives what fp32 inputs give outside autocast."""
    q, k, v = _qkv((1, 2, 40, 16), (1, 2, 40, 16))
    lay = patterns.local(40, 16, block_q=16, block_k=16)
    with torch.autocast("cpu", dtype=BF16):
        out = sparse_attn.attention(q, k, v, lay, causal=True)
    assert out.dtype == torch.float32
    want = sparse_attn.attention(q.detach(), k.detach(), v.detach().float(), lay, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == BF16


def _same_as_cast_call(call, q, k, v):
    """``call`` inside (kernel-rule) autocast on fp32 / fp32 / bf16 leaves gives, bit for bit, the output and
    the gradients (in each leaf's own dtype) of the same call on bf16 copies outside autocast."""
    with torch.autocast("cpu", dtype=BF16):
        out = call(q, k, v)
    assert out.dtype == BF16
    cast = [t.detach().to(BF16).requires_grad_() for t in (q, k, v)]
    want = call(*cast)
    assert torch.equal(out, want)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(BF16)
    got_grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want_grads = torch.autograd.grad(want, cast, grad_out)
    for leaf, got, w in zip((q, k, v), got_grads, want_grads, strict=True):
        assert got.dtype == leaf.dtype
        assert torch.equal(got, w.to(leaf.dtype))


def test_attention_runs_in_autocasts_dtype(cpu_as_kernel_autocast):
    q, k, v = _qkv((1, 4, 37, 16), (1, 2, 37, 16), seed=1)
    lay = patterns.local(37, 16, block_q=16, block_k=16)
    _same_as_cast_call(lambda q, k, v: sparse_attn.attention(q, k, v, lay, causal=True), q, k, v)


def test_varlen_attention_runs_in_autocasts_dtype(cpu_as_kernel_autocast):
    q, k, v = _qkv((50, 4, 16), (50, 2, 16), seed=2)
    cu = torch.tensor([0, 21, 50], dtype=torch.int32)
    _same_as_cast_call(lambda q, k, v: sparse_attn.varlen_attention(q, k, v, cu, cu, 29, 29, causal=True), q, k, v)


def test_grouped_attention_runs_in_autocasts_dtype(cpu_as_kernel_autocast):
    q, k, v = _qkv((30, 2, 16), (45, 2, 16), seed=3)
    groups = [Group(0, 10, 0, 20), Group(10, 30, 0, 45)]
    _same_as_cast_call(lambda q, k, v: sparse_attn.grouped_attention(q, k, v, groups), q, k, v)


def test_the_transformers_attention_function_runs_in_autocasts_dtype(cpu_as_kernel_autocast):
    """The integration's attention function under autocast. (Its own cast, which its padded-batch path needs on
    CUDA, where it launches the kernels without attention(), is covered by the GPU test
    test_an_fp32_model_under_autocast_runs_like_sdpa: on the CPU every call goes through attention().)"""
    transformers = pytest.importorskip("transformers")
    from sparse_attn.integrations import transformers as sat
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    attn = transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn
    q, k, v = _qkv((2, 4, 24, 16), (2, 2, 24, 16), seed=4)
    _same_as_cast_call(lambda q, k, v: sat.sparse_attention_forward(attn, q, k, v, None, scaling=0.25)[0], q, k, v)
