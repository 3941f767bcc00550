"""One request's reply, parsed into OpenAI chat fields: reasoning, content and tool calls.

`ChatOutputStream` is what a streaming chat completion holds per choice: feed() each detokenized text delta, send
each returned `ChatDelta` as one chunk (`delta.to_openai()`), call finish() at the end and send what it returns,
then take the chunk's finish_reason from `finish_reason(engine_reason)`. `parse_chat_output` is the same for a
whole reply, for non-streaming responses; both give the same result however the reply is split into deltas.

The text must keep `<think>`, `</think>` and the DSML tags: they are ordinary (non-special) tokens in DeepSeek's
tokenizers, so the usual skip_special_tokens=True decoding keeps them.
"""
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dsv4.chat.tokens import Family
from dsv4.serve.parsers.reasoning import ReasoningStream
from dsv4.serve.parsers.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, new_call_id


@dataclass(frozen=True)
class ParserOptions:
    """How to read one request's reply.

    family: "v4" (DeepSeek-V4) or "v41" (DeepSeek-V4.1), whose DSML tags differ.
    thinking: the prompt ended with `<think>`, so the reply starts inside the reasoning.
    parse_tool_calls: look for DSML tool calls (a request with tools and tool_choice other than "none");
        otherwise the content is passed through as the model wrote it.
    tool_names: the request's tool names: calls to other names are dropped; None accepts any name.
    """

    family: Family
    thinking: bool
    parse_tool_calls: bool = True
    tool_names: frozenset[str] | None = None


@dataclass(frozen=True)
class ChatDelta:
    """One streamed chunk's delta: exactly one of reasoning text, content text or a tool-call piece."""

    reasoning: str = ""
    content: str = ""
    tool_call: ToolCallDelta | None = None

    def to_openai(self, reasoning_key: str = "reasoning_content") -> dict[str, Any]:
        """The chunk's `choices[i].delta` (without `role`); `reasoning_key` names the reasoning field
        (`reasoning_content` as DeepSeek's API and SGLang, `reasoning` as vLLM >= 0.28)."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.to_openai()]}
        if self.reasoning:
            return {reasoning_key: self.reasoning}
        return {"content": self.content}


def _finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    # As OpenAI: a reply that ended by itself after calling tools finished for "tool_calls"; "length" stays.
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


@dataclass(frozen=True)
class ChatOutput:
    """A whole parsed reply; reasoning and content are None when empty."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]

    def to_openai_message(self, reasoning_key: str = "reasoning_content") -> dict[str, Any]:
        """The response's `choices[i].message`."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message[reasoning_key] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message

    def finish_reason(self, engine_reason: str) -> str:
        """The choice's finish_reason given the engine's ("stop" or "length")."""
        return _finish_reason(engine_reason, bool(self.tool_calls))


class ChatOutputStream:
    """Per-request, per-choice parser of a streamed reply (module docstring: how to drive it)."""

    def __init__(self, options: ParserOptions, make_call_id: Callable[[], str] = new_call_id) -> None:
        self._reasoning = ReasoningStream(options.family, options.thinking)
        self._tools = (ToolCallStream(options.family, options.tool_names, make_call_id)
                       if options.parse_tool_calls else None)

    def feed(self, text: str) -> list[ChatDelta]:
        """The chunks a text delta of the reply makes, often none (text held back) or one."""
        split = self._reasoning.feed(text)
        return self._deltas(split.reasoning, self._content(split.content, last=False))

    def finish(self) -> list[ChatDelta]:
        """The chunks of what was held back, at the end of the reply."""
        split = self._reasoning.finish()
        return self._deltas(split.reasoning, self._content(split.content, last=True))

    def finish_reason(self, engine_reason: str) -> str:
        """The finish_reason of the last chunk given the engine's ("stop" or "length")."""
        return _finish_reason(engine_reason, self._tools is not None and self._tools.n_calls > 0)

    def _content(self, text: str, last: bool) -> list[str | ToolCallDelta]:
        if self._tools is None:
            return [text] if text else []
        return self._tools.feed(text) + self._tools.finish() if last else self._tools.feed(text)

    @staticmethod
    def _deltas(reasoning: str, content: list[str | ToolCallDelta]) -> list[ChatDelta]:
        deltas = [ChatDelta(reasoning=reasoning)] if reasoning else []
        for item in content:
            deltas.append(ChatDelta(content=item) if isinstance(item, str) else ChatDelta(tool_call=item))
        return deltas


def accumulate(deltas: Iterable[ChatDelta]) -> ChatOutput:
    """The reply the deltas of a stream add up to, as a client assembles it."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        piece = delta.tool_call
        if piece is None:
            continue
        if piece.id is not None:
            calls.append(ToolCall(piece.id, piece.name or "", piece.arguments))
        else:
            call = calls[piece.index]
            calls[piece.index] = ToolCall(call.id, call.name, call.arguments + piece.arguments)
    return ChatOutput("".join(reasoning) or None, "".join(content) or None, tuple(calls))


def parse_chat_output(text: str, options: ParserOptions,
                      make_call_id: Callable[[], str] = new_call_id) -> ChatOutput:
    """A whole reply parsed: what streaming it in any deltas would add up to."""
    stream = ChatOutputStream(options, make_call_id)
    return accumulate(stream.feed(text) + stream.finish())
