"""The deepest slice of DeepSeek-V4.1-Flash one GPU holds (issue 22, item 3): configs and the weight plan.

usage: PYTHONPATH=. python3 benchmarks/v41_flash_slice.py plan [--gib 139.8] [--utilization 0.95] [--reserve-gib 8]
       PYTHONPATH=. python3 benchmarks/v41_flash_slice.py write LAYERS OUT_DIR [--engram-layers 1]

`write` writes the config.json + tokenizer (`make-model --config-only --quant released`, for `--load-format dummy`)
of the first LAYERS layers of the released 40-layer schedule at full width (384 experts; FP8 32x32 dense, MXFP4
experts), with the KV / index sources among them. The candidate source (layer 20, the first ratio-1 KV source) is
kept when the slice reaches it; a shorter slice has no ratio-1 layer, so no candidate pre-selection (-1). Engram:
on the released layers 1 and 14 that `--engram-layers` keeps (default: layer 1 only). Every table is full size
(384 M rows, 94.4 GiB: the table rows follow from engram_vocab_size, one value for all layers, and the engine
refuses a table smaller than its hash layout), and the 1-GPU machine's 125 GiB of host memory holds one of them,
not the two (189 GiB) of the release.

`plan` prints, for every depth, the weights one GPU holds (`dsv4.engine.memory_plan`'s count from the config alone;
the Engram tables in host memory) and marks the deepest slice whose weights plus `--reserve-gib` (KV pool, the
worst-case step's activations, CUDA graphs: ~6-8 GiB measured on the 8-layer preset) fit in utilization x the
GPU's memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

import torch

from dsv4.models.config_v41 import RELEASED_INDEX_SOURCES, RELEASED_KV_SOURCES, RELEASED_RATIOS

RELEASED_LAYERS = 40
CANDIDATE_SOURCE = RELEASED_KV_SOURCES[-1]  # layer 20: the first ratio-1 layer, the candidate source
MIN_LAYERS = RELEASED_KV_SOURCES[0] + 1  # a slice needs its first KV source (layer 2)
_GIB = float(1 << 30)


def slice_overrides(layers: int, engram_layers: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Text-config fields of the first `layers` layers of the released V4.1-Flash schedule."""
    if not MIN_LAYERS <= layers <= RELEASED_LAYERS:
        raise ValueError(f"a slice has {MIN_LAYERS} to {RELEASED_LAYERS} layers, got {layers}")
    return {
        "num_hidden_layers": layers,
        "compress_ratios": list(RELEASED_RATIOS[:layers]),
        "kv_source_layer_ids": [i for i in RELEASED_KV_SOURCES if i < layers],
        "index_source_layer_ids": [i for i in RELEASED_INDEX_SOURCES if i < layers],
        "candidate_source_layer_id": CANDIDATE_SOURCE if CANDIDATE_SOURCE < layers else -1,
        "engram_layer_ids": [i for i in engram_layers if i < layers],
    }


def write_slice(layers: int, out: str, engram_layers: tuple[int, ...] = (1,)) -> str:
    from dsv4.make_model import make_model

    return make_model("v41-flash", out, overrides=slice_overrides(layers, engram_layers), quant="released",
                      config_only=True)


def planned_bytes(model_dir: str) -> dict[str, int]:
    """Weight bytes by kind of the checkpoint at model_dir as one GPU holds it (bf16 model dtype, the checkpoint's
    quantization): what `dsv4.engine.memory_plan.planned_weight_bytes` counts on one rank, from the config alone."""
    from dsv4.engine.memory_plan import KINDS, kind_of
    from dsv4.models.build import checkpoint_layout
    from dsv4.models.config import load_model_config
    from dsv4.quant.config import load_quant_config

    out = dict.fromkeys(KINDS, 0)
    layout = checkpoint_layout(load_model_config(model_dir), torch.bfloat16, load_quant_config(model_dir))
    for name, (shape, dt) in layout.items():
        out[kind_of(name)] += math.prod(shape) * dt.itemsize
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan")
    pl.add_argument("--gib", type=float, default=139.8, help="GPU memory in GiB (default: an H200's 139.8)")
    pl.add_argument("--utilization", type=float, default=0.95)
    pl.add_argument("--reserve-gib", type=float, default=8.0, help="KV pool + activations + graphs (default 8)")
    wr = sub.add_parser("write")
    wr.add_argument("layers", type=int)
    wr.add_argument("out")
    wr.add_argument("--engram-layers", default="1", help="released engram layers kept, among 1,14 (default 1)")
    args = p.parse_args(argv)
    if args.cmd == "write":
        print(write_slice(args.layers, args.out, tuple(int(v) for v in args.engram_layers.split(",") if v)))
        return
    budget = args.gib * args.utilization - args.reserve_gib
    rows, deepest = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for layers in range(MIN_LAYERS, RELEASED_LAYERS + 1):
            d = write_slice(layers, os.path.join(tmp, str(layers)))
            plan = planned_bytes(d)
            device = sum(v for k, v in plan.items() if k != "engram") / _GIB
            rows.append({"layers": layers, "device_gib": round(device, 2), "engram_host_gib": round(
                plan["engram"] / _GIB, 2), **{k: round(v / _GIB, 2) for k, v in plan.items() if v}})
            if device <= budget:
                deepest = layers
    for r in rows:
        mark = "  <- deepest" if r["layers"] == deepest else ""
        print(f"L={r['layers']:2d}  weights on the GPU {r['device_gib']:7.2f} GiB  (engram on the host "
              f"{r['engram_host_gib']:.2f} GiB){mark}")
    print(json.dumps({"budget_gib": round(budget, 2), "deepest": deepest, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
