# session 20, device call A: rows threshold A/B at b32, LM head GEMV at b1, idle b1, encoder sweep
export PYTHONPATH=.; . benchmarks/device_lib.sh
L=$OUT/logs; mkdir -p $L; out=$L
T0=$(date +%s); END=$((T0 + ${BUDGET:-575}))
need() { local left=$((END - $(date +%s))); [ $left -ge $1 ] || { echo "skip $2 (left $left s)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
need 200 ab32 && BATCH=32 AB="DSV4_ROWS_MIN_ROWS_PER_SM=0.375" bash benchmarks/run_mixed_load.sh $L ab
grep -h "of floor" $L/ab-b32-*.log | head -4
need 150 gemv && for v in 0 head; do
  p=v4-flash-4l; make_preset $p
  DSV4_BF16_GEMV=$v timeout 200 python3 -u benchmarks/profile_graph.py /tmp/$p 1 20 > "$L/decode_b1-gemv$v.log" 2>&1
  echo "v4 b1 DSV4_BF16_GEMV=$v (rc $?):"; grep -E "replay alone|engine step \(|logits|of floor" "$L/decode_b1-gemv$v.log"
done
need 120 idle1 && bash benchmarks/run_mixed_load.sh $L idle
need 100 enc && { timeout $((END - $(date +%s) - 5)) python3 benchmarks/encoder_latency.py --vision released --iters 10 --warmup 2 --sizes 544x544 640x640 768x768 1024x768 896x896 --counts 1 2 > $L/encoder.log 2>&1; echo "enc rc $?"; grep -E "^\| [0-9]" $L/encoder.log; }
echo "elapsed $(( $(date +%s) - T0 )) s"
