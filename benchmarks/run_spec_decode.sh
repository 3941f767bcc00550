#!/usr/bin/env bash
# Speculative decoding's speed on one H200 (issue 21's acceptance). From the repo root, PYTHONPATH=.:
#   benchmarks/run_spec_decode.sh OUTDIR PART [PART ...]
#   tests   tests/gpu/test_spec_decode_gpu.py (tiny V4.1 / V4, fp32: greedy outputs with a random, an oracle and an
#           MTP drafter equal plain decoding's), and the verify-rows, drafter-graph and pipelined-step GPU tests
#   bench   V4.1-Flash-8l (random bf16 weights) WITH its DSpark drafter (make_model(..., drafter=True): the released
#           drafter's fields, 3 stages of 128 experts, k = block 5), written to /tmp/v41-flash-8l-dspark (not
#           device_lib's /tmp/v41-flash-8l, which has no drafter); then benchmarks/spec_decode_speed.py at batch
#           $BATCHES (default 1,2,4,8,16,32), 512 tokens in, $OUTPUT_LEN (default 128) out: plain decode, the
#           oracle drafter (free drafts, all accepted), the oracle after the real drafter (its cost, all accepted),
#           the random drafter (acceptance ~0); JSON + log in OUTDIR. $DRAFTER_EXPERTS (unset: the released 128)
#           writes a smaller drafter instead, to /tmp/v41-flash-8l-dspark-e$DRAFTER_EXPERTS.
#   VERIFY_DECODE=1 (bench, demo): the speculative engine runs uniform verify steps as decode rows with CUDA graphs
#   DRAFTER_GRAPHS=1 (bench, demo): the speculative engine replays the DSpark drafter's proposals as CUDA graphs
#   PIPELINED=1 (bench, demo; with VERIFY_DECODE=1): the speculative engine with async scheduling (pipelined steps)
#   ADAPTIVE=1 (bench, demo): the speculative engine speculates only while it measures that it pays (gate.py)
#   MTP=1 (bench): V4-Flash-4l (random bf16) with one MTP layer (make_model(..., drafter=True)), written to
#           /tmp/v4-flash-4l-mtp, k = $NUM_SPEC (default 3), instead of V4.1-Flash-8l and DSpark
#   PHASE_PROFILE=1 (bench, demo): one more run per speculative row, every step's phases synced and timed (phases_ms)
#   BATCH_INVARIANCE=1 (bench): the plain engine also decodes each batch's prompts one at a time (plain.alone_vs_batched)
#   MODES=plain,drafter (bench): only these modes (spec_decode_speed.py --modes)
#   DTYPE=float32 (bench): the engine's dtype (default bf16); fp32 keeps the oracle's recorded tokens exact when
#           plain and verify steps compute a token (the adaptive switch mixes them; bf16 near ties then differ)
#   BENCH_LIMIT: seconds for spec_decode_speed.py in the bench part (default 280; up to ~480 when it runs alone)
#   agree   benchmarks/spec_logit_agreement.py on the same checkpoint: plain decoding's logprobs against the verify
#           rows' (oracle drafts, fixed speculation; ADAPTIVE=1: the adaptive switch), position by position, one
#           request, $INPUT_LEN (512) in, $OUTPUT_LEN (256) out, $DTYPE (float32): where do the two first differ?
#   demo    the built-in trained model with its trained drafter on held-out code (--prompts held-out-code): the
#           realistic acceptance beside the oracle (~1-2 minutes: a tiny model, eager verify steps)
#
# Time estimate (whole script, expected ~330 s, every command capped: 80 + 200 + 280 = 560 s at worst):
#   tests  ~35 s (9 GPU tests took 31 s on 2026-12-01, this file's 5 of them less).
#   make   the checkpoint is 44.5 GB (target 16.0 GB + drafter 28.5 GB, 14.2 B params): drawn on the GPU and
#          written at disk speed; estimated 60-150 s from the 16 GB preset fitting device_lib's 150 s (the log
#          prints the time it took; a second call on a warm machine reuses the directory).
#   bench  ~130 s (~200 s if eager steps are twice the guess). Start-up: imports ~10 s, the plain engine ~20 s
#          (7 s load, graphs of 6 sizes), the speculative one ~30 s (44.5 GB load). Plain, per batch: a warm-up of
#          16 tokens and a timed run of 128, 2 prefills (0.1 s at batch 1 to 0.45 s at batch 32) + 143 graph steps
#          of 3.7 ms (batch 1) to 6 ms (batch 32): ~9 s over the 6 batches. Speculative steps are eager (no graphs):
#          ~30 ms per verify step (an eager 8-layer decode step measured 23-30 ms) plus ~15 ms for the eager
#          drafter (guess). Per batch: oracle ~29 steps (26 verify steps of 6 tokens + warm-up) ~1 s, oracle after
#          the drafter ~1.3 s, random ~144 steps ~6.5 s, 6 prefills ~0.5-2.7 s: ~60 s over the 6 batches.
#          The CPU run (tiny-v41, batch 1,2, 4 in / 6 out, 1 thread) takes ~5 s and counts the same steps per mode.
#   The JSON is rewritten after every measured (batch, mode), so a run cut short keeps what it measured; batch 1,
#   the acceptance's batch, comes first.
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l
[ -n "${MTP:-}" ] && p=v4-flash-4l  # MTP=1: DeepSeek-V4's MTP layer on V4-Flash-4l instead of DSpark

part_tests() {
  gpu_pytest 300 gpu_tests_spec.log tests/gpu/test_spec_decode_gpu.py tests/gpu/test_spec_verify_decode_gpu.py \
    tests/gpu/test_dspark_graphs_gpu.py tests/gpu/test_spec_pipelined_gpu.py tests/gpu/test_spec_gate_gpu.py \
    tests/gpu/test_seeded_noise_gpu.py
}

# make_drafter_preset DIR: $p with its drafter (drawn on the GPU) at DIR, unless it is there: v41-flash-8l's DSpark,
# or v4-flash-4l's MTP layer (MTP=1); written to DIR.partial first, so a write cut short is never taken for one
make_drafter_preset() {
  local dir=$1 t0=$SECONDS
  [ -d "$dir" ] && return 0
  rm -rf "$dir.partial"
  local need=46 free  # GB: 44.5 with the released drafter; a smaller one ($DRAFTER_EXPERTS) needs less
  [ -n "${DRAFTER_EXPERTS:-}" ] && need=$(( 18 + DRAFTER_EXPERTS / 4 ))
  [ -n "${MTP:-}" ] && need=12  # V4-Flash-4l (16 experts a layer) and one MTP layer of the same shapes
  free=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
  if [ "${free:-0}" -lt "$need" ]; then  # the 1-GPU machine has a 64 GiB disk: /tmp/v41-flash-8l (16 GB) too?
    echo "make $dir: only ${free} GB free in /tmp, ~$need GB needed; the largest there:" \
      "$(du -sh /tmp/* 2>/dev/null | sort -h | tail -3 | tr '\n' ' ')"
    return 1
  fi
  timeout 200 python3 - "$dir.partial" "$p" > "$out/make_model.log" 2>&1 <<'EOF'
import os, sys
from dsv4.make_model import make_model
from dsv4.models.presets import DRAFTER_FIELDS
n = os.environ.get("DRAFTER_EXPERTS")
overrides = {**DRAFTER_FIELDS, "dspark_n_routed_experts": int(n)} if n and sys.argv[2].startswith("v41") else None
make_model(sys.argv[2], sys.argv[1], device="cuda", drafter=True, overrides=overrides)
EOF
  local rc=$?
  [ $rc -eq 0 ] && mv "$dir.partial" "$dir"
  echo "make $dir (rc $rc): $((SECONDS - t0)) s, $(du -sh "$dir" 2>/dev/null | cut -f1)"
  return $rc
}

# drafter_dir: where make_drafter_preset writes this run's checkpoint ($p, its drafter, $DRAFTER_EXPERTS, MTP)
drafter_dir() {
  if [ -n "${MTP:-}" ]; then echo "/tmp/$p-mtp"; else echo "/tmp/$p-dspark${DRAFTER_EXPERTS:+-e$DRAFTER_EXPERTS}"; fi
}

part_bench() {
  local dir; dir=$(drafter_dir)
  make_drafter_preset "$dir" || { tail -5 "$out/make_model.log" 2>/dev/null; return 1; }
  local t0=$SECONDS log=$out/spec_decode_speed.log
  timeout "${BENCH_LIMIT:-280}" python3 benchmarks/spec_decode_speed.py --model "$dir" --batch-sizes "${BATCHES:-1,2,4,8,16,32}" \
    --input-len 512 --output-len "${OUTPUT_LEN:-128}" ${VERIFY_DECODE:+--verify-decode} \
    ${DRAFTER_GRAPHS:+--drafter-cuda-graphs} ${PIPELINED:+--pipelined} ${ADAPTIVE:+--adaptive} ${PHASE_PROFILE:+--phase-profile} \
    ${BATCH_INVARIANCE:+--batch-invariance} ${MODES:+--modes $MODES} \
    ${MTP:+--num-speculative-tokens ${NUM_SPEC:-3}} ${DTYPE:+--dtype $DTYPE} --output-json "$out/spec_decode_speed.json" \
    > "$log" 2>&1
  local rc=$?
  echo "spec_decode_speed (rc $rc): $((SECONDS - t0)) s"
  sed -n '/^spec_decode_speed: /,$p' "$log"  # the table and the verdicts
  grep -E "Error|Traceback|FAILED" "$log" | head -5
}

# the realistic case: the built-in trained model (12M, dsv4/assets/dsv4-demo) and its trained DSpark drafter on
# held-out standard-library code (acceptance length 2.42 in `dsv4 eval` on the CPU), beside the oracle's bound;
# a tiny model, so the step times are launch-bound: read acceptance and speed-up, not absolute tokens/s
part_demo() {
  local t0=$SECONDS log=$out/spec_decode_demo.log
  timeout 200 python3 benchmarks/spec_decode_speed.py --model dsv4/assets/dsv4-demo --prompts held-out-code \
    --modes plain,oracle,drafter --batch-sizes "${BATCHES:-1,2,4,8,16,32}" --input-len 256 \
    --output-len "${OUTPUT_LEN:-128}" ${VERIFY_DECODE:+--verify-decode} ${DRAFTER_GRAPHS:+--drafter-cuda-graphs} \
    ${PIPELINED:+--pipelined} ${ADAPTIVE:+--adaptive} ${PHASE_PROFILE:+--phase-profile} --output-json "$out/spec_decode_demo.json" \
    > "$log" 2>&1
  echo "spec_decode_speed demo (rc $?): $((SECONDS - t0)) s"
  sed -n '/^spec_decode_speed: /,$p' "$log"
  grep -E "Error|Traceback|FAILED" "$log" | head -5
}

# the verify rows' logits against plain decoding's, position by position (benchmarks/spec_logit_agreement.py), one
# request, fixed speculation with the oracle (or the adaptive switch with ADAPTIVE=1), $DTYPE (default float32)
part_agree() {
  local dir; dir=$(drafter_dir)
  make_drafter_preset "$dir" || { tail -5 "$out/make_model.log" 2>/dev/null; return 1; }
  local tag=spec_logit_agreement${ADAPTIVE:+_adaptive}
  timeout "${BENCH_LIMIT:-280}" python3 benchmarks/spec_logit_agreement.py --model "$dir" --input-len "${INPUT_LEN:-512}" \
    --output-len "${OUTPUT_LEN:-256}" --dtype "${DTYPE:-float32}" ${ADAPTIVE:+--adaptive} \
    --output-json "$out/$tag.json" > "$out/$tag.log" 2>&1
  echo "$tag (rc $?): $(tail -3 "$out/$tag.log" | tr '\n' ' ')"
}

run_parts "$@"
