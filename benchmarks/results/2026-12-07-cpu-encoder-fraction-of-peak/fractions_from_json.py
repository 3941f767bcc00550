"""The work of each case of committed `encoder_latency.py` JSON files against the bf16 dense peak (989.5 TFLOP/s,
the H100 SXM's and the H200's), with the script's own `work_fields`: runs on a CPU, the times come from the files.

    PYTHONPATH=. python benchmarks/results/2026-12-07-cpu-encoder-fraction-of-peak/fractions_from_json.py FILE...
"""

import importlib.util
import json
import sys

spec = importlib.util.spec_from_file_location("encoder_latency", "benchmarks/encoder_latency.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
cfg, hidden = bench.VISIONS["released"][:2]
PEAK = 989.5e12

for path in sys.argv[1:]:
    print(path)
    print("| size | images | span | eager ms | graphs ms | speedup | TFLOP eager / graphs | floor ms "
          "| eager / graphs % of peak | 2x needs % of peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in json.load(open(path))["results"]:
        e, g = r["eager_ms"]["median"], r["graphs_ms"]["median"]
        w = bench.work_fields(cfg, hidden, tuple(r["vit_grid"]), r["batches"], e, g, PEAK)
        print(f"| {r['size']} | {r['images']} | {r['span_tokens']} | {e:.2f} | {g:.2f} | {r['speedup']:.2f}x "
              f"| {w['eager_flops'] / 1e12:.2f} / {w['graphs_flops'] / 1e12:.2f} | {w['floor_ms']:.2f} "
              f"| {100 * w['eager_fraction_of_peak']:.0f} / {100 * w['graphs_fraction_of_peak']:.0f} "
              f"| {100 * w['graphs_fraction_for_2x']:.0f} |")
