#!/usr/bin/env bash
# Issue 9's runs on a machine with two GPUs (nvidia-h200-x2). From the repo root, PYTHONPATH=.:
#   benchmarks/run_issue9.sh OUTDIR PART [PART ...]
#   tests   tests/gpu/test_distributed_gpu.py (NCCL ranks = one GPU, tokens), then the rest of tests/gpu on GPU 0
#   bench   V4.1-Flash-8l decode at batch $BATCHES (default "1 32"): one GPU, then two GPUs under torchrun
#           (--tensor-parallel-size 2 --expert-parallel); FULL graphs (capture size = batch), async scheduling
set -uo pipefail
out=$1; shift; mkdir -p "$out"
p=v41-flash-8l
for part in "$@"; do
  case $part in
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_distributed_gpu.py > "$out/gpu_dist_tests.log" 2>&1
      tail -3 "$out/gpu_dist_tests.log" ;;
    resttests)
      timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu --deselect tests/gpu/test_distributed_gpu.py \
        > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log" ;;
    bench)
      [ -d /tmp/$p ] || timeout 150 python3 -m dsv4.cli make-model --preset $p --out /tmp/$p --device cuda > /dev/null
      for b in ${BATCHES:-1 32}; do
        args="bench latency --model /tmp/$p --batch-size $b --input-len 512 --output-len 32 --num-iters 2 --cudagraph-capture-sizes $b"
        timeout 120 python3 -m dsv4.cli $args --output-json "$out/$p-b$b-1gpu.json" > "$out/$p-b$b-1gpu.log" 2>&1
        echo "$p b$b 1 GPU (rc $?): $(grep -E 'decode step|fraction|Error' "$out/$p-b$b-1gpu.log" | tr -s ' ' | tr '\n' ' ')"
        timeout 180 python3 -m torch.distributed.run --nproc-per-node 2 -m dsv4.cli $args --tensor-parallel-size 2 \
          --expert-parallel --output-json "$out/$p-b$b-2gpu.json" > "$out/$p-b$b-2gpu.log" 2>&1
        echo "$p b$b 2 GPUs (rc $?): $(grep -E 'decode step|fraction|Error' "$out/$p-b$b-2gpu.log" | tr -s ' ' | tr '\n' ' ')"
      done ;;
  esac
done
