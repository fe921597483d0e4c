#!/usr/bin/env bash
# A/B of the element masks as intervals (kernels._allowed): mask_cost_probe.py under the previous source
# tree (ab_old/src: `git archive <commit> src | tar -x -C ab_old`) and this one, alternating; "new-arith"
# was this tree with SPARSE_ATTN_BWD_CONTIGUOUS_MASKED=1, the switch the experiment had (its arithmetic
# dK/dV walk with masks is now the default and the switch is gone). One device call.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache; mkdir -p /tmp/tcache; tar xzf .tcache/tcache.tgz -C /tmp/tcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2; do for tree in old new new-arith; do
  src=$([ $tree = old ] && echo ab_old/src || echo src)
  SPARSE_ATTN_BWD_CONTIGUOUS_MASKED=$([ $tree = new-arith ] && echo 1 || echo 0) PYTHONPATH=$PWD/$src \
  python3 benchmarks/mask_cost_probe.py --cases causal streaming local --rounds 7 --out $OUT/mask-ab-$tree-$r.json 2>&1 \
    | grep -v -i warn | python3 -c "
import sys, json
for line in sys.stdin:
    try: d = json.loads(line)
    except Exception: print(line.rstrip()); continue
    m = d['median_ms']; print('$tree', '$r', d['case'], d['variant'], {k[:12]: round(v, 3) for k, v in m.items()})"
done; done
