"""Where a graph-mode decode step's time goes: whole engine step, the decode graph's replay alone, the host phases
around it, and the kernels inside the graph.

usage: PYTHONPATH=. python3 benchmarks/profile_graph.py MODEL_DIR [BATCH] [STEPS] [--compile] [--load-format=dummy]
                                                        [--context=TOKENS]
       PYTHONPATH=. torchrun --nproc-per-node N benchmarks/profile_graph.py MODEL_DIR [BATCH] [STEPS] --tp=N

One capture size (BATCH); prompts of --context tokens (default 512; a long one is prefilled in 16K chunks). With --tp=N (under torchrun): tensor + expert parallelism over N ranks; every rank runs
the same steps (their collectives meet), rank 0 prints.

Prints (median over STEPS):
- step: wall time of `LLMEngine.step()` for a uniform-decode step (sync on both sides);
- replay: GPU time of the graph replay alone (CUDA events around back-to-back replays of the same graph);
- host phases of one step, each timed with a device sync before it (so each number is that phase's own cost,
  host work plus the kernels it launches): schedule, runner inputs + metadata, replay, logits + sampling,
  scheduler/engine bookkeeping;
- the kernels of one replay by GPU time (torch profiler; kernels inside a graph are listed when the CUPTI in use
  reports them);
- with --timeline: every kernel of one replay in launch order, its duration and the idle gap before it, and the
  replay's kernel time against its span (how much of a replay is launch gaps rather than kernels).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def _timed(fn: Callable[..., Any], name: str, acc: dict[str, list[float]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        acc[name].append((time.perf_counter() - t0) * 1e3)
        return out
    return wrapper


def _step_times(eng: LLMEngine, steps: int) -> list[float]:
    """Wall time (ms) of `steps` engine steps, a device sync on both sides of each."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def decoding_engine(model: str, batch: int, steps: int, context: int, **engine_args: Any) -> LLMEngine:
    """An engine with one capture size (`batch`) and room for `batch` requests of `context` prompt tokens and
    4 * steps + 64 decode steps; `engine_args` go to `LLMEngine.from_args`. Shared with decode_device_idle.py."""
    return LLMEngine.from_args(model, dtype="bfloat16", device="cuda", max_model_len=max(1024, context + 4 * steps + 128),
                               max_num_seqs=batch, max_num_batched_tokens=min(16384, max(2048, context * batch)),
                               load_tokenizer=False, cudagraph_capture_sizes=(batch,), **engine_args)


def prefill_prompts(eng: LLMEngine, batch: int, steps: int, context: int) -> None:
    """Submit `batch` greedy requests of `context` random prompt tokens (4 * steps + 64 output tokens each) and step
    the engine until their prompts are prefilled (in 16K chunks for long contexts)."""
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(10, eng.config.model.vocab_size, (context,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=4 * steps + 64, ignore_eos=True),
                        request_id=str(i))
    while any(r.num_computed_tokens < context for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model, batch = args[0], int(args[1]) if len(args) > 1 else 1
    steps = int(args[2]) if len(args) > 2 else 20
    compile_decode = "--compile" in sys.argv
    tp = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--tp=")), 1)
    load_format = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--load-format=")), "auto")
    context = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--context=")), 512)
    t0 = time.perf_counter()
    eng = decoding_engine(model, batch, steps, context, compile_decode=compile_decode, tensor_parallel_size=tp,
                          expert_parallel=tp > 1, load_format=load_format)
    out = print if eng.parallel.rank == 0 else (lambda *a, **k: None)
    out(f"engine start-up {time.perf_counter() - t0:.1f} s (compile_decode={compile_decode})")
    prefill_prompts(eng, batch, steps, context)
    for _ in range(4):  # then a few decode steps
        eng.step()
    runner = eng.runner
    # 1. whole steps
    walls = _step_times(eng, steps)
    # 2. the graph alone
    P = runner.graphs.padded_size(batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = []
    for _ in range(steps):
        start.record()
        runner.graphs.replay(P)
        end.record()
        end.synchronize()
        reps.append(start.elapsed_time(end))
    # 3. host phases (each synced: own cost)
    acc: dict[str, list[float]] = defaultdict(list)
    sched = eng.scheduler
    orig_schedule = sched.schedule
    sched.schedule = _timed(sched.schedule, "schedule", acc)
    ms = runner.model_state
    ms.prepare_decode_attn = _timed(ms.prepare_decode_attn, "decode metadata", acc)
    ms.prepare_inputs = _timed(ms.prepare_inputs, "model inputs", acc)
    runner.graphs.replay = _timed(runner.graphs.replay, "graph replay", acc)
    runner.model.compute_logits = _timed(runner.model.compute_logits, "logits", acc)
    sampler_call = runner.sampler.__call__
    runner.sampler = _SamplerProxy(_timed(sampler_call, "sampler", acc))
    runner.execute = _timed(runner.execute, "execute (all)", acc)
    step_t = _step_times(eng, steps)
    sched.schedule = orig_schedule
    out(f"{model} batch {batch} (graph size {P}), median over {steps}:")
    out(f"  engine step (unsynced inside)  {statistics.median(walls):8.3f} ms")
    out(f"  graph replay alone (events)    {statistics.median(reps):8.3f} ms")
    out(f"  engine step with synced phases {statistics.median(step_t):8.3f} ms")
    for k, v in acc.items():
        out(f"    {k:28s} {statistics.median(v):8.3f} ms")
    # 4. kernels in one replay
    del runner.graphs.replay
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.graphs.replay(P)
        torch.cuda.synchronize()
    out("kernels of 5 replays:")
    out(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))
    if "--timeline" in sys.argv:
        _timeline(runner, P, out)


def _timeline(runner: Any, P: int, out: Callable[..., None]) -> None:
    """One replay's kernels in order: start offset, duration, gap before it (us)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.graphs.replay(P)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        out("timeline: the profiler reported no kernels inside the graph")
        return
    t0, prev_end, busy = kernels[0].time_range.start, kernels[0].time_range.start, 0.0
    out(f"timeline of one replay ({len(kernels)} kernels): start_us dur_us gap_us name")
    for e in kernels:
        r = e.time_range
        gap = max(0.0, r.start - prev_end)
        busy += r.end - r.start
        out(f"  {r.start - t0:9.1f} {r.end - r.start:7.2f} {gap:6.2f}  {e.name[:100]}")
        prev_end = max(prev_end, r.end)
    span = prev_end - t0
    out(f"timeline: span {span:.1f} us, kernel time {busy:.1f} us ({100 * busy / span:.1f}%), "
        f"{len(kernels)} kernels")


class _SamplerProxy:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


if __name__ == "__main__":
    main()
