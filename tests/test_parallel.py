"""Zigzag llama3 context parallelism: W gloo ranks on the CPU (spawned processes) against the
single-process full-sequence oracle, in fp64."""
import datetime
import queue as queue_mod
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_attn
from sparse_attn.parallel import (
    zigzag_chunk_ids,
    zigzag_cu_seqlens,
    zigzag_gather,
    zigzag_llama3_attention,
    zigzag_merge,
    zigzag_merge_varlen,
    zigzag_split,
    zigzag_split_varlen,
)

B, D, TOL = 2, 8, 1e-8


def _seq_len(world):
    return 16 * world  # 2W chunks of 8 tokens: 32 for W=2, 64 for W=4


def _inputs(world, hq, hkv, length=None):
    g = torch.Generator().manual_seed(1234)  # same seed on every rank: every rank builds the same full tensors
    L = length or _seq_len(world)
    mk = lambda h: torch.randn(B, h, L, D, dtype=torch.float64, generator=g)
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _compare(rank, world, hq, hkv, causal, kv_head_chunk=None, scale=None):
    q, k, v, dout = _inputs(world, hq, hkv)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attn.attention(*full, causal=causal, scale=scale)
    out.backward(dout)

    loc = [zigzag_split(t, world, rank).requires_grad_() for t in (q, k, v)]
    out_l = zigzag_llama3_attention(*loc, causal=causal, scale=scale, kv_head_chunk=kv_head_chunk)
    out_l.backward(zigzag_split(dout, world, rank))
    for name, got, want in [("out", out_l, out)] + [(f"d{n}", t.grad, f.grad) for n, t, f in zip("qkv", loc, full)]:
        torch.testing.assert_close(got, zigzag_split(want.detach(), world, rank), rtol=TOL, atol=TOL,
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


def _case_all_reduce_fallback(rank, world):
    from sparse_attn.parallel import comm
    comm._REDUCE_SCATTER_UNSUPPORTED.add("gloo")  # the path for backends without reduce_scatter
    try:
        _compare(rank, world, 4, 2, causal=True, kv_head_chunk=1)
    finally:
        comm._REDUCE_SCATTER_UNSUPPORTED.discard("gloo")


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


CASES = {f.__name__.removeprefix("_case_"): f for f in
         (_case_causal, _case_gqa, _case_noncausal, _case_kv_head_chunk, _case_all_reduce_fallback, _case_gather, _case_mismatch)}


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
