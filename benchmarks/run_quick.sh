#!/usr/bin/env bash
# tests/gpu, then decode latency with graphs at batch 1 and 32 for both Flash-shaped presets.
# usage: benchmarks/run_quick.sh OUTDIR   (repo root, PYTHONPATH=.)
set -uo pipefail
out=$1; mkdir -p "$out"
python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
for preset in v4-flash-4l v41-flash-8l; do
  [ -d /tmp/$preset ] || python3 -m dsv4.cli make-model --preset $preset --out /tmp/$preset --device cuda > /dev/null
  for B in 1 32; do
    python3 -m dsv4.cli bench latency --model /tmp/$preset --batch-size $B --input-len 512 --output-len 32 \
      --num-iters 2 --output-json "$out/$preset-b$B.json" 2>&1 | grep -E "decode step|fraction of floor"
  done
done
