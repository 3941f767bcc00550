#!/usr/bin/env bash
# Decode on two GPUs (expert + tensor parallel) against one (nvidia-h200-x2). From the repo root, PYTHONPATH=.:
#   benchmarks/run_two_gpu_decode.sh OUTDIR PART [PART ...]
#   tests      tests/gpu/test_distributed_gpu.py (NCCL ranks against one GPU: tokens)
#   resttests  the rest of tests/gpu (on GPU 0)
#   bench      V4.1-Flash-8l decode at batch $BATCHES (default "1 32"): one GPU, then two GPUs under torchrun
#              (--tensor-parallel-size 2 --expert-parallel); FULL graphs (capture size = batch), async scheduling
#   profile    where a two-GPU step goes: NCCL's transport and the latency of one step's collectives alone
#              (benchmarks/nccl_latency.py), then benchmarks/profile_graph.py at batch $BATCHES on one GPU and on two
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l
dist_tests=tests/gpu/test_distributed_gpu.py

part_tests() { gpu_pytest 400 gpu_dist_tests.log $dist_tests; }

part_resttests() { gpu_pytest 330 gpu_tests.log tests/gpu --deselect $dist_tests; }

part_bench() {
  make_preset $p
  local b args
  for b in ${BATCHES:-1 32}; do
    args="bench latency --model /tmp/$p --batch-size $b --input-len 512 --output-len 32 --num-iters 2"
    args="$args --cudagraph-capture-sizes $b"
    timeout 120 python3 -m dsv4.cli $args --output-json "$out/$p-b$b-1gpu.json" > "$out/$p-b$b-1gpu.log" 2>&1
    summary "$p b$b 1 GPU" $? "$out/$p-b$b-1gpu.log" 'decode step|fraction|Error'
    timeout 180 python3 -m torch.distributed.run --nproc-per-node 2 -m dsv4.cli $args --tensor-parallel-size 2 \
      --expert-parallel --output-json "$out/$p-b$b-2gpu.json" > "$out/$p-b$b-2gpu.log" 2>&1
    summary "$p b$b 2 GPUs" $? "$out/$p-b$b-2gpu.log" 'decode step|fraction|Error'
  done
}

part_profile() {
  NCCL_DEBUG=INFO timeout 90 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/nccl_latency.py \
    > "$out/nccl_latency.log" 2>&1
  grep -E "via|NVLS|P2P|batch|all_|NCCL [0-9]" "$out/nccl_latency.log" | grep -v "^ *$" | sort -u | head -30
  make_preset $p
  local b
  for b in ${BATCHES:-1 32}; do
    timeout 120 python3 benchmarks/profile_graph.py /tmp/$p $b 20 > "$out/profile-b$b-1gpu.log" 2>&1
    summary "profile b$b 1 GPU" $? "$out/profile-b$b-1gpu.log" 'engine step|graph replay alone|Error'
    timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_graph.py /tmp/$p $b 20 \
      --tp=2 > "$out/profile-b$b-2gpu.log" 2>&1
    summary "profile b$b 2 GPUs" $? "$out/profile-b$b-2gpu.log" 'engine step|graph replay alone|Error'
  done
}

run_parts "$@"
