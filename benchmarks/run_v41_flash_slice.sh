#!/usr/bin/env bash
# The deepest slice of DeepSeek-V4.1-Flash on one H200 (issue 22, item 3), full width, released format, random weights
# (`--load-format dummy`), the Engram table(s) full size in host memory. From the repo root, PYTHONPATH=.:
#   benchmarks/run_v41_flash_slice.sh OUTDIR PART [PART ...]
#   plan    benchmarks/v41_flash_slice.py plan: the weights of every depth (from the config alone) and the deepest
#           that fits (prediction of 2026-12-01: 17 layers, 119.7 GiB of weights on the GPU, 94.4 GiB table on the host)
#   bench   write the slice of $LAYERS layers (default 17; engram on layer 1 only: one 94.4 GiB table, what the
#           machine's 125 GiB of host memory holds), then `dsv4 bench latency` at batch 1 and 32, 512 in / 32 out,
#           --gpu-memory-utilization 0.95; if the engine refuses the depth (its memory plan, before loading), one
#           layer less. The host table is drawn on the GPU and copied to host memory at start-up (~90 s for 94 GiB).
. "$(dirname "$0")/device_lib.sh"

part_plan() {
  timeout 120 python3 benchmarks/v41_flash_slice.py plan > "$out/slice_plan.log" 2>&1
  grep -E "deepest|rc" "$out/slice_plan.log"
}

part_bench() {
  local layers=${LAYERS:-17} b tag dir rc
  while [ "$layers" -ge 10 ]; do
    dir=/tmp/v41-flash-$layers
    [ -d "$dir" ] || timeout 120 python3 benchmarks/v41_flash_slice.py write "$layers" "$dir" > /dev/null
    for b in 1 32; do
      tag=v41-flash-${layers}l-b$b
      timeout 420 python3 -m dsv4.cli bench latency --model "$dir" --load-format dummy --engram-placement host \
        --batch-size $b --input-len 512 --output-len 32 --num-iters 2 --cudagraph-capture-sizes $b \
        --gpu-memory-utilization 0.95 --output-json "$out/$tag.json" > "$out/$tag.log" 2>&1
      rc=$?
      summary "$tag" $rc "$out/$tag.log" '^decode step|fraction of floor|weights|do not fit|Error'
      if grep -q "do not fit\|out of memory" "$out/$tag.log"; then break; fi
    done
    grep -q "do not fit\|out of memory" "$out/v41-flash-${layers}l-b1.log" || return 0
    layers=$((layers - 1))
  done
}

run_parts "$@"
