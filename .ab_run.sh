#!/usr/bin/env bash
# session-local: GPU tests touched by the in-place padded path and the offsets cache, then hf_decode_ab before/after
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=$PWD/src timeout 330 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_padded_in_place_gpu.py \
  tests/gpu/test_transformers_padding_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
  tests/gpu/test_grouped_gpu.py tests/gpu/test_fuzz_gpu.py > $OUT/tests.log 2>&1
tail -4 $OUT/tests.log; grep -E "^(E  |_{5,} )" $OUT/tests.log | cut -c1-240 | head -40
cd benchmarks
for i in ${ROUNDS:-1 2}; do
  for tree in before after; do
    src=$PWD/../src; [ $tree = before ] && src=$PWD/../.ab_old/src
    PYTHONPATH=$src timeout 200 python hf_decode_ab.py --out $OUT/hf-decode-padded${TAG:-}-$tree-$i-h200.json \
      --no-profile ${EXTRA:-} > $OUT/ab-$tree-$i.log 2>&1
    echo "== $tree $i"; grep -E "^(sdpa|dense|local|streaming)" $OUT/ab-$tree-$i.log; tail -2 $OUT/ab-$tree-$i.log | grep -i error
  done
done
