"""Speculative decoding's speed against plain decoding, per batch size (issue 21's acceptance).

usage: PYTHONPATH=. python3 benchmarks/spec_decode_speed.py --model DIR [--batch-sizes 1,2,4,8,16,32]
           [--input-len 512] [--output-len 128] [--num-speculative-tokens K] [--output-json FILE]
           [--modes plain,oracle,oracle_drafter,drafter] [--prompts random|held-out-code]
           [--warmup-output-len 16] [--num-iters 1] ...

For each batch size B: B prompts of I tokens, greedy,
`ignore_eos`, O output tokens each, run through `LLMEngine` step by step (`dsv4.bench.latency.run_batch`: every
`engine.step()` timed with `time.perf_counter`, with a device sync on both sides when scheduling is sync, which it
always is under speculation; under async scheduling a step's time is the step period). The steps in which every
request of the batch is running and has its first token are the decode steps (plain) or verify steps
(speculation); output tokens/s = the tokens those steps emitted / their summed time, the step time is their median.
Prompts (`--prompts`): `random` (default): uniformly random token ids (`dsv4.bench.latency.random_prompts`, a seed
per B); `held-out-code`: the first I tokens (BOS first) of B windows of the held-out standard-library modules
(`dsv4.train.corpus.held_out`, the model's tokenizer), for a checkpoint trained on code such as the built-in
`dsv4/assets/dsv4-demo`: with it the `drafter` mode below is the realistic case.

Modes, each on the same prompts:

- `plain`: an engine without speculation (CUDA graphs of every measured batch size, the engine's default
  scheduling: async on CUDA). Its greedy outputs are the reference every other mode must equal token for token,
  and the oracle's continuations.
- `oracle`: an engine with the checkpoint's drafter (`--speculative-config {"method": <the checkpoint's>,
  "num_speculative_tokens": k, "disable_by_batch_size": max batch + 1}`: speculation runs at every measured batch
  size), its proposer swapped for `OracleProposer` (the test hook of tests/test_spec_decode.py:
  `engine.runner.speculator.set_proposer(OracleProposer(sequences, k))`), which drafts each request's plain
  continuation: every draft is accepted. The drafts cost nothing (a host lookup), so this is the verify step's
  own speed-up bound.
- `oracle_drafter`: the same oracle drafts, but the checkpoint's drafter still runs every step (its drafts are
  computed, then replaced by the oracle's): what a drafter that is always right would give at the drafter's cost.
- `drafter` (`random` is accepted as its old name): the checkpoint's own drafter and its real acceptance. With
  random weights its drafts are (almost) never accepted: the cost of a step that verifies k drafts and keeps none,
  against a plain step (`step_ratio`). With a trained drafter (the built-in model, `--prompts held-out-code`): the
  realistic case beside the oracle's bound.

The oracle's sequences are built before its runs (not timed); the proposer swap happens outside the timed steps.
Warm-up: each engine captures its CUDA graphs at start-up; then, before each timed run, the same prompts run once
with `--warmup-output-len` tokens in the same mode (kernels compiled and autotuned for that batch's shapes).
Prefix caching is off (`--enable-prefix-caching` turns it on), so warm-up and timed runs do the same work.

Per batch: tokens/s of each mode, mean acceptance length (tokens a verify step emits per request: accepted drafts
per draft + 1) and acceptance rate, median step time, speed-up = mode tokens/s / plain tokens/s, step ratio = mode
median step / plain median step, and whether the outputs equal plain's. The break-even batch of a mode is the
largest measured batch at which it is still faster than plain (None: at none); `disable_by_batch_size_suggested`
is the first measured batch above it (speculation stops paying somewhere between the two; None: it still pays at
the largest measured batch). A mode whose outputs differ from plain's is reported (`failures`, an ERROR line) and
the script exits 1 after measuring everything. Near ties: after its timed run, plain decoding runs the batch once
more, untimed, with the top-2 log-probabilities (`repeat_matches`: it emits the same tokens), which gives plain's
margin at every token. A 16-bit verify step runs other kernels over more rows than a plain step, so where plain's
margin is tiny it may pick the runner-up, and from there on the continuation is different (not wrong). A mismatch
whose first differing token had a plain margin <= `--tie-margin` (default by dtype, `TIE_MARGIN`) is reported under
`near_ties` (a WARNING line), not as a failure; every mismatch carries `plain_margin` and `near_tie`. An oracle run
whose outputs left plain's this way is repeated with its own outputs as the oracle, so its drafts are accepted
again (`oracle_source`, `oracle_runs`, `oracle_all_accepted`; at most `--oracle-passes` runs). The JSON is rewritten
after every run (`complete`: false until the end), so a run cut short by a time limit leaves what it measured.

JSON: the run (`benchmark`, `model`, `model_type`, `date`, `device`, `device_name`, `torch`, `triton`, `cuda`,
`python`, `command`, `dtype`, `method`, `drafter_block_size`, `num_speculative_tokens`, `speculative_config`,
`batch_sizes`, `input_len`, `output_len`, `warmup_output_len`, `num_iters`, `modes`, `enable_prefix_caching`,
`engines`: each engine's arguments, scheduling, graphs, start-up and load seconds); `results`: per batch
{`batch_size`, per mode {`output_tokens_per_s`, `output_tokens_per_s_median_step`, `decode_tokens`,
`decode_time_s`, `decode_steps`, `tokens_per_step`, `step_s` (median/mean/p90/min/max), `step_times_s`, `e2e_s`;
speculative modes also `spec_decode` (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos, acceptance_rate, acceptance_length), `num_plain_steps` (must be 0), `outputs_match`,
`mismatches`, `diverged_at_near_ties_only`; oracles `oracle_source`, `oracle_runs`, `oracle_all_accepted`},
`speedup` and `step_ratio` per speculative mode}; `break_even_batch`,
`disable_by_batch_size_suggested` per speculative mode (with --phase-profile also `phases_ms`, `phases_steps` per
speculative mode: `dsv4.spec_decode.speculator.PhaseTimes`); `acceptance` (batch 1: the oracle's speed-up against 3.5,
the own drafter's step ratio against 1.3, the bound for a drafter that is never accepted, and its acceptance
length); `prompts`; `tie_margin`, `near_ties`, `failures`, `outputs_match`, `complete`.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import random
import shlex
import sys
import time
from typing import Any

import torch

from dsv4.bench import write_json
from dsv4.bench.latency import (environment, random_prompts, resolve_device_dtype, run_batch, spec_decode_counters,
                                summarize, sync)
from dsv4.models.config import load_model_config
from dsv4.spec_decode.config import DSPARK, drafter_spec
from dsv4.spec_decode.gate import SpeculationGate
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.speculator import PhaseTimes
from dsv4.tokenizer import Tokenizer
from dsv4.train import corpus

logger = logging.getLogger("spec_decode_speed")

MODES = ("plain", "oracle", "oracle_drafter", "drafter")
MODE_ALIASES = {"random": "drafter"}  # the drafter mode's first name (results of 2026-12-01 use it)
PROMPT_SOURCES = ("random", "held-out-code")
SPEC_MODES = MODES[1:]
# The plain margin (nats between the greedy token and the runner-up) at or below which a first differing token is
# counted as a near tie, not a failure. A 16-bit model rounds every hidden state to 8 significant bits (2^-9
# relative), so a verify step's other kernels and row counts move its logits by hundredths to tenths of a nat; fp32
# moves them by ~1e-6 relative, so its bound is kept tight.
TIE_MARGIN = {"bfloat16": 0.1, "float16": 0.1, "float32": 1e-3}


class OracleAfterDrafter:
    """The checkpoint's drafter runs (its cost is paid: its kernels are queued, its taps read), then its drafts are
    replaced by the oracle's."""

    def __init__(self, drafter: Any, oracle: OracleProposer) -> None:
        self.drafter, self.oracle = drafter, oracle
        self.block_size = drafter.block_size
        self.tap_layer_ids = drafter.tap_layer_ids
        self.tap_width = drafter.tap_width

    def propose(self, req_ids: Any, rows: Any, last_positions: Any, anchors: torch.Tensor, taps: Any) -> torch.Tensor:
        self.drafter.propose(req_ids, rows, last_positions, anchors, taps)
        return self.oracle.propose(req_ids, rows, last_positions, anchors, taps)


def held_out_code_prompts(model_dir: str, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` tokens: BOS + the start of windows of the held-out standard-library modules in the
    model's tokenizer, windows drawn without repeats from `seed` (each file cut into length-token windows)."""
    tok = Tokenizer.from_dir(model_dir)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    encoded = [tok.encode(f.text, add_special_tokens=False) for f in corpus.held_out()]
    windows = [w for w in corpus.eval_windows(encoded, eos, bos, length) if len(w) == length]
    if len(windows) < num:
        raise ValueError(f"the held-out code has {len(windows)} windows of {length} tokens, fewer than {num} prompts")
    return random.Random(seed).sample(windows, num)


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory with a drafter (e.g. make_model(..., "
                                                  "drafter=True))")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8, 16, 32],
                   help="comma-separated batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--warmup-output-len", type=int, default=16,
                   help="output tokens of the untimed run before each timed one (default 16; 0: none)")
    p.add_argument("--num-iters", type=int, default=1, help="timed runs per batch size and mode (default 1)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="drafts verified per step (default: the checkpoint's DSpark block size / MTP layer count)")
    p.add_argument("--prompts", choices=PROMPT_SOURCES, default="random",
                   help="random token ids (default) or held-out standard-library code (a model trained on code)")
    p.add_argument("--verify-decode", action="store_true",
                   help="the speculative engine verifies uniform steps as decode rows with CUDA graphs "
                        "(speculative config \"verify_decode\": true; default: eager verify steps)")
    p.add_argument("--drafter-cuda-graphs", action="store_true",
                   help="the speculative engine replays the drafter's proposals as CUDA graphs (speculative "
                        "config \"drafter_cuda_graphs\": true; default: the eager drafter)")
    p.add_argument("--adaptive", action="store_true",
                   help="the speculative engine speculates only while its measured step times and acceptance say "
                        "it pays (speculative config \"adaptive\": true, dsv4/spec_decode/gate.py; default off)")
    p.add_argument("--phase-profile", action="store_true",
                   help="after each speculative run, one more (untimed) with the device synced at every phase of a "
                        "step: prepare / forward / verify / propose milliseconds per verify step (`phases_ms`)")
    p.add_argument("--tie-margin", type=float,
                   help="plain margin (nats) at or below which a differing first token is a near tie, not a failure "
                        f"(default by dtype: {TIE_MARGIN})")
    p.add_argument("--batch-invariance", action="store_true",
                   help="the plain engine also decodes each batch's prompts one at a time: whether plain decoding's "
                        "tokens depend on the batch (`plain.alone_vs_batched`, with plain's margins), the floor under "
                        "any speculative-vs-plain comparison at a larger batch")
    p.add_argument("--oracle-passes", type=int, default=3,
                   help="an oracle run whose outputs leave plain's at near ties is repeated (up to this many runs) "
                        "with its own outputs as the oracle, so its drafts are all accepted again (default 3)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, among {','.join(MODES)} (plain always runs: it is the reference)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, help="default: input-len + output-len + k + 1")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per step (default: max(2048, largest batch * input-len): one prefill step)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--num-kv-blocks", type=int, help="KV pool blocks (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, help="the engine's default unless given")
    p.add_argument("--cudagraph-capture-sizes", type=_int_list,
                   help="the plain engine's decode graph sizes (default: the batch sizes)")
    p.add_argument("--enforce-eager", action="store_true", help="the plain engine without CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="the plain engine's scheduling (default: the engine's, async on CUDA); speculation is sync "
                        "unless --pipelined")
    p.add_argument("--pipelined", action="store_true",
                   help="the speculative engine with async scheduling: steady verify steps pipelined "
                        "(dsv4/spec_decode/pipelined.py; needs --verify-decode)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="default off (see the module doc)")
    p.add_argument("--seed", type=int, default=0, help="prompt and engine seed (default 0)")
    p.add_argument("--output-json", metavar="FILE", help="write every number as JSON")
    return p


# ---- one engine, one run ---------------------------------------------------------------------------------------
def _engine(args: argparse.Namespace, device: str, dtype: str, spec: dict[str, Any] | None
            ) -> tuple[Any, dict[str, Any]]:
    from dsv4.engine.engine import LLMEngine

    top = max(args.batch_sizes)
    kw: dict[str, Any] = {
        "dtype": dtype, "device": device, "max_model_len": args.max_model_len, "max_num_seqs": top,
        "max_num_batched_tokens": args.max_num_batched_tokens or max(2048, top * args.input_len),
        "block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks, "seed": args.seed,
        "load_tokenizer": False, "enable_prefix_caching": args.enable_prefix_caching,
    }
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if spec is None:
        kw["cudagraph_capture_sizes"] = tuple(args.cudagraph_capture_sizes or sorted(set(args.batch_sizes)))
        kw["enforce_eager"] = args.enforce_eager
        if args.async_scheduling is not None:
            kw["async_scheduling"] = args.async_scheduling
    else:
        kw["speculative_config"] = spec
        kw["async_scheduling"] = args.pipelined  # explicit: the engine pipelines verify steps by default on CUDA
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(args.model, **kw)
    info = {**kw, "async_scheduling": engine.config.scheduler.async_scheduling,
            "cuda_graphs": bool(engine.runner.graphs.enabled), "start_s": time.perf_counter() - t0,
            "model_load_s": engine.model_load_s}
    logger.info("engine (%s) ready in %.1f s", "plain" if spec is None else "speculative", info["start_s"])
    return engine, info


def _release(device: torch.device) -> None:
    """Free a dropped engine's device memory (the caller holds no reference to it any more)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _plain_margins(engine: Any, prompts: list[list[int]], output_len: int, tag: str
                   ) -> tuple[list[list[int]], list[list[float]]]:
    """An untimed greedy run of the batch with the top-2 log-probabilities: each request's output tokens and, per
    token, how far (nats) the chosen token's log-probability is above the runner-up's: the margin a different
    summation order (another kernel, another batch shape) has to overcome to flip that token."""
    from dsv4.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, params, request_id=f"{tag}-margins-{k}") for k, p in enumerate(prompts)]
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0]
    tokens, margins = [], []
    for rid in ids:
        out = final[rid]
        tokens.append(list(out.token_ids))
        row = []
        for lp in out.logprobs:
            ranked = sorted((v.logprob for v in lp.values() if v.rank in (1, 2)), reverse=True)
            row.append(ranked[0] - ranked[1] if len(ranked) == 2 else float("inf"))
        margins.append(row)
    return tokens, margins


def _compare(got: list[list[int]], ref: list[list[int]], margins: list[list[float]] | None = None,
             tie_margin: float = 0.0) -> dict[str, Any]:
    """Token-for-token equality with the plain outputs: the mismatching requests and where each first differs. With
    `margins` (`_plain_margins`), each mismatch also gets plain's margin at its first differing token and whether
    that is a near tie (margin <= `tie_margin`): greedy decoding of a low-precision model follows its summation
    order there, and every token after it is a different continuation, not a further error."""
    bad = []
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
            m: dict[str, Any] = {"request": i, "first_mismatch": first, "len": len(g), "ref_len": len(r)}
            if margins is not None and first < min(len(g), len(margins[i])):
                m["plain_margin"] = margins[i][first]
                m["near_tie"] = margins[i][first] <= tie_margin
            bad.append(m)
    return {"outputs_match": not bad and len(got) == len(ref), "mismatches": bad,
            "diverged_at_near_ties_only": bool(bad) and len(got) == len(ref) and all(m.get("near_tie") for m in bad)}


def _timed(engine: Any, prompts: list[list[int]], args: argparse.Namespace, device: torch.device, tag: str
           ) -> tuple[dict[str, Any], list[list[int]]]:
    """`--num-iters` timed runs of the batch (request ids `{tag}-i{it}-{k}`): decode / verify steps pooled."""
    steps_s: list[float] = []
    tokens_total = 0
    e2e: list[float] = []
    outputs: list[list[int]] = []
    for it in range(args.num_iters):
        sync(device)
        t0 = time.perf_counter()
        steps, outs = run_batch(engine, prompts, args.output_len, device, f"{tag}-i{it}")
        sync(device)
        e2e.append(time.perf_counter() - t0)
        steps_s += [s.seconds for s in steps if s.decode]
        tokens_total += sum(s.num_tokens for s in steps if s.decode)
        if it == 0:
            outputs = outs
        elif outs != outputs:  # greedy and deterministic: every iteration emits the same tokens
            outputs = [o if o == p else [] for o, p in zip(outs, outputs)]
    seconds = sum(steps_s)
    step = summarize(steps_s)
    per_step = tokens_total / len(steps_s) if steps_s else float("nan")
    return {"output_tokens_per_s": tokens_total / seconds if seconds > 0 else float("nan"),
            # the same rate from the median step (insensitive to a few slow steps)
            "output_tokens_per_s_median_step": per_step / step["median"] if steps_s else float("nan"),
            "decode_tokens": tokens_total, "decode_time_s": seconds, "decode_steps": len(steps_s),
            "tokens_per_step": per_step,
            "step_s": step, "step_times_s": steps_s, "e2e_s": summarize(e2e)}, outputs


def _warm(engine: Any, prompts: list[list[int]], args: argparse.Namespace, device: torch.device, tag: str) -> None:
    if args.warmup_output_len > 0:
        run_batch(engine, prompts, args.warmup_output_len, device, f"{tag}-warm")


def _oracle_sequences(prompts: list[list[int]], ref: list[list[int]], tags: list[str], iters: int
                      ) -> dict[str, list[int]]:
    """Every request id a run of `tags` gives (run_batch: `{tag}-{k}`) -> prompt + the plain output."""
    seqs: dict[str, list[int]] = {}
    for tag in tags:
        for k, (p, r) in enumerate(zip(prompts, ref)):
            seqs[f"{tag}-warm-{k}"] = p + r
            seqs[f"{tag}-phases-{k}"] = p + r  # the --phase-profile run
            for it in range(iters):
                seqs[f"{tag}-i{it}-{k}"] = p + r
    return seqs


def _spec_run(engine: Any, speculator: Any, own: Any, mode: str, b: int, prompts: list[list[int]],
              ref: list[list[int]], k: int, args: argparse.Namespace, device: torch.device
              ) -> tuple[dict[str, Any], dict[str, Any], list[list[int]]]:
    """One speculative mode at batch `b`: warm-up and timed run(s); (stats of the last timed run, its speculation
    counters, the outputs of the first timed run, which are compared with plain's).

    An oracle drafts plain's outputs. Where a 16-bit verify step breaks a near tie the other way than plain did,
    every later draft misses and the run measures rejections, not the oracle's bound; the run is then repeated with
    its own outputs as the oracle (up to `--oracle-passes` runs, until a run emits exactly what its oracle drafted),
    and `oracle_source` says which outputs the timed drafts came from."""
    tag = f"{mode}-b{b}"
    source = ref
    passes = 1 if mode == "drafter" else max(1, args.oracle_passes)
    first: list[list[int]] = []
    for attempt in range(passes):
        if mode == "drafter":
            speculator.set_proposer(own)
        else:  # built before the runs: not timed
            oracle = OracleProposer(_oracle_sequences(prompts, source, [tag], args.num_iters),
                                    own.block_size if mode == "oracle_drafter" else k)
            speculator.set_proposer(oracle if mode == "oracle" else OracleAfterDrafter(own, oracle))
        if speculator.gate is not None:  # --adaptive: each mode measured from a fresh switch (the last mode's
            speculator.gate = SpeculationGate()  # acceptance would otherwise carry over)
        _warm(engine, prompts, args, device, tag)
        before = copy.deepcopy(engine.spec_decode_stats)
        plain_before = speculator.num_plain_steps
        stats, outs = _timed(engine, prompts, args, device, tag)
        counters = spec_decode_counters(engine, before)
        counters.pop("speculative_config", None)
        stats["spec_decode"] = counters
        stats["num_plain_steps"] = speculator.num_plain_steps - plain_before
        if attempt == 0:
            first = outs
        if mode != "drafter":
            stats["oracle_source"] = "plain outputs" if attempt == 0 else f"own outputs of run {attempt}"
            stats["oracle_runs"] = attempt + 1
            stats["oracle_all_accepted"] = outs == source
        if mode == "drafter" or outs == source or any(not o for o in outs):
            break
        source = outs
    if args.phase_profile:  # the same drafts once more, every phase synced (PhaseTimes): where a step's time goes
        speculator.phases = PhaseTimes(device)
        try:
            run_batch(engine, prompts, args.output_len, device, f"{tag}-phases")
            stats["phases_ms"] = speculator.phases.per_step_ms()
            stats["phases_steps"] = speculator.phases.steps
        finally:
            speculator.phases = None
    return stats, counters, first


# ---- the benchmark --------------------------------------------------------------------------------------------
def _break_even(rows: list[dict[str, Any]], mode: str) -> tuple[int | None, int | None]:
    """(largest measured batch where `mode` is faster than plain, the first measured batch above it)."""
    sizes = [r["batch_size"] for r in rows if mode in r["speedup"]]
    faster = [r["batch_size"] for r in rows if r["speedup"].get(mode, 0.0) > 1.0]
    if not faster:
        return None, min(sizes) if sizes else None
    be = max(faster)
    above = [b for b in sizes if b > be]
    return be, min(above) if above else None


def _summarize_run(result: dict[str, Any], modes: list[str]) -> None:
    rows = result["results"]
    result["break_even_batch"] = {}
    result["disable_by_batch_size_suggested"] = {}
    for m in modes:
        if m == "plain":
            continue
        be, nxt = _break_even(rows, m)
        result["break_even_batch"][m] = be
        result["disable_by_batch_size_suggested"][m] = nxt
    one = next((r for r in rows if r["batch_size"] == 1), None)
    acc: dict[str, Any] = {}
    if one is not None:
        if "oracle" in one["speedup"]:
            acc["oracle_speedup_batch1"] = one["speedup"]["oracle"]
            acc["oracle_speedup_batch1_target"] = 3.5
            acc["oracle_met"] = one["speedup"]["oracle"] >= 3.5
        if "drafter" in one["step_ratio"]:
            acc["drafter_step_ratio_batch1"] = one["step_ratio"]["drafter"]
            acc["drafter_step_ratio_batch1_target"] = 1.3
            acc["drafter_met"] = one["step_ratio"]["drafter"] <= 1.3
            acc["drafter_acceptance_length_batch1"] = one["drafter"]["spec_decode"]["acceptance_length"]
    result["acceptance"] = acc
    result["outputs_match"] = not result["failures"]


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    modes = [MODE_ALIASES.get(m.strip(), m.strip()) for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose among {', '.join(MODES)}")
    modes = ["plain"] + [m for m in SPEC_MODES if m in modes]
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.input_len < 1 or args.output_len < 2:
        raise ValueError("need batch sizes >= 1, --input-len >= 1 and --output-len >= 2")
    args.batch_sizes = sorted(set(args.batch_sizes))
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        drafter = drafter_spec(json.load(f))
    if drafter.method is None:
        raise ValueError(f"{args.model}: the checkpoint ships no drafter dsv4 can run (write one with "
                         "make_model(..., drafter=True))")
    block = drafter.dspark.block_size if drafter.method == DSPARK else drafter.num_layers
    k = args.num_speculative_tokens or block
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len + k + 1
    cfg = load_model_config(args.model)
    device_str, dtype = resolve_device_dtype(args.device, args.dtype)
    device = torch.device(device_str)
    top = max(args.batch_sizes)
    # speculation at every measured batch size: an explicit limit above the largest (whatever the default is)
    # and each switch as its flag says (not the engine's defaults), so a recorded command measures the same paths
    spec_cfg = {"method": drafter.method, "num_speculative_tokens": k, "disable_by_batch_size": top + 1,
                "verify_decode": args.verify_decode, "drafter_cuda_graphs": args.drafter_cuda_graphs}
    if args.pipelined and not args.verify_decode:
        raise ValueError("--pipelined needs --verify-decode (async scheduling pipelines the multi-row verify steps)")
    if args.adaptive:
        spec_cfg["adaptive"] = True

    env = environment(args, device)
    env["command"] = "python3 benchmarks/spec_decode_speed.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result: dict[str, Any] = {
        "benchmark": "spec_decode_speed", "model": args.model, "model_type": cfg.model_type, **env, "dtype": dtype,
        "method": drafter.method, "drafter_block_size": block, "num_speculative_tokens": k,
        "speculative_config": spec_cfg, "batch_sizes": args.batch_sizes, "input_len": args.input_len,
        "output_len": args.output_len, "warmup_output_len": args.warmup_output_len, "num_iters": args.num_iters,
        "modes": modes, "prompts": args.prompts, "enable_prefix_caching": args.enable_prefix_caching, "engines": {},
        "results": [],
        "failures": [], "near_ties": [], "complete": False,
    }
    rows: dict[int, dict[str, Any]] = {}

    def save() -> None:
        result["results"] = [rows[b] for b in sorted(rows)]
        _summarize_run(result, modes)
        if args.output_json:
            write_json(args.output_json, result)

    if args.prompts == "random":
        prompts = {b: random_prompts(cfg, b, args.input_len, args.seed + b) for b in args.batch_sizes}
    else:
        prompts = {b: held_out_code_prompts(args.model, b, args.input_len, args.seed + b) for b in args.batch_sizes}
    ref: dict[int, list[list[int]]] = {}
    margins: dict[int, list[list[float]]] = {}
    tie = args.tie_margin if args.tie_margin is not None else TIE_MARGIN.get(dtype, 0.1)
    result["tie_margin"] = tie

    # (a) plain decoding: the reference outputs, and the baseline speed
    engine, result["engines"]["plain"] = _engine(args, device_str, dtype, None)
    for b in args.batch_sizes:
        _warm(engine, prompts[b], args, device, f"plain-b{b}")
        stats, ref[b] = _timed(engine, prompts[b], args, device, f"plain-b{b}")
        rows[b] = {"batch_size": b, "plain": stats, "speedup": {}, "step_ratio": {}}
        again, margins[b] = _plain_margins(engine, prompts[b], args.output_len, f"plain-b{b}")
        stats["repeat_matches"] = again == ref[b]  # plain decoding is deterministic: a second run emits the same
        if args.batch_invariance and b > 1:  # the same prompts one request at a time (batch 1 each)
            alone = [run_batch(engine, [p], args.output_len, device, f"plain-b{b}-alone-{k}")[1][0]
                     for k, p in enumerate(prompts[b])]
            stats["alone_vs_batched"] = _compare(alone, ref[b], margins[b], tie)
            logger.info("b=%d plain: one at a time %s batched (%d of %d requests differ, first at %s)", b,
                        "equals" if stats["alone_vs_batched"]["outputs_match"] else "differs from",
                        len(stats["alone_vs_batched"]["mismatches"]), b,
                        [m["first_mismatch"] for m in stats["alone_vs_batched"]["mismatches"]])
        if not stats["repeat_matches"]:
            result["failures"].append({"batch_size": b, "mode": "plain", "error": "a second greedy run differs"})
            logger.error("FAILED: batch %d, plain: a second greedy run differs from the first", b)
        logger.info("b=%d plain: %.1f tok/s, step %.3f ms", b, stats["output_tokens_per_s"],
                    stats["step_s"]["median"] * 1e3)
        save()
    engine = None
    _release(device)

    # (b), (c): one speculative engine; the proposer is swapped per mode
    if len(modes) > 1:
        engine, result["engines"]["speculative"] = _engine(args, device_str, dtype, spec_cfg)
        speculator = engine.runner.speculator
        own = speculator.proposer
        for b in args.batch_sizes:
            for mode in modes[1:]:
                stats, counters, first = _spec_run(engine, speculator, own, mode, b, prompts[b], ref[b], k, args,
                                                   device)
                stats.update(_compare(first, ref[b], margins[b], tie))
                row = rows[b]
                row[mode] = stats
                base = row["plain"]
                row["speedup"][mode] = stats["output_tokens_per_s"] / base["output_tokens_per_s"]
                row["step_ratio"][mode] = stats["step_s"]["median"] / base["step_s"]["median"]
                # plain steps are the adaptive switch's choice (calibration, backoffs); otherwise a defect
                plain_ok = args.adaptive or not stats["num_plain_steps"]
                if not plain_ok or not (stats["outputs_match"] or stats["diverged_at_near_ties_only"]):
                    why = (f"outputs differ from plain decoding's: {stats['mismatches']}" if not stats["outputs_match"]
                           else f"{stats['num_plain_steps']} steps ran without speculation")
                    result["failures"].append({"batch_size": b, "mode": mode, "error": why})
                    logger.error("FAILED: batch %d, %s: %s", b, mode, why)
                elif not stats["outputs_match"]:
                    result["near_ties"].append({"batch_size": b, "mode": mode, "mismatches": stats["mismatches"]})
                    logger.warning("batch %d, %s: outputs leave plain decoding's at near ties only (margin <= %g "
                                   "nats): %s", b, mode, tie, stats["mismatches"])
                logger.info("b=%d %s: %.1f tok/s (x%.2f), acceptance length %.2f, step %.3f ms (x%.2f)%s", b, mode,
                            stats["output_tokens_per_s"], row["speedup"][mode], counters["acceptance_length"],
                            stats["step_s"]["median"] * 1e3, row["step_ratio"][mode],
                            f", oracle: {stats['oracle_source']}" if "oracle_source" in stats else "")
                save()
            speculator.set_proposer(own)
        engine = speculator = own = None
        _release(device)
    result["complete"] = True
    save()
    return result


def _verdict(s: dict[str, Any]) -> str:
    """yes: plain's tokens; tie: left them at near ties only; NO: a failure."""
    return "yes" if s["outputs_match"] else "tie" if s.get("diverged_at_near_ties_only") else "NO"


# ---- the report -----------------------------------------------------------------------------------------------
def print_result(res: dict[str, Any]) -> None:
    print(f"spec_decode_speed: {res['model']} ({res['model_type']}), {res['device_name']} [{res['device']}], "
          f"{res['dtype']}, torch {res['torch']}, triton {res['triton']}")
    print(f"{res['method']} k={res['num_speculative_tokens']} (block {res['drafter_block_size']}), input "
          f"{res['input_len']}, output {res['output_len']}, {res['num_iters']} timed run(s) per mode")
    spec = [m for m in res["modes"] if m != "plain"]
    head = f"{'batch':>5} | {'plain tok/s':>11} {'step ms':>8}"
    for m in spec:
        head += f" | {m + ' tok/s':>20} {'acc.len':>7} {'step ms':>8} {'x step':>6} {'speedup':>7} {'ok':>3}"
    print(head)
    print("-" * len(head))
    for r in res["results"]:
        p = r["plain"]
        line = f"{r['batch_size']:>5} | {p['output_tokens_per_s']:>11.1f} {p['step_s']['median'] * 1e3:>8.3f}"
        for m in spec:
            s = r.get(m)
            if s is None:
                line += f" | {'-':>20} {'':>7} {'':>8} {'':>6} {'':>7} {'':>3}"
                continue
            line += (f" | {s['output_tokens_per_s']:>20.1f} {s['spec_decode']['acceptance_length']:>7.2f} "
                     f"{s['step_s']['median'] * 1e3:>8.3f} {r['step_ratio'][m]:>6.2f} {r['speedup'][m]:>7.2f} "
                     f"{_verdict(s):>3}")
        print(line)
    for m in spec:
        be, nxt = res["break_even_batch"].get(m), res["disable_by_batch_size_suggested"].get(m)
        where = (f"{m}: faster than plain at no measured batch" if be is None else
                 f"{m}: break-even batch {be} (the largest measured batch where it is faster than plain)")
        limit = ("no limit within the measured batches" if nxt is None else f"disable_by_batch_size {nxt}")
        print(f"{where}; suggested {limit}")
    acc = res["acceptance"]
    if "oracle_speedup_batch1" in acc:
        print(f"acceptance: oracle speed-up at batch 1 {acc['oracle_speedup_batch1']:.2f}x (>= 3.5: "
              f"{'met' if acc['oracle_met'] else 'NOT met'})")
    if "drafter_step_ratio_batch1" in acc:
        print(f"acceptance: the own drafter's step at batch 1 {acc['drafter_step_ratio_batch1']:.2f}x a plain step "
              f"(<= 1.3: {'met' if acc['drafter_met'] else 'NOT met'}), acceptance length "
              f"{acc['drafter_acceptance_length_batch1']:.2f}")
    for r in res["results"]:
        for m in spec:
            ph = r.get(m, {}).get("phases_ms")
            if ph:
                print(f"phases: batch {r['batch_size']} {m}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ph.items())
                      + f" per verify step ({r[m]['phases_steps']} steps, device synced at each)")
    for t in res.get("near_ties", []):
        print(f"near ties: batch {t['batch_size']} {t['mode']}: outputs leave plain's where plain's margin was "
              f"<= {res['tie_margin']} nats: {t['mismatches']}")
    for f in res["failures"]:
        print(f"FAILED: batch {f['batch_size']} {f['mode']}: {f['error']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv`, run, print the table, write --output-json; return the result."""
    args = build_parser().parse_args(argv)
    res = run(args, argv)
    print_result(res)
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(1 if main()["failures"] else 0)
