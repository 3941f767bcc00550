"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` (FastAPI) and `run_server(...)` (uvicorn).

Endpoints: GET /health, GET /metrics (Prometheus text), GET /v1/models, POST /v1/chat/completions and POST
/v1/completions, streaming (SSE) or not, and vLLM's POST /tokenize and POST /detokenize. A chat request becomes a
prompt through `dsv4.chat.prompt.ChatRenderer` (the checkpoint's template, or DeepSeek's encoder); its reply goes
through DeepSeek's reasoning and tool-call parsers (dsv4.serve.parsers) when they are on (`ReplyParsers`); a
tool_choice that forces calls ("required", a named function) is enforced with a grammar (dsv4.structured.tool_calls)
and, like response_format, renders the prompt with thinking off. Every request runs on the one AsyncLLMEngine, so
requests from all connections are batched together. Errors are OpenAI-shaped `{"error": {...}}` bodies with the
proper status and touch only their own request. A client that goes away (mid-stream, or while waiting for a
non-streamed answer) has its requests aborted, which frees their KV blocks.
A connection that does not deliver a whole request in time (nothing, part of the headers, part of the body) is
dropped: see `_read_deadline_protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from dsv4.chat.prompt import PARSER_CHOICES, ChatPrompt, ChatPromptError, ChatRenderer
from dsv4.chat.tokens import Family
from dsv4.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from dsv4.engine.engine import LLMEngine, RequestError
from dsv4.generation_config import load_sampling_defaults
from dsv4.models.config import hub_hint
from dsv4.outputs import RequestOutput
from dsv4.runtime.host_gc import freeze_startup_heap
from dsv4.sampling_params import SamplingParams, StructuredOutputsParams
from dsv4.serve.parsers import ParserOptions
from dsv4.serve.protocol import (APIError, ChatCompletionRequest, ChatFormat, ChatInput, ChoiceProgress,
                                 CompletionFormat, CompletionRequest, DetokenizeRequest, ResponseFormat,
                                 TokenizeRequest, bad_request, check_image_sources, model_card, usage_of)
from dsv4.structured.tool_calls import tool_call_constraint

logger = logging.getLogger(__name__)


# ---- the app ---------------------------------------------------------------------------------------------------

DEFAULT_MAX_BODY_BYTES = 64 << 20  # a few data-URL images; --max-request-body-mb raises it
MAX_SEQS_PER_REQUEST = 1024  # prompts x n of one request
MAX_WAITING = 4096  # sequences waiting for the engine before new requests get 503
DEFAULT_REQUEST_READ_TIMEOUT = 60.0  # seconds to deliver a whole request (--request-read-timeout)
_KEYED_PATHS = ("/tokenize", "/detokenize", "/metrics")  # besides /v1: what needs the API key


@dataclass(frozen=True)
class ReplyParsers:
    """Which DeepSeek family's parsers read chat replies: `reasoning` splits off the reasoning, `tools` the DSML
    tool calls (None: off). The tool-call parser reads the content the reasoning parser leaves, so it needs one of
    the same family."""

    reasoning: Family | None
    tools: Family | None

    @classmethod
    def create(cls, renderer_family: Family | None, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None) -> "ReplyParsers":
        """From --reasoning-parser / --tool-call-parser (PARSER_CHOICES); None (not given) is the family of
        DeepSeek's encoder when it renders the prompts, else off (a chat template's format is not known)."""
        def family(choice: str | None, flag: str) -> Family | None:
            if choice is None:
                return renderer_family
            if choice not in PARSER_CHOICES:
                raise ValueError(f"{flag} {choice!r} is not one of {', '.join(PARSER_CHOICES)}")
            return None if choice == "none" else choice.removeprefix("deepseek_")  # type: ignore[return-value]

        reasoning = family(reasoning_parser, "--reasoning-parser")
        tools = family(tool_call_parser, "--tool-call-parser")
        if tools is not None and tools != reasoning:
            raise ValueError(f"--tool-call-parser deepseek_{tools} needs --reasoning-parser deepseek_{tools}: the "
                             "tool calls are read from the content after the reasoning")
        return cls(reasoning, tools)


class _Guard:
    """ASGI middleware in front of the app: checks the API key of /v1 and /metrics from the headers, before a byte
    of the body is read (a client without the key cannot make the server read 200 MB), and refuses a body larger
    than `max_body` with 413, by its Content-Length or, for a chunked body, as soon as it grows past the limit."""

    def __init__(self, app: Any, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def _refuse(self, send: Send, e: APIError) -> None:
        body = json.dumps(e.body()).encode()
        await send({"type": "http.response.start", "status": e.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        path = scope["path"]
        if self.api_key is not None and (path.startswith("/v1") or path in _KEYED_PATHS):
            if not secrets.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.api_key}".encode()):
                return await self._refuse(send, APIError(
                    401, "Incorrect or missing API key: pass it as `Authorization: Bearer <key>`.",
                    code="invalid_api_key"))
        too_big = APIError(413, f"the request body exceeds {self.max_body} bytes (--max-request-body-mb)",
                           type_="invalid_request_error")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._refuse(send, too_big)
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:  # an HTTP error, which the app's handler answers with the OpenAI body
                raise StarletteHTTPException(413, too_big.message)
            return message

        await self.app(scope, counted, send)


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_body: int = DEFAULT_MAX_BODY_BYTES, tokenizer_mode: str = "auto",
              reasoning_parser: str | None = None, tool_call_parser: str | None = None,
              generation_defaults: Mapping[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `served_model_name`; /v1, /tokenize, /detokenize and /metrics need
    `api_key` when it is set (checked before the body is read); bodies above `max_body` bytes get 413. Chat prompts
    are rendered as `tokenizer_mode` says (dsv4.chat.prompt) and replies parsed as `ReplyParsers.create` says.
    `generation_defaults`: the sampling fields a request leaves out take these (the model's generation_config.json,
    `dsv4.generation_config.load_sampling_defaults`), else dsv4's defaults.
    A bad mode or parser is a ValueError, before anything is served."""
    renderer = (ChatRenderer.create(engine.tokenizer, engine.engine.config.model, tokenizer_mode)
                if engine.tokenizer is not None else None)
    parsers = ReplyParsers.create(renderer.family if renderer is not None else None, reasoning_parser,
                                  tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    # with a key, nothing but /health answers without it: the API docs are off, /metrics needs the key
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="dsv4", lifespan=lifespan, **docs)
    server = _Server(engine, served_model_name, renderer, parsers, generation_defaults)
    _install_error_handlers(app)

    app.add_middleware(_Guard, api_key=api_key, max_body=max_body)  # the key and the body size: see _Guard

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/chat/completions", server.chat, methods=["POST"])
    v1.add_api_route("/completions", server.completions, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body, whatever raised it."""

    def reply(e: APIError) -> JSONResponse:
        # a message that quotes unencodable input (a lone surrogate) must still leave as JSON, not as a 500
        e.message = e.message.encode("utf-8", "replace").decode("utf-8")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return reply(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        # a body that is not JSON names no field (its loc is a character offset)
        loc = [] if first.get("type") == "json_invalid" else [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body')}: {err.get('msg')}"
                            for err in errors) or "invalid request"
        return reply(bad_request(message, loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return reply(APIError(e.status_code, str(e.detail), type_=kind))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return reply(APIError(503, str(e), type_="server_error"))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:  # a bug: still the OpenAI shape, and logged
        logger.exception("unexpected error answering a request")
        return reply(APIError(500, f"internal error ({type(e).__name__})", type_="server_error"))


class _SSEResponse(StreamingResponse):
    """An SSE stream that aborts its requests however it ends (finished, client gone, server shutting down)."""

    def __init__(self, chunks: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


# ---- requests --------------------------------------------------------------------------------------------------

@dataclass
class _Job:
    """One engine request of an HTTP request (a chat, or one prompt of a completions batch)."""

    stream: RequestStream
    prompt_ids: list[int]
    prompt_text: str


class _Server:
    """The route handlers, sharing the engine and the served model name."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, renderer: ChatRenderer | None,
                 parsers: ReplyParsers, generation_defaults: Mapping[str, Any] | None = None) -> None:
        self.engine = engine
        self.name = served_model_name
        self.created = int(time.time())
        self.renderer = renderer
        self.parsers = parsers
        # the model's sampling defaults for fields a request leaves out (vLLM's --generation-config auto)
        self.generation_defaults = dict(generation_defaults or {})

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(self.name, self.created, self.engine.max_model_len)]}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def _tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer; send token ids to /v1/completions")
        return self.engine.tokenizer

    def _check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                              f"{num_prompt} tokens, which leaves no room for the completion.", param,
                              "context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                              f"completion). Please reduce the prompt or the completion length.", "max_tokens",
                              "context_length_exceeded")

    def _check_capacity(self, num_prompts: int, n: int) -> None:
        """Fan-out caps (as vLLM has): one request brings at most MAX_SEQS_PER_REQUEST sequences (prompts x n,
        400), and none is taken while MAX_WAITING sequences already wait for the engine (503 with Retry-After): a
        flood waits in the client, not as thousands of queued sequences the server must walk and abort."""
        if num_prompts * n > MAX_SEQS_PER_REQUEST:
            raise bad_request(f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); "
                              f"the limit is {MAX_SEQS_PER_REQUEST} per request", "n" if num_prompts == 1 else "prompt")
        if self.engine.metrics.waiting.value + num_prompts * n > MAX_WAITING:
            raise APIError(503, f"the server is busy ({int(self.engine.metrics.waiting.value)} sequences waiting); "
                                f"retry shortly", type_="server_error", headers={"Retry-After": "1"})

    async def _start(self, prompts: list[tuple[list[int], str]], params: SamplingParams,
                     request_id: str, images: list[str] | None = None) -> list[_Job]:
        """Add every prompt to the engine; if one is refused, abort the others and answer 400."""
        jobs: list[_Job] = []
        try:
            for i, (ids, text) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                # one group for all the prompts: the fair scheduler shares slots per HTTP request, not per prompt
                jobs.append(_Job(await self.engine.add_request(ids, params, rid, images=images, group_id=request_id),
                                 ids, text))
        except BaseException as e:
            for job in jobs:
                job.stream.abort()
            if isinstance(e, RequestError):
                raise bad_request(str(e)) from None
            raise
        return jobs

    async def _render(self, req: ChatInput) -> tuple[ChatPrompt, list[int]]:
        """The request's prompt and its token ids; 400 naming the field the renderer refused."""
        if self.renderer is None:
            raise bad_request("this checkpoint has no tokenizer; send token ids to /v1/completions")
        renderer, messages = self.renderer, req.checked_messages()

        def render() -> tuple[ChatPrompt, list[int]]:
            prompt = renderer.render(messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                                     reasoning_effort=req.reasoning_effort,
                                     add_generation_prompt=req.add_generation_prompt)
            return prompt, renderer.tokenizer.encode(prompt.text, add_special_tokens=False)  # BOS is in the text

        try:  # in a worker thread: a long body must not stall the event loop (and every other request) meanwhile
            return await asyncio.to_thread(render)
        except ChatPromptError as e:
            raise bad_request(str(e), e.param) from None

    def _parser_options(self, req: ChatCompletionRequest, prompt: ChatPrompt) -> ParserOptions | None:
        """How this request's replies are parsed, or None (the text is the content); 400 when the request wants
        tool calls read and no tool-call parser is on (vLLM answers "auto" without one the same way)."""
        tools = req.tool_use()
        if tools.parse and self.parsers.tools is None:
            raise bad_request(f"tool_choice {req.tool_choice or 'auto'!r} needs a tool-call parser: this server runs "
                              "without one (--tool-call-parser)", "tool_choice")
        if self.parsers.reasoning is None:
            return None
        return ParserOptions(self.parsers.reasoning, prompt.thinking, parse_tool_calls=tools.parse,
                             tool_names=tools.names)

    def _constraint(self, req: ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str]:
        """The reply's structured-output constraint and the request field it comes from: response_format /
        structured_outputs, or the grammar that enforces a tool_choice "required" or naming a function, in the DSML
        of the tool-call parser that reads the reply (dsv4.structured.tool_calls); 400 when both are asked for."""
        structured = req.structured()
        field = "response_format" if req.response_format else "structured_outputs"
        if not req.tool_use().forced:
            return structured, field
        if structured is not None:
            raise bad_request(f"tool_choice {_choice_text(req.tool_choice)} constrains the reply to tool calls; it "
                              f"cannot also follow {field}", "tool_choice")
        if self.parsers.tools is None:
            raise bad_request(f"tool_choice {_choice_text(req.tool_choice)} needs a tool-call parser: this server "
                              "runs without one (--tool-call-parser)", "tool_choice")
        try:
            return tool_call_constraint(req.tools, req.tool_choice, self.parsers.tools,
                                        parallel_tool_calls=req.parallel_tool_calls is not False), "tool_choice"
        except ValueError as e:
            raise bad_request(str(e), "tools") from None

    # ---- POST /v1/chat/completions ---------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        req.check_supported()
        self._check_capacity(1, req.n)
        constraint, field = self._constraint(req)
        prompt, ids = await self._render(req)
        if prompt.thinking and constraint is not None:
            prompt, ids = await self._render(_without_thinking(req, field))
        check_image_sources(prompt.images)
        parser = self._parser_options(req, prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, constraint,
                                     self.generation_defaults)
        self._check_length(len(ids), max_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        jobs = await self._start([(ids, prompt.text)], params, rid, list(prompt.images) or None)
        return await self._respond(raw, req, jobs, params, ChatFormat(rid, self.name, req, parser))

    # ---- POST /tokenize, /detokenize (vLLM's) ------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        tok = self._tokenizer()
        if req.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens is not False)
        else:
            prompt, ids = await self._render(req.chat_input())
            if req.add_special_tokens:  # as vLLM: the tokenizer's own (a second BOS) on top of the rendered text's
                ids = await asyncio.to_thread(tok.encode, prompt.text, True)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.id_to_token(i) for i in ids]
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(req.model)
        tok = self._tokenizer()
        bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}  # as vLLM: /tokenize's text back

    # ---- POST /v1/completions ----------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        req.check_supported()
        params = req.sampling_params(req.max_tokens, req.logprobs, defaults=self.generation_defaults)
        batch = req.prompts()
        self._check_capacity(len(batch), req.n)  # before tokenizing a batch that will not be taken
        prompts = []
        for p in batch:
            if isinstance(p, str):
                ids, text = await asyncio.to_thread(self._tokenizer().encode, p), p  # off the event loop
            else:
                ids = list(p)
                text = self.engine.tokenizer.decode(ids) if req.echo and self.engine.tokenizer else ""
            self._check_length(len(ids), req.max_tokens, "prompt")
            prompts.append((ids, text))
        rid = f"cmpl-{uuid.uuid4().hex}"
        jobs = await self._start(prompts, params, rid)
        return await self._respond(raw, req, jobs, params, CompletionFormat(rid, self.name, req))

    # ---- both ------------------------------------------------------------------------------------------------------
    async def _respond(self, raw: Request, req: ChatCompletionRequest | CompletionRequest, jobs: list[_Job],
                       params: SamplingParams, fmt: ResponseFormat) -> Response:
        def abort_all() -> None:
            for job in jobs:
                job.stream.abort()

        if req.stream:
            return _SSEResponse(_stream_chunks(jobs, params, fmt, req.include_usage), abort_all)
        try:
            finals = await _until_disconnected(raw, _collect(jobs))
        finally:
            abort_all()  # no-op for finished requests; frees the rest if the client left or we were cancelled
        if finals is None:
            return Response(status_code=499)  # nobody reads this: the client is gone
        return JSONResponse(fmt.response([job.prompt_text for job in jobs], finals, params.n,
                                         usage_of(finals)))


def _choice_text(tool_choice: Any) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "naming a function"


def _without_thinking(req: ChatCompletionRequest, field: str) -> ChatCompletionRequest:
    """The request rendered in chat mode, for a structured output (`field`: what constrains it, response_format,
    structured_outputs or a tool_choice that forces calls): its constraint applies from the first token, so with
    thinking on the structure would be the reasoning (the peers' "JSON lands in the reasoning field"). 400 when the
    request itself asked for thinking: a constraint that starts after the reasoning is not implemented."""
    kwargs = req.chat_template_kwargs or {}
    if (kwargs.get("thinking") is True or kwargs.get("enable_thinking") is True
            or req.reasoning_effort not in (None, "none")):
        what = ("structured outputs (response_format / structured_outputs) constrain the reply from its first "
                "token, so they need" if field != "tool_choice" else
                f"tool_choice {_choice_text(req.tool_choice)} constrains the reply from its first token, so it needs")
        raise bad_request(f"{what} thinking off; this request asks for thinking", field)
    return req.model_copy(update={"chat_template_kwargs": {**kwargs, "thinking": False}})


# ---- waiting and streaming -------------------------------------------------------------------------------------

async def _until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, or cancel it and return None if the client disconnects first."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def _collect(jobs: list[_Job]) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in _merged(jobs):
        finals[i] = out
    return [finals[i] for i in range(len(jobs))]


async def _merged(jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the job index."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, job.stream)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream_chunks(jobs: list[_Job], params: SamplingParams, fmt: ResponseFormat,
                         include_usage: bool) -> AsyncIterator[str]:
    """SSE lines: per-choice deltas, each choice's finish_reason, the usage chunk if asked for, then [DONE]."""
    n = params.n
    progress = [ChoiceProgress(text_offset=len(job.prompt_text) if fmt.echo else 0) for job in jobs
                for _ in range(n)]
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in _merged(jobs):
            finals[i] = out
            for o in out.outputs:
                index = i * n + o.index
                if not progress[index].done:
                    for chunk in fmt.stream_choice(index, o, progress[index], params, jobs[i].prompt_text):
                        yield _sse(chunk)
        if include_usage:
            yield _sse(fmt.chunk([], usage=usage_of(list(finals.values()))))
    except (EngineDeadError, RequestError) as e:  # the engine failed mid-stream: tell the client, then end
        yield _sse(APIError(500, str(e), type_="server_error").body())
    yield "data: [DONE]\n\n"


# ---- running it ------------------------------------------------------------------------------------------------

def _read_deadline_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks) with a read deadline: a connection has `timeout`
    seconds to deliver a whole request (headers and body) from when it opens, or from the first byte of each later
    request; past that it is closed, and a handler waiting for the body sees a disconnect. uvicorn itself closes only
    idle kept-alive connections (timeout_keep_alive): one that sends nothing, or headers and half a body, and then
    stops would hold its socket and its handler forever. The deadline is a total, not an idle gap between reads, so
    trickling a byte now and then does not keep a connection either."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class ReadDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._owes_request():
                self._arm()
            elif self._deadline is not None:  # the request is all in: its handling has no deadline
                self._deadline.cancel()
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.cycle.response_complete and self.cycle.more_body:  # a pipelined request, its body not all in
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _owes_request(self) -> bool:
            """No request yet, the last one answered (so what just arrived starts the next), or a body still due."""
            return self.cycle is None or self.cycle.response_complete or self.cycle.more_body

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(timeout, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self._owes_request() and not self.transport.is_closing():
                logger.info("closing the connection from %s: no whole request within %g s (--request-read-timeout)",
                            "%s:%d" % self.client if self.client else "?", timeout)
                self.transport.close()

    return ReadDeadlineProtocol


def run_server(model: str | None, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, log_level: str = "info",
               max_body: int = DEFAULT_MAX_BODY_BYTES, request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT,
               tokenizer_mode: str = "auto", reasoning_parser: str | None = None,
               tool_call_parser: str | None = None, generation_config: str = "auto", **engine_args: Any) -> None:
    """Build the engine (without `model`, the built-in default model), then serve until interrupted; requests that
    leave a sampling field out take the model's generation_config.json value unless `generation_config` is "none"
    (dsv4.generation_config)."""
    import torch
    import uvicorn

    if not request_read_timeout > 0:  # (not <= 0: NaN too) a deadline of 0 would close every connection at once
        raise ValueError(f"--request-read-timeout must be a positive number of seconds, got {request_read_timeout}")
    if model is None:
        from dsv4.make_model import DEFAULT_MODEL_NAME, default_model_dir

        model, name = default_model_dir(), served_model_name or DEFAULT_MODEL_NAME
    else:
        if not os.path.isdir(model):
            raise FileNotFoundError(f"--model {model!r} is not a directory{hub_hint(model)}")
        name = served_model_name or model
    # before any engine is built, on every rank alike: a bad value stops them all at once (none waits for a rank
    # that failed), and not at the first request
    generation_defaults = load_sampling_defaults(model, generation_config)
    device = engine_args.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = engine_args.pop("dtype", None) or ("bfloat16" if device.startswith("cuda") else "float32")
    from dsv4.serve.metrics import EngineMetrics

    if engine_args.get("tensor_parallel_size", 1) > 1:
        # under torchrun: rank 0 serves and schedules, the other ranks execute its steps (dsv4.distributed)
        engine_args["follow_rank0"] = True
        if os.environ.get("RANK", "0") != "0":
            follower = LLMEngine.from_args(model, dtype=dtype, device=device, **engine_args)
            freeze_startup_heap()  # one engine for the process's life: its start-up heap leaves the GC's walks
            follower.follow()
            return
    engine = AsyncLLMEngine.from_args(model, EngineMetrics(name), dtype=dtype, device=device, **engine_args)
    freeze_startup_heap()
    logger.info("serving %s as %r on http://%s:%d (max_model_len %d)", model, name, host, port,
                engine.max_model_len)
    try:
        app = build_app(engine, name, api_key, max_body, tokenizer_mode, reasoning_parser, tool_call_parser,
                        generation_defaults)
        uvicorn.run(app, host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5, http=_read_deadline_protocol(request_read_timeout))
    finally:  # (the app's lifespan stopped the engine thread already, unless the server never started)
        engine.shutdown()
        engine.engine.stop_followers()
