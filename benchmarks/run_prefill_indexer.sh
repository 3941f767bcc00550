#!/usr/bin/env bash
# The fused prefill indexer selection (issue 23 item 1: dsv4/ops/indexer_prefill.py) on one H200. From the repo
# root, PYTHONPATH=.:
#   benchmarks/run_prefill_indexer.sh OUTDIR PART [PART ...]
#   tests   tests/gpu/test_indexer_prefill_gpu.py (the kernel against its torch reference at V4.1-Flash-8l shapes, and
#           its time at 16,384 / 32,768 prompt tokens next to the current path, printed), then the GPU tests of the
#           paths it joins: the decode selection (same keys and merges) and the engine on CUDA
#   bench   V4.1-Flash-8l prefill latency, batch 1, $LENS prompt tokens (default "16384 32768"), 2 output tokens;
#           one prefill step by default (the bench's budget max(2048, input-len)), BUDGET=N for N-token chunks.
#           Target: 16,384 tokens <= 0.4 s ("prefill, synced"; before: 1.56 s, 755 ms of it in the indexer)
#   profile the kernels of one $LEN-token (default 16384) prefill by family (benchmarks/profile_prefill.py)
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l

part_tests() {
  DSV4_INDEXER_BASELINE=1 gpu_pytest 600 gpu_tests.log tests/gpu/test_indexer_prefill_gpu.py -s
  grep -E "^T=|block_m" "$out/gpu_tests.log"
  gpu_pytest 400 gpu_rest.log tests/gpu/test_decode_select_gpu.py tests/gpu/test_engine_cuda.py \
    tests/gpu/test_decode_attention_gpu.py -s
}

part_bench() {
  make_preset $p
  local len args tag
  for len in ${LENS:-16384 32768}; do
    tag="$p-in$len${BUDGET:+-budget$BUDGET}"
    args="bench latency --model /tmp/$p --batch-size 1 --input-len $len --output-len 2 --num-iters 2"
    args="$args --max-model-len $((len + 64))${BUDGET:+ --max-num-batched-tokens $BUDGET}"
    timeout 400 python3 -m dsv4.cli $args --output-json "$out/$tag.json" > "$out/$tag.log" 2>&1
    summary "$p input $len${BUDGET:+ budget $BUDGET}" $? "$out/$tag.log" 'prefill, synced|prefill tokens/s|Error'
  done
}

# where the 16K prefill's time goes by kernel family (item 2: the MoE / dense GEMMs): benchmarks/profile_prefill.py
part_profile() {
  make_preset $p
  timeout 300 python3 benchmarks/profile_prefill.py /tmp/$p "${LEN:-16384}" 30 > "$out/profile_prefill.log" 2>&1
  echo "profile_prefill (rc $?):"; sed -n '1,12p' "$out/profile_prefill.log"
}

run_parts "$@"
