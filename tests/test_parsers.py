"""Reasoning and DSML tool-call parsers (dsv4/serve/parsers) on hand-written DeepSeek-V4 / V4.1 replies.

Every case is parsed whole and streamed cut at every character boundary, one character at a time and in random
chunks: each stream must add up to the one-shot result, and no content or reasoning delta may carry any part of
a `<think>` / `</think>` / DSML marker.
"""
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from dsv4.serve.parsers import (ChatDelta, ChatOutput, ChatOutputStream, ParserOptions, accumulate,
                                parse_chat_output, parse_tool_calls, split_reasoning)

# The tag names as DeepSeek's reference encoders write them, spelt out here independently of the parser.
TAG_NAMES = {"v4": ("tool_calls", "invoke", "parameter"), "v41": (" calls", " invoke", " parameter")}
FAMILIES = list(TAG_NAMES)
FORBIDDEN = ("<think", "</think", "｜", "DSML")


def block(family: str, *calls: tuple[str, list[tuple[str, str, bool]]]) -> str:
    """A tool-call block as the encoder renders it: calls of (name, [(key, value text, is_string)])."""
    b, invoke, param = TAG_NAMES[family]
    lines = [f"<｜DSML｜{b}>"]
    for name, params in calls:
        lines.append(f'<｜DSML｜{invoke} name="{name}">')
        for key, value, is_string in params:
            lines.append(f'<｜DSML｜{param} name="{key}" string="{str(is_string).lower()}">{value}</｜DSML｜{param}>')
        lines.append(f"</｜DSML｜{invoke}>")
    return "\n".join(lines + [f"</｜DSML｜{b}>"])


def tag(family: str, which: str, attrs: str = "", closing: bool = False) -> str:
    name = dict(zip(("block", "invoke", "param"), TAG_NAMES[family]))[which]
    return f"<{'/' if closing else ''}｜DSML｜{name}{attrs}>"


WEATHER = ("get_weather", [("city", "Paris", True), ("days", "3", False)])
TRICKY_STRING = 'He said "hi" \\o/ <div class="x">a</div>\n\nZürich 東京 😀\n\n'
SEVERAL = (("search", [("query", TRICKY_STRING, True), ("filters", '{"a": [1, 2, {"b": null}]}', False)]),
           ("set_flags", [("on", "true", False), ("scale", "-1.5e3", False), ("tags", '["x", "y"]', False)]),
           ("noop", []))
SEVERAL_ARGS = [{"query": TRICKY_STRING, "filters": {"a": [1, 2, {"b": None}]}},
                {"on": True, "scale": -1500.0, "tags": ["x", "y"]}, {}]


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    thinking: bool
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, Any]]  # (name, arguments as a dict, or as raw text when incomplete JSON)
    tool_names: frozenset[str] | None = None


def cases(f: str) -> list[Case]:
    def inv(attrs: str = "", closing: bool = False) -> str:
        return tag(f, "invoke", attrs, closing)

    def par(attrs: str = "", closing: bool = False) -> str:
        return tag(f, "param", attrs, closing)

    open_block, close_block = tag(f, "block"), tag(f, "block", closing=True)
    end_inv, end_par = inv(closing=True), par(closing=True)
    weather = [("get_weather", {"city": "Paris", "days": 3})]
    plain = "Hello! 2 < 3 and 5 > 4; see <b>bold</b> and a lone <\n\nEnd.\n"
    return [
        Case("plain_text", plain, False, None, plain, []),
        Case("thinking_cut_in_end_marker", "The user wants a poem. Plan it</thi", True,
             "The user wants a poem. Plan it", None, []),
        Case("thinking_cut_plain", "Compare: 1 < 2 and x\n\n", True, "Compare: 1 < 2 and x\n\n", None, []),
        Case("thinking_answer", "Tags like <b> and\n\nblank lines.</think>The answer is 42.", True,
             "Tags like <b> and\n\nblank lines.", "The answer is 42.", []),
        Case("think_start_in_reply", "<think>Short thought</think>Answer.", False, "Short thought", "Answer.", []),
        Case("empty_reasoning", "</think>Direct.", True, None, "Direct.", []),
        Case("one_call", "Let me check the weather.\n\n" + block(f, WEATHER), False, None,
             "Let me check the weather.", weather),
        Case("several_calls", "\n\n" + block(f, *SEVERAL), False, None, None,
             list(zip(("search", "set_flags", "noop"), SEVERAL_ARGS))),
        Case("thinking_then_calls", "Two lookups needed.</think>\n\n" + block(f, WEATHER, WEATHER), True,
             "Two lookups needed.", None, weather * 2),
        Case("calls_inside_reasoning", "I will call the tool.\n\n" + block(f, WEATHER), True,
             "I will call the tool.", None, weather),
        Case("text_after_block", "Ok.\n\n" + block(f, WEATHER) + "\n \nDone, see above.", False, None,
             "Ok.Done, see above.", weather),
        Case("unclosed_block", "Checking.\n\n" + open_block + "\n" + inv(' name="ls"') + "\n"
             + par(' name="dir" string="true"') + "/tmp" + end_par + "\n" + end_inv, False, None, "Checking.",
             [("ls", {"dir": "/tmp"})]),
        Case("missing_param_close", open_block + "\n" + inv(' name="sh"') + "\n" + par(' name="cmd" string="true"')
             + "ls -la\n" + end_inv + "\n" + close_block, False, None, None, [("sh", {"cmd": "ls -la\n"})]),
        Case("missing_block_open", "Text\n\n" + inv(' name="ls"') + "\n" + end_inv, False, None, "Text",
             [("ls", {})]),
        Case("bad_json_values", "\n\n" + block(f, ("q", [("a", "{not json", False), ("b", "NaN", False),
                                                          ("c", "", False)])), False, None, None,
             [("q", {"a": "{not json", "b": "NaN", "c": ""})]),
        Case("unknown_tool_dropped", "\n\n" + block(f, ("rm_rf", [("path", "/", True)]), WEATHER), False, None,
             None, weather, frozenset({"get_weather"})),
        Case("garbage_in_block", open_block + "\nstray words\n" + inv(' name="ls"') + "\njunk "
             + par(' name="x" string="maybe"') + "v" + end_par + "\n" + end_inv + "\nmore junk\n" + close_block
             + "After.", False, None, "After.", [("ls", {})]),
        Case("duplicate_param", "\n\n" + block(f, ("f", [("k", "1", False), ("k", "2", False)])), False, None, None,
             [("f", {"k": 1})]),
        Case("stray_tags_in_content", "Hello " + end_inv + "world" + tag(f, "block", " x") + "!", False, None,
             "Hello world!", []),
        Case("cut_in_open_tag", "Sure.\n\n" + open_block + "\n" + inv(' name="get_wea')[:-1], False, None,
             "Sure.", []),
        Case("cut_in_block_marker", "Answer.\n\n<｜DSML｜" + TAG_NAMES[f][0][:3], False, None, "Answer.", []),
        Case("cut_in_value", open_block + "\n" + inv(' name="write"') + "\n" + par(' name="text" string="true"')
             + "Hello wor", False, None, None, [("write", '{"text": "Hello wor')]),
    ]


ALL_CASES = [pytest.param(f, c, id=f"{f}-{c.name}") for f in FAMILIES for c in cases(f)]


def options(family: str, case: Case) -> ParserOptions:
    return ParserOptions(family, thinking=case.thinking, tool_names=case.tool_names)


def id_maker() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(text: str, chunks: list[int], opts: ParserOptions) -> list[ChatDelta]:
    """The deltas of `text` fed cut at `chunks` (sorted positions)."""
    parser = ChatOutputStream(opts, id_maker())
    deltas: list[ChatDelta] = []
    for a, b in itertools.pairwise([0, *chunks, len(text)]):
        deltas += parser.feed(text[a:b])
    return deltas + parser.finish()


def check_deltas(deltas: list[ChatDelta]) -> None:
    """Each delta carries one thing; no text carries a marker part; calls stream as OpenAI does."""
    started: set[int] = set()
    for d in deltas:
        assert sum((bool(d.reasoning), bool(d.content), d.tool_call is not None)) == 1, d
        call = d.tool_call
        if call is None:
            continue
        if call.id is not None:  # a call's first delta: index, id, name, arguments ""
            assert call.index == len(started) and call.arguments == "" and call.name
            started.add(call.index)
        else:
            assert call.index in started and call.arguments
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    for marker in FORBIDDEN:
        assert marker not in reasoning and marker not in content, (marker, reasoning, content)


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_one_shot(family: str, case: Case) -> None:
    out = parse_chat_output(case.text, options(family, case), id_maker())
    assert (out.reasoning, out.content) == (case.reasoning, case.content)
    assert [c.id for c in out.tool_calls] == [f"call_{i}" for i in range(len(case.calls))]
    got = [(c.name, c.arguments if isinstance(args, str) else json.loads(c.arguments))
           for c, args in zip(out.tool_calls, [a for _, a in case.calls])]
    assert got == case.calls


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_stream_equals_one_shot(family: str, case: Case) -> None:
    opts = options(family, case)
    whole = parse_chat_output(case.text, opts, id_maker())
    n = len(case.text)
    rng = random.Random(n)
    chunkings = [[i] for i in range(n + 1)] + [list(range(1, n))]
    chunkings += [sorted(rng.sample(range(1, n), rng.randint(1, max(1, n // 4)))) for _ in range(20)]
    for chunks in chunkings:
        deltas = stream(case.text, chunks, opts)
        check_deltas(deltas)
        assert accumulate(deltas) == whole, chunks


def test_arguments_stream_incrementally() -> None:
    text = "\n\n" + block("v41", ("write", [("text", "a long body of text " * 5, True), ("n", "7", False)]))
    deltas = stream(text, list(range(1, len(text))), ParserOptions("v41", thinking=False))
    args = [d.tool_call.arguments for d in deltas if d.tool_call is not None and d.tool_call.id is None]
    # The string value arrives piece by piece, before the call closes; the JSON value at once with its key.
    assert len(args) > 50 and args[0] == '{"text": "' and args[-2:] == [', "n": 7', "}"]
    assert json.loads("".join(args)) == {"text": "a long body of text " * 5, "n": 7}


def test_openai_shapes_and_finish_reason() -> None:
    parser = ChatOutputStream(ParserOptions("v4", thinking=True), id_maker())
    text = "Think.</think>Calling.\n\n" + block("v4", WEATHER)
    chunks = [d.to_openai() for d in parser.feed(text) + parser.finish()]
    assert chunks[0] == {"reasoning_content": "Think."} and chunks[1] == {"content": "Calling."}
    assert chunks[2] == {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert chunks[3] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}}]}
    assert ChatDelta(reasoning="r").to_openai("reasoning") == {"reasoning": "r"}
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    plain = ChatOutputStream(ParserOptions("v4", thinking=False))
    plain.feed("hi")
    assert plain.finish_reason("stop") == "stop"


def test_one_shot_message() -> None:
    out = parse_chat_output("Think.</think>\n\n" + block("v41", WEATHER), ParserOptions("v41", thinking=True),
                            id_maker())
    assert out.finish_reason("stop") == "tool_calls"
    assert out.to_openai_message() == {
        "role": "assistant", "content": None, "reasoning_content": "Think.",
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]}
    assert ChatOutput(None, "hi", ()).to_openai_message() == {"role": "assistant", "content": "hi"}


def test_stage_functions_and_passthrough() -> None:
    assert split_reasoning("a</think>b", "v4", thinking=True) == ("a", "b")
    assert split_reasoning("a</think>b", "v4", thinking=False) == (None, "a</think>b")
    content, calls = parse_tool_calls("Hi.\n\n" + block("v4", WEATHER), "v4")
    assert content == "Hi." and [c.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
    # The other family's tags are not this family's calls.
    assert parse_tool_calls("\n\n" + block("v41", WEATHER), "v4")[1] == ()
    raw = "x\n\n" + block("v4", WEATHER)
    out = parse_chat_output(raw, ParserOptions("v4", thinking=False, parse_tool_calls=False))
    assert out.content == raw and out.tool_calls == ()
    with pytest.raises(ValueError, match="unknown model family"):
        ChatOutputStream(ParserOptions("v5", thinking=False))  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_prompt_encoder(family: str) -> None:
    """A reply rendered by dsv4.chat's encoder (as the model is trained to write it) parses back to itself."""
    from dsv4.chat import encode_chat, special_tokens

    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
             for name in ("search", "set_flags")]
    arguments = [json.dumps(SEVERAL_ARGS[0], ensure_ascii=False), json.dumps(SEVERAL_ARGS[1])]
    reply = {"role": "assistant", "content": "Looking it up.", "reasoning_content": "Two tools.",
             "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                            for i, (name, args) in enumerate(zip(("search", "set_flags"), arguments))]}
    messages = [{"role": "user", "content": "Find it."}, reply]
    prompt = encode_chat(messages[:1], family, thinking=True, tools=tools)
    full = encode_chat(messages, family, thinking=True, tools=tools, add_generation_prompt=False)
    tokens = special_tokens(family)
    assert full.startswith(prompt) and prompt.endswith(tokens.think_start) and full.endswith(tokens.eos)
    text = full[len(prompt):-len(tokens.eos)]
    opts = ParserOptions(family, thinking=True, tool_names=frozenset({"search", "set_flags"}))
    out = parse_chat_output(text, opts, id_maker())
    assert (out.reasoning, out.content) == ("Two tools.", "Looking it up.")
    assert [(c.name, c.arguments) for c in out.tool_calls] == list(zip(("search", "set_flags"), arguments))
    assert accumulate(stream(text, list(range(1, len(text))), opts)) == out
