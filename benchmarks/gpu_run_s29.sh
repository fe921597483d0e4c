# The twenty-ninth session's GPU run (H100): the memory probe of the rewritten host steps, then the
# GPU suites. Usage: bash benchmarks/gpu_run_s29.sh [1|2|3]
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
pip install -q --no-deps .whl/sageattention-1.0.6-py3-none-any.whl 2>&1 | grep -v WARNING | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${1:-1}" = 1 ]; then
  timeout 150 python benchmarks/memory_probe.py --out $OUT/memory-probe-h100.json 2>&1 | tail -12
  timeout 420 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_fuzz_gpu.py \
    tests/gpu/test_sage_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_grouped_gpu.py \
    tests/gpu/test_tools_gpu.py 2>&1 | tail -15 | tee $OUT/gpu-suites.txt
elif [ "$1" = 3 ]; then  # call 1's suites again without the probe: at 420 s they stopped at 96%
  timeout 570 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_fuzz_gpu.py \
    tests/gpu/test_sage_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_grouped_gpu.py \
    tests/gpu/test_tools_gpu.py 2>&1 | tail -15 | tee $OUT/gpu-suites-3.txt
else
  timeout 150 python benchmarks/memory_probe.py --out $OUT/memory-probe-h100.json 2>&1 | tail -12
  timeout 240 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_backward_variants_gpu.py \
    tests/test_transformers_integration.py tests/test_causal_cut.py tests/test_metrics.py 2>&1 | tail -6 \
    | tee $OUT/gpu-suites-2.txt
  for i in 0 1 2 3 4 5; do
    python benchmarks/fuzz_more.py --start $((52000 + i * 1000)) --budget-s 100 > $OUT/fuzz-$i.txt 2>&1 &
  done
  wait
  tail -n 2 $OUT/fuzz-*.txt
fi
