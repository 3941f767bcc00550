#!/usr/bin/env bash
# A prefill step's routed experts through torch's grouped GEMM on rows sorted by expert (dsv4/ops/moe_sorted.py,
# DSV4_SORTED_EXPERTS=1, the default) against the Triton grouped kernel (DSV4_SORTED_EXPERTS=0), on one H200. From
# the repo root, PYTHONPATH=.:
#   benchmarks/run_moe_prefill.sh OUTDIR PART [PART ...]
#   tests    tests/gpu/test_moe_sorted_gpu.py (the sorted path against the Triton path at Flash shapes, no host sync,
#            the engine's prefill through it)
#   kernels  benchmarks/moe_prefill_gemm.py: one layer's routed experts both ways, V4 / V4.1 Flash expert shapes,
#            16 and 256 experts, 512 / 4096 / 16384 tokens, plus a profile of the sorted path
#   engine   V4.1-Flash-8l bf16 prefill, both ways: one 16,384-token prompt (issue 23 target <= 0.4 s) and 32 x 512
#            (target >= 40,000 tokens/s)
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l

part_tests() {
  gpu_pytest 300 gpu_tests.log tests/gpu/test_moe_sorted_gpu.py
}

part_kernels() {
  timeout 400 python3 benchmarks/moe_prefill_gemm.py --json "$out/moe_prefill_gemm.json" \
    > "$out/moe_prefill_gemm.log" 2>&1
  echo "moe_prefill_gemm (rc $?):"; grep -E "^v4" "$out/moe_prefill_gemm.log"
}

part_engine() {
  make_preset $p
  local on shape
  for on in 0 1; do
    for shape in "1 16384" "32 512"; do
      set -- $shape
      DSV4_SORTED_EXPERTS=$on prefill_latency "$p-b$1-in$2-sorted$on" $1 $2 $(($1 * $2))
    done
  done
}

run_parts "$@"
