#!/usr/bin/env bash
# Decode step time of several commits in one device call (issue 24: which change took batch-1 V4.1 decode from
# 3.353 ms on df0fcc9 to 3.656 ms). Prepare the trees here, then carry them:
#   for c in C1 C2 ...; do mkdir -p .bisect/$c && git archive $c dsv4 | tar x -C .bisect/$c; done
#   run: PYTHONPATH=. bash benchmarks/run_decode_bisect.sh OUTDIR C1 C2 ...      (carry [".bisect"])
# `HEAD` as a name means the tree the call runs in. The checkpoint is made once by this tree's make-model
# (V4.1-Flash-8l, random bf16; its format has not changed since df0fcc9). Each tree runs
#   dsv4 bench latency --batch-size 1 --input-len 512 --output-len 64 --num-iters 3 --cudagraph-capture-sizes 1
# (graphs + async, the default); the commits alternate over $ROUNDS rounds (default 2), so drift of the machine
# shows as round-to-round spread rather than as a difference between commits. ~35 s per run (start-up, capture of
# one graph size, 3 iterations).
. "$(dirname "$0")/device_lib.sh"
out=$1; shift; mkdir -p "$out"
runs=/tmp/bisect-runs; rm -rf "$runs"; mkdir -p "$runs"  # the device returns ~8 files: runs go into one tar
p=v41-flash-8l
make_preset $p
root=$PWD
for round in $(seq 1 "${ROUNDS:-2}"); do
  for c in "$@"; do
    dir=$root/.bisect/$c; [ "$c" = HEAD ] && dir=$root
    [ -d "$dir/dsv4" ] || { echo "$c: no tree at $dir (carry .bisect)"; continue; }
    tag="$c-r$round"
    (cd "$dir" && PYTHONPATH=. timeout 150 python3 -m dsv4.cli bench latency --model /tmp/$p --batch-size 1 \
      --input-len 512 --output-len 64 --num-iters 3 --cudagraph-capture-sizes 1 --output-json "$runs/$tag.json") \
      > "$runs/$tag.log" 2>&1
    summary "$tag" $? "$runs/$tag.log" '^decode step|fraction of floor|Error' | tee -a "$out/bisect.txt"
  done
done
tar czf "$out/bisect-runs.tgz" -C /tmp bisect-runs
