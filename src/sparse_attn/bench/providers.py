"""Built-in benchmark providers (registered on import).

    sparse_attn      sparse_attn.attention, the public API: the Triton kernels on CUDA, the PyTorch
                     reference path elsewhere (so on the CPU it times the reference plus input checks)
    reference        sparse_attn.reference.attention, the fp32 PyTorch twin, without input checks
    flex             torch FlexAttention with ``patterns.to_flex(layout)``; torch.compile'd on CUDA,
                     eager (unfused, materialises the scores) on the CPU
    sdpa-flash       torch SDPA restricted to one backend via torch.nn.attention.sdpa_kernel.
    sdpa-cudnn       These compute DENSE attention (causal-dense when the case is causal) whatever
    sdpa-efficient   the layout: they are the baseline a sparse pattern has to beat. GQA uses
    sdpa-math        ``enable_gqa=True`` where the backend takes it, else K/V are repeated inside
                     the timed call (what a model without GQA support pays).

Note ``is_causal`` in SDPA is top-left aligned; the suites only use ``Lq == Lk`` where it agrees
with sparse_attn's bottom-right convention.
"""
from __future__ import annotations

import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F

from .registry import always, needs_cuda, register_provider


# ----------------------------------------------------------------------------- ours
@register_provider("sparse_attn",
                   description="sparse_attn.attention (Triton kernels on CUDA, reference path elsewhere)")
def sparse_attn_provider(q, k, v, layout, causal):
    import sparse_attn
    return lambda: sparse_attn.attention(q, k, v, layout, causal=causal)


@register_provider("reference", description="sparse_attn.reference.attention (fp32 PyTorch twin, blockwise)")
def reference_provider(q, k, v, layout, causal):
    from sparse_attn import reference
    return lambda: reference.attention(q, k, v, layout, causal=causal)


# ----------------------------------------------------------------------------- SDPA backends (dense)
def _backend(name: str):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, name)


def _probe_inputs(device, dtype, hq=2, hkv=2):
    q = torch.randn(1, hq, 128, 64, device=device, dtype=dtype)
    k = torch.randn(1, hkv, 128, 64, device=device, dtype=dtype)
    return q, k, torch.randn_like(k)


@lru_cache(maxsize=None)
def _sdpa_probe(backend: str, device: str, dtype: torch.dtype, gqa: bool) -> str | None:
    """None if the backend runs a tiny problem on (device, dtype[, GQA]), else the error text."""
    from torch.nn.attention import sdpa_kernel
    try:
        q, k, v = _probe_inputs(device, dtype, hkv=1 if gqa else 2)
        with sdpa_kernel(_backend(backend)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.scaled_dot_product_attention(q, k, v, **({"enable_gqa": True} if gqa else {}))
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "cannot run here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _sdpa_available(backend: str, cuda_only: bool):
    def available(device) -> tuple[bool, str]:
        device = torch.device(device)
        if cuda_only:
            ok, why = needs_cuda(device)
            if not ok:
                return ok, why
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        err = _sdpa_probe(backend, str(device), dtype, False)
        if err is not None:
            return False, f"SDPBackend.{backend} cannot run on {device.type}: {err}"
        return True, f"SDPBackend.{backend} on {device.type}"
    return available


def _sdpa_builder(backend: str):
    def build(q, k, v, layout, causal):
        from torch.nn.attention import sdpa_kernel
        group = q.shape[1] // k.shape[1]
        native_gqa = group == 1 or _sdpa_probe(backend, str(q.device), q.dtype, True) is None
        extra = {"enable_gqa": True} if group > 1 and native_gqa else {}
        be = _backend(backend)

        def forward():
            kk, vv = (k, v) if native_gqa else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, **extra)
        return forward
    return build


# The flash backend also has a CPU kernel in torch, so it is probed rather than assumed CUDA-only.
for _name, _backend_name, _cuda_only in (("sdpa-flash", "FLASH_ATTENTION", False),
                                         ("sdpa-cudnn", "CUDNN_ATTENTION", True),
                                         ("sdpa-efficient", "EFFICIENT_ATTENTION", True),
                                         ("sdpa-math", "MATH", False)):
    register_provider(_name, available=_sdpa_available(_backend_name, _cuda_only), computes="dense",
                      description=f"dense SDPA, SDPBackend.{_backend_name} (causal-dense for causal cases)")(
        _sdpa_builder(_backend_name))


# ----------------------------------------------------------------------------- FlexAttention
def _to_flex():
    from sparse_attn.patterns import to_flex  # noqa: PLC0415 - optional until patterns lands
    return to_flex


def with_causal(layout, causal: bool):
    """The layout intersected with the (bottom-right) causal mask when ``causal``."""
    if not causal or layout is None:
        return layout
    from sparse_attn.layout import BlockLayout
    from sparse_attn.masks import ElementMask, causal_term
    tri = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=layout.q_len, kv_len=layout.kv_len,
                                block_q=layout.block_q, block_k=layout.block_k, device=layout.device)
    return layout & tri


@lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


@lru_cache(maxsize=None)
def _flex_cpu_probe() -> str | None:
    try:
        from sparse_attn.layout import BlockLayout
        layout = BlockLayout.from_block_mask(torch.ones(1, 1, dtype=torch.bool), block_q=128, block_k=128)
        block_mask = _to_flex()(layout)
        q, k, v = _probe_inputs("cpu", torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _flex_fn("cpu")(q, k, v, block_mask=block_mask)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def flex_available(device) -> tuple[bool, str]:
    device = torch.device(device)
    try:
        _to_flex()
    except ImportError as e:
        return False, f"sparse_attn.patterns.to_flex is not importable ({e})"
    if device.type == "cuda":
        ok, why = needs_cuda(device)
        return (ok, "torch.compile(flex_attention)" if ok else why)
    err = _flex_cpu_probe()
    if err is not None:
        return False, f"flex_attention does not run on {device.type}: {err}"
    return True, f"eager flex_attention on {device.type} (unfused: materialises the scores)"


@register_provider("flex", available=flex_available,
                   description="FlexAttention with patterns.to_flex(layout) (compiled on CUDA)")
def flex_provider(q, k, v, layout, causal):
    from sparse_attn.layout import BlockLayout
    if layout is None:
        layout = BlockLayout.from_block_mask(
            torch.ones(-(-q.shape[2] // 128), -(-k.shape[2] // 128), dtype=torch.bool, device=q.device),
            block_q=128, block_k=128, q_len=q.shape[2], kv_len=k.shape[2])
    block_mask = _to_flex()(with_causal(layout, causal))
    fn = _flex_fn(q.device.type)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        return lambda: fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    def forward():  # eager flex warns on every call that it is unfused
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    return forward


__all__ = ["always", "needs_cuda", "flex_available", "with_causal"]
