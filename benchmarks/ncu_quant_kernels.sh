#!/usr/bin/env bash
# Nsight Compute on the quantized decode kernels (benchmarks/ncu_quant_kernels.py) on one H200 (Firecracker kinds
# read the hardware counters). From the repo root, PYTHONPATH=.:
#   benchmarks/ncu_quant_kernels.sh OUTDIR
# Every launch of the gemv and grouped kernels (each case: its checked warm-up, then 2): speed of light, warp-state
# stall reasons, scheduler issue, occupancy, memory workload, launch statistics, as CSV; the clocks as found
# (--clock-control none: the card's settings are left alone).
set -uo pipefail
out=$1; mkdir -p "$out"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu_bin" ] || { echo "ncu not found" >&2; exit 1; }
timeout 400 "$ncu_bin" --clock-control none -k 'regex:_expert_(gemv|grouped)_q_kernel' \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section MemoryWorkloadAnalysis --section LaunchStats --csv --page details \
  python3 benchmarks/ncu_quant_kernels.py --reps 2 > "$out/ncu_quant_kernels.csv" 2> "$out/ncu_quant_kernels.err"
echo "ncu rc $?"
grep -E 'rel_err' "$out/ncu_quant_kernels.csv" || true
grep -E '"(Duration|Memory Throughput|Achieved Occupancy|Stall Long Scoreboard|Stall Barrier|Stall Wait|Issue Slots Busy)"' \
  "$out/ncu_quant_kernels.csv" | cut -c1-200 | head -60
