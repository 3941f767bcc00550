#!/usr/bin/env bash
# Specialized decode (CUDA graphs of the decode-metadata builds) against the default engine. From the repo root,
# PYTHONPATH=.:
#   benchmarks/run_specialized_decode.sh OUTDIR PART [PART ...]
#   tests   tests/gpu/test_metadata_graphs_gpu.py, then the rest of tests/gpu
#   variants  V4.1-Flash-8l at b1, one process per engine (the first engine of a process was measured faster):
#           the forward graph's device time and step time of default, default:sidestream, latency_specialized and
#           its serial / nostage / serial,nostage variants (benchmarks/metadata_host.py): what slows the forward
#           graph of a specialized engine; first benchmarks/graph_streams_repro.py (the same question, no engine).
#           DUMP=1: each forward graph also goes to OUTDIR/dot/VARIANT-b1.dot (Graphviz, to diff fast and slow:
#           benchmarks/graph_dot_diff.py, run on the first two into OUTDIR/dot_diff.log; the dumps are then packed
#           into OUTDIR/dots.tgz); VARIANTS="v1 v2 ..." runs only those (and not the repro)
#   bench   V4.1-Flash-8l decode at batch $BATCHES (default "1 4 16 64"), FULL graphs (capture size = batch) and
#           async scheduling, with --decode-backend default and latency_specialized; each JSON carries the decode
#           step time, the host launch time per step and the metadata build's host time inside it
. "$(dirname "$0")/device_lib.sh"
p=v41-flash-8l
md_tests=tests/gpu/test_metadata_graphs_gpu.py

part_tests() {
  gpu_pytest 120 gpu_md_tests.log $md_tests
  gpu_pytest 300 gpu_tests.log tests/gpu --deselect $md_tests
}

part_variants() {
  [ -n "$VARIANTS" ] || timeout 60 python3 benchmarks/graph_streams_repro.py 2>&1 | tee "$out/graph_streams_repro.log"
  make_preset $p
  local v
  for v in ${VARIANTS:-default default:sidestream latency_specialized latency_specialized:serial \
           latency_specialized:nostage latency_specialized:serial,nostage default}; do
    timeout 120 python3 benchmarks/metadata_host.py /tmp/$p --batch 1 --steps 60 --backends $v ${DUMP:+--dump $out/dot} 2>&1 \
      | grep -E "^\{|debug|Debug|DEBUG" | tee -a "$out/variants.log"
  done
  # the dumps are large and many (a device call brings back at most 8 files of 16 MiB): diff the first two here,
  # then keep them only compressed
  if [ -n "$DUMP" ]; then
    local dots=("$out"/dot/*.dot)
    [ ${#dots[@]} -ge 2 ] && python3 benchmarks/graph_dot_diff.py "${dots[0]}" "${dots[1]}" > "$out/dot_diff.log" 2>&1
    tar -czf "$out/dots.tgz" -C "$out" dot && rm -r "$out/dot"
  fi
}

part_bench() {
  make_preset $p
  local b backend tag
  for b in ${BATCHES:-1 4 16 64}; do for backend in default latency_specialized; do
    tag="$p-b$b-$backend"
    timeout 90 python3 -m dsv4.cli bench latency --model /tmp/$p --batch-size $b --input-len 512 --output-len 32 \
      --num-iters 2 --cudagraph-capture-sizes $b --decode-backend $backend \
      --output-json "$out/$tag.json" > "$out/$tag.log" 2>&1
    summary "$p b$b $backend" $? "$out/$tag.log" 'decode step|host launch|metadata|Error'
  done; done
}

run_parts "$@"
