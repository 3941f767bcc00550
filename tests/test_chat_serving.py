"""Chat serving with DeepSeek's prompt encoding and reply parsers: how a request becomes a prompt (dsv4.chat.prompt,
checked through /tokenize against encode_chat), how a reply becomes reasoning, content and tool calls (the response
assembly on known replies, then end to end: a chat response equals the parse of the same greedy completion of the
same prompt), the request options (tools, tool_choice, reasoning_effort, chat_template_kwargs, include_reasoning)
and their 400s.

One server on the built-in tiny-v4 (no chat template, so DeepSeek-V4's encoder and parsers by default) with a
1024-token context: a tools section alone is about 900 of its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from test_server import KEY, Server, _post, serve_process

from dsv4.chat import encode_chat, special_tokens
from dsv4.chat.prompt import ChatPrompt, ChatPromptError, ChatRenderer
from dsv4.make_model import make_model, write_tokenizer_files
from dsv4.outputs import CompletionOutput
from dsv4.sampling_params import SamplingParams
from dsv4.serve.api_server import ReplyParsers
from dsv4.serve.parsers import ParserOptions, parse_chat_output
from dsv4.serve.protocol import APIError, ChatCompletionRequest, ChatFormat, ChoiceProgress
from dsv4.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# a later turn of a tool loop: the assistant's call (with its reasoning) and the tool's result go back in
LOOP = ASK + [{"role": "assistant", "content": "", "reasoning_content": "I should look it up.",
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
V4 = special_tokens("v4")
CALL = (f'Let me check.\n\n{V4.tool_calls_start}\n{V4.invoke_start} name="get_weather">\n'
        f'{V4.parameter_start} name="city" string="true">Paris{V4.parameter_end}\n{V4.invoke_end}\n'
        f'{V4.tool_calls_end}')
REPLY = f"The user wants the weather.{V4.think_end}{CALL}"  # a thinking-mode reply that calls a tool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("chat-serve")
    with serve_process(make_model("tiny-v4", str(tmp / "tiny"), seed=0), tmp, "--max-model-len", "1024") as s:
        yield s


def _tokenize(server: Server, **body: Any) -> dict[str, Any]:
    status, reply = _post(server, "/tokenize", json.dumps(body).encode(), AUTH)
    assert status == 200, reply
    return reply


def _ids(server: Server, text: str) -> list[int]:
    return server.tok.encode(text, add_special_tokens=False)


# ---- the prompt -------------------------------------------------------------------------------------------------

def test_tokenize_renders_deepseeks_encoding(server: Server) -> None:
    for kwargs, encoder_kwargs in [
        ({}, {}),
        ({"tools": TOOLS}, {"tools": TOOLS}),
        ({"chat_template_kwargs": {"thinking": False}}, {"thinking": False}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"thinking": False}),  # vLLM's / Qwen's name
        ({"reasoning_effort": "max"}, {"reasoning_effort": "max"}),
        ({"reasoning_effort": "none"}, {"thinking": False}),  # OpenAI's "no reasoning"
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ]:
        reply = _tokenize(server, model=server.model_dir, messages=LOOP, **kwargs)
        expected = _ids(server, encode_chat(LOOP, "v4", **encoder_kwargs))
        assert reply == {"count": len(expected), "max_model_len": 1024, "tokens": expected}, kwargs
    plain = _tokenize(server, prompt="Hello there", return_token_strs=True)
    assert plain["tokens"] == server.tok.encode("Hello there")  # a prompt gets the BOS, as vLLM
    assert plain["token_strs"][0] == V4.bos


def test_detokenize_round_trip_and_key(server: Server) -> None:
    text = encode_chat(ASK, "v4")
    tokens = _tokenize(server, messages=ASK)["tokens"]
    status, reply = _post(server, "/detokenize", json.dumps({"tokens": tokens}).encode(), AUTH)
    assert (status, reply) == (200, {"prompt": text})
    status, reply = _post(server, "/detokenize", json.dumps({"tokens": [0, 10 ** 6]}).encode(), AUTH)
    assert status == 400 and reply["error"]["param"] == "tokens"
    for path in ("/tokenize", "/detokenize"):  # key-protected like /v1
        assert _post(server, path, b'{"prompt": "x"}')[0] == 401


def test_renderer_choice_and_v41_images(tmp_path: Path) -> None:
    """auto: a template the checkpoint ships wins, else DeepSeek's encoder; V4.1 images come out in the order of
    their placeholders in the prompt, even where the encoder reorders tool results."""
    write_tokenizer_files(str(tmp_path))
    tok = Tokenizer.from_dir(str(tmp_path))

    class V4Config:
        v41 = None

    assert ChatRenderer.create(tok, V4Config()).mode == "deepseek_v4"
    assert ChatRenderer.create(tok, V4Config(), "deepseek_v41").mode == "deepseek_v41"
    templated = Tokenizer(tok.backend, tok.config, "{{ bos_token }}{{ messages[0]['content'] }}<think>")
    renderer = ChatRenderer.create(templated, V4Config())
    assert renderer.mode == "hf"
    assert renderer.render(ASK) == ChatPrompt(f"{V4.bos}Weather in Paris?<think>", (), True)
    with pytest.raises(ValueError, match="tokenizer mode"):
        ChatRenderer.create(tok, V4Config(), "slow")

    def image(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for k in (1, 2)]
    messages = [{"role": "user", "content": [image("data:A"), {"type": "text", "text": "and"}, image("data:B")]},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": [image("data:D")]},
                {"role": "tool", "tool_call_id": "c1", "content": [image("data:C")]}]
    prompt = ChatRenderer.create(tok, V4Config(), "deepseek_v41").render(messages, tools=TOOLS)
    assert prompt.images == ("data:A", "data:B", "data:C", "data:D")  # c1's result goes first
    image_token = special_tokens("v41").image
    assert prompt.text.count(image_token) == 4 and "\x00" not in prompt.text
    with pytest.raises(ChatPromptError) as info:  # V4 has no images: the encoder names the part
        ChatRenderer.create(tok, V4Config()).render(messages[:1])
    assert info.value.param == "messages" and "messages[0].content" in str(info.value)


# ---- the reply: response assembly on known replies ----------------------------------------------------------------

def _fmt(parser: ParserOptions | None, **request: Any) -> ChatFormat:
    req = ChatCompletionRequest(messages=ASK, **request)
    return ChatFormat("chatcmpl-test", "m", req, parser)


def _stream(fmt: ChatFormat, outputs: list[CompletionOutput], n: int = 1) -> list[dict[str, Any]]:
    """The chunks of choices fed growing texts, as the engine's cumulative outputs come."""
    params = SamplingParams(n=n)
    progress = [ChoiceProgress() for _ in range(n)]
    return [chunk for o in outputs for chunk in fmt.stream_choice(o.index, o, progress[o.index], params, "")]


def _cuts(text: str, index: int = 0, step: int = 7, reason: str = "stop") -> list[CompletionOutput]:
    ends = list(range(step, len(text), step)) + [len(text)]
    return [CompletionOutput(index, text[:end], list(range(end)), finish_reason=reason if end == len(text) else None)
            for end in ends]


def _accumulate(chunks: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
    """A client's view of one streamed choice: the texts joined, tool calls assembled by index."""
    out: dict[str, Any] = {"reasoning_content": "", "reasoning": "", "content": "", "tool_calls": {}}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            for key in ("reasoning_content", "reasoning", "content"):
                out[key] += delta.get(key) or ""
            for call in delta.get("tool_calls", ()):
                entry = out["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            if choice["finish_reason"] is not None:
                out["finish_reason"] = choice["finish_reason"]
    return out


def test_response_assembly_with_a_tool_call() -> None:
    options = ParserOptions("v4", thinking=True, tool_names=frozenset(["get_weather", "get_time"]))
    whole = _fmt(options, tools=TOOLS).choice(0, CompletionOutput(0, REPLY, [1], finish_reason="stop"), "")
    message = whole["message"]
    assert message["reasoning_content"] == message["reasoning"] == "The user wants the weather."
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole["finish_reason"] == "tool_calls"

    streamed = _accumulate(_stream(_fmt(options, tools=TOOLS), _cuts(REPLY)))
    assert streamed["reasoning_content"] == streamed["reasoning"] == message["reasoning"]
    assert streamed["content"] == message["content"] and streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [
        ("get_weather", '{"city": "Paris"}')]

    # cut by max_tokens: "length" stays
    assert _fmt(options).choice(0, CompletionOutput(0, REPLY, [1], finish_reason="length"), "")[
        "finish_reason"] == "length"


def test_response_assembly_options() -> None:
    thinking = ParserOptions("v4", thinking=True, parse_tool_calls=False)
    # include_reasoning=false: parsed, the reasoning left out; tool_choice "none": DSML stays in the content
    whole = _fmt(thinking, include_reasoning=False).choice(0, CompletionOutput(0, REPLY, [1], finish_reason="stop"),
                                                           "")
    assert "reasoning_content" not in whole["message"] and "reasoning" not in whole["message"]
    assert whole["message"]["content"] == CALL and whole["finish_reason"] == "stop"
    streamed = _accumulate(_stream(_fmt(thinking, include_reasoning=False), _cuts(REPLY)))
    assert streamed["reasoning_content"] == "" and streamed["content"] == CALL

    # a named tool_choice: calls to other tools are dropped
    named = ParserOptions("v4", thinking=True, tool_names=frozenset(["get_time"]))
    whole = _fmt(named).choice(0, CompletionOutput(0, REPLY, [1], finish_reason="stop"), "")
    assert "tool_calls" not in whole["message"] and whole["finish_reason"] == "stop"

    # no parser: the text is the content as written
    whole = _fmt(None).choice(0, CompletionOutput(0, REPLY, [1], finish_reason="stop"), "")
    assert whole["message"] == {"role": "assistant", "content": REPLY}

    # n = 2: one parser per choice, interleaved
    other = "Short thought.</think>Plain answer."
    fmt = _fmt(ParserOptions("v4", thinking=True), n=2)
    a, b = _cuts(REPLY, 0), _cuts(other, 1, step=3)
    chunks = _stream(fmt, [o for pair in zip(a, b) for o in pair] + a[len(b):] + b[len(a):], n=2)
    first, second = _accumulate(chunks, 0), _accumulate(chunks, 1)
    assert first["finish_reason"] == "tool_calls" and len(first["tool_calls"]) == 1
    assert (second["reasoning"], second["content"], second["finish_reason"]) == ("Short thought.", "Plain answer.",
                                                                                 "stop")


def test_reply_parsers_defaults_and_checks() -> None:
    assert ReplyParsers.create("v41") == ReplyParsers("v41", "v41")  # on for DeepSeek's encoder
    assert ReplyParsers.create(None) == ReplyParsers(None, None)  # a chat template: off unless asked for
    assert ReplyParsers.create(None, "deepseek_v4", "deepseek_v4") == ReplyParsers("v4", "v4")
    assert ReplyParsers.create("v4", tool_call_parser="none") == ReplyParsers("v4", None)
    with pytest.raises(ValueError, match="needs --reasoning-parser"):
        ReplyParsers.create("v4", reasoning_parser="none")


def test_tool_choice_checks() -> None:
    def use(**kw: Any) -> Any:
        return ChatCompletionRequest(messages=ASK, **kw).tool_use()

    assert use(tools=TOOLS).parse and use(tools=TOOLS).names == {"get_weather", "get_time"}
    assert not use(tools=TOOLS, tool_choice="none").parse
    assert use(tools=TOOLS, tool_choice="required").parse
    assert use(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}).names == {"get_time"}
    assert not use().parse
    for kw in ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"tools": TOOLS, "tool_choice": "sometimes"}, {"tool_choice": "required"}):
        with pytest.raises(APIError) as info:
            use(**kw)
        assert info.value.param == "tool_choice"


# ---- end to end ---------------------------------------------------------------------------------------------------

def _raw_completion(server: Server, tokens: list[int], max_tokens: int) -> tuple[str, str]:
    """The text and finish_reason of the same greedy request sent as token ids to /v1/completions."""
    full = server.client().completions.create(model=server.model_dir, prompt=tokens, max_tokens=max_tokens, **GREEDY)
    return full.choices[0].text, full.choices[0].finish_reason


def test_chat_equals_the_parse_of_the_same_completion(server: Server) -> None:
    """Thinking on (the default) and off: the chat response is the reply parser's reading of the raw text that the
    same prompt gives on /v1/completions."""
    client = server.client()
    for kwargs, thinking in [({}, True), ({"chat_template_kwargs": {"thinking": False}}, False)]:
        extra = {**GREEDY["extra_body"], **kwargs}
        resp = client.chat.completions.create(model=server.model_dir, messages=ASK, max_tokens=12, temperature=0,
                                              extra_body=extra)
        tokens = _tokenize(server, messages=ASK, **kwargs)["tokens"]
        assert resp.usage.prompt_tokens == len(tokens)
        text, reason = _raw_completion(server, tokens, 12)
        expected = parse_chat_output(text, ParserOptions("v4", thinking, parse_tool_calls=False))
        message = resp.choices[0].message
        extra_fields = message.model_extra or {}
        assert extra_fields.get("reasoning_content") == extra_fields.get("reasoning") == expected.reasoning
        assert message.content == expected.content and resp.choices[0].finish_reason == reason
        if not thinking and not text.startswith(V4.think_start):
            assert "reasoning_content" not in extra_fields

    resp = client.chat.completions.create(model=server.model_dir, messages=ASK, max_tokens=4,
                                          extra_body={"include_reasoning": False, "ignore_eos": True})
    assert "reasoning_content" not in (resp.choices[0].message.model_extra or {})


def test_chat_with_tools_streaming_and_not(server: Server) -> None:
    client = server.client()
    kw = dict(model=server.model_dir, messages=LOOP, tools=TOOLS, max_tokens=6, **GREEDY)
    full = client.chat.completions.create(**kw)
    assert full.usage.prompt_tokens == len(_ids(server, encode_chat(LOOP, "v4", tools=TOOLS)))
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.message.tool_calls is not None) == (choice.finish_reason == "tool_calls")

    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (reasoning or None, content or None, finish) == (
        (choice.message.model_extra or {}).get("reasoning_content"), choice.message.content, choice.finish_reason)


@pytest.mark.parametrize("kwargs,param", [
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # V4 knows high and max
    ({"reasoning_effort": "none", "extra_body": {"chat_template_kwargs": {"thinking": True}}}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"thinking": "yes"}}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"date": "today"}}}, "chat_template_kwargs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"messages": [{"role": "tool", "content": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": "get_weather"}, {"role": "user", "content": "hi"}]},
     "messages"),
])
def test_bad_chat_options_are_400s_naming_the_field(server: Server, kwargs: dict[str, Any], param: str) -> None:
    request = {"model": server.model_dir, "messages": ASK, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**request)
    assert info.value.response.json()["error"]["param"] == param


def test_effort_none_turns_thinking_off(server: Server) -> None:
    off = _tokenize(server, messages=ASK, reasoning_effort="none")["tokens"]
    assert server.tok.decode(off[-1:], skip_special_tokens=False) == V4.think_end


# ---- structured outputs over HTTP ------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "temp", "sunny"], "additionalProperties": False}


def _valid(text: str) -> bool:
    """`text` parses as JSON and satisfies SCHEMA (checked by hand: no jsonschema dependency)."""
    value = json.loads(text)
    return (set(value) == {"city", "temp", "sunny"} and value["city"] in ("Paris", "Rome", "Oslo")
            and isinstance(value["temp"], int) and not isinstance(value["temp"], bool) and -40 <= value["temp"] <= 50
            and isinstance(value["sunny"], bool))


def test_response_format_json_schema_always_validates(server: Server) -> None:
    """A random-weight model under response_format json_schema: every reply, greedy and sampled, streamed and not,
    parses and validates, ends with "stop", and is the content (thinking is turned off for a structured reply, so
    no reasoning)."""
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    out = client.chat.completions.create(model=server.model_dir, messages=ASK, max_tokens=64, temperature=1.0, seed=3,
                                         n=3, response_format=fmt)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and _valid(choice.message.content), choice
        assert getattr(choice.message, "reasoning_content", None) is None
    stream = client.chat.completions.create(model=server.model_dir, messages=ASK, max_tokens=64, temperature=0,
                                            response_format=fmt, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _valid(text) and chunks[-1].choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=server.model_dir, messages=ASK, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object"},
                                         logit_bias={str(t): 30.0 for t in _tokenize(server, prompt="}")["tokens"]})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)  # (the bias closes the object at once)


def test_structured_outputs_on_completions(server: Server) -> None:
    """vLLM's `structured_outputs` on /v1/completions: a choice and a regex."""
    client = server.client()
    choices = ["yes", "no", "maybe later"]
    out = client.completions.create(model=server.model_dir, prompt="Answer:", max_tokens=16, temperature=1.0, seed=1, n=4,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=server.model_dir, prompt="Code:", max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}})
    import re

    assert re.fullmatch(r"[a-z]{3}-\d{2}", out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, None),  # refused when the engine compiles it
    ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"thinking": True}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "reasoning_effort": "max"}, "response_format"),
])
def test_bad_structured_requests_are_400s(server: Server, body: dict[str, Any], param: str | None) -> None:
    status, reply = _post(server, "/v1/chat/completions",
                          json.dumps({"model": server.model_dir, "messages": ASK, "max_tokens": 8, **body}).encode(), AUTH)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param or param is None, error
