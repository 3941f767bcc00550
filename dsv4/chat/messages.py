"""Checking OpenAI-style chat messages and turning them into the few shapes the DeepSeek encoders render.

Every problem is a ValueError that names the message and the field (`messages[2].tool_calls[0].function.name:
...`); nothing here raises KeyError or TypeError on a bad message. The rules follow what DeepSeek's reference
encoders render; where a reference encoder would crash or print a Python repr into the prompt, the input is rejected
instead:

- roles: system, developer, user, assistant, tool. (The reference also knows `latest_reminder` and internal task
  roles; the OpenAI API has no way to send them.)
- content is a string. V4.1 also takes a list of text and image parts in any role (joined with a blank line, each
  image becoming one image placeholder, as its reference does); V4 takes a list of text parts only in a tool message
  (the one place its reference reads lists). A system or assistant message may leave content out or null.
- the image placeholder written as text inside a V4.1 message is rejected, not escaped: the tokenizer would read it
  as the special image token, so the prompt would hold more image slots than images sent (a mismatch the engine
  cannot resolve, and a way for text to forge an image position). The reference rejects it too.
- an assistant's `reasoning_content` (or `reasoning`, the name vLLM's responses use) is a string or null.
- tool-call arguments are a JSON object in a string, as OpenAI sends them (V4.1 also takes the object itself). V4's
  reference passes a string that is not JSON through as one string parameter named "arguments"; that is kept.
- a tool message needs no matching tool call: neither reference checks, and both render it the same way.
- message-level `tools`, `response_format`, `task`, `wo_eos` and `content_blocks` (reference-internal fields) are
  rejected rather than silently ignored; tools come in through the request's `tools` list.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsv4.chat.tokens import SpecialTokens

ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED_FIELDS = ("tools", "response_format", "task", "wo_eos", "content_blocks")
_IMAGE_PART_TYPES = ("image_url", "image")
# How the references join a list of content parts: one blank line between parts.
PART_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Part:
    """One piece of a user turn: text the user wrote, or one tool's output (which is where tool messages go)."""

    text: str
    is_tool_result: bool = False
    tool_call_id: str = ""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    # (parameter name, value) in the order given; a str value is written raw, anything else as JSON.
    arguments: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Message:
    """A checked message. Tool messages become user messages holding one tool-result part."""

    role: str  # system, developer, user or assistant
    content: str = ""  # every role but user
    parts: tuple[Part, ...] = ()  # user only
    reasoning: str | None = None  # assistant only
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    # The request's tool schemas (the `function` objects), on the one message that renders them.
    tools: tuple[Mapping[str, Any], ...] = ()


def to_json(value: Any, where: str) -> str:
    """JSON the way the references write it: non-ASCII kept as is, default separators."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON-serializable ({e})") from None


def check_tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    """The `function` objects of an OpenAI `tools` list, checked."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ValueError(f"tools: expected a list of tool objects, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type: only 'function' tools exist for this model, got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{where}.function: expected an object with the tool's name and parameters")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}.function.name: expected a non-empty string")
        to_json(function, f"{where}.function")
        functions.append(function)
    return tuple(functions)


def check_messages(messages: Any, tokens: SpecialTokens) -> list[Message]:
    """Check `messages` for `tokens.family` and return them as `Message`s, in order."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: the conversation is empty")
    return [_check_message(i, m, tokens) for i, m in enumerate(messages)]


def _check_message(i: int, msg: Any, tokens: SpecialTokens) -> Message:
    where = f"messages[{i}]"
    if not isinstance(msg, Mapping):
        raise ValueError(f"{where}: expected an object with a role, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: unknown role {role!r} (known: {', '.join(ROLES)})")
    for field in _UNSUPPORTED_FIELDS:
        if field in msg:
            raise ValueError(f"{where}.{field}: not supported in a message; pass tools with the request")

    if role == "user":
        return Message("user", parts=_content_parts(msg, where, tokens))
    if role == "tool":
        tool_call_id = msg.get("tool_call_id", "")
        if not isinstance(tool_call_id, str):
            raise ValueError(f"{where}.tool_call_id: expected a string, got {type(tool_call_id).__name__}")
        text = _content_text(msg, where, tokens, required=True, lists_allowed=True)
        return Message("user", parts=(Part(text, is_tool_result=True, tool_call_id=tool_call_id),))
    if role == "developer":
        text = _content_text(msg, where, tokens, required=True, lists_allowed=tokens.image is not None)
        if not text:
            raise ValueError(f"{where}.content: a developer message needs non-empty content")
        return Message("developer", content=text)
    content = _content_text(msg, where, tokens, required=False, lists_allowed=tokens.image is not None)
    if role == "system":
        return Message("system", content=content)
    return Message(
        "assistant",
        content=content,
        reasoning=_reasoning(msg, where, tokens),
        tool_calls=_tool_calls(msg.get("tool_calls"), where, tokens),
    )


def _content_parts(msg: Mapping[str, Any], where: str, tokens: SpecialTokens) -> tuple[Part, ...]:
    """A user message's content as parts: one for a string, one per item for a V4.1 list."""
    content = msg.get("content")
    if isinstance(content, str):
        _check_text(content, f"{where}.content", tokens)
        return (Part(content),)
    if isinstance(content, list) and tokens.image is not None:
        return tuple(Part(t) for t in _list_texts(content, f"{where}.content", tokens))
    kinds = _content_kinds(tokens, lists=tokens.image is not None)
    raise ValueError(f"{where}.content: expected {kinds}, got {_kind(content)}")


def _content_text(
    msg: Mapping[str, Any], where: str, tokens: SpecialTokens, *, required: bool, lists_allowed: bool
) -> str:
    content = msg.get("content")
    if content is None and not required:
        return ""
    if isinstance(content, str):
        _check_text(content, f"{where}.content", tokens)
        return content
    if isinstance(content, list) and lists_allowed:
        return PART_SEPARATOR.join(_list_texts(content, f"{where}.content", tokens))
    raise ValueError(f"{where}.content: expected {_content_kinds(tokens, lists=lists_allowed)}, got {_kind(content)}")


def _list_texts(parts: list[Any], where: str, tokens: SpecialTokens) -> list[str]:
    """The text of each content part, an image part becoming the image placeholder."""
    texts = []
    for j, part in enumerate(parts):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{here}.text: expected a string, got {_kind(text)}")
            _check_text(text, f"{here}.text", tokens)
            texts.append(text)
        elif kind in _IMAGE_PART_TYPES and tokens.image is not None:
            _check_image(part, here)
            texts.append(tokens.image)
        else:
            allowed = "text or image" if tokens.image is not None else "text"
            raise ValueError(f"{here}: expected a {allowed} part, got {kind if kind else _kind(part)!r}")
    return texts


def _check_image(part: Mapping[str, Any], where: str) -> None:
    """An image part must say where its image is; the engine loads it from there."""
    if part["type"] == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, Mapping) else ref
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.image_url: expected {{'url': ...}} with a non-empty URL")
    elif not any(part.get(key) for key in ("source", "url", "data")):
        raise ValueError(f"{where}: an image part needs a 'source', 'url' or 'data' field")


def _check_text(text: str, where: str, tokens: SpecialTokens) -> None:
    if tokens.image is not None and tokens.image in text:
        raise ValueError(
            f"{where}: contains the image placeholder {tokens.image!r} as text; send images as image parts "
            "(the placeholder is a special token, so text holding it would claim an image that was never sent)"
        )


def _reasoning(msg: Mapping[str, Any], where: str, tokens: SpecialTokens) -> str | None:
    if "reasoning_content" in msg and "reasoning" in msg and msg["reasoning_content"] != msg["reasoning"]:
        raise ValueError(f"{where}: 'reasoning_content' and 'reasoning' differ; send one of them")
    field = "reasoning_content" if "reasoning_content" in msg else "reasoning"
    reasoning = msg.get(field)
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.{field}: expected a string or null, got {_kind(reasoning)}")
    if reasoning is not None:
        _check_text(reasoning, f"{where}.{field}", tokens)
    return reasoning


def _tool_calls(calls: Any, where: str, tokens: SpecialTokens) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls: expected a list, got {_kind(calls)}")
    checked = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{here}: expected an object, got {_kind(call)}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{here}.type: expected 'function', got {call.get('type')!r}")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise ValueError(f"{here}.id: expected a string, got {_kind(call_id)}")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{here}.function: expected an object with 'name' and 'arguments'")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{here}.function.name: expected a non-empty string")
        arguments = _arguments(function.get("arguments"), f"{here}.function.arguments", tokens)
        checked.append(ToolCall(call_id, name, arguments))
    return tuple(checked)


def _arguments(raw: Any, where: str, tokens: SpecialTokens) -> tuple[tuple[str, Any], ...]:
    if isinstance(raw, str):
        _check_text(raw, where, tokens)
        try:
            value = json.loads(raw)
        except ValueError:
            if tokens.family == "v4":  # V4's reference keeps unparseable arguments as one string parameter
                return (("arguments", raw),)
            raise ValueError(f"{where}: not valid JSON: {raw[:80]!r}") from None
    elif isinstance(raw, Mapping) and tokens.family == "v41":
        value = raw
    else:
        accepted = "a JSON object in a string" + (" or an object" if tokens.family == "v41" else "")
        raise ValueError(f"{where}: expected {accepted}, got {_kind(raw)}")
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got JSON {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            to_json(item, f"{where}.{key}")
    return tuple(value.items())


def _content_kinds(tokens: SpecialTokens, *, lists: bool) -> str:
    if not lists:
        return "a string"
    return "a string or a list of text and image parts" if tokens.image is not None else "a string or text parts"


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
