"""Kernel launches on the inputs' GPU.

Triton launches a kernel on the *current* CUDA device, on that device's current stream
(``triton.runtime.jit``: ``driver.active.get_current_device()``), and so does
:mod:`sparse_attn.ops.fast_launch`. A model spread over GPUs without changing the current device
(``device_map="auto"`` in transformers / accelerate: layers on cuda:1 while cuda:0 stays current) handed
our entry points tensors on cuda:1: their kernels ran on cuda:0, on a stream not ordered after the work
that made the inputs, reading cuda:1's memory through peer access or failing with an illegal address.
CUDA ops of torch take the device guard from their inputs; the public entry points here take it from
their q (``prepare``: the layout; the transformers attention function: its query) with
:func:`on_inputs_device`. (Autograd runs a CUDA backward on a thread whose current device is the
tensors', and ``torch.compile``'s generated code guards the device itself.)
"""
from __future__ import annotations

import functools

import torch

_is_compiling = torch.compiler.is_compiling  # bound once: each guarded call looks these up (decoding's host path)
# the current CUDA device's index: torch.cuda.current_device without its lazy-init check, asked only for inputs
# already on CUDA (absent from CPU-only builds, where nothing asks)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_Tensor = torch.Tensor


def _layout_index(x) -> int:
    """The index of a BlockLayout's (anything with a ``device``) CUDA device, -1 for anything else."""
    device = getattr(x, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return _current_device() if device.index is None else device.index
    return -1


def on_inputs_device(name: str = "q", position: int = 0):
    """Decorate an entry point so its body runs with the CUDA device of its argument ``name`` (passed at
    ``position`` or by keyword; a tensor or a layout) current, when another one is; otherwise (CPU inputs,
    the device already current, while torch.compile traces) the body runs as it is. The check is written for
    the decoding path's host time (``x.device.type`` alone builds a string: 0.4 us): 1.3 us a decoding call on
    the H200's host (device_guard_probe.py, NOTES "Inputs on another GPU")."""
    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not _is_compiling():
                x = args[position] if len(args) > position else kwargs.get(name)
                if isinstance(x, _Tensor):
                    index = x.get_device() if x.is_cuda else -1
                else:
                    index = _layout_index(x)
                if index >= 0 and index != _current_device():
                    with torch.cuda.device(index):
                        return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return run
    return decorate
