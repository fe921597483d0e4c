"""Launchers: grids, strides, tile configs. No autograd here.

Tensors arrive already validated (sparse_attn.validation). Dense inputs are ``[B, H, L, D]``;
varlen inputs are packed ``[T, H, D]`` with ``cu_seqlens`` (int32 [B + 1]).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import threading
from typing import NamedTuple

import torch
import triton
from torch.utils.weak import WeakTensorKeyDictionary

from ...validation import capturing
from .. import fast_launch
from ..fast_launch import launcher
from . import kernels, replay

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The backward's string settings and their values. The module reads them from the environment at
# import (an error naming the variable below); probes and tests reassign them at run time, where a
# bool or a typo would silently select a branch (a probe's False for BWD_IDX_DEEP ran as "auto":
# NOTES.md, backward 24), so backward() checks them again on every call (_check_bwd_settings).
_BWD_SETTINGS = {"BWD_VARIANT": ("split", "fused", "fused-ptr"), "BWD_WAVE": ("auto", "1", "0", "dq", "dkdv"),
                 "BWD_QDO": ("tma", "ptr"), "BWD_DQ_KV": ("tma", "ptr"), "BWD_IDX_DEEP": ("auto", "0", "1"),
                 "BWD_DKDV_DELTA_ACC": ("auto", "0", "1"), "BWD_DKDV_ORDER": ("dp-first", "dv-first"),
                 "BWD_DKDV_HEADS": ("auto", "inside", "outside"),
                 "BWD_DKDV_MASKED": ("auto", "one-stage", "pipelined"), "BWD_TERMS": ("ptr", "tma"),
                 "BWD_TILE_ORDER": ("auto", "grid", "work")}


def _bwd_setting(name: str, env: str, default: str, choices_text: str | None = None) -> str:
    """Backward setting ``name`` read from the environment variable ``env`` (``default`` when unset);
    a value outside _BWD_SETTINGS[name] is an error naming the variable and its choices
    (``choices_text``, or the choices listed as "'a', 'b' or 'c'")."""
    value = os.environ.get(env, default)
    allowed = _BWD_SETTINGS[name]
    if value not in allowed:
        text = choices_text or ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
        raise ValueError(f"{env} must be {text}, got {value!r}")
    return value

# SPARSE_ATTN_AUTOTUNE=0 runs one default config per kernel family (tests: compile once, not per config)
AUTOTUNE = os.environ.get("SPARSE_ATTN_AUTOTUNE", "1") != "0"
# forward K/V loading: "ptr" (pointer loads) or "tma" (on-device TMA descriptors: Hopper+, 16-byte
# aligned rows). Measured on H100 (benchmarks/NOTES.md): tma ~11% faster; Triton 3.6's warp-specialized
# loop failed to compile for some tiles and gained nothing where it compiled, so it is not offered.
FWD_VARIANT = os.environ.get("SPARSE_ATTN_FWD", "tma")
# benchmarks only: visit even contiguous runs through per-tile index loads (the bookkeeping cost)
FORCE_INDEXED = False
# the order in which the forward and dQ grids dispatch each head's query tiles (kernels._query_tile
# REVERSE): "reverse-dq" (the default: the dQ grid's last tile first, the forward's in grid order),
# "reverse" (both) or "grid" (neither). On causal rows, longest last, grid order starts the longest tiles
# of the last heads in the final wave, and the SMs that took them finish alone: a greedy simulation of
# 132 SMs puts that tail at 3.7% of a kernel at 16K and 1.6% at 32K (128-row tiles, 32 heads), against
# 0.7% / 0.05% reversed. Measured on the H200 (benchmarks/NOTES.md, backward 31): the dQ kernel
# follows it, the forward does not (2-3% slower reversed).
ROW_ORDER = os.environ.get("SPARSE_ATTN_ROW_ORDER", "reverse-dq")
_ROW_ORDERS = ("reverse-dq", "reverse", "grid")
if ROW_ORDER not in _ROW_ORDERS:
    raise ValueError(f"SPARSE_ATTN_ROW_ORDER must be 'reverse-dq', 'reverse' or 'grid', got {ROW_ORDER!r}")
# the wave order of indexed rows (kernels.fwd_kernel WAVE): each program starts its walk where the
# programs running beside it stand, so on random layouts they read one stretch of keys together.
# H100 bf16 128K random 0.25 / 0.5: L2 hits 38% -> 90%, +11-15% (benchmarks/NOTES.md "The wave order").
# Not on packed (varlen) inputs, whose empty tiles past a sequence's end would shift the phases.
FWD_WAVE = os.environ.get("SPARSE_ATTN_FWD_WAVE", "1") != "0"
# split-KV (flash-decoding) forward for grids too small to fill the GPU, such as decoding (a few query
# rows against a long cache): each query tile's key walk is cut into parts run by separate programs,
# whose outputs split_merge_kernel combines by their LSE (kv_splits says when and how many).
# "auto", "0" (never) or a count of parts forced on every eligible launch (tests, benchmarks).
FWD_KV_SPLIT = os.environ.get("SPARSE_ATTN_FWD_KV_SPLIT", "auto")
if FWD_KV_SPLIT != "auto" and not FWD_KV_SPLIT.isdigit():
    raise ValueError(f"SPARSE_ATTN_FWD_KV_SPLIT must be 'auto', '0' or a number of parts, got {FWD_KV_SPLIT!r}")
# auto (kv_splits): the larger of two counts, at most KV_SPLIT_MAX parts (each part's output costs one
# extra fp32 write and read):
# - one wave: KV_SPLIT_WAVES * SMs // programs parts, each walking at least KV_SPLIT_MIN_TILES key tiles
#   of the longest row; short rows (B=1, 8K keys) are split this way (two waves lost there: 45 -> 63 us);
# - packed (varlen) calls of at most SMALL_Q_ROWS query rows a sequence (decoding), whose sequences differ in
#   length: two waves of long parts, KV_SPLIT_LONG_WAVES * SMs // programs parts of at least
#   KV_SPLIT_LONG_MIN_TILES tiles. With one program a row's part, the SMs of short rows sit idle while the long
#   ones finish; twice the programs balance them (H200, a padded batch of 8 rows of 2K-16K keys, 8 kv heads:
#   101 -> 87 us; equal rows lose 5%: benchmarks/NOTES.md "Decoding bound by the GPU, and split-KV for rows of
#   unequal length"). 0 turns it off (probes: the one-wave rule alone).
KV_SPLIT_MAX = 64
KV_SPLIT_MIN_TILES = 8
KV_SPLIT_WAVES = 1
KV_SPLIT_LONG_WAVES = 2
KV_SPLIT_LONG_MIN_TILES = 32
# up to this many query rows the forward runs split_config's small query tile even unsplit: the
# autotuned 128-row tile would spend 127 of its 128 rows' products on padding when decoding
SMALL_Q_ROWS = 64
# decoding with GQA: one tile holds the query rows of all G query heads of a kv head (fwd_kernel PACK_GQA),
# so each K/V tile is read once for them rather than once per query head ("0": off)
PACK_GQA = os.environ.get("SPARSE_ATTN_FWD_PACK_GQA", "1") != "0"
PACK_GQA_MAX_ROWS = 64
# benchmarks only (benchmarks/decode_config_probe.py): entries replacing split_config's choices
# ("BLOCK_N", "NUM_STAGES", "num_warps")
SPLIT_CONFIG_OVERRIDE: dict = {}
# the wave order's phase from the GPU clock instead of the grid position (kernels.fwd_kernel WAVE_NS,
# fwd_wave_clock), and a rotation by it of contiguous runs, which otherwise start at their first block:
# "auto" where the keys the running rows read outgrow the L2 (H100: 128K+ random or dense / causal),
# 16-bit at head dim 128 on 128-token blocks of a Hopper GPU (where measured), unless
# torch.use_deterministic_algorithms(True) is on: the start slot then depends on timing, so the
# output's last bits vary run to run. "1": on every launch of the wave order or a contiguous run;
# "0": never. H100 bf16 128K, blocks (benchmarks/NOTES.md "The wave order's clock phase"): random 0.5
# 268.1 -> 241.6 ms (L2 hits 81% -> 97%), random 0.25 132.1 -> 122.9, causal 259.2 -> 236.8 (60% ->
# 98%), dense 509.9 -> 493.1 ms.
FWD_WAVE_CLOCK = os.environ.get("SPARSE_ATTN_FWD_WAVE_CLOCK", "auto")
if FWD_WAVE_CLOCK not in ("auto", "0", "1"):
    raise ValueError(f"SPARSE_ATTN_FWD_WAVE_CLOCK must be 'auto', '0' or '1', got {FWD_WAVE_CLOCK!r}")
# ns a 128-row program spends on one 128 x 128 layout block at head dim 128 in 16-bit, one program an SM
# (H100 at its power cap, ~1.6 GHz: 241.6 ms / 248 waves / 512 blocks = 1.90 us). The period is one
# row's duration from it; an error of x in it spreads the running programs over about x of the keys
# (L2 misses), never affects correctness.
WAVE_NS_PER_BLOCK = 1950
# the same order in the backward kernels' indexed walks (kernels._bwd_wave): dK/dV programs over the
# transposed rows' query blocks (Q, dO), dQ programs over the key blocks (K, V). Not on contiguous
# schedules (their running programs already read neighbouring blocks) nor packed inputs.
# Values: "auto" (bwd_wave: where one head's walked operands outgrow the L2), "1" both kernels, "0"
# neither, "dq" / "dkdv" one of them (benchmarks).
BWD_WAVE = _bwd_setting("BWD_WAVE", "SPARSE_ATTN_BWD_WAVE", "auto")
# backward schedule: "split" (the dK/dV kernel, then a dQ kernel that recomputes P: seven matmuls per
# block pair, deterministic) or "fused" (one kernel: dQ accumulated by fp32 TMA reduce-adds next to
# dK/dV, five matmuls; dQ's summation order, so its last bits, vary run to run). With block indices
# read from registers (BWD_IDX_CHUNK) split is the faster, H100 bf16 16K (bwd-flex-regs-h100.json,
# bwd-flex-sweep-h100.json): 28.0 vs 29.5 ms dense, 7.41 vs 7.69 random 0.25, 14.5 vs 15.1 causal; the
# fused kernel's dQ staging keeps its tensor pipe 40% busy against 53% for split's dK/dV kernel (ncu).
# "fused-ptr" (benchmarks): fused with per-element atomics instead of TMA reduce-adds.
BWD_VARIANT = _bwd_setting("BWD_VARIANT", "SPARSE_ATTN_BWD", "split", "'fused' or 'split' (or 'fused-ptr')")
# split schedule's dK/dV kernel, Q and dO tiles: "tma" (descriptors; Hopper+, 16-byte aligned rows) or
# "ptr" (pointer loads). H100, bf16, 16K (results/bwd-qdo-h100.json): tma 2.4% (causal) and 6% (random
# 0.25) faster in split, but 17-18% slower in the fused kernel, whose dQ staging already fills shared
# memory, so the fused kernel keeps pointer loads.
BWD_QDO = _bwd_setting("BWD_QDO", "SPARSE_ATTN_BWD_QDO", "tma")
# the dQ kernel's K and V tiles, the same choice. H100 bf16 (results/qdo-layout-dqkv-h100.json): tma
# 8.5 vs 9.7 ms dense, 8.4-8.8 vs 10.1 ms packed (causal 8K queries x 32K keys); the masked pointer
# loads cost per-element address and mask instructions in the loop.
BWD_DQ_KV = _bwd_setting("BWD_DQ_KV", "SPARSE_ATTN_BWD_DQ_KV", "tma")
# backward kernels: block indices read IDX_CHUNK at a time into registers instead of one load per
# iteration (0: the per-iteration load). With the load inside the pipelined loop the Q/dO loads
# became indirect and Triton issued them right before their use; from registers they run one
# iteration ahead at 3 stages (benchmarks/NOTES.md, backward).
BWD_IDX_CHUNK = int(os.environ.get("SPARSE_ATTN_BWD_IDX_CHUNK", "64"))
if BWD_IDX_CHUNK < 0 or BWD_IDX_CHUNK & (BWD_IDX_CHUNK - 1):
    raise ValueError(f"SPARSE_ATTN_BWD_IDX_CHUNK must be 0 or a power of two, got {BWD_IDX_CHUNK}")
# backward kernels' indexed walks: one index load per iteration, at 2 * NUM_STAGES - 1 pipeliner
# stages in the unmasked pass (as the forward's indexed rows), instead of register chunks
# (BWD_IDX_CHUNK), whose per-iteration pick is a cross-warp reduction; the dK/dV kernel then takes
# delta through dP's accumulator too. "auto": head dim 128, no element masks, not packed, split
# schedule (random layouts: H100 backward about 2% faster on average, -2% to +8% per case; with
# element masks, as on streaming and causal, 2-7% slower: benchmarks/NOTES.md, backward 24).
# "1": every indexed walk of the split schedule.
BWD_IDX_DEEP = _bwd_setting("BWD_IDX_DEEP", "SPARSE_ATTN_BWD_IDX_DEEP", "auto")
# dK/dV kernel: delta enters through dP's accumulator (kernels._dp_product), which frees registers
# in its loop. "auto": on where it was measured faster (head dim 128, split schedule), the walks
# without the wave order that go by arithmetic with one query head per kv head (dense,
# block-diagonal) or hold GQA's heads inside. Backward alone, H100 bf16 16K: dense 24.32 -> 22.81 ms,
# block-diagonal 6.60 -> 6.21; Hkv 8 causal 13.06 -> 12.64, window 6.29 -> 6.14. Off elsewhere: on
# the wave-order walks (random layouts) it ran -3% to +8% at 32K, on the masked MHA walks (causal,
# window) -1% to +3% (benchmarks/NOTES.md, backward 23). "1" / "0": on / off everywhere.
BWD_DKDV_DELTA_ACC = _bwd_setting("BWD_DKDV_DELTA_ACC", "SPARSE_ATTN_BWD_DKDV_DELTA_ACC", "auto")
# split schedule: the dQ kernel on a second CUDA stream, concurrent with the dK/dV kernel (both read
# only the forward's tensors and delta), so its programs fill the SMs the dK/dV grid's last wave leaves
# idle, as FlexAttention's one-grid backward does. Off: one stream, the two kernels back to back.
BWD_DQ_SIDE_STREAM = os.environ.get("SPARSE_ATTN_BWD_DQ_STREAM", "1") != "0"
_SIDE_STREAMS: dict = {}
# dK/dV kernel: issue order of the dV and dP products in each iteration, "dp-first" or "dv-first"
# (kernels._dkdv_step). dp-first lets dS be computed while dV runs: backward alone 3-6% faster, H100
# bf16 16K (results/bwd-order-h100.json: dense 25.0 vs 26.4 ms, causal 13.0 vs 13.8, random 0.25
# 6.80 vs 7.05), gradients bitwise equal
BWD_DKDV_ORDER = _bwd_setting("BWD_DKDV_ORDER", "SPARSE_ATTN_BWD_DKDV_ORDER", "dp-first")
# dK/dV kernel: where its loop over the G query heads of a kv head sits, "inside" the two phases
# (unmasked blocks, masked blocks) or "outside" them; "auto": inside when G > 1. Outside, ptxas
# serialized every wgmma of the kernel for G > 1 (benchmarks/NOTES.md, backward item 16); for G == 1
# the JIT removes the head loop and "outside" is the code measured before that fix.
BWD_DKDV_HEADS = _bwd_setting("BWD_DKDV_HEADS", "SPARSE_ATTN_BWD_DKDV_HEADS", "auto")
# dK/dV kernel on contiguous schedules: its masked pass (each transposed row's query blocks with an element
# mask or past the sequence end; a block or two) "one-stage" (one index load an iteration, no software
# pipelining) or "pipelined" (register index chunks at NUM_STAGES, as the indexed walks); "auto": one-stage
# on layouts with element masks and where GQA's heads loop inside (HEADS_INSIDE). There the pipelined
# pass's buffers raised the pressure of the whole kernel: triton 3.6's SASS of the causal variant spilled
# 13 loads an iteration in the arithmetic walk of the unmasked blocks, none one-stage, and the kernel ran
# 3-5% faster (H200, 16K-32K: causal, window, streaming, Hkv 32 and 8); GQA's unmasked walk 6 -> 0, 6%
# faster (dense, block-diagonal at Hkv 8). One query head per kv head without element masks, one-stage
# was 4-7% slower (dense 16K and 32K, block-diagonal), though its SASS spills less there too (NOTES
# backward 32).
BWD_DKDV_MASKED = _bwd_setting("BWD_DKDV_MASKED", "SPARSE_ATTN_BWD_DKDV_MASKED", "auto")
# dK/dV kernel: each query tile's row terms (LSE2, delta) through 1-D TMA descriptors beside Q/dO ("tma",
# where Q/dO go by TMA: terms_by_tma) or by pointer loads ("ptr"). On an indexed walk a pointer load's
# addresses hang on the loaded block index in every thread; by TMA one thread issues it, as for Q/dO.
# H200, 16K-32K, per kernel (NOTES backward 33): dK/dV 4-8% faster on random blocks (MHA; GQA 1%), 2-9%
# on causal, 4% on window 4096, 1% on dense and streaming; block-diagonal 1% slower.
BWD_TERMS = _bwd_setting("BWD_TERMS", "SPARSE_ATTN_BWD_TERMS", "tma")
# dK/dV kernel on indexed schedules (random blocks): the programs of a (batch, kv head) row take its key tiles in
# grid order ("grid") or longest walk first ("work": tile_order); "auto": longest first for GQA / MQA only. A
# greedy simulation of the dispatch (132 SMs, one program each, a program's time its walk) put the grid order's
# tail at 6-7% of the kernel for GQA's four-head programs and 2.5-3% for MHA. H200, 16K, Hkv 8 (NOTES backward
# 34): longest first made the dK/dV kernel 7-10% faster on random 0.1-0.5; with MHA 1% faster at 16K and 2%
# slower at 32K (random 0.5), so MHA keeps grid order.
BWD_TILE_ORDER = _bwd_setting("BWD_TILE_ORDER", "SPARSE_ATTN_BWD_TILE_ORDER", "auto")
# backward kernels on contiguous schedules (every row's unmasked blocks one run: dense, causal, windows,
# block-diagonal): walk the run by arithmetic ("1") or through the register index chunks like any
# other layout ("0", benchmarks). H100 bf16 16K, per kernel (results/bwd-contig-h100.json): dQ 2-6%
# faster on dense, causal, window 4096 and block-diagonal 4096; dK/dV 4-6% faster on layouts without
# element masks (dense, block-diagonal) but then 28-47% slower on causal and window, where ptxas spilled
# in the arithmetic loop (38 spill loads per iteration against 8 in the indexed one, triton 3.6 SASS).
# Since the masks are evaluated as intervals per key (kernels._allowed) it no longer does: the
# dK/dV kernel's arithmetic walk is 1-3% faster than the indexed one on causal, window and streaming
# too (H200, results/mask-ab-h200/), so both kernels take it on every contiguous schedule
BWD_CONTIGUOUS = os.environ.get("SPARSE_ATTN_BWD_CONTIGUOUS", "1") != "0"
# benchmarks only (benchmarks/bwd_probe.py): kind ("dkdv" / "dkdv-fused" / "dq") -> configs replacing bwd_configs;
# clear _TUNED after changing it
BWD_SPACE_OVERRIDE: dict = {}


def _divisors(block: int, options=(16, 32, 64, 128)) -> list[int]:
    return [t for t in options if t <= block and block % t == 0]


def _keep_fwd(cfg: triton.Config, block_q: int, block_k: int, d_pad: int) -> bool:
    """Named prune: tiles must divide the layout's blocks; avoid configs that spill or starve."""
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    if block_q % bm or block_k % bn:
        return False
    if bm * bn < 128 * 128 and cfg.num_warps == 8 and bm < 128:
        return False
    if d_pad >= 256 and (bn > 64 or cfg.kwargs["NUM_STAGES"] > 2):
        return False
    return True


# The 8-bit forward's tiles (BLOCK_M, BLOCK_N, warps, stages), best first. One warpgroup per 64-row tile
# leaves room for two CTAs per SM, whose softmax and 8-bit MMAs the warp scheduler interleaves. H100,
# int8-fp8 dense 16K, kernel alone (results/fwd-tile-probe-h100.json): 64x128 on 4 warps 6.18 ms (3 stages)
# / 6.47 (2), the bf16 space's 128x128 on 8 warps 6.79, 64x64 6.64-6.67, 128x64 8.43. For bf16 the
# 128-row tile stays best (7.68 vs 9.50 ms), so only the 8-bit space offers these.
EIGHT_BIT_TILES = ((64, 128, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3))


# From this length class up (_tune_class: sequences longer than 16K tokens) the forward's space at head dim
# 128 is one config per QUANT, where the layout's blocks allow it; the autotuner, timing each config on a
# few 20-300 ms calls under the board's power cap, picked others there and lost 2-8%. H100, pinned configs:
# - bf16 (QUANT 0), 128 x 128 at 3 stages: against interleaved Flex (results/fwd-config-probe-h100.json)
#   the best of the four configs for every pattern at 32K and 128K but one (random 0.5 at 128K: 289.5 ms
#   against 284.0 for 128 x 64 at 3 stages); autotuned picks lost 2-7% at 128K.
# - int8-fp8 (QUANT 2), 64 x 128 on 4 warps at 3 stages: the best of the 8-bit space in each of six
#   cases (dense 32K / 64K, window 4096 at 32K / 128K, random 0.1 / 0.25 at 32K; configs in turn, three
#   rounds, results/sage-long-configs-h100.json), by 0.5-8%; the sage suite's autotuned picks (2 stages
#   at 32K, 128 x 128 at 64K) ran 6% / 3% slower on dense.
# - int8 (QUANT 1) is left to the autotuner: 128 x 128 won on dense and random 0.25, 64 x 128 at 2 stages
#   on window 4096 and random 0.1, each by 1-9%.
LONG_FWD_CLASS = 15
LONG_FWD_TILE = {0: (128, 128, 8, 3), 2: (64, 128, 4, 3)}  # QUANT -> (BLOCK_M, BLOCK_N, warps, stages)


def _prune_long_fwd(configs: list[triton.Config], nargs: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's early_config_prune for the forward at head dim 128: at TUNE_CLASS >=
    LONG_FWD_CLASS only the LONG_FWD_TILE config of the call's QUANT (when the space has it), else the
    whole space. (Triton passes positional arguments in ``nargs`` and keyword ones in ``kwargs``.)"""
    tune_class = nargs.get("TUNE_CLASS", kwargs.get("TUNE_CLASS", 0))
    tile = LONG_FWD_TILE.get(kwargs.get("QUANT", nargs.get("QUANT", 0)))
    if tune_class < LONG_FWD_CLASS or tile is None:
        return configs
    pinned = [c for c in configs
              if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["NUM_STAGES"]) == tile]
    return pinned or configs


def fwd_configs(block_q: int, block_k: int, d_pad: int, variant: str = "ptr", eight_bit: bool = False
                ) -> list[triton.Config]:
    """``eight_bit``: the space of the int8 / FP8 kernels (QUANT 1, 2), tuned apart from bf16's; where
    none of its tiles fits the layout's blocks or head dim, the bf16 space."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": max(_divisors(block_q, (16, 32))), "BLOCK_N": max(_divisors(block_k, (16, 32))),
                               "NUM_STAGES": 1, "USE_TMA": False}, num_warps=4, num_stages=1)]
    # Kept small on purpose: every config is a compile on first use. The space follows the usual
    # Hopper attention choices (the largest query tile the layout allows, 8 warps at 128 rows,
    # 2-3 stages). Per-config timings at head dim 128: results/fwd-config-probe-h100.json (the reason
    # for _prune_long_fwd).
    bm = _divisors(block_q)[-1]
    bns = _divisors(block_k, (64, 128)) or _divisors(block_k)[-1:]
    flags = {"USE_TMA": variant != "ptr"}
    if eight_bit:
        space = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": s, **flags}, num_warps=w, num_stages=s)
                 for m, n, w, s in EIGHT_BIT_TILES]
        kept = [c for c in space if _keep_fwd(c, block_q, block_k, d_pad)]
        if kept:
            return kept
    space = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": s, **flags}, num_warps=8 if bm >= 128 else 4,
                           num_stages=s)
             for bn in bns for s in (2, 3)]
    return [c for c in space if _keep_fwd(c, block_q, block_k, d_pad)]


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """On-device TMA descriptors need sm_90+, 16-byte aligned bases and row strides."""
    if INTERPRET or not tensors[0].is_cuda or _sm_major(tensors[0].device) < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and _tma_strides(t) for t in tensors)


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side descriptors live in a scratch buffer that Triton asks the host allocator for.
    Triton keeps the allocator in a context variable, so it is set on every launch: autograd runs the
    backward on its own thread, where one set during the forward is not visible."""
    triton.set_allocator(_scratch)


def _fork(t: torch.Tensor):
    """An event on the current stream marking where a side stream may start (None when the side
    stream is off: BWD_DQ_SIDE_STREAM, CUDA only)."""
    if not (BWD_DQ_SIDE_STREAM and t.is_cuda) or INTERPRET:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


@contextlib.contextmanager
def _side_stream(fork, *tensors):
    """Run the block's launches on a second stream of the tensors' device, started at the event
    ``fork`` (from :func:`_fork`; None: stay on the current stream) and joined back into the current
    stream at the end. The tensors it reads or writes are recorded on the side stream, so the caching
    allocator cannot hand their memory to other work before the side stream is done with it."""
    if fork is None:
        yield
        return
    device = tensors[0].device
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_event(fork)
    with torch.cuda.stream(side):
        yield
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t.record_stream(side)
    main.wait_stream(side)


def bwd_configs(block_q: int, block_k: int, d_pad: int, kind: str = "dkdv") -> list[triton.Config]:
    """``kind`` "dkdv", "dkdv-fused" (dK/dV kernel with dQ atomics) or "dq". For dK/dV BLOCK_N is the
    key tile and BLOCK_M the inner query tile; for dQ the reverse.

    Measured on H100 (bf16, d128, 16K; benchmarks/results/bwd-configs-h100.json, bwd-fused-h100.json,
    bwd-flex-regs-h100.json, bwd-flex-sweep-h100.json): 8 warps beat 4 by 1.4-2.4x at 64x128 tiles.
    With block indices read from registers (BWD_IDX_CHUNK > 0) 3 stages put the Q/dO (K/V) loads one
    iteration ahead: dK/dV at 64x128 and dQ at 128x64 with 3 stages are the fastest measured (a 4th
    stage or dQ's 128x128 tile at 2 stages, which fits no 3rd, lose 2-11%). With per-iteration index
    loads (BWD_IDX_CHUNK 0) extra stages bought nothing and dQ's 128x128 tile led; the deep ones
    (BWD_IDX_DEEP: 2 * 3 - 1 stages on indexed rows) keep the 3-stage tiles. The fused kernel's
    128x128 tile does not fit in shared memory."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": max(_divisors(block_q, (16, 32))), "BLOCK_N": max(_divisors(block_k, (16, 32))),
                               "NUM_STAGES": 1}, num_warps=4, num_stages=1)]
    # One large tile, the measured best that divides the layout's blocks: the autotune key leaves out
    # sequence lengths (a new length must not re-tune) and Triton caches its choice on disk, so a space
    # holding 64x64 tiles let the first small call pick them for good, 1.6-1.7x slower at 16K
    # (measured). 64x64 is the fallback for small layout blocks and d256.
    regs = BWD_IDX_CHUNK > 0 or (BWD_IDX_DEEP != "0" and kind != "dkdv-fused")  # loads ahead at 3 stages
    if kind == "dkdv-fused":  # 128x64 needs 241 KB of shared memory with the dQ staging: no fit
        big = ((64, 128, 8, 3 if regs else 2),)
    elif kind == "dkdv":  # 128x64 holds 128-row Q/dO tiles: no 3rd stage fits
        big = ((64, 128, 8, 3 if regs else 2), (128, 64, 8, 2))
    else:
        big = ((128, 64, 8, 3), (128, 128, 8, 2)) if regs else ((128, 128, 8, 2), (128, 64, 8, 2))

    def fitting(tiles):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": s}, num_warps=w, num_stages=s)
                for m, n, w, s in tiles if block_q % m == 0 and block_k % n == 0]

    space = (fitting(big)[:1] if d_pad <= 128 else []) or fitting(((64, 64, 8, 2), (64, 64, 4, 2)))
    if not space:
        m, n = _divisors(block_q)[-1], _divisors(block_k)[-1]
        space = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "NUM_STAGES": 2}, num_warps=4, num_stages=2)]
    return space


_TUNED: dict = {}


def autotune_picks(kind: str | None = None) -> dict[str, dict[str, str]]:
    """The configs the autotuner has chosen so far in this process, by kernel family
    ((kind, block_q, block_k, d_pad, variant, eight_bit)) and autotune key; ``kind`` ("fwd", "dkdv",
    ...) keeps one kind. The key holds a length class, not the length, and no layout, so a pick made
    on one call holds for later ones of its class: benchmark results record these to make such
    effects visible."""
    return {str(fam): {str(key): str(cfg) for key, cfg in t.cache.items()}
            for fam, t in _TUNED.items() if getattr(t, "cache", None) and kind in (None, fam[0])}


def _tuned(kernel, kind: str, block_q: int, block_k: int, d_pad: int, key: tuple, variant: str = "ptr",
           reset_to_zero: tuple = (), eight_bit: bool = False):
    """The autotuned kernel for this (layout blocks, head dim) family. Autotune key is on head dim,
    dtype, flags and the length class (_tune_class), never on raw sequence length (which would
    re-tune per length).
    ``reset_to_zero``: accumulator arguments the autotuner re-zeroes around its trial runs.
    ``eight_bit``: the forward's int8 / FP8 config space (fwd_configs)."""
    k = (kind, block_q, block_k, d_pad, variant, eight_bit)
    if k not in _TUNED:
        if kind == "fwd":
            configs = fwd_configs(block_q, block_k, d_pad, variant, eight_bit)
        else:
            configs = BWD_SPACE_OVERRIDE.get(kind) or bwd_configs(block_q, block_k, d_pad, kind)
        if not AUTOTUNE:
            configs = [default_config(configs, kind, d_pad, eight_bit)]
        if len(configs) > 1:
            kw = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
            if kind == "fwd" and d_pad == 128:
                kw["prune_configs_by"] = {"early_config_prune": _prune_long_fwd}
            _TUNED[k] = _Picked(triton.autotune(configs, key=list(key), reset_to_zero=list(reset_to_zero) or None,
                                                **kw)(kernel), key)
        else:
            _TUNED[k] = _Fixed(kernel, configs[0])
    return _TUNED[k]


def default_config(configs: list[triton.Config], kind: str, d_pad: int, eight_bit: bool = False) -> triton.Config:
    """A reasonable untuned pick: forward, the largest tiles, 8 warps for 128x128 tiles, 3 stages;
    backward and the 8-bit forward, the first config (their spaces list the measured best first)."""
    if kind != "fwd" or eight_bit:
        return configs[0]

    def score(c):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        want_bn = 64 if d_pad >= 128 else 128
        want_stages = 2 if d_pad >= 256 else 3
        want_warps = 8 if bm * bn >= 128 * 64 else 4
        return (bm, -abs(bn - want_bn), c.num_warps == want_warps, -abs(c.kwargs["NUM_STAGES"] - want_stages))
    return max(configs, key=score)


class _Picked:
    """An autotuned kernel whose picks are launched without the autotuner's per-call work. Triton's
    ``Autotuner.run`` rebuilds its cache key on every launch, scanning the ~70 argument names once per
    argument and taking ``str(dtype)`` of each tensor: 47 us a forward launch on the CI machine, against
    13 us for the key built here. On an H200's host a bare forward launch took 136.9 us through the
    autotuner and 113.9 us through this (benchmarks/picked_launch_ab.py, NOTES.md "The autotuner's
    per-launch work"). Here the key is built from the same values, the ``key`` arguments
    and every tensor argument's dtype, and a key seen before launches its config through the JIT
    function directly; an unseen one goes through the autotuner, which tunes (or reads its disk
    cache), and its pick is kept. ``cache`` is the autotuner's (autotune_picks reads it)."""

    def __init__(self, autotuner, key: tuple):
        self.autotuner = autotuner
        names = list(autotuner.arg_names)
        # each key argument by position when passed positionally, else by keyword
        self._key_args = tuple((names.index(n) if n in names else None, n) for n in key)
        self._picks: dict = {}
        self._tuned: set = set()  # keys the autotuner has seen, so its own cache holds their pick

    @property
    def cache(self) -> dict:
        return self.autotuner.cache

    def _key(self, args: tuple, kw: dict) -> tuple:
        values = tuple(args[i] if i is not None and i < len(args) else kw.get(n) for i, n in self._key_args)
        return values + tuple(a.dtype for a in args if isinstance(a, torch.Tensor)) \
            + tuple((n, a.dtype) for n, a in kw.items() if isinstance(a, torch.Tensor))

    def __getitem__(self, grid):
        def run(*args, **kw):
            key = self._key(args, kw)
            config = self._picks.get(key)
            if config is not None:
                return launcher(self.autotuner.fn)[grid](*args, **kw, **config.all_kwargs())
            if key not in self._tuned and capturing(next((a for a in args if isinstance(a, torch.Tensor)), None)):
                name = getattr(self.autotuner.fn, "__name__", "a kernel")
                raise RuntimeError(
                    f"{name} is being captured in a CUDA graph before it ran at these sizes: its "
                    "autotuner would now time its candidate configs, which capture forbids. Run "
                    "the same call once eagerly before capturing (PyTorch's recipe warms up on a side "
                    "stream), or use torch.compile(mode='reduce-overhead'), whose warm-up does that.")
            out = self.autotuner[grid](*args, **kw)
            self._tuned.add(key)
            picked = getattr(self.autotuner, "best_config", None)
            if picked is not None and picked.pre_hook is None:  # a pre_hook would have to run per launch
                self._picks[key] = picked
            return out
        return run


class _Fixed:
    """A kernel with one config (interpreter, or a space pruned to one)."""

    def __init__(self, kernel, config: triton.Config):
        self.kernel, self.config = kernel, config

    def __getitem__(self, grid):
        def run(*args, **kw):
            return launcher(self.kernel)[grid](*args, **kw, **self.config.kwargs, num_warps=self.config.num_warps,
                                               num_stages=self.config.num_stages)
        return run


_KEY = ("HEAD_DIM", "D_PAD", "BLOCK_Q", "BLOCK_K", "N_TERMS", "IS_VARLEN", "TUNE_CLASS")


def _tune_class(lq: int, lk: int) -> int:
    """The autotune key's length class: ceil(log2(max(lq, lk))), so a config is tuned once per power of
    two of the (max) sequence length rather than once per process. Without it the first call's length
    decided for every later one, and through Triton's on-disk autotune cache for later processes too:
    grouped_bench.py tuned the packed forward at 8K (128x128 tiles, 2 stages) and ran 16K-32K with it,
    8-16% slower than with the 3 stages tuned at those lengths (results/grouped-fwd-configs-h100.json)."""
    return (max(lq, lk, 2) - 1).bit_length()


def _layout_strides(counts: torch.Tensor, indices: torch.Tensor) -> tuple:
    """Broadcast dims (size 1) get stride 0, so one row set serves every batch element / head."""
    cb = counts.stride(0) if counts.shape[0] > 1 else 0
    ch = counts.stride(1) if counts.shape[1] > 1 else 0
    ib = indices.stride(0) if indices.shape[0] > 1 else 0
    ih = indices.stride(1) if indices.shape[1] > 1 else 0
    return cb, ch, ib, ih, indices.stride(2)


def _qkv_strides(t: torch.Tensor, varlen: bool) -> tuple:
    """(batch, head, token) strides: dense [B, H, L, D]; varlen [T, H, D] has batch stride 0."""
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def _cdiv(n: int, d: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function, whose host call costs microseconds a
    launch (its argument unwrapping), which a decoding step pays in every layer."""
    return -(-n // d)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see _cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _d_pad(d: int) -> int:
    return max(16, _next_pow2(d))


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z dimensions
SPLIT_GRID_ABOVE = MAX_GRID_YZ  # (sequence, head) pairs past which grid_rows splits them (tests lower it)


def grid_rows(sequences: int, heads: int) -> tuple[tuple[int, ...], bool]:
    """The kernels' grid axes after the tiles' and their SPLIT_GRID flag (kernels.py's legend): the
    (sequence, head) pairs on axis 1 while they fit CUDA's 65535 there, ``((sequences * heads,), False)``;
    past it (the launch failed with a bare 'Triton Error [CUDA]: invalid argument', batch 2048 x 32
    heads on the H100) heads on axis 1 and sequences on axis 2, ``((heads, sequences), True)``, or a
    ValueError where either is over 65535 too."""
    if sequences * heads <= SPLIT_GRID_ABOVE:
        return (sequences * heads,), False
    return grid_heads_batch(sequences, heads), True


def grid_heads_batch(sequences: int, heads: int) -> tuple[int, int]:
    """``(heads, sequences)`` for a grid's axes 1 and 2, or a ValueError where either is over CUDA's 65535."""
    for name, n in (("sequences", sequences), ("heads", heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"the kernels run one grid row per {name[:-1]}: {n} {name} is over CUDA's "
                             f"{MAX_GRID_YZ}; split the call into batches of at most {MAX_GRID_YZ} {name}")
    return heads, sequences


def _num_seqs(cu: torch.Tensor, seq_step: int) -> int:
    """cu_seqlens [B + 1] (seq_step 1) or (start, end) pairs [2 B] (seq_step 2)."""
    return cu.numel() - 1 if seq_step == 1 else cu.numel() // 2


def _scale_strides(t: torch.Tensor | None, varlen: bool) -> tuple:
    """(batch, head) strides of a per-token or per-channel scale tensor: dense [B, H, n], varlen [H, n]."""
    if t is None:
        return 0, 0
    return (0, t.stride(0)) if varlen else (t.stride(0), t.stride(1))


def _channel_scale_strides(t: torch.Tensor | None) -> tuple:
    """(batch or sequence, head) strides of the per-channel V scales [B | S, H, D]."""
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def _v_strides(v: torch.Tensor, varlen: bool, v_trans: bool) -> tuple:
    """(batch, head, token, channel) strides of V: [B, H, L, D] / [T, H, D], or with v_trans the
    transposed FP8 copies [B, H, D, L] / [H, D, T]."""
    if not v_trans:
        return _qkv_strides(v, varlen) + (1,)
    if varlen:
        return 0, v.stride(0), 1, v.stride(1)
    return v.stride(0), v.stride(1), 1, v.stride(2)


def forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous: bool, terms, n_terms: int,
            cu_q, cu_k, block_q: int, block_k: int, sm_scale: float, max_q: int, max_k: int, seq_step: int = 1,
            scales: tuple | None = None, quant: int = 0, out_dtype: torch.dtype | None = None,
            pv_threshold: float = 0.0, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            k_scale_span: int = 0, device_plan: int = 0, window: int = 0, sinks: int = 0):
    """Returns (out like q, lse fp32 [B, H, Lq] or [H, T] for varlen): :func:`_forward`, whose arguments these
    are. A 16-bit call of at most SMALL_Q_ROWS query rows (decoding) whose geometry has been recorded launches
    the recorded kernels again with its own tensors (:mod:`.replay`: the same bits, without the host work)."""
    args = (q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous, terms, n_terms, cu_q, cu_k, block_q,
            block_k, sm_scale, max_q, max_k, seq_step)
    options = dict(scales=scales, quant=quant, out_dtype=out_dtype, pv_threshold=pv_threshold, out=out, lse=lse,
                   k_scale_span=k_scale_span, device_plan=device_plan, window=window, sinks=sinks)
    if not (replay.ENABLED and out is None and lse is None and not quant and 0 < max_q <= SMALL_Q_ROWS):
        return _forward(*args, **options)
    inputs = (q, k, v, counts, n_full, full_start, indices, mask_ids, terms, cu_q, cu_k)
    key = replay.key(inputs, (contiguous, n_terms, block_q, block_k, sm_scale, max_q, max_k, seq_step, out_dtype,
                              pv_threshold, k_scale_span, device_plan, window, sinks, _replay_settings()))
    _last_key.value = None if key is None else (key, (id(q), id(k), id(v)))
    found = None if key is None else replay.find(key)
    if found is None or found is replay.NEVER or not replay.usable():  # (not usable: a profiler's hook, say)
        return _forward(*args, **options)
    if found is not replay.RECORD:
        _ensure_allocator()
        return replay.run(found, inputs, q.device)
    trace: dict = {}
    with fast_launch.recording() as launches:
        result = _forward(*args, **options, trace=trace)
    replay.keep(key, inputs, trace.get("allocs", []), launches, trace.get("expected", -1), result,
                trace.get("length_spec"))
    return result


def _device_plan_blocks(device_plan: int, lk: int, block_q: int, block_k: int, window: int, sinks: int) -> int:
    """The most key blocks a device-planned row visits (the split-KV count is planned on it)."""
    blocks = _cdiv(lk, block_k)
    if device_plan == 3:  # a query block's windows span window + block_q - 1 keys, unaligned, after the sinks
        blocks = min(blocks, _cdiv(window + block_q - 1, block_k) + 1 + _cdiv(sinks, block_k))
    return blocks


class LengthSpec(NamedTuple):
    """What a recorded device-planned short forward (dense or packed inputs) decided from its key length
    (derive_for_length): short_query_plan's arguments before and after its ``max_k``, the plan it gave, the device
    plan's kind, window and sinks, and the key blocks it planned for."""
    plan_head: tuple  # (B, H, hkv, Lq, block_q, block_k, d_pad, layout_heads)
    plan: ShortQueryPlan
    plan_tail: tuple  # (variant, device, varlen): the variant as _forward chose it (TMA or pointer loads)
    device_plan: int
    window: int
    sinks: int
    blocks: int  # the key blocks the plan was made for (_device_plan_blocks)


# the fwd_kernel arguments a device-planned call takes from its key length, in the order derive_for_length
# computes them: K's and V's strides, Lk (a packed call's longest sequence), the autotune key's length class, the
# key tokens
_LENGTH_ARGS = ("stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_vd", "Lk",
                "TUNE_CLASS", "T_K")
# once: (their positions among a fwd launch's values, which are in signature order; the count of those values)
_fwd_args: list = []


def derive_for_length(recipe: replay.Recipe, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      max_k: int | None = None) -> replay.Recipe | None:
    """The recipe of a device-planned short forward on ``q``, ``k``, ``v`` (dense ``[B, H, L, D]``, or packed token
    views with the longest sequence's ``max_k`` keys), made from ``recipe``, recorded for a call that differed from
    this one only in the key length (K/V's length or ``max_k``, their tokens and the strides the length scales; a
    packed call's offsets are inputs): what :func:`_forward` would launch here, or None where that cannot be shown
    without taking its path. A decoding step's first layer meets a new cache length, whose path and recording took
    212-268 us of host time on the H200 against 44 for a replay (benchmarks/new_length_probe.py; NOTES, "A cache
    length never seen").

    Only the fwd launch's length arguments (_LENGTH_ARGS) may differ, so this redoes what depends on the length:
    short_query_plan, whose split count steps with the key blocks, must give the same plan (then the grid, the
    allocations and the merge launch are the recorded ones), the variant (TMA or pointer loads) must be the same,
    and each new integer must have the recorded one's specialization class (ops.fast_launch keys its kept kernels by
    it): otherwise None, and the call takes the path, which records anew."""
    spec = recipe.length_spec
    if spec is None:
        return None
    varlen = spec.plan_tail[2]
    if varlen:
        if max_k is None or v.shape[0] != k.shape[0]:
            return None
        lk, t_k = max_k, k.shape[0]
    else:
        lk = t_k = k.shape[2]
        if v.shape[2] != lk:
            return None
    if lk < 1:
        return None
    if spec.plan_tail[0] != "ptr":  # q and the K/V bases are the recorded call's: only K/V's strides may differ
        if not (_tma_strides(k) and _tma_strides(v)):
            return None
    elif FWD_VARIANT != "ptr" and _tma_ok(q, k, v):
        return None
    head = spec.plan_head
    blocks = _device_plan_blocks(spec.device_plan, lk, head[4], head[5], spec.window, spec.sinks)
    if blocks != spec.blocks:  # the split count is planned on them
        plan, old = short_query_plan(*head, blocks, *spec.plan_tail), spec.plan
        if plan is None or plan[1:] != old[1:] or plan.config.all_kwargs() != old.config.all_kwargs():
            return None
        spec = spec._replace(blocks=blocks)
    if not _fwd_args:
        names = tuple(inspect.signature(kernels.fwd_kernel.fn).parameters)
        _fwd_args.append((tuple(names.index(n) for n in _LENGTH_ARGS), len(names)))
    positions, count = _fwd_args[0]
    fwd, template, tensors = recipe.launches[0]
    if len(template) != count:
        return None
    values = list(template)
    new = (*_qkv_strides(k, varlen), *_v_strides(v, varlen, False), lk, _tune_class(head[3], lk), t_k)
    for i, value in zip(positions, new, strict=True):
        was = values[i]
        if value != was:
            if type(was) is not int or fast_launch._int_class(was) != fast_launch._int_class(value):
                return None
            values[i] = value
    return recipe._replace(launches=((fwd, tuple(values), tensors),) + recipe.launches[1:], length_spec=spec)


def _tma_strides(t: torch.Tensor) -> bool:
    """_tma_ok's condition on a tensor's strides (every one but the last a multiple of 16 bytes)."""
    size = t.element_size()
    return all((st * size) % 16 == 0 for st in t.stride()[:-1])


_last_key = threading.local()  # this thread's last forward's replay key (take_replay_key)


def take_replay_key() -> tuple | None:
    """(replay key, ids of its q, k, v) of this thread's last :func:`forward` since the last take, or None where it
    computed none (a call the replay does not serve): what ops.block_sparse.entry learns a decoding call's key from
    (taking it before the call too, so that a call that never reaches :func:`forward` finds none)."""
    value = getattr(_last_key, "value", None)
    _last_key.value = None
    return value


def _replay_settings() -> tuple:
    """What the short-query path reads besides its arguments (module settings that probes and tests reassign, the
    kernels and launcher in use, deterministic algorithms, which turn the wave order's clock off): part of every
    replay key."""
    return (torch.are_deterministic_algorithms_enabled(), FWD_VARIANT, FORCE_INDEXED, FWD_KV_SPLIT,
            tuple(SPLIT_CONFIG_OVERRIDE.items()), PACK_GQA, PACK_GQA_MAX_ROWS, SMALL_Q_ROWS, KV_SPLIT_MAX,
            KV_SPLIT_MIN_TILES, KV_SPLIT_WAVES, KV_SPLIT_LONG_WAVES, KV_SPLIT_LONG_MIN_TILES, ROW_ORDER,
            SPLIT_GRID_ABOVE, fast_launch.ENABLED, id(kernels.fwd_kernel), id(kernels.split_merge_kernel),
            id(launcher))


def _forward(q, k, v, counts, n_full, full_start, indices, mask_ids, contiguous: bool, terms, n_terms: int,
             cu_q, cu_k, block_q: int, block_k: int, sm_scale: float, max_q: int, max_k: int, seq_step: int = 1,
             scales: tuple | None = None, quant: int = 0, out_dtype: torch.dtype | None = None,
             pv_threshold: float = 0.0, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
             k_scale_span: int = 0, device_plan: int = 0, window: int = 0, sinks: int = 0, trace: dict | None = None):
    """Returns (out like q, lse fp32 [B, H, Lq] or [H, T] for varlen). The layout arrives as its
    schedule (sparse_attn.ops.block_sparse.schedule): unmasked blocks first, then masked.
    ``out`` / ``lse``: write there instead (views of any strides, shaped as the results; callers
    outside autograd only, e.g. context parallelism filling slices of its own buffers).

    8-bit inputs (``quant`` 1 or 2, see kernels.py): q/k int8, ``scales = (q_scale, k_scale, v_scale)``
    (fp32 per row ``[B, H, L]`` / ``[H, T]``, and per V channel ``[B, Hkv, D]`` / per sequence ``[S, Hkv, D]``), v
    in out_dtype (quant 1) or FP8 transposed (quant 2); ``out_dtype`` is the output's dtype.
    ``pv_threshold`` in (0, 1): skip K/V tiles whose probabilities are all below it (0: off).
    ``k_scale_span``: the 8-bit K scales are constant over aligned runs of this many keys (0: per key);
    where a kernel tile fits in one run, its scale joins the per-row factor (kernels._scores).
    ``device_plan`` 1 (dense), 2 (bottom-right causal) or 3 (bottom-right causal sliding window of ``window``
    keys, as patterns.local; with ``sinks`` > 0 also the first ``sinks`` keys, as patterns.streaming), 16-bit
    inputs on 128 x 128 blocks: the kernel plans each row from its sequence's lengths (kernels.fwd_kernel
    DEVICE_PLAN), so nothing here depends on the lengths' values: ``counts`` is an int32 stand-in for the
    schedule and the term table (never read), the other schedule tensors and ``terms`` are ignored, as are
    ``contiguous`` and ``n_terms``.
    ``trace``: a dict that the short-query path fills for :func:`forward`'s recording: ``allocs``, the buffers it
    allocated, and ``expected``, the launches it makes."""
    varlen = cu_q is not None
    if device_plan:
        if (device_plan not in (1, 2, 3) or quant or (block_q, block_k) != (128, 128)
                or (device_plan == 3) != (window >= 1) or sinks < 0 or (sinks and device_plan != 3)):
            raise ValueError(f"a device plan is dense (1), causal (2) or a causal window of at least one key (3, with "
                             f"sinks >= 0) on 16-bit inputs and 128 x 128 blocks, got device_plan={device_plan}, "
                             f"window={window}, sinks={sinks}, quant={quant}, blocks {block_q} x {block_k}")
        # never read (DEVICE_PLAN): int32 tensors stand in for the schedule and the term table, and n_terms is
        # the host plan's, so that the autotune key (which holds N_TERMS and the tensors' dtypes) is the host
        # plan's: one pick, so the same config and bits for calls with gradients (host plan) and without
        n_full = full_start = indices = mask_ids = terms = counts
        contiguous, n_terms = True, 0 if device_plan == 1 else 2 if sinks else 1
    v_trans = quant == 2
    if varlen:
        T, H, D = q.shape
        B = _num_seqs(cu_q, seq_step)
        Lq, Lk = max_q, max_k
        lse = torch.empty(H, T, device=q.device, dtype=torch.float32) if lse is None else lse
        l_strides = (0, lse.stride(0), lse.stride(1))
        hkv = k.shape[1]
    else:
        B, H, Lq, D = q.shape
        Lk, hkv = k.shape[2], k.shape[1]
        lse = torch.empty(B, H, Lq, device=q.device, dtype=torch.float32) if lse is None else lse
        l_strides = lse.stride()
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype) if out is None else out
    q_scale, k_scale, v_scale = scales if scales is not None else (None, None, None)
    d_pad = _d_pad(D)
    # 8-bit varlen on TMA too: packed FP8 V^T starts each sequence at a 16-byte aligned column
    # (kernels.vt_column0), and per-key K scales of packed sequences come by pointer loads (a TMA
    # read at a sequence's first key, any token, is unaligned: an illegal instruction on the H100)
    variant = FWD_VARIANT if _tma_ok(q, k, v) else "ptr"
    if variant != "ptr":
        _ensure_allocator()
    contiguous = bool(device_plan) or (contiguous and not FORCE_INDEXED)  # a bool: the constexpr's variants
    rows, split = grid_rows(B, H)
    if device_plan:  # one row set for every sequence and head, at most the longest sequence's key blocks
        layout_heads, layout_strides = 1, (0, 0, 0, 0, 0)
        max_count = _device_plan_blocks(device_plan, Lk, block_q, block_k, window, sinks)
    else:
        layout_heads, max_count, layout_strides = counts.shape[1], indices.shape[-1], _layout_strides(counts, indices)
    t_q, t_k = (q.shape[0], k.shape[0]) if varlen else (Lq, Lk)

    def run_fwd(kern, grid, o, o_strides, l, l_strides_, wave_ns, wave, n_parts, part_strides, heads=H,
                split_grid=split, **meta):
        kern[grid](
            q, k, v, o, l, counts, n_full, full_start, indices, mask_ids, terms, cu_q, cu_k, q_scale, k_scale,
            v_scale, sm_scale, math.log2(pv_threshold) if pv_threshold > 0 else 0.0,
            *_qkv_strides(q, varlen), *_qkv_strides(k, varlen), *_v_strides(v, varlen, v_trans), *o_strides,
            *l_strides_, *layout_strides,
            *_scale_strides(q_scale, varlen), *_scale_strides(k_scale, varlen), *_channel_scale_strides(v_scale),
            heads, H // hkv, Lq, Lk, seq_step, _tune_class(Lq, Lk), _sm_count(q.device), wave_ns, n_parts,
            *part_strides, t_q, t_k, window, sinks, HEAD_DIM=D, D_PAD=d_pad, BLOCK_Q=block_q, BLOCK_K=block_k,
            N_TERMS=n_terms,
            CONTIGUOUS=contiguous, IS_VARLEN=varlen, QUANT=quant, PV_SKIP=pv_threshold > 0,
            K_SCALE_SPAN=k_scale_span, WAVE=wave, SPLIT_GRID=split_grid, DEVICE_PLAN=device_plan, **meta)

    reverse = _reverse_rows("fwd")  # checks ROW_ORDER on every call, whichever kernel runs
    plan = None if quant else short_query_plan(
        B, H, hkv, Lq, block_q, block_k, d_pad, layout_heads, max_count, variant, q.device, varlen)
    if plan is not None:  # few query rows (decoding) or a grid too small for the GPU
        kern = _Fixed(kernels.fwd_kernel, plan.config)
        plan_rows, plan_split = grid_rows(B, plan.heads)  # a split grid: decoding thousands of sequences
        grid = (plan.tiles * plan.parts, *plan_rows)
        if trace is not None:
            trace["allocs"], trace["expected"] = [out, lse], 1 if plan.parts == 1 else 2
            if device_plan:  # what derive_for_length needs to redo for another key length
                trace["length_spec"] = LengthSpec((B, H, hkv, Lq, block_q, block_k, d_pad, layout_heads), plan,
                                                  (variant, q.device, varlen), device_plan, window, sinks, max_count)
        if plan.parts == 1:  # the small tile alone, written in place
            run_fwd(kern, grid, out, _qkv_strides(out, varlen), lse, l_strides, 0, False, 1, (0, 0), plan.heads,
                    plan_split, REVERSE=False, KV_SPLIT=False, PACK_GQA=plan.pack)
            return out, lse
        # (kv_splits splits grids of at most as many programs as SMs: never a split grid, nor a merge grid
        # over CUDA's 65535 on axis 1)
        parts = _SplitParts.new(plan.parts, out, varlen)
        if trace is not None:
            trace["allocs"] += [parts.out, parts.lse]
        run_fwd(kern, grid, parts.out, parts.o_strides, parts.lse, parts.l_strides, 0, False, plan.parts,
                parts.part_strides, plan.heads, plan_split, REVERSE=False, KV_SPLIT=True, PACK_GQA=plan.pack)
        # packed rows merge as one sequence of T rows: the merge is row by row
        merge_b, merge_rows = (1, out.shape[0]) if varlen else (B, Lq)
        block_r = 16 if merge_rows <= 16 else 64
        launcher(kernels.split_merge_kernel)[(_cdiv(merge_rows, block_r), merge_b * H)](
            parts.out, parts.lse, out, lse, plan.parts, parts.out.stride(0), *parts.o_strides, parts.lse.stride(0),
            *parts.l_strides[:2], *_qkv_strides(out, varlen), *l_strides, H, merge_rows, HEAD_DIM=D, D_PAD=d_pad,
            BLOCK_R=block_r, num_warps=4)
        return out, lse
    kern = _tuned(kernels.fwd_kernel, "fwd", block_q, block_k, d_pad, _KEY + ("CONTIGUOUS", "QUANT", "PV_SKIP", "WAVE"),
                  variant, eight_bit=quant != 0)
    wave_ns = fwd_wave_clock(q.device, d_pad, k.element_size(), quant, block_q, block_k, Lk, max_count,
                             contiguous) if FWD_WAVE and not varlen and q.device.type == "cuda" else 0
    # indexed rows: the grid position's phase or the clock's; contiguous runs: only the clock's
    wave = FWD_WAVE and not varlen and (not contiguous or wave_ns > 0)
    grid = lambda meta: (_cdiv(Lq, meta["BLOCK_M"]), *rows)  # noqa: E731
    run_fwd(kern, grid, out, _qkv_strides(out, varlen), lse, l_strides, wave_ns, wave, 1, (0, 0),
            REVERSE=reverse, KV_SPLIT=False, PACK_GQA=False)
    return out, lse


class _SplitParts(NamedTuple):
    """The split-KV forward's per-part results (fp32): outputs ``out`` [parts, B, H, Lq, D] (packed:
    [parts, T, H, D]) and LSEs ``lse`` [parts, B, H, Lq] (packed: [parts, H, T]), with the (batch, head,
    row) strides of one part as fwd_kernel and split_merge_kernel take them, and the part strides."""
    out: torch.Tensor
    lse: torch.Tensor
    o_strides: tuple
    l_strides: tuple
    part_strides: tuple

    @staticmethod
    def new(parts: int, out: torch.Tensor, varlen: bool) -> "_SplitParts":
        if varlen:
            T, H, D = out.shape
            o = torch.empty(parts, T, H, D, device=out.device, dtype=torch.float32)
            lse = torch.empty(parts, H, T, device=out.device, dtype=torch.float32)
            o_strides, l_strides = (0, o.stride(2), o.stride(1)), (0, lse.stride(1), lse.stride(2))
        else:
            o = torch.empty(parts, *out.shape, device=out.device, dtype=torch.float32)
            lse = torch.empty(parts, *out.shape[:3], device=out.device, dtype=torch.float32)
            o_strides, l_strides = o.stride()[1:4], lse.stride()[1:]
        return _SplitParts(o, lse, o_strides, l_strides, (o.stride(0), lse.stride(0)))


class ShortQueryPlan(NamedTuple):
    """How launch.forward runs a call with few query rows (short_query_plan)."""
    config: triton.Config  # split_config's
    heads: int  # the grid's heads: query heads, or kv heads when ``pack``
    tiles: int  # query tiles per (batch, grid head)
    parts: int  # split-KV parts per tile (1: unsplit, written in place)
    pack: bool  # PACK_GQA: a tile holds the rows of all query heads of one kv head


def short_query_plan(B: int, H: int, hkv: int, lq: int, block_q: int, block_k: int, d_pad: int, layout_heads: int,
                     max_k: int, variant: str, device: torch.device, uneven: bool = False) -> ShortQueryPlan | None:
    """The small-tile forward's plan for a 16-bit call (packed or not; ``lq`` packed: the longest
    sequence's query rows), or None for the autotuned kernel. It
    runs where the call has at most SMALL_Q_ROWS query rows or where kv_splits splits its grid. GQA
    rows are packed (PACK_GQA) where all query heads share the layout, every query sits in its first
    query block and the G * lq rows fit PACK_GQA_MAX_ROWS: K/V tiles are then read once per kv head.
    ``uneven``: a packed call, whose sequences differ in length; with at most SMALL_Q_ROWS query rows a
    sequence its split takes two waves (kv_splits; longer calls were not measured so and keep one)."""
    if lq == 0:  # nothing to attend: the autotuned kernel's empty grid, as before
        return None
    group = H // hkv
    pack = PACK_GQA and group > 1 and layout_heads == 1 and lq <= block_q and group * lq <= PACK_GQA_MAX_ROWS
    heads = hkv if pack else H
    config = split_config(block_q, block_k, d_pad, group * lq if pack else lq, variant, packed=pack)
    tiles = 1 if pack else _cdiv(lq, config.kwargs["BLOCK_M"])
    parts = kv_splits(tiles * B * heads, max_k * (block_k // config.kwargs["BLOCK_N"]), device,
                      uneven and lq <= SMALL_Q_ROWS)
    if parts == 1 and lq > SMALL_Q_ROWS:
        return None
    return ShortQueryPlan(config, heads, tiles, parts, pack)


def layout_query_plan(layout, B: int, H: int, hkv: int, lq: int, head_dim: int, device: torch.device,
                      variant: str = "tma") -> ShortQueryPlan | None:
    """short_query_plan for a call on ``layout`` (benchmarks and tests: what forward would run)."""
    return short_query_plan(B, H, hkv, lq, layout.block_q, layout.block_k, _d_pad(head_dim), layout.heads,
                            layout.max_k, variant, device)


def split_config(block_q: int, block_k: int, d_pad: int, lq: int, variant: str, packed: bool = False
                 ) -> triton.Config:
    """The short-query forward's one config, split or not (short_query_plan; no autotuning: its launches
    are short and few rows long). Query tiles of 16 rows for up to 16 query rows (decoding), else 64, where they divide
    the layout's query blocks; ``packed`` (PACK_GQA, ``lq`` the packed rows: at most 64): the least power
    of two from 16 holding them, whatever block_q. 128-key tiles at 3 stages (64 at 2 for head dim 256,
    as _keep_fwd), 4 warps."""
    if packed:
        bm = max(16, _next_pow2(lq))
    elif INTERPRET:
        bm = 16 if block_q % 16 == 0 else _divisors(block_q)[-1]
    else:
        want_m = 16 if lq <= 16 else 64
        bm = max([t for t in _divisors(block_q) if t <= want_m] or _divisors(block_q)[:1])
    if INTERPRET:
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": max(_divisors(block_k, (16, 32))), "NUM_STAGES": 1,
                              "USE_TMA": False}, num_warps=4, num_stages=1)
    bns = _divisors(block_k, (64,) if d_pad >= 256 else (64, 128)) or _divisors(block_k)[-1:]
    bn = SPLIT_CONFIG_OVERRIDE.get("BLOCK_N", bns[-1])
    stages = SPLIT_CONFIG_OVERRIDE.get("NUM_STAGES", 2 if d_pad >= 256 else 3)
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": stages, "USE_TMA": variant != "ptr"},
                         num_warps=SPLIT_CONFIG_OVERRIDE.get("num_warps", 4), num_stages=stages)


def kv_splits(programs: int, tiles_per_row: int, device: torch.device, uneven: bool = False) -> int:
    """How many parts a split-KV forward cuts each query tile's key walk into (FWD_KV_SPLIT), 1 for no
    split. ``programs``: the unsplit grid's (query tiles x batch x heads); ``tiles_per_row``: key tiles of
    the layout's longest row; ``uneven``: the rows' lengths differ (packed sequences). "auto": as many
    parts as keep the grid within one wave (SMs // programs), each walking at least KV_SPLIT_MIN_TILES
    tiles of the longest row; where ``uneven``, at least as many as make two waves (KV_SPLIT_LONG_WAVES)
    of parts KV_SPLIT_LONG_MIN_TILES long. At most KV_SPLIT_MAX; a grid that fills the SMs by itself
    stays unsplit. A forced count is capped by the row's tiles."""
    if FWD_KV_SPLIT == "auto":
        if programs == 0:  # no query row: an empty grid
            return 1
        n_sm = _sm_count(device)
        parts = min(KV_SPLIT_WAVES * n_sm // programs, tiles_per_row // KV_SPLIT_MIN_TILES)
        if uneven:
            parts = max(parts, min(KV_SPLIT_LONG_WAVES * n_sm // programs, tiles_per_row // KV_SPLIT_LONG_MIN_TILES))
        return max(1, min(parts, KV_SPLIT_MAX))
    try:
        forced = int(FWD_KV_SPLIT)
    except ValueError:
        forced = -1
    if forced < 0:
        raise ValueError(f"SPARSE_ATTN_FWD_KV_SPLIT must be 'auto', '0' or a number of parts, got {FWD_KV_SPLIT!r}")
    return max(1, min(forced, tiles_per_row))


def _reverse_rows(kernel: str) -> bool:
    """The REVERSE constexpr of the ``kernel`` ("fwd" or "dq") grid (ROW_ORDER, checked again here:
    probes reassign it at run time)."""
    if ROW_ORDER not in _ROW_ORDERS:
        raise ValueError(f"launch.ROW_ORDER must be 'reverse-dq', 'reverse' or 'grid', got {ROW_ORDER!r}")
    return ROW_ORDER == "reverse" or (ROW_ORDER == "reverse-dq" and kernel == "dq")


def fwd_wave_clock(device: torch.device, d_pad: int, elem_bytes: int, quant: int, block_q: int, block_k: int,
                   lk: int, max_k: int, contiguous: bool = False) -> int:
    """WAVE_NS of a forward launch (FWD_WAVE_CLOCK): about one row's duration in ns, for rows of at
    most ``max_k`` layout blocks, or 0: indexed rows then take the grid position's phase, contiguous
    runs no rotation. "auto" takes the clock where the keys the running rows read outgrow the L2 (K
    and V of one kv head: all ``lk`` keys for indexed rows, which scatter over them; a run's own
    ``max_k`` blocks for contiguous rows, which the running neighbours share), in 16-bit at head dim
    128 on 128-token blocks of a Hopper GPU (WAVE_NS_PER_BLOCK is the H100's), unless deterministic
    algorithms are requested. The interpreter stands in an H100 (50 MiB of L2); launch.forward passes 0
    there: it has no GPU clock."""
    if FWD_WAVE_CLOCK == "0" or max_k == 0:
        return 0
    if FWD_WAVE_CLOCK == "auto":
        measured = (_sm_major(device) == 9 and quant == 0 and d_pad == 128 and block_q % 128 == 0
                    and block_k % 128 == 0)
        keys = max_k * block_k if contiguous else lk
        fits_l2 = 2 * keys * d_pad * elem_bytes <= _l2_bytes(device)
        if not measured or fits_l2 or torch.are_deterministic_algorithms_enabled():
            return 0
    return max_k * block_q * block_k // (128 * 128) * WAVE_NS_PER_BLOCK


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (the interpreter, on CPU tensors, stands in 3)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3


@functools.lru_cache(maxsize=None)
def _sm_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device (9: Hopper); the interpreter, on CPU tensors, stands in 9."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 9


@functools.lru_cache(maxsize=None)
def _l2_bytes(device: torch.device) -> int:
    """L2 cache size of a CUDA device; the interpreter, on CPU tensors, stands in the H100's 50 MiB."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 << 20


def bwd_wave(device: torch.device, d_pad: int, elem_bytes: int, walk_q: int, walk_k: int) -> tuple[bool, bool]:
    """(dK/dV, dQ): whether each backward kernel's indexed walks take the wave order (BWD_WAVE).
    "auto": where one head's walked operands outgrow the L2, the dK/dV kernel's Q and dO over
    ``walk_q`` query rows, the dQ kernel's K and V over ``walk_k`` key rows. The order brings L2 hits
    back where those miss, but with deep index loads it cost 2-7% where they fit (H100 random layouts,
    backward alone: 16K-64K slower, 128K 1-4% faster; NOTES.md backward 26)."""
    _check_bwd_settings("BWD_WAVE")
    if BWD_WAVE == "auto":
        def outgrows_l2(rows: int) -> bool:  # two [rows, d_pad] operands of one head
            return 2 * rows * d_pad * elem_bytes > _l2_bytes(device)
        return outgrows_l2(walk_q), outgrows_l2(walk_k)
    return BWD_WAVE in ("1", "dkdv"), BWD_WAVE in ("1", "dq")


def _round_up(n: int, multiple: int) -> int:
    return _cdiv(n, multiple) * multiple


def _row_terms(out: torch.Tensor, do: torch.Tensor, lse: torch.Tensor, block_q: int, cu_q=None, seq_step: int = 1,
               max_q: int | None = None, dlse: torch.Tensor | None = None):
    """(delta, lse2, their (batch, head) strides, starts): fp32 ``rowsum(out * do)`` and the LSE in
    log2 units with -inf as +inf (bwd_delta_kernel), for dense ``[B, H, L, Dv]`` or packed
    ``[T, H, Dv]`` inputs (``cu_q`` / ``seq_step`` / ``max_q`` as in :func:`backward`).

    Each sequence's rows are padded to a multiple of ``block_q`` (the layout's query block), past its
    end delta 0 and LSE2 +inf, so the dK/dV loop reads whole query tiles without a mask. Dense:
    ``[B, H, roundup(L, block_q)]``, ``starts`` None. Packed: ``[H, rows]``, sequence b's rows from
    ``starts[b]`` (int32 ``[B]`` on the device, multiples of block_q; computed there, no sync).
    ``dlse``: the LSE output's gradient (shaped as ``lse``, any strides), subtracted from delta."""
    if cu_q is not None:
        T, H, dv = out.shape
        B = _num_seqs(cu_q, seq_step)
        bounds = cu_q.view(B, 2) if seq_step == 2 else torch.stack([cu_q[:-1], cu_q[1:]], 1)
        padded = (bounds[:, 1] - bounds[:, 0] + block_q - 1) // block_q * block_q
        starts = (padded.cumsum(0) - padded).to(torch.int32)
        # query slices do not overlap (checked by the callers), so their padded rows fit in this
        rows = _round_up(T + B * block_q, 16)
        delta = torch.empty(H, rows, device=out.device, dtype=torch.float32)
        strides, lse_strides = (0, delta.stride(0)), (0, lse.stride(0), lse.stride(1))
        g_strides = (0, dlse.stride(0), dlse.stride(1)) if dlse is not None else (0, 0, 0)
        longest = max_q
    else:
        B, H, L, dv = out.shape
        starts = None
        delta = torch.empty(B, H, _round_up(L, block_q), device=out.device, dtype=torch.float32)
        strides, lse_strides = delta.stride()[:2], lse.stride()
        g_strides = dlse.stride() if dlse is not None else (0, 0, 0)
        longest = L
    lse2 = torch.empty_like(delta)
    if B * H and longest:
        block_m = 16 if INTERPRET else 64
        rows, split = grid_rows(B, H)
        launcher(kernels.bwd_delta_kernel)[(_cdiv(_round_up(longest, block_q), block_m), *rows)](
            out, do, lse, delta, lse2, cu_q, starts, dlse, *_qkv_strides(out, cu_q is not None),
            *_qkv_strides(do, cu_q is not None), *lse_strides, *strides, *g_strides, H, longest, seq_step,
            HEAD_DIM=dv, D_PAD=_d_pad(dv), BLOCK_M=block_m, BLOCK_Q=block_q, IS_VARLEN=cu_q is not None,
            HAS_DLSE=dlse is not None, SPLIT_GRID=split, num_warps=4)
    return delta, lse2, strides, starts


def _check_bwd_settings(*names: str) -> None:
    """ValueError naming the first of ``names`` (default: all backward settings) that holds a value
    outside its choices."""
    for name in names or _BWD_SETTINGS:
        value, allowed = globals()[name], _BWD_SETTINGS[name]
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"launch.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def deep_index_loads(fused: bool, d_pad: int, n_terms: int, varlen: bool) -> bool:
    """Whether the backward kernels' indexed walks load one block index per iteration, pipelined two
    levels deep (BWD_IDX_DEEP), instead of reading register chunks: "auto" where it was measured
    faster (head dim 128, no element masks, not packed), "1" on every split-schedule call."""
    _check_bwd_settings("BWD_IDX_DEEP")
    if fused or BWD_IDX_DEEP == "0":
        return False
    return BWD_IDX_DEEP == "1" or (d_pad == 128 and n_terms == 0 and not varlen)


def terms_by_tma(qdo_tma: bool) -> bool:
    """Whether the dK/dV kernel reads the row terms (LSE2, delta) through TMA descriptors (BWD_TERMS):
    only beside Q/dO read by TMA, whose checks (device, alignment, allocator) cover the terms too."""
    _check_bwd_settings("BWD_TERMS")
    return qdo_tma and BWD_TERMS == "tma"


def tile_order(t_counts: torch.Tensor, hkv: int) -> tuple[torch.Tensor, int, int]:
    """(order, batch stride, head stride): int32 ``[Bl, Hl', n_key_blocks]``, each (batch, kv head) row's key
    blocks sorted by the dK/dV walk's length, longest first (ties in block order), the length being the
    transposed schedule's block counts summed over the kv head's query heads. A layout broadcast over batch
    or heads (size 1) gives one row for all (stride 0)."""
    bl, hl, nkb = t_counts.shape
    work = t_counts if hl == 1 else t_counts.view(bl, hkv, hl // hkv, nkb).sum(2)
    order = torch.argsort(work, dim=-1, descending=True, stable=True).to(torch.int32)
    return order, order.stride(0) if bl > 1 else 0, order.stride(1) if order.shape[1] > 1 else 0


# tile_order's results per transposed schedule's counts tensor: a layout caches its schedules, so its backward
# sorts once instead of launching the sort's five small kernels on every call (each entry goes with its
# tensor). Nothing is stored during CUDA graph capture: a tensor made there holds values only after replay.
_TILE_ORDERS = WeakTensorKeyDictionary()


def cached_tile_order(t_counts: torch.Tensor, hkv: int) -> tuple[torch.Tensor, int, int]:
    """tile_order(t_counts, hkv), computed once per counts tensor, kv head count and in-place version."""
    key = (hkv, t_counts._version)
    found = _TILE_ORDERS.get(t_counts, {}).get(key)
    if found is not None:
        return found
    found = tile_order(t_counts, hkv)
    if not capturing(t_counts):
        _TILE_ORDERS.setdefault(t_counts, {})[key] = found
    return found


def longest_walks_first(indexed: bool, varlen: bool, fused: bool, heads: int, hkv: int) -> bool:
    """Whether the dK/dV programs take their row's key tiles longest walk first (BWD_TILE_ORDER): on indexed
    schedules only (a contiguous one's walks shrink or stay level along the grid), not on packed inputs (their
    rows' lengths differ by sequence) nor the fused variant; "auto" for GQA / MQA (heads > hkv) only."""
    _check_bwd_settings("BWD_TILE_ORDER")
    if not indexed or varlen or fused or BWD_TILE_ORDER == "grid":
        return False
    return BWD_TILE_ORDER == "work" or heads > hkv


def backward(do, q, k, v, out, lse, counts, n_full, indices, mask_ids, t_counts, t_n_full, t_indices, t_mask_ids,
             terms, n_terms: int, cu_q, cu_k, block_q: int, block_k: int, sm_scale: float, max_q: int, max_k: int,
             seq_step: int = 1, cu_dk=None, dk_rows=None, dkv_dtype: torch.dtype | None = None,
             contiguous: bool = False, t_contiguous: bool = False, dlse: torch.Tensor | None = None):
    """Returns (dq, dk, dv). dK/dV walk the transposed schedule; each program owns one key tile of
    one kv head and loops over that head's query-head group, so dK/dV need no atomics. dQ: with
    BWD_VARIANT "split" (the default) a dQ kernel walks the forward schedule, on a side stream beside
    the dK/dV kernel (BWD_DQ_SIDE_STREAM); with "fused" the dK/dV programs add it into an fp32 buffer
    (atomics).

    Overlapping key slices (grouped attention, ``seq_step`` 2): each sequence writes its dK/dV rows
    into an fp32 scratch buffer at the (start, end) pairs ``cu_dk``; ``dk_rows`` (int64 [scratch
    rows]) maps scratch rows to k's rows, and overlapping contributions are summed in fp32 before
    the one rounding to k's dtype.

    ``dkv_dtype``: dK/dV in this dtype instead of k's (float32 for callers that sum several calls'
    dK/dV: context parallelism, where rounding each group's partial sum to bf16 first doubled the
    max error against single-device attention at 4K tokens on 2 H200).

    ``contiguous`` / ``t_contiguous``: the forward / transposed schedule's claim that every row's
    unmasked blocks form one run (Schedule.contiguous); the dQ / dK/dV kernel then walks it by
    arithmetic (BWD_CONTIGUOUS). False is always safe.

    ``dlse``: the gradient of the LSE output (shaped as ``lse``), when the caller's loss used it."""
    _check_bwd_settings()
    varlen = cu_q is not None
    if varlen:
        T, H, D = q.shape
        B = _num_seqs(cu_q, seq_step)
        Lq, Lk = max_q, max_k
        hkv = k.shape[1]
    else:
        B, H, Lq, D = q.shape
        Lk, hkv = k.shape[2], k.shape[1]
    rows, split = grid_rows(B, H)  # refused before any allocation (the forward checked it; direct callers may not)
    delta, lse2, l_strides, l_starts = _row_terms(out, do, lse, block_q, cu_q, seq_step, max_q, dlse)
    d_pad = _d_pad(D)
    # the fused kernel's extra dQ tile does not fit in shared memory beside d256 tiles: split there
    fused = BWD_VARIANT in ("fused", "fused-ptr") and d_pad <= 128
    if fused:  # fp32 accumulator, zeroed: rows in no group (seq_step 2) or no block stay 0
        dqa = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        # _tma_ok's stride check also makes every head's and sequence's row base 16-byte aligned
        dq_tma = BWD_VARIANT == "fused" and _tma_ok(dqa)
        if dq_tma:
            _ensure_allocator()
    else:
        dqa, dq_tma = None, False
        # (start, end) pairs (seq_step 2, grouped attention) need not cover q: the dQ kernel writes only
        # group rows, so rows in no group must start at 0
        dq = (torch.zeros if seq_step == 2 else torch.empty)(q.shape, device=q.device, dtype=q.dtype)  # as the fakes
    qdo_tma = BWD_QDO == "tma" and not fused and _tma_ok(q, do)
    if qdo_tma:
        _ensure_allocator()
    dk_dtype, dv_dtype = dkv_dtype or k.dtype, dkv_dtype or v.dtype
    if dk_rows is None:
        dk = torch.empty(k.shape, device=k.device, dtype=dk_dtype)  # contiguous, as the op's fake says
        dv = torch.empty(v.shape, device=v.device, dtype=dv_dtype)
        cu_dk = cu_k
    else:  # fp32 scratch: each group's partial dK/dV is summed before any rounding to k's dtype
        dk = k.new_empty(dk_rows.numel(), *k.shape[1:], dtype=torch.float32)
        dv = v.new_empty(dk_rows.numel(), *v.shape[1:], dtype=torch.float32)
    common = dict(HEAD_DIM=D, D_PAD=d_pad, BLOCK_Q=block_q, BLOCK_K=block_k, N_TERMS=n_terms, IS_VARLEN=varlen)
    heads_inside = BWD_DKDV_HEADS == "inside" or (BWD_DKDV_HEADS == "auto" and H > hkv)
    deep = deep_index_loads(fused, d_pad, n_terms, varlen)
    # the wave order where bwd_wave asks for it (the shallow per-iteration index loads do not rotate,
    # packed inputs keep grid order; for GQA the dK/dV kernel's wave spans its heads only with the
    # head loop inside the phases)
    wave_ok = (BWD_IDX_CHUNK > 0 or deep) and not varlen
    dkdv_order, dq_order = bwd_wave(q.device, d_pad, q.element_size(), Lq, Lk)
    kern = _tuned(kernels.bwd_dkdv_kernel, "dkdv-fused" if fused else "dkdv", block_q, block_k, d_pad,
                  _KEY + ("FUSED_DQ", "DQ_TMA", "QDO_TMA", "HEADS_INSIDE", "CONTIGUOUS", "WAVE", "DELTA_ACC",
                           "IDX_DEEP", "TERMS_TMA", "TILE_ORDER"),
                  variant=f"dq-{'tma' if dq_tma else 'ptr'}/qdo-{qdo_tma}/{BWD_DKDV_ORDER}",
                  reset_to_zero=("DQA",) if fused else ())
    fork = None if fused else _fork(q)  # the dQ kernel needs only delta: it may start beside dK/dV
    dkdv_contiguous = t_contiguous and BWD_CONTIGUOUS
    dkdv_wave = wave_ok and dkdv_order and not t_contiguous and (heads_inside or H == hkv)
    dkdv_deep = deep and not dkdv_contiguous
    delta_acc = BWD_DKDV_DELTA_ACC == "1" or (BWD_DKDV_DELTA_ACC == "auto" and d_pad == 128 and not fused and (
        dkdv_deep or (not dkdv_wave and (heads_inside or dkdv_contiguous))))
    masked_one_stage = BWD_DKDV_MASKED == "one-stage" or (
        BWD_DKDV_MASKED == "auto" and (n_terms > 0 or heads_inside))
    kv_rows, kv_split = grid_rows(B, hkv)
    ordered = longest_walks_first(not dkdv_contiguous, varlen, fused, H, hkv)
    order, o_b, o_h = cached_tile_order(t_counts, hkv) if ordered else (None, 0, 0)
    if ordered:  # whole layout blocks of key tiles; the tiles past Lk return at once
        grid = lambda meta: (_cdiv(Lk, block_k) * (block_k // meta["BLOCK_N"]), *kv_rows)  # noqa: E731
    else:
        grid = lambda meta: (_cdiv(Lk, meta["BLOCK_N"]), *kv_rows)  # noqa: E731
    kern[grid](
        q, k, v, do, lse2, delta, dk, dv, dqa, t_counts, t_n_full, t_indices, t_mask_ids, terms, cu_q, cu_k, cu_dk,
        l_starts, order,
        sm_scale, *_qkv_strides(q, varlen), *_qkv_strides(k, varlen), *_qkv_strides(v, varlen),
        *_qkv_strides(do, varlen), *l_strides, *_qkv_strides(dk, varlen), *_qkv_strides(dv, varlen),
        *(_qkv_strides(dqa, varlen) if fused else (0, 0, 0)), *_layout_strides(t_counts, t_indices), o_b, o_h,
        hkv, H // hkv, Lq, Lk, seq_step, _tune_class(Lq, Lk), _sm_count(q.device), FUSED_DQ=fused, DQ_TMA=dq_tma,
        QDO_TMA=qdo_tma, IDX_CHUNK=0 if dkdv_deep else BWD_IDX_CHUNK, DP_FIRST=BWD_DKDV_ORDER == "dp-first",
        HEADS_INSIDE=heads_inside, CONTIGUOUS=dkdv_contiguous, WAVE=dkdv_wave, DELTA_ACC=delta_acc,
        IDX_DEEP=dkdv_deep, SPLIT_GRID=kv_split, MASKED_ONE_STAGE=masked_one_stage,
        TERMS_TMA=terms_by_tma(qdo_tma), TILE_ORDER=ordered, **common)
    if fused:
        dq = dqa.to(q.dtype)
    else:
        kv_tma = BWD_DQ_KV == "tma" and _tma_ok(k, v)
        if kv_tma:
            _ensure_allocator()
        kern = _tuned(kernels.bwd_dq_kernel, "dq", block_q, block_k, d_pad,
                      _KEY + ("KV_TMA", "CONTIGUOUS", "WAVE", "IDX_DEEP"), variant=f"kv-{kv_tma}")
        grid = lambda meta: (_cdiv(Lq, meta["BLOCK_M"]), *rows)  # noqa: E731
        dq_contiguous = contiguous and BWD_CONTIGUOUS
        dq_deep = deep and not dq_contiguous
        with _side_stream(fork, q, k, v, do, lse2, delta, dq, counts, n_full, indices, mask_ids, terms, cu_q, cu_k,
                          l_starts):
            kern[grid](
                q, k, v, do, lse2, delta, dq, counts, n_full, indices, mask_ids, terms, cu_q, cu_k, l_starts, sm_scale,
                *_qkv_strides(q, varlen), *_qkv_strides(k, varlen), *_qkv_strides(v, varlen),
                *_qkv_strides(do, varlen), *l_strides, *_qkv_strides(dq, varlen), *_layout_strides(counts, indices),
                H, H // hkv, Lq, Lk, seq_step, _tune_class(Lq, Lk), _sm_count(q.device),
                IDX_CHUNK=0 if dq_deep else BWD_IDX_CHUNK, KV_TMA=kv_tma, CONTIGUOUS=dq_contiguous,
                WAVE=wave_ok and dq_order and not contiguous, IDX_DEEP=dq_deep, SPLIT_GRID=split,
                REVERSE=_reverse_rows("dq"), **common)
    if dk_rows is not None:
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32).index_add_(0, dk_rows, dk).to(dk_dtype)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32).index_add_(0, dk_rows, dv).to(dv_dtype)
    return dq, dk, dv
