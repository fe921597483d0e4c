#!/usr/bin/env bash
# The long-context report suite (report-gpu) on a GPU whose single command is time-limited, in slices.
#   bash benchmarks/report_run.sh plan [N]        the slices: rows and estimated H100 seconds (runs nothing)
#   bash benchmarks/report_run.sh 1/3 [2/3 ...]   run these slices (3 slices: ~5-6.5 min each on an H100)
# Each slice goes through benchmarks/device_run.sh (the Triton cache restored from .tcache/tcache.tgz and
# saved to $OUT/tcache.tgz) and writes $OUT/report-gpu-K-of-N[-HHMMSS].{json,csv,log}. Rows already in
# benchmarks/results/report-h100/slices/ are skipped, so running a slice that was cut off again finishes it.
# Then, on any machine:
#   cp $OUT/report-gpu-*.json benchmarks/results/report-h100/slices/ && python benchmarks/merge_results.py report
set -eu
cd "$(dirname "$0")/.."
export OUT=${OUT:-out/report-run}
mkdir -p "$OUT"
DONE=benchmarks/results/report-h100/slices
if [ "${1:-}" = plan ]; then
  PYTHONPATH=$PWD/src exec python3 -m sparse_attn.cli.main bench --suite report-gpu --plan ${2:-}
fi
[ $# -ge 1 ] || { echo "usage: bash benchmarks/report_run.sh plan [N] | K/N [K/N ...]" >&2; exit 2; }
args=()
for s in "$@"; do
  case $s in */*) ;; *) echo "a slice is K/N, e.g. 2/3; got '$s'" >&2; exit 2 ;; esac
  name="report-gpu-${s/\//-of-}"
  [ -e "$DONE/$name.json" ] && name="$name-$(date +%H%M%S)"  # a re-run: keep the earlier file's rows
  args+=("$name" "--suite report-gpu --slice $s --skip-done $DONE")
done
exec bash benchmarks/device_run.sh "${args[@]}"
