"""tool_choice "required" and a named function, enforced with a grammar (dsv4.structured.tool_calls).

The grammar against DeepSeek's own format: it accepts, token by token, the assistant turn the prompt encoder
(dsv4.chat) renders for tool calls of each family, and the DSML parser reads those calls back; it refuses a call
to another function, parameters that break the schema, or anything but tool calls. Then end to end: `dsv4 serve`
on the random-weight tiny-v4 (with a 2048-token context: a tools section alone is about 900 of its tokens) answers
tool_choice "required" / named requests, streaming and not, with `tool_calls` whose arguments parse and validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_server import KEY, Server, _post, serve_process

from dsv4.chat import encode_chat, special_tokens
from dsv4.make_model import make_model, write_tokenizer_files
from dsv4.sampling_params import StructuredOutputsParams
from dsv4.serve.parsers import parse_tool_calls
from dsv4.structured import GrammarCompiler
from dsv4.structured.tool_calls import tool_call_constraint
from dsv4.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object",
    "$defs": {"Window": {"type": "object", "properties": {"from": {"type": "integer"}, "to": {"type": "integer"}},
                         "required": ["from"], "additionalProperties": False}},
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["C", "F"]},
        "when": {"type": "string", "format": "date"},
        "note": {"type": ["string", "null"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "window": {"$ref": "#/$defs/Window"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SEARCH = {"type": "function", "function": {"name": "search"}}  # no schema: any parameters
LIST = {"type": "function", "function": {"name": "list_files", "parameters": {  # every parameter optional
    "type": "object", "properties": {"path": {"type": "string"}, "hidden": {"type": "boolean"}}}}}
TOOLS = [WEATHER, CLOCK, SEARCH, LIST]
NAMED_CLOCK = {"type": "function", "function": {"name": "get_time"}}

Call = tuple[str, dict[str, Any]]
GOOD_CALLS: list[list[Call]] = [
    [("get_weather", {"city": "Paris", "days": 3})],
    # every parameter, in the schema's order; a raw string with markup-like text and a blank line in it
    [("get_weather", {"city": "Pa<ris> \"x\"\n\nend", "days": 14, "unit": "F", "when": "2025-02-28", "note": None,
                      "code": "CDG", "window": {"from": 1, "to": 2}, "tags": ["a", "b c"]})],
    [("get_weather", {"city": "", "days": 1, "note": "free text"})],
    [("get_time", {})],
    [("search", {"query": "dsv4", "limit": 3, "filters": {"lang": ["en"]}})],
    [("search", {})],
    [("list_files", {})],
    [("list_files", {"hidden": True})],
    [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {}), ("get_weather", {"city": "Rome", "days": 7})],
]
BAD_CALLS: list[tuple[str, list[Call]]] = [
    ("a string where an integer is required", [("get_weather", {"city": "Paris", "days": "3"})]),
    ("a number that is not an integer", [("get_weather", {"city": "Paris", "days": 2.5})]),
    ("an integer out of range", [("get_weather", {"city": "Paris", "days": 15})]),
    ("a missing required parameter", [("get_weather", {"city": "Paris"})]),
    ("required parameters out of the schema's order", [("get_weather", {"days": 3, "city": "Paris"})]),
    ("a value outside the enum", [("get_weather", {"city": "Paris", "days": 3, "unit": "K"})]),
    ("a string the pattern refuses", [("get_weather", {"city": "Paris", "days": 3, "code": "cdg"})]),
    ("a string that is not a date", [("get_weather", {"city": "Paris", "days": 3, "when": "tomorrow"})]),
    ("a $ref'd object missing its required key", [("get_weather", {"city": "P", "days": 3, "window": {"to": 2}})]),
    ("an array over maxItems", [("get_weather", {"city": "P", "days": 3, "tags": ["a", "b", "c"]})]),
    ("a parameter the schema does not have", [("get_weather", {"city": "Paris", "days": 3, "country": "FR"})]),
    ("a parameter of a tool without parameters", [("get_time", {"zone": "UTC"})]),
    ("a tool that is not in the request", [("get_wether", {"city": "Paris", "days": 3})]),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(str(path))
    return Tokenizer.from_dir(str(path))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])


def _reply(family: str, calls: list[Call], content: str = "") -> str:
    """What DeepSeek's encoder writes for an assistant turn making `calls` (in chat mode), EOS included."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]}
    prompt = encode_chat(ask, family, thinking=False, tools=TOOLS)
    full = encode_chat(ask + [turn], family, thinking=False, tools=TOOLS)
    assert full.startswith(prompt)
    return full[len(prompt):]


def _accepts(grammar: Any, tokenizer: Tokenizer, text: str) -> bool:
    """Whether a matcher of `grammar` takes every token of `text` and ends there (its last token is EOS)."""
    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        matcher.is_terminated()


def _grammar(compiler: GrammarCompiler, family: str, choice: Any = "required", parallel: bool = True) -> Any:
    params = tool_call_constraint(TOOLS, choice, family, parallel)
    assert params is not None and params.kind == "structural_tag"
    return compiler.compile(params)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_grammar_accepts_the_encoders_tool_calls_and_the_parser_reads_them_back(
        family: str, compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    required = _grammar(compiler, family)
    eos = special_tokens(family).eos
    for calls in GOOD_CALLS:
        text = _reply(family, calls)
        assert text.endswith(eos) and _accepts(required, tokenizer, text), (calls, text)
        content, parsed = parse_tool_calls(text.removesuffix(eos), family)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        assert not _accepts(required, tokenizer, text.removesuffix(eos)), calls  # the message must end
    named = _grammar(compiler, family, NAMED_CLOCK)
    assert _accepts(named, tokenizer, _reply(family, [("get_time", {})]))
    single = _grammar(compiler, family, parallel=False)
    assert _accepts(single, tokenizer, _reply(family, GOOD_CALLS[0]))


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_grammar_refuses_other_calls_bad_parameters_and_free_text(
        family: str, compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    required = _grammar(compiler, family)
    for why, calls in BAD_CALLS:
        assert not _accepts(required, tokenizer, _reply(family, calls)), why
    call = _reply(family, GOOD_CALLS[0])
    for text in ("Let me check." + call, "</think>" + call, _reply(family, [])):
        assert not _accepts(required, tokenizer, text), text  # tool calls and nothing else; at least one
    other = "v41" if family == "v4" else "v4"
    assert not _accepts(required, tokenizer, _reply(other, GOOD_CALLS[0]))  # the family's own DSML tags
    # a DSML opener inside a raw string would end the value for the parser
    assert not _accepts(required, tokenizer, _reply(family, [("get_weather", {"city": "<｜DSML｜x", "days": 3})]))
    # JSON as the encoder writes it (one space after ',' and ':') or compact, but no runs of whitespace
    window = _reply(family, [("get_weather", {"city": "P", "days": 3, "window": {"from": 1, "to": 2}})])
    assert _accepts(required, tokenizer, window.replace(", ", ",").replace(": ", ":"))
    assert not _accepts(required, tokenizer, window.replace('"from": 1', '"from":   1'))

    named = _grammar(compiler, family, NAMED_CLOCK)
    assert not _accepts(named, tokenizer, _reply(family, GOOD_CALLS[0]))  # a call to another function
    assert not _accepts(named, tokenizer, _reply(family, [("get_time", {}), ("get_time", {})]))  # exactly one
    single = _grammar(compiler, family, parallel=False)
    assert not _accepts(single, tokenizer, _reply(family, GOOD_CALLS[-1]))  # parallel_tool_calls=false: one call


def test_constraint_choices_and_errors() -> None:
    assert tool_call_constraint(TOOLS, "auto", "v4") is None
    assert tool_call_constraint(TOOLS, "none", "v4") is None
    assert tool_call_constraint(TOOLS, None, "v41") is None
    for tools, choice, msg in [
        ([], "required", "needs `tools`"),
        (None, NAMED_CLOCK, "needs `tools`"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in `tools`"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        ([{"type": "function", "function": {"name": 'say"hi'}}], "required", "cannot be written in a DSML"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a<b": {"type": "string"}}}}}], "required", "parameter name 'a<b'"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {}, "required": ["x"]}}}], "required", r"\['x'\] are not in"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tool_call_constraint(tools, choice, "v4")


def test_a_bad_schema_fails_the_compile_with_a_clear_message(compiler: GrammarCompiler) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integr"}}, "required": ["n"]}}}]
    params = tool_call_constraint(bad, "required", "v4")
    with pytest.raises(ValueError, match="structured outputs: invalid structural tag: .*integr"):
        compiler.compile(params)
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams(structural_tag="")


# ---- end to end -------------------------------------------------------------------------------------------------

E2E_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "metric": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _valid_call(name: str, arguments: str) -> bool:
    """A call of E2E_TOOLS whose arguments parse and satisfy its schema (checked by hand: no jsonschema)."""
    args = json.loads(arguments)
    if name == "get_time":
        return args == {"zone": "UTC"} or args == {"zone": "CET"}
    return (name == "get_weather" and set(args) - {"metric"} == {"city", "days"}
            and args["city"] in ("Paris", "Rome", "Oslo") and type(args["days"]) is int and 1 <= args["days"] <= 7
            and isinstance(args.get("metric", False), bool))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tool-choice")
    model = make_model("tiny-v4", str(tmp / "tiny"), seed=0, overrides={"max_position_embeddings": 2048})
    with serve_process(model, tmp, "--max-model-len", "2048") as s:
        yield s


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_required_tool_choice_returns_valid_tool_calls(server: Server) -> None:
    """Greedy on a random model: what it prefers is no call at all, yet the reply is tool calls, the last chunk /
    the choice finishes with "tool_calls", nothing leaks into the content, and thinking was off."""
    resp = server.client().chat.completions.create(model=server.model_dir, messages=ASK, tools=E2E_TOOLS,
                                                   tool_choice="required", temperature=0, max_tokens=500)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and not (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.message.tool_calls and all(
        _valid_call(c.function.name, c.function.arguments) for c in choice.message.tool_calls), choice

    stream = server.client().chat.completions.create(
        model=server.model_dir, messages=ASK, tools=E2E_TOOLS, tool_choice={"type": "function",
                                                                          "function": {"name": "get_time"}},
        temperature=0, max_tokens=500, stream=True)
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for piece in c.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls.values()] == ["get_time"] and _valid_call("get_time", calls[0]["arguments"])


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required", "chat_template_kwargs": {"thinking": True}}, "tool_choice"),
    ({"tool_choice": NAMED_CLOCK, "reasoning_effort": "max"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": 'a"b'}}]}, "tools"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
])
def test_bad_tool_choice_requests_are_400s(server: Server, body: dict[str, Any], param: str) -> None:
    request = {"model": server.model_dir, "messages": ASK, "tools": E2E_TOOLS, "max_tokens": 4, **body}
    status, reply = _post(server, "/v1/chat/completions", json.dumps(request).encode(),
                          {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_tool_choice_none_leaves_the_reply_unparsed(server: Server) -> None:
    """"none": no grammar and no tool-call parsing (the DSML, if any, stays in the content), thinking as asked."""
    resp = server.client().chat.completions.create(model=server.model_dir, messages=ASK, tools=E2E_TOOLS,
                                                   tool_choice="none", max_tokens=4, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError):  # "required" with no tools at all
        server.client().chat.completions.create(model=server.model_dir, messages=ASK, tool_choice="required",
                                                max_tokens=4)
