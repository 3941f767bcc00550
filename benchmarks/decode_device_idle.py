"""How much of a steady decode step the GPU waits for the host: the device's idle time between kernels over a run of
back-to-back engine steps (async scheduling as the engine defaults to, no sync between steps), against the idle
gaps inside the decode graph's own replay. Their difference is the host time outside the graphs that the step
exposes (issue 24: at most 5% of a decode step).

usage: PYTHONPATH=. python3 benchmarks/decode_device_idle.py MODEL_DIR [BATCH] [STEPS] [--context=TOKENS]

Prints, per step (medians over the profiled run):
- period: wall time of the profiled steps / STEPS (the step as a user sees it);
- busy: the union of kernel intervals; idle: period - busy;
- in-graph idle: the gaps inside one replay of the decode graph alone (launch latency of its nodes);
- host-exposed idle: idle - in-graph idle, and its share of the period;
- the largest gaps of the run with the kernels on either side (where the device waited).
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def busy_intervals(events: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(span, union of busy time, gaps) of kernel intervals (start, end, name) in microseconds; a gap is
    (length, name of the kernel before, name of the kernel after), for every stretch no kernel covers."""
    ev = sorted(events)
    if not ev:
        return 0.0, 0.0, []
    t0, cover_end, prev_name = ev[0][0], ev[0][0], ev[0][2]
    busy, gaps = 0.0, []
    for start, end, name in ev:
        if start > cover_end:
            gaps.append((start - cover_end, prev_name, name))
        if end > cover_end:
            busy += end - max(start, cover_end)
            cover_end, prev_name = end, name
    return cover_end - t0, busy, gaps


def _kernels(prof: profile) -> list[tuple[float, float, str]]:
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model, batch = args[0], int(args[1]) if len(args) > 1 else 1
    steps = int(args[2]) if len(args) > 2 else 20
    context = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--context=")), 512)
    from profile_graph import decoding_engine, prefill_prompts  # benchmarks/: this script's folder, first on sys.path

    eng = decoding_engine(model, batch, steps, context)
    prefill_prompts(eng, batch, steps, context)
    print(f"async scheduling: {eng.config.scheduler.async_scheduling}")
    for _ in range(8):  # steady state: the pipeline of launched steps is full
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    span, busy, gaps = busy_intervals(_kernels(prof))
    runner = eng.runner
    P = runner.graphs.padded_size(batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof1:
        runner.graphs.replay(P)
        torch.cuda.synchronize()
    r_span, r_busy, _ = busy_intervals(_kernels(prof1))
    period = wall * 1e6 / steps
    idle = (span - busy) / steps
    in_graph = r_span - r_busy
    exposed = idle - in_graph
    print(f"{model} batch {batch}, {steps} steps profiled (us per step):")
    print(f"  period (wall / steps)     {period:9.1f}")
    print(f"  device span / steps       {span / steps:9.1f}")
    print(f"  busy (union of kernels)   {busy / steps:9.1f}")
    print(f"  idle                      {idle:9.1f}")
    print(f"  in-graph idle (1 replay)  {in_graph:9.1f}   (replay span {r_span:.1f}, kernels {r_busy:.1f})")
    print(f"  host-exposed idle         {exposed:9.1f}   = {100 * exposed / period:.1f}% of the period")
    print("largest gaps of the run (us, kernel before -> kernel after):")
    for length, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {length:8.1f}  {before[:60]} -> {after[:60]}")


if __name__ == "__main__":
    main()
