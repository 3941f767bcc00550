"""OpenAI API shapes: request bodies (pydantic) and their SamplingParams; responses, whole and streamed.

Field names and defaults follow OpenAI's API; the non-standard extras clients send in `extra_body` (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens, min_tokens, include_stop_str_in_output,
chat_template_kwargs, include_reasoning) follow vLLM. Unknown fields are accepted and ignored, as OpenAI-compatible
servers do, except features a client would silently get wrong (JSON response formats, suffix, best_of > n), which
are refused with 400.

Responses are plain dicts (built per chunk, so no model validation on the hot path). A streamed choice sends its
text as it becomes final, holding back what could still turn into a stop string. With a reply parser
(dsv4.serve.parsers), a chat choice's text is split into reasoning (`reasoning_content`, and `reasoning` as vLLM
names it), content and tool calls, streamed as the parser releases them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from dsv4.engine.stop import stop_hold_back
from dsv4.outputs import CompletionOutput, Logprob, RequestOutput
from dsv4.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams, is_valid_unicode
from dsv4.serve.parsers import ChatDelta, ChatOutputStream, ParserOptions, parse_chat_output

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
# The reasoning of a reply goes out under both names clients read: DeepSeek's API and SGLang's, and vLLM's.
REASONING_KEY, VLLM_REASONING_KEY = "reasoning_content", "reasoning"


class APIError(Exception):
    """An error returned to the client as OpenAI's `{"error": {message, type, param, code}}` body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers  # extra response headers (Retry-After of a 503)

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse into their exceptions."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param, code)


def _unencodable(value: Any, path: str) -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode (a lone surrogate, which JSON's \\u
    escapes can carry but UTF-8 cannot encode: tokenizing or echoing it would fail), or None."""
    if isinstance(value, str):
        return None if is_valid_unicode(value) else path
    if isinstance(value, dict):
        items = [(k, path) for k in value] + [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(v, f"{path}[{i}]") for i, v in enumerate(value)]
    else:
        return None
    # (a bad top-level key has the empty path: compare with None, not by truth)
    return next((found for v, p in items if (found := _unencodable(v, p)) is not None), None)


class _Body(BaseModel):
    """Any request body: unknown fields allowed, every string valid Unicode."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Refuse a body carrying a lone surrogate anywhere, naming where and not echoing it."""
        found = _unencodable(data, "")
        if found is not None:
            raise ValueError(f"`{found or 'body'}` is not valid Unicode text (a lone surrogate)")
        return data

    model: str | None = None


class _Request(_Body):
    """Fields shared by chat and completions requests."""

    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar; and disable_any_whitespace
    structured_outputs: dict[str, Any] | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint (dsv4.structured), or None. JSON is generated compact unless the request
        says otherwise (`disable_any_whitespace: false`): vLLM allows any whitespace by default, and a model can
        then fill the object with blank lines up to max_tokens; compact JSON is the same JSON."""
        spec = self.structured_outputs
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(spec) - set(_STRUCTURED_KEYS))
        if unknown:
            raise bad_request(f"structured_outputs: unknown key(s) {unknown}; known: {list(_STRUCTURED_KEYS)}",
                              "structured_outputs")
        return _structured_params(dict(spec), "structured_outputs")

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.get("include_usage"))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams, constrained by `structured` when given (the server's tool_choice grammar),
        else by `structured()`; 400 naming the field when a value is out of range. A sampling field the request
        leaves out (or sends as null) takes `defaults` (the model's generation_config.json values,
        dsv4.generation_config), else SamplingParams' own default, as vLLM does."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty}
        sampling = {**(defaults or {}), **{name: value for name, value in given.items() if value is not None}}
        try:
            return SamplingParams(
                n=self.n, **sampling, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                min_tokens=self.min_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=bias,
                structured_outputs=structured if structured is not None else self.structured(),
            )
        except SamplingParamsError as e:
            name = re.search(r"`(\w+)`", str(e))
            raise bad_request(str(e), name.group(1) if name else None) from None


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")


def _structured_params(spec: dict[str, Any], field: str) -> StructuredOutputsParams:
    """StructuredOutputsParams of a request's spec (compact JSON by default, see `_Request.structured`); 400 naming
    `field` when its shape is wrong (a bad schema, regex or grammar is refused when the engine compiles it)."""
    spec.setdefault("disable_any_whitespace", True)
    if not isinstance(spec["disable_any_whitespace"], bool):
        raise bad_request(f"{field}: disable_any_whitespace must be true or false", field)
    try:
        return StructuredOutputsParams(**spec)
    except SamplingParamsError as e:
        raise bad_request(f"{field}: {e}", field) from None


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's `tools` and `tool_choice` ask of the reply: whether it is parsed for tool calls, the
    names a call may have (the named tool of a named tool_choice, else every tool of the request), and whether the
    reply must call them ("required" or a named function: the server enforces it with a grammar)."""

    parse: bool
    names: frozenset[str]
    forced: bool = False


def _messages_checked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with a missing or null content as "", after the shape checks every renderer relies on; a 400
    naming the message otherwise. Image parts must be `image_url` ones (the server takes no `image` objects)."""
    out = [{**m, "content": m.get("content") if m.get("content") is not None else ""} for m in messages]
    for i, m in enumerate(out):
        if not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}]: `role` must be a string", "messages")
        if not isinstance(m["content"], (str, list)):
            raise bad_request(f"messages[{i}]: `content` must be a string or a list of content parts", "messages")
        if isinstance(m["content"], list) and not all(isinstance(p, dict) for p in m["content"]):
            raise bad_request(f"messages[{i}]: content parts must be objects", "messages")
        if isinstance(m["content"], list) and any(p.get("type") == "text" and not isinstance(p.get("text"), str)
                                                  for p in m["content"]):
            raise bad_request(f"messages[{i}]: a text part's `text` must be a string", "messages")
        if isinstance(m["content"], list) and any(p.get("type") == "image" for p in m["content"]):
            raise bad_request(f"messages[{i}]: use image_url content parts", "messages")
    return out


def check_image_sources(images: tuple[Any, ...]) -> None:
    """Remote image URLs are refused: the server does not fetch arbitrary addresses."""
    if not all(isinstance(url, str) and url.startswith("data:") for url in images):
        raise bad_request("only data: image URLs are accepted (the server does not fetch remote images)", "messages")


class ChatInput(_Body):
    """What becomes a chat prompt: the conversation and the options of its rendering (dsv4.chat.prompt)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    # vLLM's: variables for the chat template, or thinking / enable_thinking / reasoning_effort / drop_thinking for
    # DeepSeek's encoder
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; V4.1 also takes 1-100 (strict: true or 2.0 is no effort level)
    reasoning_effort: StrictStr | StrictInt | None = None
    add_generation_prompt: bool = True

    def checked_messages(self) -> list[dict[str, Any]]:
        """The messages, shape-checked (400 naming the message)."""
        return _messages_checked(self.messages)


class ChatCompletionRequest(_Request, ChatInput):
    """POST /v1/chat/completions."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: str | dict[str, Any] | None = None
    # OpenAI's: false makes tool_choice "required" allow one call only (with "auto" the model decides, unchecked)
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the response
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Refuse what this server would otherwise silently ignore."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")

    def structured(self) -> StructuredOutputsParams | None:
        """OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}) or vLLM's `structured_outputs` (not both), as StructuredOutputsParams."""
        fmt = self.response_format
        if fmt is None or fmt.get("type", "text") == "text":
            return super().structured()
        if self.structured_outputs is not None:
            raise bad_request("give response_format or structured_outputs, not both", "response_format")
        kind = fmt.get("type")
        if kind == "json_object":
            return _structured_params({"json_object": True}, "response_format")
        if kind == "json_schema":
            schema = fmt.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema"), (dict, str)):
                raise bad_request("response_format json_schema needs {\"json_schema\": {\"schema\": {...}}}",
                                  "response_format")
            return _structured_params({"json": schema["schema"]}, "response_format")
        raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")

    def tool_use(self) -> ToolUse:
        """`tool_choice` checked against `tools`: "auto" (the default with tools), "none" (tools stay in the prompt,
        as vLLM renders them, but the reply is not parsed), "required" (at least one call), or {"type": "function",
        "function": {"name": ...}} (a call to that tool, which must be one of them)."""
        names = frozenset(t["function"]["name"] for t in self.tools or ()
                          if isinstance(t, dict) and isinstance(t.get("function"), dict)
                          and isinstance(t["function"].get("name"), str))
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return ToolUse(False, names)
        if not self.tools:
            raise bad_request(f"tool_choice {choice!r} needs `tools`", "tool_choice")
        if choice in ("auto", "required"):
            return ToolUse(True, names, forced=choice == "required")
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the tool {name!r}, which is not in `tools`", "tool_choice")
        return ToolUse(True, frozenset([name]), forced=True)


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered as /v1/chat/completions renders them."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: StrictStr | StrictInt | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self

    def chat_input(self) -> ChatInput:
        """The messages and their rendering options, as a chat request carries them."""
        return ChatInput(messages=self.messages or [], tools=self.tools,
                          chat_template_kwargs=self.chat_template_kwargs, reasoning_effort=self.reasoning_effort,
                          add_generation_prompt=self.add_generation_prompt)


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""

    tokens: list[StrictInt]  # (true is no token id)


class CompletionRequest(_Request):
    """POST /v1/completions. A prompt is a string, token ids, or a list of either (a batch)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's (and vLLM's) default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Refuse what this server would otherwise silently ignore."""
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        return list(p)  # type: ignore[arg-type]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, with prefix-cache hits in prompt_tokens_details.cached_tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One entry of GET /v1/models (max_model_len is vLLM's extra field)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "dsv4", "root": name, "parent": None,
            "max_model_len": max_model_len}


# ---- response shapes ---------------------------------------------------------------------------------------------

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass
class ChoiceProgress:
    """What one choice has streamed so far."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    started: bool = False
    done: bool = False


def next_delta(o: CompletionOutput, p: ChoiceProgress, params: SamplingParams) -> tuple[str, int, int]:
    """(new text, first new token, end token) for one choice, advancing `p`. Until a choice finishes, text that
    could be the start of a stop string is withheld, so everything streamed is a prefix of the final text."""
    p.done = o.finish_reason is not None
    visible = len(o.text)
    if not p.done:
        visible -= stop_hold_back(o.text, params.stop, params.include_stop_str_in_output)
    text = o.text[p.text_len:visible] if visible > p.text_len else ""
    start, end = p.num_tokens, len(o.token_ids)
    p.text_len, p.num_tokens = max(p.text_len, visible), end
    return text, start, end


def usage_of(finals: list[RequestOutput]) -> dict[str, Any]:
    """Usage of finished requests (one per prompt), all their samples counted; prompt tokens as the engine ran
    them (image placeholders expanded to their spans)."""
    return usage(sum(len(out.prompt_token_ids) for out in finals),
                 sum(len(o.token_ids) for out in finals for o in out.outputs),
                 sum(out.num_cached_tokens for out in finals))


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB) if not math.isnan(x) else _MIN_LOGPROB


def _ranked(d: dict[int, Logprob], k: int) -> list[Logprob]:
    """The top-k entries of one token's logprob dict, best first."""
    entries = [lp for lp in d.values() if lp.rank is not None and lp.rank <= k]
    return sorted(entries, key=lambda lp: (lp.rank, -lp.logprob))[:k]


class ResponseFormat:
    """How one endpoint shapes stream chunks and whole responses; choice index = prompt index * n + sample."""

    object = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, include_usage: bool, echo: bool = False) -> None:
        self.id, self.model, self.include_usage, self.echo = request_id, model, include_usage, echo
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """One streamed chunk object."""
        body = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk has the field; only the last one fills it
        body.update(extra)
        return body

    def stream_choice(self, index: int, o: CompletionOutput, p: ChoiceProgress, params: SamplingParams,
                      prompt_text: str) -> list[dict[str, Any]]:
        """The chunks that bring choice `index` from `p` up to `o` (possibly none)."""
        raise NotImplementedError

    def response(self, prompt_texts: list[str], finals: list[RequestOutput], n: int,
                 usage_: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed response for finished requests (one per prompt)."""
        choices = [self.choice(i * n + o.index, o, text) for i, (text, out) in enumerate(zip(prompt_texts, finals))
                   for o in out.outputs]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}

    def choice(self, index: int, o: CompletionOutput, prompt_text: str) -> dict[str, Any]:
        """One choice of a non-streamed response."""
        raise NotImplementedError


def _token_entry(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": _lp(lp.logprob), "bytes": list(token.encode("utf-8"))}


class ChatFormat(ResponseFormat):
    """chat.completion / chat.completion.chunk; logprobs as `content[] = {token, logprob, bytes, top_logprobs}`.

    With `parser` options, each choice's text goes through its own reply parser (one per choice, so n > 1 works):
    the message gets `content`, `reasoning_content` and `reasoning` (the same text under DeepSeek's / SGLang's and
    vLLM's names; left out with include_reasoning=false) and `tool_calls`; a choice that ended by itself after
    calling tools finishes with "tool_calls". Without, the text is the content as the model wrote it.
    """

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, req: ChatCompletionRequest,
                 parser: ParserOptions | None = None) -> None:
        super().__init__(request_id, model, req.include_usage)
        self.top = (req.top_logprobs or 0) if req.logprobs else None
        self.parser = parser
        self.include_reasoning = req.include_reasoning
        self._streams: dict[int, ChatOutputStream] = {}  # per choice index

    def _logprobs(self, o: CompletionOutput, start: int, end: int) -> dict[str, Any] | None:
        if self.top is None or o.logprobs is None:
            return None
        return {"content": [{**_token_entry(d[tid]), "top_logprobs": [_token_entry(lp) for lp in _ranked(d, self.top)]}
                            for tid, d in zip(o.token_ids[start:end], o.logprobs[start:end])]}

    def _delta(self, d: ChatDelta) -> dict[str, Any] | None:
        """A parsed delta as the chunk's `delta`; None for reasoning the request asked to leave out."""
        delta = d.to_openai(REASONING_KEY)
        if REASONING_KEY in delta:
            if not self.include_reasoning:
                return None
            delta[VLLM_REASONING_KEY] = delta[REASONING_KEY]
        return delta

    def _deltas(self, index: int, text: str, done: bool) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        stream = self._streams.setdefault(index, ChatOutputStream(self.parser))
        parsed = (stream.feed(text) if text else []) + (stream.finish() if done else [])
        return [delta for d in parsed if (delta := self._delta(d)) is not None]

    def _finish_reason(self, index: int, engine_reason: str | None) -> str | None:
        if engine_reason is None or self.parser is None:
            return engine_reason
        return self._streams.setdefault(index, ChatOutputStream(self.parser)).finish_reason(engine_reason)

    def stream_choice(self, index: int, o: CompletionOutput, p: ChoiceProgress, params: SamplingParams,
                      prompt_text: str) -> list[dict[str, Any]]:
        chunks = []
        if not p.started:  # the first delta of a choice carries the role
            p.started = True
            chunks.append(self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
        text, start, end = next_delta(o, p, params)
        deltas = self._deltas(index, text, p.done)
        logprobs = self._logprobs(o, start, end)
        if not deltas and (p.done or (self.top is not None and end > start)):
            deltas = [{}]  # the finish_reason, or logprobs of tokens whose text is held back
        for k, delta in enumerate(deltas):
            last = k + 1 == len(deltas)
            chunks.append(self.chunk([{"index": index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                       "finish_reason": self._finish_reason(index, o.finish_reason) if last else None,
                                       "stop_reason": o.stop_reason if last else None}]))
        return chunks

    def choice(self, index: int, o: CompletionOutput, prompt_text: str) -> dict[str, Any]:
        if self.parser is None:
            message, finish_reason = {"role": "assistant", "content": o.text}, o.finish_reason
        else:
            parsed = parse_chat_output(o.text, self.parser)
            message = parsed.to_openai_message(REASONING_KEY)
            if REASONING_KEY in message:
                if self.include_reasoning:
                    message[VLLM_REASONING_KEY] = message[REASONING_KEY]
                else:
                    del message[REASONING_KEY]
            finish_reason = parsed.finish_reason(o.finish_reason) if o.finish_reason is not None else None
        return {"index": index, "message": message, "logprobs": self._logprobs(o, 0, len(o.token_ids)),
                "finish_reason": finish_reason, "stop_reason": o.stop_reason}


class CompletionFormat(ResponseFormat):
    """text_completion; logprobs as `{tokens, token_logprobs, top_logprobs, text_offset}`."""

    object = chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, req: CompletionRequest) -> None:
        super().__init__(request_id, model, req.include_usage, req.echo)
        self.top = req.logprobs

    def _logprobs(self, o: CompletionOutput, start: int, end: int, p: ChoiceProgress) -> dict[str, Any] | None:
        if self.top is None or o.logprobs is None:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, d in zip(o.token_ids[start:end], o.logprobs[start:end]):
            chosen = d[tid]
            token = chosen.decoded_token or ""
            top = {lp.decoded_token or "": _lp(lp.logprob) for lp in _ranked(d, self.top)}
            top.setdefault(token, _lp(chosen.logprob))  # the sampled token is always listed, as vLLM does
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(chosen.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(p.text_offset)
            p.text_offset += len(token)
        return out

    def stream_choice(self, index: int, o: CompletionOutput, p: ChoiceProgress, params: SamplingParams,
                      prompt_text: str) -> list[dict[str, Any]]:
        text, start, end = next_delta(o, p, params)
        if self.echo and not p.started:
            text = prompt_text + text
        p.started = True
        if not (text or p.done or (self.top is not None and end > start)):
            return []
        return [self.chunk([{"index": index, "text": text, "logprobs": self._logprobs(o, start, end, p),
                             "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}])]

    def choice(self, index: int, o: CompletionOutput, prompt_text: str) -> dict[str, Any]:
        p = ChoiceProgress(text_offset=len(prompt_text) if self.echo else 0)
        return {"index": index, "text": (prompt_text if self.echo else "") + o.text,
                "logprobs": self._logprobs(o, 0, len(o.token_ids), p), "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason}
