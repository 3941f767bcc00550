"""`dsv4 bench chat`: time to first token of a multi-turn chat that resends the whole conversation every turn.

Turn t's prompt is the conversation so far (every earlier user message and reply) plus a new user message of
`--turn-len` random token ids; the reply is `--output-len` greedy tokens (`ignore_eos`) and joins the history.
One conversation, one request at a time, so each turn's TTFT is the time its prefill takes (plus one decode step
of scheduling latency). `--prefix-caching` picks the engine's mode: `bounded` (the default: SWA bounded replay of
the last window after a hit), `exact` (replay of n_layers * (W - 1) tokens) or `off` (every turn a cold prefill).
A short warm-up request with other tokens goes first, untimed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dsv4.bench import run_and_report
from dsv4.bench.latency import environment, random_prompts, resolve_device_dtype, sync
from dsv4.models.config import load_model_config

MODES = {"bounded": {"enable_prefix_caching": True, "swa_bounded_replay": True},
         "exact": {"enable_prefix_caching": True, "swa_bounded_replay": False},
         "off": {"enable_prefix_caching": False}}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 bench chat`."""
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--turns", type=int, default=30, help="turns of the conversation (default 30)")
    parser.add_argument("--turn-len", type=int, default=256, help="tokens of each user message (default 256)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens of each reply (default 32)")
    parser.add_argument("--prefix-caching", choices=sorted(MODES), default="bounded",
                        help="bounded (default) | exact | off (cold prefill every turn)")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: the engine's)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="(default 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="token and engine seed (default 0)")
    parser.add_argument("--output-json", metavar="FILE", help="write every number as JSON")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the conversation; return the result dict (what --output-json writes)."""
    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams

    if args.turns < 1 or args.turn_len < 1 or args.output_len < 1:
        raise ValueError("need --turns, --turn-len and --output-len >= 1")
    cfg = load_model_config(args.model)
    device_str, dtype = resolve_device_dtype(args.device, args.dtype)
    device = torch.device(device_str)
    max_len = args.turns * (args.turn_len + args.output_len) + 1
    kwargs: dict[str, Any] = {"dtype": dtype, "device": device_str, "max_model_len": max_len, "max_num_seqs": 1,
                              "max_num_batched_tokens": args.max_num_batched_tokens or max(2048, args.turn_len),
                              "block_size": args.block_size, "seed": args.seed, "enforce_eager": args.enforce_eager,
                              "gpu_memory_utilization": args.gpu_memory_utilization, "load_tokenizer": False,
                              **MODES[args.prefix_caching]}
    engine = LLMEngine.from_args(args.model, **kwargs)
    messages = random_prompts(cfg, args.turns + 1, args.turn_len, args.seed)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def turn(req_id: str, prompt: list[int]) -> tuple[float, list[int], int]:
        sync(device)
        t0 = time.perf_counter()
        engine.add_request(prompt, greedy, request_id=req_id)
        ttft, last = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                last = out
        assert ttft is not None and last is not None and last.finished
        return ttft, list(last.outputs[0].token_ids), last.num_cached_tokens

    turn("warmup", messages[-1][: max(2, args.turn_len // 2)])
    history: list[int] = []
    turns = []
    for t in range(args.turns):
        history += messages[t]
        ttft, reply, cached = turn(f"turn{t}", list(history))
        turns.append({"turn": t, "prompt_tokens": len(history), "cached_tokens": cached, "ttft_s": ttft})
        history += reply
    later = [x["ttft_s"] for x in turns[1:]] or [turns[0]["ttft_s"]]
    return {
        "benchmark": "chat", "model": args.model, "model_type": cfg.model_type, **environment(args, device),
        "dtype": dtype, "prefix_caching": args.prefix_caching, "turns": args.turns, "turn_len": args.turn_len,
        "output_len": args.output_len, "engine_kwargs": kwargs, "per_turn": turns,
        "ttft_first_turn_s": turns[0]["ttft_s"], "ttft_median_s": statistics.median(later),
        "ttft_mean_s": statistics.fmean(later), "ttft_last_turn_s": turns[-1]["ttft_s"],
        "final_prompt_tokens": turns[-1]["prompt_tokens"],
        "cached_fraction": sum(x["cached_tokens"] for x in turns) / sum(x["prompt_tokens"] for x in turns),
    }


def print_result(res: dict[str, Any]) -> None:
    """The short table."""
    print(f"dsv4 bench chat: {res['model']} ({res['model_type']}), {res['device_name']} [{res['device']}], "
          f"{res['dtype']}, prefix caching {res['prefix_caching']}")
    print(f"{res['turns']} turns x (user {res['turn_len']}, reply {res['output_len']}) -> final prompt "
          f"{res['final_prompt_tokens']} tokens; {100 * res['cached_fraction']:.1f}% of prompt tokens from the cache")
    print(f"{'TTFT turn 1 (ms)':28}{1e3 * res['ttft_first_turn_s']:12.2f}")
    print(f"{'TTFT median turns 2+ (ms)':28}{1e3 * res['ttft_median_s']:12.2f}")
    print(f"{'TTFT mean turns 2+ (ms)':28}{1e3 * res['ttft_mean_s']:12.2f}")
    print(f"{'TTFT last turn (ms)':28}{1e3 * res['ttft_last_turn_s']:12.2f}")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`dsv4 bench chat`: run, print the table, write --output-json."""
    return run_and_report(args, run, print_result)
