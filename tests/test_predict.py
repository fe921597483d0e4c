"""sparse_attn.predict: meansim against a loop-by-loop implementation of its documented rule,
monotonicity and limits of the thresholds, and adaptive_attention against dense attention.

The slow oracle below works block by block with Python loops and plain per-block torch calls
(F.cosine_similarity, Python softmax over a list), straight from the rule in
``sparse_attn/predict/meansim.py``'s docstring; token masks are checked against the block
decision expanded to tokens and cut by ``j <= i + Lk - Lq`` when causal.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import sparse_attn
from sparse_attn import BlockLayout, LayoutError, metrics, viz
from sparse_attn.accuracy import structured_qkv
from sparse_attn.predict import SPARSE_LEVELS, adaptive_attention, level_params, meansim
from sparse_attn.testing import causal_token_mask


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- inputs and oracle
def mixed_qk(B, Hq, Hkv, Lq, Lk, D, bq, bk, seed=0):
    """float64 q/k whose blocks range from pure noise to near-constant (a mix of self-similar and not)."""
    g = torch.Generator().manual_seed(seed)

    def make(H, L, blk):
        nb = math.ceil(L / blk)
        centre = torch.randn(B, H, nb, D, generator=g, dtype=torch.float64)
        strength = torch.tensor([0.0, 0.7, 3.0], dtype=torch.float64)[torch.randint(0, 3, (B, H, nb), generator=g)]
        base = (centre * strength[..., None]).repeat_interleave(blk, 2)[:, :, :L]
        return base + torch.randn(B, H, L, D, generator=g, dtype=torch.float64)

    return make(Hq, Lq, bq), make(Hkv, Lk, bk)


def slow_block_keep(q, k, *, simthreshd1, cdfthreshd, topk, bq, bk, causal, sink, scale=None):
    """bool [B, Hq, Qb, Kb]: the documented rule, one (batch, head, query block) at a time."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    nq, nk = math.ceil(Lq / bq), math.ceil(Lk / bk)
    scale = 1 / math.sqrt(D) if scale is None else scale
    sims = simthreshd1 if isinstance(simthreshd1, (list, tuple)) else [simthreshd1] * Hq

    def pool(x, blk, n_blocks):
        means, sim = [], []
        for i in range(n_blocks):
            tok = x[i * blk:(i + 1) * blk].double()
            m = tok.mean(0)
            means.append(m)
            sim.append(float(F.cosine_similarity(tok, m[None], dim=-1).mean()))
        return means, sim

    keep = torch.zeros(B, Hq, nq, nk, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            mq, sq = pool(q[b, h], bq, nq)
            mk, sk = pool(k[b, h // group], bk, nk)
            thr = sims[h]
            for qb in range(nq):
                p_last = min((qb + 1) * bq, Lq) - 1 + (Lk - Lq)
                d = p_last // bk
                visible = [kb for kb in range(nk) if not causal or kb <= d]
                kept = set()
                if sq[qb] < thr:
                    kept |= set(visible)
                kept |= {kb for kb in visible if sk[kb] < thr}
                if causal:  # every key block holding some row's own position p >= 0
                    own = range(max(qb * bq + Lk - Lq, 0), p_last + 1)
                    kept |= {kb for kb in visible if any(kb * bk <= p < (kb + 1) * bk for p in own)}
                if sink and 0 in visible:
                    kept.add(0)
                cands = [kb for kb in visible if sk[kb] >= thr]
                score = {kb: float(mq[qb] @ mk[kb]) * scale for kb in cands}
                ranked = sorted(cands, key=lambda kb: -score[kb])  # stable: ties keep lower kb first
                if topk is not None:
                    kept |= set(ranked[:math.ceil(topk * len(visible) - 1e-9)])
                elif ranked:
                    top = max(score.values())
                    w = {kb: math.exp(score[kb] - top) for kb in ranked}
                    total = sum(w.values())
                    mass = 0.0
                    for kb in ranked:
                        if mass < cdfthreshd or cdfthreshd >= 1:
                            kept.add(kb)
                        mass += w[kb] / total
                for kb in kept:
                    keep[b, h, qb, kb] = True
    return keep


def expected_token_mask(block_keep, Lq, Lk, bq, bk, causal):
    tok = block_keep.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :Lq, :Lk]
    return tok & causal_token_mask(Lq, Lk) if causal else tok


# ----------------------------------------------------------------------------- meansim vs the oracle
SHAPES = [  # B, Hq, Hkv, Lq, Lk, D, block_q, block_k
    (1, 2, 2, 100, 100, 16, 16, 16),
    (2, 4, 2, 77, 130, 16, 16, 32),     # GQA, Lq < Lk, tails
    (1, 3, 1, 130, 50, 8, 32, 16),      # MQA, Lq > Lk (first rows see no key under causal)
    (1, 2, 2, 1, 1, 16, 16, 16),        # L = 1
    (1, 2, 1, 160, 160, 16, 32, 32),    # block multiples
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}Hq{}Hkv{}_Lq{}Lk{}_D{}_b{}x{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_meansim_matches_slow_rule(shape, causal):
    B, Hq, Hkv, Lq, Lk, D, bq, bk = shape
    q, k = mixed_qk(B, Hq, Hkv, Lq, Lk, D, bq, bk, seed=Lq + Lk)
    settings = [dict(simthreshd1=0.5, cdfthreshd=0.9, topk=None, sink=False),
                dict(simthreshd1=0.3, cdfthreshd=0.6, topk=None, sink=True),
                dict(simthreshd1=0.5, cdfthreshd=0.9, topk=0.3, sink=False),
                dict(simthreshd1=[0.2, 0.9] + [0.5] * (Hq - 2), cdfthreshd=0.8, topk=None, sink=True)]
    mixed = 0
    for s in settings:
        layout = meansim(q, k, simthreshd1=s["simthreshd1"], cdfthreshd=s["cdfthreshd"], topk=s["topk"],
                         block_q=bq, block_k=bk, causal=causal, attention_sink=s["sink"])
        layout.validate()
        assert (layout.batch, layout.heads, layout.q_len, layout.kv_len) == (B, Hq, Lq, Lk)
        assert (layout.block_q, layout.block_k) == (bq, bk)
        keep = slow_block_keep(q, k, simthreshd1=s["simthreshd1"], cdfthreshd=s["cdfthreshd"], topk=s["topk"],
                               bq=bq, bk=bk, causal=causal, sink=s["sink"])
        want_tok = expected_token_mask(keep, Lq, Lk, bq, bk, causal)
        assert torch.equal(layout.to_token_mask(), want_tok), s
        # blocks the causal cut leaves empty are not listed; every listed block holds an allowed token
        nq, nk = layout.num_q_blocks, layout.num_kv_blocks
        padded = F.pad(want_tok, (0, nk * bk - Lk, 0, nq * bq - Lq))
        assert torch.equal(layout.to_block_mask(), padded.view(B, Hq, nq, bq, nk, bk).any(3).any(-1))
        if causal:  # == the kept blocks intersected with patterns.causal: same full / partial / absent states
            ref = BlockLayout.from_block_mask(keep, block_q=bq, block_k=bk, q_len=Lq, kv_len=Lk) & \
                sparse_attn.patterns.causal(Lq, Lk, block_q=bq, block_k=bk)
            assert torch.equal(viz.block_states(layout), viz.block_states(ref))
        mixed += 0.0 < layout.sparsity < 1.0
    if Lq > 1:
        assert mixed >= 2  # the inputs exercise both kept and skipped blocks


def test_block_pair_and_scale():
    q, k = mixed_qk(1, 2, 2, 96, 96, 16, 32, 16)
    a = meansim(q, k, block=(32, 16), simthreshd1=0.4)
    b = meansim(q, k, block_q=32, block_k=16, simthreshd1=0.4)
    assert (a.block_q, a.block_k) == (32, 16) and torch.equal(a.to_token_mask(), b.to_token_mask())
    c = meansim(q, k, block=32, simthreshd1=0.4)
    assert (c.block_q, c.block_k) == (32, 32)
    hot = meansim(q, k, block=16, simthreshd1=0.4, cdfthreshd=0.9, scale=5.0)
    want = slow_block_keep(q, k, simthreshd1=0.4, cdfthreshd=0.9, topk=None, bq=16, bk=16, causal=False, sink=False,
                           scale=5.0)
    assert torch.equal(hot.to_block_mask(), want)


# ----------------------------------------------------------------------------- threshold behaviour
def test_cdf_monotone_superset():
    q, k, _ = structured_qkv(1, 2, 512, 32, seed=1, dtype=torch.float64)
    for causal in (False, True):
        prev, prev_sp = None, 1.0
        sparsities = []
        for thr in (0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0):
            layout = meansim(q, k, simthreshd1=0.3, cdfthreshd=thr, block=32, causal=causal)
            blocks = layout.to_block_mask()
            if prev is not None:
                assert bool((prev <= blocks).all()), f"cdfthreshd {thr} dropped blocks"
            assert layout.sparsity <= prev_sp + 1e-12
            prev, prev_sp = blocks, layout.sparsity
            sparsities.append(layout.sparsity)
        assert sparsities[0] > sparsities[-1]  # the thresholds actually matter on this input
    prev = None
    for frac in (0.1, 0.25, 0.5, 1.0):
        blocks = meansim(q, k, simthreshd1=0.3, topk=frac, block=32).to_block_mask()
        assert prev is None or bool((prev <= blocks).all())
        prev = blocks
    assert bool(prev.all())  # topk=1.0 keeps every block


@pytest.mark.parametrize("causal", [False, True])
def test_limits_give_dense(causal):
    Lq, Lk = 200, 230
    q, k = mixed_qk(2, 4, 2, Lq, Lk, 16, 32, 32)
    full = sparse_attn.patterns.causal(Lq, Lk, block_q=32, block_k=32) if causal else \
        sparse_attn.patterns.dense(Lq, Lk, block_q=32, block_k=32)
    want = full.to_token_mask().expand(2, 4, Lq, Lk)
    # nothing is self-similar (cosines are <= 1): every visible block is computed
    a = meansim(q, k, simthreshd1=1.01, cdfthreshd=0.1, block=32, causal=causal)
    assert torch.equal(a.to_token_mask(), want)
    # everything self-similar and the whole mass kept: dense rows
    b = meansim(q, k, simthreshd1=-1.0, cdfthreshd=1.0, block=32, causal=causal)
    assert torch.equal(b.to_token_mask(), want)
    assert a.num_blocks == b.num_blocks == full.num_blocks * 8
    # a tiny mass keeps one ranked block per row (plus, causal, the 2 blocks of its rows' own keys: Lk - Lq = 30)
    c = meansim(q, k, simthreshd1=-1.0, cdfthreshd=1e-6, block=32, causal=causal)
    counts = c.kv_counts
    visible_rows = full.kv_counts.expand_as(counts) > 0
    assert bool((counts[visible_rows] >= 1).all()) and bool((counts <= (3 if causal else 1)).all())


def ramp_qk(Lq, Lk, D=32, seed=0):
    """float64 q/k, every block self-similar, later keys scoring higher: the top-ranked key block of a
    causal row is its diagonal block, so a tiny mass keeps nothing before it."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 2, 1, D, generator=g, dtype=torch.float64)
    q = base + 0.05 * torch.randn(1, 2, Lq, D, generator=g, dtype=torch.float64)
    ramp = torch.linspace(0.5, 2.0, Lk, dtype=torch.float64)[:, None]
    return q, base * ramp + 0.05 * torch.randn(1, 2, Lk, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("Lq, Lk, block",
                         [(512, 1000, 128), (256, 256, (128, 64)), (100, 130, 32), (130, 50, (32, 16))])
def test_causal_prediction_keeps_every_rows_own_key(Lq, Lk, block):
    """A query block whose rows straddle two key blocks (Lk - Lq not a multiple of block_k, as with a
    KV cache, or block_q > block_k): only the block of its last row was forced, so its first rows kept
    no key at all and attention gave them output 0 (Lq=512, Lk=1000 in 128-blocks: 192 of 1024 rows)."""
    q, k = ramp_qk(Lq, Lk)
    layout = meansim(q, k, block=block, causal=True, simthreshd1=0.5, cdfthreshd=0.5)
    assert layout.sparsity > 0.3  # the rule still prunes
    tok = layout.to_token_mask()                                     # [1, 2, Lq, Lk]
    rows = torch.arange(Lq)
    pos = rows + Lk - Lq
    sees = pos >= 0                                                  # rows that may see a key
    assert bool(tok[:, :, rows[sees], pos[sees]].all())              # each keeps its own key
    out = sparse_attn.attention(q, k, torch.randn_like(k), layout, causal=True)
    assert bool((out[:, :, sees].abs().sum(-1) > 0).all())


def test_attention_sink_keeps_first_block():
    q, k = mixed_qk(1, 2, 2, 128, 128, 16, 16, 16)
    layout = meansim(q, k, simthreshd1=-1.0, cdfthreshd=1e-6, block=16, attention_sink=True)
    assert bool(layout.to_block_mask()[..., 0].all())


def test_argument_errors():
    q, k = mixed_qk(1, 4, 2, 64, 64, 16, 16, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        meansim(q, torch.randn(1, 3, 64, 16, dtype=q.dtype))
    with pytest.raises(ValueError, match="cdfthreshd"):
        meansim(q, k, cdfthreshd=0.0)
    with pytest.raises(ValueError, match="topk"):
        meansim(q, k, topk=1.5)
    with pytest.raises(ValueError, match="simthreshd1 has 3 values"):
        meansim(q, k, simthreshd1=[0.1, 0.2, 0.3])
    with pytest.raises(LayoutError, match="block_q"):
        meansim(q, k, block_q=20)
    with pytest.raises(ValueError, match="head_dim"):
        meansim(q, k[..., :8])
    with pytest.raises(ValueError, match="level"):
        level_params("extreme")


def test_argument_errors_name_the_argument():
    # each of these ran (a str causal predicted a causal layout) or failed deep inside (ZeroDivisionError,
    # "cannot unpack non-iterable float", "must be real number, not NoneType", "'float' is not iterable")
    q, k = mixed_qk(1, 2, 2, 64, 64, 16, 16, 16)
    with pytest.raises(TypeError, match="causal must be True or False, got str 'no'"):
        meansim(q, k, causal="no", block=16)
    with pytest.raises(TypeError, match="attention_sink must be True or False"):
        meansim(q, k, attention_sink=1, block=16)
    with pytest.raises(ValueError, match="head_dim 0"):
        meansim(q[..., :0], k[..., :0])
    with pytest.raises(TypeError, match="block must be an int or a \\(block_q, block_k\\) pair, got 16.0"):
        meansim(q, k, block=16.0)
    with pytest.raises(TypeError, match="block must be an int or a"):
        meansim(q, k, block=(16,))
    assert meansim(q, k, block=(16, 32)).block_k == 32
    for name in ("simthreshd1", "cdfthreshd"):
        with pytest.raises(TypeError, match=f"{name} must be a number or 2 per-head numbers, got None"):
            meansim(q, k, block=16, **{name: None})
    v = torch.randn_like(k)
    with pytest.raises(TypeError, match="adaptive= takes a dict of meansim options .* got float 0.5"):
        sparse_attn.attention(q, k, v, "adaptive", adaptive=0.5)
    with pytest.raises(ValueError, match="unknown layout 'adaptive:'"):
        sparse_attn.attention(q, k, v, "adaptive:")  # an empty level ran as "adaptive"
    with pytest.raises(ValueError, match="kv_heads \\(0\\), which must be >= 1"):
        structured_qkv(1, 3, 64, 32, kv_heads=0)


# ----------------------------------------------------------------------------- adaptive attention
def test_adaptive_close_to_dense_at_low_level():
    q, k, v = structured_qkv(1, 2, 1024, 64, seed=0)
    dense = sparse_attn.attention(q, k, v)
    out, layout = adaptive_attention(q, k, v, **level_params("low"))
    assert layout.sparsity > 0.05
    assert metrics.cosine_similarity(out, dense) > 0.99
    assert metrics.relative_l1(out, dense) < 0.05
    layout.validate()


def test_adaptive_levels_order_and_causal_gqa():
    q, k, v = structured_qkv(1, 4, 768, 64, kv_heads=2, seed=3)
    dense = sparse_attn.attention(q, k, v, causal=True)
    sp = []
    for level in SPARSE_LEVELS:
        out, layout = adaptive_attention(q, k, v, causal=True, **level_params(level))
        assert layout.heads == 4 and layout.batch == 1
        # exactly sparse attention on the predicted layout
        assert torch.equal(out, sparse_attn.attention(q, k, v, layout, causal=True))
        assert metrics.cosine_similarity(out, dense) > 0.95
        sp.append(layout.sparsity)
    assert sp[0] < sp[1] < sp[2]
    alone = adaptive_attention(q, k, v, causal=True, return_layout=False, **level_params("medium"))
    assert isinstance(alone, torch.Tensor) and alone.shape == q.shape
    with pytest.raises(TypeError, match="return_layout must be True or False, got str 'False'"):
        adaptive_attention(q, k, v, causal=True, return_layout="False")  # returned (out, layout)


def test_structured_inputs_are_sparsifiable_random_are_not():
    from sparse_attn.accuracy import random_qkv
    qs, ks, _ = structured_qkv(1, 2, 1024, 64)
    qr, kr, _ = random_qkv(1, 2, 1024, 64)
    s = meansim(qs, ks, **level_params("medium")).sparsity
    r = meansim(qr, kr, **level_params("medium")).sparsity
    assert s > 0.1 and r < 0.02


@pytest.mark.gpu
def test_meansim_cuda_matches_cpu():
    q, k = mixed_qk(2, 4, 2, 300, 333, 64, 64, 64)
    for causal, block in ((False, 64), (True, 64), (True, (128, 64))):  # 300 x 333 and 128 x 64: rows straddle edges
        cpu = meansim(q.float(), k.float(), simthreshd1=0.5, cdfthreshd=0.9, block=block, causal=causal)
        gpu = meansim(q.float().cuda(), k.float().cuda(), simthreshd1=0.5, cdfthreshd=0.9, block=block, causal=causal)
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.to("cpu").to_token_mask(), cpu.to_token_mask())
    qs, ks, vs = structured_qkv(1, 8, 4096, 128, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    dense = sparse_attn.attention(qs, ks, vs, causal=True)
    out, layout = adaptive_attention(qs, ks, vs, causal=True, **level_params("medium"))
    assert layout.sparsity > 0.3 and metrics.cosine_similarity(out, dense) > 0.98


# ----------------------------------------------------------------------------- attention(layout="adaptive")
def test_attention_adaptive_string_is_meansim_then_attention():
    q, k, v = structured_qkv(1, 4, 768, 64, kv_heads=2, seed=5)
    for spec, params in (("adaptive", {}), ("adaptive:low", level_params("low")), ("adaptive:high", level_params("high"))):
        out, layout = sparse_attn.attention(q, k, v, spec, causal=True, scale=0.1, return_layout=True)
        want_layout = meansim(q, k, causal=True, scale=0.1, **params)
        assert torch.equal(layout.to_token_mask(), want_layout.to_token_mask()), spec
        assert torch.equal(out, sparse_attn.attention(q, k, v, want_layout, causal=True, scale=0.1))
        assert 0.0 < layout.sparsity < 1.0
    # options over the level; lse and layout together; the layout comes last
    out, lse, layout = sparse_attn.attention(q, k, v, "adaptive:high", adaptive=dict(cdfthreshd=0.5, block=32),
                                             return_lse=True, return_layout=True)
    want = meansim(q, k, simthreshd1=level_params("high")["simthreshd1"], cdfthreshd=0.5, block=32)
    assert (layout.block_q, layout.block_k) == (32, 32)
    assert torch.equal(layout.to_token_mask(), want.to_token_mask())
    assert lse.shape == q.shape[:3] and out.shape == q.shape
    # adaptive= alone means layout="adaptive"; a plain call returns the tensor alone
    alone = sparse_attn.attention(q, k, v, adaptive=dict(topk=0.25))
    assert torch.equal(alone, sparse_attn.attention(q, k, v, meansim(q, k, topk=0.25)))
    # return_layout with a given layout or none hands back what ran
    given = sparse_attn.patterns.local(768, 128)
    assert sparse_attn.attention(q, k, v, given, return_layout=True)[1] is given
    assert sparse_attn.attention(q, k, v, return_layout=True)[1] is None


def test_attention_adaptive_string_errors():
    q, k, v = structured_qkv(1, 2, 256, 32, seed=1)
    with pytest.raises(ValueError, match="'adaptive', 'adaptive:low', 'adaptive:medium', 'adaptive:high'"):
        sparse_attn.attention(q, k, v, "adaptive:extreme")
    with pytest.raises(ValueError, match="unknown layout 'local'"):
        sparse_attn.attention(q, k, v, "local")
    with pytest.raises(ValueError, match="unknown adaptive= option.*causal"):
        sparse_attn.attention(q, k, v, "adaptive", adaptive=dict(causal=True))
    with pytest.raises(TypeError, match="adaptive= options apply to layout='adaptive'"):
        sparse_attn.attention(q, k, v, sparse_attn.patterns.dense(256), adaptive=dict(topk=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_keeps_ceil_of_topk_times_visible_in_any_dtype(dtype):
    """0.6 * 25 is 15.000001 in fp32: fp32 inputs kept 16 blocks where fp64 kept the documented 15."""
    from sparse_attn.predict.meansim import select_ranked
    scores = torch.randn(1, 1, 1, 25, dtype=dtype)
    cand = torch.ones(1, 1, 1, 25, dtype=torch.bool)
    for topk, n in ((0.6, 15), (0.61, 16), (0.04, 1), (1.0, 25)):
        keep = select_ranked(scores, cand, cdfthreshd=None, topk=torch.tensor([[[topk]]], dtype=dtype),
                             n_visible=torch.tensor([25]))
        assert int(keep.sum()) == n, (topk, int(keep.sum()))


def test_meansim_self_similarity_threshold_is_inclusive():
    """A block is self-similar iff sim >= simthreshd1 (equality counts). All-zero queries have sim 0
    (cos = 0 for a zero norm): with simthreshd1=0 they are self-similar, so their rows are ranked
    (uniform pooled scores over 4 key blocks, cdfthreshd 0.5 keeps 2), not kept whole."""
    q = torch.zeros(1, 1, 64, 16)
    k = torch.randn(1, 1, 4, 16).repeat_interleave(16, 2)  # identical tokens per key block: sim 1
    lay = meansim(q, k, simthreshd1=0.0, cdfthreshd=0.5, block=16)
    assert lay.kv_counts.tolist() == [[[2, 2, 2, 2]]]


def test_meansim_cdfthreshd_one_keeps_every_candidate_even_when_its_mass_underflows():
    """cdfthreshd >= 1 keeps every candidate: also those whose pooled softmax mass is 0 in fp32 (the
    cumulative mass of the higher ranks already reads 1.0), not only those before the mass reaches 1."""
    q = torch.full((1, 1, 32, 16), 10.0)
    c = torch.tensor([3.0, 2.0, 1.0, -1.0])  # pooled scores 0.25 * 160 * c: 120, 80, 40, -40
    k = (c[:, None, None] * torch.ones(4, 16, 16)).reshape(1, 1, 64, 16)
    lay = meansim(q, k, simthreshd1=0.5, cdfthreshd=1.0, block=16)
    assert lay.kv_counts.tolist() == [[[4, 4]]]
    assert meansim(q, k, simthreshd1=0.5, cdfthreshd=0.999, block=16).kv_counts.tolist() == [[[1, 1]]]


@pytest.mark.parametrize("where", ["q", "k"])
def test_meansim_block_with_a_non_finite_token_is_never_self_similar(where):
    """A NaN token made its block's pooled mean NaN but its similarity 0 (a NaN norm reads as no norm):
    with simthreshd1 <= 0 the block counted as self-similar and its NaN pooled scores took the softmax,
    so a row kept one ranked key block (the CUDA kernel kept them all): the 15 finite queries beside a
    NaN one lost every other block. Now such a block is always computed, its row or its column."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, 1, 16, generator=g)
    q, k, v = (base + 0.3 * torch.randn(1, 1, 128, 16, generator=g) for _ in range(3))
    (q if where == "q" else k)[0, 0, 40, 0] = float("nan")  # token 40: block 2 of 16
    layout = meansim(q, k, simthreshd1=-1.0, cdfthreshd=0.5, block=16)
    blocks = layout.to_block_mask()[0, 0]                            # [Qb, Kb]
    assert bool((blocks[2] if where == "q" else blocks[:, 2]).all())
    assert int(blocks.sum()) < 64 and bool((blocks.sum(-1) > 1).all())  # the others still ranked, on finite scores
    if where == "q":  # the finite queries of block 2 attend every key, as dense attention does
        out, dense = sparse_attn.attention(q, k, v, layout), sparse_attn.attention(q, k, v)
        rows = [r for r in range(32, 48) if r != 40]
        torch.testing.assert_close(out[:, :, rows], dense[:, :, rows])
