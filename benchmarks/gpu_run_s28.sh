# The twenty-eighth session's GPU runs (H100): first call (suites + spot checks), second call (dLSE cost,
# backward-touching suites, random cases). Usage: bash benchmarks/gpu_run_s28.sh [1|2]
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
pip install -q --no-deps .whl/sageattention-1.0.6-py3-none-any.whl 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-1}" = 1 ]; then
  timeout 480 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_fuzz_gpu.py \
    tests/gpu/test_sage_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_backward_variants_gpu.py \
    tests/gpu/test_grouped_gpu.py 2>&1 | tail -15 | tee $OUT/gpu-suites.txt
elif [ "$1" = 3 ]; then  # the backward suites again, with time to finish (call 2 cut them at 300 s)
  timeout 540 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_backward_variants_gpu.py tests/gpu/test_grouped_gpu.py tests/gpu/test_tools_gpu.py 2>&1 \
    | tail -4 | tee $OUT/gpu-suites-3.txt
else
  python benchmarks/dlse_cost_probe.py --out $OUT/dlse-cost-h100.json
  timeout 300 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_backward_variants_gpu.py tests/gpu/test_grouped_gpu.py tests/gpu/test_tools_gpu.py 2>&1 \
    | tail -4 | tee $OUT/gpu-suites-2.txt
  for i in 0 1 2 3 4 5; do
    python benchmarks/fuzz_more.py --start $((46000 + i * 1000)) --budget-s 120 > $OUT/fuzz-$i.txt 2>&1 &
  done
  wait
  tail -n 2 $OUT/fuzz-*.txt
fi
