#!/usr/bin/env bash
# Fresh processes, each timing GQA random 0.5 at 32K (the backward's wave order vs grid order) as its
# first case, alternately with the dQ kernel on its side stream and on the main stream: is the
# occasional first-case slowdown of the wave order (NOTES.md, backward item 21) the side stream's?
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
for i in 1 2 3 4; do
  for mode in side main; do
    if [ $mode = side ]; then only="split-regs split-regs-nowave"; else only="split-regs-1stream split-regs-nowave-1stream"; fi
    python benchmarks/bwd_flex_probe.py --hkv 8 --only $only --cases random0.5:32768 \
      --out "$OUT/wave-stream-$mode-$i.json" 2>&1 | grep '^{' | cut -c1-160
  done
done
