"""What the API hands the kernels (pure torch, so checked on the CPU): the default dense/causal
layouts, causal folded into a layout by intersection, and prepare() caching every derived piece."""
import torch

import sparse_attn
from sparse_attn import patterns
from sparse_attn.api import _kernel_layout


def _token(layout):
    return layout.to_token_mask()[0, 0]


def test_default_layouts_are_dense_and_bottom_right_causal():
    dense = _kernel_layout(None, False, 300, 200, "cpu")
    causal = _kernel_layout(None, True, 300, 200, "cpu")
    assert bool(_token(dense).all())
    i, j = torch.arange(300)[:, None], torch.arange(200)[None, :]
    assert torch.equal(_token(causal), j <= i + 200 - 300)
    assert _kernel_layout(None, True, 300, 200, "cpu") is causal  # cached per shape


def test_causal_flag_intersects_and_caches_on_the_layout():
    layout = patterns.local(257, 100, causal=False, block_q=64, block_k=64)
    folded = _kernel_layout(layout, True, 257, 257, "cpu")
    i, j = torch.arange(257)[:, None], torch.arange(257)[None, :]
    assert torch.equal(_token(folded), _token(layout) & (j <= i))
    assert _kernel_layout(layout, True, 257, 257, "cpu") is folded
    assert _kernel_layout(layout, False, 257, 257, "cpu") is layout


def test_prepare_caches_schedules_for_plain_and_causal_use():
    layout = patterns.streaming(300, 64, 8, causal=False, block_q=64, block_k=64)
    assert sparse_attn.prepare(layout, causal=True) is layout
    folded = layout._derived[("causal", torch.device("cpu"))]
    assert ("schedule", True, None) in folded._derived
    assert ("schedule", False, None) in folded._transpose._derived
    sparse_attn.prepare(layout, backward=False)
    assert ("schedule", True, None) in layout._derived and layout._transpose is None


def test_a_schedule_first_built_inside_cuda_graph_capture_is_a_named_error(monkeypatch):
    """Building a schedule reads the layout on the host, which capture forbids: a named error that says
    to prepare() first (capture faked here, no GPU), and none once the schedules are cached."""
    import pytest

    from sparse_attn.ops import block_sparse
    state = {"capturing": True}
    monkeypatch.setattr(block_sparse, "capturing", lambda device: state["capturing"])
    layout = patterns.local(300, 64, block_q=64, block_k=64)
    with pytest.raises(RuntimeError, match=r"cannot run inside CUDA graph capture; call sparse_attn.prepare\(layout\)"):
        block_sparse.layout_inputs(layout, False)
    assert ("schedule", True, None) not in layout._derived  # refused before building anything
    state["capturing"] = False
    sparse_attn.prepare(layout, backward=False)
    state["capturing"] = True
    assert block_sparse.layout_inputs(layout, False)[0] is not None
    with pytest.raises(RuntimeError, match="CUDA graph capture"):  # the backward's transpose is not prepared
        block_sparse.layout_inputs(layout, True)
