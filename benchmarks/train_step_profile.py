"""Profile the `dsv4 train-demo` target's training step: where a step's GPU time goes, kernel by kernel.

Runs the train-demo recipe (its model, batch and metadata) for `--steps` target steps without the drafter, profiles
steps 4 and 5 with torch.profiler, and writes the step times and the profiler's tables (by self CUDA time, by CPU
time) to OUT/profile_<label>.txt. `--nondeterministic` turns train-demo's request for deterministic algorithms off
(does determinism cost the step?). Usage, from the repo root on a GPU machine:
    PYTHONPATH=. python3 benchmarks/train_step_profile.py OUT [--nondeterministic]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

import dsv4.train.demo as demo

PROFILED = (4, 5)  # the steps inside the profile (after the first steps' one-time costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for profile_<label>.txt")
    parser.add_argument("--nondeterministic", action="store_true", help="skip torch.use_deterministic_algorithms")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    label = "nondeterministic" if args.nondeterministic else "deterministic"
    if args.nondeterministic:
        torch.use_deterministic_algorithms = lambda *a, **k: None  # demo.train requests them on CUDA
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    engine_step = demo.Trainer.step
    times: list[float] = []

    def step(self: demo.Trainer, ids: torch.Tensor, lr: float) -> Any:
        torch.cuda.synchronize()
        t = time.perf_counter()
        if len(times) + 1 == PROFILED[0]:
            prof.__enter__()
        loss = engine_step(self, ids, lr)
        torch.cuda.synchronize()
        if len(times) + 1 == PROFILED[1]:
            prof.__exit__(None, None, None)
        times.append(time.perf_counter() - t)
        return loss

    demo.Trainer.step = step
    demo.train(demo.TrainSettings(out=f"/tmp/train-step-profile-{label}", steps=args.steps, drafter=False,
                                  max_minutes=None, eval_every=10**6, log_every=10**6))
    table = prof.key_averages()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{label}.txt"), "w", encoding="utf-8") as f:
        f.write(f"step times (s): {[round(t, 3) for t in times]}; profiled steps {PROFILED}\n")
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=70))
        f.write(table.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    print(label, "step times (s):", [round(t, 3) for t in times])


if __name__ == "__main__":
    main()
