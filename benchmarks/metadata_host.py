"""Host time of the decode-metadata part of a FULL-graph decode step, split by what runs there, for the default
and the latency-specialized decode backends (issue 7: what the metadata graphs save, and what is left).

usage: PYTHONPATH=. python3 benchmarks/metadata_host.py MODEL_DIR [--batch 1 4] [--steps 100] [--profile] [--trace]

For each backend and batch: B greedy requests of 256 prompt tokens, one FULL decode graph of size B; after a few
warm steps, `--steps` decode steps are timed with the parts of `prepare_decode_attn` wrapped in perf_counter
timers: the eager build (default backend, or a specialized miss), the lookback gather staged on the side stream,
the metadata graph's replay; then the forward graph's device time alone (back-to-back replays, CUDA events).
`--profile` adds a cProfile of the metadata part (the functions under it with the most host time; its overhead
inflates the timers, so take those from a run without it). `--trace` adds kernels by device time over 10 profiled
steps and the device time of back-to-back metadata-graph replays. `--backends` takes variants (see `run`) that
isolate why a specialized engine's forward graph replays slower (results/2026-11-30-h200-specialized-decode).
Each engine runs in this one process: run a variant first in a process of its own when the order matters (the
first engine of a process was measured faster). `--dump DIR` writes each engine's forward graph as Graphviz text
(`CUDAGraph.debug_dump`, kernels with their launch parameters) to DIR/BACKEND-bBATCH.dot, to diff a slow engine's
graph against a fast one's. CUDA only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.model_state import DefaultModelState
from dsv4.sampling_params import SamplingParams


def _timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        acc.append(time.perf_counter() - t0)
        return out
    return wrapper


def _device_us(fn: Callable[[], Any], n: int = 100) -> float:
    """Mean device time of `fn` run n times back to back (CUDA events on the current stream)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / n


def _gpu_side(eng: LLMEngine) -> dict[str, Any]:
    """Kernels of 10 decode steps by device time; device time of the metadata-side pieces alone."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    state = eng.runner.model_state
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"kernels": prof.key_averages().table(sort_by="cuda_time_total", row_limit=20,
                                                                max_name_column_width=60)}
    if hasattr(state, "graphs") and state.graphs.recorded():
        key = state.graphs.recorded()[0]
        out["md_graph_replay_device_us"] = _device_us(lambda: state.graphs._graphs[key][0].replay())
    return out


def forward_graph_us(eng: LLMEngine) -> float:
    """Device time of the (one) forward graph replayed alone, back to back: median of 5 x 20 replays."""
    fwd = eng.runner.graphs.graphs
    graph = fwd[next(iter(fwd))][0]
    return statistics.median(_device_us(graph.replay, 20) for _ in range(5))


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its graph description after instantiation, so that it can be dumped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # torch 2.11 on the H100 (2026-12-06): with debug mode alone `debug_dump` wrote no file. keep_graph (newer
        # torch) keeps the captured cudaGraph_t past instantiation, which the dump reads.
        try:
            super().__init__(*args, keep_graph=True, **kwargs)
        except TypeError:
            super().__init__(*args, **kwargs)
        self.enable_debug_mode()


def run(model: str, backend: str, batch: int, steps: int, profile: bool, trace: bool = False,
        dump: str | None = None) -> dict[str, Any]:
    # variants (comma-separated after a colon), to find what slows the forward graph of a specialized engine:
    # nostage: the lookback gather on the main stream, as the default does; serial: the metadata builds recorded
    # without forking (one stream); sidestream: a default engine that makes one empty round trip through a side
    # stream every step (event wait both ways)
    variant = set(backend.partition(":")[2].split(","))
    eng = LLMEngine.from_args(model, dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=batch,
                              max_num_batched_tokens=max(2048, 256 * batch), cudagraph_capture_sizes=(batch,),
                              load_tokenizer=False, decode_backend=backend.partition(":")[0])
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, eng.config.model.vocab_size, (256,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True),
                        request_id=str(i))
    for _ in range(8):  # prefill, then warm decode steps
        eng.step()
    runner, state = eng.runner, eng.runner.model_state
    parts: dict[str, list[float]] = defaultdict(list)
    # instance attributes shadow the methods: only this engine's calls are timed
    state.prepare_decode_attn = _timed(state.prepare_decode_attn, parts["prepare_decode_attn"])
    eager = DefaultModelState.prepare_decode_attn
    DefaultModelState.prepare_decode_attn = _timed(eager, parts["eager build"])  # type: ignore[method-assign]
    if "serial" in variant:
        state.graphs.fork = False
        runner.capture_graphs()
    if "sidestream" in variant:
        side = torch.cuda.Stream()
        prepare_inputs = state.prepare_inputs

        def round_trip(*args: Any) -> Any:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            main.wait_stream(side)
            return prepare_inputs(*args)
        state.prepare_inputs = round_trip
    if "nostage" in variant:
        state._stage_lookback = lambda batch: None
    elif hasattr(state, "graphs"):
        state._stage_lookback = _timed(state._stage_lookback, parts["stage lookback (side stream)"])
        state.graphs.replay = _timed(state.graphs.replay, parts["metadata graph replay"])
    launch, md, wall = [], [], []
    prof = cProfile.Profile() if profile else None
    torch.cuda.synchronize()
    try:
        for _ in range(steps):
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            eng.step()
            wall.append(time.perf_counter() - t0)
            if prof is not None:
                prof.disable()
            launch.append(runner.last_launch_s)
            md.append(runner.last_decode_md_s)
    finally:
        DefaultModelState.prepare_decode_attn = eager  # type: ignore[method-assign]
    out: dict[str, Any] = {
        "backend": backend, "batch": batch, "steps": steps,
        "step_median_us": 1e6 * statistics.median(wall), "launch_median_us": 1e6 * statistics.median(launch), "metadata_median_us": 1e6 * statistics.median(md),
        "parts_us": {k: {"calls": len(v), "median": 1e6 * statistics.median(v)} for k, v in parts.items() if v},
    }
    if hasattr(state, "graphs"):
        out["replays"], out["misses"] = state.graphs.num_replays, state.graphs.num_misses
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_callees("prepare_decode_attn")
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    out["forward_graph_replay_device_us"] = forward_graph_us(eng)
    if trace:
        out.update(_gpu_side(eng))
    if dump is not None:
        fwd = eng.runner.graphs.graphs
        path = os.path.join(dump, f"{backend.replace(':', '-').replace(',', '-')}-b{batch}.dot")
        fwd[next(iter(fwd))][0].debug_dump(path)
        out["dot"] = path if os.path.exists(path) else f"not written: {path}"
    del eng
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--dump", metavar="DIR", help="write each engine's forward graph (Graphviz) under DIR")
    ap.add_argument("--backends", nargs="+", default=["default", "latency_specialized"],
                    help="BACKEND[:VARIANT,...], variants nostage, serial, sidestream (see run)")
    args = ap.parse_args()
    if args.dump:  # every graph captured from here on (recaptures included) keeps its description for the dump
        os.makedirs(args.dump, exist_ok=True)
        torch.cuda.CUDAGraph = _DebugGraph  # type: ignore[misc]
    for b in args.batch:
        for backend in args.backends:
            r = run(args.model, backend, b, args.steps, args.profile, args.trace, args.dump)
            texts = [r.pop(k) for k in ("profile", "kernels") if k in r]
            print(r, flush=True)
            for t in texts:
                print(t, flush=True)


if __name__ == "__main__":
    main()
