#!/usr/bin/env bash
# Decode of both Flash presets under each engine mode (graphs, async, eager, the HF baseline), in device calls of at
# most ~9 minutes each (every command has its own limit, so a slow part cannot eat the rest). Run from the repo root
# with PYTHONPATH=.:
#   benchmarks/run_decode_modes.sh OUTDIR PART [PART ...]
#   tests        tests/gpu, then both presets at batch 1 and 32: graphs, graphs+async
#   kernels      tests/gpu/test_kernels_gpu.py alone
#   sizes        both presets at batch 8 and 64: graphs, graphs+async
#   v41-async    V4.1 at batch 1 and 32, graphs+async
#   eager        both presets eager at batch 1/8/32/64
#   hf           V4 --baseline hf at batch 1 and 32 (ours with graphs+async)
#   grouped      the grouped-expert GPU tests with the engine and graph tests, then V4 batch 1 and V4.1 batch 32
#                (graphs+async; their prefill times show the grouped MoE of prefill steps)
#   compile-v4   V4 at batch 1 and 32 (or $BATCHES) with --compile-decode --async-scheduling
#   compile-v41  the same for V4.1 (its compile takes minutes per graph size)
# Async scheduling is the engine's default on CUDA: the `graphs` and `eager` runs turn it off explicitly.
# Each bench writes OUTDIR/<preset>-b<B>-<tag>.json (+ .log); one summary line per run goes to stdout.
set -uo pipefail
out=$1; shift; mkdir -p "$out"
make() { [ -d /tmp/$1 ] || timeout 150 python3 -m dsv4.cli make-model --preset $1 --out /tmp/$1 --device cuda > /dev/null; }
bench() {  # bench LIMIT PRESET BATCH TAG [extra args]
  local limit=$1 p=$2 b=$3 tag=$4; shift 4
  timeout $limit python3 -m dsv4.cli bench latency --model /tmp/$p --batch-size $b --input-len 512 --output-len 32 \
    --num-iters 2 --output-json "$out/$p-b$b-$tag.json" "$@" > "$out/$p-b$b-$tag.log" 2>&1
  echo "$p b$b $tag (rc $?): $(grep -E 'decode step|fraction of floor|hf |Error' "$out/$p-b$b-$tag.log" | tr -s ' ' | tr '\n' ' ')"
}
for part in "$@"; do
  presets="v4-flash-4l v41-flash-8l"
  case $part in compile-v4|hf) presets=v4-flash-4l ;; compile-v41|v41-async) presets=v41-flash-8l ;; kernels) presets= ;; esac
  for p in $presets; do make $p; done
  case $part in
    tests)
      timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
      for p in $presets; do for b in 1 32; do
        bench 60 $p $b graphs --cudagraph-capture-sizes $b --no-async-scheduling
        bench 60 $p $b async --cudagraph-capture-sizes $b --async-scheduling
      done; done ;;
    kernels)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py > "$out/gpu_kernel_tests.log" 2>&1
      tail -3 "$out/gpu_kernel_tests.log" ;;
    sizes)
      for p in $presets; do for b in 8 64; do
        bench 60 $p $b graphs --cudagraph-capture-sizes $b --no-async-scheduling
        bench 60 $p $b async --cudagraph-capture-sizes $b --async-scheduling
      done; done ;;
    v41-async)
      for b in 1 32; do bench 60 $presets $b async --cudagraph-capture-sizes $b --async-scheduling; done ;;
    eager)
      for p in $presets; do for b in 1 8 32 64; do bench 90 $p $b eager --enforce-eager --no-async-scheduling; done; done ;;
    hf)
      for b in 1 32; do bench 150 $presets $b async-hf --cudagraph-capture-sizes $b --async-scheduling --baseline hf; done ;;
    grouped)
      # (-k applies to every file named, so the kernel test is selected by its node id)
      timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py::test_expert_grouped \
        tests/gpu/test_engine_cuda.py tests/gpu/test_cudagraphs.py > "$out/gpu_grouped_tests.log" 2>&1
      tail -3 "$out/gpu_grouped_tests.log"
      bench 60 v4-flash-4l 1 async-grouped --cudagraph-capture-sizes 1 --async-scheduling
      bench 60 v41-flash-8l 32 async-grouped --cudagraph-capture-sizes 32 --async-scheduling ;;
    compile-v4|compile-v41)
      for b in ${BATCHES:-1 32}; do
        bench 270 $presets $b compile-async --cudagraph-capture-sizes $b --compile-decode --async-scheduling
      done ;;
  esac
done
