# Nsight Compute beside benchmarks/power_probe.py: SM clock, L2 hit rate, DRAM traffic and tensor-pipe
# busy share of one forward per provider, for cases whose clocks the probe found apart. On the device:
#     bash benchmarks/power_ncu.sh [CASES]   # writes $OUT/power-ncu-raw.csv and prints one line a kernel
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
CASES=${1:-dense:32768:fwd:sparse_attn+flex,dense:131072:fwd:sparse_attn+sparse_attn-indexed+flex}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
METRICS=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum
timeout 500 $NCU --clock-control none --profile-from-start off --kernel-name regex:"fwd_kernel|triton_tem" \
  --metrics $METRICS --csv --page raw python3 benchmarks/power_probe.py --profile --cases "$CASES" --out /dev/null \
  2>/dev/null | grep -v -i warn > $OUT/power-ncu-raw.csv
python3 - <<'PY'
import csv, io, os
text = open(os.environ["OUT"] + "/power-ncu-raw.csv").read()
rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
head, data = rows[0], rows[2:]  # rows[1]: units
for r in data:
    d = dict(zip(head, r))
    print(f"{d['Kernel Name'][:28]:28s} {d['gpu__time_duration.sum']:>12s} ns  {d['sm__cycles_elapsed.avg.per_second']:>8s} cyc/s"
          f"  L2 hit {d['lts__t_sector_hit_rate.pct']:>6s}%  DRAM rd {d['dram__bytes_read.sum']:>10s} wr {d['dram__bytes_write.sum']:>10s}"
          f"  L2 bytes {d['lts__t_bytes.sum']:>10s}  tensor {d['sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active']:>6s}%")
PY
