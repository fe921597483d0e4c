"""Block pooling for the adaptive predictor, one read of x: per block of tokens, the mean and the
mean cosine of the tokens to that mean. @triton.jit only.

Symbol legend
    i_n, i_h, i_b   program's token block, head, batch
    o_r, o_d        token offsets of a row chunk, head-dim offsets
    m_*  masks      p_*  pointers      b_*  on-chip blocks
    BLOCK           tokens per block (the layout's block); BR rows loaded at a time (divides BLOCK)
The mean cosine uses ``sum_a cos(x_a, m) = <sum_a x_a / |x_a|, m> / |m|`` (a token or a mean of
norm 0 adds 0), so one pass accumulates the token sum and the sum of unit vectors.
"""
import triton
import triton.language as tl


@triton.jit
def block_pool_kernel(X, POOLED, SIM, L, s_xb, s_xh, s_xl, s_xd, s_pb, s_ph, s_pn, s_sb, s_sh,
                      D: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    i_n, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_base = X + i_b.to(tl.int64) * s_xb + i_h.to(tl.int64) * s_xh
    b_sum = tl.zeros([BD], dtype=tl.float32)
    b_unit = tl.zeros([BD], dtype=tl.float32)
    for r in tl.static_range(0, BLOCK, BR):
        o_r = i_n * BLOCK + r + tl.arange(0, BR)
        m_r = o_r < L
        p_x = p_base + o_r[:, None].to(tl.int64) * s_xl + o_d[None, :] * s_xd
        b_x = tl.load(p_x, mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BR, BD]
        b_norm = tl.sqrt(tl.sum(b_x * b_x, 1))                                             # [BR]
        b_inv = tl.where(b_norm > 0, 1.0 / tl.where(b_norm > 0, b_norm, 1.0), 0.0)
        b_sum += tl.sum(b_x, 0)
        b_unit += tl.sum(b_x * b_inv[:, None], 0)
    n = tl.minimum(L - i_n * BLOCK, BLOCK).to(tl.float32)  # valid tokens of this block
    b_mean = b_sum / n                                                                     # [BD]
    m_norm = tl.sqrt(tl.sum(b_mean * b_mean, 0))
    sim = tl.where(m_norm > 0, tl.sum(b_unit * b_mean, 0) / (tl.where(m_norm > 0, m_norm, 1.0) * n), 0.0)
    tl.store(POOLED + i_b.to(tl.int64) * s_pb + i_h.to(tl.int64) * s_ph + i_n.to(tl.int64) * s_pn + o_d,
             b_mean, mask=m_d)
    tl.store(SIM + i_b.to(tl.int64) * s_sb + i_h.to(tl.int64) * s_sh + i_n, sim)
