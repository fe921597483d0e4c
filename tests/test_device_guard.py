"""The public entry points run with their inputs' CUDA device current (sparse_attn.device_guard): Triton launches
on the current device, and a model spread over GPUs (transformers' device_map="auto") hands tensors on cuda:1
while cuda:0 stays current. This machine has no GPU, so torch.cuda's current device and its device context are
stood in for, and each entry point is stopped at its first step, where the device it would launch on is
read. tests/gpu/test_multi_gpu.py runs the real thing where there are two GPUs."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

import sparse_attn
from sparse_attn import api, device_guard, grouped

meansim_module = importlib.import_module("sparse_attn.predict.meansim")  # (the package's meansim is the function)


class _Stop(Exception):
    pass


class _OnGpu:
    """Stands in for a tensor or layout on ``cuda:<index>``: all the guard reads is ``.device``."""

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)


@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda's current device as a variable (0 to start), its device context switching it; returns the
    function that records, at an entry point's first step, which device was current, and stops the call."""
    state = {"current": 0, "seen": []}

    @contextlib.contextmanager
    def device(d):
        before, state["current"] = state["current"], d if isinstance(d, int) else torch.device(d).index
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(device_guard, "_current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)

    def first_step(*args, **kwargs):
        state["seen"].append(state["current"])
        raise _Stop

    state["first_step"] = first_step
    return state


ENTRIES = {  # entry point -> (module attribute of its first step, call with x in the guarded argument)
    "attention": (api, "autocast_inputs", lambda x: sparse_attn.attention(x, x, x)),
    "attention, q by keyword": (api, "autocast_inputs", lambda x: sparse_attn.attention(q=x, k=x, v=x)),
    "varlen_attention": (api, "autocast_inputs", lambda x: sparse_attn.varlen_attention(x, x, x, None, None, 1, 1)),
    "grouped_attention": (grouped, "autocast_inputs", lambda x: sparse_attn.grouped_attention(x, x, x, [])),
    "prepare": (api, "check_is_layout", lambda x: sparse_attn.prepare(x)),
    "meansim": (meansim_module, "_check_inputs", lambda x: meansim_module.meansim(x, x)),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_an_entry_point_runs_on_its_inputs_device(gpus, monkeypatch, entry):
    module, first, call = ENTRIES[entry]
    monkeypatch.setattr(module, first, gpus["first_step"])
    for current, index in ((0, 1), (0, 0), (0, 3), (2, 0)):
        gpus["current"] = current
        with pytest.raises(_Stop):
            call(_OnGpu(index))
        assert gpus["current"] == current  # restored after the call
    assert gpus["seen"] == [1, 0, 3, 0]


def test_the_transformers_attention_function_runs_on_its_inputs_device(gpus, monkeypatch):
    pytest.importorskip("transformers")
    from sparse_attn.integrations import transformers as sat
    monkeypatch.setattr(sat, "autocast_inputs", gpus["first_step"])
    with pytest.raises(_Stop):
        sat.sparse_attention_forward(object(), _OnGpu(2), _OnGpu(2), _OnGpu(2), None)
    assert gpus["seen"] == [2]


def test_cpu_inputs_and_a_trace_leave_the_current_device_alone(gpus, monkeypatch):
    """No device context for CPU tensors (torch.cuda is not touched: a CPU-only machine has none to ask), and
    none while torch.compile traces (its generated code guards the device)."""
    asked = []
    monkeypatch.setattr(device_guard, "_current_device", lambda: asked.append(1) or 0)
    guarded = device_guard.on_inputs_device()(lambda q: gpus["current"])
    assert guarded(torch.zeros(1)) == 0 and guarded("not a tensor") == 0 and not asked
    monkeypatch.setattr(device_guard, "_is_compiling", lambda: True)
    assert guarded(_OnGpu(1)) == 0 and not asked
