"""Zigzag llama3 context parallelism: W gloo ranks on the CPU (spawned processes) against the
single-process full-sequence oracle, in fp64; dense [B, H, L, D] and packed varlen [T, H, D]
batches; the kernel path under the Triton interpreter; mismatched inputs and a missing peer."""
import datetime
import os
import queue as queue_mod
import socket
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn
from sparse_attn.parallel import (
    local,
    zigzag_chunk_ids,
    zigzag_cu_seqlens,
    zigzag_gather,
    zigzag_llama3_attention,
    zigzag_llama3_varlen_attention,
    zigzag_merge,
    zigzag_merge_varlen,
    zigzag_plan,
    zigzag_split,
    zigzag_split_varlen,
)

B, D, TOL = 2, 8, 1e-8


def _seq_len(world):
    return 16 * world  # 2W chunks of 8 tokens: 32 for W=2, 64 for W=4


def _inputs(world, hq, hkv, length=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(1234)  # same seed on every rank: every rank builds the same full tensors
    L = length or _seq_len(world)
    mk = lambda h: torch.randn(B, h, L, D, dtype=torch.float64, generator=g).to(dtype)
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _compare(rank, world, hq, hkv, causal, kv_head_chunk=None, scale=None, dtype=torch.float64, tol=TOL,
             use_grouped_attention=None):
    q, k, v, dout = _inputs(world, hq, hkv, dtype=dtype)
    full = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = sparse_attn.attention(*full, causal=causal, scale=scale)
    out.backward(dout.double())

    loc = [zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v)]
    out_l = zigzag_llama3_attention(*loc, causal=causal, scale=scale, kv_head_chunk=kv_head_chunk,
                                    use_grouped_attention=use_grouped_attention)
    assert out_l.is_contiguous()
    out_l.backward(zigzag_split(dout, world, rank))
    for name, got, want in [("out", out_l, out)] + [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", loc, full)]:
        torch.testing.assert_close(got.double(), zigzag_split(want.detach(), world, rank), rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"rank {rank} {name}: {m}")


def _case_causal(rank, world):
    _compare(rank, world, 4, 4, causal=True)


def _case_gqa(rank, world):
    _compare(rank, world, 4, 2, causal=True, scale=0.3)


def _case_noncausal(rank, world):
    _compare(rank, world, 4, 2, causal=False)


def _case_kv_head_chunk(rank, world):
    _compare(rank, world, 4, 4, causal=True, kv_head_chunk=3)  # uneven head chunks: (0, 3), (3, 4)
    _compare(rank, world, 4, 2, causal=False, kv_head_chunk=1)
    # an integer of numpy or torch is a head count too (np.int64(1) was refused as "not a positive number")
    _compare(rank, world, 4, 2, causal=True, kv_head_chunk=np.int64(1))
    _compare(rank, world, 4, 4, causal=True, kv_head_chunk=torch.tensor(3))


def _case_all_reduce_fallback(rank, world):
    from sparse_attn.parallel import comm
    comm._REDUCE_SCATTER_UNSUPPORTED.add("gloo")  # the path for backends without reduce_scatter
    try:
        _compare(rank, world, 4, 2, causal=True, kv_head_chunk=1)
    finally:
        comm._REDUCE_SCATTER_UNSUPPORTED.discard("gloo")


def _case_unchecked(rank, world):
    """check_inputs=False skips the cross-rank check (no collective before the K/V gather) and gives
    the same result."""
    from sparse_attn.parallel import zigzag as zz
    q, k, v, _ = (zigzag_split(t, world, rank) for t in _inputs(world, 4, 2))
    calls, real = [], zz.check_consistent_shapes
    zz.check_consistent_shapes = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        want = zigzag_llama3_attention(q, k, v)
        got = zigzag_llama3_attention(q, k, v, check_inputs=False)
    finally:
        zz.check_consistent_shapes = real
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _case_value_dim(rank, world):
    """Dv != D: K and V cannot share one gather buffer, so each is gathered on its own."""
    g = torch.Generator().manual_seed(77)
    L = _seq_len(world)
    q, k, dout = (torch.randn(B, h, L, D, dtype=torch.float64, generator=g) for h in (4, 2, 4))
    v = torch.randn(B, 2, L, D // 2, dtype=torch.float64, generator=g)
    dout = dout[..., :D // 2]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    sparse_attn.attention(*full, causal=True).backward(dout)
    loc = [zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v)]
    out_l = zigzag_llama3_attention(*loc, causal=True)
    assert out_l.shape == (B, 4, L // world, D // 2)
    out_l.backward(zigzag_split(dout, world, rank))
    for name, t, f in zip("qkv", loc, full):
        torch.testing.assert_close(t.grad, zigzag_split(f.grad, world, rank), rtol=TOL, atol=TOL)


def _case_gather(rank, world):
    x = _inputs(world, 2, 2)[0]
    torch.testing.assert_close(zigzag_gather(zigzag_split(x, world, rank)), x, rtol=0, atol=0)


def _case_mismatch(rank, world):
    q, k, v, _ = _inputs(world, 4, 4)
    q, k, v = (zigzag_split(t, world, rank) for t in (q, k, v))
    if rank == world - 1:
        q, k, v = (t[:, :, :-2] for t in (q, k, v))  # this rank lost two tokens
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree") as ei:
        zigzag_llama3_attention(q, k, v)
    bad_len = 2 * 8 - 2
    assert f"rank {world - 1}: q (2, 4, {bad_len}, 8)" in str(ei.value) and "rank 0: q (2, 4, 16, 8)" in str(ei.value)
    _compare(rank, world, 4, 4, causal=True)  # the group is still usable afterwards


def _case_other_call_or_scale(rank, world):
    """Ranks that entered different entry points (dense vs varlen: rows of different lengths once
    killed the gloo process) or passed different scales get the ValueError on every rank."""
    q, k, v, _ = _inputs(world, 2, 2)
    q, k, v = (zigzag_split(t, world, rank) for t in (q, k, v))
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] made a different call than rank 0"):
        if rank == world - 1:
            packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # [T / W, H, D]
            zigzag_llama3_varlen_attention(*packed, [0, packed[0].shape[0] * world])
        else:
            zigzag_llama3_attention(q, k, v)
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree.*rank 0: .*scale=0\.25.*"
                                         rf"rank {world - 1}: .*scale=0\.5"):
        zigzag_llama3_attention(q, k, v, scale=0.5 if rank == world - 1 else 0.25)
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree.*rank 0: .*scale=None"):
        zigzag_llama3_attention(q, k, v, scale=0.5 if rank == world - 1 else None)
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree.*use_grouped_attention"):
        zigzag_llama3_attention(q, k, v, use_grouped_attention=True if rank == world - 1 else None)
    with pytest.raises(ValueError, match="use_grouped_attention must be True, False or None"):
        zigzag_llama3_attention(q, k, v, use_grouped_attention="yes")
    _compare(rank, world, 2, 2, causal=True, scale=0.3)  # the group is still usable afterwards


def _case_bad_option_on_one_rank(rank, world):
    """An option that fails its own check on one rank only raised there at once, while its peers
    waited in their first collective until the timeout (kv_head_chunk=True vs 1 compared equal, and
    causal='no' went through int()). Now every rank raises at once: the bad one its own error."""
    q, k, v, _ = _inputs(world, 2, 2)
    q, k, v = (zigzag_split(t, world, rank) for t in (q, k, v))
    bad = rank == world - 1
    for kwargs, own, kind in ((dict(kv_head_chunk=True if bad else 1), "kv_head_chunk must be a positive", ValueError),
                              (dict(causal="no" if bad else True), "causal must be True or False, got str", TypeError)):
        with pytest.raises(kind if bad else ValueError,
                           match=own if bad else rf"ranks \[{world - 1}\] disagree.*options_valid"):
            zigzag_llama3_attention(q, k, v, **kwargs)
    with pytest.raises(TypeError, match="causal must be True or False"):  # on every rank alike
        zigzag_llama3_attention(q, k, v, causal="no")
    _compare(rank, world, 2, 2, causal=True)  # the group is still usable afterwards


def _case_bad_cu_seqlens_on_one_rank(rank, world):
    """A float cu_seqlens on one rank raised its TypeError there before the cross-rank check, while its
    peers waited in the check's all-gather until the process group's timeout. Now every rank raises at
    once: the bad one its own error, the others the disagreement."""
    T = 4 * world
    q = torch.randn(T // world, 2, 8, dtype=torch.float64)
    bad = rank == world - 1
    cu = torch.tensor([0.0, float(T)]) if bad else [0, T]
    with pytest.raises(TypeError if bad else ValueError,
                       match="cu_seqlens must hold integer offsets" if bad else rf"ranks \[{world - 1}\] disagree"):
        zigzag_llama3_varlen_attention(q, q, q, cu)
    _compare(rank, world, 2, 2, causal=True)  # the group is still usable afterwards


def _case_second_backward_refused(rank, world):
    """A gradient taken with create_graph=True came back detached (the backward's collectives and local
    kernels record no graph), so a gradient penalty added to the loss was dropped without a word. As the
    kernels' backward, the context-parallel one is once-differentiable: the second backward raises, on
    every rank alike."""
    q, k, v, _ = (zigzag_split(t, world, rank) for t in _inputs(world, 2, 2))
    q.requires_grad_()
    out = zigzag_llama3_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + gq.square().sum()).backward()
    _compare(rank, world, 2, 2, causal=True)  # the group is still usable afterwards


# ---- packed varlen batches ---------------------------------------------------------------------

def _varlen_cu(world, units=(3, 0, 5, 1)):
    """Global offsets of sequences of 2W * units tokens (an empty one included)."""
    cu = [0]
    for u in units:
        cu.append(cu[-1] + 2 * world * u)
    return torch.tensor(cu, dtype=torch.int32)


def _compare_varlen(rank, world, hq, hkv, causal, kv_head_chunk=None, scale=None, dtype=torch.float64, tol=TOL,
                    units=(3, 0, 5, 1), use_grouped_attention=None):
    cu = _varlen_cu(world, units)
    g = torch.Generator().manual_seed(4321)
    T = int(cu[-1])
    q, k, v, dout = (torch.randn(T, h, D, dtype=torch.float64, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
    full = [t.detach().double().requires_grad_() for t in (q, k, v)]
    max_len = int((cu[1:] - cu[:-1]).max())
    out = sparse_attn.varlen_attention(*full, cu, cu, max_len, max_len, causal=causal, scale=scale)
    out.backward(dout.double())

    loc = [zigzag_split_varlen(t, cu, world, rank).detach().requires_grad_() for t in (q, k, v)]
    out_l = zigzag_llama3_varlen_attention(*loc, cu, causal=causal, scale=scale, kv_head_chunk=kv_head_chunk,
                                           use_grouped_attention=use_grouped_attention)
    assert out_l.shape == (T // world, hq, D) and out_l.is_contiguous()
    out_l.backward(zigzag_split_varlen(dout, cu, world, rank))
    for name, got, want in [("out", out_l, out)] + [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", loc, full)]:
        torch.testing.assert_close(got.double(), zigzag_split_varlen(want.detach(), cu, world, rank), rtol=tol,
                                   atol=tol, msg=lambda m, name=name: f"rank {rank} varlen {name}: {m}")


def _case_varlen_causal(rank, world):
    _compare_varlen(rank, world, 4, 2, causal=True)


def _case_varlen_noncausal_head_chunks(rank, world):
    _compare_varlen(rank, world, 4, 2, causal=False, kv_head_chunk=1, scale=0.4, use_grouped_attention=True)


def _case_varlen_one_sequence(rank, world):
    _compare_varlen(rank, world, 2, 2, causal=True, units=(4,), kv_head_chunk=1)


def _count_launches():
    """Wrap ops.block_sparse.forward_into (which local.forward imports per call) to count grouped
    launches (seq_step 2) and plain ones; returns (counts, undo)."""
    from sparse_attn.ops import block_sparse
    real, counts = block_sparse.forward_into, {"grouped": 0, "plain": 0}

    def counting(*args, **kwargs):
        counts["grouped" if kwargs.get("seq_step") == 2 else "plain"] += 1
        return real(*args, **kwargs)
    block_sparse.forward_into = counting
    return counts, lambda: setattr(block_sparse, "forward_into", real)


def _case_kernel_path(rank, world):
    """The CUDA code path (one grouped forward launch for the 4 groups of two sequences, kernel
    backward from the saved LSE without recompute, on strided views of a packed batch, GQA) under the
    Triton interpreter, in fp32; then with use_grouped_attention=False (one launch per group). Kept
    to two short sequences: the interpreter is slow."""
    if os.environ.get("TRITON_INTERPRET") != "1" or world > 2:  # interpreter only; one world size is enough
        return
    local.FORCE_KERNELS = True
    counts, undo = _count_launches()
    try:
        _compare_varlen(rank, world, 2, 1, causal=True, dtype=torch.float32, tol=2e-5, units=(2, 1))
        assert counts == {"grouped": 1, "plain": 0}, counts
        _compare_varlen(rank, world, 2, 1, causal=True, dtype=torch.float32, tol=2e-5, units=(2, 1),
                        use_grouped_attention=False)
        assert counts == {"grouped": 1, "plain": 4}, counts
        # the default for one packed sequence (two query chunks): two plain launches, as the README says
        _compare_varlen(rank, world, 2, 1, causal=True, dtype=torch.float32, tol=2e-5, units=(2,))
        assert counts == {"grouped": 1, "plain": 6}, counts
    finally:
        local.FORCE_KERNELS = False
        undo()


def _case_kernel_path_dense(rank, world):
    """The kernel path on a dense batch of B=2 rows (two plain launches, one per zigzag chunk; with
    use_grouped_attention=True one grouped launch per row), GQA, two head ranges, in fp32 under the
    Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1" or world > 2:
        return
    local.FORCE_KERNELS = True
    counts, undo = _count_launches()
    try:
        _compare(rank, world, 2, 2, causal=True, kv_head_chunk=1, dtype=torch.float32, tol=2e-5)
        assert counts == {"grouped": 0, "plain": 4}, counts  # 2 head ranges x 2 chunks
        _compare(rank, world, 2, 2, causal=True, kv_head_chunk=1, dtype=torch.float32, tol=2e-5,
                 use_grouped_attention=True)
        assert counts == {"grouped": 4, "plain": 4}, counts  # 2 head ranges x 2 batch rows
    finally:
        local.FORCE_KERNELS = False
        undo()


def _case_host_check_group(rank, world):
    """Under NCCL the input check runs over a gloo group made beside it, once: pretend the world is
    not gloo so that path runs here, and check a mismatch is still caught through it."""
    from sparse_attn.parallel import comm
    real = comm.dist.get_backend
    comm.dist.get_backend = lambda group=None: "nccl" if group in (None, dist.group.WORLD) else real(group)
    try:
        comm._HOST_GROUPS.clear()
        host = comm._host_group(None)
        assert host is not dist.group.WORLD and real(host) == "gloo" and comm._host_group(None) is host
        assert dist.get_process_group_ranks(host) == list(range(world))
        _case_mismatch(rank, world)
    finally:
        comm.dist.get_backend = real
        comm._HOST_GROUPS.clear()


def _case_varlen_mismatch(rank, world):
    cu = _varlen_cu(world)
    T = int(cu[-1])
    q, k, v = (torch.randn(T // world, h, D, dtype=torch.float64) for h in (4, 2, 2))
    bad = cu.clone()
    if rank == world - 1:
        bad[1] += 2 * world  # same total, different split: only the offsets disagree
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree.*cu_seqlens_digest"):
        zigzag_llama3_varlen_attention(q, k, v, bad)
    if rank == world - 1:
        q = q.float()
    with pytest.raises(ValueError, match=rf"ranks \[{world - 1}\] disagree") as ei:
        zigzag_llama3_varlen_attention(q, k, v, cu)
    assert f"rank {world - 1}: q ({T // world}, 4, 8) float32" in str(ei.value)
    assert f"rank 0: q ({T // world}, 4, 8) float64" in str(ei.value)
    # the same wrong cu_seqlens on every rank: a local error, raised by every rank alike (no hang)
    with pytest.raises(ValueError, match="not a multiple of 2 \\* world_size"):
        zigzag_llama3_varlen_attention(q.double(), k, v, [0, T - 1, T])
    _compare_varlen(rank, world, 4, 2, causal=True)  # the group is still usable afterwards


CASES = {f.__name__.removeprefix("_case_"): f for f in
         (_case_causal, _case_gqa, _case_noncausal, _case_kv_head_chunk, _case_all_reduce_fallback, _case_unchecked,
          _case_value_dim, _case_gather, _case_mismatch, _case_other_call_or_scale, _case_bad_option_on_one_rank,
          _case_bad_cu_seqlens_on_one_rank, _case_second_backward_refused, _case_varlen_causal,
          _case_varlen_noncausal_head_chunks, _case_varlen_one_sequence, _case_kernel_path, _case_kernel_path_dense,
          _case_host_check_group, _case_varlen_mismatch)}


def _worker(rank, world, port, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    except Exception:  # noqa: BLE001 -- report any failure to the parent
        results.put((rank, "setup", traceback.format_exc()))
        return
    for name, fn in CASES.items():
        try:
            fn(rank, world)
            results.put((rank, name, None))
        except BaseException:  # noqa: BLE001 -- report any failure to the parent
            results.put((rank, name, traceback.format_exc()))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 150
    while len(got) < world * len(CASES) and time.monotonic() < deadline:
        try:
            rank, name, err = results.get(timeout=1)
            got[(rank, name)] = err
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join()
    return got, [p.exitcode for p in procs]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def dist_run(request):
    return request.param, *_run_world(request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_zigzag_llama3_matches_full_sequence(dist_run, case):
    world, got, exitcodes = dist_run
    setup = {r: got[(r, "setup")] for r in range(world) if (r, "setup") in got}
    assert not setup, f"process group setup failed: {setup}"
    missing = [r for r in range(world) if (r, case) not in got]
    assert not missing, f"ranks {missing} never reported case {case!r} (exit codes {exitcodes})"
    errors = {r: got[(r, case)] for r in range(world) if got[(r, case)] is not None}
    assert not errors, "\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items())


# ---- single-process helpers -------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_split_merge_roundtrip(world):
    x = torch.arange(2 * 3 * 16 * world).reshape(2, 3, 16 * world)
    parts = [zigzag_split(x, world, r, dim=2) for r in range(world)]
    assert torch.equal(zigzag_merge(parts, dim=2), x)
    c = 8
    a, b = zigzag_chunk_ids(world, 0)
    assert (a, b) == (0, 2 * world - 1)
    assert torch.equal(parts[0][..., :c], x[..., :c]) and torch.equal(parts[0][..., c:], x[..., -c:])


def test_split_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 2 \\* world_size = 8"):
        zigzag_split(torch.zeros(1, 1, 12, 2), 4, 0)


def test_varlen_helpers():
    world = 2
    cu = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    x = torch.arange(28 * 2).reshape(28, 2)
    parts = [zigzag_split_varlen(x, cu, world, r) for r in range(world)]
    local_cu = zigzag_cu_seqlens(cu, world)
    assert local_cu.tolist() == [0, 4, 6, 14] and local_cu.dtype == cu.dtype
    assert all(p.shape[0] == 14 for p in parts)
    for s in range(3):  # each local sequence is the zigzag split of that sequence alone
        seq = x[cu[s]:cu[s + 1]]
        assert torch.equal(parts[1][local_cu[s]:local_cu[s + 1]], zigzag_split(seq, world, 1, dim=0))
    assert torch.equal(zigzag_merge_varlen(parts, cu), x)
    with pytest.raises(ValueError, match="sequence 1"):
        zigzag_cu_seqlens(torch.tensor([0, 8, 14]), world)


# ---- a missing peer ---------------------------------------------------------------------------

PEER_TIMEOUT_S = 2


def _silent_peer_worker(rank, world, port, results, done):
    """Rank 0 calls in; rank 1 stays connected (until ``done``) but never calls. Rank 0 must get an
    error naming the likely cause after the process group's timeout, not hang."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
        if rank == 0:
            q = torch.randn(1, 2, 8, 4)
            t0 = time.monotonic()
            try:
                zigzag_llama3_attention(q, q, q)
                results.put((rank, "returned without error"))
            except RuntimeError as e:
                results.put((rank, (str(e), time.monotonic() - t0)))
        else:
            done.wait(timeout=PEER_TIMEOUT_S + 30)
            results.put((rank, "waited"))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))


def test_missing_peer_times_out_with_a_message():
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_silent_peer_worker, args=(r, 2, port, results, done), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            try:
                rank, res = results.get(timeout=1)
                got[rank] = res
                if rank == 0:
                    done.set()  # rank 0 has its answer: let the silent peer go
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        done.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    assert 0 in got, f"rank 0 never reported (got {got})"
    assert isinstance(got[0], tuple), got[0]
    msg, waited = got[0]
    assert "a peer did not answer" in msg and "init_process_group(timeout=...)" in msg, msg
    assert "rank 0 of 2" in msg and "zigzag_llama3_attention" in msg, msg
    assert waited < PEER_TIMEOUT_S + 20, f"took {waited:.1f} s for a {PEER_TIMEOUT_S} s timeout"


# ---- the varlen plan (per-rank cu_seqlens, positions, groups) ------------------------------------

@pytest.mark.parametrize("world", [1, 2, 4])
def test_plan_matches_split(world):
    cu = _varlen_cu(world, (3, 0, 5, 1))
    T = int(cu[-1])
    pos_full = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
    seq_full = torch.cat([torch.full((int(b - a),), i) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])
    idx_full = torch.arange(T)
    for rank in range(world):
        plan = zigzag_plan(cu, world, rank)
        assert plan.cu_seqlens_local().tolist() == zigzag_cu_seqlens(cu, world).tolist()
        assert plan.cu_seqlens_local().dtype == torch.int32 and plan.max_seqlen_local == 5 * 2
        assert torch.equal(plan.position_ids(), zigzag_split_varlen(pos_full, cu, world, rank))
        # every group: its local query tokens and the global keys it sees are one sequence, the keys
        # a prefix of it ending at the group's last query token (causal)
        idx_loc = zigzag_split_varlen(idx_full, cu, world, rank)
        for g in plan.groups(causal=True):
            qtok = idx_loc[g.q_start:g.q_end]
            assert (seq_full[qtok] == seq_full[g.k_start]).all() and seq_full[g.k_end - 1] == seq_full[g.k_start]
            assert g.k_start == cu[seq_full[g.k_start]] and g.k_end == int(qtok[-1]) + 1
            assert torch.equal(qtok, torch.arange(int(qtok[0]), int(qtok[0]) + g.q_len))  # one contiguous chunk
        assert sum(g.q_len for g in plan.groups(causal=False)) == T // world
    # zigzag balances causal work: every rank computes the same number of (query, key) pairs
    assert len({zigzag_plan(cu, world, r).pairs(True) for r in range(world)}) == 1


def test_plan_hands_out_its_cached_pieces_immutable():
    """groups(), gather_pieces() and scatter_pieces() are cached on the plan: they returned the cached
    lists, so a caller that appended to or edited one changed every later call's groups and pieces."""
    plan = zigzag_plan([0, 16, 40], 2, 1)
    for got in (plan.groups(True), plan.groups(False), plan.gather_pieces(), plan.scatter_pieces(),
                plan.scatter_pieces()[0]):
        assert isinstance(got, tuple)
        with pytest.raises((AttributeError, TypeError)):
            got.append(got[0])
    assert plan.groups(True) == zigzag_plan([0, 16, 40], 2, 1).groups(True)


def test_plan_rejects_bad_offsets():
    with pytest.raises(ValueError, match="sequence 1 .* not a multiple of 2 \\* world_size = 4"):
        zigzag_plan([0, 8, 14], 2, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_plan([0, 8, 4], 2, 0)
    with pytest.raises(ValueError, match="rank"):
        zigzag_plan([0, 8], 2, 2)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size, got rank=0, world_size=0"):
        zigzag_plan([0, 8], 0, 0)  # once a ZeroDivisionError
    with pytest.raises(ValueError, match=r"at least 2 entries.*got \[0\]"):
        zigzag_split_varlen(torch.zeros(0), [0], 2, 0)
    with pytest.raises(ValueError, match="got none"):
        zigzag_merge([])
    # inconsistent inputs that dropped tokens without a word
    x = torch.arange(20.0)[:, None]
    with pytest.raises(ValueError, match="x has 20 tokens along dim 0, cu_seqlens ends at 16"):
        zigzag_split_varlen(x, [0, 8, 16], 2, 0)
    with pytest.raises(ValueError, match="the same shape, got \\[\\(1, 1, 4, 1\\), \\(1, 1, 6, 1\\)\\]"):
        zigzag_merge([torch.zeros(1, 1, 4, 1), torch.ones(1, 1, 6, 1)])
    with pytest.raises(ValueError, match="each of the 2 parts holds 8 along dim 0, got \\[8, 10\\]"):
        zigzag_merge_varlen([torch.zeros(8, 1), torch.zeros(10, 1)], [0, 8, 16])
    with pytest.raises(TypeError, match="integer offsets, got \\[0, 8.5, 16\\]"):
        zigzag_plan([0, 8.5, 16], 2, 0)  # was cut to 8
    with pytest.raises(TypeError, match="integer offsets, got a torch.float32 tensor"):
        zigzag_cu_seqlens(torch.tensor([0.0, 8.0]), 2)


_X16 = torch.arange(16.0)[None, None, :, None]
_NOT_INTS = {"plan rank": lambda: zigzag_plan([0, 16], 2, 1.5), "plan world": lambda: zigzag_plan([0, 16], 2.5, 0),
             "split world": lambda: zigzag_split(_X16, 2.0, 0), "split bool": lambda: zigzag_split(_X16, True, 0),
             "split rank": lambda: zigzag_split(_X16, 2, 1.0), "cu_seqlens": lambda: zigzag_cu_seqlens([0, 16], 2.0),
             "chunk ids": lambda: zigzag_chunk_ids(2, 1.5),
             "split varlen": lambda: zigzag_split_varlen(_X16[0, 0], [0, 16], 2.0, 0)}


@pytest.mark.parametrize("call", list(_NOT_INTS))
def test_world_size_and_rank_must_be_ints(call):
    """A float world size or rank was cut by zigzag_plan (rank 1.5 planned as rank 1, world 2.5 as 2), gave float
    offsets from zigzag_cu_seqlens and float chunk ids, failed inside narrow() in zigzag_split, and a bool world
    size split as one rank (the whole tensor)."""
    with pytest.raises(TypeError, match=r"(world_size|rank) must be an int, got (1\.5|2\.5|2\.0|1\.0|True)"):
        _NOT_INTS[call]()


def test_world_size_and_rank_take_numpy_and_torch_ints():
    assert zigzag_plan([0, 16], np.int64(2), torch.tensor(1)) is zigzag_plan([0, 16], 2, 1)
    assert torch.equal(zigzag_split(_X16, np.int64(2), np.int32(1)), zigzag_split(_X16, 2, 1))
    assert zigzag_chunk_ids(np.int64(2), np.int64(1)) == (1, 2)
    assert zigzag_cu_seqlens([0, 16], np.int64(2)).tolist() == [0, 8]


@pytest.mark.parametrize("causal", [True, False])
def test_plan_pairs_count_the_attended_query_key_pairs(causal):
    """pairs() (the FLOP count: 4 * B * Hq * D * pairs) equals the (query, key) pairs of the rank's
    groups counted on a token mask: bottom-right causal, so a group of lq queries over lk keys sees
    lq * lk - lq * (lq - 1) / 2 pairs (each query sees itself)."""
    cu = [0, 16, 48, 48, 72]
    for world in (1, 2):
        for rank in range(world):
            plan = zigzag_plan(cu, world, rank)
            want = 0
            for g in plan.groups(causal):
                i = torch.arange(g.q_len)[:, None]
                j = torch.arange(g.k_len)[None, :]
                want += int((j <= i + g.k_len - g.q_len).sum()) if causal else g.q_len * g.k_len
            assert plan.pairs(causal) == want, (world, rank)
