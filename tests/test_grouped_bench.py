"""benchmarks/grouped_bench.py at tiny size on the CPU (keeps the GPU script from rotting), its zigzag
groups and byte counts, and the grouped providers of the bench registry."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sparse_attn import Group, reference
from sparse_attn.bench import get_provider

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grouped_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grouped_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_zigzag_groups(bench):
    groups, tq = bench.zigzag_groups(64, 2, world=2, rank=0)
    assert tq == 32 and groups == [Group(0, 16, 0, 16), Group(16, 32, 0, 64)]
    groups, tq = bench.zigzag_groups(64, 2, world=2, rank=1)
    assert groups == [Group(0, 16, 0, 32), Group(16, 32, 0, 48)]
    groups, tq = bench.zigzag_groups(64, 4, world=2, rank=0)  # chunks 0, 3, 4, 7 of 8
    assert tq == 32 and [g.k_end for g in groups] == [8, 32, 40, 64]
    # over all ranks every chunk is held exactly once
    held = sorted(g.k_end for r in range(4) for g in bench.zigzag_groups(128, 4, world=4, rank=r)[0])
    assert held == list(range(8, 129, 8))
    assert bench.kv_bytes(groups, hkv=2, d=4, elt=2) == ((8 + 32 + 40 + 64) * 32, 64 * 32)
    with pytest.raises(ValueError, match="even"):
        bench.zigzag_groups(64, 3, world=2, rank=0)


def test_tiny_run_writes_json(bench, tmp_path, one_thread):
    out = tmp_path / "g.json"
    assert bench.main(["--device", "cpu", "--tiny", "--groups", "2", "4", "--modes", "fwd", "fwd+bwd",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("gpu", "torch", "triton", "date", "rows"):
        assert key in data
    assert len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["ms_grouped"] > 0 and row["ms_loop"] > 0 and row["speedup"] > 0
        assert row["kv_bytes_loop"] > row["kv_bytes_grouped"] > 0 and row["max_abs_diff"] < 1e-5
        assert row["flops"] > 0 and sum(row["q_lens"]) == row["q_tokens"]
        saved = row["kv_bytes_loop"] - row["kv_bytes_grouped"]
        assert row["kv_mb_saved"] == saved / 2**20 and row["kv_saved_pct"] == 100 * saved / row["kv_bytes_loop"]
    lines = out.with_suffix(".csv").read_text().strip().splitlines()  # the seed's CSV export
    assert len(lines) == 5 and "kv_saved_pct" in lines[0].split(",") and "ms_grouped" in lines[0].split(",")


@pytest.mark.parametrize("causal,lq", [(True, 256), (False, 256), (True, 100)])
def test_grouped_providers_equal_dense_attention(causal, lq):
    q = torch.randn(1, 4, lq, 16)
    k, v = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    want = reference.attention(q, k, v, causal=causal)
    for name in ("grouped-2", "grouped-loop-2"):
        prov = get_provider(name)
        assert prov.computes == "dense" and prov.available("cpu")[0]
        got = prov.make_run(q, k, v, None, causal, "fwd").fn()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="batch 1"):
        get_provider("grouped-2").make_run(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                           v.expand(2, -1, -1, -1), None, causal, "fwd")
