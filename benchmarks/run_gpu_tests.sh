#!/usr/bin/env bash
# tests/gpu file by file in one device call, each file under its own time limit, so one slow or hanging file costs
# only its limit and the rest still run. From the repo root, PYTHONPATH=.:
#   benchmarks/run_gpu_tests.sh OUTDIR [FILE ...]       (default: every tests/gpu/test_*.py)
# LIMIT: seconds a file may take (default 150); TOTAL: seconds for the whole run (default 560: a device call is 600);
# a file that would start with less than 20 s left is listed as NOT RUN. With .whl/ carried (`run` carry [".whl"])
# the wheels are installed first (xgrammar: test_structured_outputs_gpu). Prints one line per file (its exit status
# and pytest's last line); the logs come back as OUTDIR/gpu_tests.tgz (the device returns only a few files).
. "$(dirname "$0")/device_lib.sh"
out=$1; shift
mkdir -p "$out/logs"
ls .whl/*.whl > /dev/null 2>&1 && use_wheels
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(tests/gpu/test_*.py)
end=$((SECONDS + ${TOTAL:-560}))
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  left=$((end - SECONDS))
  if [ $left -lt 20 ]; then echo "$name NOT RUN (time)"; continue; fi
  limit=${LIMIT:-150}
  [ $left -lt "$limit" ] && limit=$left
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$f" -rfE --durations=5 > "$out/logs/$name.log" 2>&1
  echo "$name rc=$? $(tail -1 "$out/logs/$name.log")"
done
tar czf "$out/gpu_tests.tgz" -C "$out" logs && rm -rf "$out/logs"
