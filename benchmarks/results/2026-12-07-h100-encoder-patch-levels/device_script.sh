# session 21, device call A: encoder graphs with two patch-row levels, Triton (EVEN_D) vs cuDNN graph attention; encoder GPU tests
export PYTHONPATH=.; . benchmarks/device_lib.sh
L=$OUT/logs; mkdir -p $L; out=$L
T0=$(date +%s); END=$((T0 + ${BUDGET:-575}))
need() { local left=$((END - $(date +%s))); [ $left -ge $1 ] || { echo "skip $2 (left $left s)"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
need 120 tests && gpu_pytest 200 enc_tests.log tests/gpu/test_varlen_attention_gpu.py tests/gpu/test_encoder_cudagraphs_gpu.py
grep -E "FAILED|Error" $L/enc_tests.log | head -8
for cfg in "steps4-triton 4 triton" "steps4-cudnn 4 cudnn"; do
  set -- $cfg
  need 90 $1 || continue
  timeout $(( END - $(date +%s) > 200 ? 200 : END - $(date +%s) - 5 )) python3 benchmarks/encoder_latency.py --vision released --iters 10 --warmup 2 --budget-steps $2 --graph-attention $3 --sizes 544x544 640x640 768x768 1024x768 896x896 --counts 1 2 --output-json $L/enc-$1.json > $L/enc-$1.log 2>&1
  echo "enc $1 rc $?"; grep -E "^\| [0-9]|Error" $L/enc-$1.log
done
need 70 attn && { timeout $((END - $(date +%s) - 5)) python3 -u benchmarks/varlen_attention_bench.py --json $L/varlen_attention.json > $L/varlen_attention.log 2>&1; echo "varlen rc $?"; grep -E "^(544|896|1024|1536)" $L/varlen_attention.log; }
echo "elapsed $(( $(date +%s) - T0 )) s"
