#!/usr/bin/env bash
# One device call: restore the Triton cache carried from the last call (compiles + autotune results),
# run the given `sparse-attn bench` slices, save the cache back under $OUT.
#   bash benchmarks/device_run.sh NAME "bench args" [NAME "bench args" ...]
set -u
set -f  # bench args hold pattern globs
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/tcache.tgz ] && tar xzf .tcache/tcache.tgz -C "$TRITON_CACHE_DIR"
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  python3 -m sparse_attn.cli.main bench --device cuda --out-dir "$OUT" --name "$name" $args 2>&1 | grep -v -i warn | tee "$OUT/$name.log" | tail -60
done
tar czf "$OUT/tcache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
ls -la "$OUT"
