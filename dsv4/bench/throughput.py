"""`dsv4 bench throughput`: offline throughput through `LLM.generate`, as `vllm bench throughput`.

N prompts of I random token ids, each generating exactly O tokens (`ignore_eos`), are handed to `LLM.generate` at
once; the engine batches them up to `--max-num-seqs`. Reported: requests/s, output tokens/s and total (prompt +
output) tokens/s over the wall time of that one call. A one-request warm-up call goes first (lazy initialisation,
kernel compilation), untimed.

Input and prefill rates (see `prefill_work`):
- `input_tokens_per_s`: prompt tokens / wall time of the call, as vLLM's totals count them (cached or not, whatever
  else the steps did).
- `prefill_tokens_per_s`: the prompt tokens the steps computed (a prefix-cache hit's tokens are not computed; its
  replayed tokens are) / the time of the steps that computed any prompt token (`prefill_step_time_s`). Those steps
  may decode other requests too (chunked prefill mixes them), so it is a lower bound on the prefill's own rate.
- `prefill_flops` (`dsv4.bench.flops.prefill_flops` of the computed prompt chunks, lm_head once per completed
  prompt), `prefill_tflops_per_s` over the same step time and `prefill_fraction_of_peak` of one device's dense
  peak (one H200's for the dtype, or `--peak-tflops`): the decode work of mixed steps is not in the FLOPs but is in
  the time, so this too is a lower bound.
A step's time is the wall time of the `engine.step()` call that waits for its result: the call that runs it without
async scheduling, the next call with it (that call launches the next step, then waits for this one's tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from dsv4.bench import run_and_report
from dsv4.bench.flops import PrefillFlops, flop_rate_report, prefill_flops
from dsv4.bench.latency import (engine_knobs, environment, random_prompts, resolve_device_dtype, spec_decode_counters,
                                sync)
from dsv4.config import SchedulerConfig
from dsv4.models.config import ModelConfig, load_model_config
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
    SchedulerConfig.add_mixed_load_cli_args(parser)
    parser.add_argument("--max-model-len", type=int, help="default: input-len + output-len")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (when the engine has them)")
    parser.add_argument("--gpu-memory-utilization", type=float, help="passed to the engine when it supports it")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="prompt and engine seed (default 0)")
    parser.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--peak-tflops", type=float,
                        help="dense peak TFLOP/s of the device for the prefill's fraction of peak (default: the "
                             "H200 datasheet's for the dtype: 989.5 bf16 / fp16, 67 fp32)")
    parser.add_argument("--output-json", metavar="FILE", help="write every number as JSON")


@contextlib.contextmanager
def record_steps(engine: Any) -> Iterator[list[list[Any]]]:
    """While open, every `engine.step()` call appends [the SchedulerOutput it scheduled (None when it scheduled
    nothing), its wall seconds] to the yielded list (the engine's step and its scheduler's schedule are wrapped on
    the instances, and restored on exit). Costs two clock reads and an append per step."""
    calls: list[list[Any]] = []
    sched = engine.scheduler
    schedule, step = sched.schedule, engine.step

    def recorded_schedule() -> Any:
        so = schedule()
        if calls:  # (the engine schedules only inside step())
            calls[-1][0] = so
        return so

    def timed_step() -> Any:
        calls.append([None, 0.0])
        t0 = time.perf_counter()
        out = step()
        calls[-1][1] = time.perf_counter() - t0
        return out

    shadowed = [(obj, name, vars(obj)[name]) for obj, name in ((sched, "schedule"), (engine, "step"))
                if name in vars(obj)]  # instance attributes of these names already (none, normally)
    sched.schedule, engine.step = recorded_schedule, timed_step
    try:
        yield calls
    finally:
        del sched.schedule, engine.step  # the class's methods show through again
        for obj, name, value in shadowed:
            setattr(obj, name, value)


def prefill_work(cfg: ModelConfig, calls: list[list[Any]], async_scheduling: bool
                 ) -> tuple[int, int, float, PrefillFlops]:
    """(prompt tokens computed, steps that computed any, their seconds, the FLOP model's FLOPs of those tokens) from
    `record_steps`' calls. A request's prompt tokens in a step are its scheduled positions below its prompt length,
    from the computed count the step starts at (the SchedulerOutput's, for new and running requests alike); each
    such chunk [a, b) counts `prefill_flops(cfg, b, context_len=a)`, with lm_head when it ends the prompt. With
    async scheduling the step launched by call i is timed by call i + 1 (which waits for its tokens)."""
    prompt_len: dict[str, int] = {}
    chunks: Counter[tuple[int, int, bool]] = Counter()
    tokens = steps = 0
    seconds = 0.0
    for i, (so, call_s) in enumerate(calls):
        if so is None or not so.num_scheduled_tokens:
            continue
        starts = {}
        for new in so.scheduled_new_reqs:
            prompt_len[new.req_id] = len(new.prompt_token_ids)
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        computed = 0
        for rid, n in so.num_scheduled_tokens.items():
            a, p = starts.get(rid, 0), prompt_len.get(rid, 0)  # (every request is new in an earlier step)
            if a < p:
                b = min(a + n, p)
                chunks[(a, b, b == p)] += 1
                computed += b - a
        if not computed:
            continue
        tokens += computed
        steps += 1
        if not async_scheduling:
            seconds += call_s
        elif i + 1 < len(calls):
            seconds += calls[i + 1][1]
    flops = PrefillFlops()
    for (a, b, last), count in chunks.items():
        flops = flops + prefill_flops(cfg, b, count, context_len=a, sample=last)
    return tokens, steps, seconds, flops


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
    for name in SchedulerConfig.MIXED_LOAD_ARGS:  # the mixed-load scheduling options, when given
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    knobs, ignored = engine_knobs(LLM, args.enforce_eager, args.gpu_memory_utilization)
    llm = LLM(**kwargs, **knobs)

    params = SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True, seed=args.seed)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(cfg, n, i, args.seed)]
    device = torch.device(device_str)
    llm.generate(prompts[:1], SamplingParams(temperature=args.temperature, max_tokens=2, ignore_eos=True))
    sync(device)
    spec_before = copy.deepcopy(llm.engine.spec_decode_stats)  # counters since start: the timed call's share
    with record_steps(llm.engine) as calls:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        sync(device)
        elapsed = time.perf_counter() - t0
    spec = spec_decode_counters(llm.engine, spec_before)
    computed, prefill_steps, prefill_s, flops = prefill_work(cfg, calls, llm.engine.config.scheduler.async_scheduling)

    out_tokens = sum(len(c.token_ids) for r in outputs for c in r.outputs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in outputs)
    return {
        "benchmark": "throughput", "model": args.model, "model_type": cfg.model_type, **environment(args, device),
        "dtype": dtype, "num_prompts": n, "input_len": i, "output_len": o, "max_num_seqs": args.max_num_seqs,
        "enforce_eager": bool(args.enforce_eager), "engine_kwargs": {**kwargs, **knobs},
        "ignored_engine_kwargs": ignored, "elapsed_s": elapsed, "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "requests_per_s": n / elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / elapsed, "spec_decode": spec,
        "input_tokens_per_s": prompt_tokens / elapsed,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in outputs), "prefill_tokens_computed": computed,
        "prefill_steps": prefill_steps, "steps": len(calls), "prefill_step_time_s": prefill_s,
        "prefill_tokens_per_s": computed / prefill_s if prefill_s > 0 else float("nan"),
        **flop_rate_report(flops, prefill_s, dtype, 1, args.peak_tflops),
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
    print(f"{'input tokens/s':24}{res['input_tokens_per_s']:12.1f}  (prompt tokens / wall time)")
    print(f"{'prefill tokens/s':24}{res['prefill_tokens_per_s']:12.1f}  ({res['prefill_tokens_computed']} computed "
          f"prompt tokens / {res['prefill_step_time_s']:.3f} s of the {res['prefill_steps']} of {res['steps']} steps "
          f"computing them)")
    print(f"{'prefill TFLOP/s':24}{res['prefill_tflops_per_s']:12.4g}  ({res['prefill_flops'] / 1e12:.4g} TFLOP; "
          f"{res['prefill_fraction_of_peak'] * 100:.3g} % of {res['peak_tflops_per_s']:.1f} TFLOP/s, "
          f"{res['peak_source']})")
    sd = res.get("spec_decode")
    if sd is not None:
        print(f"{'acceptance length':24}{sd['acceptance_length']:12.3f}  ({sd['num_accepted_tokens']}/"
              f"{sd['num_draft_tokens']} drafts accepted over {sd['num_drafts']} verify steps)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`dsv4 bench throughput`: run, print the table, write --output-json."""
    return run_and_report(args, run, print_result)
