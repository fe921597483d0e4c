"""The host path of a kernel call (benchmarks/host_overhead_probe.py): what was trimmed from it must not
change what runs. Under TRITON_INTERPRET=1 (conftest.py) on small fp16 cases."""
from __future__ import annotations

import os

import pytest
import torch
import triton

from sparse_attn import patterns
from sparse_attn.ops.block_sparse import attention_op, function, launch

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="interpreter tests run only without a GPU")


def test_host_integer_helpers_match_triton():
    """_cdiv / _next_pow2 stand in for triton.cdiv / triton.next_power_of_2 in launch code."""
    for n in range(0, 3000):
        assert launch._next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 129):
            assert launch._cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: (torch.randn(*s, generator=g) * 2).half().requires_grad_(grad)  # noqa: E731
    return mk(1, 4, 3, 32), mk(1, 2, 80, 32), mk(1, 2, 80, 32)


def _spy_function(monkeypatch) -> list:
    """Count the calls that go through the autograd Function."""
    calls, apply = [], function._EagerForward.apply
    monkeypatch.setattr(function._EagerForward, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


@interpreted
def test_forward_without_grad_skips_the_autograd_function(monkeypatch):
    """Inference calls run the implementation directly and return what the Function returns, bit for bit;
    a call whose inputs require grad still goes through the Function and gets gradients."""
    layout = patterns.causal(3, 80, block_q=16, block_k=16)
    calls = _spy_function(monkeypatch)
    q, k, v = _inputs(grad=True)
    out_grad, lse_grad = attention_op(q, k, v, layout, return_lse=True)
    assert len(calls) == 1 and out_grad.grad_fn is not None
    out_grad.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0

    with torch.no_grad():  # inputs that require grad, grad mode off
        out_ng, lse_ng = attention_op(q, k, v, layout, return_lse=True)
    plain = tuple(t.detach() for t in (q, k, v))  # grad mode on, no input requires grad
    out_plain, lse_plain = attention_op(*plain, layout, return_lse=True)
    assert len(calls) == 1  # neither went through the Function
    for out, lse in ((out_ng, lse_ng), (out_plain, lse_plain)):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, out_grad.detach()) and torch.equal(lse, lse_grad.detach())


@interpreted
def test_layout_edit_after_a_call_is_still_seen():
    """The leaner fingerprint still notices an in-place edit of a layout's indices: the second call runs
    the edited layout (here: every block dropped, so zeros), not the cached schedule."""
    layout = patterns.dense(32, 64, block_q=16, block_k=16)
    q, k, v = _inputs(grad=False)
    q = q[:, :, :1].expand(1, 4, 32, 32).contiguous()
    first = attention_op(q, k[:, :, :64], v[:, :, :64], layout)
    assert first.abs().sum() > 0
    layout.kv_counts.zero_()
    second = attention_op(q, k[:, :, :64], v[:, :, :64], layout)
    assert torch.equal(second, torch.zeros_like(second))


def _schedule_rows(layout):
    from sparse_attn.ops.block_sparse.schedule import schedule
    s = schedule(layout)
    live = torch.arange(s.indices.shape[-1]) < s.counts[..., None]
    return (s.counts, s.n_full, torch.where(s.n_full > 0, s.full_start, 0), torch.where(live, s.indices, -1),
            torch.where(live, s.mask_ids, -1) >= 0, s.contiguous)


@pytest.mark.parametrize("causal", [False, True])
def test_one_sequence_layout_is_the_patterns_layout(causal):
    """A CUDA call without a layout runs api._one_sequence_layout (built here on the CPU): the blocks, mask
    terms and forward schedule of patterns.dense / causal on decoding, prefill and Lq > Lk shapes."""
    from sparse_attn import api
    builder = patterns.causal if causal else patterns.dense
    for lq, lk in [(1, 1), (1, 127), (1, 128), (1, 32769), (4, 300), (16, 4096), (300, 300), (129, 1000),
                   (1000, 129), (256, 256), (2, 0), (640, 5000)]:
        fast = api._one_sequence_layout(causal, lq, lk, "cpu")
        slow = builder(lq, lk, block_q=128, block_k=128)
        assert (fast.q_len, fast.kv_len, fast.block_q, fast.block_k) == (slow.q_len, slow.kv_len, 128, 128)
        rows = _schedule_rows(fast)
        for a, b in zip(rows, _schedule_rows(slow)):
            assert (a == b) if isinstance(a, bool) else torch.equal(a, b), (lq, lk)
        # the causal term, unless no block is partial (patterns.causal then leaves it out; unused, it changes nothing)
        assert set(fast.masks) == set(slow.masks) or not rows[4].any(), (lq, lk)
        assert (patterns.causal_cut(fast) is fast) == causal  # marked as its own causal cut


@interpreted
@pytest.mark.parametrize("lq,lk", [(1, 300), (3, 257), (130, 200)])
def test_one_sequence_layout_runs_as_the_patterns_layout(lq, lk):
    """The kernels give the same bits on both layouts (the causal term aligned bottom-right)."""
    from sparse_attn import api
    g = torch.Generator().manual_seed(lq + lk)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).half() for n in (lq, lk, lk))
    fast = attention_op(q, k, v, api._one_sequence_layout(True, lq, lk, "cpu"), return_lse=True)
    slow = attention_op(q, k, v, patterns.causal(lq, lk), return_lse=True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_plan_tensors_start_on_16_byte_boundaries():
    """A host-built plan's tensors share one copy; each starts 16-byte aligned whatever the plan's sizes,
    or a decoding loop compiles a new kernel variant (pointer alignment) as its cache grows."""
    from sparse_attn import api, varlen
    from sparse_attn.ops.block_sparse.schedule import schedule
    for lk in range(1000, 1000 + 129 * 5, 129):
        for layout in (api._one_sequence_layout(True, 1, lk, "cpu"),
                       varlen.stack_dense_or_causal([1, 2, 3], [lk, lk + 7, 5], True, 3, lk + 7, "cpu")):
            s = schedule(layout, [lk] if layout.batch == 1 else [lk, lk + 7, 5])
            for t in (s.counts, s.n_full, s.full_start, s.indices, s.mask_ids):
                assert t.data_ptr() % 16 == 0, (lk, tuple(t.shape))


@pytest.mark.parametrize("causal", [False, True])
def test_lengths_with_one_plan_key_have_one_plan(causal):
    """varlen.plan_key is what forward-only calls share default layouts by: any two (lq, lk) with one key get
    the same plan (blocks, masks, schedule); lengths whose plans differ get different keys. Every lk up to
    five key blocks, at decoding, short prefill and Lq > Lk lengths."""
    from sparse_attn import api
    from sparse_attn.varlen import ARITHMETIC_PLAN_ROWS, plan_key
    plans: dict = {}
    for lq in (1, 2, 5, 127, 128, 129, 300):
        for lk in range(0, 5 * 128 + 2):
            key = plan_key([lq], [lk], causal, lq)
            rows = _schedule_rows(api._one_sequence_layout(causal, lq, lk, "cpu"))
            rows = tuple(r if isinstance(r, bool) else str(r.tolist()) for r in rows)
            if key in plans:
                assert plans[key][1] == rows, (lq, lk, plans[key][0])
            plans[key] = ((lq, lk), rows)
    assert len({p[1] for p in plans.values()}) == len(plans)  # keys no finer than the plans need
    assert plan_key([1] * ARITHMETIC_PLAN_ROWS, [10] * ARITHMETIC_PLAN_ROWS, causal, 1) is not None
    assert plan_key([1], [10], causal, 128 * ARITHMETIC_PLAN_ROWS + 1) is None  # too long to key by a loop each call


@pytest.mark.parametrize("causal", [False, True])
def test_batches_with_one_plan_key_have_one_plan(causal):
    """The same for packed batches (varlen.stack_dense_or_causal, 16-token blocks): random batches of 1-3
    sequences, empty ones and Lq > Lk included, against the plan of every earlier batch with their key."""
    from sparse_attn.ops.block_sparse.schedule import schedule
    from sparse_attn.varlen import plan_key, stack_dense_or_causal
    g = torch.Generator().manual_seed(11)
    plans: dict = {}
    for _ in range(1500):
        n = int(torch.randint(1, 4, (1,), generator=g))
        q_lens = torch.randint(0, 20, (n,), generator=g).tolist()
        k_lens = torch.randint(0, 50, (n,), generator=g).tolist()
        max_q = max(q_lens) + int(torch.randint(0, 2, (1,), generator=g)) * 16
        layout = stack_dense_or_causal(q_lens, k_lens, causal, max_q, max(k_lens), "cpu", 16)
        s = schedule(layout, k_lens)
        rows = str([t.tolist() for t in (s.counts, s.n_full, s.full_start, s.indices, s.mask_ids)] + [s.contiguous])
        key = plan_key(q_lens, k_lens, causal, max_q, 16)
        assert plans.setdefault(key, rows) == rows, (q_lens, k_lens, max_q)
    assert len(plans) < 1500  # batches did share keys


def _host_plans(monkeypatch):
    """Default layouts built as on CUDA (one-sequence plans, shared by forward-only calls), run here by the
    interpreted kernels; empty caches."""
    from sparse_attn import api
    monkeypatch.setattr(api, "_use_kernels", lambda q: True)
    monkeypatch.setattr(api, "_plans_on_host", lambda device: True)
    monkeypatch.setattr(api, "_DEFAULT_LAYOUTS", {})
    monkeypatch.setattr(api, "_SHARED_PLANS", api.PlanCache(api.DEFAULT_LAYOUTS_KEPT))
    monkeypatch.setattr(api, "_VARLEN_PLANS", api.PlanCache(16))
    monkeypatch.setattr(api, "_SHARED_VARLEN_PLANS", api.PlanCache(16))
    return api


@interpreted
@pytest.mark.parametrize("causal", [False, True])
def test_a_growing_cache_plans_on_the_device_and_gives_the_patterns_bits(monkeypatch, causal):
    """A decoding loop's cache grows a token a call: forward-only calls without a layout run the kernels'
    device plan (no default layout is built or cached), and every step gives the bits of that step's own
    patterns layout, across a block edge (256: the last block no longer cut) and with Lq > 1 (the causal
    edge moves)."""
    import sparse_attn
    api = _host_plans(monkeypatch)
    g = torch.Generator().manual_seed(5)
    k_all, v_all = (torch.randn(1, 2, 300, 32, generator=g).half() for _ in range(2))
    builder = patterns.causal if causal else patterns.dense
    for lq, lens in ((1, (250, 251, 255, 256, 257)), (3, (250, 253, 255, 256, 257))):
        q = torch.randn(1, 4, lq, 32, generator=g).half()
        for lk in lens:
            k, v = k_all[:, :, :lk], v_all[:, :, :lk]
            out, lse = sparse_attn.attention(q, k, v, causal=causal, return_lse=True)
            assert api._DEFAULT_LAYOUTS == {} and len(api._SHARED_PLANS) == 0, (lq, lk)
            want = attention_op(q, k, v, builder(lq, lk), return_lse=True)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), (lq, lk)


@interpreted
def test_a_default_layout_shared_across_lengths_gives_each_length_s_bits(monkeypatch):
    """Forward-only default layouts of the host (the 8-bit path's, _default_layout(exact=False)) are shared
    across lengths with one varlen.plan_key: built for the first length, run for the others, each giving the
    bits of its own patterns layout; 257 keys have another plan."""
    from sparse_attn.varlen import plan_key
    api = _host_plans(monkeypatch)
    g = torch.Generator().manual_seed(6)
    k_all, v_all = (torch.randn(1, 2, 300, 32, generator=g).half() for _ in range(2))
    q = torch.randn(1, 4, 3, 32, generator=g).half()
    by_key: dict = {}
    for lk in (250, 253, 255, 257):
        lay = api._default_layout(True, 3, lk, "cpu", exact=False)
        by_key.setdefault(plan_key([3], [lk], True, 3), []).append(lay)
        k, v = k_all[:, :, :lk], v_all[:, :, :lk]
        got = attention_op(q, k, v, lay, return_lse=True)
        want = attention_op(q, k, v, patterns.causal(3, lk), return_lse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lk
    assert sorted(map(len, by_key.values())) == [1, 3]
    assert all(lay is group[0] and group[0].kv_len == 250 for group in by_key.values() if len(group) == 3
               for lay in group)


@interpreted
def test_a_call_that_needs_gradients_gets_a_layout_of_its_own_lengths(monkeypatch):
    """A shared layout carries the lengths it was built for, and the backward's transpose reads them: after
    forward-only (8-bit path) layouts at shared lengths, a call that needs gradients at those lengths
    replaces the entry by one built for them, and its gradients are those of its patterns layout; a later
    forward-only lookup keeps that exact one."""
    import sparse_attn
    api = _host_plans(monkeypatch)
    q, k, v = _inputs(grad=False)  # 3 queries, 80 keys
    api._default_layout(True, 3, 70, "cpu", exact=False)  # builds the plan for (3, 70)
    api._default_layout(True, 3, 80, "cpu", exact=False)
    key = (True, 3, 80, "cpu")
    assert api._DEFAULT_LAYOUTS[key].kv_len == 70  # shared with (3, 70)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = sparse_attn.attention(qg, kg, vg, causal=True)
    assert api._DEFAULT_LAYOUTS[key].kv_len == 80
    grads = torch.autograd.grad(out.float().square().sum(), (qg, kg, vg))
    qw, kw, vw = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = attention_op(qw, kw, vw, patterns.causal(3, 80))
    assert torch.equal(out, want)
    for got, exp in zip(grads, torch.autograd.grad(want.float().square().sum(), (qw, kw, vw))):
        assert torch.equal(got, exp)
    exact = api._DEFAULT_LAYOUTS[key]
    assert api._default_layout(True, 3, 80, "cpu", exact=False) is exact


@interpreted
def test_compiling_a_training_call_after_forward_only_calls_asks_for_a_grad_warm_up(monkeypatch):
    """torch.compile reads default layouts and cannot build one. A forward-only call needs none (the kernels'
    device plan, eager and compiled alike, so no warm-up); a compiled call that needs gradients is refused,
    forward-only eager calls notwithstanding, until an eager call with grad has built the layout for its
    lengths, then compiles."""
    import sparse_attn
    _host_plans(monkeypatch)
    q, k, v = _inputs(grad=False)
    with torch.no_grad():
        sparse_attn.attention(q, k[:, :, :70], v[:, :, :70], causal=True)  # the plan (3, 80) shares
        want = sparse_attn.attention(q, k, v, causal=True)

    def f(q, k, v):
        return sparse_attn.attention(q, k, v, causal=True)

    with torch.no_grad():
        assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), want)
    torch._dynamo.reset()
    qg = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="with grad enabled if the compiled code trains"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(qg, k, v)
    torch._dynamo.reset()
    f(qg, k, v)
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(qg, k, v), want)


def _packed_step(g_seed: int, q_lens, k_lens, grad: bool = False):
    """Packed q / k / v of one continuous-batching step (each sequence's cache its own random prefix, so a
    longer step extends it) with cu_seqlens."""
    g = torch.Generator().manual_seed(g_seed)
    caches = [torch.randn(2, 300, 2, 32, generator=g).half() for _ in k_lens]  # per sequence: (k, v) x 300 keys
    q = torch.randn(sum(q_lens), 4, 32, generator=g).half()
    k = torch.cat([c[0, :n] for c, n in zip(caches, k_lens)])
    v = torch.cat([c[1, :n] for c, n in zip(caches, k_lens)])
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return [t.requires_grad_(grad) for t in (q, k, v)], cu(q_lens), cu(k_lens)


@interpreted
def test_continuous_batching_steps_plan_on_the_device_and_give_each_step_s_bits(monkeypatch):
    """varlen_attention without layouts, every cache a token longer each step, forward only: the kernels plan
    each row from the offsets (the device plan), so no plan is built or cached on the host, and each step
    gives the bits of its own per-sequence patterns.causal layouts (across 128 keys, where the first
    sequence's last block stops being cut)."""
    import sparse_attn
    api = _host_plans(monkeypatch)
    q_lens = [1, 2, 1]
    for step in range(5):
        k_lens = [124 + step, 200 + step, 131 + step]
        (q, k, v), cu_q, cu_k = _packed_step(step, q_lens, k_lens)
        args = (q, k, v, cu_q, cu_k, 2, max(k_lens))
        planned = len(api._VARLEN_PLANS)  # the pattern calls' plans (want, below)
        out, lse = sparse_attn.varlen_attention(*args, causal=True, return_lse=True)
        assert len(api._VARLEN_PLANS) == planned and len(api._SHARED_VARLEN_PLANS) == 0, step
        want = sparse_attn.varlen_attention(*args, pattern=patterns.causal, return_lse=True)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), k_lens


@interpreted
def test_a_varlen_call_that_needs_gradients_gets_a_plan_of_its_own_lengths(monkeypatch):
    """Forward-only plans of the host (the 8-bit path's) are shared across lengths with one varlen.plan_key;
    a call needing gradients at lengths whose entry another step's lengths built gets a plan built for
    them, and the gradients of its per-sequence patterns layouts."""
    import sparse_attn
    api = _host_plans(monkeypatch)
    q_lens = [1, 2, 1]
    for k_lens in ([124, 200, 131], [125, 201, 132]):
        api._varlen_plan(q_lens, k_lens, None, None, True, 4, 2, max(k_lens), "cpu", exact=False)
    key = (tuple(q_lens), tuple(k_lens), 2, max(k_lens), True, 4, "cpu", id(None), None)
    assert api._VARLEN_PLANS.find(key).lengths[1] == (124, 200, 131)  # shared
    (q, k, v), cu_q, cu_k = _packed_step(0, q_lens, k_lens, grad=True)
    out = sparse_attn.varlen_attention(q, k, v, cu_q, cu_k, 2, max(k_lens), causal=True)
    assert api._VARLEN_PLANS.find(key).lengths[1] == tuple(k_lens)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    (qw, kw, vw), _, _ = _packed_step(0, q_lens, k_lens, grad=True)
    want = sparse_attn.varlen_attention(qw, kw, vw, cu_q, cu_k, 2, max(k_lens), pattern=patterns.causal)
    assert torch.equal(out, want)
    for got, exp in zip(grads, torch.autograd.grad(want.float().square().sum(), (qw, kw, vw))):
        assert torch.equal(got, exp)


def test_every_default_layout_a_graph_was_captured_on_is_kept(monkeypatch):
    """A graph replays on the tensors of the layout it was captured with. One shape's entry can change (a
    shared layout, then one built for a call that needs gradients); both captured layouts stay alive."""
    api = _host_plans(monkeypatch)
    monkeypatch.setattr(api, "_CAPTURED_DEFAULTS", {})
    capturing = [False]
    monkeypatch.setattr(api, "capturing", lambda device: capturing[0])
    api._default_layout(True, 1, 290, "cpu", exact=False)
    shared = api._default_layout(True, 1, 300, "cpu", exact=False)
    assert shared.kv_len == 290
    capturing[0] = True
    assert api._default_layout(True, 1, 300, "cpu", exact=False) is shared
    with pytest.raises(RuntimeError, match="with grad enabled if the captured code trains"):
        api._default_layout(True, 1, 300, "cpu", exact=True)
    capturing[0] = False
    exact = api._default_layout(True, 1, 300, "cpu", exact=True)
    assert exact.kv_len == 300
    capturing[0] = True
    assert api._default_layout(True, 1, 300, "cpu", exact=True) is exact
    kept = list(api._CAPTURED_DEFAULTS.values())
    assert len(kept) == 2 and any(k is shared for k in kept) and any(k is exact for k in kept)
