"""Where an engine step makes the host wait for the GPU: every synchronizing CUDA call of a prefill step and of the
decode steps after it, with the dsv4 source lines that made it.

usage: PYTHONPATH=. python3 benchmarks/host_syncs.py MODEL_DIR [--prompt-len 512] [--batch 1] [--decode-steps 8]
       [--async-scheduling | --no-async-scheduling] [--lines 30]

Why. A step whose host work waits on the device cannot run ahead of it: its host time (metadata, launches) and the
device time add up instead of overlapping. On the H200 a 512-token prefill of V4-Flash-4l took 34-50 ms of wall time
for 9 ms of kernels (benchmarks/results/2026-12-04-h200-decode-launches, section 2); every sync inside the step
exposes the launches queued before it. This lists them: CUDA's sync debug mode (`torch.cuda.set_sync_debug_mode`)
warns at each synchronizing call (item(), a device-to-host copy, nonzero, ...), and each warning is counted by step
kind ("prefill": any step that computes prompt tokens; "decode": the others) and by the two innermost dsv4 frames
of its call stack. Under async scheduling the step's own token copy (an event, not a sync) is not reported; the
engine's wait for the previous step's tokens (`PendingOutput.result`, an event wait) is not a CUDA sync call either.
CUDA only (the debug mode needs a GPU); on a CPU the script says so and exits.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from typing import Any

import torch


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/dsv4/" in f.filename]
    return " <- ".join(f"{f.filename.split('/dsv4/')[-1]}:{f.lineno}" for f in frames[-2:][::-1]) or "(outside dsv4)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--lines", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_syncs: needs a CUDA device (torch.cuda.set_sync_debug_mode)")
        return 2
    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams

    # (from_args defaults to the CPU in fp32: the GPU must be asked for)
    eng = LLMEngine.from_args(args.model, dtype="bfloat16", device="cuda",
                              max_model_len=args.prompt_len + args.decode_steps + 16,
                              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                              async_scheduling=args.async_scheduling, load_tokenizer=False)
    vocab = eng.config.model.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)

    def batch(tag: str) -> None:
        for b in range(args.batch):
            ids = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            eng.add_request(ids, params, request_id=f"{tag}-{b}")

    batch("warm")  # kernels compiled, graphs captured, lazy buffers made: outside the count
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()

    seen: dict[str, collections.Counter[str]] = {"prefill": collections.Counter(), "decode": collections.Counter()}
    steps = collections.Counter()
    kind = ["prefill"]

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            seen[kind[0]][_where()] += 1

    batch("timed")
    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            while eng.has_unfinished_requests():
                sched = eng.scheduler
                kind[0] = "prefill" if any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) \
                    or sched.num_waiting else "decode"
                steps[kind[0]] += 1
                eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, async scheduling {args.async_scheduling}")
    for k in ("prefill", "decode"):
        total = sum(seen[k].values())
        print(f"{k}: {steps[k]} steps, {total} synchronizing calls ({total / max(steps[k], 1):.1f} a step)")
        for where, n in seen[k].most_common(args.lines):
            print(f"  {n:5d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
