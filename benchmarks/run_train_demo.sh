#!/usr/bin/env bash
# The demo model's training run on one H200 (dsv4 train-demo, issue 25), in one device call of ~5.5 minutes.
# From the repo root, PYTHONPATH=.:
#   benchmarks/run_train_demo.sh OUTDIR [MINUTES] [TRAIN-DEMO ARGS...]     (e.g. --space-split-rate 0.1)
# Trains for MINUTES (default 4, an integer) with the defaults and any further train-demo arguments (target, then
# its DSpark drafter), then puts the run's record (train.log, train_info.json, train_log.csv, drafter_log.csv;
# loss.png is in the checkpoint) and the checkpoint, as a tar.gz split into 15 MB parts (the device tool returns
# files of at most 16 MiB), into OUTDIR. Reassemble on the other machine:
#   cat OUTDIR/dsv4-demo.tgz.part-* | tar xz -C DIR      (-> DIR/dsv4-demo)
# Then, on any machine: dsv4 eval --model DIR/dsv4-demo (bf16), dsv4 quantize + dsv4 eval (released FP8 / MXFP4),
# dsv4 eval --engine-arg speculative_config='{"method": "dspark"}' (the drafter's acceptance).
set -uo pipefail
out=$1
minutes=${2:-4}
shift $(( $# >= 2 ? 2 : $# ))
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout $(( minutes * 60 + 120 )) python3 -m dsv4.cli train-demo --out /tmp/dsv4-demo --max-minutes "$minutes" "$@" \
  > "$out/train.log" 2>&1
rc=$?
grep -v "^drafter step" "$out/train.log" | tail -25
for f in train_info.json train_log.csv drafter_log.csv; do  # 4 files + 3 parts: under the ~8 files returned
  [ -f "/tmp/dsv4-demo/$f" ] && cp "/tmp/dsv4-demo/$f" "$out/"
done
[ -d /tmp/dsv4-demo ] && tar czf - -C /tmp dsv4-demo | split -b 15M - "$out/dsv4-demo.tgz.part-"
echo "train-demo rc $rc; $(ls "$out" | wc -l) files in $out"
exit $rc
