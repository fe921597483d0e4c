#!/bin/bash
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache $OUT/r
t0=$(date +%s)
timeout 330 python -m pytest -q -n 8 -p no:cacheprovider tests/gpu/test_replay_gpu.py tests/gpu/test_padded_in_place_gpu.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_host_path_gpu.py tests/gpu/test_device_plan_gpu.py tests/gpu/test_integration_gpu.py tests/gpu/test_transformers_padding_gpu.py tests/gpu/test_kv_split_gpu.py > $OUT/r/gpu-tests.log 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 ))s" >> $OUT/r/times.txt
t0=$(date +%s)
timeout 120 python benchmarks/new_length_probe.py --out $OUT/r/new-length-probe-after.json --providers sparse_attn,sparse_attn-noreplay,sdpa-flash,sdpa-default > $OUT/r/new-length-probe-after.log 2>&1
echo "probe rc=$? $(( $(date +%s)-t0 ))s" >> $OUT/r/times.txt
t0=$(date +%s)
timeout 120 python benchmarks/hf_step_split_probe.py --out $OUT/r/step-split-one-16-new-after.json --prompts one --layers 16 --new-lengths > $OUT/r/step-split-one-16-new-after.log 2>&1
echo "split rc=$? $(( $(date +%s)-t0 ))s" >> $OUT/r/times.txt
cat $OUT/r/times.txt; tail -15 $OUT/r/gpu-tests.log; grep -v Warning $OUT/r/new-length-probe-after.log | grep "new"; grep "generate\|layer 0 us\|layer 1 us\|layer 2 us\|attention us" $OUT/r/step-split-one-16-new-after.log
