#!/usr/bin/env bash
# Issue 6's GPU runs (prefix caching with SWA bounded replay). From the repo root with PYTHONPATH=.:
#   benchmarks/run_issue6.sh OUTDIR PART [PART ...]
#   tests   tests/gpu
#   chat    `dsv4 bench chat` on the V4.1-Flash-8l preset, 30 turns, for each turn length in $TURN_LENS (default
#           "512") and each mode in $MODES (default "off bounded exact"); writes OUTDIR/chat-<len>-<mode>.json
set -uo pipefail
out=$1; shift; mkdir -p "$out"
p=v41-flash-8l
for part in "$@"; do
  case $part in
    tests)
      timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log" ;;
    chat)
      [ -d /tmp/$p ] || timeout 150 python3 -m dsv4.cli make-model --preset $p --out /tmp/$p --device cuda > /dev/null
      for len in ${TURN_LENS:-512}; do for mode in ${MODES:-off bounded exact}; do
        timeout ${CHAT_LIMIT:-150} python3 -m dsv4.cli bench chat --model /tmp/$p --turns 30 --turn-len $len \
          --output-len 16 --prefix-caching $mode --output-json "$out/chat-$len-$mode.json" > "$out/chat-$len-$mode.log" 2>&1
        echo "chat $len $mode (rc $?): $(grep -E 'TTFT|cache|Error' "$out/chat-$len-$mode.log" | tr -s ' ' | tr '\n' ' ')"
      done; done ;;
  esac
done
