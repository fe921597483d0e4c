"""The adaptive predictor's selection and packing in one pass per query-block row. @triton.jit only.

Symbol legend
    i_q, i_h, i_b   program's query block, query head, batch
    o_k             key-block offsets of the row (padded to the power of two KB)
    m_*  masks      p_*  pointers      b_*  on-chip vectors over the row's key blocks
One program reads its row of pooled scores, decides which key blocks to keep with the rule of
``predict/meansim.py`` (steps 3-6) and writes the row packed as ``predict/pack.py`` packs it: kept
blocks ascending, then the dropped ones as -1; the causal mask id per slot; the count of leading
slots that need no mask (the kernels' schedule). Ranking sorts one int64 key per block: the score's
order-preserving bits above the inverted block index, so descending keys are descending scores with
ties to the lower block, as the PyTorch twin's stable sort orders them.
"""
import triton
import triton.language as tl


@triton.jit
def _order_bits(x):
    """fp32 -> int64 in [0, 2**32) ordered as the floats are (-inf lowest)."""
    u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)


@triton.jit
def _from_order_bits(o):
    u = tl.where(o >= 0x80000000, o - 0x80000000, 0xFFFFFFFF - o)
    return u.to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)


@triton.jit
def select_pack_kernel(S, SQ, SK, SIM_THR, THR, COUNTS, INDICES, MASK_IDS, N_FULL,
                       Hq, Qb, Kb, group, q_len, kv_len, block_q, block_k, scale,
                       s_sb, s_sh, s_sq, s_qb, s_qh, s_kb, s_kh,
                       TOPK: tl.constexpr, CAUSAL: tl.constexpr, SINK: tl.constexpr, HAS_MASK: tl.constexpr,
                       KB: tl.constexpr):
    i_q, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, KB)
    m_k = o_k < Kb
    # visibility (step 3): key block kb is visible iff its first key <= the row's last position
    offset = kv_len - q_len
    p_first = i_q * block_q + offset
    p_last = tl.minimum((i_q + 1) * block_q, q_len) - 1 + offset
    k_first = o_k * block_k
    k_last = tl.minimum(k_first + block_k, kv_len) - 1
    if CAUSAL:
        b_vis = m_k & (k_first <= p_last)
    else:
        b_vis = m_k
    # self-similarity and the always-kept blocks (step 4)
    sim_thr = tl.load(SIM_THR + i_h)
    # (scalars are broadcast to the row before a logical op: the interpreter's scalar|vector fails)
    b_qsim = tl.zeros([KB], tl.float32) + tl.load(SQ + i_b.to(tl.int64) * s_qb + i_h * s_qh + i_q)
    b_ksim = tl.load(SK + i_b.to(tl.int64) * s_kb + (i_h // group) * s_kh + o_k, mask=m_k, other=0.0) >= sim_thr
    # not (sim >= thr), rather than sim < thr: a NaN similarity (an inf token) keeps the row, as on the CPU
    b_always = ((b_qsim >= sim_thr) == 0) | (b_ksim == 0)
    if CAUSAL:
        # the blocks holding the rows' own keys (the diagonal block, and an earlier one where the rows
        # straddle a key-block edge: with the diagonal block alone those rows kept no key)
        b_always = b_always | ((k_first <= p_last) & (k_last >= tl.maximum(p_first, 0)))
    if SINK:
        b_always = b_always | (o_k == 0)
    # ranking (step 5): candidates are the visible self-similar blocks, ordered by pooled score
    b_cand = b_vis & b_ksim
    row = i_b.to(tl.int64) * s_sb + i_h.to(tl.int64) * s_sh + i_q.to(tl.int64) * s_sq
    b_s = tl.load(S + row + o_k, mask=m_k, other=0.0) * scale
    b_s = tl.where(b_cand, tl.where(b_s == 0.0, 0.0, b_s), float("-inf"))  # -0.0 ties +0.0, as in a sort
    n_cand = tl.sum(b_cand.to(tl.int32), 0)
    b_key = tl.where(m_k, (_order_bits(b_s) << 16) + (0xFFFF - o_k), -1)  # 16 index bits: Kb <= 4096
    b_sorted = tl.sort(b_key, descending=True)          # candidates first, best first
    pos = tl.arange(0, KB)
    if TOPK:
        n_vis = tl.sum(b_vis.to(tl.int32), 0)
        # (1 - 1e-6): predict.meansim.TOPK_SLACK, so fp32 rounding cannot add a block (0.6 * 25 -> 15.000001)
        n_keep = tl.ceil(tl.load(THR + i_h) * n_vis.to(tl.float32) * 0.999999).to(tl.int32)
        n_rank = tl.minimum(n_keep, n_cand)
    else:
        # CDF: the shortest prefix whose mass reaches the threshold (rank r kept iff mass before r < thr)
        thr = tl.load(THR + i_h)
        b_ss = _from_order_bits(b_sorted >> 16)
        # finite s_max and a sum >= 1 whenever there is a candidate: no inf - inf or 0 / 0 in an empty row
        s_max = tl.maximum(tl.max(tl.where(pos < n_cand, b_ss, float("-inf")), 0), -3.0e38)
        b_e = tl.where(pos < n_cand, tl.exp(tl.minimum(b_ss - s_max, 0.0)), 0.0)  # padding decodes to 0.0
        b_p = b_e / tl.maximum(tl.sum(b_e, 0), 1.0)
        b_before = tl.cumsum(b_p, 0) - b_p
        keep_rank = (pos < n_cand) & (b_before < tl.where(thr >= 1.0, float("inf"), thr))
        n_rank = tl.max(tl.where(keep_rank, pos + 1, 0), 0)
    kth = tl.max(tl.where(pos == n_rank - 1, b_sorted, -1), 0)  # key of the last kept rank
    b_ranked = b_cand & (b_key >= kth) & (pos * 0 + n_rank > 0)
    b_keep = (b_ranked | b_always) & b_vis
    # packing (pack.py): kept blocks ascending first, then -1; per slot the causal mask id
    b_csum = tl.cumsum(b_keep.to(tl.int32), 0)
    count = tl.sum(b_keep.to(tl.int32), 0)
    slot = tl.where(b_keep, b_csum - 1, count + o_k - b_csum)
    out_row = ((i_b * Hq + i_h) * Qb + i_q).to(tl.int64)
    tl.store(INDICES + out_row * Kb + slot, tl.where(b_keep, o_k, -1), mask=m_k)
    b_partial = b_vis & (k_last > p_first)
    if CAUSAL and HAS_MASK:
        tl.store(MASK_IDS + out_row * Kb + slot, tl.where(b_keep & b_partial, 0, -1), mask=m_k)
    else:
        tl.store(MASK_IDS + out_row * Kb + slot, tl.full([KB], -1, tl.int32), mask=m_k)
    # leading slots needing no mask: all kept minus causal-partial ones and a tail block cut by kv_len
    b_needs = (o_k == Kb - 1) & ((o_k * 0 + kv_len) % block_k != 0)
    if CAUSAL and HAS_MASK:
        b_needs = b_needs | b_partial
    tl.store(COUNTS + out_row, count)
    tl.store(N_FULL + out_row, count - tl.sum((b_keep & b_needs).to(tl.int32), 0))
