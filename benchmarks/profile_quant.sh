#!/usr/bin/env bash
# Where a quantized decode step's time goes on one H200 (profile_graph.py rows). From the repo root, PYTHONPATH=.:
#   benchmarks/profile_quant.sh OUTDIR
# v4-flash with --load-format dummy at $DEPTH layers (default 8; released shapes, 256 experts) at batch 1 and 32,
# and the v4-flash-4l preset in bf16 and released at batch 1.
. "$(dirname "$0")/device_lib.sh"
out=$1; mkdir -p "$out"
d=/tmp/v4-flash-dummy-${DEPTH:-8}
python3 -m dsv4.cli make-model --preset v4-flash --out $d --config-only --quant released > /dev/null
python3 - "$d/config.json" "${DEPTH:-8}" <<'PY'
import json, sys
path, n = sys.argv[1], int(sys.argv[2])
c = json.load(open(path))
c["num_hidden_layers"] = n
c["layer_types"], c["mlp_layer_types"] = c["layer_types"][:n], c["mlp_layer_types"][:n]
json.dump(c, open(path, "w"), indent=1)
PY
for b in ${DUMMY_BATCHES-1 32}; do
  timeout 200 python3 benchmarks/profile_graph.py $d $b 20 --load-format=dummy > "$out/profile-v4-flash-${DEPTH:-8}l-dummy-b$b.log" 2>&1
  summary "dummy b$b" $? "$out/profile-v4-flash-${DEPTH:-8}l-dummy-b$b.log" 'replay alone|Error'
done
# PRESETS="v41-flash-8l v4-flash-4l": also profile those presets' released copies at $BATCHES
for p in ${PRESETS:-}; do
  [ -d /tmp/$p-released ] || timeout 240 python3 -m dsv4.cli make-model --preset $p --out /tmp/$p-released \
    --device cuda --quant released > /dev/null
  for b in ${BATCHES:-1 32}; do
    timeout 150 python3 benchmarks/profile_graph.py /tmp/$p-released $b 20 > "$out/profile-$p-released-b$b.log" 2>&1
    summary "$p released b$b" $? "$out/profile-$p-released-b$b.log" 'engine step|replay alone|logits|metadata|Error'
  done
done
