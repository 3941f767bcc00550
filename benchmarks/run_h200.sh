#!/usr/bin/env bash
# Decode latency on one GPU for one Flash-shaped preset: graphs and enforce_eager at batch 1, 8, 32, 64.
# usage: benchmarks/run_h200.sh PRESET OUTDIR [extra bench args]   (run from the repo root, PYTHONPATH=.)
set -euo pipefail
preset=$1; out=$2; shift 2
model=/tmp/$preset
[ -d "$model" ] || python3 -m dsv4.cli make-model --preset "$preset" --out "$model" --device cuda
mkdir -p "$out"
for B in 1 8 32 64; do
  extra=()
  if [[ $preset == v4-* && ( $B == 1 || $B == 32 ) ]]; then extra=(--baseline hf); fi
  python3 -m dsv4.cli bench latency --model "$model" --batch-size $B --input-len 512 --output-len 32 \
    --num-iters 2 --output-json "$out/$preset-b$B.json" "${extra[@]}" "$@"
  python3 -m dsv4.cli bench latency --model "$model" --batch-size $B --input-len 512 --output-len 32 \
    --num-iters 2 --enforce-eager --output-json "$out/$preset-b$B-eager.json" "$@"
done
