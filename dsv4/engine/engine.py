"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

The engine validates requests (a bad one raises for that request only; the others keep running), fans out
`n > 1` into child requests, drives scheduler -> runner -> scheduler, detokenizes incrementally and applies
stop strings.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dsv4.config import CacheConfig, EngineConfig, SchedulerConfig
from dsv4.distributed import ParallelConfig, StepChannel, init_parallel
from dsv4.engine.multimodal import expand_image_spans, process_images
from dsv4.engine.request import Request
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.stop import check_stop_strings, stop_hold_back
from dsv4.kv.manager import KVCacheManager
from dsv4.kv.spec import make_kv_groups, replay_tokens, ring_slack
from dsv4.engine.memory_plan import check_weights_fit, image_cache_bytes, memory_report
from dsv4.models.build import build_model
from dsv4.models.config import ConfigError, ModelConfig, load_model_config
from dsv4.models.layers import merged
from dsv4.quant.config import load_quant_config
from dsv4.quant.online import load_dir as online_quantized_dir
from dsv4.outputs import CompletionOutput, Logprob, RequestOutput
from dsv4.runtime import compile_log
from dsv4.runtime.kv_cache import kv_cache_bytes
from dsv4.runtime.runner import ModelRunner, PendingOutput
from dsv4.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError, is_valid_unicode
from dsv4.spec_decode.config import SpeculativeConfig, drafter_spec, parse_speculative_config
from dsv4.spec_decode.speculator import SpecDecodeStats
from dsv4.step import RunnerOutput, SchedulerOutput, TokenLogprobs
from dsv4.structured import GrammarCompiler
from dsv4.structured.compiler import GrammarKey
from dsv4.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling values); only that request fails."""


@dataclass
class _Child:
    """One sample of a user request: its engine request, detokenizer and what it has produced."""

    request: Request
    detok: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_seen: int = 0  # output tokens already turned into text
    # DELTA outputs: how much of the tokens, text and logprobs earlier outputs carried
    tokens_out: int = 0
    text_out: int = 0
    logprobs_out: int = 0


@dataclass
class _UserRequest:
    """A request as the user sees it: a prompt and `n` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    grammar_key: GrammarKey | None = None  # the grammar it holds in the engine's GrammarCompiler, if constrained


def default_num_blocks(config: EngineConfig) -> int:
    """Window-group blocks for max_num_seqs requests of max_model_len tokens (plus the null block)."""
    sc, bs = config.scheduler, config.cache.block_size
    return sc.max_num_seqs * -(-sc.max_model_len // bs) + 1


def kv_blocks_for_budget(cfg: ModelConfig, block_size: int, max_num_seqs: int, dtype: torch.dtype,
                         budget: int, slack: int = 0) -> int:
    """The largest window-group pool whose caches (all groups) fit in `budget` bytes."""
    def fits(n: int) -> bool:
        return kv_cache_bytes(cfg, make_kv_groups(cfg, block_size, n, max_num_seqs, slack=slack), dtype) <= budget

    lo, hi = 0, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def default_async_scheduling(device: str, requested: bool | None) -> bool:
    """Async scheduling unless told otherwise on CUDA, where host work can hide behind the GPU's; off on the CPU."""
    return requested if requested is not None else str(device).startswith("cuda")


def speculative_async_request(spec: SpeculativeConfig | None, requested: bool | None,
                              tensor_parallel_size: int) -> bool | None:
    """What a speculative config makes of an unset async_scheduling (None: the device's default, which pipelines
    the verify steps). Off with eager verify steps (they cannot be pipelined; asking for async with them is an
    error) and over several ranks, where pipelined steps have run on the CPU only (gloo: tests/test_distributed.py),
    never over NCCL on GPUs."""
    if spec is None or requested is not None:
        return requested
    return False if not spec.verify_decode or tensor_parallel_size > 1 else None


class LLMEngine:
    """Single-process engine: scheduler, KV manager, runner and detokenizers."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        config.validate()
        compiles = compile_log.install_from_env()  # DSV4_LOG_COMPILES=1: a line per Triton compile from here on
        self.config, self.tokenizer = config, tokenizer
        eos = set(config.model.eos_token_ids)  # the model's stop tokens and the tokenizer's
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self._eos = tuple(sorted(eos))
        # structured outputs: grammars over this tokenizer, compiled at admission or beforehand by the caller (the
        # server, off this thread); a bad one fails its request
        self.grammar_compiler = (GrammarCompiler(tokenizer, config.model.vocab_size, self._eos)
                                 if tokenizer is not None else None)
        torch.manual_seed(config.seed)
        dtype = _DTYPES[config.dtype]
        # every rank runs this same engine on the same requests (dsv4.distributed): decisions agree by determinism
        self.parallel = init_parallel(config.parallel, config.device)
        self._channel = (StepChannel(self.parallel) if config.parallel.follow_rank0 and self.parallel.world_size > 1
                         else None)
        self.weight_plan = check_weights_fit(config, dtype)  # a config that cannot fit fails here, before loading
        t0 = time.perf_counter()
        model = build_model(config.model, config.model_dir, dtype, config.device, self.parallel, config.quant,
                            config.load_format, config.engram_placement, merge=merged.MERGE_SIBLINGS)
        self.model_load_s = time.perf_counter() - t0  # checkpoint -> device weights (bench latency reports it)
        num_blocks = config.cache.num_blocks or default_num_blocks(config)
        self._step_peak: int | None = None  # the KV sizing's profile of a worst-case step
        if config.device.startswith("cuda") and config.cache.num_blocks is None:
            num_blocks = self._size_kv_pool(model, dtype)
        cc = config.cache
        replay = replay_tokens(config.model, cc.swa_bounded_replay) if cc.enable_prefix_caching else 0
        self.groups = make_kv_groups(config.model, cc.block_size, num_blocks, config.scheduler.max_num_seqs, replay,
                                     self._ring_slack())
        self.runner = ModelRunner(config, model, self.groups, dtype, self.grammar_compiler)
        cuda = config.device.startswith("cuda")
        if cuda:  # a capture empties the allocator's cache (torch.cuda.graph does): empty it first, so the
            gc.collect()  # difference is the graphs' pools, not the profile's cached blocks going away
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(torch.device(config.device)) if cuda else 0
        self.runner.capture_graphs()
        graphs = torch.cuda.memory_reserved(torch.device(config.device)) - before if cuda else None
        spec = self.runner.speculator
        self.memory = memory_report(config, model, kv_cache_bytes(config.model, self.groups, dtype), self._step_peak,
                                    graphs, spec.proposer.drafter if spec is not None else None)
        for line in self.memory.lines():
            logger.info("%s", line)
        self.kv_manager = KVCacheManager(self.groups, config.scheduler.max_num_batched_tokens, cc.enable_prefix_caching)
        if self.kv_manager.prefix is not None:
            logger.info("prefix caching: units of %d tokens, %s replay of %d tokens after a hit",
                        self.kv_manager.prefix.unit_tokens, "bounded" if cc.swa_bounded_replay else "exact",
                        self.kv_manager.replay_tokens)
        elif cc.enable_prefix_caching:
            logger.info("prefix caching: off for %s (no prefix-cacheable KV group: its compressors carry open-window "
                        "state across every block boundary)", config.model.model_type)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.requests: dict[str, _UserRequest] = {}
        self._child_to_user: dict[str, str] = {}
        self._ids = itertools.count()
        # async scheduling: the launched step whose tokens are still on their way (its SchedulerOutput with them)
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        if compiles is not None:  # what start-up compiled; any compile logged after this line is a request's wait
            n, secs = len(compiles.records), sum(r.seconds for r in compiles.records)
            logger.info("start-up compiled %d Triton kernel variants in %.1f s; later compiles delay requests", n, secs)

    def _ring_slack(self) -> int:
        """The compressor rings' rows past their windows under speculation (`kv.spec.ring_slack`)."""
        spec = self.config.speculative
        return ring_slack(spec.num_speculative_tokens if spec is not None else None)

    def _size_kv_pool(self, model: torch.nn.Module, dtype: torch.dtype) -> int:
        """Profile a worst-case step on a minimal pool, then give the KV cache what `gpu_memory_utilization`
        leaves (capped at what max_num_seqs requests of max_model_len can use). A budget that cannot hold one
        request of max_model_len fails here, at start-up, never mid-run."""
        cfg, sc, bs = self.config, self.config.scheduler, self.config.cache.block_size
        slack = self._ring_slack()
        per_request = -(-sc.max_model_len // bs) + 1
        probe = make_kv_groups(cfg.model, bs, per_request + 1, sc.max_num_seqs, slack=slack)
        runner = ModelRunner(cfg, model, probe, dtype)
        peak = runner.profile_peak_memory() - kv_cache_bytes(cfg.model, probe, dtype)
        self._step_peak = peak
        del runner
        gc.collect()  # the probe runner's speculator (and drafter) reference it back: a cycle
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory
        images = image_cache_bytes(cfg, model)  # filled as images arrive: held back from the KV cache
        budget = int(total * cfg.gpu_memory_utilization) - peak - images
        blocks = kv_blocks_for_budget(cfg.model, bs, sc.max_num_seqs, dtype, budget, slack)
        if blocks < per_request + 1:
            need = kv_cache_bytes(cfg.model, probe, dtype)
            raise ConfigError(
                f"the KV cache does not fit: one request of max_model_len={sc.max_model_len} needs "
                f"{need / 2**30:.2f} GiB, but gpu_memory_utilization={cfg.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB leaves {max(budget, 0) / 2**30:.2f} GiB after the weights, a worst-case "
                f"step ({peak / 2**30:.2f} GiB) and the image cache ({images / 2**30:.2f} GiB); lower max_model_len or "
                "max_num_batched_tokens or image_cache_mb, or raise gpu_memory_utilization")
        blocks = min(blocks, default_num_blocks(cfg))
        blocks = self.parallel.min_(blocks, cfg.device)  # every rank schedules into the same pool: the smallest
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB); worst-case step peak %.2f GiB", blocks, bs,
                    kv_cache_bytes(cfg.model, make_kv_groups(cfg.model, bs, blocks, sc.max_num_seqs, slack=slack),
                                   dtype) / 2**30,
                    peak / 2**30)
        return blocks

    @classmethod
    def from_args(cls, model: str, dtype: str = "float32", device: str = "cpu", max_model_len: int | None = None,
                  max_num_seqs: int = 16, max_num_batched_tokens: int | None = None, block_size: int = 16,
                  num_kv_blocks: int | None = None, seed: int = 0, load_tokenizer: bool = True,
                  enforce_eager: bool = False, cudagraph_capture_sizes: tuple[int, ...] | None = None,
                  gpu_memory_utilization: float = 0.9, encoder_cudagraphs: bool = False,
                  piecewise_cudagraphs: bool = False, compile_decode: bool = False,
                  async_scheduling: bool | None = None,
                  enable_prefix_caching: bool = True, swa_bounded_replay: bool = True, image_cache_mb: int = 128,
                  decode_backend: str = "default", tensor_parallel_size: int = 1,
                  expert_parallel: bool = False, parallel_init_timeout_s: float = 300.0,
                  follow_rank0: bool = False, quantization: str | None = None,
                  load_format: str = "auto", skip_tokenizer_init: bool = False,
                  scheduling_policy: str = "fair", engram_placement: str = "auto",
                  speculative_config: str | dict[str, Any] | None = None, long_prefill_token_threshold: int = 0,
                  max_num_partial_prefills: int = 1, max_long_partial_prefills: int = 1) -> "LLMEngine":
        """Build an engine from a checkpoint directory and the usual knobs (async_scheduling None: on for CUDA;
        quantization None / "auto": the checkpoint's format, "none": dequantize FP8 / FP4 weights at load;
        speculative_config: vLLM's `{"method": "dspark", "num_speculative_tokens": k}`, a dict or its JSON; with its
        default verify steps as decode rows, async scheduling (on CUDA) pipelines the steady verify steps,
        dsv4/spec_decode/pipelined.py; with `"verify_decode": false` async scheduling is off, and asking for it an
        error). quantization "fp8" of a float checkpoint loads its released-format copy (made once, cached:
        dsv4/quant/online.py)."""
        model, quantization = online_quantized_dir(model, quantization)
        mc = load_model_config(model)
        spec = parse_speculative_config(speculative_config, drafter_spec(_raw_config(model)))
        async_scheduling = speculative_async_request(spec, async_scheduling, tensor_parallel_size)
        pipelined = spec is not None and bool(async_scheduling)
        quant = load_quant_config(model, quantization)
        max_model_len = max_model_len or min(mc.max_position_embeddings, 4096)
        batched = max_num_batched_tokens or max(2048, max_model_len)
        cfg = EngineConfig(
            model_dir=model, model=mc,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                                      max_model_len=max_model_len,
                                      async_scheduling=default_async_scheduling(device, async_scheduling),
                                      scheduling_policy=scheduling_policy,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      max_num_partial_prefills=max_num_partial_prefills,
                                      max_long_partial_prefills=max_long_partial_prefills,
                                      drafts_past_max_tokens=spec is not None and spec.verify_decode,
                                      spec_pipeline_tokens=spec.num_speculative_tokens + 1 if pipelined else 0),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                              enable_prefix_caching=enable_prefix_caching, swa_bounded_replay=swa_bounded_replay,
                              image_cache_mb=image_cache_mb),
            dtype=dtype, device=device, seed=seed, enforce_eager=enforce_eager,
            cudagraph_capture_sizes=cudagraph_capture_sizes, gpu_memory_utilization=gpu_memory_utilization,
            encoder_cudagraphs=encoder_cudagraphs, piecewise_cudagraphs=piecewise_cudagraphs,
            compile_decode=compile_decode, decode_backend=decode_backend,
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel,
                                    init_timeout_s=parallel_init_timeout_s, follow_rank0=follow_rank0),
            quant=quant, load_format=load_format, speculative=spec, engram_placement=engram_placement,
        )
        # skip_tokenizer_init (vLLM's name): token ids in and out, no tokenizer files needed
        tok = Tokenizer.from_dir(model) if load_tokenizer and not skip_tokenizer_init else None
        return cls(cfg, tok)

    # ---- requests ------------------------------------------------------------------------------------
    def _validate(self, prompt_ids: list[int], params: SamplingParams,
                  grammar: "xgrammar.CompiledGrammar | None" = None) -> "xgrammar.CompiledGrammar | None":
        """Raise RequestError for a request the engine cannot run; return its compiled grammar (None when it has no
        structured outputs): `grammar` when the caller compiled it beforehand, else compiled here."""
        vocab = self.config.model.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        max_len = self.config.scheduler.max_model_len
        if len(prompt_ids) >= max_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_len} "
                               f"(a prompt must leave room for at least one generated token)")
        if len(prompt_ids) >= self.scheduler.max_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the KV cache holds at most "
                               f"{self.scheduler.max_len} tokens for one request")
        try:
            params.validate()
        except SamplingParamsError as e:
            raise RequestError(str(e)) from None
        for tok in list(params.logit_bias or {}) + list(params.stop_token_ids or []):
            if tok >= vocab:
                raise RequestError(f"token id {tok} in logit_bias/stop_token_ids is outside the vocabulary")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer")
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise RequestError("structured outputs need a tokenizer")
            if grammar is None:  # compiled on this thread: the offline path (the server compiles beforehand)
                try:
                    grammar = self.grammar_compiler.compile(params.structured_outputs)
                except ValueError as e:
                    raise RequestError(str(e)) from None
        else:
            grammar = None
        room = max_len - len(prompt_ids)
        if params.min_tokens > room:
            raise RequestError(f"sampling parameter `min_tokens` asks for {params.min_tokens} tokens but the prompt "
                               f"leaves room for {room} (max_model_len {max_len})")
        masked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos))
        if params.min_tokens and len(masked) >= vocab:  # below min_tokens the stop tokens are masked: none is left
            raise RequestError("sampling parameter `stop_token_ids` covers the whole vocabulary, so `min_tokens` "
                               "leaves nothing to sample")
        return grammar

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    images: list[Any] | None = None, group_id: str | None = None,
                    grammar: "xgrammar.CompiledGrammar | None" = None) -> str:
        """Queue a request (a text prompt or token ids, and optionally images: PIL images, paths, bytes or data
        URLs, one per image placeholder of the prompt). Raises RequestError for a bad request; nothing is queued.
        `group_id`: the user request it belongs to, for the "fair" scheduling policy (default: its own id; a server
        gives every prompt of one multi-prompt completion the same group, so the batch shares one fair share).
        `grammar`: the grammar of `params.structured_outputs`, compiled beforehand with `grammar_compiler` off the
        engine thread (AsyncLLMEngine does); without it a constrained request's grammar is compiled here."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; pass prompt_token_ids")
            if not is_valid_unicode(prompt):
                raise RequestError("the prompt is not valid Unicode text (a lone surrogate)")
            text, prompt_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, prompt_ids = None, list(prompt)
        else:
            raise RequestError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        image_inputs = None
        if images:
            vision = self.config.model.vision
            if vision is None:
                raise RequestError("this model has no vision tower: it cannot take images")
            try:
                processed = process_images(list(images), vision)
                prompt_ids, image_inputs = expand_image_spans(prompt_ids, processed, self.config.model.v41.image_token_id)
            except ValueError as e:
                raise RequestError(str(e)) from None
        grammar = self._validate(prompt_ids, params, grammar)
        eos = self._eos
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:  # each sample is its own sequence; seeded samples get seed + index, as vLLM
                child_params = SamplingParams(**{**_params_fields(params), "n": 1,
                                                 "seed": None if params.seed is None else params.seed + i})
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, list(prompt_ids), child_params, eos_token_ids=eos,
                          group_id=group_id or request_id, images=image_inputs)
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                     if self.tokenizer is not None else None)
            children.append(_Child(req, detok, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None))
        added = []
        try:
            for c in children:
                self.scheduler.add_request(c.request)
                added.append(c.request.req_id)
        except ValueError as e:
            self.scheduler.abort_requests(added)
            raise RequestError(str(e)) from None
        for c in children:
            self._child_to_user[c.request.req_id] = request_id
        user = _UserRequest(request_id, text, list(prompt_ids), children, params.output_kind)
        if grammar is not None:
            # held until the request ends: the runner looks it up again at admission and after every preemption
            assert self.grammar_compiler is not None and params.structured_outputs is not None
            user.grammar_key = self.grammar_compiler.hold(params.structured_outputs, grammar)
        self.requests[request_id] = user
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (all their samples); their KV blocks are freed at once."""
        for rid in request_ids:
            user = self.requests.pop(rid, None)
            if user is None:
                continue
            self._release_grammar(user)
            ids = [c.request.req_id for c in user.children]
            self.scheduler.abort_requests(ids)
            for cid in ids:
                self._child_to_user.pop(cid, None)

    def _release_grammar(self, user: _UserRequest) -> None:
        if user.grammar_key is not None and self.grammar_compiler is not None:
            self.grammar_compiler.release(user.grammar_key)
            user.grammar_key = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's acceptance counters since start; None when speculation is off."""
        spec = self.runner.speculator
        return spec.stats if spec is not None else None

    # ---- stepping ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of requests that progressed or finished. With async
        scheduling the step is launched first and the outputs are those of the step before it."""
        sc = self.config.scheduler
        touched: set[str] = set()
        pipelined, q = False, 0
        if sc.spec_pipeline_tokens:
            # speculation under async scheduling: only steady steps are pipelined (verify steps, and plain steps
            # while speculation is off for the batch); any other step first lands the one in flight
            # (dsv4/spec_decode/pipelined.py)
            speculator = self.runner.speculator
            assert speculator is not None
            q = speculator.pipeline_tokens()
            pipelined = q > 0 and self.scheduler.can_pipeline(q)
            if not pipelined and self._in_flight is not None:
                landed, self._in_flight = self._in_flight, None
                touched = self._apply_output(landed[0], landed[1].result())
        so = self.scheduler.schedule_pipelined(q) if pipelined else self.scheduler.schedule()
        work = bool(so.num_scheduled_tokens or so.finished_req_ids)
        if work and self._channel is not None:
            assert self.parallel.rank == 0, "under follow_rank0 only rank 0 steps; the others call follow()"
            self._channel.send(so)  # the other ranks execute the same step (their collectives meet ours)
        if not sc.async_scheduling or (sc.spec_pipeline_tokens and not pipelined):  # (speculation: synchronous)
            return self._outputs(touched | (self._apply_output(so, self.runner.execute(so)) if work else set()))
        pending = self.runner.execute_async(so) if work else None
        landed, self._in_flight = self._in_flight, (so, pending) if pending is not None else None
        return self._outputs(self._apply_output(landed[0], landed[1].result()) if landed else set())

    def follow(self) -> None:
        """Ranks other than 0 under follow_rank0: execute rank 0's steps until it stops (`stop_followers`)."""
        assert self._channel is not None and self.parallel.rank != 0, "follow() is for ranks 1.. under follow_rank0"
        while (so := self._channel.recv()) is not None:
            self.runner.execute(so)

    def stop_followers(self) -> None:
        """Rank 0 under follow_rank0: let the other ranks' follow() return (call once, when done serving)."""
        if self._channel is not None and self.parallel.rank == 0:
            self._channel.send(None)

    def _apply_output(self, so: SchedulerOutput, ro: RunnerOutput) -> set[str]:
        """Hand a step's tokens to the scheduler (stops, lengths) and to the requests' children; returns the
        user requests that changed."""
        touched: set[str] = set()
        logprobs = dict(zip(ro.req_ids, ro.logprobs))
        for req in self.scheduler.update_from_output(so, ro):
            user_id = self._child_to_user.get(req.req_id)
            if user_id is None:
                continue
            children = self.requests[user_id].children
            child = children[0] if len(children) == 1 else next(c for c in children if c.request is req)
            self._on_new_tokens(child, logprobs.get(req.req_id))
            touched.add(user_id)
        return touched

    def _outputs(self, touched: set[str]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for user_id in touched:
            user = self.requests[user_id]
            if user.first_token_time is None:
                user.first_token_time = now
            finished = all(c.finish_reason is not None for c in user.children)
            if finished or user.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(user, finished))
            if finished:
                del self.requests[user_id]
                self._release_grammar(user)
                for c in user.children:
                    self._child_to_user.pop(c.request.req_id, None)
        return outputs

    def _on_new_tokens(self, child: _Child, lps: list[TokenLogprobs] | None) -> None:
        req = child.request
        # what the scheduler appended (it drops tokens past a stop token)
        tokens = req.output_token_ids[child.num_seen:]
        stop_str = None
        if child.detok is not None:
            sp = req.sampling_params
            # several tokens at once (speculative decoding) with stop strings: one at a time, and the tokens after
            # the one that completes a stop string are dropped (decoding token by token never produces them)
            parts = [tokens] if len(tokens) <= 1 or not sp.stop else [[t] for t in tokens]
            used = 0
            for part in parts:
                piece = child.detok.step(part)
                used += len(part)
                if req.is_finished and used == len(tokens):
                    piece += child.detok.flush()
                child.text += piece
                hit = check_stop_strings(child.text, len(piece), sp.stop, sp.include_stop_str_in_output)
                if hit is not None:
                    child.text, stop_str = hit
                    break
            if used < len(tokens):
                del req.output_token_ids[child.num_seen + used:]
                tokens = tokens[:used]
        child.num_seen = req.num_output_tokens
        if lps is not None and child.logprobs is not None:
            for lp in lps[: len(tokens)]:
                child.logprobs.append(self._logprob_dict(lp))
                child.cumulative_logprob += lp.logprob
        if stop_str is not None:
            self.scheduler.finish_requests([req.req_id], "stop", stop_str)
        if req.is_finished:
            child.finish_reason = "stop" if stop_str is not None else req.finish_reason
            child.stop_reason = stop_str if stop_str is not None else req.stop_reason

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        def text(t: int) -> str | None:
            return self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer is not None else None

        d = {t: Logprob(v, rank=i + 1, decoded_token=text(t)) for i, (t, v) in
             enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        d[lp.token_id] = Logprob(lp.logprob, rank=lp.rank, decoded_token=text(lp.token_id))
        return d

    def _make_output(self, user: _UserRequest, finished: bool) -> RequestOutput:
        if user.output_kind == RequestOutputKind.DELTA:
            outs = [self._delta(i, c) for i, c in enumerate(user.children)]
        else:
            outs = [CompletionOutput(index=i, text=c.text, token_ids=list(c.request.output_token_ids),
                                     cumulative_logprob=c.cumulative_logprob,
                                     logprobs=list(c.logprobs) if c.logprobs is not None else None,
                                     finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    for i, c in enumerate(user.children)]
        metrics = {"arrival_time": user.arrival_time}
        if user.first_token_time is not None:
            metrics["first_token_time"] = user.first_token_time
        cached = max(0, user.children[0].request.num_cached_tokens)  # the prompt's hit (the same for every sample)
        return RequestOutput(user.request_id, user.prompt, user.prompt_token_ids, outs, finished,
                             num_cached_tokens=cached, metrics=metrics)

    @staticmethod
    def _delta(index: int, c: _Child) -> CompletionOutput:
        """What sample `c` produced since its last output. Until it finishes, the text withholds a tail that may
        be the start of a stop string (`stop_hold_back`): text once sent cannot be taken back."""
        tokens = c.request.output_token_ids
        text_end = len(c.text)
        if c.finish_reason is None:
            sp = c.request.sampling_params
            text_end = max(c.text_out, text_end - stop_hold_back(c.text, sp.stop, sp.include_stop_str_in_output))
        out = CompletionOutput(index=index, text=c.text[c.text_out:text_end], token_ids=list(tokens[c.tokens_out:]),
                               cumulative_logprob=c.cumulative_logprob,
                               logprobs=c.logprobs[c.logprobs_out:] if c.logprobs is not None else None,
                               finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        c.tokens_out, c.text_out = len(tokens), text_end
        c.logprobs_out = len(c.logprobs) if c.logprobs is not None else 0
        return out


def _raw_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _params_fields(p: SamplingParams) -> dict:
    return {k: v for k, v in vars(p).items() if not k.startswith("_")}
