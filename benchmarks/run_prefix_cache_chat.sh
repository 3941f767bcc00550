#!/usr/bin/env bash
# Multi-turn chat with prefix caching (SWA bounded replay against exact and off). From the repo root with PYTHONPATH=.:
#   benchmarks/run_prefix_cache_chat.sh OUTDIR PART [PART ...]
#   tests   tests/gpu
#   chat    `dsv4 bench chat` on the V4.1-Flash-8l preset, 30 turns, for each turn length in $TURN_LENS (default
#           "512") and each mode in $MODES (default "off bounded exact"); writes OUTDIR/chat-<len>-<mode>.json
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l

part_tests() { gpu_pytest 330 gpu_tests.log tests/gpu; }

part_chat() {
  make_preset $p
  local len mode log
  for len in ${TURN_LENS:-512}; do for mode in ${MODES:-off bounded exact}; do
    log="$out/chat-$len-$mode.log"
    timeout ${CHAT_LIMIT:-150} python3 -m dsv4.cli bench chat --model /tmp/$p --turns 30 --turn-len $len \
      --output-len 16 --prefix-caching $mode --output-json "$out/chat-$len-$mode.json" > "$log" 2>&1
    summary "chat $len $mode" $? "$log" 'TTFT|cache|Error'
  done; done
}

run_parts "$@"
