# Shared by the benchmarks/run_issue*.sh device scripts (sourced): each defines a function part_NAME per part it
# offers and ends with `run_parts "$@"`. Every command carries its own time limit, so a slow part cannot eat the
# device call's budget; each writes its log under $out and prints one summary line.
set -uo pipefail

# make_preset NAME: the random-weight checkpoint /tmp/NAME (drawn on the GPU), unless it is there already
make_preset() {
  [ -d "/tmp/$1" ] || timeout 150 python3 -m dsv4.cli make-model --preset "$1" --out "/tmp/$1" --device cuda > /dev/null
}

# use_wheels: install the wheels carried in .whl/ (`run` with carry [".whl"]: fastapi/uvicorn for a served
# benchmark, xgrammar; the device has no package registry) into /tmp/site and put it on PYTHONPATH; once per machine
use_wheels() {
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/ carried: run with carry [\".whl\"]" >&2; return 1; }
  if [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "use_wheels: installing .whl/*.whl failed" >&2; return 1; }
    touch /tmp/site/.done
  fi
  export PYTHONPATH=".:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}

# gpu_pytest LIMIT LOGNAME PYTEST_ARGS...: run pytest quietly into $out/LOGNAME, print its last lines
gpu_pytest() {
  local limit=$1 log=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$out/$log" 2>&1
  tail -3 "$out/$log"
}

# summary LABEL RC LOG PATTERN: one line with the run's exit status and the log lines matching PATTERN
summary() {
  echo "$1 (rc $2): $(grep -E "$4" "$3" | tr -s ' ' | tr '\n' ' ')"
}

# prefill_latency TAG BATCH INPUT_LEN BUDGET: one `dsv4 bench latency` prefill of /tmp/$p (2 output tokens, 2
# iterations, BUDGET tokens a step) into $out/TAG.{json,log}, one summary line; DSV4_* switches set before the call
# (`DSV4_X=0 prefill_latency ...`) reach the run
prefill_latency() {
  local args="bench latency --model /tmp/$p --batch-size $2 --input-len $3 --output-len 2 --num-iters 2"
  args="$args --max-model-len $(($3 + 64)) --max-num-batched-tokens $4"
  timeout 300 python3 -m dsv4.cli $args --output-json "$out/$1.json" > "$out/$1.log" 2>&1
  summary "$1" $? "$out/$1.log" 'prefill, synced|prefill tokens/s|Error'
}

# run_parts OUTDIR PART...: run part_PART for each PART, in order, with $out set to OUTDIR (created)
run_parts() {
  out=$1; shift; mkdir -p "$out"
  local part
  for part in "$@"; do
    if declare -F "part_$part" > /dev/null; then "part_$part"; else echo "unknown part: $part" >&2; fi
  done
}
