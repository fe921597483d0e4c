"""A BlockLayout caches what it derives (validation, kernel schedules, mask table, transpose, causal cut,
device copy); varlen and grouped plans are cached per layout. Changing a layout after a first call,
in place or through dataclasses.replace / copy.copy, must never run the stale state: that gave wrong
results, and an edit that made the layout invalid reached the kernels unchecked (reads out of bounds on
a GPU). The kernel cases run under TRITON_INTERPRET=1 (conftest.py) through the public API."""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

import sparse_attn
from sparse_attn import patterns, reference
from sparse_attn.layout import BlockLayout, LayoutError
from sparse_attn.masks import ElementMask, window_term

kernels = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run only without a GPU")


@pytest.fixture(params=["reference", pytest.param("kernels", marks=[kernels, pytest.mark.interpreter])])
def path(request, monkeypatch):
    """sparse_attn.attention on CPU tensors through the reference, or through the Triton kernels."""
    if request.param == "kernels":
        monkeypatch.setattr(sparse_attn.api, "_use_kernels", lambda q: True)
    return request.param


def _qkv(L=64, Lk=None, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, n, d, generator=g) for n in (L, Lk or L, Lk or L))


def _expect(q, k, v, layout, causal=False):
    fresh = BlockLayout(layout.block_q, layout.block_k, layout.q_len, layout.kv_len, layout.kv_counts.clone(),
                        layout.kv_indices.clone(), layout.kv_mask_ids.clone(), layout.masks)
    return reference.attention(q.double(), k.double(), v.double(), fresh, causal=causal).float()


def _close(out, want):
    assert (out - want).abs().max() < 1e-4, float((out - want).abs().max())


def test_an_edit_in_place_after_a_first_call_runs_the_edited_layout(path):
    q, k, v = _qkv()
    lay = BlockLayout.from_block_mask(torch.eye(4, dtype=torch.bool), block_q=16, block_k=16)
    for causal in (False, True):
        sparse_attn.attention(q, k, v, lay, causal=causal)
    lay.kv_indices.copy_(lay.kv_indices.flip(2))  # every row now visits the mirrored key block
    for causal in (False, True):
        _close(sparse_attn.attention(q, k, v, lay, causal=causal), _expect(q, k, v, lay, causal))


def test_an_edit_that_makes_the_layout_invalid_is_refused_after_a_first_call(path):
    q, k, v = _qkv()
    lay = patterns.local(64, 8, block_q=16, block_k=16)
    sparse_attn.attention(q, k, v, lay)
    lay.kv_counts[0, 0, 0] = 2  # row 0 lists one block: the new slot holds -1
    with pytest.raises(LayoutError, match=r"kv_indices\[0,0,0,1\] = -1"):
        sparse_attn.attention(q, k, v, lay)


def test_replace_and_copy_start_without_the_caches(path):
    q, k, v = _qkv()
    base = patterns.local(64, 8, block_q=16, block_k=16)
    sparse_attn.attention(q, k, v, base, causal=True)
    wider = dataclasses.replace(base, masks=(ElementMask((window_term(12, 0),)),))
    assert not wider._derived and wider._table is None and not wider._validated
    _close(sparse_attn.attention(q, k, v, wider), _expect(q, k, v, wider))
    moved = copy.copy(base)
    moved.masks = wider.masks
    _close(sparse_attn.attention(q, k, v, moved), _expect(q, k, v, wider))
    bad = dataclasses.replace(base, kv_indices=torch.full_like(base.kv_indices, 7))  # 4 key blocks
    with pytest.raises(LayoutError, match="out of range"):
        sparse_attn.attention(q, k, v, bad)


def test_masks_given_as_a_list_and_edited_in_place(path):
    """A hand-built layout's masks may be a list (validate() takes one); replacing an element in place
    kept the id the caches were keyed on, so the kernels ran the old mask table and causal cut."""
    q, k, v = _qkv()
    base = patterns.local(64, 8, block_q=16, block_k=16)
    lay = BlockLayout(16, 16, 64, 64, base.kv_counts, base.kv_indices, base.kv_mask_ids, list(base.masks))
    for causal in (False, True):
        sparse_attn.attention(q, k, v, lay, causal=causal)
    lay.masks[0] = ElementMask((window_term(2, 0),))  # a narrower window inside the same blocks
    assert lay.mask_table()[0][0, 0, 4].item() == 2
    for causal in (False, True):
        _close(sparse_attn.attention(q, k, v, lay, causal=causal), _expect(q, k, v, lay, causal))


@kernels
@pytest.mark.interpreter
def test_non_contiguous_counts_are_read_per_row(monkeypatch):
    """kv_counts expanded over heads (stride 0) or transposed: the kernels read counts at the offsets of
    the schedule's contiguous tensors, so a row read another row's count (and K/V past their end)."""
    monkeypatch.setattr(sparse_attn.api, "_use_kernels", lambda q: True)
    q, k, v = _qkv(64, 56)
    idx = torch.full((1, 2, 4, 2), -1, dtype=torch.int32)
    idx[0, 0] = torch.tensor([0, 2], dtype=torch.int32)
    idx[0, 1] = torch.tensor([1, 3], dtype=torch.int32)  # block 3 is cut by kv_len = 56
    counts = torch.full((1, 1, 4), 2, dtype=torch.int32).expand(1, 2, 4)
    lay = BlockLayout(16, 16, 64, 56, counts, idx, torch.full_like(idx, -1))
    _close(sparse_attn.attention(q, k, v, lay), _expect(q, k, v, lay))
    per_row = torch.tensor([[1, 2], [0, 1], [2, 0], [1, 1]], dtype=torch.int32)  # [Qb, H], the transposed view
    idx2 = torch.tensor([0, 3], dtype=torch.int32).expand(1, 2, 4, 2).clone()
    idx2[per_row.t()[None, ..., None].expand(1, 2, 4, 2) <= torch.arange(2)] = -1
    lay2 = BlockLayout(16, 16, 64, 56, per_row.t()[None], idx2, torch.full_like(idx2, -1))
    assert not lay2.kv_counts.is_contiguous()
    _close(sparse_attn.attention(q, k, v, lay2), _expect(q, k, v, lay2))


def test_combining_or_transposing_an_invalid_layout_is_refused():
    """| and & rearranged a bad hand-built operand's entries (an out-of-range block moved to another
    row) and marked the result validated."""
    idx = torch.tensor([[[[6], [0], [0], [0]]]], dtype=torch.int32)  # 4 key blocks: 6 is out of range
    bad = BlockLayout(16, 16, 64, 64, torch.ones(1, 1, 4, dtype=torch.int32), idx, torch.full_like(idx, -1))
    good = patterns.dense(64, block_q=16, block_k=16)
    for fn in (lambda: bad | good, lambda: good & bad, lambda: patterns.causal_cut(bad), bad.transpose):
        with pytest.raises(LayoutError, match=r"kv_indices\[0,0,0,0\] = 6"):
            fn()


def test_varlen_plan_follows_a_layout_edited_in_place():
    q, k, v = (torch.randn(40, 2, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 16, 40], dtype=torch.int32)
    lays = [patterns.dense(16, block_q=16, block_k=16), patterns.local(24, 4, block_q=16, block_k=16)]
    sparse_attn.varlen_attention(q, k, v, cu, cu, 24, 24, layouts=lays, causal=True)
    lays[1].kv_counts.zero_()  # the second sequence now sees nothing
    out = sparse_attn.varlen_attention(q, k, v, cu, cu, 24, 24, layouts=lays, causal=True)
    assert torch.equal(out[16:], torch.zeros_like(out[16:])) and out[:16].abs().sum() > 0


def test_a_layout_used_on_two_gpus_keeps_a_copy_for_each(monkeypatch):
    """A CPU layout used by layers on cuda:0 and cuda:1 in turn (a model split over GPUs) kept one device copy,
    rebuilt (copied, its schedules derived again) at every switch. No GPU here: q stands in by its shape and
    device, and BlockLayout.to is counted (its copy stays on the CPU: only the cache's bookkeeping is checked)."""
    from sparse_attn.validation import check_layout
    made = []

    def to(self, device):
        made.append(torch.device(device))
        return dataclasses.replace(self)
    monkeypatch.setattr(BlockLayout, "to", to)

    class OnGpu:
        def __init__(self, index):
            self.shape, self.device = (1, 2, 64, 16), torch.device("cuda", index)

    lay = patterns.local(64, 32, block_q=16, block_k=16)
    copies = [check_layout(lay, OnGpu(i), OnGpu(i)) for i in (0, 1, 0, 1, 1, 0)]
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert copies[0] is copies[2] is copies[5] and copies[1] is copies[3] is copies[4] and copies[0] is not copies[1]
    lay.kv_counts.add_(0)  # an edit in place: every copy is stale
    assert check_layout(lay, OnGpu(1), OnGpu(1)) is not copies[1] and len(made) == 3
