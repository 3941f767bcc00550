# session 20, device call B: encoder attention tiles on H100; LM head GEMV wide tiles (forms, profile, latency); gemv GPU tests
export PYTHONPATH=.; . benchmarks/device_lib.sh
L=$OUT/logs; mkdir -p $L; out=$L
T0=$(date +%s); END=$((T0 + ${BUDGET:-560}))
need() { local left=$((END - $(date +%s))); [ $left -ge $1 ] || { echo "skip $2 (left $left s)"; return 1; }; }
nvidia-smi --query-gpu=name --format=csv,noheader
p=v4-flash-4l; make_preset $p
need 100 forms && { timeout 100 python3 -u benchmarks/bf16_gemv_forms.py /tmp/$p --default-only --json $L/gemv_default.json > $L/gemv_default.log 2>&1; echo "forms rc $?"; grep -E "x .*floor|one-row" $L/gemv_default.log; }
need 100 prof && for v in 0 head; do
  DSV4_BF16_GEMV=$v timeout 150 python3 -u benchmarks/profile_graph.py /tmp/$p 1 20 > "$L/decode_b1-gemv$v.log" 2>&1
  echo "v4 b1 DSV4_BF16_GEMV=$v (rc $?):"; grep -E "replay alone|engine step \(|logits" "$L/decode_b1-gemv$v.log"
done
for pp in v4-flash-4l v41-flash-8l; do for v in head 0; do
  need 80 lat$pp$v || continue; make_preset $pp
  DSV4_BF16_GEMV=$v timeout 150 python3 -m dsv4.cli bench latency --model /tmp/$pp --batch-size 1 --input-len 512 --output-len 64 --num-iters 3 --max-model-len 4096 --output-json "$L/lat-$pp-b1-gemv$v.json" > "$L/lat-$pp-b1-gemv$v.log" 2>&1
  summary "bench latency $pp b1 DSV4_BF16_GEMV=$v" $? "$L/lat-$pp-b1-gemv$v.log" "decode step|fraction|Error"
done; done
need 90 gemvtest && gpu_pytest 85 gemv_gpu.log tests/gpu/test_gemv_gpu.py
need 60 varlen && { timeout $((END - $(date +%s) - 5)) python3 -u benchmarks/varlen_attention_bench.py --json $L/varlen_attention.json > $L/varlen_attention.log 2>&1; echo "varlen rc $?"; tail -40 $L/varlen_attention.log; }
echo "elapsed $(( $(date +%s) - T0 )) s"
