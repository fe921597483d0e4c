"""Input checks for the public API. Bad input never reaches a kernel: every error names what was
received and what is expected."""
from __future__ import annotations

import math
import numbers

import torch

from .layout import BlockLayout, LayoutError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


KERNEL_AUTOCAST = "cuda"  # the device type whose autocast casts the inputs (tests point it at the CPU's)


def autocast_inputs(q, k, v) -> tuple:
    """q, k, v as autocast hands them to attention.

    Inside ``torch.autocast("cuda", dtype=...)`` every CUDA floating-point input but float64 is cast to
    that dtype, as CUDA autocast casts ``scaled_dot_product_attention``'s. Why: an fp32 model trained
    under autocast hands attention fp32 q and k (transformers' rotary embedding computes in fp32) next to
    a bf16 v; SDPA runs that in bf16, and so do we, where the kernels would refuse fp32 and mixed dtypes.
    Inside CPU autocast, CPU inputs of mixed dtypes are promoted to one (``torch.promote_types``): the CPU
    reference computes in fp32 under autocast as outside it, so promoting loses nothing, and fp32 inputs
    keep their fp32 result there. Anything else (no autocast, one dtype, not a tensor: the checks report
    that) comes back as it is. Gradients flow back through the casts in the inputs' own dtypes."""
    device = KERNEL_AUTOCAST
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)

        def cast(t):
            if (isinstance(t, torch.Tensor) and t.device.type == device and t.is_floating_point()
                    and t.dtype not in (torch.float64, dtype)):
                return t.to(dtype)
            return t
        q, k, v = cast(q), cast(k), cast(v)
    if torch.is_autocast_enabled("cpu") and all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                and t.is_floating_point() for t in (q, k, v)):
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (t.to(dtype) for t in (q, k, v))  # (.to of a tensor already in dtype returns it)
    return q, k, v


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq_len, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same heads and seq_len")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[3]}, k has {k.shape[3]}: they must match")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k has {hkv} heads, q has {hq}: Hq must be a multiple of Hkv (GQA/MQA)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[3] == 0:
            raise ValueError(f"{name} has head_dim 0")


def check_packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """Packed q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]`` (varlen and grouped attention);
    errors speak of the packed shapes the caller passed. ``what``: the entry, for the messages."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{what} q/k/v must be packed [total_tokens, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same tokens and heads "
                         "([total_tokens, heads, head_dim])")
    check_qkv(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2))


def check_is_layout(layout, alternative: str = "") -> None:
    """A TypeError unless ``layout`` is a BlockLayout, naming the converter for a mask or index tensor."""
    if not isinstance(layout, BlockLayout):
        hint = ""
        if isinstance(layout, torch.Tensor):  # a block or token mask: say which converter takes it
            hint = (": a bool block mask [Qb, Kb] becomes one with BlockLayout.from_block_mask(mask, block_q=..., "
                    "block_k=..., q_len=..., kv_len=...); top-k indices [B, H, q_blocks, top_k] with "
                    "patterns.from_block_index")
        alternative = f" {alternative}" if alternative else ""
        raise TypeError(f"layout must be a sparse_attn.BlockLayout{alternative}, got {type(layout).__name__}{hint}")


def check_layout(layout: BlockLayout, q: torch.Tensor, k: torch.Tensor) -> BlockLayout:
    """Check the layout fits q/k and is internally consistent; return it on q's device.

    The (host-syncing) consistency check runs once per layout object and is remembered.
    """
    check_is_layout(layout, "(or None)")
    layout.check_token_frame("attention")
    B, Hq, Lq = q.shape[:3]
    Lk = k.shape[2]
    if layout.q_len != Lq or layout.kv_len != Lk:
        hint = ""
        if Hq == layout.q_len and k.shape[1] == layout.kv_len:  # the lengths sit where the heads should be
            hint = ("; q and k look like [batch, seq_len, heads, head_dim]: attention takes [batch, heads, seq_len, "
                    "head_dim], pass q.transpose(1, 2) (and k, v alike)")
        raise LayoutError(f"layout was built for q_len={layout.q_len}, kv_len={layout.kv_len} but q has "
                          f"seq_len {Lq} and k has {Lk}: build the layout with these lengths{hint}")
    if layout.batch not in (1, B):
        raise LayoutError(f"layout has batch {layout.batch}; q has batch {B}: use 1 (broadcast)"
                          + ("" if B == 1 else f" or {B}"))
    if layout.heads not in (1, Hq):
        raise LayoutError(f"layout has {layout.heads} heads; q has {Hq}: use 1 (broadcast)"
                          + ("" if Hq == 1 else f" or {Hq} (one per query head)"))
    layout._ensure_valid()
    if layout.device != q.device:
        cached = layout._device_copies.get(q.device)
        if cached is None:  # (kept per device: one copy alternating between two GPUs was rebuilt each switch)
            cached = layout.to(q.device)
            cached._validated = True
            layout._device_copies[q.device] = cached
        layout = cached
    return layout


def check_flag(name: str, value) -> bool:
    """A True/False argument must be a bool: a string such as ``"no"`` is truthy, and ran as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_causal(causal) -> bool:
    return check_flag("causal", causal)


def check_flags(**flags) -> None:
    """Each keyword a bool (``return_lse="no"`` would have returned the LSE)."""
    for name, value in flags.items():
        check_flag(name, value)


def check_scale(scale) -> float | None:
    """``scale`` as a Python float (numpy scalars too), None kept; a ValueError when it is not a finite
    positive number (a tensor is refused: it would be read back from the device on every call)."""
    if scale is None:
        return None
    ok = isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
    if not ok:
        hint = "; pass a Python float (scale.item())" if isinstance(scale, torch.Tensor) else ""
        raise ValueError(f"scale must be a finite positive number or None (1/sqrt(head_dim)), got {scale!r}{hint}")
    return float(scale)


def needs_grad(q, k, v) -> bool:
    """Whether autograd will ask for gradients of this call: then the kernels' forward records a graph and
    takes the layout's transpose along, and a default layout must be built for the call's own lengths."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def capturing(t) -> bool:
    """Whether ``t`` (a tensor or a device) is on CUDA and the current stream is capturing a CUDA graph."""
    on_cuda = t.type == "cuda" if isinstance(t, torch.device) else bool(getattr(t, "is_cuda", False))
    return on_cuda and torch.cuda.is_current_stream_capturing()


def check_not_capturing(what: str, t, why: str, instead: str) -> None:
    """Refuse, by name, a step that reads ``t``'s values on the host while a CUDA graph is being
    captured: the read itself is illegal there (torch's error names a pinned-memory copy), and a graph
    replayed later would keep what it read now."""
    if capturing(t):
        raise RuntimeError(f"{what} cannot run inside CUDA graph capture: {why}. {instead}")
