"""`dsv4 bench throughput`: offline throughput through `LLM.generate`, as `vllm bench throughput`.

N prompts of I random token ids, each generating exactly O tokens (`ignore_eos`), are handed to `LLM.generate` at
once; the engine batches them up to `--max-num-seqs`. Reported: requests/s, output tokens/s and total (prompt +
output) tokens/s over the wall time of that one call. A one-request warm-up call goes first (lazy initialisation,
kernel compilation), untimed.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

from dsv4.bench import run_and_report
from dsv4.bench.latency import (engine_knobs, environment, random_prompts, resolve_device_dtype, spec_decode_counters,
                                sync)
from dsv4.models.config import load_model_config
from dsv4.spec_decode.config import SPECULATIVE_CONFIG_HELP


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 bench throughput` (vLLM's names)."""
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests per batch (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: the engine's)")
    parser.add_argument("--max-model-len", type=int, help="default: input-len + output-len")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (when the engine has them)")
    parser.add_argument("--gpu-memory-utilization", type=float, help="passed to the engine when it supports it")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="prompt and engine seed (default 0)")
    parser.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--output-json", metavar="FILE", help="write every number as JSON")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return the result dict (what --output-json writes)."""
    from dsv4 import LLM, SamplingParams

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("need --num-prompts, --input-len and --output-len >= 1")
    cfg = load_model_config(args.model)
    device_str, dtype = resolve_device_dtype(args.device, args.dtype)
    n, i, o = args.num_prompts, args.input_len, args.output_len
    kwargs: dict[str, Any] = {"model": args.model, "dtype": dtype, "device": device_str,
                              "max_model_len": args.max_model_len or i + o, "max_num_seqs": args.max_num_seqs,
                              "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}
    if args.speculative_config is not None:
        kwargs["speculative_config"] = args.speculative_config
    knobs, ignored = engine_knobs(LLM, args.enforce_eager, args.gpu_memory_utilization)
    llm = LLM(**kwargs, **knobs)

    params = SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True, seed=args.seed)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(cfg, n, i, args.seed)]
    device = torch.device(device_str)
    llm.generate(prompts[:1], SamplingParams(temperature=args.temperature, max_tokens=2, ignore_eos=True))
    sync(device)
    spec_before = copy.deepcopy(llm.engine.spec_decode_stats)  # counters since start: the timed call's share
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - t0
    spec = spec_decode_counters(llm.engine, spec_before)

    out_tokens = sum(len(c.token_ids) for r in outputs for c in r.outputs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in outputs)
    return {
        "benchmark": "throughput", "model": args.model, "model_type": cfg.model_type, **environment(args, device),
        "dtype": dtype, "num_prompts": n, "input_len": i, "output_len": o, "max_num_seqs": args.max_num_seqs,
        "enforce_eager": bool(args.enforce_eager), "engine_kwargs": {**kwargs, **knobs},
        "ignored_engine_kwargs": ignored, "elapsed_s": elapsed, "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "requests_per_s": n / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / elapsed, "spec_decode": spec,
    }


def print_result(res: dict[str, Any]) -> None:
    """The short table."""
    print(f"dsv4 bench throughput: {res['model']} ({res['model_type']}), {res['device_name']} [{res['device']}], "
          f"{res['dtype']}, enforce_eager={res['enforce_eager']}")
    print(f"{res['num_prompts']} prompts x (input {res['input_len']}, output {res['output_len']}), "
          f"max_num_seqs {res['max_num_seqs']}: {res['elapsed_s']:.3f} s")
    print(f"{'requests/s':24}{res['requests_per_s']:12.2f}")
    print(f"{'output tokens/s':24}{res['output_tokens_per_s']:12.1f}")
    print(f"{'total tokens/s':24}{res['total_tokens_per_s']:12.1f}")
    sd = res.get("spec_decode")
    if sd is not None:
        print(f"{'acceptance length':24}{sd['acceptance_length']:12.3f}  ({sd['num_accepted_tokens']}/"
              f"{sd['num_draft_tokens']} drafts accepted over {sd['num_drafts']} verify steps)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`dsv4 bench throughput`: run, print the table, write --output-json."""
    return run_and_report(args, run, print_result)
