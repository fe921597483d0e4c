"""Kernel launches on the inputs' GPU.

Triton launches a kernel on the *current* CUDA device, on that device's current stream
(``triton.runtime.jit``: ``driver.active.get_current_device()``), and so does
:mod:`sparse_attn.ops.fast_launch`. A model spread over GPUs without changing the current device
(``device_map="auto"`` in transformers / accelerate: layers on cuda:1 while cuda:0 stays current) handed
our entry points tensors on cuda:1: their kernels ran on cuda:0, on a stream not ordered after the work
that made the inputs, reading cuda:1's memory through peer access or failing with an illegal address.
CUDA ops of torch take the device guard from their inputs; the public entry points here take it from
their first tensor argument with :func:`on_inputs_device`. (Autograd runs a CUDA backward on a thread whose
current device is the tensors', and ``torch.compile``'s generated code guards the device itself.)
"""
from __future__ import annotations

import functools

import torch


def _cuda_device(x) -> torch.device | None:
    """``x``'s CUDA device (a tensor's or a BlockLayout's), None for anything else."""
    device = getattr(x, "device", None)
    return device if isinstance(device, torch.device) and device.type == "cuda" else None


def on_inputs_device(name: str = "q", position: int = 0):
    """Decorate an entry point so its body runs with the CUDA device of its argument ``name`` (passed at
    ``position`` or by keyword; a tensor or a layout) current, when another one is; otherwise (CPU inputs,
    the device already current, while torch.compile traces) the body runs as it is, at the cost of an
    attribute read and a compare."""
    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not torch.compiler.is_compiling():
                device = _cuda_device(args[position] if len(args) > position else kwargs.get(name))
                if device is not None and device.index is not None and device.index != torch.cuda.current_device():
                    with torch.cuda.device(device):
                        return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return run
    return decorate
