#!/usr/bin/env bash
# Native FP8 / MXFP4 weights on one H200. From the repo root, PYTHONPATH=.:
#   benchmarks/run_quant.sh OUTDIR PART [PART ...]
#   tests     all of tests/gpu (the quantized kernels' tests among them)
#   kernels   benchmarks/fp8_linear_bench.py and benchmarks/moe_quant_bench.py (W8A16 vs W8A8, W4A16 vs bf16)
#   bench     $PRESETS (default "v4-flash-4l v41-flash-8l") written in bf16 and with --quant released; decode at
#             batch $BATCHES (default "1 32", input 512, output 32, FULL graphs + async) and prefill 32 x 512;
#             $FORMATS (default "bf16 released") picks which of the two run
#   moe       the routed-expert kernels with the cut-down presets' 16 experts (the grouped kernel's forms and tiles
#             at T=32 and 512, the row plan torch vs one launch) and with V4-Flash's 256 at decode (moe_quant_bench.py)
#   GROUPED_Q='dict(prefetch_x_max_block_m=64)' (any part): that update of GROUPED_Q_CONFIG for the engine runs
#   TAG=-x (bench): appended to the result names, to keep two runs of one checkpoint apart; LIMIT=S: each engine
#             run's time limit (default 150 s; a V4.1 start on a fresh machine compiles its kernels cold: give it 300)
#   realsize  v4-flash with --load-format dummy at $DEPTH layers (default 30): memory map, decode at batch 1 and 32
# Each bench writes OUTDIR/<checkpoint>-b<B>.json (+ .log); one summary line per run goes to stdout.
. "$(dirname "$0")/device_lib.sh"

# make_quant NAME: /tmp/NAME-released, the preset written in the released layout (drawn on the GPU)
make_quant() {
  [ -d "/tmp/$1-released" ] || timeout 240 python3 -m dsv4.cli make-model --preset "$1" --out "/tmp/$1-released" \
    --device cuda --quant released > /dev/null
}

# dsv4's CLI; with GROUPED_Q='dict(prefetch_x_max_block_m=64)' (a Python dict expression) the grouped quantized
# expert kernel's config is updated with it first (dsv4.ops.moe_quant.GROUPED_Q_CONFIG), e.g. to time another form
CLI=(python3 -c "import sys; from dsv4.ops import moe_quant; moe_quant.GROUPED_Q_CONFIG.update(${GROUPED_Q:-{\}});
from dsv4.cli import main; sys.exit(main(sys.argv[1:]))")

bench() {  # bench LIMIT DIR BATCH TAG [extra args]
  local limit=$1 dir=$2 b=$3 tag=$4; shift 4
  timeout "$limit" "${CLI[@]}" bench latency --model "$dir" --batch-size "$b" --input-len 512 \
    --output-len 32 --num-iters 2 --cudagraph-capture-sizes "$b" --output-json "$out/$tag-b$b.json" "$@" \
    > "$out/$tag-b$b.log" 2>&1
  summary "$tag b$b" $? "$out/$tag-b$b.log" 'decode step|fraction|prefill|load|Error'
}

part_tests() { gpu_pytest 420 gpu_tests.log tests/gpu; }

part_kernels() {
  timeout 150 python3 benchmarks/fp8_linear_bench.py --json "$out/fp8_linear.json" > "$out/fp8_linear.log" 2>&1
  tail -40 "$out/fp8_linear.log"
  timeout 150 python3 benchmarks/moe_quant_bench.py --json "$out/moe_quant.json" > "$out/moe_quant.log" 2>&1
  tail -20 "$out/moe_quant.log"
}

part_moe() {
  timeout 300 python3 benchmarks/moe_quant_bench.py --models v4-flash --experts 16 --tokens 1,32,512 \
    --sweep-grouped --plan --json "$out/moe_decode_e16.json" > "$out/moe_decode_e16.log" 2>&1
  tail -8 "$out/moe_decode_e16.log"
  timeout 100 python3 benchmarks/moe_quant_bench.py --models v4-flash --tokens 1,32 \
    --json "$out/moe_decode_e256.json" > "$out/moe_decode_e256.log" 2>&1
  tail -5 "$out/moe_decode_e256.log"
}

part_bench() {
  local p b
  for p in ${PRESETS:-v4-flash-4l v41-flash-8l}; do
    case " ${FORMATS:-bf16 released} " in *" bf16 "*) make_preset "$p"; du -sb "/tmp/$p";; esac
    make_quant "$p"; du -sb "/tmp/$p-released"
    for b in ${BATCHES:-1 32}; do
      case " ${FORMATS:-bf16 released} " in *" bf16 "*) bench "${LIMIT:-150}" "/tmp/$p" "$b" "$p-bf16${TAG:-}";; esac
      case " ${FORMATS:-bf16 released} " in *" released "*)
        bench "${LIMIT:-150}" "/tmp/$p-released" "$b" "$p-released${TAG:-}";; esac
    done
  done
}

part_realsize() {
  local d=/tmp/v4-flash-dummy b
  python3 -m dsv4.cli make-model --preset v4-flash --out $d --config-only --quant released > /dev/null || return
  python3 - "$d/config.json" "${DEPTH:-30}" <<'PY'  # the first DEPTH layers of the released schedule
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
c = json.load(open(path))
c["num_hidden_layers"] = n
c["layer_types"], c["mlp_layer_types"] = c["layer_types"][:n], c["mlp_layer_types"][:n]
json.dump(c, open(path, "w"), indent=1)
PY
  for b in 1 32; do
    bench 300 $d "$b" "v4-flash-${DEPTH:-30}l-dummy" --load-format dummy
  done
}

run_parts "$@"
