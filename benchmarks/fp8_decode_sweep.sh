#!/usr/bin/env bash
# W8A16 decode configs (dsv4.ops.fp8_linear._config overrides) at M = 1 and 32 on the V4 (block 128) and V4.1
# (block 32) shapes that dominate a decode step; one line per (config, shape, M). From the repo root, PYTHONPATH=.:
#   bash benchmarks/fp8_decode_sweep.sh OUTDIR
out=$1; mkdir -p "$out"
shapes=v4.wq_b,v41.wq_a,v41.wq_b
for o in "" BLOCK_N=32 BLOCK_N=128 num_warps=8 num_stages=2 BLOCK_N=32,num_warps=2 split=1; do
  timeout 60 python3 benchmarks/fp8_linear_bench.py --shapes $shapes --m 1,32 --methods w8a16 --rep 10 \
    ${o:+--override $o} > "$out/sweep-$(echo "${o:-default}" | tr '=,' '-_').log" 2>&1  # names $OUT keeps
  grep -E "w8a16|FAILED" "$out/sweep-$(echo "${o:-default}" | tr '=,' '-_').log" | awk -v o="${o:-default}" '{print o, $1, $2, $4}'
done
