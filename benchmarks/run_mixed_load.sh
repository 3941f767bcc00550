#!/usr/bin/env bash
# Mixed load (issue 23 item 4) on one H200. From the repo root, PYTHONPATH=.:
#   benchmarks/run_mixed_load.sh OUTDIR PART [PART ...]
# Each part starts `dsv4 serve` on V4.1-Flash-8l (random weights) with its scheduler options, loads it with
# `dsv4 bench serve` (vLLM's random dataset: 1024 tokens in / 128 out, concurrency 64, $NUM_PROMPTS prompts, default
# 320 = five turnovers), writes OUTDIR/mixed-PART.json (bench serve's --save-result) and the logs, and stops the
# server. About 2-4 minutes a part (start-up and CUDA graph capture included); run a few parts per device call.
# The server logs every Triton compile (DSV4_LOG_COMPILES=1): those after "start-up compiled" made requests wait.
#   base      the defaults: no chunk cap, decodes first (measured before this work: TPOT median 36 ms, while a pure
#             decode step at batch 64 takes < 7 ms)
#   t512      --long-prefill-token-threshold 512  --max-num-partial-prefills 2 --max-long-partial-prefills 2
#   t256      --long-prefill-token-threshold 256  --max-num-partial-prefills 4 --max-long-partial-prefills 4
#   derived   --max-num-partial-prefills 4 --max-long-partial-prefills 4: vLLM's derived cap, 4% of max-model-len
#             (163 tokens at the default 4096)
#   t256l1    --long-prefill-token-threshold 256  --max-num-partial-prefills 4 --max-long-partial-prefills 1: here
#             every prompt is long, so one prefill at a time (the starving extreme, for contrast)
#   b576      --max-num-batched-tokens 576: 64 decodes + a 512-token prefill chunk in every step. base (2,048) puts
#             the prefill work in ~1/4 of the steps (~45 ms each beside ~8.4 ms decode-only steps), and its TPOT
#             (17.0 ms on an H100) is about (prefill time + decode-only steps) / 127: spreading the same prefill over
#             every step removes the decode-only steps, if a 576-row step costs <= ~15 ms (unmeasured)
#   b1088     --max-num-batched-tokens 1088: between the two
#   basepw, b576pw  base and b576 with --piecewise-cudagraphs (the prefill / mixed steps' token-wise layer pieces as
#             CUDA graphs: dsv4/runtime/piecewise_graphs.py)
#   first     not a server: benchmarks/first_steps.py, a fresh engine's first steps under one wave of 64 x 1024-token
#             prompts with the Triton compiles each step waited for (run it first on a fresh machine: a cold
#             Triton cache is what a new server meets)
#   step      not a server: benchmarks/mixed_step.py, one mixed step (64 decodes + a CHUNK-token prompt chunk, CHUNKS
#             default "512 1984": b576's and base's steps) timed as wall against host time, with its kernel time
#             and host syncs: is the ~41 ms step of b576 (2026-12-06) host-bound? (yes: 40 ms host, 28 ms kernels,
#             benchmarks/results/2026-12-06-h100-mixed-step-host); CPROFILE=N adds a Python profile of a round (where
#             the host time goes: by file, top N functions); PIECEWISE=1 with --piecewise (logs *-pw.log)
#   syncs     not a server: benchmarks/host_syncs.py, the synchronizing CUDA calls of a 512-token prefill and of the
#             batch-1 decode steps after it
#   warmup    not a server: tests/gpu/test_warm_up_gpu.py (no Triton compile after start-up under a served
#             workload; dsv4/runtime/warm_up.py, built 2026-12-06 after base's first request waited 1.48 s for the
#             expert plan's sort: TTFT p90 2.52 s, all of it the first wave of 64); then run base again for its TTFT
#   decode64  not a server: benchmarks/profile_graph.py at batch 64 (the decode-only step of this load: ~10.6 ms of
#             ITL on an H100, ~41% of its stored-bytes floor, half of TPOT; 7.2 ms replay / 8.2 ms ITL since the
#             mHC splits, 2026-12-06-h100-decode-b64-splits), its kernels and timeline
#   latency   `dsv4 bench latency` at batch $BATCHES (default "1 32"), 512 in / 64 out, FULL graphs + async: issue 24's
#             decode-step points (the step against the floor)
#   decode1   decode64 at batch 1 (issue 24's 75%-of-floor point: where a batch-1 replay's time goes beyond the
#             weights' bytes; a switch set before the call, e.g. DSV4_DECODE_SIDE_STREAM=0, times the step without it),
#             then benchmarks/timeline_exposed.py on its timeline (the small kernels no big product hides)
#   switches  not a server: decode64 (replay and engine step, no timeline) on the defaults, with each decode switch
#             of the batch-64 step turned off, and with all of them off; then batch 1 on the defaults and with the
#             side stream off. The switches (on by default since results/2026-12-06-h100-decode-optins, which ran
#             this as `optins64` with them off by default): DSV4_MOE_TOKEN_MAJOR (the every-expert MoE path's rows
#             in token order), DSV4_FP32_LINEAR_MM_ROWS (65: the fp32 linears' Triton kernel up to 64 rows),
#             DSV4_ROWS_SPLITS (the rows kernel's keys in splits), DSV4_ENGRAM_HASH_KERNEL (Engram's hash in one
#             launch), DSV4_MHC_SUM_TILE (mHC's split sums as one tile), DSV4_DECODE_SIDE_STREAM (independent
#             chains of a decode forward on side streams)
#   ab        not a server: profile_graph.py (replay and engine step, no timeline) at batch $BATCH (default 1) on
#             the defaults and with each setting of $AB (default: this session's untimed switches,
#             "DSV4_COMBINE_CHANNELS=0 DSV4_ATTN_ROPE_FUSED=0 DSV4_MHC_EXPAND_COLLAPSE=1"), one run each, on one machine
#   idle      not a server: benchmarks/decode_device_idle.py at batch $BATCH (default 1): the device's idle time over
#             30 back-to-back async decode steps against one replay's own gaps (issue 24: host time outside the
#             graphs <= 5% of a decode step), then the same after a heap freeze (--gc-freeze, as dsv4 serve does)
#   gemv      not a server: benchmarks/bf16_gemv_forms.py (the batch-1 step's cuBLAS products against the Triton GEMV of
#             dsv4/ops/gemv.py, tiles swept; the expert gemv's tiles), then the batch-1 replay, step and logits phase
#             with DSV4_BF16_GEMV 0 / 1 / head (head: the LM head alone)
#   rowsplits not a server: the rows kernel's key splits against the whole walk at 8-128 rows
#             (benchmarks/rows_attention_bench.py --row-splits 2,4,8; where the rows kernel takes over from the split
#             kernel, ROWS_MIN_ROWS_PER_SM: then BATCH=32 AB="DSV4_ROWS_MIN_ROWS_PER_SM=0.375" part ab for the step)
#   kernels   not a server: kernels of the mixed step far off their floor, by their opt-in variants:
#             benchmarks/mhc_rows_splits.py (mHC's rows projection by column splits, DSV4_MHC_ROWS_SPLIT_K),
#             benchmarks/rope_inplace_forms.py (the in-place rope's pairs strided or contiguous, DSV4_ROPE_VEC),
#             benchmarks/fp32_linear_blocks.py (V4.1's fp32 router / compressor linears at decode sizes: the Triton
#             path's narrow tiles against the wide default, DSV4_FP32_LINEAR_BLOCKS)
# Compare TPOT / ITL (step length) against TTFT and throughput (prefill spread over more steps) across the parts.
. "$(dirname "$0")/device_lib.sh"
p=${PRESET:-v41-flash-8l}
port=${PORT:-8123}
# (a CPU smoke test of the script: PRESET=tiny-v41 with /tmp/tiny-v41 made beforehand, INPUT_LEN=64 OUTPUT_LEN=8
# CONCURRENCY=4 NUM_PROMPTS=8)

# serve_and_bench NAME SERVE_ARGS...: start the server with SERVE_ARGS, wait for /health, run the load, stop it
serve_and_bench() {
  local name=$1; shift
  use_wheels || return 1  # the server's fastapi / uvicorn (call with carry [".whl"])
  make_preset $p
  DSV4_LOG_COMPILES=1 timeout 900 python3 -m dsv4.cli serve --model /tmp/$p --port "$port" \
    --max-num-seqs "${CONCURRENCY:-64}" "$@" \
    > "$out/mixed-$name-server.log" 2>&1 &
  local pid=$! ready=0 i
  for i in $(seq 1 300); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2> /dev/null; then ready=1; break; fi
    kill -0 $pid 2> /dev/null || break
    sleep 1
  done
  if [ $ready = 1 ]; then
    timeout 300 python3 -m dsv4.cli bench serve --base-url "http://127.0.0.1:$port" \
      --num-prompts "${NUM_PROMPTS:-320}" --max-concurrency "${CONCURRENCY:-64}" \
      --random-input-len "${INPUT_LEN:-1024}" --random-output-len "${OUTPUT_LEN:-128}" \
      --save-result "$out/mixed-$name.json" > "$out/mixed-$name.log" 2>&1
    summary "$p mixed load $name" $? "$out/mixed-$name.log" \
      'Failed requests|Output token throughput|Median (TTFT|TPOT|ITL)|P99 (TPOT|ITL)|Error'
  else
    echo "$p mixed load $name: the server did not start (tail of its log:)"; tail -5 "$out/mixed-$name-server.log"
  fi
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
}

part_base() { serve_and_bench base; }
part_t512() {
  serve_and_bench t512 --long-prefill-token-threshold 512 --max-num-partial-prefills 2 --max-long-partial-prefills 2
}
part_t256() {
  serve_and_bench t256 --long-prefill-token-threshold 256 --max-num-partial-prefills 4 --max-long-partial-prefills 4
}
part_derived() { serve_and_bench derived --max-num-partial-prefills 4 --max-long-partial-prefills 4; }
part_t256l1() {
  serve_and_bench t256l1 --long-prefill-token-threshold 256 --max-num-partial-prefills 4 --max-long-partial-prefills 1
}

part_b576() { serve_and_bench b576 --max-num-batched-tokens 576; }
part_basepw() { serve_and_bench basepw --piecewise-cudagraphs; }
part_b576pw() { serve_and_bench b576pw --max-num-batched-tokens 576 --piecewise-cudagraphs; }
part_b1088() { serve_and_bench b1088 --max-num-batched-tokens 1088; }

part_first() {
  make_preset $p
  timeout 400 python3 benchmarks/first_steps.py /tmp/$p --json "$out/first_steps.json" > "$out/first_steps.log" 2>&1
  echo "first_steps (rc $?):"; grep -E "engine ready|all [0-9]+ prompts|variants" "$out/first_steps.log" | head -12
}

part_step() {
  make_preset $p
  local c
  for c in ${CHUNKS:-512 1984}; do
    timeout 240 python3 -u benchmarks/mixed_step.py /tmp/$p --chunk "$c" --top 40 ${CPROFILE:+--cprofile $CPROFILE} \
      ${PIECEWISE:+--piecewise} > "$out/mixed_step-$c${PIECEWISE:+-pw}.log" 2>&1
    echo "mixed_step chunk $c${PIECEWISE:+ piecewise} (rc $?):"
    grep -E "start-up|set-up:|steps:|profiled|synchronizing" "$out/mixed_step-$c${PIECEWISE:+-pw}.log"
  done
}

part_syncs() {
  make_preset $p
  timeout 200 python3 -u benchmarks/host_syncs.py /tmp/$p > "$out/host_syncs.log" 2>&1
  echo "host_syncs (rc $?):"; grep -E "steps," "$out/host_syncs.log"
}

part_warmup() {
  gpu_pytest 300 warm_up_gpu.log tests/gpu/test_warm_up_gpu.py -x
  grep -E "compiles after start-up" "$out/warm_up_gpu.log" | cut -c1-1500 | head -3
}

part_latency() {
  make_preset $p
  local b
  for b in ${BATCHES:-1 32}; do
    timeout 150 python3 -m dsv4.cli bench latency --model /tmp/$p --batch-size $b --input-len 512 --output-len 64 \
      --num-iters 3 --max-model-len 4096 --output-json "$out/lat-b$b.json" > "$out/lat-b$b.log" 2>&1
    summary "bench latency b$b" $? "$out/lat-b$b.log" "decode step|floor|Error"
  done
}

part_decode1() {
  make_preset $p
  timeout 240 python3 -u benchmarks/profile_graph.py /tmp/$p 1 20 --timeline > "$out/decode_b1.log" 2>&1
  echo "profile batch 1 (rc $?):"; grep -E "step|replay|of floor" "$out/decode_b1.log" | head -12
  python3 benchmarks/timeline_exposed.py "$out/decode_b1.log" --top 20 > "$out/decode_b1_exposed.log" 2>&1
  head -12 "$out/decode_b1_exposed.log"
}

part_decode64() {
  make_preset $p
  timeout 240 python3 -u benchmarks/profile_graph.py /tmp/$p 64 20 --timeline > "$out/decode_b64.log" 2>&1
  echo "profile batch 64 (rc $?):"; grep -E "step|replay|of floor" "$out/decode_b64.log" | head -12
}

part_gemv() {
  make_preset $p
  timeout 300 python3 -u benchmarks/bf16_gemv_forms.py /tmp/$p --json "$out/gemv_forms.json" > "$out/gemv_forms.log" 2>&1
  echo "bf16_gemv_forms (rc $?):"; grep -E "one-row products|experts" "$out/gemv_forms.log"
  local v
  for v in 0 1 head; do  # head: the LM head alone (eager, after the graph: the "logits" phase, not the replay)
    DSV4_BF16_GEMV=$v timeout 240 python3 -u benchmarks/profile_graph.py /tmp/$p 1 20 > "$out/decode_b1-gemv$v.log" 2>&1
    echo "profile batch 1, DSV4_BF16_GEMV=$v (rc $?):"
    grep -E "replay alone|engine step \(|logits" "$out/decode_b1-gemv$v.log"
  done
}

switches_off="DSV4_MOE_TOKEN_MAJOR=0 DSV4_FP32_LINEAR_MM_ROWS=65 DSV4_ROWS_SPLITS=0 DSV4_ENGRAM_HASH_KERNEL=0"
switches_off="$switches_off DSV4_MHC_SUM_TILE=0 DSV4_DECODE_SIDE_STREAM=0"

part_switches() {
  make_preset $p
  local v tag
  for v in defaults $switches_off "$switches_off"; do
    tag=$(echo "$v" | tr "=" "-"); [[ "$v" == *" "* ]] && tag=all-off
    env ${v/defaults/} timeout 240 python3 -u benchmarks/profile_graph.py /tmp/$p 64 20 > "$out/decode_b64-$tag.log" 2>&1
    echo "profile batch 64, $v (rc $?):"; grep -E "replay alone|engine step \(" "$out/decode_b64-$tag.log"
  done
  for v in defaults DSV4_DECODE_SIDE_STREAM=0; do
    tag=$(echo "$v" | tr "=" "-")
    env ${v/defaults/} timeout 240 python3 -u benchmarks/profile_graph.py /tmp/$p 1 20 > "$out/decode_b1-$tag.log" 2>&1
    echo "profile batch 1, $v (rc $?):"; grep -E "replay alone|engine step \(" "$out/decode_b1-$tag.log"
  done
}

part_ab() {
  make_preset $p
  local b=${BATCH:-1} v tag
  for v in defaults ${AB:-DSV4_COMBINE_CHANNELS=0 DSV4_ATTN_ROPE_FUSED=0 DSV4_MHC_EXPAND_COLLAPSE=1}; do
    tag=$(echo "$v" | tr "=" "-")
    env ${v/defaults/} timeout 200 python3 -u benchmarks/profile_graph.py /tmp/$p "$b" 20 > "$out/ab-b$b-$tag.log" 2>&1
    echo "profile batch $b, $v (rc $?):"; grep -E "replay alone|engine step \(" "$out/ab-b$b-$tag.log"
  done
}

part_idle() {
  make_preset $p
  local b=${BATCH:-1}
  local f
  for f in "" --gc-freeze; do
    timeout 200 python3 -u benchmarks/decode_device_idle.py /tmp/$p "$b" 30 $f > "$out/idle-b$b$f.log" 2>&1
    echo "decode_device_idle batch $b $f (rc $?):"; grep -E "period|idle|host-exposed" "$out/idle-b$b$f.log" | head -9
  done
}

part_rowsplits() {
  timeout 200 python3 -u benchmarks/rows_attention_bench.py --rows 8,16,24,32,48,64,128 --row-splits 2,4,8 \
    --json "$out/rows_splits.json" > "$out/rows_splits.log" 2>&1
  echo "rows_attention_bench --row-splits 2,4,8 (rc $?):"; tail -21 "$out/rows_splits.log"
}

part_kernels() {
  timeout 120 python3 -u benchmarks/mhc_rows_splits.py > "$out/mhc_rows_splits.log" 2>&1
  echo "mhc_rows_splits (rc $?):"; tail -5 "$out/mhc_rows_splits.log"
  timeout 90 python3 -u benchmarks/rope_inplace_forms.py > "$out/rope_inplace_forms.log" 2>&1
  echo "rope_inplace_forms (rc $?):"; tail -7 "$out/rope_inplace_forms.log"
  timeout 90 python3 -u benchmarks/fp32_linear_blocks.py > "$out/fp32_linear_blocks.log" 2>&1
  echo "fp32_linear_blocks (rc $?):"; tail -13 "$out/fp32_linear_blocks.log"
}

run_parts "$@"
