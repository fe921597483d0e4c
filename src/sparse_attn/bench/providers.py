"""Built-in benchmark providers (registered on import).

    sparse_attn      sparse_attn.attention, the public API: the Triton kernels on CUDA, the PyTorch
                     reference path elsewhere (so on the CPU it times the reference plus input checks)
    reference        sparse_attn.reference.attention, the fp32 PyTorch twin, without input checks
    adaptive         predict.meansim(q, k) then sparse_attn.attention, both timed (see adaptive_provider)
    flex             torch FlexAttention with ``patterns.to_flex(layout)``; torch.compile'd on CUDA,
                     eager (unfused, materialises the scores) on the CPU
    sdpa-flash       torch SDPA restricted to one backend via torch.nn.attention.sdpa_kernel.
    sdpa-cudnn       These compute DENSE attention (causal-dense when the case is causal) whatever
    sdpa-efficient   the layout: they are the baseline a sparse pattern has to beat. GQA uses
    sdpa-math        ``enable_gqa=True`` where the backend takes it, else K/V are repeated inside
                     the timed call (what a model without GQA support pays).
    grouped-2        dense (causal-dense) attention of batch 1 computed as two query groups, each over
    grouped-loop-2   the K/V prefix it may see (the zigzag-llama3 shape): sparse_attn.grouped_attention
                     in one launch, or grouped_attention_loop (one call per group); they ignore the layout
    sparse_attn-int8       sparse_attn.attention(quant="int8" / "int8-fp8"): the 8-bit path (INT8 Q.K,
    sparse_attn-int8-fp8   bf16/fp16 or FP8 P.V); int8-fp8 needs compute capability 8.9+ on CUDA
    sageattention    PyPI sageattention 1.0.6 (Triton INT8), DENSE like the SDPA rows; unavailable when
                     the package is not installed
    torch-sparse     the layout's exact attention through torch.sparse CSR ops (bench/torch_sparse.py):
                     the baseline a user without a sparse kernel writes; memory O(allowed token pairs)

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


ADAPTIVE_LEVEL = "medium"


@register_provider("adaptive", description="predict.meansim on q/k, then sparse_attn.attention (both timed)")
def adaptive_provider(q, k, v, layout, causal):
    """Adaptive sparsity as a user runs it: every call predicts the layout from these q/k
    (``predict.meansim`` at the ``medium`` level) and attends over it, so the prediction is timed.

    ``layout`` is the case's FLOP-count layout: the runner counts effective FLOPs and density from it,
    so the prediction on these inputs must visit exactly its blocks (checked once, untimed; a
    ValueError otherwise, which the runner records on the row). On ``torch.randn`` inputs no block
    is self-similar and the prediction keeps every visible block: the count layout is dense/causal.
    """
    import sparse_attn
    from sparse_attn.predict import level_params, meansim

    from .flops import visited_blocks
    params = level_params(ADAPTIVE_LEVEL)
    B, H = q.shape[0], q.shape[1]
    predicted = meansim(q, k, causal=causal, block_q=layout.block_q, block_k=layout.block_k, **params)
    got = visited_blocks(predicted, batch=B, heads=H, causal=causal)
    want = visited_blocks(layout, batch=B, heads=H, causal=causal)
    if got != want:
        raise ValueError(f"adaptive: the prediction visits {got} blocks, the case's count layout {want}: "
                         f"its effective FLOPs would be wrong; give the case the layout the prediction makes")

    def forward():
        pred = meansim(q, k, causal=causal, block_q=layout.block_q, block_k=layout.block_k, **params)
        return sparse_attn.attention(q, k, v, pred, causal=causal)
    return forward


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


# ----------------------------------------------------------------------------- torch.sparse
@lru_cache(maxsize=None)
def _torch_sparse_probe(device: str, dtype: torch.dtype) -> str | None:
    """None if the torch-sparse provider runs a tiny local pattern on (device, dtype), else the error."""
    from sparse_attn import patterns

    from .torch_sparse import torch_sparse_provider
    try:
        q, k, v = _probe_inputs(device, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch_sparse_provider(q, k, v, patterns.local(128, 32, block_q=64, block_k=64, device=device), False)()
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "cannot run here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def torch_sparse_available(device) -> tuple[bool, str]:
    device = torch.device(device)
    err = _torch_sparse_probe(str(device), torch.float32)
    if err is not None:
        return False, f"torch.sparse ops do not run on {device.type}: {err}"
    note = " (fp32 / fp64 only: sampled_addmm has no fp16 / bf16 CUDA kernel)" if device.type == "cuda" else ""
    return True, f"torch.sparse CSR (sampled_addmm, row softmax, spmm) on {device.type}{note}"


@register_provider("torch-sparse", available=torch_sparse_available,
                   description="token-level CSR attention with torch.sparse (sampled_addmm, row softmax, "
                               "sparse @ dense), one call per head")
def torch_sparse_provider(q, k, v, layout, causal):
    from .torch_sparse import torch_sparse_provider as build

    def forward():  # torch warns on every call that sparse CSR support is in beta
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = build(q, k, v, layout, causal)
    return forward


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
        # dynamic=False compiles once per shape; past dynamo's recompile limit (8) it would silently run
        # the unfused eager flex instead, so a suite with many lengths (report-gpu) raises the limit.
        import torch._dynamo.config as dynamo_config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
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


# ----------------------------------------------------------------------------- 8-bit attention
def _fp8_available(device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return True, f"the PyTorch emulation of the 8-bit path on {device.type} (ops/sage/reference.py)"
    ok, why = needs_cuda(device)
    if not ok:
        return ok, why
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"FP8 P.V needs compute capability 8.9+, {torch.cuda.get_device_name(device)} is sm_{cap[0]}{cap[1]}"
    return True, "Triton 8-bit kernels, FP8 P.V"


def _quant_builder(quant: str):
    def build(q, k, v, layout, causal):
        import sparse_attn
        return lambda: sparse_attn.attention(q, k, v, layout, causal=causal, quant=quant)
    return build


for _quant, _available in (("int8", always), ("int8-fp8", _fp8_available)):
    register_provider(f"sparse_attn-{_quant}", available=_available,
                      description=f"sparse_attn.attention(quant={_quant!r}, per_warp scales, smoothed K); "
                                  "Triton on CUDA, PyTorch emulation elsewhere")(_quant_builder(_quant))


SAGEATTENTION_VERSION = "1.0.6"


def sageattention_available(device) -> tuple[bool, str]:
    """The PyPI ``sageattention`` package (1.0.6: Triton, INT8 Q.K, FP16 P.V) imports and the device is CUDA."""
    try:
        import sageattention  # noqa: F401
        from importlib.metadata import version
        installed = version("sageattention")
    except Exception as e:  # noqa: BLE001 - ImportError, or triton failing inside its import
        return False, (f"the sageattention package is not importable ({type(e).__name__}: {e}); "
                       f"pip install sageattention=={SAGEATTENTION_VERSION}")
    ok, why = needs_cuda(device)
    if not ok:
        return ok, why
    note = "" if installed == SAGEATTENTION_VERSION else f" (the suites were written for {SAGEATTENTION_VERSION})"
    return True, f"sageattention {installed}{note}"


@register_provider("sageattention", available=sageattention_available, computes="dense",
                   description=f"PyPI sageattention {SAGEATTENTION_VERSION} sageattn (Triton INT8 Q.K, FP16 P.V), "
                               "dense or causal-dense whatever the layout")
def sageattention_provider(q, k, v, layout, causal):
    """``sageattn(q, k, v, tensor_layout="HND", is_causal=causal)`` (smoothed K, per-block scales).

    sageattn subtracts K's mean from ``k`` IN PLACE on every call, so it gets its own copy of K (made
    here, untimed; the subtraction inside each call is its cost and stays timed) and the shared inputs
    the other providers see are left alone. Its head dim must be 64, 96 or 128."""
    from sageattention import sageattn
    own_k = k.detach().clone()
    return lambda: sageattn(q, own_k, v, tensor_layout="HND", is_causal=causal)


# ----------------------------------------------------------------------------- grouped (issue 6)
def prefix_groups(lq: int, lk: int, causal: bool, n: int = 2) -> list:
    """``n`` query groups of ``[Lq]`` whose results together are (causal-)dense attention: group
    ``[a, e)`` attends keys ``[0, e + Lk - Lq)`` (causal, bottom-right aligned) or all keys."""
    from sparse_attn import Group
    cuts = [lq * i // n for i in range(n + 1)]
    return [Group(a, e, 0, max(0, min(lk, e + lk - lq)) if causal else lk) for a, e in zip(cuts, cuts[1:])]


def _grouped_builder(loop: bool):
    def build(q, k, v, layout, causal):
        import sparse_attn
        from sparse_attn.grouped import grouped_attention_loop
        if q.shape[0] != 1:
            raise ValueError(f"grouped providers take batch 1 (packed tokens), got batch {q.shape[0]}")
        fn = grouped_attention_loop if loop else sparse_attn.grouped_attention
        groups = prefix_groups(q.shape[2], k.shape[2], causal)
        # [1, H, L, D] -> packed [L, H, D] views (no copy); the result back as [1, H, L, D]
        return lambda: fn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), groups,
                          causal=causal).transpose(0, 1)[None]
    return build


register_provider("grouped-2", computes="dense",
                  description="(causal-)dense attention as 2 query groups over K/V prefixes, one launch "
                              "(sparse_attn.grouped_attention)")(_grouped_builder(loop=False))
register_provider("grouped-loop-2", computes="dense",
                  description="(causal-)dense attention as 2 query groups over K/V prefixes, one call per "
                              "group (grouped_attention_loop)")(_grouped_builder(loop=True))

__all__ = ["always", "needs_cuda", "flex_available", "with_causal", "prefix_groups"]
