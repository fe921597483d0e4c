"""Row quantization shared by the 8-bit path's quantization kernel (ops/sage/kernels.py) and the
attention forward, which quantizes its own Q tile when the Q scale groups fit in it. @triton.jit only."""
import triton
import triton.language as tl

INT8_MAX = tl.constexpr(127.0)


@triton.jit
def int8_rows(b_x, SPAN: tl.constexpr, PERIOD: tl.constexpr):
    """(int8 rows, fp32 scale per row) of fp32 rows b_x [TILE, D]. One scale per group: the rows of a
    SPAN-row span that are equal modulo PERIOD (TILE a multiple of SPAN), amax / 127, or 1 for an
    all-zero group (padding rows included: never a 0 scale). Rounds half away from zero."""
    TILE: tl.constexpr = b_x.shape[0]
    b_amax = tl.max(tl.abs(b_x), 1)  # [TILE]
    b_g = tl.max(tl.reshape(b_amax, [TILE // SPAN, SPAN // PERIOD, PERIOD]), 1)  # [TILE // SPAN, PERIOD]
    b_amax = tl.reshape(tl.broadcast_to(b_g[:, None, :], [TILE // SPAN, SPAN // PERIOD, PERIOD]), [TILE])
    b_scale = tl.where(b_amax > 0, b_amax / INT8_MAX, 1.0)
    b_xs = b_x / b_scale[:, None]
    return (b_xs + tl.where(b_xs >= 0, 0.5, -0.5)).to(tl.int8), b_scale
