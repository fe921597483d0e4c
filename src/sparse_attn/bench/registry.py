"""The one benchmark registry (the project's design rule 9: one registry of providers and modes,
effective TFLOP/s from the blocks actually computed, JSON out): named providers, three modes.

A *provider* is a function ``build(q, k, v, layout, causal) -> forward`` registered with
:func:`register_provider`. ``build`` does every piece of set-up that must not be timed (building
a FlexAttention ``BlockMask``, compiling, repeating K/V for a backend without GQA) and returns a
zero-argument closure that computes the attention output once. :meth:`Provider.make_run` wraps
that closure for a mode:

    fwd       time ``forward()``
    bwd       run ``out = forward()`` once, then time ``out.backward(grad, retain_graph=True)``
    fwd+bwd   time ``forward().backward(grad)``

Adding a provider is one decorated function (``q [B, Hq, Lq, D]``, ``k`` / ``v [B, Hkv, Lk, D]``, the
case's layout or None, ``causal``), e.g. the public API on CUDA only::

    @register_provider("ours-cuda", available=needs_cuda, description="sparse_attn.attention on CUDA")
    def ours_cuda(q, k, v, layout, causal):
        import sparse_attn
        return lambda: sparse_attn.attention(q, k, v, layout, causal=causal)

``available(device) -> (ok, reason)`` says whether the provider can run on a device at all; a
provider that can run but not on some input (a dtype, a head dim) raises inside ``build`` or the
closure, and the runner records the error on that row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MODES = ("fwd", "bwd", "fwd+bwd")
COMPUTES = ("sparse", "dense")

Forward = Callable[[], torch.Tensor]
Builder = Callable[..., Forward]
Availability = Callable[[torch.device], "tuple[bool, str]"]


def always(device: torch.device) -> tuple[bool, str]:
    return True, f"runs on {torch.device(device).type}"


def needs_cuda(device: torch.device) -> tuple[bool, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, "CUDA"


@dataclass
class Run:
    """A timed closure plus the tensors whose ``.grad`` the timer resets between repetitions."""

    fn: Callable[[], object]
    grad_to_none: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class Provider:
    """A registered way of computing attention; see the module docstring."""

    name: str
    build: Builder
    available: Availability
    computes: str = "sparse"  # "dense": ignores the layout (a dense / causal-dense baseline)
    description: str = ""

    def make_run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, causal: bool,
                 mode: str) -> Run:
        """Set up (untimed) and return the closure to time for ``mode``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        forward = self.build(q, k, v, layout, causal)
        if mode == "fwd":
            return Run(forward)
        leaves = tuple(t for t in (q, k, v) if t.requires_grad)
        if not leaves:
            raise ValueError(f"mode {mode!r} needs q, k, v with requires_grad=True")
        out = forward()
        grad = torch.randn_like(out)
        if mode == "bwd":
            return Run(lambda: out.backward(grad, retain_graph=True), leaves)
        return Run(lambda: forward().backward(grad), leaves)


PROVIDERS: dict[str, Provider] = {}


def register_provider(name: str, *, available: Availability = always, computes: str = "sparse",
                      description: str | None = None) -> Callable[[Builder], Builder]:
    """Decorator: register ``build(q, k, v, layout, causal) -> forward`` under ``name``."""
    if computes not in COMPUTES:
        raise ValueError(f"computes must be one of {COMPUTES}, got {computes!r}")

    def deco(build: Builder) -> Builder:
        if name in PROVIDERS:
            raise ValueError(f"provider {name!r} is already registered")
        doc = description if description is not None else (build.__doc__ or "").strip().split("\n")[0]
        PROVIDERS[name] = Provider(name, build, available, computes, doc)
        return build

    return deco


def unregister_provider(name: str) -> None:
    PROVIDERS.pop(name, None)


def _load_builtin() -> None:
    from . import providers  # noqa: F401  (registers the built-in providers on import)


def get_provider(name: str) -> Provider:
    """The registered provider ``name`` (the built-ins load on first use); KeyError listing the names."""
    _load_builtin()
    if name not in PROVIDERS:
        raise KeyError(f"unknown provider {name!r}; registered: {', '.join(PROVIDERS)}")
    return PROVIDERS[name]


def provider_names() -> list[str]:
    """Every registered provider's name, in registration order."""
    _load_builtin()
    return list(PROVIDERS)
