#!/usr/bin/env bash
# Host time a call, this tree against another (host_overhead_probe.py), alternated in one device call:
#   OLD=path/to/old/src bash benchmarks/host_ab.sh [ROUNDS]     # JSON and the rows under $OUT/host-ab
set -u
OUT=${OUT:-out}/host-ab
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
CASES="decode decode-growing decode-local prefill-1k prefill-1k-grad varlen-decode varlen-decode-growing varlen-decode-host-offsets varlen-decode-growing-host-offsets decode-no-launch"
for r in $(seq 1 "${1:-2}"); do
  PYTHONPATH=$OLD python benchmarks/host_overhead_probe.py --out "$OUT/old$r.json" --cases $CASES 2>&1 \
    | grep case | sed 's/^/old /'
  PYTHONPATH=$PWD/src python benchmarks/host_overhead_probe.py --out "$OUT/new$r.json" --cases $CASES sdpa-decode \
    sdpa-prefill-1k launch-empty launch-empty-1-arg 2>&1 | grep case | sed 's/^/new /'
done
