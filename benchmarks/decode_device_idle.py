"""How much of a steady decode step the GPU waits for the host: the device's idle time between kernels over a run of
back-to-back engine steps (async scheduling as the engine defaults to, no sync between steps), against the idle
gaps inside the decode graph's own replay. Their difference is the host time outside the graphs that the step
exposes (issue 24: at most 5% of a decode step).

usage: PYTHONPATH=. python3 benchmarks/decode_device_idle.py MODEL_DIR [BATCH] [STEPS] [--context=TOKENS] [--gc-freeze]

--gc-freeze: freeze the heap after start-up and prefill, as `dsv4 serve` does (dsv4/runtime/host_gc.py), so that
no full garbage collection walks the start-up objects during the measured steps.

Prints, per step:
- period: wall time of the steps / STEPS, without the profiler (the step as a user sees it) and under it;
- busy: the union of kernel intervals; idle: the profiled span - busy (mean a step);
- idle a step by step windows: the run cut at each launch of a kernel that runs once a step (the earliest such
  name), median and largest window. The profiler's own host work stalls a few steps now and then (its first run,
  2026-12-07, H100: 3.1, 1.2 and 0.6 ms gaps in 30 steps, while most steps' gaps were ~13 us), so the median
  window is the steady step;
- in-graph idle: the gaps inside one replay of the decode graph alone (launch latency of its nodes);
- host-exposed idle: idle - in-graph idle (mean and median window), and its share of the unprofiled period;
- the largest gaps of the run with the kernels on either side (where the device waited).
"""

from __future__ import annotations

import bisect
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def busy_intervals(events: list[tuple[float, float, str]]
                   ) -> tuple[float, float, list[tuple[float, float, str, str]]]:
    """(span, union of busy time, gaps) of kernel intervals (start, end, name) in microseconds; a gap is
    (length, start, name of the kernel before, name of the kernel after), for every stretch no kernel covers."""
    ev = sorted(events)
    if not ev:
        return 0.0, 0.0, []
    t0, cover_end, prev_name = ev[0][0], ev[0][0], ev[0][2]
    busy, gaps = 0.0, []
    for start, end, name in ev:
        if start > cover_end:
            gaps.append((start - cover_end, cover_end, prev_name, name))
        if end > cover_end:
            busy += end - max(start, cover_end)
            cover_end, prev_name = end, name
    return cover_end - t0, busy, gaps


def step_marker(events: list[tuple[float, float, str]], steps: int) -> str | None:
    """The earliest-starting kernel name launched exactly `steps` times (once a step), None if there is none."""
    counts: dict[str, int] = {}
    for _, _, name in events:
        counts[name] = counts.get(name, 0) + 1
    for _, _, name in sorted(events):
        if counts[name] == steps:
            return name
    return None


def window_idles(events: list[tuple[float, float, str]], gaps: list[tuple[float, float, str, str]],
                 marker: str) -> list[float]:
    """Idle time of each step window: the run cut at every start of `marker`'s launches, each window from one start
    to the next (the last window to the end of the run); a gap belongs to the window its start lies in. Gaps
    before the first marker are not counted."""
    cuts = sorted(s for s, _, name in events if name == marker)
    out = [0.0] * len(cuts)
    for length, start, _, _ in gaps:
        i = bisect.bisect_right(cuts, start) - 1
        if i >= 0:
            out[i] += length
    return out


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
    if "--gc-freeze" in sys.argv:
        from dsv4.runtime.host_gc import freeze_startup_heap

        print(f"gc freeze: {freeze_startup_heap()} objects")
    print(f"async scheduling: {eng.config.scheduler.async_scheduling}")
    for _ in range(8):  # steady state: the pipeline of launched steps is full
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) * 1e6 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = _kernels(prof)
    span, busy, gaps = busy_intervals(events)
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
    print(f"  period, no profiler       {plain:9.1f}")
    print(f"  period (wall / steps)     {period:9.1f}   (under the profiler)")
    print(f"  device span / steps       {span / steps:9.1f}")
    print(f"  busy (union of kernels)   {busy / steps:9.1f}")
    print(f"  idle                      {idle:9.1f}")
    print(f"  in-graph idle (1 replay)  {in_graph:9.1f}   (replay span {r_span:.1f}, kernels {r_busy:.1f})")
    print(f"  host-exposed idle         {exposed:9.1f}   = {100 * exposed / plain:.1f}% of the unprofiled period")
    marker = step_marker(events, steps)
    if marker is not None:
        windows = window_idles(events, gaps, marker)
        med = statistics.median(windows)
        print(f"  idle a step window        {med:9.1f}   median of {len(windows)} (largest {max(windows):.1f}; "
              f"windows cut at {marker[:50]})")
        print(f"  host-exposed, median step {med - in_graph:9.1f}   = {100 * (med - in_graph) / plain:.1f}% of the "
              "unprofiled period")
    else:
        print("  (no kernel runs once a step: no step windows)")
    print("largest gaps of the run (us, kernel before -> kernel after):")
    for length, _, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {length:8.1f}  {before[:60]} -> {after[:60]}")


if __name__ == "__main__":
    main()
