"""What a full cyclic garbage collection costs a process that holds an engine, before and after
`freeze_startup_heap` (dsv4/runtime/host_gc.py): the objects the collector tracks and the time of `gc.collect()`.

usage: PYTHONPATH=. python3 benchmarks/gc_full_collection.py [MODEL_DIR or PRESET] [--device cpu|cuda] [--json PATH]

A preset name (e.g. tiny-v41, the default) is drawn into a temporary folder first. The engine generates a few
tokens (so its lazy state exists), then: tracked objects and the fastest of 5 full collections; the freeze; the
same again. Host-side only: the device does not matter to the numbers, the engine's Python objects do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

from dsv4 import LLM, SamplingParams
from dsv4.runtime.host_gc import freeze_startup_heap


def full_collection_ms(repeats: int = 5) -> float:
    """The fastest of `repeats` full collections, in milliseconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="tiny-v41")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model
    if not os.path.isdir(model):
        from dsv4.make_model import make_model

        model = make_model(model, os.path.join(tempfile.mkdtemp(), model), seed=0)
    llm = LLM(model, device=args.device, max_model_len=256)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    before = {"tracked": len(gc.get_objects()), "full_ms": full_collection_ms()}
    frozen = freeze_startup_heap()
    after = {"tracked": len(gc.get_objects()), "full_ms": full_collection_ms(), "frozen": frozen}
    print(f"{args.model} on {args.device}: {before['tracked']} tracked objects, a full collection "
          f"{before['full_ms']:.2f} ms; frozen {frozen}: {after['tracked']} tracked, {after['full_ms']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "before": before, "after": after}, f, indent=1)
    del llm


if __name__ == "__main__":
    main()
