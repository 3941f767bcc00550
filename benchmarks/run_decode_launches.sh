#!/usr/bin/env bash
# Decode launches on one H200 (benchmarks/results/2026-12-04-h200-decode-launches). From the repo root, PYTHONPATH=.:
#   benchmarks/run_decode_launches.sh OUTDIR PART [PART ...]
#   micro   the decode attention by split size and the indexer selection by split count (decode_attention_splits.py,
#           decode_select_splits.py)
#   tests   the GPU tests of the fused / merged decode pieces (norm + rope, merged siblings, router, graphs, verify rows)
#   bench   V4-Flash-4l in bf16 and released at batch 1 and 32 (run_quant.sh bench), then the released batch-1 timeline
#   probes  tests/gpu/test_decode_select_gpu.py, mxfp4_dot_scaled_probe.py, fp8_gemv_pipelined_probe.py
#   v41     V4.1-Flash-8l released and bf16 at batch 1 (start limit 300 s: a cold machine compiles its kernels)
. "$(dirname "$0")/device_lib.sh"

part_micro() {
  timeout 90 python3 benchmarks/decode_attention_splits.py > "$out/decode_attention_splits.log" 2>&1
  cat "$out/decode_attention_splits.log"
  timeout 120 python3 benchmarks/decode_select_splits.py > "$out/decode_select_splits.log" 2>&1
  cat "$out/decode_select_splits.log"
}

part_tests() {
  gpu_pytest 330 gpu_tests.log tests/gpu/test_decode_fusions_gpu.py tests/gpu/test_merged_gpu.py \
    tests/gpu/test_quant_engine_gpu.py tests/gpu/test_cudagraphs.py tests/gpu/test_spec_verify_decode_gpu.py \
    tests/gpu/test_rmsnorm_gpu.py tests/gpu/test_compile_decode_gpu.py
}

part_bench() {
  PRESETS=v4-flash-4l LIMIT=150 bash benchmarks/run_quant.sh "$out" bench
  timeout 120 python3 benchmarks/profile_graph.py /tmp/v4-flash-4l-released 1 20 --timeline \
    > "$out/profile-v4-flash-4l-released-b1.log" 2>&1
  summary "timeline" $? "$out/profile-v4-flash-4l-released-b1.log" 'replay alone|timeline:|Error'
}

# the expert / dense gemv probes (tensor-core MXFP4 via tl.dot_scaled, cp.async-pipelined FP8) against the landed
# kernels, with the selection test of the merge change
part_probes() {
  gpu_pytest 200 gpu_tests_select.log tests/gpu/test_decode_select_gpu.py
  timeout 150 python3 benchmarks/mxfp4_dot_scaled_probe.py > "$out/mxfp4_dot_scaled_probe.log" 2>&1
  cat "$out/mxfp4_dot_scaled_probe.log"
  timeout 150 python3 benchmarks/fp8_gemv_pipelined_probe.py > "$out/fp8_gemv_pipelined_probe.log" 2>&1
  cat "$out/fp8_gemv_pipelined_probe.log"
}

part_v41() { PRESETS=v41-flash-8l BATCHES=1 LIMIT=300 bash benchmarks/run_quant.sh "$out" bench; }

run_parts "$@"
