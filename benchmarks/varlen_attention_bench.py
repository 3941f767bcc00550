"""The vision encoder's attention alone, at the released ViT shapes (16 heads, head_dim 64): what eager encoding runs
(one SDPA call per image, host bounds) against the kernels a CUDA graph can run over a budget's buffer (device
cu_seqlens, padding rows, unused slots): FlashAttention's varlen forward, cuDNN's ragged forward (opt-in: whether it
captures at all is part of the question) and the Triton varlen kernel at several tile configurations.

    PYTHONPATH=. python benchmarks/varlen_attention_bench.py --json OUT/varlen_attention.json

Cases: the sequences of benchmarks/encoder_latency.py's table (images of 544x544 = 39x39 patches, 896x896 = 64x64,
1024x768 = 55x74, 1536x1536 = 93x93; 1, 4 images) in the buffer rows their budget has (9 x budget aligner rows,
`--budget-steps` per octave) with the manager's 33 cu_seqlens slots. Each kernel is timed as a CUDA graph of one
call replayed `--iters` times (SDPA per image: eagerly, as the eager encoder runs it), CUDA events, median; TFLOP/s
counts the real work (4 n^2 Dh per head and image). Every row also says how far it is from SDPA's output (bf16, max
abs); a kernel that fails (or cannot be captured) is recorded with its error.
Why: a graph replay of the encoder was slower than eager encoding for every case but small single images
(../results/2026-11-30-h200-s2), with the budget padding at most 1.07x the rows for the 1536x1536 image; the
attention is most of that case's work (9.8 of 17 TFLOP), so its kernel is the first suspect.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from dsv4.models.vision import per_image_attention
from dsv4.ops.varlen_attention import varlen_attention_flash, varlen_attention_triton
from dsv4.runtime.encoder_cudagraphs import BUDGET_STEPS, budget_range, padded_cu_seqlens, plan_batches, token_budgets

H, D, RATIO, SLOTS = 16, 64, 3, 33
IMAGES = {"544x544": (39, 39), "896x896": (64, 64), "1024x768": (55, 74), "1536x1536": (93, 93)}
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the landed default first
TRITON_CONFIGS = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                  (128, 32, 4, 2), (64, 128, 4, 2)]


def time_ms(fn: Callable[[], object], iters: int, graph: bool) -> float:
    """Median ms of one call: replays of a CUDA graph of one call, or eager calls; CUDA events around each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile / autotune / allocate outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--counts", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--budget-steps", type=int, default=BUDGET_STEPS)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    budgets = token_budgets(*budget_range(args.max_num_batched_tokens, 4096), steps=args.budget_steps)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, budgets {budgets}", flush=True)
    results, seen = [], set()
    for name, grid in IMAGES.items():
        aligner_rows = -(-grid[0] // RATIO) * -(-grid[1] // RATIO)
        for count in args.counts:
            for batch in plan_batches([aligner_rows] * count, budgets, SLOTS - 1):
                if batch.budget is None or (name, batch.budget, len(batch.indices)) in seen:
                    continue  # eager images, or a batch measured already
                seen.add((name, batch.budget, len(batch.indices)))
                grids = [grid] * len(batch.indices)
                rows = RATIO ** 2 * batch.budget
                cu = padded_cu_seqlens(grids, SLOTS, rows)
                bounds = cu[: len(grids) + 1].tolist()
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v = (torch.randn(rows, H, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
                cu_dev = cu.to(dev)
                flops = sum(4 * (b - a) ** 2 * D * H for a, b in zip(bounds[:-1], bounds[1:]))
                ref = per_image_attention(q, k, v, bounds)
                row = {"image": name, "images": len(grids), "budget": batch.budget, "rows": rows,
                       "real_rows": bounds[-1], "gflop": flops / 1e9, "kernels": {}}
                candidates: list[tuple[str, Callable[[], torch.Tensor], bool]] = [
                    ("sdpa_per_image", lambda: per_image_attention(q, k, v, bounds), False),
                    ("flash_varlen", lambda: varlen_attention_flash(q, k, v, cu_dev), True)]
                for bm, bn, w, s in TRITON_CONFIGS:
                    candidates.append((f"triton_{bm}x{bn}_w{w}_s{s}", lambda bm=bm, bn=bn, w=w, s=s:
                                       varlen_attention_triton(q, k, v, cu_dev, block_m=bm, block_n=bn, num_warps=w,
                                                               num_stages=s), True))
                for kname, fn, graph in candidates:
                    try:
                        diff = (fn().float() - ref.float()).abs().max().item()
                        ms = time_ms(fn, args.iters, graph)
                        row["kernels"][kname] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff": diff}
                    except Exception as e:  # a config a GPU cannot run (shared memory): recorded, not fatal
                        row["kernels"][kname] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                results.append(row)
                best = min((r["ms"], kn) for kn, r in row["kernels"].items() if "ms" in r)
                print(f"{name} x{len(grids)} (budget {batch.budget}, {bounds[-1]}/{rows} rows, {flops / 1e9:.0f} "
                      f"GFLOP): " + ", ".join(f"{kn} {r['ms']:.3f} ms ({r['tflops']:.0f} TF/s)" if "ms" in r
                                              else f"{kn} {r['error']}" for kn, r in row["kernels"].items())
                      + f"; best {best[1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "budgets": budgets,
                       "iters": args.iters, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
