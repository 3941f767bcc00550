"""Host time an encoder-graph call spends before its replay can start: building a batch's metadata (patch positions,
the aligner's merge plan, the padded boundaries, the span gather index: `batch_metadata`) against finding it in the
manager's cache, and staging the batch's patches into one tensor (the copy the cache cannot save). Runs on the CPU:
these are host costs; a CUDA device adds pinning to the build.

    PYTHONPATH=. python benchmarks/encoder_host_metadata.py [--device cuda] [--sizes 544x544 ...] [--counts 1 2]

The released tower's image planning (patch size, merge ratio, limits) and the engine's budgets; no weights are used
(one layer of the tower is built, for the manager's shapes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv4.models.vision import VisionConfig, VisionEncoder
from dsv4.runtime.encoder_cudagraphs import EncoderCudaGraphManager, batch_metadata, llm_grid_of, plan_call, span_tokens

_spec = importlib.util.spec_from_file_location("encoder_latency", Path(__file__).parent / "encoder_latency.py")
assert _spec is not None and _spec.loader is not None
encoder_latency = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(encoder_latency)


def median_us(fn: Callable[[], Any], iters: int) -> float:
    """Median wall time of `fn` in microseconds, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["544x544", "640x640", "768x768", "1024x768", "896x896"])
    ap.add_argument("--counts", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    cfg = VisionConfig()
    device = torch.device(args.device)
    enc = VisionEncoder(VisionConfig(num_hidden_layers=1), 64).to(device)
    mgr = EncoderCudaGraphManager.from_limits(enc, 2048, 4096, device=device)
    pin = device.type == "cuda"
    rows = []
    print(f"device {device} (pinned: {pin}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| size | images | graph (B, P) | build metadata us | cached us | stage patches us |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        grid = encoder_latency.image_grid(size, cfg)
        lh, lw = llm_grid_of(grid, cfg.downsample_ratio)
        for count in args.counts:
            grids = [grid] * count
            batches = plan_call([lh * lw] * count, [span_tokens(lh, lw)] * count, mgr.budgets, mgr.max_batch_size,
                                mgr.eager_above)
            if len(batches) != 1 or batches[0].budget is None:
                print(f"| {size} | {count} | eager | - | - | - |")
                continue
            key = mgr.graph_key(batches[0].budget, grids)
            slots = mgr.cu_seqlens.numel()
            patches = [torch.rand(grid[0] * grid[1], cfg.patch_dim) for _ in grids]
            build = median_us(lambda k=key, g=grids, n=slots: batch_metadata(k, g, cfg.downsample_ratio, n, pin), args.iters)
            mgr.metadata(key, grids)
            cached = median_us(lambda k=key, g=grids: mgr.metadata(k, g), args.iters)
            staged = torch.empty(sum(p.shape[0] for p in patches), cfg.patch_dim, pin_memory=pin)
            stage = median_us(lambda p=patches, s=staged: torch.cat(p, out=s), args.iters)
            rows.append({"size": size, "images": count, "key": list(key), "build_us": build, "cached_us": cached,
                         "stage_us": stage})
            print(f"| {size} | {count} | {key} | {build:.0f} | {cached:.1f} | {stage:.0f} |", flush=True)
    report = {"benchmark": "encoder_host_metadata", "device": str(device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "iters": args.iters, "rows": rows}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
