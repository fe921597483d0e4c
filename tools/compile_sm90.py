"""Compile the Triton kernels for sm_90 on a machine without a GPU (frontend, LLVM, ptxas), so
syntax/type errors and shared-memory/register use show up before any device time is spent.

    python tools/compile_sm90.py            # prints one line per variant, exit 1 on any failure
    python tools/compile_sm90.py WAVE=True  # only the variants whose constexprs match (no residency report)
"""
import ast
import itertools
import os
import re
import subprocess
import sys
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from sparse_attn.ops.block_sparse import kernels as K
from sparse_attn.ops.block_sparse import launch as L

POINTERS_I32 = {"COUNTS", "N_FULL", "FULL_START", "INDICES", "MASK_IDS", "T_COUNTS", "T_N_FULL", "T_INDICES",
                "T_MASK_IDS", "TERMS", "CU_Q", "CU_K", "CU_DK", "CU_L", "T_ORDER"}
SMEM_LIMIT = 232448  # bytes of shared memory one sm_90 block may have
SCALES_F32 = {"LSE", "LSE2", "DELTA", "Q_SCALE", "K_SCALE", "V_SCALE", "DQA", "O_PART", "LSE_PART"}


def signature(fn, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("sm_scale", "pv_log2"):
            sig[name] = "fp32"
        elif name.startswith("stride") or name in ("H", "G", "HKV", "L", "Lq", "Lk", "SEQ_STEP", "TUNE_CLASS", "N_SM", "WAVE_NS",
                                                        "N_SPLIT", "T_Q", "T_K", "WINDOW", "SINKS"):
            sig[name] = "i32"
        elif name in POINTERS_I32:
            sig[name] = "*i32"
        elif name in SCALES_F32:
            sig[name] = "*fp32"
        elif name in ("Q", "K") and consts.get("QUANT", 0):
            sig[name] = "*i8"
        elif name == "V" and consts.get("QUANT", 0) == 2:
            sig[name] = "*fp8e4nv"
        else:
            sig[name] = "*bf16"
    return sig


def sass(cubin) -> str | None:
    """The SASS of a cubin (nvdisasm, shipped with Triton's NVIDIA backend); None when it is missing."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def wgmma_serialized(cubin):
    """True when ptxas waits for every wgmma right after issuing it (a WARPGROUP.DEPBAR per HGMMA /
    IGMMA / QGMMA in the SASS): the tensor-core pipeline is then off. ptxas does this without a warning in some loop
    nests (benchmarks/NOTES.md, backward item 16); a healthy kernel waits once per product of several
    HGMMAs. None when nvdisasm (shipped with Triton's NVIDIA backend) is missing."""
    sass_text = sass(cubin)
    if sass_text is None:
        return None
    hgmma = sum(sass_text.count(op) for op in ("HGMMA.", "IGMMA.", "QGMMA."))
    waits = sass_text.count("WARPGROUP.DEPBAR")
    return hgmma > 0 and waits >= hgmma


def divisibility(fn, sig):
    """What the JIT gives real calls on aligned tensors: pointers and strides divisible by 16. Without
    it the analysis cannot prove 16-byte vectors, and pointer loads that a real call would pipeline
    with cp.async compile as plain loads (the TTGIR then misleads)."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name] != "constexpr" and (sig[name].startswith("*") or name.startswith("stride"))}


def variants():
    """Every variant on the usual grid (SPLIT_GRID False), then the kernels' split-grid variants (more
    than 65535 (sequence, head) pairs: kernels.py's legend), the wave order's included."""
    for fn, consts in _usual_grid_variants():
        yield fn, dict(consts, SPLIT_GRID=False) if "SPLIT_GRID" in fn.arg_names else consts
    for fn, consts in _usual_grid_variants():
        # the short-query tile unsplit: decoding thousands of packed sequences
        short_unsplit = fn is K.fwd_kernel and consts.get("BLOCK_M") == 16 and not consts["KV_SPLIT"]
        if consts.get("WAVE") or fn is K.bwd_delta_kernel or short_unsplit:
            yield fn, dict(consts, SPLIT_GRID=True)


def _usual_grid_variants():
    for fn, consts in _variants_as_written():
        if fn is K.bwd_dkdv_kernel:  # launch.BWD_DKDV_MASKED "auto": one-stage with element masks or GQA's heads inside
            consts = dict(consts, MASKED_ONE_STAGE=consts["N_TERMS"] > 0 or consts["HEADS_INSIDE"])
            # launch.terms_by_tma: the row terms by TMA wherever Q/dO go by TMA (BWD_TERMS "tma")
            consts.setdefault("TERMS_TMA", consts["QDO_TMA"])
            consts.setdefault("TILE_ORDER", False)  # launch.BWD_TILE_ORDER's default, "grid"
        yield fn, consts


def _variants_as_written():
    base = dict(HEAD_DIM=128, D_PAD=128, BLOCK_Q=128, BLOCK_K=128, NUM_STAGES=3)
    fwd = dict(base, K_SCALE_SPAN=0, WAVE=False, REVERSE=False, KV_SPLIT=False, PACK_GQA=False,  # ROW_ORDER's default
               DEVICE_PLAN=0)
    bwd = dict(base, WAVE=False, IDX_DEEP=False)
    dkdv = dict(bwd, DELTA_ACC=False)
    dq = dict(bwd, REVERSE=True)
    for n_terms, varlen, tma, contiguous in itertools.product((0, 2), (False, True), (False, True), (False, True)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=128, BLOCK_N=64, N_TERMS=n_terms, IS_VARLEN=varlen,
                                 CONTIGUOUS=contiguous, USE_TMA=tma, QUANT=0, PV_SKIP=False)
    for n_terms, tma in itertools.product((0, 2), (False, True)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=128, BLOCK_N=64, N_TERMS=n_terms, IS_VARLEN=False,
                                 CONTIGUOUS=True, USE_TMA=tma, QUANT=0, PV_SKIP=True)
    # the largest tiles of the autotune spaces on indexed rows, whose first loop runs 2 * NUM_STAGES - 1
    # stages: d128 128x128 at 3 stages, d64 128x128 at 3, d256 128x64 at 2 (its only config)
    for d, bn, stages in ((128, 128, 3), (64, 128, 3), (256, 64, 2)):
        yield K.fwd_kernel, dict(fwd, HEAD_DIM=d, D_PAD=d, NUM_STAGES=stages, BLOCK_M=128, BLOCK_N=bn, N_TERMS=2,
                                 IS_VARLEN=False, CONTIGUOUS=False, USE_TMA=True, QUANT=0, PV_SKIP=False)
    # the wave order of indexed rows (launch.FWD_WAVE), bf16 and int8-fp8
    for n_terms, quant in ((0, 0), (2, 0), (0, 2)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=128 if quant == 0 else 64, BLOCK_N=128, N_TERMS=n_terms,
                                 IS_VARLEN=False, CONTIGUOUS=False, USE_TMA=True, QUANT=quant, PV_SKIP=False,
                                 K_SCALE_SPAN=128 if quant else 0, WAVE=True)
    # contiguous runs rotated by the clock's phase (launch.fwd_wave_clock: dense and causal at 128K+)
    for n_terms in (0, 2):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=128, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=False, CONTIGUOUS=True,
                                 USE_TMA=True, QUANT=0, PV_SKIP=False, WAVE=True)
    # short queries (launch.short_query_plan): 16-row tiles (decoding) and 64-row ones, split-KV or not,
    # GQA's rows packed or not, padded or packed (varlen) inputs, d128 and d256
    for bm, n_terms, contiguous, split, pack, varlen in itertools.product((16, 64), (0, 2), (False, True),
                                                                          (False, True), (False, True), (False, True)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=bm, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen, CONTIGUOUS=contiguous,
                                 USE_TMA=True, QUANT=0, PV_SKIP=False, KV_SPLIT=split, PACK_GQA=pack)
    # the device plan (dense 1, causal 2, causal window 3; launch.forward device_plan): decoding tiles, split or not, GQA's rows
    # packed or not, and the autotuned 128-row tile of longer queries; packed (varlen) and padded (attention())
    for plan, bm, split, pack, varlen in itertools.product((1, 2, 3), (16, 128), (False, True), (False, True),
                                                           (True, False)):
        if bm == 16 or not (split or pack):
            yield K.fwd_kernel, dict(fwd, BLOCK_M=bm, BLOCK_N=128, N_TERMS=int(plan != 1),
                                     IS_VARLEN=varlen, CONTIGUOUS=True, USE_TMA=True, QUANT=0, PV_SKIP=False,
                                     KV_SPLIT=split, PACK_GQA=pack, DEVICE_PLAN=plan)
    yield K.fwd_kernel, dict(fwd, HEAD_DIM=256, D_PAD=256, NUM_STAGES=2, BLOCK_M=16, BLOCK_N=64, N_TERMS=2,
                             IS_VARLEN=False, CONTIGUOUS=True, USE_TMA=True, QUANT=0, PV_SKIP=False, KV_SPLIT=True)
    yield K.split_merge_kernel, dict(HEAD_DIM=128, D_PAD=128, BLOCK_R=16)
    # 8-bit: per-key K scales (span 0) and one K scale per tile (span 128, per_block / per_warp)
    for quant, tma, bn, span in itertools.product((1, 2), (False, True), (64, 128), (0, 128)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=128, BLOCK_N=bn, N_TERMS=2, IS_VARLEN=False, CONTIGUOUS=True,
                                 USE_TMA=tma, QUANT=quant, PV_SKIP=False, K_SCALE_SPAN=span)
    # 8-bit on packed (varlen) inputs: TMA K/V (FP8 V^T from each sequence's aligned column), K scales
    # by pointer loads (per key) or one per tile; both query tiles of the 8-bit space (launch.EIGHT_BIT_TILES)
    for quant, span, bm in itertools.product((1, 2), (0, 128), (64, 128)):
        yield K.fwd_kernel, dict(fwd, BLOCK_M=bm, BLOCK_N=128, N_TERMS=2, IS_VARLEN=True, CONTIGUOUS=True,
                                 USE_TMA=True, QUANT=quant, PV_SKIP=False, K_SCALE_SPAN=span)
    # backward: block indices per iteration (IDX_CHUNK 0, 2 stages) or from registers (64, 3 stages:
    # the configs bwd_configs gives; the fused kernel's 3 stages are the tightest fit, ~214 KB)
    for n_terms, varlen, (fused, dq_tma), qdo_tma, chunk in itertools.product(
            (0, 2), (False, True), ((False, False), (True, False), (True, True)), (False, True), (0, 64)):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3 if chunk else 2, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms,
                                      IS_VARLEN=varlen, FUSED_DQ=fused, DQ_TMA=dq_tma, QDO_TMA=qdo_tma, IDX_CHUNK=chunk,
                                      DP_FIRST=True, HEADS_INSIDE=True, CONTIGUOUS=False)
    # the other issue order of dV and dP (launch.BWD_DKDV_ORDER), on the default schedule
    for n_terms, varlen in itertools.product((0, 2), (False, True)):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=64, DP_FIRST=False,
                                      HEADS_INSIDE=True, CONTIGUOUS=False)
    # one query head per kv head: the JIT specializes G == 1 to a constant, which removes the head loop;
    # there launch.BWD_DKDV_HEADS "auto" puts the (one) head outside the phases
    for n_terms, varlen in itertools.product((0, 2), (False, True)):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=64, DP_FIRST=True, G=1,
                                      HEADS_INSIDE=False, CONTIGUOUS=False)
    # contiguous schedules walked by arithmetic (launch.BWD_CONTIGUOUS), with and without element masks,
    # one query head per kv head or GQA
    for n_terms, varlen, (g, inside) in itertools.product((0, 2), (False, True), ((1, False), (None, True))):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=64, DP_FIRST=True,
                                      HEADS_INSIDE=inside, CONTIGUOUS=True, **({"G": g} if g else {}))
    # delta through dP's accumulator (launch.BWD_DKDV_DELTA_ACC "auto"): the arithmetic MHA walk, and
    # GQA's heads-inside walks, indexed (with and without element masks) and arithmetic
    for varlen, (g, inside, contiguous, n_terms) in itertools.product(
            (False, True), ((1, False, True, 0), (1, False, True, 2), (None, True, False, 0), (None, True, False, 2),
                            (None, True, True, 0), (None, True, True, 2))):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=64, DP_FIRST=True,
                                      HEADS_INSIDE=inside, CONTIGUOUS=contiguous, DELTA_ACC=True,
                                      **({"G": g} if g else {}))
    for n_terms, varlen, chunk, kv_tma in itertools.product((0, 2), (False, True), (0, 64), (False, True)):
        yield K.bwd_dq_kernel, dict(dq, NUM_STAGES=3 if chunk else 2, BLOCK_M=128, BLOCK_N=64 if chunk else 128,
                                    N_TERMS=n_terms, IS_VARLEN=varlen, IDX_CHUNK=chunk, KV_TMA=kv_tma, CONTIGUOUS=False)
    for n_terms, varlen in itertools.product((0, 2), (False, True)):
        yield K.bwd_dq_kernel, dict(dq, NUM_STAGES=3, BLOCK_M=128, BLOCK_N=64, N_TERMS=n_terms, IS_VARLEN=varlen,
                                    IDX_CHUNK=64, KV_TMA=True, CONTIGUOUS=True)
    # the wave order of indexed walks (launch.BWD_WAVE): dK/dV with GQA (heads inside) and with G == 1,
    # dQ; with and without element masks
    for n_terms, (g, inside) in itertools.product((0, 2), ((1, False), (None, True))):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=False,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=64, DP_FIRST=True,
                                      HEADS_INSIDE=inside, CONTIGUOUS=False, WAVE=True, **({"G": g} if g else {}))
    for n_terms in (0, 2):
        yield K.bwd_dq_kernel, dict(dq, NUM_STAGES=3, BLOCK_M=128, BLOCK_N=64, N_TERMS=n_terms, IS_VARLEN=False,
                                    IDX_CHUNK=64, KV_TMA=True, CONTIGUOUS=False, WAVE=True)
    # deep per-iteration index loads (launch.BWD_IDX_DEEP; "auto": no element masks, delta in dP's
    # accumulator, wave order): MHA and GQA, dQ; "1" also with element masks and on packed inputs
    for n_terms, varlen, (g, inside) in itertools.product((0, 2), (False, True), ((1, False), (None, True))):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=n_terms, IS_VARLEN=varlen,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=0, DP_FIRST=True,
                                      HEADS_INSIDE=inside, CONTIGUOUS=False, WAVE=not varlen, DELTA_ACC=True,
                                      IDX_DEEP=True, **({"G": g} if g else {}))
    for n_terms, varlen in itertools.product((0, 2), (False, True)):
        yield K.bwd_dq_kernel, dict(dq, NUM_STAGES=3, BLOCK_M=128, BLOCK_N=64, N_TERMS=n_terms, IS_VARLEN=varlen,
                                    IDX_CHUNK=0, KV_TMA=True, CONTIGUOUS=False, WAVE=not varlen, IDX_DEEP=True)
    # key tiles longest walk first (launch.BWD_TILE_ORDER "work"): the deep indexed walks, MHA and GQA
    for g, inside in ((1, False), (None, True)):
        yield K.bwd_dkdv_kernel, dict(dkdv, NUM_STAGES=3, BLOCK_M=64, BLOCK_N=128, N_TERMS=0, IS_VARLEN=False,
                                      FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, IDX_CHUNK=0, DP_FIRST=True,
                                      HEADS_INSIDE=inside, CONTIGUOUS=False, DELTA_ACC=True, IDX_DEEP=True,
                                      TILE_ORDER=True, **({"G": g} if g else {}))
    for varlen, dlse in itertools.product((False, True), (False, True)):
        yield K.bwd_delta_kernel, dict(HEAD_DIM=128, D_PAD=128, BLOCK_M=64, BLOCK_Q=128, IS_VARLEN=varlen,
                                       HAS_DLSE=dlse)


def num_warps(fn, consts) -> int:
    """The warps the launcher's spaces give a variant's tiles: the forward puts 8 warps on 128-row query
    tiles and 4 on 64-row ones (launch.fwd_configs, EIGHT_BIT_TILES); the backward tiles compiled here
    (64 x 128 dK/dV, 128 x 64 dQ) run on 8 (launch.bwd_configs), the row-terms pass on 4. ptxas's
    register allocation, and with it whether it serializes the wgmmas, depends on the warp count, so a
    variant compiled at warps no config uses says nothing about the shipped kernels."""
    if fn is K.fwd_kernel:
        return 8 if consts["BLOCK_M"] >= 128 else 4
    return 4 if fn in (K.bwd_delta_kernel, K.split_merge_kernel) else 8


def ptxas_log(ptx: str) -> str:
    """``ptxas -v`` 's report (registers, spills, warnings) on a kernel's PTX, by the ptxas Triton itself
    uses for sm_90 (triton 3.9 emits PTX 9.4, which only its bundled ``ptxas-blackwell`` reads)."""
    ptxas = get_ptxas(90).path
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        return subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True,
                              text=True, check=True).stderr


def ptxas_registers(ptx: str) -> int:
    """Registers a thread uses, from ``ptxas -v`` on the kernel's PTX."""
    return int(re.search(r"Used (\d+) registers", ptxas_log(ptx)).group(1))


class _Elem:
    """What kernels._resident_per_sm reads of a tensor argument: ``.dtype.element_ty.primitive_bitwidth``."""

    def __init__(self, bits):
        self.dtype = types.SimpleNamespace(element_ty=types.SimpleNamespace(primitive_bitwidth=bits))


def _residency(target, fn, consts, warps: int, stages: int) -> tuple[int, int, int]:
    """(registers a thread, shared bytes, programs one SM holds) of fn compiled for sm_90: 65536
    registers and 228 KB per SM, 1 KB reserved per program."""
    consts = dict(consts, SPLIT_GRID=False)
    sig = signature(fn, consts)
    c = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=divisibility(fn, sig)), target=target,
                       options=dict(num_warps=warps, num_stages=stages))
    regs = ptxas_registers(c.asm["ptx"])
    per_sm = min(65536 // ((regs + 7) // 8 * 8 * 32 * warps), 233472 // (c.metadata.shared + 1024))
    return regs, c.metadata.shared, per_sm


def report_residency(target) -> None:
    """The wave order's period assumes kernels._resident_per_sm (forward) and _bwd_resident_per_sm
    (backward) programs per SM. Compare it with what ptxas's registers and the compiled shared memory
    allow for the configs that layouts with 64- and 128-token blocks get.
    A difference is not an error: the wave then aligns the running programs less well, at worst about
    as badly as no wave order (a simulation of the hardware's in-order dispatch, benchmarks/NOTES.md
    "The wave order"); the configs of long sequences (bf16 128 x 128 at 3 stages, 8-bit 64 x 128, the
    backward's 64 x 128 / 128 x 64) match."""
    def line(label, regs, shared, actual, assumed):
        print(f"{'ok  ' if assumed == actual else 'note'} residency {label}: {regs} registers, {shared} B shared "
              f"-> {actual} per SM; kernels assume {assumed}")

    cases = [(d, c, 0, 16) for d in (64, 128, 256) for bq in (64, 128) for c in L.fwd_configs(bq, bq, d, "tma")]
    cases += [(128, c, q, 8) for bq in (64, 128) for c in L.fwd_configs(bq, bq, 128, "tma", eight_bit=True)
              for q in (1, 2)]
    seen = set()
    for d, cfg, quant, bits in cases:
        m, n, s, w = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["NUM_STAGES"], cfg.num_warps
        if (d, m, n, s, w, quant) in seen:
            continue
        seen.add((d, m, n, s, w, quant))
        consts = dict(HEAD_DIM=d, D_PAD=d, BLOCK_Q=128, BLOCK_K=128, NUM_STAGES=s, BLOCK_M=m, BLOCK_N=n, N_TERMS=0,
                      IS_VARLEN=False, CONTIGUOUS=False, USE_TMA=True, QUANT=quant, PV_SKIP=False,
                      K_SCALE_SPAN=128 if quant else 0, WAVE=True, REVERSE=False, KV_SPLIT=False, PACK_GQA=False,
                      DEVICE_PLAN=0)
        assumed = K._resident_per_sm.fn(_Elem(bits), _Elem(8 if quant == 2 else 16), m, n, d, s)
        line(f"d{d} {m}x{n} {s} stages {w} warps quant {quant}", *_residency(target, K.fwd_kernel, consts, w, s),
             assumed)
    # G == 1 and GQA's heads inside compile alike here (the dK/dV variant has the heads inside)
    for kind, d, bq in itertools.product(("dkdv", "dq"), (64, 128, 256), (64, 128)):
        for cfg in L.bwd_configs(bq, bq, d, kind):
            m, n, s, w = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["NUM_STAGES"], cfg.num_warps
            if (kind, d, m, n, s, w) in seen:
                continue
            seen.add((kind, d, m, n, s, w))
            consts = dict(HEAD_DIM=d, D_PAD=d, BLOCK_Q=bq, BLOCK_K=bq, NUM_STAGES=s, BLOCK_M=m, BLOCK_N=n, N_TERMS=0,
                          IS_VARLEN=False, IDX_CHUNK=64, CONTIGUOUS=False, WAVE=True, IDX_DEEP=False)
            consts.update(dict(FUSED_DQ=False, DQ_TMA=False, QDO_TMA=True, DP_FIRST=True, HEADS_INSIDE=True, DELTA_ACC=False,
                               MASKED_ONE_STAGE=True, TERMS_TMA=True, TILE_ORDER=False) if kind == "dkdv"
                          else dict(KV_TMA=True, REVERSE=True))
            fn = K.bwd_dkdv_kernel if kind == "dkdv" else K.bwd_dq_kernel
            line(f"{kind} d{d} {m}x{n} {s} stages {w} warps", *_residency(target, fn, consts, w, s),
                 K._bwd_resident_per_sm.fn(m, n, d))


def main(filters: list[str]):
    """filters: NAME=VALUE strings (VALUE a Python literal); only variants with those constexprs run."""
    target = GPUTarget("cuda", 90, 32)
    wanted = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in filters)}
    if not wanted:
        report_residency(target)
    failed = 0
    print(f"triton {triton.__version__}")  # what ptxas does differs between versions (NOTES.md)
    for fn, consts in variants():
        if any(consts.get(k) != v for k, v in wanted.items()):
            continue
        flags = {k: v for k, v in consts.items() if k in ("HEAD_DIM", "N_TERMS", "IS_VARLEN", "USE_TMA", "CONTIGUOUS", "QUANT", "BLOCK_N", "NUM_STAGES",
                                                                 "PV_SKIP", "K_SCALE_SPAN", "FUSED_DQ", "DQ_TMA", "QDO_TMA", "IDX_CHUNK", "KV_TMA",
                                                                 "DP_FIRST", "G", "HEADS_INSIDE", "WAVE", "DELTA_ACC", "IDX_DEEP",
                                                                 "SPLIT_GRID", "KV_SPLIT", "PACK_GQA", "BLOCK_M", "BLOCK_R",
                                                                 "DEVICE_PLAN", "TERMS_TMA", "TILE_ORDER")}
        try:
            sig = signature(fn, consts)
            c = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=divisibility(fn, sig)), target=target,
                               options=dict(num_warps=num_warps(fn, consts),
                                            num_stages=consts.get("NUM_STAGES", 3)))
            ptx = c.asm.get("ptx", "")
            if c.metadata.shared > SMEM_LIMIT:  # compiles, but a launch would fail with OutOfResources
                raise RuntimeError(f"shared memory {c.metadata.shared} B over the sm_90 limit {SMEM_LIMIT} B")
            serialized = wgmma_serialized(c.asm["cubin"])
            if serialized is None:
                print("note: nvdisasm not found next to Triton's ptxas; wgmma serialization not checked")
            elif serialized:
                raise RuntimeError("every wgmma is waited for right after issue (serialized tensor-core pipeline)")
            print(f"ok   {fn.__name__:16s} {flags} warps={num_warps(fn, consts)} smem={c.metadata.shared} "
                  f"wgmma={'wgmma' in ptx} tma={'cp.async.bulk.tensor' in ptx}")
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {fn.__name__:16s} {flags}: {type(e).__name__}: {str(e)[:800]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
