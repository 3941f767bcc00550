"""The first steps of a fresh engine under a wave of prompts, step by step, with the Triton compiles each one waits
for: what a server's first requests pay after it reports ready.

    python3 benchmarks/first_steps.py MODEL [--num-prompts 64] [--input-len 1024] [--output-len 8]
        [--max-num-seqs 64] [--load-format auto|dummy] [--long-prefill-token-threshold N ...] [--json OUT]

Sets DSV4_LOG_COMPILES=1 (dsv4/runtime/compile_log.py) before the engine starts, so the start-up's compiles and each
step's are counted apart. Prints one line per step as it finishes (wall ms, seconds since the prompts came, how
many have their first token, the compiles in the step with their seconds), then the totals: time until every
prompt had its first token, and the kernels compiled after start-up, most expensive first. A step's compiles
are the ones its forward triggered (async scheduling: the launched step's, in the step that launched it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

os.environ["DSV4_LOG_COMPILES"] = "1"  # before dsv4 is imported: the engine installs the hooks at start-up

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsv4.engine.engine import LLMEngine  # noqa: E402
from dsv4.runtime import compile_log  # noqa: E402
from dsv4.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--long-prefill-token-threshold", type=int, default=0)
    ap.add_argument("--max-num-partial-prefills", type=int, default=1)
    ap.add_argument("--max-long-partial-prefills", type=int, default=1)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--capture-sizes", default=None,
                    help="comma-separated decode graph sizes (default: the engine's); fewer start faster")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the compile lines too

    t0 = time.perf_counter()
    engine = LLMEngine.from_args(
        args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        load_format=args.load_format, load_tokenizer=False,
        cudagraph_capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",")) if args.capture_sizes else None,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills)
    log = compile_log.active()
    assert log is not None, "the engine did not install the compile log"
    startup_s, startup_compiles = time.perf_counter() - t0, len(log.records)
    print(f"engine ready in {startup_s:.1f} s; {startup_compiles} Triton compiles during start-up "
          f"({sum(r.seconds for r in log.records):.1f} s)", flush=True)

    rng = np.random.default_rng(0)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i in range(args.num_prompts):
        engine.add_request(rng.integers(100, vocab - 100, args.input_len).tolist(), params, request_id=str(i))

    steps, first_token_s = [], {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = len(log.records)
        t = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t
        new = log.records[before:]
        now = time.perf_counter() - start
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first_token_s:
                first_token_s[o.request_id] = now
        row = {"step": len(steps), "wall_ms": wall * 1e3, "t_s": now, "first_tokens": len(first_token_s),
               "compiles": [(r.kernel, round(r.seconds, 2)) for r in new]}
        steps.append(row)
        kernels = ", ".join(f"{k} {s:.1f}s" for k, s in row["compiles"])
        print(f"step {row['step']:3d}  {row['wall_ms']:9.1f} ms  t={now:7.2f} s  first tokens {len(first_token_s):3d}"
              f"  compiles {len(new)}{': ' + kernels if kernels else ''}", flush=True)
    later = log.records[startup_compiles:]
    print(f"all {args.num_prompts} prompts had a first token after {max(first_token_s.values()):.2f} s; "
          f"{len(later)} compiles after start-up, {sum(r.seconds for r in later):.1f} s:")
    for k, (n, secs) in log.summary(since=startup_compiles).items():
        print(f"  {k:40s} {n:3d} variants {secs:7.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "startup_s": startup_s, "startup_compiles": startup_compiles,
                       "steps": steps, "later_compiles": [dataclasses.asdict(r) for r in later]}, f, indent=1)


if __name__ == "__main__":
    main()
