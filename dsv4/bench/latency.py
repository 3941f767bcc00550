"""`dsv4 bench latency`: decode step time at a fixed batch, against the memory-bandwidth floor.

One batch of B requests (I random prompt tokens each, `ignore_eos`, greedy, O output tokens) runs through the engine
step by step; every step is timed with a device sync on both sides. Steps in which all B requests decode are the
decode steps; the others (prefill, or prefill mixed with decode) are reported apart. The floor is what a decode step
must at least read from device memory (`decode_floor`) over the measured device copy bandwidth
(`measure_copy_bandwidth`); the fraction of the floor reached is floor time / measured median decode step. Under
torchrun (`--tensor-parallel-size N --expert-parallel`) the floor is what one GPU reads, over one GPU's bandwidth.

`--speculative-config` (speculative decoding with the checkpoint's drafter): a decode step is a verify step emitting
one or more tokens per request; the report adds the acceptance counters of the timed batches, the acceptance length
(tokens per verify step per request) and output tokens per second per request (`spec_decode`).

Prefill: the steps that compute prompt tokens (one step of B x I tokens by default) are timed with a device sync on
both sides even under async scheduling (`prefill_time_s`, per batch); every timed batch has prompts of its own, so no
prefill is served from the prefix cache. Prefill tokens/s = B * I / median prefill time; the FLOPs of that prefill
(`dsv4.bench.flops.prefill_flops`) over the same time give TFLOP/s and the fraction of the dense peak
(`dsv4.bench.flops.peak_flops`: one H200's for the run's dtype, times the GPUs under tensor parallelism, or
`--peak-tflops` per GPU).

`--baseline hf` runs transformers' DeepseekV4ForCausalLM on the same checkpoint in the same process (eager
attention, a manual greedy decode loop with its DynamicCache) on the same prompts, for a side-by-side ratio.
"""

from __future__ import annotations

import contextlib

import argparse
import copy
import gc
import inspect
import json
import logging
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from dsv4.bench import run_and_report
from dsv4.bench.flops import flop_rate_report, prefill_flops
from dsv4.distributed import split_over_ranks
from dsv4.models.config import CSA, ModelConfig, load_model_config
from dsv4.models.presets import tensor_shapes
from dsv4.config import ENGRAM_PLACEMENTS, LOAD_FORMATS, SchedulerConfig
from dsv4.quant.config import QUANTIZATION_CHOICES, QuantConfig
from dsv4.quant.released import quant_kind, stored_nbytes
from dsv4.spec_decode.config import SPECULATIVE_CONFIG_HELP

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- the floor -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeFloor:
    """Bytes one decode step must read from device memory, by kind."""

    weight_bytes: float  # every non-routed-expert weight once; embedding, tid2eid and engram rows of the batch only
    expert_bytes: float  # the routed experts the batch hits (expected distinct count per MoE layer)
    kv_bytes: float  # window rows, compressed entries attended, indexer keys scanned

    @property
    def total(self) -> float:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes


def expected_distinct_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts hit when `batch` tokens each pick `top_k` distinct experts uniformly at
    random out of `n_experts`: an expert is missed by one token with probability 1 - k/E."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def _dtype_name(dtype: str | torch.dtype) -> str:
    return dtype if isinstance(dtype, str) else _DTYPE_NAMES[dtype]


def _is_embedding(name: str) -> bool:
    return name in ("model.embed_tokens.weight", "model.embed.weight")


def _is_routed_expert(name: str) -> bool:
    # V4 packs the experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); V4.1 stores `ffn.experts.E.wN`.
    return ".experts." in name


def _is_engram_table(name: str) -> bool:
    return name.endswith(".engram.embed.weight")


def _kv_rows(cfg: ModelConfig, ctx_len: int) -> tuple[int, int]:
    """(rows of head_dim, rows of index_head_dim) one request reads at one decode step, summed over layers."""
    rows, index_rows = 0, 0
    v41 = cfg.v41
    for layer in range(cfg.num_hidden_layers):
        rows += min(cfg.sliding_window, ctx_len)  # every layer attends its window
        ratio = cfg.compress_ratios[layer]
        if ratio == 0:
            continue
        entries = ctx_len // ratio  # entries whose whole window of `ratio` tokens is in the context
        if v41 is None:
            if cfg.layer_types[layer] == CSA:  # own indexer: scan all keys, attend top-k
                rows += min(cfg.index_topk, entries)
                index_rows += entries
            else:  # HCA attends every entry
                rows += entries
            continue
        rows += min(cfg.index_topk, entries)  # V4.1: every compressed layer attends the top-k of its index source
        if layer in v41.index_source_layer_ids:
            cand = v41.candidate_source_layer_id
            scanned = entries
            if 0 <= cand < layer:  # a re-index source scores only the candidate source's top blocks
                scanned = min(entries, v41.candidate_topk_blocks * v41.candidate_block_size)
            index_rows += scanned
    return rows, index_rows


def decode_floor(cfg: ModelConfig, batch: int, ctx_len: int, dtype: str | torch.dtype, world: int = 1,
                 quant: QuantConfig | None = None) -> DecodeFloor:
    """The bytes a decode step of `batch` requests, each with `ctx_len` tokens of context (the decoded token
    included), must read from device memory, for weights and KV cache in `dtype`; with `world` > 1, what one of
    that many ranks reads (tensor and expert parallelism, `dsv4.distributed`): a tensor the ranks split
    (`split_over_ranks`) counts 1/world (the embedding: its share of the batch's rows; routed experts: its
    expected share of the distinct experts), a replicated one whole, and the KV cache whole (one shared KV head:
    every rank attends over all of it).

    Assumptions (a floor, not a model of any kernel):
    - weights: every tensor of the checkpoint layout (`tensor_shapes`) is read once per step at its checkpoint
      dtype (`dtype`, the mHC / sink / router-bias tensors in fp32), except: the embedding (only the `batch` rows of
      the step's tokens), hash-MoE `tid2eid` (only those rows, int64), engram tables (only the batch's
      (max_ngram_size - 1) * n_heads rows per engram layer; their dummy float scale is never read), and routed
      experts (below). Norm weights the engine keeps in fp32 are counted at `dtype` (a few KB per layer).
      lm_head is read whole.
    - routed experts: per MoE layer, the expected number of distinct experts among `batch` tokens each drawing
      top_k distinct experts uniformly (`expected_distinct_experts`), each read whole (w1, w2, w3).
    - KV, per request and layer: min(sliding_window, ctx_len) window rows of head_dim; a compressed layer of ratio m
      sees floor(ctx_len / m) entries: V4 CSA attends min(index_topk, entries) of them and its indexer scans all
      their keys (index_head_dim); V4 HCA attends all; V4.1 layers with ratio > 0 attend min(index_topk, entries)
      of their KV source's entries, and index sources scan all keys (a re-index source after the candidate source:
      at most candidate_topk_blocks * candidate_block_size). KV and keys are stored in `dtype`.
    - `quant` (the engine keeps the checkpoint's low-precision weights, `dsv4.quant`): the tensors the release
      stores quantized (`dsv4.quant.released.quant_kind`: FP8 dense linears, routed experts, engram tables) count
      their stored bytes with scales (`stored_nbytes`; engram rows: head_dim FP8 bytes + head_dim/32 scale bytes);
      every other tensor stays at `dtype` as above. KV unchanged. None: every weight at `dtype`.
    - not counted: activations, the compressor rings (a few rows per step), writes, sampling, host traffic.
    """
    name = _dtype_name(dtype)
    item = getattr(torch, name).itemsize
    distinct = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
    weights = experts = 0.0
    for tensor, (shape, dt) in tensor_shapes(cfg, name).items():
        share = 1 / world if split_over_ranks(tensor, cfg, world) else 1.0
        stored = (stored_nbytes(tensor, shape, cfg, quant) if quant is not None and quant_kind(tensor)
                  else math.prod(shape) * dt.itemsize)
        nbytes = stored * share
        row = nbytes / shape[0]
        if _is_embedding(tensor) or tensor.endswith("tid2eid"):
            weights += batch * row
        elif _is_engram_table(tensor):
            eng = cfg.v41.engram
            weights += batch * (eng.max_ngram_size - 1) * eng.n_heads * row
        elif tensor.endswith(".engram.embed.scale"):
            continue
        elif _is_routed_expert(tensor):
            experts += nbytes / cfg.n_routed_experts * distinct
        else:
            weights += nbytes
    rows, index_rows = _kv_rows(cfg, ctx_len)
    kv = batch * (rows * cfg.head_dim + index_rows * cfg.index_head_dim) * item
    return DecodeFloor(weights, experts, kv)


def decode_floor_bytes(cfg: ModelConfig, batch: int, ctx_len: int, dtype: str | torch.dtype,
                       quant: QuantConfig | None = None) -> float:
    """`decode_floor(cfg, batch, ctx_len, dtype, quant=quant).total`: bytes a decode step must read."""
    return decode_floor(cfg, batch, ctx_len, dtype, quant=quant).total


def mean_decode_floor(cfg: ModelConfig, batch: int, input_len: int, output_len: int, dtype: str, world: int = 1,
                      quant: QuantConfig | None = None) -> DecodeFloor:
    """The floor averaged over the decode steps of a run: decode step j (1 <= j < O) reads a context of I + j."""
    floors = [decode_floor(cfg, batch, input_len + j, dtype, world, quant) for j in range(1, output_len)]
    n = len(floors)
    return DecodeFloor(*(sum(getattr(f, k) for f in floors) / n for k in ("weight_bytes", "expert_bytes", "kv_bytes")))


# ---- the device ----------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting each copy's read and write (2 * nbytes).

    CUDA: `nbytes` copied `iters` times between two device buffers, timed with events after a warm-up copy.
    CPU: the same with host memory (a memcpy bandwidth)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch and allocation effects
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * iters / seconds


def device_name(device: torch.device) -> str:
    """The GPU's name, or the host CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def command_line(args: argparse.Namespace) -> str:
    """The `dsv4 bench ...` command that reproduces `args` (every option given or defaulted)."""
    words = ["dsv4", args.command, args.bench_command] if hasattr(args, "bench_command") else ["dsv4"]
    for key, value in vars(args).items():
        if key in ("command", "bench_command") or value is None or value is False:
            continue
        words.append(f"--{key.replace('_', '-')}")
        if isinstance(value, (list, tuple)):
            words.extend(str(v) for v in value)
        elif value is not True:
            words.append(str(value))
    return " ".join(words)


def switches() -> dict[str, str]:
    """The DSV4_* environment switches of this process (e.g. DSV4_SORTED_EXPERTS), which change what a run measures;
    names holding a secret (DSV4_API_KEY) are left out."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4_") and "KEY" not in k}


def environment(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Versions, the machine, the command and the DSV4_* switches, for the results file."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device),
            "device_name": device_name(device), "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "python": platform.python_version(), "command": command_line(args),
            "switches": switches()}


# ---- shared with `bench throughput` --------------------------------------------------------------------------
def resolve_device_dtype(device: str, dtype: str) -> tuple[str, str]:
    """"auto" -> cuda if available else cpu; bfloat16 on CUDA, float32 on the CPU (as `LLM`)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def random_prompts(cfg: ModelConfig, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` uniformly random token ids, avoiding BOS/EOS/pad and the V4.1 image placeholder
    (which the engram treats as a gap)."""
    avoid = {0, 1, 2, *cfg.eos_token_ids}
    if cfg.bos_token_id is not None:
        avoid.add(cfg.bos_token_id)
    if cfg.v41 is not None:
        avoid.add(cfg.v41.image_token_id)
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        ids = []
        while len(ids) < length:
            t = rng.randrange(cfg.vocab_size)
            if t not in avoid:
                ids.append(t)
        out.append(ids)
    return out


def engine_knobs(fn: Callable[..., Any], enforce_eager: bool, gpu_memory_utilization: float | None
                 ) -> tuple[dict[str, Any], list[str]]:
    """The optional engine knobs `fn` (LLMEngine.from_args or LLM) accepts, and the names of those asked for that it
    does not know (this engine build predates them), so the benchmark runs on builds with and without them."""
    params = inspect.signature(fn).parameters
    knobs: dict[str, Any] = {}
    ignored: list[str] = []
    if "enforce_eager" in params:
        knobs["enforce_eager"] = enforce_eager
    elif enforce_eager:
        ignored.append("enforce_eager")
    if gpu_memory_utilization is not None:
        if "gpu_memory_utilization" in params:
            knobs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            ignored.append("gpu_memory_utilization")
    for name in ignored:
        logger.warning("this engine build has no `%s`; ignored", name)
    return knobs, ignored


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation, as numpy's default."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """median / mean / p90 / min / max of a list of seconds (empty -> NaNs)."""
    if not values:
        return {k: float("nan") for k in ("median", "mean", "p90", "min", "max")}
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "p90": percentile(values, 90),
            "min": min(values), "max": max(values)}


# ---- the dsv4 run --------------------------------------------------------------------------------------------
@dataclass
class StepTime:
    """One engine step: its wall time (device-synced), whether all B requests decoded in it, its requests."""

    seconds: float
    decode: bool
    num_requests: int
    host_s: float = 0.0  # the runner's host time to launch the step (ModelRunner.last_launch_s)
    md_host_s: float = 0.0  # of which the decode-metadata build (ModelRunner.last_decode_md_s)
    num_tokens: int = 0  # output tokens the step emitted, all requests (several per request under speculation)
    prefill: bool = False  # the step computed prompt tokens (synced on both sides whatever the scheduling)


def weight_bytes(engine: Any) -> int:
    """Bytes of the model's parameters and buffers as held (stored FP8 / FP4 bytes and scales when quantized)."""
    return sum(t.numel() * t.element_size() for t in engine.runner.model.state_dict().values())


def build_engine(args: argparse.Namespace, device: str, dtype: str) -> tuple[Any, dict[str, Any]]:
    """LLMEngine.from_args for a batch of `batch_size` prompts of `input_len` + `output_len` tokens; the knobs this
    engine build does not know (enforce_eager, gpu_memory_utilization) are reported, not passed."""
    from dsv4.engine.engine import LLMEngine

    b, i, o = args.batch_size, args.input_len, args.output_len
    kwargs: dict[str, Any] = {
        "dtype": dtype, "device": device, "max_model_len": args.max_model_len or i + o, "max_num_seqs": b,
        # the whole batch's prompts in one step by default, so every later step is a full-batch decode step
        "max_num_batched_tokens": args.max_num_batched_tokens or max(2048, b * i),
        "block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks, "seed": args.seed,
        # ids in, ids out: detokenization is host work outside the floor (a grammar needs the tokenizer)
        "load_tokenizer": args.detokenize or args.json_schema is not None,
    }
    if args.cudagraph_capture_sizes:
        kwargs["cudagraph_capture_sizes"] = tuple(args.cudagraph_capture_sizes)
    if args.compile_decode:
        kwargs["compile_decode"] = True
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if args.decode_backend != "default":
        kwargs["decode_backend"] = args.decode_backend
    if args.tensor_parallel_size > 1:  # under torchrun, one process per GPU
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size, expert_parallel=args.expert_parallel)
    knobs, ignored = engine_knobs(LLMEngine.from_args, args.enforce_eager, args.gpu_memory_utilization)
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    if args.engram_placement != "auto":
        kwargs["engram_placement"] = args.engram_placement
    if args.speculative_config is not None:
        kwargs["speculative_config"] = args.speculative_config
    for name in SchedulerConfig.MIXED_LOAD_ARGS:  # the mixed-load scheduling options, when given
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    engine = LLMEngine.from_args(args.model, **kwargs, **knobs)
    resolved = {"async_scheduling": engine.config.scheduler.async_scheduling}  # what the engine chose by default
    return engine, {"engine_kwargs": {**kwargs, **knobs, **resolved}, "ignored_engine_kwargs": ignored}


def prefill_pending(engine: Any, ids: list[str]) -> bool:
    """Whether a request of `ids` still has prompt tokens to schedule (the scheduler counts scheduled tokens as
    computed, so this turns False with the step that schedules the last prompt chunk)."""
    for rid in ids:
        user = engine.requests.get(rid)
        if user is not None and any(c.request.num_computed_tokens < c.request.num_prompt_tokens
                                    for c in user.children):
            return True
    return False


def run_batch(engine: Any, prompts: list[list[int]], output_len: int, device: torch.device, tag: str,
              json_schema: dict[str, Any] | None = None,
              cached_tokens: list[int] | None = None) -> tuple[list[StepTime], list[list[int]]]:
    """Submit the batch, step the engine until it drains; return every step's time and the output tokens.
    `json_schema`: every request's output is constrained to it (structured outputs). `cached_tokens`: the prompt
    tokens each request got from the prefix cache are appended to it."""
    from dsv4.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    # DELTA outputs: each step returns only the new tokens (what a streaming server asks for), so the timed step
    # does not copy every request's growing token list (CUMULATIVE) on the host
    structured = None if json_schema is None else StructuredOutputsParams(json=json_schema)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, structured_outputs=structured)
    ids = [engine.add_request(p, params, request_id=f"{tag}-{k}") for k, p in enumerate(prompts)]
    produced = dict.fromkeys(ids, 0)
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    alive = set(ids)
    steps: list[StepTime] = []
    # async scheduling overlaps a step's host work with the previous step's GPU work: a device sync around every
    # step would serialise them again. Each step still waits for the previous step's tokens, so in the steady
    # state a step's wall time is the step period.
    # The steps that compute prompt tokens are synced on both sides always, so the prefill is timed alone (under
    # async scheduling the next step is launched only after it finished: that costs one overlap, outside the decode
    # steps).
    per_step_sync = not engine.config.scheduler.async_scheduling
    pending = True  # prompt tokens left to schedule (checked until they are all scheduled)
    hits: dict[str, int] = {}
    sync(device)
    while engine.has_unfinished_requests():
        # a decode step: every request of the batch is still running and has its first token (its prefill is done)
        decode = len(alive) == len(ids) and all(produced[r] > 0 for r in ids)
        running = len(alive)
        pending = pending and prefill_pending(engine, ids)
        if per_step_sync or pending:
            sync(device)
        t0 = time.perf_counter()
        outputs = engine.step()
        if per_step_sync or pending:
            sync(device)
        runner = getattr(engine, "runner", None)
        steps.append(StepTime(time.perf_counter() - t0, decode, running, getattr(runner, "last_launch_s", 0.0),
                              getattr(runner, "last_decode_md_s", 0.0),
                              sum(len(out.outputs[0].token_ids) for out in outputs), pending))
        for out in outputs:
            hits[out.request_id] = out.num_cached_tokens
            tokens[out.request_id].extend(out.outputs[0].token_ids)
            produced[out.request_id] = len(tokens[out.request_id])
            if out.finished:
                alive.discard(out.request_id)
    if cached_tokens is not None:
        cached_tokens.extend(hits.get(r, 0) for r in ids)
    return steps, [tokens[r] for r in ids]


# ---- the transformers baseline -------------------------------------------------------------------------------
def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int, device: torch.device
               ) -> tuple[list[float], torch.Tensor]:
    """One prefill forward, then steps - 1 greedy decode forwards with the model's DynamicCache, each timed."""
    times, tokens = [], []
    # Some transformers releases (5.17 on the GPU machine) leave the mHC collapse in fp32 and then feed it to
    # bf16 projections; autocast keeps such a model runnable in its load dtype.
    low = model.dtype if model.dtype != torch.float32 else None
    autocast = torch.autocast(device.type, dtype=low) if low is not None else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        out = model(ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        tokens.append(nxt)
        for _ in range(steps - 1):
            sync(device)
            t0 = time.perf_counter()
            out = model(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - t0)
            tokens.append(nxt)
    return times, torch.stack(tokens, dim=1)


def hf_decode_steps(model_dir: str, prompts: list[list[int]], output_len: int, dtype: str, device: torch.device
                    ) -> tuple[list[float], list[list[int]]]:
    """transformers' DeepseekV4ForCausalLM (eager attention) on the same prompts: one prefill forward, then
    output_len - 1 greedy decode forwards with its DynamicCache, each timed with a device sync. A short warm-up
    run goes first. Returns (decode step seconds, output tokens per prompt)."""
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").to(device).eval()
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    _hf_greedy(model, ids, min(output_len, 3), device)  # warm-up: kernels, allocator
    times, tokens = _hf_greedy(model, ids, output_len, device)
    return times, tokens.tolist()


# ---- the command ---------------------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 bench latency` (vLLM's names where vLLM has them)."""
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--batch-size", type=int, default=8, help="requests decoded together (default 8)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    parser.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (when the engine has them)")
    parser.add_argument("--gpu-memory-utilization", type=float, help="passed to the engine when it supports it")
    parser.add_argument("--compile-decode", action="store_true",
                        help="torch.compile the decode forward before capturing its graphs (start-up: minutes)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch each step before the previous step's tokens reach the host (default: the "
                             "engine's, on for CUDA)")
    parser.add_argument("--decode-backend", choices=["default", "latency_specialized"], default="default",
                        help="latency_specialized: record the decode-metadata builds as CUDA graphs (V4.1)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs serving the model (started for you, or by torchrun --nproc-per-node N; rank 0 "
                             "reports)")
    parser.add_argument("--expert-parallel", action="store_true", help="split the routed experts over those GPUs")
    parser.add_argument("--cudagraph-capture-sizes", type=int, nargs="+",
                        help="decode graph sizes (default: the engine's, 1, 2, 4, 8, 16, ... up to the batch)")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches first (default 1)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed batches (default 3)")
    parser.add_argument("--max-model-len", type=int, help="default: input-len + output-len")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens per step (default: max(2048, batch * input-len): one prefill step)")
    SchedulerConfig.add_mixed_load_cli_args(parser)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    parser.add_argument("--num-kv-blocks", type=int, help="KV pool blocks (default: the engine's)")
    parser.add_argument("--detokenize", action="store_true", help="load the tokenizer and detokenize (default off)")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="constrain every output to this JSON schema (structured outputs; needs a tokenizer and "
                             "xgrammar). A request whose grammar ends early ends the batch's decode steps: use a "
                             "schema that cannot close within --output-len, e.g. benchmarks/schemas/long_text.json")
    parser.add_argument("--copy-bytes", type=int,
                        help="bytes per copy for the bandwidth measure (default 2 GiB on CUDA, 256 MiB on the CPU)")
    parser.add_argument("--baseline", choices=["hf"], help="also run transformers' DeepSeek-V4 (V4 checkpoints)")
    parser.add_argument("--seed", type=int, default=0, help="prompt and engine seed (default 0)")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES,
                        help="weight format: auto (default: the checkpoint's quantization_config) | none (dequantized "
                             "at load) | fp8 | deepseek_v4_fp8 (a float checkpoint: its released FP8 / MXFP4 copy, "
                             "cached); sets the floor's weight bytes")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="dummy: random weights of the checkpoint's layout, no weight files (full-size shapes)")
    parser.add_argument("--engram-placement", choices=list(ENGRAM_PLACEMENTS), default="auto",
                        help="where V4.1's engram tables live: device, host (read by the GPU over PCIe), auto")
    parser.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--peak-tflops", type=float,
                        help="dense peak TFLOP/s of one device for the prefill's fraction of peak (default: the "
                             "H200 datasheet's for the dtype: 989.5 bf16 / fp16, 67 fp32)")
    parser.add_argument("--output-json", metavar="FILE", help="write every number as JSON")


def prefill_report(cfg: ModelConfig, batch: int, input_len: int, seconds: float, dtype: str, world: int = 1,
                   peak_tflops: float | None = None) -> dict[str, Any]:
    """Prefill rates of `batch` prompts of `input_len` tokens computed in `seconds` (whole prompts, no prefix
    hit): tokens/s, the FLOP model's FLOPs (`prefill_flops`) and TFLOP/s, and their fraction of the dense peak of
    `world` devices (`peak_tflops` per device, else one H200's for `dtype`): `flop_rate_report`'s fields."""
    return {"prefill_tokens": batch * input_len,
            "prefill_tokens_per_s": batch * input_len / seconds if seconds > 0 else float("nan"),
            **flop_rate_report(prefill_flops(cfg, input_len, batch), seconds, dtype, world, peak_tflops)}


def spec_decode_counters(engine: Any, before: Any) -> dict[str, Any] | None:
    """Speculative decoding's acceptance counters since `before` (a copy of `engine.spec_decode_stats` taken
    earlier; None when speculation is off) and the acceptance length: tokens a verify step emits per request,
    accepted drafts per draft + 1."""
    after = engine.spec_decode_stats
    if after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"speculative_config": asdict(engine.config.speculative), "num_drafts": drafts,
            "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": [a - b for a, b in zip(after.num_accepted_tokens_per_pos,
                                                                  before.num_accepted_tokens_per_pos)],
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}


def spec_decode_report(engine: Any, before: Any, decode_tokens: int, decode_seconds: float, batch: int
                       ) -> dict[str, Any] | None:
    """`spec_decode_counters` over the timed batches plus output tokens per second over their decode steps, in
    total and per request (a request's tokens over the time the whole batch decodes: what one user sees)."""
    report = spec_decode_counters(engine, before)
    if report is None:
        return None
    rate = decode_tokens / decode_seconds if decode_seconds > 0 else float("nan")
    return {**report, "decode_tokens": decode_tokens, "output_tokens_per_s": rate,
            "output_tokens_per_s_per_request": rate / batch}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return the result dict (what --output-json writes)."""
    if args.batch_size < 1 or args.input_len < 1 or args.output_len < 2 or args.num_iters < 1:
        raise ValueError("need --batch-size >= 1, --input-len >= 1, --output-len >= 2 (one decode step at least) "
                         "and --num-iters >= 1")
    cfg = load_model_config(args.model)
    if args.baseline == "hf" and cfg.v41 is not None:
        raise ValueError("--baseline hf runs transformers' DeepseekV4ForCausalLM: it needs a DeepSeek-V4 checkpoint")
    device_str, dtype = resolve_device_dtype(args.device, args.dtype)
    device = torch.device(device_str)
    b, i, o = args.batch_size, args.input_len, args.output_len

    schema = None
    if args.json_schema is not None:
        with open(args.json_schema) as f:
            schema = json.load(f)
    engine, engine_info = build_engine(args, device_str, dtype)
    for w in range(args.num_iters_warmup):
        run_batch(engine, random_prompts(cfg, b, i, args.seed + 1000 + w), o, device, f"warmup{w}", schema)
    # every timed batch prefills prompts of its own: a repeated prompt would be served from the prefix cache
    prompts = random_prompts(cfg, b, i, args.seed)
    # acceptance counters since start: the report takes the timed batches' share (warm-up excluded)
    spec_before = copy.deepcopy(engine.spec_decode_stats)
    decode_tokens = 0
    decode_steps: list[float] = []
    host_times: list[float] = []
    md_times: list[float] = []
    prefill_times: list[float] = []
    prefill_compute: list[float] = []
    cached: list[int] = []
    e2e: list[float] = []
    tokens: list[list[int]] = []
    for it in range(args.num_iters):
        if it > 0:
            prompts = random_prompts(cfg, b, i, args.seed + it)
        steps, tokens = run_batch(engine, prompts, o, device, f"iter{it}", schema, cached)
        decode_steps += [s.seconds for s in steps if s.decode]
        decode_tokens += sum(s.num_tokens for s in steps if s.decode)
        host_times += [s.host_s for s in steps if s.decode]
        md_times += [s.md_host_s for s in steps if s.decode]
        prefill_times.append(sum(s.seconds for s in steps if not s.decode))  # the batch's prefill step(s)
        prefill_compute.append(sum(s.seconds for s in steps if s.prefill))  # the steps computing prompt tokens
        e2e.append(sum(s.seconds for s in steps))
    quant = engine.config.quant  # the weight format the engine runs, for the floor
    held = {"model_load_s": engine.model_load_s, "weight_bytes_on_device": weight_bytes(engine),
            "memory": engine.memory.to_json(), "weight_plan": engine.weight_plan,
            "max_memory_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    spec = spec_decode_report(engine, spec_before, decode_tokens, sum(decode_steps), b)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    stats = summarize(decode_steps)
    # several GPUs read their shares at the same time: the floor is what one of them reads over its bandwidth
    world = max(1, args.tensor_parallel_size)
    floor = mean_decode_floor(cfg, b, i, o, dtype, world, quant)
    copy_bytes = args.copy_bytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    bandwidth = measure_copy_bandwidth(device, copy_bytes)
    floor_time = floor.total / bandwidth
    prefill = summarize(prefill_compute)
    result: dict[str, Any] = {
        "benchmark": "latency", "model": args.model, "model_type": cfg.model_type, **environment(args, device),
        "dtype": dtype, "batch_size": b, "input_len": i, "output_len": o, "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup, "enforce_eager": bool(args.enforce_eager), **engine_info,
        "decode_step_s": stats, "decode_steps": len(decode_steps), "decode_step_times_s": decode_steps,
        "decode_host_launch_s": summarize(host_times), "decode_metadata_host_s": summarize(md_times),
        "decode_backend": args.decode_backend, "tensor_parallel_size": world, "json_schema": schema,
        # a plain decode step emits one token per request; a speculative one a varying number: tokens over time
        "decode_tokens_per_s": b / stats["median"] if spec is None else spec["output_tokens_per_s"],
        "spec_decode": spec, "prefill_s": summarize(prefill_times), "e2e_s": summarize(e2e),
        "prefill_time_s": prefill, "prefill_cached_tokens": sum(cached),
        **prefill_report(cfg, b, i, prefill["median"], dtype, world, args.peak_tflops),
        "quantization": None if quant is None else quant.to_json(), "load_format": args.load_format, **held,
        "floor_bytes": floor.total, "floor": {**asdict(floor), "total": floor.total},
        "copy_bytes": copy_bytes, "copy_bandwidth_Bps": bandwidth, "floor_time_s": floor_time,
        "fraction_of_floor": floor_time / stats["median"], "achieved_Bps": floor.total / stats["median"],
        "hf": None,
    }
    if args.baseline == "hf":
        hf_times, hf_tokens = hf_decode_steps(args.model, prompts, o, dtype, device)
        hf = summarize(hf_times)
        result["hf"] = {"decode_step_s": hf, "decode_step_times_s": hf_times,
                        "fraction_of_floor": floor_time / hf["median"],
                        "speedup": hf["median"] / stats["median"],  # HF step time / dsv4 step time
                        "matching_sequences": sum(a == h for a, h in zip(tokens, hf_tokens))}
    return result


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f}"


def print_result(res: dict[str, Any]) -> None:
    """The short table."""
    s, f = res["decode_step_s"], res["floor"]
    print(f"dsv4 bench latency: {res['model']} ({res['model_type']}), {res['device_name']} [{res['device']}], "
          f"{res['dtype']}, enforce_eager={res['enforce_eager']}")
    print(f"batch {res['batch_size']}, input {res['input_len']}, output {res['output_len']}, "
          f"{res['num_iters']} iters (+{res['num_iters_warmup']} warm-up), {res['decode_steps']} decode steps")
    print(f"{'':24}{'median':>10} {'mean':>10} {'p90':>10}")
    print(f"{'decode step (ms)':24}{_ms(s['median'])} {_ms(s['mean'])} {_ms(s['p90'])}")
    h = res["decode_host_launch_s"]
    print(f"{'host launch/step (ms)':24}{_ms(h['median'])} {_ms(h['mean'])} {_ms(h['p90'])}")
    m = res["decode_metadata_host_s"]
    print(f"{'  of it metadata (ms)':24}{_ms(m['median'])} {_ms(m['mean'])} {_ms(m['p90'])}")
    p = res["prefill_s"]
    print(f"{'prefill steps (ms)':24}{_ms(p['median'])} {_ms(p['mean'])} {_ms(p['p90'])}")
    p = res["prefill_time_s"]
    print(f"{'prefill, synced (ms)':24}{_ms(p['median'])} {_ms(p['mean'])} {_ms(p['p90'])}  "
          f"({res['prefill_tokens']} prompt tokens)")
    print(f"{'prefill tokens/s':24}{res['prefill_tokens_per_s']:10.1f}")
    c = res["prefill_flops_by_component"]
    parts = ", ".join(f"{k} {c[k] / c['total'] * 100:.0f}%" for k in c if k != "total" and c[k])
    print(f"{'prefill FLOPs':24}{res['prefill_flops'] / 1e12:10.4g} TFLOP  ({parts})")
    print(f"{'prefill TFLOP/s':24}{res['prefill_tflops_per_s']:10.4g}  = {res['prefill_fraction_of_peak'] * 100:.3g} % "
          f"of {res['peak_tflops_per_s']:.1f} TFLOP/s ({res['peak_source']})")
    print(f"{'decode tokens/s':24}{res['decode_tokens_per_s']:10.1f}")
    sd = res.get("spec_decode")
    if sd is not None:
        cfg = sd["speculative_config"]
        print(f"{'speculative':24}{cfg['method']:>10} k={cfg['num_speculative_tokens']}, {sd['num_drafts']} verify "
              f"steps, {sd['num_accepted_tokens']}/{sd['num_draft_tokens']} drafts accepted")
        print(f"{'acceptance length':24}{sd['acceptance_length']:10.3f}  tokens per verify step per request "
              f"(rate {sd['acceptance_rate'] * 100:.1f} %)")
        print(f"{'tokens/s per request':24}{sd['output_tokens_per_s_per_request']:10.1f}")
    world = res.get("tensor_parallel_size", 1)
    per_gpu = f" per GPU ({world} GPUs)" if world > 1 else ""
    print(f"{'floor bytes/step':24}{res['floor_bytes'] / 1e9:10.4f} GB  (weights {f['weight_bytes'] / 1e9:.4f}, "
          f"experts {f['expert_bytes'] / 1e9:.4f}, KV {f['kv_bytes'] / 1e9:.4f}){per_gpu}")
    print(f"{'copy bandwidth':24}{res['copy_bandwidth_Bps'] / 1e9:10.1f} GB/s{per_gpu}")
    print(f"{'floor time/step (ms)':24}{_ms(res['floor_time_s'])}")
    print(f"{'fraction of floor':24}{res['fraction_of_floor'] * 100:9.1f} %")
    print(f"{'achieved (GB/s)':24}{res['achieved_Bps'] / 1e9:10.1f}")
    q = res["quantization"]
    fmt = "in the model dtype" if q is None else f"FP8 {q['weight_block_size']} + {q['expert_dtype']} experts"
    print(f"{'weights':24}{res['weight_bytes_on_device'] / 1e9:10.3f} GB  {fmt}, load {res['model_load_s']:.1f} s "
          f"({res['load_format']})")
    if res["hf"] is not None:
        h = res["hf"]["decode_step_s"]
        print(f"{'HF decode step (ms)':24}{_ms(h['median'])} {_ms(h['mean'])} {_ms(h['p90'])}")
        print(f"{'HF fraction of floor':24}{res['hf']['fraction_of_floor'] * 100:9.1f} %")
        print(f"{'speedup vs HF':24}{res['hf']['speedup']:10.2f} x  "
              f"({res['hf']['matching_sequences']}/{res['batch_size']} greedy sequences identical)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """`dsv4 bench latency`: run, print the table, write --output-json."""
    return run_and_report(args, run, print_result)
