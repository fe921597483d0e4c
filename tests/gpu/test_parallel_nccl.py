"""Zigzag llama3 context parallelism over NCCL on 2-4 GPUs: benchmarks/cp_run.py's correctness check
(bf16, H=32, Hkv=8, D=128, causal, dense and varlen, forward and backward, every rank against the fp64
oracle with single-device attention's error as the yardstick, DESIGN.md rule 3).

The same by hand (what the lead runs on the lent H200s, with the benchmark):
    torchrun --standalone --nproc_per_node=2 benchmarks/cp_run.py --out cp-h200-w2.json
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")
def test_cp_nccl_matches_single_device(tmp_path):
    world = min(torch.cuda.device_count(), 4)
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "benchmarks" / "cp_run.py"), "--skip-bench", "--check-tokens", "4096", "--timeout", "120",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert data["checks_passed"] and len(data["checks"]) == world * 8
    assert {c["rank"] for c in data["checks"]} == set(range(world))
