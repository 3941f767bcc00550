"""ModelRunner: executes one SchedulerOutput on the device and returns the sampled tokens.

Per step (runtime.md 1.8): apply the request deltas to the stable rows, order the batch (decodes first), fill
the persistent input buffers from the device token history, let the model state build the attention metadata
and extra inputs, run the forward, sample the rows whose known tokens are all computed, append the sampled
tokens to the device history.

`execute_async` returns a `PendingOutput` as soon as the step is launched: its tokens are copied to the host on
the side (a non-blocking copy and an event), so the engine can schedule and launch the next step before waiting
for them (async scheduling); `execute` is the same and waits at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from dsv4.config import EngineConfig
from dsv4.engine.memory_plan import image_cache_bytes
from dsv4.engine.multimodal import ImageInput, images_to_encode
from dsv4.kv.spec import KVGroupSpec
from dsv4.models.layers.rope import prepare_rope_tables
from dsv4.runtime.attn_metadata import DecodeMetadata
from dsv4.runtime.block_tables import BlockTables
from dsv4.runtime.cudagraphs import CudaGraphManager, default_capture_sizes, round_capture_sizes
from dsv4.runtime.encoder_cudagraphs import EncoderCudaGraphManager
from dsv4.runtime.image_cache import ImageKey, ImageSpanCache
from dsv4.runtime.input_batch import InputBatch, InputBuffers
from dsv4.runtime.kv_cache import allocate_kv_caches
from dsv4.runtime.model_state import (DeepseekV41ModelState, DeepseekV41SpecializedDecodeModelState,
                                      DefaultModelState)
from dsv4.runtime.piecewise_graphs import PiecewiseGraphs, default_piecewise_sizes, unsupported
from dsv4.runtime.request_state import RequestState
from dsv4.runtime.sampler import SampledLogprobs, Sampler, SamplingTensors, greedy_sample, needs_output_values
from dsv4.runtime.warm_up import WARM_UP_REQS, step_warm_up_shapes
from dsv4.spec_decode.speculator import PlainSpecOutput, SpecOutput, Speculator, make_speculator
from dsv4.step import RunnerOutput, SchedulerOutput, TokenLogprobs
from dsv4.structured import GrammarCompiler, GrammarMatchers

logger = logging.getLogger(__name__)


class PendingOutput:
    """The sampled tokens (and logprobs) of a launched step, on their way to the host.

    `result()` waits for this step only (an event recorded after its copies, not a stream sync, so later steps
    keep running), appends the tokens to the host mirrors of rows that still belong to their request, and returns
    the RunnerOutput; later calls return the same object."""

    def __init__(self, runner: "ModelRunner", req_ids: list[str], sample_rows: np.ndarray,
                 tokens: torch.Tensor | None, lps: SampledLogprobs | None) -> None:
        self._runner, self._req_ids, self._sample_rows = runner, req_ids, sample_rows
        self._result: RunnerOutput | None = None
        self._event: torch.cuda.Event | None = None
        if tokens is not None and tokens.is_cuda:
            # pinned host copies (non_blocking from CUDA allocates them pinned), ordered after the sampling
            tokens = tokens.to("cpu", non_blocking=True)
            lps = lps.to_host(non_blocking=True) if lps is not None else None
            self._event = torch.cuda.Event()
            self._event.record()
        self._tokens, self._lps = tokens, lps

    @property
    def req_ids(self) -> list[str]:
        """The step's requests, in its row order."""
        return self._req_ids

    @property
    def sample_rows(self) -> np.ndarray:
        """Indices into `req_ids` of the requests that sample a token in this step."""
        return self._sample_rows

    def result(self) -> RunnerOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        req_ids = self._req_ids
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(req_ids)
        if self._tokens is not None:
            rs, grammars = self._runner.req_state, self._runner.grammars
            for b, t in zip(self._sample_rows.tolist(), self._tokens.tolist()):
                sampled[b] = [t]
                row = rs.req_id_to_row.get(req_ids[b])
                if row is not None:  # finished or preempted since: the scheduler keeps the token, if any
                    rs.output_ids[row].append(t)
                    grammars.accept(row, t)
            if self._lps is not None:
                for b, lp in zip(self._sample_rows.tolist(), self._lps.tolist()):
                    if lp is not None:
                        logprobs[b] = [lp]
        self._result = RunnerOutput(req_ids, sampled, logprobs)
        self._runner._forget(self)
        return self._result


class ModelRunner:
    """Owns the model, its KV caches and every per-request device tensor."""

    def __init__(self, config: EngineConfig, model: nn.Module, groups: tuple[KVGroupSpec, ...],
                 dtype: torch.dtype, grammar_compiler: GrammarCompiler | None = None) -> None:
        self.config, self.model, self.groups = config, model, groups
        prepare_rope_tables(model, config.scheduler.max_model_len)  # no position reaches max_model_len
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N": device equality
            self.device = torch.device("cuda", torch.cuda.current_device())
        sc = config.scheduler
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = config.model.eos_token_ids
        self.req_state = RequestState(sc.max_num_seqs, sc.max_model_len, self.device)
        self.block_tables = BlockTables(groups, sc.max_num_seqs, sc.max_model_len, self.device)
        # decode graphs read up to max_num_seqs rows even when the token budget is smaller
        self.buffers = InputBuffers(sc.max_num_seqs, max(sc.max_num_batched_tokens, sc.max_num_seqs), self.device)
        self.kv_caches = allocate_kv_caches(config.model, groups, dtype, self.device)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(config.seed)
        self.sampler = Sampler(gen)
        # structured outputs (dsv4.structured): the engine's compiler (None without a tokenizer: the engine then
        # refuses constrained requests) and a grammar matcher per constrained row
        self.grammar_compiler = grammar_compiler
        self.grammars = GrammarMatchers(sc.max_num_seqs, self.vocab_size, self.device)
        sizes = round_capture_sizes(list(config.cudagraph_capture_sizes or default_capture_sizes(sc.max_num_seqs)),
                                    1, sc.max_num_seqs)
        graph_sizes = sizes
        if config.speculative is not None and not config.speculative.adaptive:
            # steps with drafts have their own paths (Speculator.launch); only the plain decode steps of a batch of
            # disable_by_batch_size or more requests replay these graphs: sizes that cannot hold one are not
            # captured. The adaptive switch (spec_decode/gate.py) runs plain steps at any batch size: all sizes.
            limit = config.speculative.disable_by_batch_size
            graph_sizes = [s for s in sizes if limit is not None and s >= limit]
        use_graphs = (self.device.type == "cuda" and not config.enforce_eager and bool(graph_sizes)
                      and self._graph_safe())
        sizes = graph_sizes or sizes
        self.graphs = CudaGraphManager(sizes, enabled=use_graphs)
        # prefill / mixed steps' token-wise pieces as CUDA graphs (opt-in; captured in capture_graphs)
        self.piecewise: PiecewiseGraphs | None = None
        reason = unsupported(model) if config.piecewise_cudagraphs else None
        if reason is not None:
            raise ValueError(f"--piecewise-cudagraphs: {reason}")
        state_args = (groups, sc.max_num_seqs, sc.max_model_len, config.model.sliding_window, self.device)
        if config.decode_backend == "latency_specialized":
            self.model_state: DefaultModelState = DeepseekV41SpecializedDecodeModelState(
                *state_args, model.token_lookback_depth, sizes)
        elif config.model.v41 is not None:
            self.model_state = DeepseekV41ModelState(*state_args, model.token_lookback_depth)
        else:
            self.model_state = DefaultModelState(*state_args)
        # encoder outputs per request, computed once at admission: [(prompt offset, span embeddings)]
        self.image_spans: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.image_cache = ImageSpanCache(image_cache_bytes(config, model))  # 0 without a vision tower
        self.num_images_encoded = 0  # images the encoder ran on (not those the image cache or a prefix hit covered)
        self.num_images_skipped = 0  # wholly inside a prefix-cache hit: never encoded (see _apply_deltas)
        # launched steps whose tokens the host has not read yet, oldest first (async scheduling)
        self._unresolved: list[PendingOutput] = []
        # host time of the last execute_async, and of the last decode step's metadata build (eager or a recorded
        # one's replay): benchmarks report them per decode step
        self.last_launch_s = 0.0
        self.last_decode_md_s = 0.0
        self.num_warm_ups = 0  # warm_up_kernels calls (tests check start-up warms)
        # speculative decoding (dsv4.spec_decode): every step is the speculator's (verify, commit, propose)
        self.speculator: Speculator | None = (make_speculator(self, config.speculative)
                                              if config.speculative is not None else None)
        # its plain steps (speculation off for the batch) compute the drafter's taps too, so the drafter reads fresh
        # ones when speculation resumes; not under compile (a dict filled inside the traced forward)
        self.plain_tap_ids: tuple[int, ...] = () if config.compile_decode else self._drafter_tap_ids()

    def _graph_safe(self) -> bool:
        """Graphs need every input readable by the device without the host: engram tables on the device or in
        mapped host memory are; a host table the host gathers from is not."""
        tables = getattr(self.model, "engram_tables", {})
        if not all(t.device_readable(self.device) for t in tables.values()):
            logger.warning("engram tables are gathered by the host: decode runs eagerly (no CUDA graphs)")
            return False
        return True

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """JIT-compile the kernels a step launches outside the model's forward (model state's `warm_up`, on dummy
        decode batches of 1, 2 and 16 requests) now, not in the first request's step. Called before memory
        profiling and before graph capture (compiled kernels are cached per process: a second call relaunches them)."""
        for reqs in WARM_UP_REQS:  # the request count is an integer argument of both: one per Triton class
            if reqs <= self.config.scheduler.max_num_seqs:
                batch = InputBatch.make_dummy(self.buffers, reqs, reqs)
                self.model_state.warm_up(batch, self.block_tables, self.req_state)
        self.num_warm_ups += 1

    def warm_up_steps(self) -> int:
        """Run the eager forward once at each of `step_warm_up_shapes` (dsv4/runtime/warm_up.py says why), so a
        served step of any size compiles no Triton kernel; dummy batches write no KV a request reads. Returns the
        number of steps run."""
        sc = self.config.scheduler
        shapes = step_warm_up_shapes(sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len)
        t0 = time.perf_counter()
        for reqs, tokens in shapes:
            self.dummy_run(reqs, tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # their activations' cached blocks would count as the graphs' memory after
        logger.info("warm-up: %d dummy steps of 1-%d tokens in %.1f s", len(shapes), sc.max_num_batched_tokens,
                    time.perf_counter() - t0)
        return len(shapes)

    def capture_graphs(self) -> None:
        """Capture the vision encoder at every token budget (a V4.1 checkpoint with a vision tower) and the decode
        forward at every capture size (warm-up included); no-op when graphs are off (CPU, enforce_eager)."""
        self.warm_up_kernels()
        if self.device.type == "cuda":  # Triton kernels (the CPU runs torch's ops): compiled now, not in a request
            self.warm_up_steps()
        if (self.device.type == "cuda" and not self.config.enforce_eager and self.config.encoder_cudagraphs
                and hasattr(self.model, "vision_encoder")):
            # the model's encode_images replays these; engram tables in host memory do not matter to the encoder
            sc = self.config.scheduler
            encoder_graphs = EncoderCudaGraphManager.from_limits(self.model.vision_encoder, sc.max_num_batched_tokens,
                                                                 sc.max_model_len, self.device)
            encoder_graphs.capture()
            self.model.encoder_graphs = encoder_graphs
        if self.speculator is not None:
            self.speculator.capture_graphs()  # multi-row verify and drafter graphs, when switched on
        if self.config.piecewise_cudagraphs and self.device.type == "cuda" and not self.config.enforce_eager:
            self.piecewise = None  # a recapture drops the old graphs first
            before, t0 = torch.cuda.memory_reserved(self.device), time.perf_counter()
            sizes = default_piecewise_sizes(self.config.scheduler.max_num_batched_tokens)
            with torch.inference_mode():
                self.piecewise = PiecewiseGraphs(self.model, sizes, graphs=True)
            logger.info("piecewise CUDA graphs of prefill / mixed steps at %s tokens in %.1f s: %.2f GiB reserved",
                        sizes, time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - before) / 2 ** 30)
        if not self.graphs.enabled:
            return
        # graphs hold the addresses of everything they read: a recapture drops the old ones first
        self.graphs.release()
        self.model_state.release_graphs()
        # The extra inputs (lookback window) are filled here, once: a fill inside `run` would be captured and
        # replayed over the real inputs. All-padding metadata: captures write only the trash slots.
        largest = self.graphs.capture_sizes[-1]
        extra = self.model_state.prepare_dummy_inputs(largest, largest)
        self.model_state.prepare_dummy_decode_attn(largest)
        self.buffers.input_ids.zero_()
        forward = self.model.forward_decode
        if self.config.compile_decode:
            # one eager pass first fills lazy caches (engram hash tensors, rope tables) outside the trace; then one
            # compiled variant per capture size (static shapes: the Triton wrappers size their grids and splits
            # from the batch on the host), each compiled in its first warm-up run
            with torch.inference_mode():
                forward(self.buffers.input_ids[:largest], self.model_state.decode.views(largest, largest),
                        self.kv_caches, **extra)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                        2 * len(self.graphs.capture_sizes))
            forward = torch.compile(forward, dynamic=False)

        def run(size: int) -> torch.Tensor:  # with `plain_tap_ids`, the drafter's taps beside the hidden states
            inputs = {k: v[:size] for k, v in extra.items()}
            return self._forward_decode_with_taps(forward, size, self.model_state.decode.views(size, size), inputs)

        with torch.inference_mode():
            self.graphs.capture(run)
            # the decode-metadata builds the graphs serve (specialized decode only), in the same memory pool
            self.model_state.capture_metadata_graphs(self.buffers, self.block_tables, self.graphs.pool)

    # ---- request deltas ------------------------------------------------------------------------------
    def _apply_deltas(self, so: SchedulerOutput) -> None:
        for req_id in sorted(so.finished_req_ids):  # sorted: every rank frees rows in the same order
            self.model_state.remove_request(req_id)
            row = self.req_state.remove_request(req_id)
            if row is not None:
                self.grammars.remove(row)
            self.image_spans.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.image_spans.pop(new.req_id, None)  # a resumed request: its spans are those of this admission
            images = images_to_encode(new.images or [], new.num_computed_tokens)  # `_image_rows` reads no other
            if images:
                self.image_spans[new.req_id] = self._encode_images(images)
            self.num_images_skipped += len(new.images or ()) - len(images)
            old_row = self.req_state.req_id_to_row.get(new.req_id)
            if old_row is not None:  # re-adding an id replaces its old row: its matcher goes with it
                self.grammars.remove(old_row)
            row = self.req_state.add_request(new)
            so_params = new.sampling_params.structured_outputs
            if so_params is not None:
                assert self.grammar_compiler is not None, "the engine admits constrained requests only with one"
                self.grammars.add(row, self.grammar_compiler.compile(so_params), new.output_token_ids)
            self.block_tables.set_row(row, new.block_ids)
            self.model_state.add_request(row, new)
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = self.req_state.req_id_to_row[req_id]
            if new_ids is not None:
                self.block_tables.append(row, new_ids)
            self.req_state.num_computed[row] = computed

    def _encode_images(self, images: list[ImageInput]) -> list[tuple[int, torch.Tensor]]:
        """(prompt offset, span embeddings) of each ImageInput: spans the image cache keeps, the others encoded in
        one call (each distinct image once) and kept."""
        keys: list[ImageKey] = [(im.content_hash, (int(im.vit_grid[0]), int(im.vit_grid[1]))) for im in images]
        spans: list[torch.Tensor | None] = [self.image_cache.get(key) for key in keys]
        first: dict[ImageKey, int] = {}  # a missing key -> its first image
        for i, span in enumerate(spans):
            if span is None:
                first.setdefault(keys[i], i)
        if first:
            outputs = self.model.encode_images([images[i] for i in first.values()])
            encoded = {key: span for key, (_, span) in zip(first, outputs)}
            for key, span in encoded.items():
                self.image_cache.put(key, span)
            spans = [encoded[key] if span is None else span for key, span in zip(keys, spans)]
            self.num_images_encoded += len(first)
        return [(im.offset, span) for im, span in zip(images, spans)]  # type: ignore[misc]  # all filled above

    # ---- one step ------------------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.execute_async(so).result()

    def _forget(self, pending: PendingOutput) -> None:
        if pending in self._unresolved:
            self._unresolved.remove(pending)

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingOutput | SpecOutput | PlainSpecOutput:
        """Launch one step; rows whose chunk ends at their last planned token get a sampled token. The host knows
        how many tokens every row has at once (the next step's inputs come from the device history); their values
        come with the returned PendingOutput."""
        t_start = time.perf_counter()
        pending = self._launch(so)
        self.last_launch_s = time.perf_counter() - t_start
        return pending

    def _launch(self, so: SchedulerOutput) -> PendingOutput | SpecOutput | PlainSpecOutput:
        if self.speculator is not None:
            return self.speculator.launch(so)
        self._apply_deltas(so)
        return self.launch_plain(so)

    def launch_plain(self, so: SchedulerOutput) -> PendingOutput:
        """A step without drafts, its request deltas applied already (the speculator runs such steps here when
        speculation is off for the batch: disable_by_batch_size)."""
        rs = self.req_state
        # decodes first (builders split decodes from prefills), then by query length; stable
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: (so.num_scheduled_tokens[r] != 1,
                                                                   so.num_scheduled_tokens[r]))
        if not req_ids:
            return PendingOutput(self, [], np.zeros(0, dtype=np.int64), None, None)
        rows = np.array([rs.req_id_to_row[r] for r in req_ids], dtype=np.int64)
        sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = rs.num_computed[rows].copy()
        assert (computed + sched <= rs.num_tokens[rows]).all(), "scheduled past the known tokens"
        sample_rows = np.nonzero(computed + sched == rs.num_tokens[rows])[0]

        batch = InputBatch.prepare(self.buffers, rs.token_history, req_ids, rows, computed, sched, sample_rows)
        image_rows = self._image_rows(batch)
        tap_ids = self.plain_tap_ids
        if (sched == 1).all() and image_rows is None and not self.model_state.replaying(batch):
            hidden = self._decode(batch)
            tap_values = hidden[:, self.config.model.hidden_size:] if tap_ids else None
            hidden = hidden[:, : self.config.model.hidden_size] if tap_ids else hidden
        else:
            md = self.model_state.prepare_attn(batch, self.block_tables)
            extra = self.model_state.prepare_inputs(batch, rs)
            if image_rows is not None:
                extra["image_embeds"] = image_rows
            taps = dict.fromkeys(tap_ids) if tap_ids else None
            if taps is not None:
                extra["taps"] = taps
            pw = self.piecewise
            if pw is not None and image_rows is None and taps is None and pw.bucket(batch.num_tokens) is not None:
                hidden = pw.forward(batch.input_ids, md, self.kv_caches, **extra)
            else:
                hidden = self.model(batch.input_ids, md, self.kv_caches, **extra)
            tap_values = torch.cat([taps[i] for i in tap_ids], dim=-1) if taps is not None else None
        if tap_values is not None:  # the drafter's tap ring stays fresh while speculation is off
            assert self.speculator is not None
            self.speculator.write_taps(tap_values, rows, computed, sched)
        rs.num_computed[rows] = computed + sched

        tokens = lps = None
        if len(sample_rows):
            # every token samples (a decode): logits_indices is arange(T), so no gather is needed
            sel = hidden[: batch.num_tokens] if len(sample_rows) == batch.num_tokens else hidden[batch.logits_indices]
            logits = self.model.compute_logits(sel)
            srows = rows[sample_rows]
            if self.grammars.constrains(srows):
                # the grammars must have taken the previous step's tokens (async scheduling: still on the device);
                # this step's forward is queued already, so the GPU runs it while the host waits and fills the mask
                for pending in list(self._unresolved):
                    pending.result()
                self.grammars.apply(logits, srows)
            # every row takes the argmax of its raw logits (masked by its grammar, if any): no SamplingTensors
            if rs.all_plain_greedy(srows):
                tokens, lps = greedy_sample(logits), None
            else:
                params = [rs.sampling_params[r] for r in srows]
                if self._unresolved and any(needs_output_values(p) for p in params):
                    for pending in list(self._unresolved):  # penalties read the output tokens, not just their count
                        pending.result()
                st = SamplingTensors.build(
                    params, [rs.prompt_ids[r] for r in srows], [rs.output_ids[r] for r in srows], self.vocab_size,
                    self.device, self.eos_token_ids,
                    num_output_tokens=(rs.num_tokens[srows] - rs.prompt_len[srows]).tolist())
                tokens, lps = self.sampler(logits, st)
            rs.append_sampled(srows, tokens, batch.append_index)
        pending = PendingOutput(self, req_ids, sample_rows, tokens, lps)
        if tokens is not None:
            self._unresolved.append(pending)
        return pending

    def _image_rows(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices in the batch, span embeddings) of the image-span positions this step computes."""
        idx, vals = [], []
        for b, req_id in enumerate(batch.req_ids):
            spans = self.image_spans.get(req_id)
            if not spans:
                continue
            p0 = int(batch.num_computed_np[b])
            p1, t0 = p0 + int(batch.num_scheduled_tokens[b]), int(batch.query_start_loc_np[b])
            for offset, span in spans:
                lo, hi = max(p0, offset), min(p1, offset + span.shape[0])
                if lo < hi:
                    idx.append(torch.arange(t0 + lo - p0, t0 + hi - p0))
                    vals.append(span[lo - offset: hi - offset])
        if not idx:
            return None
        return torch.cat(idx).to(self.device), torch.cat(vals)

    def _decode(self, batch: InputBatch) -> torch.Tensor:
        """A uniform-decode step: replay the graph of the smallest capture size that holds it, else run the same
        fixed-shape forward eagerly. Metadata and inputs go to the persistent buffers first (order: metadata,
        then model inputs)."""
        R = batch.num_reqs
        padded = self.graphs.padded_size(R)
        P = padded or R
        full = padded is not None and padded in self.graphs.graphs
        self.buffers.input_ids[R:P].zero_()
        t0 = time.perf_counter()
        dmd = self.model_state.prepare_decode_attn(batch, self.block_tables, P, full)
        self.last_decode_md_s = time.perf_counter() - t0
        extra = self.model_state.prepare_inputs(batch, self.req_state)
        if full:
            return self.graphs.replay(padded)[:R]
        return self._forward_decode_with_taps(self.model.forward_decode, P, dmd, extra)[:R]

    def _drafter_tap_ids(self) -> tuple[int, ...]:
        """The target layers whose taps a speculative engine's drafter reads (its tap ring's), else ()."""
        sp = self.speculator
        return sp.tap_layer_ids if sp is not None and sp.taps is not None else ()

    def _forward_decode_with_taps(self, forward: Callable[..., torch.Tensor], size: int, dmd: DecodeMetadata,
                                  extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The decode forward of `size` rows: hidden states [size, D], and with `plain_tap_ids` the drafter's taps
        after them in the same rows ([size, D + taps]: one output, what a graph keeps)."""
        ids = self.plain_tap_ids
        taps = dict.fromkeys(ids) if ids else None
        hidden = forward(self.buffers.input_ids[:size], dmd, self.kv_caches, **extra,
                         **({"taps": taps} if taps is not None else {}))
        if taps is None:
            return hidden
        return torch.cat([hidden] + [taps[i].to(hidden.dtype) for i in ids], dim=-1)

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Peak bytes allocated by a worst-case step: a prefill of max_num_batched_tokens tokens (split into as
        few requests as max_model_len allows) and a full decode batch. CUDA only."""
        sc = self.config.scheduler
        self.warm_up_kernels()  # compilation's allocations happen before the peak is measured
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # as many tokens as a step may carry, in requests no longer than max_model_len
        T = min(sc.max_num_batched_tokens, sc.max_num_seqs * (sc.max_model_len - 1))
        reqs = max(1, -(-T // (sc.max_model_len - 1)))
        self.dummy_run(reqs, max(T, reqs))
        P = sc.max_num_seqs
        extra = self.model_state.prepare_dummy_inputs(P, P)
        self.model.forward_decode(self.buffers.input_ids[:P], self.model_state.prepare_dummy_decode_attn(P),
                                  self.kv_caches, **extra)
        if self.speculator is not None:
            self.speculator.profile_forwards()  # verify rows (k + 1 a request) and the drafter's proposal
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    @torch.inference_mode()
    def dummy_run(self, num_reqs: int, num_tokens: int) -> torch.Tensor:
        """A forward over a dummy batch (warm-up, profiling); writes no KV a real request reads."""
        assert -(-num_tokens // num_reqs) < self.config.scheduler.max_model_len, "dummy requests past max_model_len"
        batch = InputBatch.make_dummy(self.buffers, num_reqs, num_tokens)
        md = self.model_state.prepare_attn(batch, self.block_tables, for_dummy=True)
        extra = self.model_state.prepare_dummy_inputs(num_reqs, num_tokens)
        hidden = self.model(batch.input_ids, md, self.kv_caches, **extra)
        return self.model.compute_logits(hidden[batch.logits_indices])
