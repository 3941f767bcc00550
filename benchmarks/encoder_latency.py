"""Vision-encoder latency: CUDA graphs (dsv4/runtime/encoder_cudagraphs.py) against the eager encoder, for 1, 4 and
16 images of several sizes.

    PYTHONPATH=. python benchmarks/encoder_latency.py --vision released \
        --output-json benchmarks/results/$(date +%F)-h200-encoder-latency-released.json
    PYTHONPATH=. python benchmarks/encoder_latency.py --vision tiny \
        --output-json benchmarks/results/$(date +%F)-h200-encoder-latency-tiny.json

`--vision tiny` is tiny-v41-vl's tower (2 layers, dim 32, text hidden 64); `released` has the released shapes
(model.md 8.2: 32 layers, dim 1024, 16 heads, aligner into a 5120 text hidden). Weights are random (latency does not
depend on them). Image sizes are pixel sizes planned by the image processor with the config's limits (min_pixels,
max_image_tokens), so a size gives the vit grid and span a real image of that size gets.

What is timed, per (size, count): one call that turns `count` preprocessed images (host float32 patches) into their
span embeddings on the device, `torch.cuda.synchronize()` before and after, wall clock (host overhead included):
- eager: `VisionEncoder.forward` (what `encode_images` runs with enforce_eager: one packed ViT pass, attention per
  image, the aligner and the span assembly per image);
- graphs: `EncoderCudaGraphManager.encode` (sorted greedy packing, one replay per batch, one gather per batch; images
  larger than every budget run eagerly, reported as misses; so does a whole call above `--eager-above` span tokens,
  as the engine's manager does: GRAPH_MAX_SPAN_TOKENS, 0 for none).
Budgets follow the engine's limits (`--max-num-batched-tokens`, `--max-model-len`) and `--budget-steps` per octave
(1: the powers of two measured until 2026-12-05). The graph attention is `--graph-attention`: the Triton varlen
kernel (O(sum of len^2) per image, nothing for the budget's unused rows) or FlashAttention's varlen forward (the
kernel eager SDPA runs per image); the rest of the tower runs over every row of the budget, so graphs pay for up to
(1 + 1 / steps) x the linear work of the eager path: the results show where that outweighs the saved launches.
Each case also reports its work (dsv4/bench/vision_flops.py: the linear layers over the rows a path runs, attention
over the images' own patches) against the dense bf16 peak (`--peak-tflops`, else the H200 datasheet's 989.5, which is
also the H100 SXM's): the fraction of the peak each path reached, and the fraction a graphs call would need to run in
half the eager time (2x): where that is near or above what the GEMMs and attention reach, no saving of launches gets
there. `--profile` prints the top kernels of one eager and one graphs call of each case. `--device cpu` smoke-tests
the script (no graphs: the uncaptured stand-in); `--plan-only` prints each case's rows and TFLOP from the shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dsv4.bench.flops import device_peak
from dsv4.bench.vision_flops import encoder_flops
from dsv4.models.image_processor import plan_image
from dsv4.models.vision import VisionConfig, VisionEncoder, vision_param_dtype
from dsv4.ops import varlen_attention as varlen_ops
from dsv4.runtime.encoder_cudagraphs import (BUDGET_STEPS, GRAPH_MAX_SPAN_TOKENS, EncoderCudaGraphManager,
                                             default_max_batch_size, engine_budgets, llm_grid_of, patch_rows,
                                             plan_call, span_tokens)

VISIONS: dict[str, tuple[VisionConfig, int, list[str]]] = {
    # (tower config, text hidden size, default pixel sizes)
    "tiny": (VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                          max_image_tokens=64, min_pixels=14 * 14 * 9 * 4), 64, ["84x84", "224x224", "448x448"]),
    "released": (VisionConfig(), 5120, ["544x544", "1024x768", "1536x1536"]),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_encoder(cfg: VisionConfig, hidden: int, dtype: torch.dtype, device: torch.device) -> VisionEncoder:
    """A randomly initialised encoder on `device`, in `dtype` except the fp32-kept norms and delimiters."""
    torch.manual_seed(0)
    enc = VisionEncoder(cfg, hidden)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if name.startswith("image_"):
                p.normal_(0, 0.02)
    enc = enc.to(device)
    for name, p in enc.named_parameters():
        p.data = p.data.to(vision_param_dtype(name, dtype))
    return enc.eval()


def image_grid(size: str, cfg: VisionConfig) -> tuple[int, int]:
    """The vit grid of a `WxH` image under the config's image-processing limits."""
    w, h = (int(v) for v in size.lower().split("x"))
    plan = plan_image(w, h, patch_size=cfg.patch_size, downsample=cfg.downsample_ratio, min_pixels=cfg.min_pixels,
                      max_n_token=cfg.max_image_tokens, max_wh_ratio=cfg.max_wh_ratio)
    return plan.vit_grid


def time_calls(fn: Callable[[], Any], sync: Callable[[], None], warmup: int, iters: int) -> dict[str, float]:
    """Median, mean, p90, min of `iters` synchronized wall-clock calls, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median": statistics.median(times), "mean": statistics.fmean(times),
            "p90": times[min(len(times) - 1, int(0.9 * len(times)))], "min": times[0]}


def kernel_table(fn: Callable[[], Any], sync: Callable[[], None], rows: int = 15) -> str:
    """The `rows` CUDA kernels of one call of `fn` with the most device time (torch.profiler), as a table, after a
    line with the call's kernel time against its wall time: a call whose kernels fill its wall time is
    device-bound, and no graph (which only removes launch gaps) can make it faster than wall / kernel time."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
    # kernels carry the self device time; CPU ops have none of their own (children's time is not self time)
    kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
                    for e in prof.key_averages())
    head = (f"kernel time {kernel_us / 1e3:.3f} ms of an unprofiled call's wall {wall * 1e3:.3f} ms "
            f"(device busy {kernel_us / 1e3 / (wall * 1e3):.0%}; graphs can gain at most "
            f"{wall * 1e6 / max(kernel_us, 1e-9):.2f}x)\n")
    return head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def bench_budgets(args: argparse.Namespace) -> tuple[list[int], int | None]:
    """The budget ladder and the eager-above limit of the manager the engine would build (`from_limits`), with
    `--budget-steps` per octave; `--eager-above 0`: no limit, every budget up to the engine's limits."""
    eager_above = args.eager_above or None
    return engine_budgets(args.max_num_batched_tokens, args.max_model_len, eager_above, args.budget_steps), eager_above


def plan_table(args: argparse.Namespace) -> dict[str, Any]:
    """The work of every case under the budget ladder, from shapes alone: real ViT rows against the rows the graphs
    run (the budget's), and the tower's TFLOP (linear layers over the rows a path runs; attention over the images'
    own rows, which both paths do)."""
    cfg, hidden = VISIONS[args.vision][:2]
    budgets, eager_above = bench_budgets(args)
    mbs = default_max_batch_size(budgets)  # the manager's default
    rows_out = []
    print(f"budgets ({args.budget_steps} a octave): {budgets}; max batch {mbs}")
    print("| size | images | batches (budget x images) | real rows | graph rows | x | linear TFLOP eager / graphs "
          "| attention TFLOP |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes or VISIONS[args.vision][2]:
        grid = image_grid(size, cfg)
        lh, lw = llm_grid_of(grid, cfg.downsample_ratio)
        for count in args.counts:
            batches = plan_call([lh * lw] * count, [span_tokens(lh, lw)] * count, budgets, mbs, eager_above)
            real = count * grid[0] * grid[1]
            graph_rows = sum(patch_rows(b.budget, grid[0] * grid[1] * len(b.indices), cfg.downsample_ratio)
                             if b.budget else grid[0] * grid[1] * len(b.indices) for b in batches)
            eager = encoder_flops(cfg, hidden, [grid] * count)
            graphs = encoder_flops(cfg, hidden, [grid] * count, patch_rows=graph_rows)
            row = {"size": size, "images": count, "batches": [(b.budget, len(b.indices)) for b in batches],
                   "real_rows": real, "graph_rows": graph_rows, "linear_tflop": eager.tower_linear / 1e12,
                   "graph_linear_tflop": graphs.tower_linear / 1e12, "attention_tflop": eager.attention / 1e12}
            rows_out.append(row)
            plan = ", ".join(f"{b or 'eager'}x{n}" for b, n in row["batches"])
            print(f"| {size} | {count} | {plan} | {real} | {graph_rows} | {graph_rows / real:.2f} "
                  f"| {row['linear_tflop']:.2f} / {row['graph_linear_tflop']:.2f} | {row['attention_tflop']:.2f} |")
    return {"budgets": budgets, "plan": rows_out}


def work_fields(cfg: VisionConfig, hidden: int, grid: tuple[int, int], batches: list[dict[str, Any]],
                eager_ms: float, graphs_ms: float, peak: float) -> dict[str, float]:
    """The FLOPs of a case's eager and graphs calls (a graph batch runs its buffers' patch and aligner rows, an
    eager batch its images' own) and the fraction of `peak` (FLOP/s) each reached; `graphs_fraction_for_2x`: what a
    graphs call would need to reach to take half of `eager_ms`."""
    eager = sum(encoder_flops(cfg, hidden, [grid] * b["images"]).total for b in batches)
    # an eager batch's patch_rows and budget are None: encoder_flops then counts the images' own rows
    graphs = sum(encoder_flops(cfg, hidden, [grid] * b["images"], patch_rows=b["patch_rows"],
                               aligner_rows=b["budget"]).total for b in batches)
    return {"eager_flops": eager, "graphs_flops": graphs, "floor_ms": eager / peak * 1e3,
            "eager_fraction_of_peak": eager / (eager_ms / 1e3) / peak,
            "graphs_fraction_of_peak": graphs / (graphs_ms / 1e3) / peak,
            "graphs_fraction_for_2x": graphs / (eager_ms / 2e3) / peak}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vision", choices=sorted(VISIONS), default="released")
    ap.add_argument("--sizes", nargs="+", default=None, help="pixel sizes WxH (default: per --vision)")
    ap.add_argument("--counts", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graph-attention", choices=varlen_ops.GRAPH_ATTENTIONS, default=varlen_ops.GRAPH_ATTENTION,
                    help="the graphs' attention kernel (DSV4_ENCODER_GRAPH_ATTENTION)")
    ap.add_argument("--budget-steps", type=int, default=BUDGET_STEPS,
                    help="budgets per octave of the graph ladder (1: powers of two)")
    ap.add_argument("--eager-above", type=int, default=GRAPH_MAX_SPAN_TOKENS,
                    help="calls of more span tokens run eagerly and no budget is above it, as in the engine "
                         "(0: every call through the graphs, budgets up to the engine's limits)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the top CUDA kernels of one eager call and one graphs call per case")
    ap.add_argument("--plan-only", action="store_true",
                    help="print each case's batches, real and budget ViT rows and TFLOP; build and time nothing")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak for --dtype (default: the H200's bf16 / fp32 datasheet figure)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    varlen_ops.GRAPH_ATTENTION = args.graph_attention
    if args.plan_only:
        return plan_table(args)

    cfg, hidden, default_sizes = VISIONS[args.vision]
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    peak, peak_source = device_peak(args.dtype, args.peak_tflops)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    enc = build_encoder(cfg, hidden, DTYPES[args.dtype], device)
    budgets, eager_above = bench_budgets(args)
    mgr = EncoderCudaGraphManager(enc, budgets, device=device, eager_above=eager_above)
    capture_s, graph_bytes = 0.0, 0
    if cuda:
        sync()
        # torch.cuda.graph empties the allocator's cache on entry: without this the cache built up before capture
        # would count against the graphs (a negative "graph memory" in 2026-12-06-h100-encoder-graphs-eager-above)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        t0 = time.perf_counter()
        mgr.capture()
        capture_s = time.perf_counter() - t0
        print(f"captured {len(mgr.graphs)} graphs (aligner rows, patch rows) {mgr.keys} in {capture_s:.1f} s",
              flush=True)
        graph_bytes = torch.cuda.memory_reserved(device) - before

    results = []
    for size in args.sizes or default_sizes:
        grid = image_grid(size, cfg)
        lh, lw = llm_grid_of(grid, cfg.downsample_ratio)
        tokens = span_tokens(lh, lw)
        for count in args.counts:
            gen = torch.Generator().manual_seed(count)
            patches = [torch.rand(grid[0] * grid[1], cfg.patch_dim, generator=gen) * 2 - 1 for _ in range(count)]
            grids = [grid] * count
            with torch.inference_mode():
                eager_out = enc(torch.cat(patches), grids)
                graph_out = mgr.encode(patches, grids)
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager_out, graph_out))
                eager = time_calls(lambda: enc(torch.cat(patches), grids), sync, args.warmup, args.iters)
                graphs = time_calls(lambda: mgr.encode(patches, grids), sync, args.warmup, args.iters)
            # every call plans the same batches: hits and misses per call follow from the plan
            batches = plan_call([lh * lw] * count, [tokens] * count, mgr.budgets, mgr.max_batch_size,
                                mgr.eager_above)
            planned = [{"budget": b.budget, "images": len(b.indices), "aligner_rows": b.rows,
                        "patch_rows": mgr.graph_key(b.budget, [grid] * len(b.indices))[1] if b.budget else None}
                       for b in batches]
            results.append({
                "size": size, "vit_grid": list(grid), "span_tokens": tokens, "images": count, "batches": planned,
                "hits_per_call": sum(len(b.indices) for b in batches if b.budget is not None),
                "misses_per_call": sum(len(b.indices) for b in batches if b.budget is None),
                "eager_ms": eager, "graphs_ms": graphs, "speedup": eager["median"] / graphs["median"],
                "max_abs_diff": diff,
                **work_fields(cfg, hidden, grid, planned, eager["median"], graphs["median"], peak),
            })
            print(f"{size} x{count}: eager {eager['median']:.3f} ms, graphs {graphs['median']:.3f} ms", flush=True)
            if args.profile and cuda:
                for name, fn in (("eager", lambda: enc(torch.cat(patches), grids)),
                                 ("graphs", lambda: mgr.encode(patches, grids))):
                    print(f"-- {size} x{count} {name}: top kernels of one call", flush=True)
                    print(kernel_table(fn, sync), flush=True)

    report = {
        "benchmark": "encoder_latency", "vision": args.vision, "vision_config": dataclasses.asdict(cfg),
        "text_hidden": hidden, "dtype": args.dtype,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "graph_attention": args.graph_attention, "budget_steps": args.budget_steps, "eager_above": eager_above,
        "budgets": mgr.budgets, "max_batch_size": mgr.max_batch_size, "graphs_captured": sorted(mgr.graphs),
        "capture_s": capture_s, "graph_memory_reserved_bytes": graph_bytes, "warmup": args.warmup,
        "iters": args.iters, "peak_tflops_per_s": peak / 1e12, "peak_source": peak_source, "results": results,
    }
    print(f"vision={args.vision} dtype={args.dtype} device={report['device']} budgets={mgr.budgets} "
          f"max_batch_size={mgr.max_batch_size} capture={capture_s:.2f}s graph memory={graph_bytes / 2**20:.0f} MiB")
    print(f"peak {peak / 1e12:.1f} TFLOP/s ({peak_source})")
    print("| size | vit grid | span | images | batches (budget/patch rows x images) | eager ms | graphs ms | speedup "
          "| max diff | floor ms | eager / graphs % of peak | 2x needs % of peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        plan = ", ".join(f"{b['budget']}/{b['patch_rows']}x{b['images']}" if b["budget"] else f"eagerx{b['images']}"
                         for b in r["batches"])
        print(f"| {r['size']} | {r['vit_grid'][0]}x{r['vit_grid'][1]} | {r['span_tokens']} | {r['images']} | {plan} "
              f"| {r['eager_ms']['median']:.3f} | {r['graphs_ms']['median']:.3f} | {r['speedup']:.2f}x "
              f"| {r['max_abs_diff']:.3g} | {r['floor_ms']:.2f} | {100 * r['eager_fraction_of_peak']:.0f} / "
              f"{100 * r['graphs_fraction_of_peak']:.0f} | {100 * r['graphs_fraction_for_2x']:.0f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
