"""Where a mixed step's time goes: D running decodes plus one prompt chunk in one eager step, as `dsv4 serve` runs
them under `--max-num-batched-tokens D + CHUNK` (issue 23's TPOT point).

usage: PYTHONPATH=. python3 benchmarks/mixed_step.py MODEL_DIR [--decodes 64] [--chunk 512] [--prompt-len 1024]
       [--new 4] [--top 25] [--cprofile 30] [--piecewise]

Why. `bench serve` 1024 in / 128 out at concurrency 64 with `--max-num-batched-tokens 576` (64 decodes + a 512-token
chunk in every step) gave a median ITL of ~41 ms on an H100 (benchmarks/results/2026-12-06-h100-mixed-load-b576),
while the same 512 prompt tokens cost ~11 ms of GPU time inside a 16K-token step (46.6k tokens/s) and 64 decodes
~8.4 ms as a graphed step. A mixed step runs eagerly (no CUDA graph), so the question is whether it is host-bound
(launches, host syncs that stop the host running ahead) or device-bound (kernels slow at these row counts). This
prints, for the mixed steps and for the decode-only steps after them:
- wall time a step (synced before and after), and the host time of `step()` alone, and of its parts (the eager
  model forward, metadata, inputs, logits, scheduling: a part whose host time is close to the step's wall time
  with the GPU idle is where a host-bound step goes);
- the GPU's kernel time of a round of mixed steps alone (torch.profiler), and the count of kernels and aten ops;
- the synchronizing CUDA calls made by the mixed steps, by dsv4 source line (CUDA's sync debug mode);
- the top kernels by GPU time;
- with --cprofile N, a Python profile of one more round of mixed steps: host time by source file (self time summed)
  and the N functions of most self time and of most cumulative time (where the eager forward's host time goes).

Set-up: D requests of PROMPT_LEN random tokens are prefilled and decode (kernels compiled, graphs captured); then
NEW more requests of PROMPT_LEN arrive at once. Their prompts are computed CHUNK tokens a step beside the D..D+NEW
decodes: NEW x PROMPT_LEN / CHUNK mixed steps. This repeats three times (untimed warm-up, timed, profiled), then
once more under the sync debug mode.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import time
import traceback
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def _device_us(e: Any) -> float:
    return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/dsv4/" in f.filename]
    return " <- ".join(f"{f.filename.split('/dsv4/')[-1]}:{f.lineno}" for f in frames[-2:][::-1]) or "(outside dsv4)"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _file_key(filename: str) -> str:
    """dsv4's files by their path in the package, the rest by package (or file name)."""
    if "/dsv4/" in filename:
        return "dsv4/" + filename.split("/dsv4/")[-1]
    if "site-packages/" in filename:
        return filename.split("site-packages/")[-1].split("/")[0]
    return filename if filename.startswith("<") else filename.rsplit("/", 1)[-1]


def python_profile(run: Any, top: int) -> None:
    """cProfile of `run()`: self time summed by source file, a built-in's (a torch op, a kernel launch in C) counted
    to the file of the function that called it; then the `top` functions by self time and by cumulative time."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    _sync()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    by_file: collections.Counter[str] = collections.Counter()
    for (filename, _, _), (_, _, tottime, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~" and callers:  # a built-in: its time per calling function, to that function's file
            for (caller_file, _, _), (_, _, tt, _) in callers.items():
                by_file[_file_key(caller_file)] += tt
        else:
            by_file[_file_key(filename)] += tottime
    print(f"Python profile of one round of mixed steps: {wall * 1e3:.1f} ms wall (profiler on); self time by file "
          "(built-ins to their caller's):")
    for key, t in by_file.most_common(top):
        print(f"  {t * 1e3:9.1f} ms  {key}")
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
        print(f"top {top} by {order}:")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-12000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--piecewise", action="store_true",
                    help="the engine's --piecewise-cudagraphs (prefill / mixed steps replay layer pieces as graphs)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile one more round of mixed steps in Python and print its top N functions")
    args = ap.parse_args()
    d, rounds = args.decodes, 4
    mixed_per_round = args.new * args.prompt_len // args.chunk
    max_tokens = (rounds + 1) * (mixed_per_round + 8) + 16  # no request ends before the last round
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()  # (from_args defaults to the CPU in fp32: a GPU run must ask for the GPU)
    eng = LLMEngine.from_args(args.model, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu",
                              max_model_len=args.prompt_len + max_tokens + 8,
                              max_num_seqs=d + rounds * args.new, max_num_batched_tokens=d + args.chunk,
                              load_tokenizer=False, piecewise_cudagraphs=args.piecewise)
    print(f"engine start-up {time.perf_counter() - t_start:.1f} s", flush=True)
    vocab = eng.config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    n_added = [0]

    def add(n: int) -> None:
        for _ in range(n):
            ids = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            eng.add_request(ids, params, request_id=f"r{n_added[0]}")
            n_added[0] += 1

    def prefilling() -> bool:
        s = eng.scheduler
        return bool(s.num_waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)

    def run_round(timed: list[tuple[str, float, float]] | None, decode_steps: int = 4) -> None:
        """NEW requests arrive; step until their prompts are in, then `decode_steps` decode-only steps."""
        add(args.new)
        extra = decode_steps
        while prefilling() or extra > 0:
            kind = "mixed" if prefilling() else "decode"
            if kind == "decode":
                extra -= 1
            _sync()
            t0 = time.perf_counter()
            eng.step()
            t1 = time.perf_counter()
            _sync()
            t2 = time.perf_counter()
            if timed is not None:
                timed.append((kind, t1 - t0, t2 - t0))

    t0 = time.perf_counter()
    add(d)
    n_steps = 0
    while prefilling():
        eng.step()
        n_steps += 1
        if n_steps % 32 == 0:  # progress, so a run cut by its time limit shows where it was
            print(f"  set-up step {n_steps}, {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(4):
        eng.step()
    _sync()
    print(f"set-up: {d} requests of {args.prompt_len} prefilled in {time.perf_counter() - t0:.1f} s "
          f"(budget {d + args.chunk} tokens a step)", flush=True)
    run_round(None)  # warm-up: every mixed-step kernel variant compiled
    print("warm-up round done", flush=True)
    # host time of the step's parts (each call returns once its kernels are queued, unless it syncs)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    runner = eng.runner
    hooks = ((runner.model, "forward", "model forward (eager)"),
             (runner.model_state, "prepare_attn", "attention metadata"),
             (runner.model_state, "prepare_inputs", "model inputs"),
             (runner.model, "compute_logits", "logits"),
             (eng.scheduler, "schedule", "schedule"))
    for owner, name, label in hooks:
        def timed_call(*a: Any, _f: Any = getattr(owner, name), _label: str = label, **k: Any) -> Any:
            t = time.perf_counter()
            out = _f(*a, **k)
            parts[_label].append(time.perf_counter() - t)
            return out
        setattr(owner, name, timed_call)
    parted: list[tuple[str, float, float]] = []
    run_round(parted, decode_steps=0)
    n_mixed = len(parted)
    for label, times in parts.items():
        print(f"  host time in {label}: {sum(times) / max(n_mixed, 1) * 1e3:.2f} ms a mixed step ({len(times)} calls)")
    for owner, name, _ in hooks:
        delattr(owner, name)  # the class's own method again
    timed: list[tuple[str, float, float]] = []
    run_round(timed)
    for kind in ("mixed", "decode"):
        rows = [t for t in timed if t[0] == kind]
        if rows:
            host = statistics.median(r[1] for r in rows) * 1e3
            wall = statistics.median(r[2] for r in rows) * 1e3
            print(f"{kind:6s} steps: {len(rows)}, median wall {wall:.2f} ms, host time of step() {host:.2f} ms")

    if args.cprofile:
        python_profile(lambda: run_round(None, decode_steps=0), args.cprofile)

    prof_steps: list[tuple[str, float, float]] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_round(prof_steps, decode_steps=0)  # the mixed steps alone
    n_mixed = sum(1 for t in prof_steps if t[0] == "mixed")
    events = prof.key_averages()
    kernel_us = sum(_device_us(e) for e in events if _device_us(e) > 0)
    n_kernels = sum(e.count for e in events if _device_us(e) > 0 and not e.key.startswith("aten::"))
    n_aten = sum(e.count for e in events if e.key.startswith("aten::"))
    launches = sum(e.count for e in events if e.key in ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC", "cudaGraphLaunch"))
    wall_all = sum(t[2] for t in prof_steps) * 1e3
    print(f"profiled round: {len(prof_steps)} steps ({n_mixed} mixed), {wall_all:.1f} ms wall (profiler on, synced "
          f"each step), "
          f"{kernel_us / 1e3:.1f} ms of kernel time (aten ops' self device time counted once), "
          f"{launches} launch calls, {n_kernels} device-time events, {n_aten} aten ops")
    print(events.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70))

    if not torch.cuda.is_available():
        return  # (CUDA's sync debug mode needs a GPU)
    seen: collections.Counter[str] = collections.Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            seen[_where()] += 1

    old = warnings.showwarning
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            sync_steps: list[tuple[str, float, float]] = []
            run_round(sync_steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    n = sum(1 for t in sync_steps if t[0] == "mixed")
    total = sum(seen.values())
    print(f"synchronizing calls in one round ({n} mixed + 4 decode steps): {total}")
    for where, c in seen.most_common(20):
        print(f"  {c:5d}  {where}")


if __name__ == "__main__":
    main()
