"""DeepSeek-V4 / V4.1 prompt encoding: OpenAI-style chat messages to the prompt string the models were trained on.

The released checkpoints ship no chat template; DeepSeek publishes a Python encoder per family instead
(`encoding/encoding_dsv4.py`, `encoding/encoding_dsv41.py`). This module is our own implementation of that format,
checked string-for-string against the reference encoders on the conversations in `tests/data/chat_encoding/`.

The format, V4 (V4.1 differences after it):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜><think>{reasoning}</think>{reply}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>

- The system prompt is bare text after BOS; request tools are appended to it as a "## Tools" section that lists each
  tool's `function` object as one JSON line. A developer message renders like a user message.
- Each user turn ends with `<｜Assistant｜>` and a think marker: `<think>` when the model is to reason (thinking
  mode) or `</think>` when it is to answer at once (chat mode). The marker after an earlier turn follows the same
  rule, except that turns before the last user message get `</think>` when earlier reasoning is dropped.
- An assistant turn is `{reasoning}</think>{content}` then, if it called tools, a blank line and a DSML block
  (`<｜DSML｜tool_calls>`, `<｜DSML｜invoke name=...>`, `<｜DSML｜parameter name=... string="true|false">`), then
  EOS. In chat mode the reasoning and its `</think>` are left out.
- Tool messages have no role of their own: each tool output becomes `<tool_result>...</tool_result>` in a user turn,
  and a run of consecutive tool and user messages is one user turn whose pieces are joined by a blank line. Tool
  results are put in the order of the calls (matched by `tool_call_id`) of the latest assistant turn that made
  calls.
- Earlier reasoning: with `drop_thinking` (the default) in thinking mode, assistant turns before the last user
  message lose their reasoning and developer messages before it are left out. The reference keeps everything when
  the request has tools (DeepSeek's API likewise wants reasoning passed back in tool loops), so `drop_thinking`
  then has no effect.
- Reasoning effort (thinking mode only) goes before the first message: V4 writes a fixed paragraph for "max" and
  nothing for "high".

V4.1: a system message starts with `<｜System｜>`, and a system message after the first counts as a user turn (it
gets the `<｜Assistant｜>` header); the effort is always written in thinking mode, as a `<｜System｜>` line
`Reasoning Effort: N (range 1-100, ...)` in front of the first message; DSML tag names start with a space
(`<｜DSML｜ calls>`, `<｜DSML｜ invoke`, `<｜DSML｜ parameter`); an image part becomes `<｜deepseek_image｜>`.

Request options (the reference encoders take none of these; the mapping follows vLLM's `deepseek_v4` and
`deepseek_v41` tokenizer modes):

- Thinking is ON by default in both families (`thinking=None`), as vLLM does.
- reasoning_effort: V4 takes "high" (the default, writes nothing) and "max". V4.1 takes "low", "high" (the default),
  "xhigh", "max" = 25, 50, 75, 100, or an integer 1-100. Both take the OpenAI value "none", which turns thinking off
  (and contradicts an explicit `thinking=True`). Anything else is a ValueError naming the value; vLLM instead maps
  V4's unknown values to "high" and "minimal"/"medium"/"low" to a "low" level V4's reference encoder rejects.
- Request tools go into the system message: for V4 the first message when it is a system or developer message, for
  V4.1 the first system message anywhere; with no such message, an empty system message is put first.
- add_generation_prompt=False leaves out the `<｜Assistant｜>` + think marker the reference writes after a final user
  turn. After a final assistant turn the reference writes nothing more, with or without it.

Special tokens are ordinary text here; `encode_chat` returns a string, BOS included, to be tokenized in one call
without adding special tokens (as vLLM does with the reference's output). DeepSeek's tokenizer.json makes each
special token one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dsv4.chat.messages import PART_SEPARATOR, Message, Part, ToolCall, check_messages, check_tools, to_json
from dsv4.chat.tokens import Family, SpecialTokens, special_tokens

EFFORT_NONE = "none"  # OpenAI's reasoning_effort value for "do not reason"
DEFAULT_THINKING = True
DEFAULT_EFFORT = "high"
V4_EFFORTS = ("high", "max")
V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}

# Separators of the format, named so a test can plant a change in one and see the reference comparison fail.
BLANK_LINE = "\n\n"  # between a message's text and its tools section or tool-call block
NEWLINE = "\n"  # between DSML tags, and between tool schemas

V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


@dataclass(frozen=True)
class Reasoning:
    """Whether the prompt asks the model to reason, and how hard.

    `thinking` also tells a reasoning parser where a reply starts: inside the reasoning (the prompt ends with the
    think-start token) or in the answer (it ends with the think-end token).
    """

    thinking: bool
    effort: str | int  # as given, or the default
    budget: int | None  # V4.1's 1-100 number; None for V4, whose efforts are levels only


def resolve_reasoning(
    family: Family, thinking: bool | None = None, reasoning_effort: str | int | None = None
) -> Reasoning:
    """Apply the defaults and check the values; a ValueError names a bad value."""
    special_tokens(family)  # rejects an unknown family
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking: expected true, false or null, got {thinking!r}")
    effort = reasoning_effort
    if isinstance(effort, str) and effort == EFFORT_NONE:
        if thinking:
            raise ValueError("reasoning_effort 'none' turns thinking off, but thinking=True was asked for")
        thinking, effort = False, None
    thinking = DEFAULT_THINKING if thinking is None else thinking
    effort = DEFAULT_EFFORT if effort is None else effort
    if family == "v4":
        if not (isinstance(effort, str) and effort in V4_EFFORTS):
            raise ValueError(
                f"reasoning_effort {effort!r} is not one DeepSeek-V4 knows: use 'high', 'max', or 'none' (no thinking)"
            )
        return Reasoning(thinking, effort, None)
    if isinstance(effort, str) and effort in V41_EFFORTS:
        return Reasoning(thinking, effort, V41_EFFORTS[effort])
    if type(effort) is int and 1 <= effort <= 100:  # `type`, so that True is not taken for 1
        return Reasoning(thinking, effort, effort)
    raise ValueError(
        f"reasoning_effort {effort!r} is not one DeepSeek-V4.1 knows: use 'low', 'high', 'xhigh', 'max', an integer "
        "from 1 to 100, or 'none' (no thinking)"
    )


def encode_chat(
    messages: Sequence[dict[str, Any]],
    family: Family,
    *,
    thinking: bool | None = None,
    reasoning_effort: str | int | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt for `messages` (OpenAI chat format) in `family`'s format ("v4" or "v41"), BOS included.

    `tools` is the request's OpenAI tool list. `drop_thinking` leaves out earlier turns' reasoning (see the module
    docstring for when the reference keeps it anyway). Bad input raises ValueError naming the message and field.
    """
    tokens = special_tokens(family)
    reasoning = resolve_reasoning(family, thinking, reasoning_effort)
    for name, flag in (("drop_thinking", drop_thinking), ("add_generation_prompt", add_generation_prompt)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected true or false, got {flag!r}")
    conversation = check_messages(messages, tokens)
    functions = check_tools(tools) if tools is not None else ()
    if functions:
        conversation = _attach_tools(conversation, functions, family)
    conversation = _order_tool_results(_merge_user_turns(conversation))
    drop = drop_thinking and not functions
    if reasoning.thinking and drop:
        conversation = _drop_earlier_thinking(conversation, family)
    last_user = _last_user_turn(conversation, family)
    return tokens.bos + "".join(
        _render(i, conversation, last_user, tokens, reasoning, drop, add_generation_prompt)
        for i in range(len(conversation))
    )


# ---- Shaping the conversation the way the reference does before it renders


def _attach_tools(conversation: list[Message], functions: tuple[Any, ...], family: Family) -> list[Message]:
    if family == "v4":
        target = 0 if conversation[0].role in ("system", "developer") else None
    else:
        target = next((i for i, m in enumerate(conversation) if m.role == "system"), None)
    if target is None:
        return [Message("system", tools=functions), *conversation]
    return [replace(m, tools=functions) if i == target else m for i, m in enumerate(conversation)]


def _merge_user_turns(conversation: list[Message]) -> list[Message]:
    """Consecutive user messages (tool messages are user messages by now) become one user turn."""
    merged: list[Message] = []
    for m in conversation:
        if m.role == "user" and merged and merged[-1].role == "user":
            merged[-1] = replace(merged[-1], parts=merged[-1].parts + m.parts)
        else:
            merged.append(m)
    return merged


def _order_tool_results(conversation: list[Message]) -> list[Message]:
    """Within each user turn, put tool results in the order of the latest calls; text parts keep their places.

    A result whose id matches no call sorts as the first call (the sort is stable), as in the reference.
    """
    call_order: dict[str, int] = {}
    ordered = []
    for m in conversation:
        if m.role == "assistant" and m.tool_calls:
            call_order = {call.id: k for k, call in enumerate(m.tool_calls) if call.id}
        elif m.role == "user" and call_order:
            results = [p for p in m.parts if p.is_tool_result]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda p: call_order.get(p.tool_call_id, 0)))
                m = replace(m, parts=tuple(next(ranked) if p.is_tool_result else p for p in m.parts))
        ordered.append(m)
    return ordered


def _drop_earlier_thinking(conversation: list[Message], family: Family) -> list[Message]:
    """Before the last user turn: assistant reasoning goes, developer messages go, the rest stays."""
    last_user = _last_user_turn(conversation, family)
    kept = []
    for i, m in enumerate(conversation):
        if i >= last_user or m.role in ("user", "system"):
            kept.append(m)
        elif m.role == "assistant":
            kept.append(replace(m, reasoning=None))
    return kept


def _is_user_turn(i: int, m: Message, family: Family) -> bool:
    """Whether message i is one the model answers (it gets the assistant header when a reply follows)."""
    return m.role in ("user", "developer") or (family == "v41" and m.role == "system" and i > 0)


def _last_user_turn(conversation: list[Message], family: Family) -> int:
    return max((i for i, m in enumerate(conversation) if _is_user_turn(i, m, family)), default=-1)


# ---- Rendering


def _render(
    i: int,
    conversation: list[Message],
    last_user: int,
    tokens: SpecialTokens,
    reasoning: Reasoning,
    drop: bool,
    add_generation_prompt: bool,
) -> str:
    m = conversation[i]
    family = tokens.family
    text = _opening(i, m, tokens, reasoning)
    if m.role == "system":
        text += m.content + _tools_suffix(m, tokens)
    elif m.role == "developer":
        text += tokens.user + m.content + _tools_suffix(m, tokens)
    elif m.role == "user":
        text += tokens.user + PART_SEPARATOR.join(_part_text(p, tokens) for p in m.parts)
    else:
        # Reasoning is shown for the turns after the last user message (the one being answered now, e.g. in a
        # tool-call loop), or for every turn when earlier reasoning is kept.
        shows_reasoning = reasoning.thinking and (not drop or i > last_user)
        text += f"{m.reasoning or ''}{tokens.think_end}" if shows_reasoning else ""
        text += m.content + _tool_calls_block(m.tool_calls, tokens) + tokens.eos

    is_last = i + 1 == len(conversation)
    if not is_last and conversation[i + 1].role != "assistant":
        return text
    if _is_user_turn(i, m, family) and (add_generation_prompt or not is_last):
        thinks = reasoning.thinking and (not drop or i >= last_user)
        text += tokens.assistant + (tokens.think_start if thinks else tokens.think_end)
    return text


def _opening(i: int, m: Message, tokens: SpecialTokens, reasoning: Reasoning) -> str:
    """What goes before message i's own text: the effort (first message only) and V4.1's system token."""
    if tokens.family == "v4":
        return V4_MAX_EFFORT if i == 0 and reasoning.thinking and reasoning.effort == "max" else ""
    effort = ""
    if i == 0 and reasoning.thinking:
        effort = (
            f"Reasoning Effort: {reasoning.budget} "
            f"(range 1-100, the higher the value, the more thorough the reasoning){BLANK_LINE}"
        )
    # The effort line lives in a system block: the first message's own when it is a system message.
    return (tokens.system or "" if m.role == "system" or effort else "") + effort


def _part_text(part: Part, tokens: SpecialTokens) -> str:
    if part.is_tool_result:
        return tokens.tool_result_start + part.text + tokens.tool_result_end
    return part.text


def _tools_suffix(m: Message, tokens: SpecialTokens) -> str:
    if not m.tools:
        return ""
    t = tokens
    example = NEWLINE.join(
        [
            t.tool_calls_start,
            f'{t.invoke_start} name="$TOOL_NAME">',
            f'{t.parameter_start} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{t.parameter_end}',
            "...",
            t.invoke_end,
            f'{t.invoke_start} name="$TOOL_NAME2">',
            "...",
            t.invoke_end,
            t.tool_calls_end,
        ]
    )
    schemas = NEWLINE.join(to_json(f, "tools") for f in m.tools)
    # The wording is part of the format: the models were trained on exactly this text.
    return (
        f"{BLANK_LINE}## Tools{BLANK_LINE}"
        "You have access to a set of tools to help answer the user's question. "
        f'You can invoke tools by writing a "{t.tool_calls_start}" block like the following:{BLANK_LINE}'
        f"{example}{BLANK_LINE}"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        f'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.{BLANK_LINE}'
        f"If thinking_mode is enabled (triggered by {t.think_start}), you MUST output your complete reasoning inside "
        f"{t.think_start}...{t.think_end} BEFORE any tool calls or final response.{BLANK_LINE}"
        f"Otherwise, output directly after {t.think_end} with tool calls or final response.{BLANK_LINE}"
        f"### Available Tool Schemas{BLANK_LINE}"
        f"{schemas}{BLANK_LINE}"
        f"You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.{NEWLINE}"
    )


def _tool_calls_block(calls: tuple[ToolCall, ...], tokens: SpecialTokens) -> str:
    if not calls:
        return ""
    t = tokens
    invokes = []
    for call in calls:
        parameters = NEWLINE.join(
            f'{t.parameter_start} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else to_json(value, call.name)}{t.parameter_end}"
            for key, value in call.arguments
        )
        invokes.append(f'{t.invoke_start} name="{call.name}">{NEWLINE}{parameters}{NEWLINE}{t.invoke_end}')
    return f"{BLANK_LINE}{t.tool_calls_start}{NEWLINE}{NEWLINE.join(invokes)}{NEWLINE}{t.tool_calls_end}"
