# Nsight Compute on the Gluon backward (benchmarks/gluon_bwd.py) beside our split kernels, dense 8K:
# tensor-pipe busy share and the top stall reasons per kernel (NOTES.md backward 27). On the device:
#     bash benchmarks/gluon_bwd_ncu.sh      # writes $OUT/gluon-ncu.ncu-rep and $OUT/gluon-ncu-raw.csv
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 400 $NCU --clock-control none --profile-from-start off --kernel-name regex:"bwd_dkdv|bwd_dq_|fused_bwd" \
  --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -o $OUT/gluon-ncu \
  python3 benchmarks/gluon_bwd_probe.py --checks --cases dense:8192 --profile split-regs gluon-C gluon-C-store gluon-A-skip 2>&1 | grep -v Warning | tail -5
$NCU --import $OUT/gluon-ncu.ncu-rep --page raw --csv > $OUT/gluon-ncu-raw.csv
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/gluon-ncu-raw.csv")))
head, data = rows[0], rows[2:]  # rows[1]: units
keys = [c for c in head if c.startswith("smsp__average_warps_issue_stalled_") and c.endswith("_per_issue_active.ratio")]
for r in data:
    d = dict(zip(head, r))
    print(d.get("Kernel Name")[:30], d.get("gpu__time_duration.sum"), "ms, tensor pipe busy %",
          d.get("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"))
    st = sorted(((float(d[k] or 0), k.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", ""))
                for k in keys), reverse=True)[:8]
    print("   ", ", ".join(f"{n} {v:.2f}" for v, n in st))
PY
