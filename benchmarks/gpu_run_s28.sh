export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
pip install -q --no-deps .whl/sageattention-1.0.6-py3-none-any.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python benchmarks/gpu_checks_s28.py 2>&1 | grep -v Warning | tail -20
timeout 480 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_fuzz_gpu.py tests/gpu/test_sage_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_backward_variants_gpu.py tests/gpu/test_grouped_gpu.py 2>&1 | tail -15 | tee $OUT/gpu-suites.txt
