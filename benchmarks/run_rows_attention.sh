#!/usr/bin/env bash
# The sink attention's rows kernel (dsv4/ops/decode_attention.py: prefill-sized row counts and decode batches of
# 50+ rows) on one GPU. From the repo root, PYTHONPATH=.:
#   benchmarks/run_rows_attention.sh OUTDIR PART [PART ...]
#   tests    the kernels against fp64 (test_decode_attention_gpu), then the paths that now take the rows kernel:
#            the engine on CUDA, decode graphs (batches >= 50 rows), the fused prefill selection beside it
#   kernels  split against rows kernel by row count (benchmarks/rows_attention_bench.py)
#   prefill  V4.1-Flash-8l: one 16,384-token prompt, one 32,768-token prompt and 32 x 512 tokens, each with the rows
#            kernel (default) and with DSV4_ROWS_ATTENTION=0 (the split kernel; the baseline on the same card).
#            Targets (issue 23, H200): 16K <= 0.4 s, 32K <= 1.0 s, 32 x 512 >= 40,000 tokens/s.
#            SHAPES="BATCH:LEN ..." other shapes (default "1:16384 1:32768 32:512"); SWITCH=NAME another on / off
#            switch than DSV4_ROWS_ATTENTION, e.g. SWITCH=DSV4_FP32_LINEAR_MM (the fp32 router / compressor GEMMs of
#            prefill on the tensor cores, 1, or as fp32 GEMMs, 0)
#   profile  the kernels of one $LEN-token (default 16384) prefill by family (benchmarks/profile_prefill.py)
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l

part_tests() {
  gpu_pytest 150 gpu_tests_attention.log tests/gpu/test_decode_attention_gpu.py -s
  grep "fp32 rows" "$out/gpu_tests_attention.log"
  gpu_pytest 300 gpu_tests_engine.log tests/gpu/test_engine_cuda.py tests/gpu/test_cudagraphs.py \
    tests/gpu/test_indexer_prefill_gpu.py
}

part_kernels() {
  timeout 240 python3 benchmarks/rows_attention_bench.py --json "$out/rows_attention_bench.json" \
    > "$out/rows_attention_bench.log" 2>&1
  echo "rows_attention_bench (rc $?):"; tail -28 "$out/rows_attention_bench.log"
}

part_prefill() {
  make_preset $p
  local on shape b len switch=${SWITCH:-DSV4_ROWS_ATTENTION} tag
  case $switch in DSV4_ROWS_ATTENTION) tag=rows ;; *) tag=$switch ;; esac
  for shape in ${SHAPES:-1:16384 1:32768 32:512}; do
    b=${shape%%:*} len=${shape##*:}
    for on in 1 0; do
      (export "$switch=$on"; prefill_latency "$p-b$b-in$len-$tag$on" $b $len $((b * len > 16384 ? b * len : 16384)))
    done
  done
}

# the same profile as run_prefill_indexer.sh's (LEN tokens, default 16384)
part_profile() { bash "$(dirname "$0")/run_prefill_indexer.sh" "$out" profile; }

run_parts "$@"
