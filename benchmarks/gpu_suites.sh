#!/usr/bin/env bash
# The GPU test suites in shards that each finish inside one device call (the six suites together took
# 520 s on 8 workers of an H100, too close to the 600 s a call may run), and extra fuzz seeds.
#   bash benchmarks/gpu_suites.sh a          # kernels + fuzz suites, and the gpu-marked tests beside CPU ones
#   bash benchmarks/gpu_suites.sh b          # 8-bit, integration, grouped, CUDA graphs, tools, backward variants
#   bash benchmarks/gpu_suites.sh c          # transformers on the GPU (padding, in place, compiled decoding)
#   bash benchmarks/gpu_suites.sh multi      # two or more GPUs (the -x2 kind): inputs on a GPU that is not current
#   bash benchmarks/gpu_suites.sh fuzz START # six fuzz_more.py workers from seed START (+1000 each), 100 s
# Carry .whl (sageattention's wheel, for shard b). Summaries land in $OUT (default out/gpu).
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
ls .whl/sageattention-*.whl >/dev/null 2>&1 && pip install -q --no-deps .whl/sageattention-*.whl 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
suites() {  # $1: shard name, rest: test files
  local name=$1; shift
  timeout 560 python -m pytest -q -n 8 -p no:cacheprovider "$@" > "$OUT/gpu-suites-$name.log" 2>&1
  # the summary, and each failure's first error lines (a whole log is too long to read back in a reply)
  tail -4 "$OUT/gpu-suites-$name.log" | tee "$OUT/gpu-suites-$name.txt"
  grep -E "^(E  |_{5,} )" "$OUT/gpu-suites-$name.log" | cut -c1-240 | head -60
}
case "${1:-a}" in
  a) suites a tests/gpu/test_kernels_gpu.py tests/gpu/test_fuzz_gpu.py tests/gpu/test_kv_split_gpu.py \
       tests/gpu/test_device_plan_gpu.py \
       tests/gpu/test_host_path_gpu.py tests/gpu/test_replay_gpu.py
     # the GPU cases that live beside their CPU tests (meansim's kernels vs CPU, bench, integration)
     suites a-beside -m gpu tests/test_accuracy_cli.py tests/test_bench.py tests/test_predict.py \
       tests/test_predict_pack.py
     # the transformers tests whole, against the machine's transformers (5.17 there, CI's newest here: the
     # two differed on T5's configs and static caches, which only these CPU tests saw; 75 s)
     suites a-transformers tests/test_transformers_integration.py tests/test_transformers_padding.py \
       tests/test_eval_model.py ;;
  b) suites b tests/gpu/test_sage_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_grouped_gpu.py \
       tests/gpu/test_cuda_graphs_gpu.py \
       tests/gpu/test_tools_gpu.py tests/gpu/test_backward_variants_gpu.py ;;
  # transformers on the GPU: padded / packed batches, read in place, compiled static-cache decoding (the three
  # files took 154 s on 4 workers of an H200, compiles included)
  c) suites c tests/gpu/test_transformers_padding_gpu.py tests/gpu/test_padded_in_place_gpu.py \
       tests/gpu/test_traced_integration_gpu.py ;;
  # skipped on one GPU (test_multi_gpu.py's skipif): run it on nvidia-h200-x2 or larger
  multi) suites multi tests/gpu/test_multi_gpu.py ;;
  fuzz)
    start=${2:?a first seed, e.g. 58000}
    for i in 0 1 2 3 4 5; do
      python benchmarks/fuzz_more.py --start $((start + i * 1000)) --budget-s 100 > "$OUT/fuzz-$i.txt" 2>&1 &
    done
    wait
    tail -n 2 "$OUT"/fuzz-*.txt ;;
  *) echo "usage: bash benchmarks/gpu_suites.sh a|b|c|multi|fuzz START" >&2; exit 2 ;;
esac
