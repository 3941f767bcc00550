"""AsyncLLMEngine: many asyncio callers, one LLMEngine stepping in one background thread.

LLMEngine is not thread-safe, so only the engine thread touches it. Callers put commands (add, abort) on a queue;
the thread drains it between steps, steps while anything is unfinished, and sleeps on a condition when idle (no
busy spin). Each request has an asyncio queue on its caller's event loop, fed with `call_soon_threadsafe`.

    stream = await engine.add_request(prompt, params, request_id)   # RequestError here, before any output
    async for out in stream: ...                                     # cumulative RequestOutputs, last one finished

`generate()` does both. A request's images are decoded and preprocessed in a small pool of worker threads before
the request is queued (PIL and torch release the GIL while they work), so neither the event loop nor the engine
thread waits for pixels: the engine thread gets ready patches. Likewise a structured request's grammar is compiled
in its own small pool (xgrammar releases the GIL) and the engine thread gets it compiled: a schema that takes
seconds to compile delays only its own request, not the decode steps of every running one. A stream left before
its final output (client disconnect, cancellation, an exception in the consumer) aborts its request, so its KV
blocks are freed at the next step boundary. Errors from add_request reach only that request's caller; an exception
inside `step()` fails every request and marks the engine dead (`/health` then reports it), since the engine's state
can no longer be trusted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from dsv4.engine.engine import LLMEngine, RequestError
from dsv4.engine.multimodal import PreparedImage, prepare_image
from dsv4.outputs import RequestOutput
from dsv4.sampling_params import SamplingParams
from dsv4.serve.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can run any more."""


_ACCEPTED = object()  # the engine thread's acknowledgement that add_request succeeded

# Threads decoding images: apart from asyncio's default pool (which tokenizes), so that image-heavy requests cannot
# starve tokenization; at most half the cores, so that the engine thread and the event loop keep theirs; at most 4,
# so that few decoded images (up to MAX_PIXELS RGB pixels, 192 MB, each) are in memory at once. The rest wait.
IMAGE_WORKERS = min(4, max(1, (os.cpu_count() or 2) // 2))
# Threads compiling grammars (dsv4.structured): two, so that one slow schema does not queue every other structured
# request behind it; xgrammar parallelizes each compile itself, so more would only compete for the same cores.
GRAMMAR_WORKERS = 2


class RequestStream:
    """The outputs of one request, as an async iterator. Leaving it before the end aborts the request."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Called from the engine thread: hand an output (or an exception) to the consumer's loop."""
        _hand_over(self._loop, [(self, item)])

    async def _get(self) -> Any:
        item = await self._queue.get()
        # Outputs are cumulative, so a consumer that fell behind only needs the latest one; an exception or the
        # final output ends the stream and is never skipped.
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                out = await self._get()
                self.finished = out.finished
                yield out
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        """Abort the request (no-op once it finished)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, Any]]) -> None:
    """Called from the engine thread: queue each (stream, item) on `loop`, all in one wake-up of that loop. Each
    call_soon_threadsafe writes to the loop's self-pipe, a system call that contends for the GIL with the loop
    it wakes; one per request per step was 45 of the engine thread's 555 samples in a profile of a stubbed server
    at 64 streams (benchmarks/results/2026-12-06-cpu-served-host-overhead)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the consumers' loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._queue.put_nowait(item)


def _hand_over_all(items: list[tuple[RequestStream, Any]]) -> None:
    """`_hand_over` for items whose streams may live on different loops: one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, its in by_loop.items():
        _hand_over(loop, its)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    arrival_time: float
    images: list[Any] | None = None
    group_id: str | None = None
    grammar: Any = None  # the xgrammar CompiledGrammar of params.structured_outputs, compiled off the engine thread


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Live:
    """The engine thread's bookkeeping of one running request (for its stream and the latency metrics)."""

    stream: RequestStream
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_tokens: int = 0


@dataclass
class _Commands:
    items: deque[_Add | _Abort] = field(default_factory=deque)
    stop: bool = False


class AsyncLLMEngine:
    """An asyncio front over LLMEngine; call `start()` once, then `add_request`/`generate`/`abort` from any loop."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics()
        if engine.spec_decode_stats is not None:  # speculative decoding: vLLM's acceptance counters on /metrics
            self.metrics.enable_spec_decode(len(engine.spec_decode_stats.num_accepted_tokens_per_pos))
        self._cond = threading.Condition()
        self._commands = _Commands()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._image_pool = ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="dsv4-images")
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="dsv4-grammars")
        self.dead_error: BaseException | None = None

    @classmethod
    def from_args(cls, model: str, metrics: EngineMetrics | None = None, **engine_args: Any) -> "AsyncLLMEngine":
        """Build the LLMEngine (`LLMEngine.from_args` arguments) and wrap it; the thread is not started yet."""
        return cls(LLMEngine.from_args(model, **engine_args), metrics)

    # ---- facts callers need (constant after construction, so safe to read from any thread) ----------------------
    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Tokenizer (encode/decode/chat template are safe to call concurrently)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one request may hold: max_model_len, or less if the KV cache is smaller."""
        return min(self.engine.config.scheduler.max_model_len, self.engine.scheduler.max_len)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and accepting requests."""
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._commands.stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._image_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests -----------------------------------------------------------------------------------------------
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                          images: list[Any] | None = None, group_id: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it; RequestError (a ValueError) if it, one of its
        images or its grammar is refused. `group_id`: as LLMEngine.add_request."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_error
        # before the grammar is compiled and the images decoded: their time is part of the time to first token
        arrival = time.monotonic()
        grammar = await self._compile_grammar(params)
        if images and self.engine.config.model.vision is not None:  # (without a tower the engine refuses them)
            images = await self._prepare_images(list(images))
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._submit(_Add(request_id, prompt, params, stream, arrival, images, group_id, grammar))
        try:
            first = await stream._queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it takes effect whatever the engine does first
            raise
        if first is not _ACCEPTED:
            stream.finished = True  # never added: nothing to abort (and the id may belong to someone else)
            raise first
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of a structured request (None for a free one, or when the engine has no compiler:
        it refuses the request itself), compiled in the grammar pool; RequestError naming a bad spec. A caller
        cancelled meanwhile leaves the compile running: its grammar lands in the cache for the next request."""
        compiler = self.engine.grammar_compiler
        if params.structured_outputs is None or compiler is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._grammar_pool, compiler.compile, params.structured_outputs)
        except ValueError as e:
            raise RequestError(str(e)) from None

    async def _prepare_images(self, sources: list[Any]) -> list[PreparedImage]:
        """Decode and preprocess a request's images in the image pool, one task per image; RequestError naming the
        first unusable one. A cancelled caller (its client left) cancels the images not yet started."""
        loop = asyncio.get_running_loop()
        vision = self.engine.config.model.vision
        results = await asyncio.gather(*(loop.run_in_executor(self._image_pool, prepare_image, i, src, vision)
                                         for i, src in enumerate(sources)), return_exceptions=True)
        for r in results:
            if isinstance(r, ValueError):  # ImageError, or a plan the vision config cannot satisfy
                raise RequestError(str(r)) from None
            if isinstance(r, BaseException):
                raise r
        return cast(list[PreparedImage], results)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until the finished one; leaving early aborts the request."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:  # runs on aclose()/cancellation, without waiting for the inner iterator to be collected
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); takes effect before the next step."""
        self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.items.append(command)
            self._cond.notify()

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while (not self._commands.items and not self._commands.stop
                           and not self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._commands.stop:
                        break
                    commands, self._commands.items = self._commands.items, deque()
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                self._record_state()
            error: BaseException = EngineDeadError("the engine was shut down")
        except Exception as e:  # a bug in a step: the engine state is suspect, so fail everyone and stop
            logger.exception("engine step failed; the engine is stopping")
            error = EngineDeadError(f"engine step failed: {e!r}")
            error.__cause__ = e
        self.dead_error = error
        with self._cond:  # requests that arrived meanwhile must not wait forever
            pending = [c for c in self._commands.items if isinstance(c, _Add)]
            self._commands.items.clear()
        _hand_over_all([(live.stream, error) for live in self._live.values()]
                       + [(command.stream, error) for command in pending])
        self._live.clear()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._live.pop(command.request_id, None) is not None:
                self.engine.abort_request([command.request_id])
                self.metrics.on_finished("abort", None)
            return
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id, images=command.images,
                                    group_id=command.group_id, grammar=command.grammar)
        except Exception as e:  # RequestError and anything unexpected: that caller's problem only
            if not isinstance(e, RequestError):
                logger.exception("add_request failed for %s", command.request_id)
            command.stream.put(e)
            return
        self._live[command.request_id] = _Live(command.stream, command.arrival_time)
        command.stream.put(_ACCEPTED)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        ready: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            num_tokens = sum(len(o.token_ids) for o in out.outputs)
            new = num_tokens - live.num_tokens
            if new > 0:
                if live.first_token_time is None:
                    live.first_token_time = now
                    self.metrics.on_first_output(now - live.arrival_time, len(out.prompt_token_ids),
                                                 out.num_cached_tokens)
                    self.metrics.on_new_tokens(new, None)
                else:
                    self.metrics.on_new_tokens(new, now - live.last_token_time)
                live.last_token_time, live.num_tokens = now, num_tokens
            if out.finished:
                del self._live[out.request_id]
                # A request finishes with one reason per sample; report the first sample's, as vLLM reports one.
                self.metrics.on_finished(out.outputs[0].finish_reason or "stop", now - live.arrival_time)
            ready.append((live.stream, out))
        _hand_over_all(ready)

    def _record_state(self) -> None:
        sched = self.engine.scheduler
        self.metrics.on_scheduler_state(sched.num_running, sched.num_waiting, self.engine.kv_manager.usage(),
                                        sched.num_preemptions)
        encoder_graphs = getattr(self.engine.runner.model, "encoder_graphs", None)  # V4.1 vision with graphs only
        if encoder_graphs is not None:
            self.metrics.on_encoder_graphs(encoder_graphs.hits, encoder_graphs.misses)
        spec = self.engine.spec_decode_stats
        if spec is not None:
            self.metrics.on_spec_decode(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                                        spec.num_accepted_tokens_per_pos)
