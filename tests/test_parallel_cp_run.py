"""benchmarks/cp_run.py with 2 gloo ranks on the CPU (tiny sizes): the GPU benchmark script's
correctness check, timing loop and JSON output stay runnable. The two ranks are started the way
torchrun starts them (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT), without torchrun's
agent, which adds ~10 s of start-up and shut-down."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cp_run_gloo_world2(tmp_path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cp_run.py"), "--backend", "gloo", "--device", "cpu", "--tiny",
           "--tokens-per-gpu", "32", "--kv-head-chunks", "1", "--reps", "1", "--warmup", "0", "--timeout", "60",
           "--out", str(out)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(f"--- rank {r} ---\n{t[-3000:]}" for r, t in enumerate(logs))
    data = json.loads(out.read_text())
    h = data["header"]
    assert h["world_size"] == 2 and h["backend"] == "gloo" and h["gpu"] == "cpu" and h["torch"] and h["date"]
    assert data["checks_passed"] and len(data["checks"]) == 2 * 8  # 2 ranks x (dense, varlen) x (out, dq, dk, dv)
    assert {c["rank"] for c in data["checks"]} == {0, 1} and all(c["ok"] for c in data["checks"])
    rows = data["rows"]
    assert {(r["layout"], r["mode"]) for r in rows} == {(lay, m) for lay in ("dense B=1", "varlen 4 seqs")
                                                         for m in ("fwd", "fwd+bwd")}
    for r in rows:
        assert r["tokens_per_gpu"] == 32 and r["total_tokens"] == 64 and len(r["cp_ms"]) == 2
        assert r["fraction"] > 0 and r["cp_tflops_per_gpu"] > 0 and r["local_tflops_per_gpu"] > 0
