"""Every input error of sparse_attn.attention fires before any compute, naming what was received and
what is expected (DESIGN rule 8)."""
from __future__ import annotations

import math

import pytest
import torch

import sparse_attn
from sparse_attn.layout import BlockLayout, LayoutError
from sparse_attn.masks import ElementMask, causal_term, window_term
from sparse_attn import patterns, reference


def qkv(B=2, Hq=4, Hkv=2, Lq=40, Lk=48, D=16, Dv=None, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Lk, D if Dv is None else Dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def layout_for(Lq=40, Lk=48, B=1, H=1, block=16):
    nq, nk = math.ceil(Lq / block), math.ceil(Lk / block)
    bm = torch.ones(B, H, nq, nk, dtype=torch.bool)
    return BlockLayout.from_block_mask(bm, block_q=block, block_k=block, q_len=Lq, kv_len=Lk)


def test_valid_inputs_pass():
    q, k, v = qkv()
    out = sparse_attn.attention(q, k, v, layout_for(B=2, H=4), scale=0.5)
    assert out.shape == (2, 4, 40, 16)


def re_shape(shape):
    return r"\(" + r", ".join(str(s) for s in shape) + r"\)"


# ----------------------------------------------------------------------------- tensors
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_number_of_dims(which):
    t = dict(zip("qkv", qkv()))
    t[which] = t[which][0]
    shape = tuple(t[which].shape)
    with pytest.raises(ValueError, match=rf"{which} must be 4-D \[batch, heads, seq_len, head_dim\], "
                                         rf"got shape {re_shape(shape)}"):
        sparse_attn.attention(t["q"], t["k"], t["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(which):
    t = dict(zip("qkv", qkv()))
    t[which] = t[which].tolist()
    with pytest.raises(TypeError, match=rf"{which} must be a torch\.Tensor, got list"):
        sparse_attn.attention(t["q"], t["k"], t["v"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64])
def test_non_float_dtype(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"k has dtype {dtype}; expected one of float16, bfloat16, float32, float64"):
        sparse_attn.attention(q, k.to(dtype), v)


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError,
                       match=r"q, k, v must share a dtype, got torch\.float32, torch\.float16, torch\.float32"):
        sparse_attn.attention(q, k.half(), v)
    with pytest.raises(TypeError, match=r"got torch\.bfloat16, torch\.bfloat16, torch\.float64"):
        sparse_attn.attention(q.bfloat16(), k.bfloat16(), v.double())


def test_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q, k, v must be on one device, got cpu, meta, cpu"):
        sparse_attn.attention(q, k.to("meta"), v)


def test_batch_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"batch sizes differ: q 2, k 1, v 1"):
        sparse_attn.attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"batch sizes differ: q 2, k 2, v 1"):
        sparse_attn.attention(q, k, v[:1])


def test_k_v_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError,
                       match=r"k \(2, 2, 48, 16\) and v \(2, 2, 47, 16\) must have the same heads and seq_len"):
        sparse_attn.attention(q, k, v[:, :, :47])
    with pytest.raises(ValueError, match=r"k \(2, 2, 48, 16\) and v \(2, 1, 48, 16\) must have the same heads"):
        sparse_attn.attention(q, k, v[:, :1])


def test_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q has head_dim 16, k has 8: they must match"):
        sparse_attn.attention(q, k[..., :8], v)


def test_value_head_dim_may_differ():
    q, k, v = qkv(Dv=5)
    assert sparse_attn.attention(q, k, v).shape == (2, 4, 40, 5)


@pytest.mark.parametrize("which", ["q", "v"])
def test_zero_head_dim(which):
    q, k, v = qkv(D=16)
    if which == "q":
        q, k = q[..., :0], k[..., :0]
    else:
        v = v[..., :0]
    with pytest.raises(ValueError, match=rf"{which} has head_dim 0"):
        sparse_attn.attention(q, k, v)


@pytest.mark.parametrize("Hq,Hkv", [(32, 7), (4, 3), (2, 4)])
def test_heads_not_a_multiple(Hq, Hkv):
    q, k, v = qkv(Hq=Hq, Hkv=Hkv)
    with pytest.raises(ValueError, match=rf"k has {Hkv} heads, q has {Hq}: Hq must be a multiple of Hkv"):
        sparse_attn.attention(q, k, v)


def test_zero_kv_heads():
    q, k, v = qkv(Hq=4, Hkv=2)
    with pytest.raises(ValueError, match=r"k has 0 heads, q has 4"):
        sparse_attn.attention(q, k[:, :0], v[:, :0])


# ----------------------------------------------------------------------------- layout vs tensors
def test_layout_not_a_layout():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"layout must be a sparse_attn\.BlockLayout \(or None\), got Tensor: a bool "
                                        r"block mask .* BlockLayout\.from_block_mask\(mask"):
        sparse_attn.attention(q, k, v, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got list$"):
        sparse_attn.attention(q, k, v, [1, 2])  # not a tensor: no converter to suggest


@pytest.mark.parametrize("Lq,Lk", [(41, 48), (40, 47), (48, 40)])
def test_layout_length_mismatch(Lq, Lk):
    q, k, v = qkv(Lq=40, Lk=48)
    with pytest.raises(LayoutError, match=rf"layout was built for q_len={Lq}, kv_len={Lk} but q has seq_len 40 "
                                          rf"and k has 48"):
        sparse_attn.attention(q, k, v, layout_for(Lq, Lk))


def test_a_layout_length_mismatch_from_bshd_inputs_says_to_transpose():
    """[batch, seq_len, heads, head_dim] tensors (FlashAttention's order) put the lengths where the heads go: the
    error names the transpose; a plain mismatch does not suggest it."""
    q, k, v = (t.transpose(1, 2) for t in qkv(Hq=4, Hkv=4, Lq=40, Lk=40))
    with pytest.raises(LayoutError, match=r"seq_len 4 and k has 4.*\[batch, seq_len, heads, head_dim\].*"
                                          r"q\.transpose\(1, 2\)"):
        sparse_attn.attention(q, k, v, layout_for(40, 40))
    q, k, v = qkv(Lq=40, Lk=48)
    with pytest.raises(LayoutError) as plain:
        sparse_attn.attention(q, k, v, layout_for(41, 48))
    assert "transpose" not in str(plain.value)


def test_layout_batch_not_broadcastable():
    q, k, v = qkv(B=2)
    with pytest.raises(LayoutError, match=r"layout has batch 3; q has batch 2: use 1 \(broadcast\) or 2"):
        sparse_attn.attention(q, k, v, layout_for(B=3))
    q, k, v = qkv(B=1)
    with pytest.raises(LayoutError, match=r"layout has batch 3; q has batch 1: use 1 \(broadcast\)$"):
        sparse_attn.attention(q, k, v, layout_for(B=3))  # not "use 1 (broadcast) or 1"


@pytest.mark.parametrize("H", [2, 3, 8])
def test_layout_heads_not_broadcastable(H):
    """Heads must be 1 or Hq; Hkv (=2 here) is not accepted either."""
    q, k, v = qkv(Hq=4, Hkv=2)
    with pytest.raises(LayoutError, match=rf"layout has {H} heads; q has 4: use 1 \(broadcast\) or 4"):
        sparse_attn.attention(q, k, v, layout_for(H=H))


def _with(layout, **tensors):
    fields = dict(block_q=layout.block_q, block_k=layout.block_k, q_len=layout.q_len, kv_len=layout.kv_len,
                  kv_counts=layout.kv_counts, kv_indices=layout.kv_indices, kv_mask_ids=layout.kv_mask_ids,
                  masks=layout.masks)
    fields.update(tensors)
    return BlockLayout(**fields)


def _window_layout():
    return BlockLayout.from_mask(ElementMask((window_term(20, 0),)), q_len=40, kv_len=48, block_q=16, block_k=16)


def test_window_layout_shape_assumed_below():
    L = _window_layout()
    assert L.kv_counts[0, 0].tolist() == [2, 3, 2] and L.num_kv_blocks == 3
    assert L.kv_indices[0, 0, 1].tolist() == [0, 1, 2]


@pytest.mark.parametrize("value", [3, -1, 100])
def test_corrupted_layout_out_of_range_index(value):
    q, k, v = qkv()
    L = _window_layout()
    idx = L.kv_indices.clone()
    idx[0, 0, 1, 2] = value
    with pytest.raises(LayoutError, match=rf"kv_indices\[0,0,1,2\] = {value} is out of range: valid key-block "
                                          rf"indices are 0\.\.2 \(kv_len=48, block_k=16\)"):
        sparse_attn.attention(q, k, v, _with(L, kv_indices=idx))


def test_corrupted_layout_unsorted_and_duplicate():
    q, k, v = qkv()
    L = _window_layout()
    idx = L.kv_indices.clone()
    idx[0, 0, 1, 1], idx[0, 0, 1, 2] = 2, 1
    with pytest.raises(LayoutError, match=r"kv_indices\[0,0,1\] has unsorted entries at slots 1,2: 2, 1; "
                                          r"each row must be strictly ascending"):
        sparse_attn.attention(q, k, v, _with(L, kv_indices=idx))
    idx = L.kv_indices.clone()
    idx[0, 0, 1, 0] = 1
    with pytest.raises(LayoutError, match=r"kv_indices\[0,0,1\] has duplicate entries at slots 0,1: 1, 1"):
        sparse_attn.attention(q, k, v, _with(L, kv_indices=idx))


def test_corrupted_layout_counts_and_mask_ids():
    q, k, v = qkv()
    L = _window_layout()
    counts = L.kv_counts.clone()
    counts[0, 0, 0] = 4
    with pytest.raises(LayoutError, match=r"kv_counts\[0,0,0\] = 4 is outside \[0, 3\]"):
        sparse_attn.attention(q, k, v, _with(L, kv_counts=counts))
    mids = L.kv_mask_ids.clone()
    mids[0, 0, 1, 2] = 5
    with pytest.raises(LayoutError,
                       match=r"kv_mask_ids\[0,0,1,2\] = 5: must be -1 \(full\) or a mask index in \[0, 0\]"):
        sparse_attn.attention(q, k, v, _with(L, kv_mask_ids=mids))


def test_layout_validated_once_and_failure_not_remembered():
    """A bad layout keeps failing (a failed check is not cached as passed); a good one is marked."""
    q, k, v = qkv()
    L = _window_layout()
    idx = L.kv_indices.clone()
    idx[0, 0, 1, 2] = 9
    bad = _with(L, kv_indices=idx)
    for _ in range(2):
        with pytest.raises(LayoutError):
            sparse_attn.attention(q, k, v, bad)
    good = _window_layout()
    sparse_attn.attention(q, k, v, good)
    assert good._validated


# ----------------------------------------------------------------------------- scale
@pytest.mark.parametrize("scale", [0, 0.0, -1.0, float("nan"), float("-inf"), "0.5", [0.5], object()])
def test_bad_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"scale must be a finite positive number or None \(1/sqrt\(head_dim\)\), got "):
        sparse_attn.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [float("inf"), True], ids=["inf", "bool"])
def test_non_finite_or_bool_scale_rejected(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"scale must be a finite positive"):
        sparse_attn.attention(q, k, v, scale=scale)


def test_scale_message_names_value():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"got -2\.5$"):
        sparse_attn.attention(q, k, v, scale=-2.5)


def test_checks_run_before_layout_use():
    """Tensor errors win over layout errors (the layout is only checked against valid tensors)."""
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"must share a dtype"):
        sparse_attn.attention(q, k.double(), v, layout_for(99, 99))
    causal = BlockLayout.from_mask(ElementMask((causal_term(),)), q_len=40, kv_len=48, block_q=16, block_k=16)
    with pytest.raises(ValueError, match=r"scale must be"):
        sparse_attn.attention(q, k, v, causal, scale=0)


# ----------------------------------------------------------------------------- argument types (an audit's finds)
def test_numpy_numbers_are_accepted_and_tensors_strings_refused_with_a_reason():
    np = pytest.importorskip("numpy")
    from sparse_attn import patterns
    q, k, v = qkv()
    want = sparse_attn.attention(q, k, v, scale=0.5)
    assert torch.equal(sparse_attn.attention(q, k, v, scale=np.float32(0.5)), want)  # "got np.float32(0.5)"
    with pytest.raises(ValueError, match=r"scale\.item\(\)"):
        sparse_attn.attention(q, k, v, scale=torch.tensor(0.5))
    with pytest.raises(TypeError, match="causal must be True or False, got str 'no'"):
        sparse_attn.attention(q, k, v, causal="no")  # was truthy: causal attention
    lay = patterns.local(4096, 256, block_q=np.int64(64))  # refused as "not a multiple of 16"
    assert type(lay.block_q) is int and lay.block_q == 64
    with pytest.raises(TypeError, match="density must be a number in \\(0, 1\\], got bool True"):
        patterns.random(256, density=True, block_q=16, block_k=16)  # was density 1.0
    with pytest.raises(TypeError, match="got str '0.25'"):
        patterns.random(256, density="0.25", block_q=16, block_k=16)
    with pytest.raises(ValueError, match="seed must be < 2\\*\\*64"):
        patterns.random(256, density=0.25, seed=2 ** 64, block_q=16, block_k=16)  # "Overflow when unpacking"


def test_layout_lengths_and_masks_are_checked_with_their_names():
    mask = ElementMask((window_term(4, 0),))
    with pytest.raises(LayoutError, match="q_len must be an int >= 0, got int -1"):
        BlockLayout.from_mask(mask, q_len=-1, block_q=16, block_k=16)  # built a q_len=-1 layout
    with pytest.raises(LayoutError, match="got float 100.0"):
        BlockLayout.from_mask(mask, q_len=100.0, block_q=16, block_k=16)  # repeat_interleave_cpu error
    with pytest.raises(LayoutError, match="q_len must be an int >= 0, got int -5"):
        BlockLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), block_q=16, block_k=16, q_len=-5)
    lay = layout_for()
    bad = BlockLayout(lay.block_q, lay.block_k, lay.q_len, lay.kv_len, lay.kv_counts, lay.kv_indices,
                      lay.kv_mask_ids, masks=mask)
    with pytest.raises(LayoutError, match="masks must be a tuple of ElementMask"):  # was "not iterable"
        bad.validate()


def test_varlen_and_grouped_check_max_seqlen_and_shared_blocks_on_the_cpu_too():
    np = pytest.importorskip("numpy")
    from sparse_attn import Group, patterns
    q, k, v = (torch.randn(48, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 16, 48], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen for cu_seqlens_q must be an int >= the longest sequence"):
        sparse_attn.varlen_attention(q, k, v, cu, cu, None, None)  # "'>' not supported ... NoneType"
    out = sparse_attn.varlen_attention(q, k, v, cu, cu, np.int64(32), 32)
    assert torch.equal(out, sparse_attn.varlen_attention(q, k, v, cu, cu, 32, 32))
    mixed = [patterns.local(16, 4, block_q=16, block_k=16), patterns.local(32, 4, block_q=32, block_k=64)]
    with pytest.raises(LayoutError, match="same block_q x block_k .* 16x16 and 32x64"):
        sparse_attn.varlen_attention(q, k, v, cu, cu, 32, 32, layouts=mixed)  # the kernels refused, the CPU ran
    groups = [Group(0, 16, 0, 16), Group(16, 48, 0, 32)]
    with pytest.raises(LayoutError, match="same block_q x block_k"):
        sparse_attn.grouped_attention(q, k, v, groups, layouts=mixed)
    empty = [Group(0, 16, 0, 16), Group(16, 48, 0, 0)]
    with pytest.raises(LayoutError, match="layout 1 was built for q_len=16"):  # a group with no keys
        sparse_attn.grouped_attention(q, k, v, empty, layouts=[mixed[0], mixed[0]])
    sparse_attn.grouped_attention(q, k, v, empty, layouts=[mixed[0], None])


def test_reference_oracle_refuses_a_layout_for_other_lengths_and_csr_errors_point_at_the_offset():
    from sparse_attn import patterns, reference
    q = torch.randn(1, 1, 48, 16)
    with pytest.raises(LayoutError, match="layout is for q_len=64, kv_len=64, .* Lq=48, Lk=48"):
        reference.attention(q, q, q, patterns.local(64, 5, block_q=16, block_k=16))  # ran, on the wrong frame
    with pytest.raises(LayoutError, match="layout is for q_len=32"):
        reference.attention(q, q, q, patterns.local(32, 5, block_q=16, block_k=16))  # an IndexError inside
    with pytest.raises(LayoutError, match="first problem at 2\\)"):  # crow has offsets 0..2; it said 3
        patterns.from_csr(torch.tensor([[[0, 1, 5]]]), torch.tensor([[[0, 1, 1]]]), seq_len=32, block_q=16,
                          block_k=16)


def test_reference_oracle_refuses_a_layout_for_another_batch_or_head_count():
    """_check_frame also pins batch and heads (1 or the tensors' own): a per-batch layout for B=2 used
    on B=3 must be a LayoutError naming the frame, not a broadcast RuntimeError deep inside."""
    q = torch.randn(3, 2, 32, 16)
    per_batch = patterns.random(32, density=0.5, batch=2, heads=1, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match="batch=2, heads=1 but q/k have .* B=3, Hq=2"):
        reference.attention(q, q, q, per_batch)
    per_head = patterns.random(32, density=0.5, batch=1, heads=3, block_q=16, block_k=16)
    with pytest.raises(LayoutError, match="heads=3 but q/k have .* Hq=2"):
        reference.attention(q, q, q, per_head)


def test_explicit_reference_backward_checks_its_arguments_as_the_forward_does():
    """reference.attention_backward (the CPU compile path's explicit backward) took causal="False" as
    causal, scale 0, and failed on a layout for other lengths with an IndexError deep inside."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(4))
    _, lse = reference.attention(q, k, v, return_lse=True, _acc_lse=True)
    ok = reference.attention_backward(do, None, q, k, v, lse)
    assert [g.shape for g in ok] == [q.shape, k.shape, v.shape]
    with pytest.raises(TypeError, match="causal must be True or False"):
        reference.attention_backward(do, None, q, k, v, lse, causal="False")
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        reference.attention_backward(do, None, q, k, v, lse, scale=0.0)
    with pytest.raises(LayoutError, match="q_len=32, kv_len=32"):
        reference.attention_backward(do, None, q, k, v, lse, patterns.causal(32, block_q=16, block_k=16))
    with pytest.raises(ValueError, match="divisible|multiple"):
        reference.attention_backward(do, None, torch.randn(1, 3, 40, 16, dtype=torch.float64), k, v, lse)
    with pytest.raises(ValueError, match=r"do has shape \(1, 2, 39, 16\)"):
        reference.attention_backward(do[:, :, :39], None, q, k, v, lse)
    with pytest.raises(ValueError, match=r"dlse has shape \(1, 2\)"):
        reference.attention_backward(do, lse[:, :, 0], q, k, v, lse)


def test_prepare_refuses_what_attention_refuses():
    """prepare(None) failed on None.q_len; prepare(layout, causal="no") built the causal schedule."""
    layout = patterns.local(256, 64, block_q=64, block_k=64)
    with pytest.raises(TypeError, match="layout must be a sparse_attn.BlockLayout, got NoneType"):
        sparse_attn.prepare(None)
    with pytest.raises(TypeError, match="from_block_mask"):
        sparse_attn.prepare(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="causal must be True or False, got str 'no'"):
        sparse_attn.prepare(layout, causal="no")
    with pytest.raises(TypeError, match="backward must be True or False"):
        sparse_attn.prepare(layout, backward=1)
    assert sparse_attn.prepare(layout, causal=False) is layout
