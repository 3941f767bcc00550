"""dsv4.chat against DeepSeek's reference prompt encoders for V4 and V4.1.

The expected prompts in tests/data/chat_encoding/expected_<family>.json were written by the reference encoders
themselves (make_expected.py; the file header names the repository, path and commit they were read from). Equal
strings give equal token ids: the engine tokenizes the whole prompt in one call with add_special_tokens=False, as
vLLM does with the reference's output, and DeepSeek's tokenizer.json makes each special token one atomic token.

The planted-change tests alter one special token or one separator of our encoder and check that the comparison
with the reference then fails, so a wrong token or newline cannot pass unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dsv4.chat import FAMILIES, encode_chat, resolve_reasoning, special_tokens
from dsv4.chat import encoding, messages, tokens

DATA = Path(__file__).parent / "data" / "chat_encoding"
OPTIONS = ("thinking", "reasoning_effort", "tools", "drop_thinking", "add_generation_prompt")


def _load(family: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cases = json.loads((DATA / f"conversations_{family}.json").read_text(encoding="utf-8"))["cases"]
    expected = json.loads((DATA / f"expected_{family}.json").read_text(encoding="utf-8"))
    return cases, expected


def _encode(case: dict[str, Any], family: str) -> str:
    return encode_chat(case["messages"], family, **{k: case[k] for k in OPTIONS if k in case})


def _mismatches(family: str) -> list[str]:
    cases, expected = _load(family)
    return [c["name"] for c in cases if _encode(c, family) != expected["expected"][c["name"]]]


CASES = [(family, case) for family in FAMILIES for case in _load(family)[0]]


@pytest.mark.parametrize(("family", "case"), CASES, ids=[f"{f}-{c['name']}" for f, c in CASES])
def test_matches_reference(family: str, case: dict[str, Any]) -> None:
    expected = _load(family)[1]["expected"][case["name"]]
    assert _encode(case, family) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_expected_set_is_complete_and_sourced(family: str) -> None:
    cases, expected = _load(family)
    names = [c["name"] for c in cases]
    assert len(names) >= 30 and len(set(names)) == len(names)
    assert set(expected["expected"]) == set(names)
    source = expected["source"]
    assert source["repo"] and source["path"].endswith(f"encoding_ds{family}.py")
    assert len(source["commit"]) == 40 and source["generated"]


# ---- Planted changes: each must make at least one reference comparison fail


def _token_fields(family: str) -> list[str]:
    table = special_tokens(family)
    return [f.name for f in dataclasses.fields(table) if f.name != "family" and getattr(table, f.name) is not None]


TOKEN_FIELDS = [(family, name) for family in FAMILIES for name in _token_fields(family)]


@pytest.mark.parametrize(("family", "field"), TOKEN_FIELDS, ids=[f"{f}-{n}" for f, n in TOKEN_FIELDS])
def test_planted_token_change_fails(family: str, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tokens.TOKENS[family]
    planted = dataclasses.replace(table, **{field: getattr(table, field) + "x"})
    monkeypatch.setitem(tokens.TOKENS, family, planted)
    assert _mismatches(family), f"changing {field} went unnoticed"


PLANTED_FORMAT = [
    (encoding, "BLANK_LINE", "\n"),
    (encoding, "NEWLINE", "\n\n"),
    (encoding, "PART_SEPARATOR", "\n"),  # between the pieces of a user turn
    (messages, "PART_SEPARATOR", "\n"),  # between the parts of list content
    (encoding, "V4_MAX_EFFORT", encoding.V4_MAX_EFFORT[:-1]),  # one newline fewer
]


@pytest.mark.parametrize(
    ("module", "name", "value"), PLANTED_FORMAT, ids=[f"{m.__name__}.{n}" for m, n, _ in PLANTED_FORMAT]
)
def test_planted_format_change_fails(module: Any, name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, name, value)
    failing = _mismatches("v4") + _mismatches("v41")
    assert failing, f"changing {module.__name__}.{name} went unnoticed"


def test_planted_effort_budget_change_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(encoding.V41_EFFORTS, "high", 51)
    assert _mismatches("v41")


# ---- Options


@pytest.mark.parametrize(
    ("family", "thinking", "effort", "want"),
    [
        ("v4", None, None, (True, "high", None)),
        ("v4", False, "max", (False, "max", None)),
        ("v4", None, "none", (False, "high", None)),
        ("v41", None, None, (True, "high", 50)),
        ("v41", True, "xhigh", (True, "xhigh", 75)),
        ("v41", None, 7, (True, 7, 7)),
        ("v41", False, None, (False, "high", 50)),
        ("v41", None, "none", (False, "high", 50)),
    ],
)
def test_resolve_reasoning(family: str, thinking: bool | None, effort: str | int | None, want: tuple[Any, ...]) -> None:
    r = resolve_reasoning(family, thinking, effort)
    assert (r.thinking, r.effort, r.budget) == want


def test_default_is_thinking_on() -> None:
    for family in FAMILIES:
        t = special_tokens(family)
        assert encode_chat([{"role": "user", "content": "q"}], family).endswith(t.assistant + t.think_start)


def test_reasoning_alias() -> None:
    """`reasoning` (vLLM's response field) is taken like `reasoning_content`."""
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with_alias = [turns[0], {**turns[1], "reasoning": "r"}, turns[0]]
    with_field = [turns[0], {**turns[1], "reasoning_content": "r"}, turns[0]]
    for family in FAMILIES:
        prompt = encode_chat(with_alias, family, drop_thinking=False)
        assert prompt == encode_chat(with_field, family, drop_thinking=False)
        assert "r</think>b" in prompt


def test_v4_has_no_image_token() -> None:
    """V4 has no image placeholder, so V4.1's placeholder is plain text there."""
    text = "<｜deepseek_image｜>"
    assert text in encode_chat([{"role": "user", "content": text}], "v4")


def test_special_tokens() -> None:
    v4, v41 = special_tokens("v4"), special_tokens("v41")
    assert v4.tool_calls_start == "<｜DSML｜tool_calls>" and v41.tool_calls_start == "<｜DSML｜ calls>"
    assert v41.invoke_end == "</｜DSML｜ invoke>" and v4.parameter_start == "<｜DSML｜parameter"
    assert v4.system is None and v4.image is None
    assert (v41.system, v41.image) == ("<｜System｜>", "<｜deepseek_image｜>")
    assert v4.bos == v41.bos == "<｜begin▁of▁sentence｜>"
    with pytest.raises(dataclasses.FrozenInstanceError):
        v4.eos = "x"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown model family 'v3'"):
        special_tokens("v3")


# ---- Bad input: always a ValueError naming the place


def _user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def _call(arguments: Any, **function: Any) -> list[dict[str, Any]]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments, **function}}
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]


IMAGE_TEXT = "see <｜deepseek_image｜>"
BAD_INPUT = [
    ("v4", [], {}, r"messages: the conversation is empty"),
    ("v4", "hello", {}, r"messages: expected a list"),
    ("v4", ["hello"], {}, r"messages\[0\]: expected an object"),
    ("v4", [{"content": "x"}], {}, r"messages\[0\]\.role: unknown role None"),
    ("v41", [{"role": "bot", "content": "x"}], {}, r"messages\[0\]\.role: unknown role 'bot'"),
    ("v4", _user(3), {}, r"messages\[0\]\.content: expected a string, got int"),
    ("v4", _user(None), {}, r"messages\[0\]\.content: expected a string, got null"),
    ("v4", _user([{"type": "text", "text": "a"}]), {}, r"messages\[0\]\.content: expected a string, got list"),
    ("v4", [{"role": "user"}], {}, r"messages\[0\]\.content"),
    ("v41", _user({"text": "a"}), {}, r"messages\[0\]\.content: expected a string or a list"),
    ("v41", _user([{"type": "audio"}]), {}, r"messages\[0\]\.content\[0\]: expected a text or image part, got 'audio'"),
    ("v41", _user(["raw"]), {}, r"messages\[0\]\.content\[0\]: expected a text or image part"),
    ("v41", _user([{"type": "text", "text": 5}]), {}, r"messages\[0\]\.content\[0\]\.text: expected a string"),
    ("v41", _user([{"type": "image_url", "image_url": {}}]), {}, r"messages\[0\]\.content\[0\]\.image_url"),
    ("v41", _user([{"type": "image"}]), {}, r"messages\[0\]\.content\[0\]: an image part needs"),
    ("v41", _user(IMAGE_TEXT), {}, r"messages\[0\]\.content: contains the image placeholder"),
    ("v41", _user([{"type": "text", "text": IMAGE_TEXT}]), {}, r"messages\[0\]\.content\[0\]\.text: contains"),
    ("v41", [{"role": "system", "content": IMAGE_TEXT}], {}, r"messages\[0\]\.content: contains the image"),
    ("v41", [{"role": "tool", "content": IMAGE_TEXT}], {}, r"messages\[0\]\.content: contains the image"),
    ("v41", [{"role": "assistant", "reasoning_content": IMAGE_TEXT}], {}, r"reasoning_content: contains"),
    ("v4", [{"role": "system", "content": "s", "tools": []}], {}, r"messages\[0\]\.tools: not supported in a message"),
    ("v4", [{"role": "developer", "content": ""}], {}, r"messages\[0\]\.content: a developer message needs"),
    ("v4", [{"role": "tool", "content": "r", "tool_call_id": 7}], {}, r"messages\[0\]\.tool_call_id: expected"),
    ("v4", [{"role": "tool", "content": None}], {}, r"messages\[0\]\.content: expected a string or text parts"),
    ("v4", [{"role": "tool", "content": [{"type": "image_url", "image_url": "u"}]}], {}, r"expected a text part"),
    ("v4", [{"role": "assistant", "content": "a", "reasoning_content": 1}], {}, r"messages\[0\]\.reasoning_content"),
    ("v4", [{"role": "assistant", "content": "a", "reasoning_content": "x", "reasoning": "y"}], {}, r"differ"),
    ("v4", [{"role": "assistant", "tool_calls": {}}], {}, r"messages\[0\]\.tool_calls: expected a list"),
    ("v4", [{"role": "assistant", "tool_calls": [None]}], {}, r"messages\[0\]\.tool_calls\[0\]: expected an object"),
    ("v4", [{"role": "assistant", "tool_calls": [{"id": "c"}]}], {}, r"messages\[0\]\.tool_calls\[0\]\.function"),
    ("v4", _call("{}", name=""), {}, r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ("v4", _call("[1, 2]"), {}, r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object"),
    ("v4", _call({"a": 1}), {}, r"function\.arguments: expected a JSON object in a string, got dict"),
    ("v41", _call("{oops"), {}, r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ("v41", _call(None), {}, r"function\.arguments: expected a JSON object in a string or an object, got null"),
    ("v41", _call({"a": {1, 2}}), {}, r"function\.arguments\.a: not JSON-serializable"),
    ("v4", _user("q"), {"tools": {"type": "function"}}, r"tools: expected a list"),
    ("v4", _user("q"), {"tools": [{"type": "function"}]}, r"tools\[0\]\.function: expected an object"),
    ("v4", _user("q"), {"tools": [{"type": "retrieval", "function": {}}]}, r"tools\[0\]\.type"),
    ("v41", _user("q"), {"tools": [{"function": {"description": "d"}}]}, r"tools\[0\]\.function\.name"),
    ("v3", _user("q"), {}, r"unknown model family 'v3'"),
    ("v4", _user("q"), {"reasoning_effort": "low"}, r"reasoning_effort 'low' is not one DeepSeek-V4 knows"),
    ("v4", _user("q"), {"reasoning_effort": 50}, r"reasoning_effort 50 is not one DeepSeek-V4 knows"),
    ("v41", _user("q"), {"reasoning_effort": "medium"}, r"reasoning_effort 'medium' is not one DeepSeek-V4.1 knows"),
    ("v41", _user("q"), {"reasoning_effort": "minimal"}, r"reasoning_effort 'minimal'"),
    ("v41", _user("q"), {"reasoning_effort": 0}, r"reasoning_effort 0 "),
    ("v41", _user("q"), {"reasoning_effort": 101}, r"reasoning_effort 101 "),
    ("v41", _user("q"), {"reasoning_effort": True}, r"reasoning_effort True "),
    ("v41", _user("q"), {"reasoning_effort": 50.0}, r"reasoning_effort 50.0 "),
    ("v41", _user("q"), {"reasoning_effort": ["max"]}, r"reasoning_effort \['max'\] "),
    ("v41", _user("q"), {"reasoning_effort": "medium", "thinking": False}, r"'medium'"),  # checked even when off
    ("v4", _user("q"), {"reasoning_effort": "none", "thinking": True}, r"'none' turns thinking off"),
    ("v4", _user("q"), {"thinking": "yes"}, r"thinking: expected true, false or null"),
    ("v4", _user("q"), {"drop_thinking": None}, r"drop_thinking: expected true or false"),
    ("v41", _user("q"), {"add_generation_prompt": 1}, r"add_generation_prompt: expected true or false"),
]


@pytest.mark.parametrize(("family", "msgs", "kwargs", "match"), BAD_INPUT, ids=[m for *_, m in BAD_INPUT])
def test_bad_input_is_a_clear_value_error(family: str, msgs: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_chat(msgs, family, **kwargs)
