#!/usr/bin/env bash
# One device call's worth (about 8 minutes on an H200): tests/gpu, decode latency with graphs at batch 1 and 32 for
# both Flash-shaped presets (one graph size, the batch's), the kernel table of a V4.1 batch-1 graph step, and the
# vision-encoder benchmark. Each part has its own time limit so a slow one cannot eat the rest.
# usage: benchmarks/run_quick.sh OUTDIR [--compile-decode]   (repo root, PYTHONPATH=.)
set -uo pipefail
out=$1; shift; mkdir -p "$out"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1; tail -1 "$out/gpu_tests.log"
for preset in v4-flash-4l v41-flash-8l; do
  [ -d /tmp/$preset ] || timeout 120 python3 -m dsv4.cli make-model --preset $preset --out /tmp/$preset --device cuda > /dev/null
  for B in 1 32; do
    timeout 90 python3 -m dsv4.cli bench latency --model /tmp/$preset --batch-size $B --input-len 512 --output-len 32 \
      --num-iters 2 --cudagraph-capture-sizes $B --output-json "$out/$preset-b$B.json" "$@" 2>&1 \
      | grep -E "decode step|fraction of floor|Error"
  done
done
timeout 60 python3 benchmarks/profile_graph.py /tmp/v41-flash-8l 1 10 > "$out/profile-graph-v41-b1.txt" 2>&1
head -13 "$out/profile-graph-v41-b1.txt"
timeout 90 python3 benchmarks/encoder_latency.py --vision released --iters 3 --warmup 1 --counts 1 4 \
  --output-json "$out/encoder-latency-released.json" 2>&1 | tail -8
