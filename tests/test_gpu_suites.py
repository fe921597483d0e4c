"""benchmarks/gpu_suites.sh is how the GPU tests run on the lent device, shard by shard: a GPU test file that no
shard names never runs there, however many cases it holds."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run apart: needs two or more GPUs (the -x2 and larger kinds), started by hand as its docstring says
MULTI_GPU = {"tests/gpu/test_parallel_nccl.py"}


def test_every_gpu_test_file_is_in_a_shard():
    script = (ROOT / "benchmarks" / "gpu_suites.sh").read_text()
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert files, "no GPU test files found"
    missing = sorted(f for f in files - MULTI_GPU if f not in script)
    assert not missing, f"GPU test files no shard of benchmarks/gpu_suites.sh runs: {missing}"
    assert MULTI_GPU <= files, "a multi-GPU file named here no longer exists"
