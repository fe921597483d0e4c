#!/usr/bin/env bash
# A/B of the reversed query-tile order (launch.ROW_ORDER): launch_setting_probe.py under the previous source
# tree (ab_old/src: `git archive <commit> src | tar -x -C ab_old`), this tree in grid order, and this tree
# reversed, alternating, two rounds. "old" against "grid" shows what the edit alone did to the compiled
# kernels; "grid" against "reverse" what the order does. One device call.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache; mkdir -p /tmp/tcache; tar xzf .tcache/tcache.tgz -C /tmp/tcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2; do for tree in old grid reverse; do
  src=$([ $tree = old ] && echo ab_old/src || echo src)
  SPARSE_ATTN_ROW_ORDER=$([ $tree = old ] && echo reverse || echo $tree) PYTHONPATH=$PWD/$src \
  python3 benchmarks/launch_setting_probe.py --rounds 5 --label $tree --out $OUT/row-order-$tree-$r.json 2>&1 \
    | grep -v -i warn | python3 -c "
import sys, json
for line in sys.stdin:
    try: d = json.loads(line)
    except Exception: print(line.rstrip()); continue
    m = d['median_ms']; print('$tree', '$r', d['seq_len'], d['kv_heads'], d['case'], {k[:12]: round(v, 3) for k, v in m.items()})"
done; done
