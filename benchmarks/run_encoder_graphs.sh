#!/usr/bin/env bash
# Vision-encoder CUDA graphs against eager encoding on one H200: which attention kernel and which budget ladder make
# the graphs pay at every size and count. From the repo root, PYTHONPATH=.:
#   benchmarks/run_encoder_graphs.sh OUTDIR PART [PART ...]
#   tests    tests/gpu/test_varlen_attention_gpu.py (the graph attentions: triton, flash) and
#            test_encoder_cudagraphs_gpu.py
#   attn     benchmarks/varlen_attention_bench.py: the attention alone, SDPA per image vs FlashAttention varlen vs
#            the Triton kernel at several tile configurations, at the released ViT shapes
#   latency  benchmarks/encoder_latency.py --vision released, its default table (SIZES / COUNTS override: e.g.
#            SIZES="544x544 640x640 768x768 1024x768 896x896" COUNTS="1 2"): budgets powers of two + Triton (the
#            11-30 configuration), 4 steps per octave + Triton, 4 steps + FlashAttention (CONFIGS picks some, e.g.
#            CONFIGS="steps4-triton 4 triton;steps4-flash 4 flash"; PROFILE=1 adds the kernel tables, ITERS / LIMIT
#            per run)
. "$(dirname "$0")/device_lib.sh"

part_tests() {
  gpu_pytest 300 gpu_tests.log tests/gpu/test_varlen_attention_gpu.py tests/gpu/test_encoder_cudagraphs_gpu.py
}

part_attn() {
  timeout 240 python3 benchmarks/varlen_attention_bench.py --json "$out/varlen_attention.json" \
    > "$out/varlen_attention.log" 2>&1
  echo "varlen_attention_bench (rc $?):"
  grep -E "^(544|896|1024|1536)" "$out/varlen_attention.log"
}

part_latency() {
  local tag steps attn extra
  # CONFIGS: "TAG STEPS ATTENTION" triples, ";"-separated (default: all three); PROFILE=1 adds --profile
  local IFS_SAVE=$IFS
  IFS=";"; set -- ${CONFIGS:-pow2-triton 1 triton;steps4-triton 4 triton;steps4-flash 4 flash}; IFS=$IFS_SAVE
  for cfg in "$@"; do
    set -- $cfg
    tag=$1 steps=$2 attn=$3 extra=""
    [ "${PROFILE:-0}" = 1 ] && extra="--profile"
    [ -n "${SIZES:-}" ] && extra="$extra --sizes $SIZES"
    [ -n "${COUNTS:-}" ] && extra="$extra --counts $COUNTS"
    timeout "${LIMIT:-300}" python3 benchmarks/encoder_latency.py --vision released --iters "${ITERS:-10}" --warmup 2 \
      --budget-steps "$steps" --graph-attention "$attn" $extra --output-json "$out/encoder-latency-$tag.json" \
      > "$out/encoder-latency-$tag.log" 2>&1
    echo "encoder_latency $tag (rc $?):"; grep -E "^\| [0-9]" "$out/encoder-latency-$tag.log"
  done
}

run_parts "$@"
