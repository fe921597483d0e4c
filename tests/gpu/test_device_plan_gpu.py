"""The kernels' device plan on the GPU (launch.forward ``device_plan``): forward-only dense / causal varlen
calls planned from the offsets in the kernel. Bit for bit the host plan's results (what calls that need
gradients run), checked against the fp64 oracle, and what makes a continuous-batching step capturable in a
CUDA graph whose replays follow new lengths. Fresh random inputs; outputs poisoned before replays."""
from __future__ import annotations

import random

import pytest
import torch

import sparse_attn
from sparse_attn import api
from sparse_attn.ops.block_sparse import varlen_attention_op, varlen_device_plan_op
from sparse_attn.testing import assert_close_to_oracle, capture_graph, oracle_attention, reference_attention
from sparse_attn.varlen import stack_dense_or_causal

pytestmark = pytest.mark.gpu


def _cu(lens, device="cuda") -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _packed(q_lens, k_lens, hq, hkv, d, dtype, seed, spare: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(sum(q_lens), hq), mk(sum(k_lens) + spare, hkv), mk(sum(k_lens) + spare, hkv)


def _window_pattern(window: int, num_sink: int = 0):
    """The host's layout of a window call: patterns.local, or patterns.streaming with sinks."""
    from sparse_attn import patterns
    if num_sink:
        return lambda lq, lk, device=None: patterns.streaming(lq, window, num_sink, kv_len=lk, device=device)
    return lambda lq, lk, device=None: patterns.local(lq, window, kv_len=lk, device=device)


def _per_sequence_oracle(out, q, k, v, q_lens, k_lens, causal, window=None, num_sink=0):
    """Each sequence's rows of ``out`` against the same-dtype reference and the fp64 oracle (rule 3); with
    ``window``, under patterns.local's (with sinks patterns.streaming's) layout of the sequence."""
    from sparse_attn import patterns
    cq, ck = _cu(q_lens, "cpu").tolist(), _cu(k_lens, "cpu").tolist()
    for b in range(len(q_lens)):
        if q_lens[b] == 0 or k_lens[b] == 0:
            continue
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ks, vs = (t[ck[b]:ck[b + 1]].transpose(0, 1)[None] for t in (k, v))
        got = out[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        layout = None if window is None else _window_pattern(window, num_sink)(q_lens[b], k_lens[b], q.device)
        assert_close_to_oracle(got, reference_attention(qs, ks, vs, layout, causal=causal),
                               oracle_attention(qs, ks, vs, layout, causal=causal))


CASES = [  # (q_lens, k_lens, hq, hkv, d): decoding, GQA packed rows, chunked prefill, odd and empty sequences
    ([1] * 8, [1000, 4096, 130, 2500, 3000, 700, 1900, 260], 32, 8, 128),
    ([1, 3, 1, 2], [20001, 517, 4097, 0], 16, 16, 128),
    ([700, 129, 1, 0], [700, 3000, 5000, 64], 8, 2, 64),
    ([1000, 300], [1000, 2500], 8, 8, 256),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_device_plan_gives_the_host_plan_s_bits(dtype, causal, case):
    q_lens, k_lens, hq, hkv, d = CASES[case]
    q, k, v = _packed(q_lens, k_lens, hq, hkv, d, dtype, seed=case)
    max_q, max_k = max(q_lens), max(k_lens) + 5
    got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, causal, return_lse=True)
    layout = stack_dense_or_causal(q_lens, k_lens, causal, max_q, max_k, q.device)
    want = varlen_attention_op(q, k, v, layout, _cu(q_lens), _cu(k_lens), max_q, max_k, tuple(k_lens),
                               return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _per_sequence_oracle(got[0], q, k, v, q_lens, k_lens, causal)


def test_varlen_attention_runs_the_device_plan_without_grad_and_the_host_plan_with_it(monkeypatch):
    monkeypatch.setattr(api, "_VARLEN_PLANS", api.PlanCache(16))
    q_lens, k_lens = [3, 1, 2], [900, 4100, 33]
    q, k, v = _packed(q_lens, k_lens, 16, 4, 128, torch.bfloat16, seed=5)
    args = (q, k, v, _cu(q_lens), _cu(k_lens), 3, 4100)
    out = sparse_attn.varlen_attention(*args, causal=True)
    assert len(api._VARLEN_PLANS) == 0
    qg = q.clone().requires_grad_()
    out_g = sparse_attn.varlen_attention(qg, *args[1:], causal=True)
    assert len(api._VARLEN_PLANS) == 1 and torch.equal(out, out_g)


@pytest.mark.parametrize("window,num_sink", [(None, 0), (512, 0), (512, 64)])
def test_a_captured_decoding_step_follows_new_lengths_on_replay(window, num_sink):
    """Capture one varlen decoding step (8 sequences, GQA, causal or a causal window, sinks or not, max_seqlen_k
    fixed) on buffers with room for every cache, then replay it with the caches grown a token, then shrunk,
    regrown and emptied at random (the offsets rewritten in place, q refilled): each replay equals an eager call
    on the step's tensors bit for bit (the same kernels and split), the outputs are poisoned before every
    replay, and the last one is checked against the fp64 oracle."""
    n_seqs, cap, hq, hkv, d = 8, 4200, 32, 8, 128
    rnd = random.Random(1)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(n_seqs, hq, d, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(n_seqs * cap, hkv, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu_q = _cu([1] * n_seqs)
    lens = [rnd.randint(1, cap - 1) for _ in range(n_seqs)]  # room for the first step's token
    cu_k = _cu(lens)

    def call(kk, vv, offsets):
        return sparse_attn.varlen_attention(q, kk, vv, cu_q, offsets, 1, cap, causal=True, window=window,
                                            num_sink=num_sink, return_lse=True)

    t = sum(lens)
    # eager warm-up calls want offsets that end at the tensors' length; the capture takes the whole buffers
    graph, (out, lse) = capture_graph(lambda: call(k, v, cu_k), warm_up=lambda: call(k[:t], v[:t], cu_k))
    for trial in range(5):
        lens = [n + 1 for n in lens] if trial == 0 else [rnd.randint(0 if trial == 4 else 1, cap)
                                                         for _ in range(n_seqs)]
        cu_k.copy_(_cu(lens))
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        t = sum(lens)
        want = call(k[:t], v[:t], _cu(lens))
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), trial
    _per_sequence_oracle(out, q, k, v, [1] * n_seqs, lens, True, window, num_sink)


def test_a_captured_prefill_chunk_follows_new_lengths_on_replay():
    """Longer query rows take the autotuned kernel (warmed up by capture_graph's eager calls): a captured
    chunked-prefill step (4 sequences, up to 700 new rows on up to 6000 keys) replayed on new lengths of
    the same totals equals eager calls bit for bit."""
    q_lens, k_lens = [700, 100, 1, 223], [3000, 6000, 1, 999]
    q, k, v = _packed(q_lens, k_lens, 8, 8, 128, torch.bfloat16, seed=3)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)

    def step():
        return sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 700, 6000, causal=True)

    graph, out = capture_graph(step)
    # the same totals (eager validation wants offsets ending at the tensors' lengths), within max_seqlen
    for q_new, k_new in (([100, 700, 222, 2], [6000, 1000, 999, 2001]), ([700, 324, 0, 0], [6000, 4000, 0, 0])):
        cu_q.copy_(_cu(q_new))
        cu_k.copy_(_cu(k_new))
        out.fill_(float("nan"))
        graph.replay()
        want = sparse_attn.varlen_attention(q, k, v, _cu(q_new), _cu(k_new), 700, 6000, causal=True)
        assert torch.equal(out, want), (q_new, k_new)


def test_eager_device_plan_calls_do_not_grow_memory():
    q_lens, k_lens = [1] * 8, [3000 + 37 * i for i in range(8)]
    q, k, v = _packed(q_lens, k_lens, 32, 8, 128, torch.bfloat16, seed=4)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    for _ in range(3):
        sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 1, 3300, causal=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 1, 3300, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


WINDOW_CASES = [  # (q_lens, k_lens, hq, hkv, d, window): decoding rows, a chunked prefill, odd / empty sequences
    ([1] * 8, [1000, 4096, 130, 2500, 3000, 700, 1900, 260], 32, 8, 128, 1024),
    ([1, 3, 1, 2], [20001, 517, 4097, 0], 16, 16, 128, 4096),
    ([700, 129, 1, 0], [700, 3000, 5000, 64], 8, 2, 64, 300),
    ([1000, 300], [1000, 2500], 8, 8, 256, 129),
    ([2000, 517], [2000, 4000], 8, 4, 128, 1),
]


def _window_host_plan(q, k, v, q_lens, k_lens, window, max_q, max_k, num_sink=0):
    """The same call on the host's plan of patterns.local (streaming) layouts (what a call that needs gradients
    runs)."""
    from sparse_attn import varlen
    build = _window_pattern(window, num_sink)
    per_seq = varlen.build_layouts(q_lens, k_lens, None, lambda lq, lk: build(lq, lk), True)
    stacked = varlen.stack([lay.to(q.device) for lay in per_seq], max_q, max_k, q.shape[1])
    return varlen_attention_op(q, k, v, stacked, _cu(q_lens), _cu(k_lens), max_q, max_k, tuple(k_lens),
                               return_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
@pytest.mark.parametrize("num_sink", [0, 100, 300])
def test_the_window_device_plan_gives_the_host_plan_s_bits(dtype, case, num_sink, monkeypatch):
    """DEVICE_PLAN 3 (varlen_attention(causal=True, window=W[, num_sink=S]) without gradients) against
    patterns.local's (streaming's) host plan, bit for bit with the key walk unsplit (the host plan sizes its
    split by its own longest row), and against the fp64 oracle per sequence with the automatic split. 300 sinks
    fill two blocks: the host schedules those rows as indexed, for which the autotuner may pick another tile
    than for the device plan's contiguous rows, so with sinks one config runs."""
    from sparse_attn.ops.block_sparse import launch
    if num_sink:
        monkeypatch.setattr(launch, "AUTOTUNE", False)
        monkeypatch.setattr(launch, "_TUNED", {})
    q_lens, k_lens, hq, hkv, d, window = WINDOW_CASES[case]
    q, k, v = _packed(q_lens, k_lens, hq, hkv, d, dtype, seed=20 + case)
    max_q, max_k = max(q_lens), max(k_lens) + 5
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "1")
    got = varlen_device_plan_op(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, True, return_lse=True, window=window,
                                num_sink=num_sink)
    want = _window_host_plan(q, k, v, q_lens, k_lens, window, max_q, max_k, num_sink)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setattr(launch, "FWD_KV_SPLIT", "auto")
    out = sparse_attn.varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), max_q, max_k, causal=True, window=window,
                                       num_sink=num_sink)
    _per_sequence_oracle(out, q, k, v, q_lens, k_lens, True, window, num_sink)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq,lk,window,hkv", [(1, 20001, 4096, 8), (4, 3000, 1, 32), (700, 700, 256, 8),
                                               (1000, 2500, 1024, 4), (300, 129, 100, 32)])
@pytest.mark.parametrize("num_sink", [0, 300])
def test_attention_s_window_without_a_layout_gives_patterns_local_s_bits(dtype, lq, lk, window, hkv, num_sink,
                                                                         monkeypatch):
    """attention(causal=True, window=W[, num_sink=S]) without gradients plans the window in the kernel; bit for
    bit the same call on patterns.local's (streaming's) layout, and within the same-dtype reference's error of
    the fp64 oracle. Rows with whole sink blocks have two unmasked runs, which the host schedules as indexed rows:
    a padded call walks those in the wave order (a rotated start, launch.FWD_WAVE), and the autotuner may pick
    indexed rows another tile than contiguous ones (the device plan's), so with sinks the bits are compared with
    the wave off and one config (H200: with both on, 4 of 10 such cases differed in their last bits)."""
    from sparse_attn.ops.block_sparse import attention_op, launch
    if num_sink:
        monkeypatch.setattr(launch, "FWD_WAVE", False)
        monkeypatch.setattr(launch, "AUTOTUNE", False)
        monkeypatch.setattr(launch, "_TUNED", {})
    g = torch.Generator(device="cuda").manual_seed(lq + lk)
    q = torch.randn(2, 32, lq, 128, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, hkv, lk, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
    got = sparse_attn.attention(q, k, v, causal=True, window=window, num_sink=num_sink, return_lse=True)
    layout = _window_pattern(window, num_sink)(lq, lk, "cuda")
    want = attention_op(q, k, v, layout, return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_close_to_oracle(got[0], reference_attention(q, k, v, layout), oracle_attention(q, k, v, layout))


def test_a_window_decoding_step_captures_without_a_warm_up_and_trains_through_patterns_local():
    """A forward-only decoding step with a window needs no plan, so its first call at new lengths may be inside
    a capture (an eager call at other lengths compiled the kernel); replays on new q equal eager calls. With
    gradients the call runs patterns.local (close to the oracle)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(1, 32, 1, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, 8, 9000, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    sparse_attn.attention(q, k[:, :, :5000], v[:, :, :5000], causal=True, window=2048)
    graph, out = capture_graph(lambda: sparse_attn.attention(q, k, v, causal=True, window=2048), warmup=0)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, sparse_attn.attention(q, k, v, causal=True, window=2048))
    from sparse_attn import patterns
    leaves = [torch.randn(1, h, 600, 64, device="cuda", generator=g).bfloat16().requires_grad_() for h in (8, 4, 4)]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    out = sparse_attn.attention(*leaves, causal=True, window=200)
    out.float().square().sum().backward()
    layout = patterns.local(600, 200, device="cuda")
    want = sparse_attn.attention(*twins, layout, causal=True)
    want.float().square().sum().backward()
    assert torch.equal(out, want) and all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, twins))
    detached = [t.detach() for t in leaves]
    assert_close_to_oracle(out, reference_attention(*detached, layout), oracle_attention(*detached, layout))
