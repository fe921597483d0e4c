"""The GPU autotune spaces (launch.fwd_configs / bwd_configs), checked without a GPU.

The autotune key holds only a power-of-two class of the sequence length (launch._tune_class) and
Triton caches its pick on disk, so whatever a first call picks is kept for every later length of its
class, in later processes too. A space may therefore only offer tiles that are never far from the
best across a class (measured on the H100: benchmarks/NOTES.md, results/fwd-tile-probe-*.json,
bwd-configs-h100.json)."""
from __future__ import annotations

import inspect

import pytest
import triton

from sparse_attn.ops.block_sparse import kernels, launch


@pytest.fixture
def gpu_spaces(monkeypatch):
    """The spaces as on a GPU (the interpreter has a one-config space of its own)."""
    monkeypatch.setattr(launch, "INTERPRET", False)


def _tiles(configs):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["NUM_STAGES"]) for c in configs]


def test_bf16_forward_offers_only_128_row_tiles_at_d128(gpu_spaces):
    # one-warpgroup 64-row tiles are 1.2-1.4x slower for bf16 at 16K-32K (fwd-tile-probe-*.json)
    tiles = _tiles(launch.fwd_configs(128, 128, 128, "tma"))
    assert tiles and all(m == 128 and w == 8 for m, _, w, _ in tiles)


@pytest.mark.parametrize("tune_class, expect", [(14, "all"), (15, "pinned"), (17, "pinned")])
def test_long_bf16_forward_is_pinned_to_the_measured_best_tile(gpu_spaces, tune_class, expect):
    # fwd-config-probe-h100.json: 128x128 at 3 stages best at 32K and 128K; autotuning there lost 2-7%
    space = launch.fwd_configs(128, 128, 128, "tma")
    kept = launch._prune_long_fwd(space, {"TUNE_CLASS": tune_class})
    if expect == "all":
        assert kept == space and len(space) > 1
    else:
        assert _tiles(kept) == [(128, 128, 8, 3)]


def test_long_forward_prune_keeps_spaces_without_the_pinned_tile(gpu_spaces):
    space = launch.fwd_configs(64, 64, 128, "tma")  # 64-token layout blocks: no 128x128 tile fits
    assert launch._prune_long_fwd(space, {"TUNE_CLASS": 17}) == space


@pytest.mark.parametrize("tune_class, quant, expect", [(14, 2, None), (15, 2, (64, 128, 4, 3)),
                                                       (17, 2, (64, 128, 4, 3)), (17, 1, None)])
def test_long_int8_fp8_forward_is_pinned_to_the_measured_best_tile(gpu_spaces, tune_class, quant, expect):
    # sage-long-configs-h100.json: 64x128 on 4 warps at 3 stages best for int8-fp8 in six cases at 32K-128K;
    # int8 (bf16 P.V) has no config best everywhere, so it keeps its whole space. QUANT comes as a keyword.
    space = launch.fwd_configs(128, 128, 128, "tma", eight_bit=True)
    kept = launch._prune_long_fwd(space, {"TUNE_CLASS": tune_class}, QUANT=quant)
    if expect is None:
        assert kept == space and len(space) > 1
    else:
        assert _tiles(kept) == [expect]


@pytest.mark.parametrize("d_pad, eight_bit, pruned", [(128, False, True), (128, True, True), (64, False, False)])
def test_only_d128_forward_autotuners_get_the_long_prune(gpu_spaces, monkeypatch, d_pad, eight_bit, pruned):
    monkeypatch.setattr(launch, "_TUNED", {})
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    tuned = launch._tuned(kernels.fwd_kernel, "fwd", 128, 128, d_pad, launch._KEY, "tma", eight_bit=eight_bit)
    assert isinstance(tuned, launch._Picked)
    tuned = tuned.autotuner
    assert isinstance(tuned, triton.runtime.autotuner.Autotuner)
    assert (getattr(tuned, "early_config_prune", None) is launch._prune_long_fwd) == pruned


def test_eight_bit_forward_space_leads_with_one_warpgroup_tiles(gpu_spaces):
    configs = launch.fwd_configs(128, 128, 128, "tma", eight_bit=True)
    assert _tiles(configs)[0] == (64, 128, 4, 3)
    assert all(c.kwargs["USE_TMA"] for c in configs)
    # with autotuning off the 8-bit forward takes the measured best, not the bf16 rule's largest tile
    assert _tiles([launch.default_config(configs, "fwd", 128, eight_bit=True)]) == [(64, 128, 4, 3)]
    assert launch.default_config(launch.fwd_configs(128, 128, 128, "tma"), "fwd", 128).kwargs["BLOCK_M"] == 128


@pytest.mark.parametrize("block_q,block_k,d_pad", [(32, 128, 128), (128, 64, 128), (128, 128, 256)])
def test_eight_bit_space_falls_back_where_its_tiles_do_not_fit(gpu_spaces, block_q, block_k, d_pad):
    eight = launch.fwd_configs(block_q, block_k, d_pad, "tma", eight_bit=True)
    assert _tiles(eight) == _tiles(launch.fwd_configs(block_q, block_k, d_pad, "tma"))
    for m, n, _, _ in _tiles(eight):
        assert block_q % m == 0 and block_k % n == 0


def test_backward_spaces_offer_small_tiles_only_where_no_large_one_fits(gpu_spaces):
    for kind in ("dkdv", "dkdv-fused", "dq"):
        assert all(m * n >= 64 * 128 for m, n, _, _ in _tiles(launch.bwd_configs(128, 128, 128, kind))), kind
    assert _tiles(launch.bwd_configs(64, 64, 128, "dkdv"))[0][:2] == (64, 64)


def test_backward_spaces_hold_the_measured_best_large_tile(gpu_spaces, monkeypatch):
    # one config each (no autotune pick that a first small call could fix for good); with register
    # indices the third stage pays (bwd-flex-sweep-h100.json), with shallow per-iteration index loads
    # it did not; the deep ones (launch.BWD_IDX_DEEP) take the 3-stage tiles (2 * 3 - 1 pipeliner stages)
    monkeypatch.setattr(launch, "BWD_IDX_CHUNK", 64)
    assert _tiles(launch.bwd_configs(128, 128, 128, "dkdv")) == [(64, 128, 8, 3)]
    assert _tiles(launch.bwd_configs(128, 128, 128, "dkdv-fused")) == [(64, 128, 8, 3)]
    assert _tiles(launch.bwd_configs(128, 128, 128, "dq")) == [(128, 64, 8, 3)]
    assert _tiles(launch.bwd_configs(128, 64, 128, "dkdv")) == [(128, 64, 8, 2)]  # 64-key blocks
    monkeypatch.setattr(launch, "BWD_IDX_CHUNK", 0)
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "0")
    assert _tiles(launch.bwd_configs(128, 128, 128, "dkdv")) == [(64, 128, 8, 2)]
    assert _tiles(launch.bwd_configs(128, 128, 128, "dq")) == [(128, 128, 8, 2)]
    monkeypatch.setattr(launch, "BWD_IDX_DEEP", "auto")
    assert _tiles(launch.bwd_configs(128, 128, 128, "dkdv")) == [(64, 128, 8, 3)]
    assert _tiles(launch.bwd_configs(128, 128, 128, "dq")) == [(128, 64, 8, 3)]
    assert _tiles(launch.bwd_configs(128, 128, 128, "dkdv-fused")) == [(64, 128, 8, 2)]  # never deep


def test_bad_index_chunk_is_a_clear_error():
    from sparse_attn.testing import launch_import_stderr
    assert "SPARSE_ATTN_BWD_IDX_CHUNK must be 0 or a power of two, got 48" in launch_import_stderr(
        "SPARSE_ATTN_BWD_IDX_CHUNK", "48")


def test_eight_bit_space_keeps_only_tiles_dividing_the_layout_blocks(gpu_spaces):
    # 64-row query blocks: the 64-row tiles stay, the 128-row one goes (a tile must divide its block)
    assert _tiles(launch.fwd_configs(64, 128, 128, "tma", eight_bit=True)) == [(64, 128, 4, 3), (64, 128, 4, 2)]


def test_autotune_picks_lists_tuned_families_only(monkeypatch):
    """Benchmark headers record the autotuner's choices; kernels with one fixed config have none."""
    class Tuned:
        cache = {(128, "torch.bfloat16"): "BLOCK_M: 128, BLOCK_N: 128"}

    fwd, bwd = ("fwd", 128, 128, 128, "tma", False), ("dkdv", 128, 128, 128, "ptr", False)
    fixed = ("dq", 128, 128, 128, "ptr", False)
    monkeypatch.setattr(launch, "_TUNED", {fwd: Tuned(), bwd: Tuned(),
                                           fixed: launch._Fixed(None, launch.bwd_configs(128, 128, 128, "dq")[0])})
    picks = launch.autotune_picks()
    assert set(picks) == {str(fwd), str(bwd)}
    assert picks[str(fwd)] == {"(128, 'torch.bfloat16')": "BLOCK_M: 128, BLOCK_N: 128"}
    assert set(launch.autotune_picks("fwd")) == {str(fwd)}


@pytest.mark.parametrize("lq, lk, cls", [(1, 1, 1), (2, 2, 1), (3, 1, 2), (8192, 8192, 13), (8193, 100, 14),
                                         (100, 16384, 14), (16385, 16384, 15), (131072, 4096, 17)])
def test_tune_class_is_the_power_of_two_above_the_longer_length(lq, lk, cls):
    assert launch._tune_class(lq, lk) == cls


@pytest.mark.parametrize("kernel", [kernels.fwd_kernel, kernels.bwd_dkdv_kernel, kernels.bwd_dq_kernel])
def test_launched_kernels_key_their_autotuning_on_the_length_class_without_recompiling(kernel):
    """TUNE_CLASS is a kernel argument (Triton's autotuner keys on arguments only) in the shared key,
    and unspecialized: a class value divisible by 16 must not compile another kernel."""
    assert "TUNE_CLASS" in launch._KEY and "TUNE_CLASS" in kernel.arg_names
    # the interpreter's wrapper drops the decorator's arguments: read them from the source
    decorator = inspect.getsource(getattr(kernel, "fn", kernel)).splitlines()[0]
    assert decorator.startswith("@triton.jit(do_not_specialize=[") and '"TUNE_CLASS"' in decorator


class _StubAutotuner:
    """What launch._Picked uses of triton's Autotuner: arg_names, cache, best_config, fn[grid] and
    self[grid]. Each tuning picks the next of ``configs`` (so a re-tune is visible in the pick)."""

    def __init__(self, configs):
        self.arg_names = ["X", "N", "TUNE_CLASS", "HEAD_DIM"]
        self.cache, self.configs, self.calls = {}, list(configs), []
        outer = self

        class _Fn:
            def __getitem__(self, grid):
                return lambda *a, **kw: outer.calls.append(("direct", grid, a, kw))
        self.fn = _Fn()

    def __getitem__(self, grid):
        def run(*a, **kw):
            self.best_config = self.configs.pop(0)
            self.cache[len(self.cache)] = self.best_config
            self.calls.append(("tuned", grid, a, kw))
        return run


def test_picked_configs_skip_the_autotuner_only_for_a_key_it_has_seen():
    """launch._Picked keys on the key arguments and every tensor's dtype, as Triton's autotuner does: a
    new key value or dtype goes through the autotuner (which tunes), anything else launches the pick
    directly with its constexprs and launch options."""
    import torch
    first = triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3)
    second = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2)
    third = triton.Config({"BLOCK_M": 32}, num_warps=4, num_stages=1)
    stub = _StubAutotuner([first, second, third])
    picked = launch._Picked(stub, ("TUNE_CLASS", "HEAD_DIM"))
    x16, x32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    picked[(1,)](x16, 10, 14, HEAD_DIM=128)
    picked[(2,)](x16, 99, 14, HEAD_DIM=128)  # N is no key argument: the pick, launched directly
    assert [c[0] for c in stub.calls] == ["tuned", "direct"]
    assert stub.calls[1][1:] == ((2,), (x16, 99, 14), {"HEAD_DIM": 128, **first.all_kwargs()})
    picked[(1,)](x16, 10, 15, HEAD_DIM=128)  # another length class
    picked[(1,)](x32, 10, 14, HEAD_DIM=128)  # another dtype
    assert [c[0] for c in stub.calls] == ["tuned", "direct", "tuned", "tuned"]
    picked[(1,)](x32, 10, 14, HEAD_DIM=128)
    assert stub.calls[-1][0] == "direct" and stub.calls[-1][3]["BLOCK_M"] == 32
    assert picked.cache is stub.cache


def test_picked_configs_with_a_pre_hook_always_go_through_the_autotuner():
    import torch
    hooked = triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3, pre_hook=lambda nargs: None)
    stub = _StubAutotuner([hooked, hooked])
    picked = launch._Picked(stub, ("TUNE_CLASS",))
    x = torch.zeros(2)
    picked[(1,)](x, 1, 14)
    picked[(1,)](x, 1, 14)
    assert [c[0] for c in stub.calls] == ["tuned", "tuned"]


def test_picked_refuses_to_tune_inside_cuda_graph_capture(monkeypatch):
    """A key the autotuner has not seen would be tuned (kernels timed, device synchronized) inside the
    capture: a named error instead of CUDA's. Once seen, the key launches inside a capture, the pick
    directly or, for a config the picks cannot keep (pre_hook), through the autotuner's own cache."""
    import torch
    state = {"capturing": True}
    monkeypatch.setattr(launch, "capturing", lambda t: isinstance(t, torch.Tensor) and state["capturing"])
    plain = triton.Config({"BLOCK_M": 128}, num_warps=8, num_stages=3)
    hooked = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=2, pre_hook=lambda nargs: None)
    stub = _StubAutotuner([plain, hooked, hooked])
    picked = launch._Picked(stub, ("TUNE_CLASS",))
    x = torch.zeros(2)
    with pytest.raises(RuntimeError, match="captured in a CUDA graph before it ran at these sizes.*eagerly"):
        picked[(1,)](x, 1, 14)
    assert stub.calls == []
    state["capturing"] = False
    picked[(1,)](x, 1, 14)   # eager warm-up: tunes
    picked[(1,)](x, 1, 15)   # another key, tuned to the hooked config
    state["capturing"] = True
    picked[(1,)](x, 1, 14)
    picked[(1,)](x, 1, 15)
    assert [c[0] for c in stub.calls] == ["tuned", "tuned", "direct", "tuned"]
