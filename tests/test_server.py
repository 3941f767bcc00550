"""The OpenAI-compatible server, end to end: a real `dsv4 serve` process on loopback, driven by the official
`openai` client (and raw HTTP where a client would hide what is checked), then `dsv4 bench serve` against it.

One server for the whole module (the tiny random model, a 256-token context, 16 sequences per batch); every
request is short, so the module stays well under two minutes on two CPU cores.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from dsv4.chat import encode_chat
from dsv4.make_model import make_model
from dsv4.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
MAX_MODEL_LEN = 256
READ_TIMEOUT = 2.0  # --request-read-timeout of the module's server
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the fox."}]
PROMPT = "The quick brown fox"


@dataclass
class Server:
    """A running `dsv4 serve` process."""

    url: str
    model_dir: str
    log: Path
    tok: Tokenizer | None

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(model_dir: str, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`dsv4 serve` (with `extra` arguments, and `env` over this process's environment) on a free loopback port until
    the block exits."""
    port, log, key_file = _free_port(), tmp / "server.log", tmp / "api-key"
    key_file.write_text(KEY + "\n")  # from a file, as a deployment keeps it out of the process list
    cmd = [sys.executable, "-m", "dsv4.cli", "serve", "--model", model_dir, "--port", str(port), "--api-key-file",
           str(key_file), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--log-level", "warning",
           *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    with open(log, "wb") as out:  # a file, not a pipe: an unread pipe would block the server
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not become healthy:\n{log.read_text()}")
            time.sleep(0.2)
        has_tok = os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
        yield Server(url, model_dir, log, Tokenizer.from_dir(model_dir) if has_tok else None)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    with serve_process(make_model("tiny-v4", str(tmp / "tiny"), seed=0), tmp, "--request-read-timeout",
                       str(READ_TIMEOUT)) as s:
        yield s


def _metrics(server: Server) -> dict[str, float]:
    """Prometheus samples by name; a `finished_reason` label is folded into the name (name:reason)."""
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([\w:]+)(\{[^}]*\})? (\S+)$', line)
        if m and "le=" not in (m.group(2) or ""):
            reason = re.search(r'finished_reason="(\w+)"', m.group(2) or "")
            out[m.group(1) + (":" + reason.group(1) if reason else "")] = float(m.group(3))
    return out


def _post(server: Server, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _chat_prompt_len(server: Server, messages: list[dict[str, str]]) -> int:
    # the built-in model has no chat template: its prompts are DeepSeek-V4's encoding
    return len(server.tok.encode(encode_chat(messages, "v4"), add_special_tokens=False))


def _parts(message: Any) -> tuple[str, str]:
    """(reasoning, content) of a message or a delta, "" for a missing one: the reasoning parser splits replies
    (thinking is on by default, so a random model's reply is mostly reasoning)."""
    return (message.model_extra or {}).get("reasoning_content") or "", message.content or ""


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# ---- the basics -----------------------------------------------------------------------------------------------

def test_models(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model_dir]
    assert models[0].max_model_len == MAX_MODEL_LEN  # vLLM's extra field


def test_completions_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    full = client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(server.tok.encode(PROMPT))
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    # token-id prompts (what benchmarks send) count exactly
    ids = server.tok.encode(PROMPT)
    by_ids = client.completions.create(model=server.model_dir, prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == full.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_chat_stream_equals_non_stream(server: Server) -> None:
    client = server.client()
    kw = dict(model=server.model_dir, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == _chat_prompt_len(server, MESSAGES)
    assert full.usage.completion_tokens == 8

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    deltas = [_parts(c.choices[0].delta) for c in with_choices]
    assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == _parts(choice.message)
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    streamed = [e.token for c in with_choices if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in choice.logprobs.content]


# ---- logprobs -----------------------------------------------------------------------------------------------

def test_chat_logprobs(server: Server) -> None:
    client = server.client()
    for temperature in (0, 1.0):  # greedy: the chosen token is the top one; sampled: it is listed if in the top 3
        resp = client.chat.completions.create(model=server.model_dir, messages=MESSAGES, max_tokens=6, seed=3,
                                              temperature=temperature, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})
        content = resp.choices[0].logprobs.content
        assert len(content) == resp.usage.completion_tokens == 6
        for entry in content:
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            top = entry.top_logprobs
            assert len(top) == 3 and all(t.logprob <= 0 for t in top)
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            if temperature == 0:
                assert entry.logprob == pytest.approx(top[0].logprob)
            if entry.logprob > top[-1].logprob:
                assert entry.token in [t.token for t in top]


def test_completions_logprobs(server: Server) -> None:
    resp = server.client().completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=6, logprobs=2,
                                              temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    offset = 0
    for token, value, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert value <= 0 and start == offset
        assert token in top and len(top) <= 3 and all(v <= 0 for v in top.values())
        offset += len(token)


# ---- sampling fields --------------------------------------------------------------------------------------------

def test_n_seed_and_max_completion_tokens(server: Server) -> None:
    client = server.client()
    kw = dict(model=server.model_dir, messages=MESSAGES, n=2, seed=1234, temperature=1.0, max_completion_tokens=5,
              extra_body={"ignore_eos": True})
    first, again = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [_parts(c.message) for c in first.choices] == [_parts(c.message) for c in again.choices]
    assert first.usage.completion_tokens == 10  # max_completion_tokens per choice
    assert all(c.finish_reason == "length" for c in first.choices)

    streamed = [("", ""), ("", "")]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning, content = _parts(c.delta)
            streamed[c.index] = (streamed[c.index][0] + reasoning, streamed[c.index][1] + content)
    assert streamed == [_parts(c.message) for c in first.choices]

    batch = client.completions.create(model=server.model_dir, prompt=[PROMPT, "Hello"], n=2, max_tokens=3,
                                      **GREEDY)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3] and batch.usage.completion_tokens == 12


def test_stop_strings(server: Server) -> None:
    client = server.client()
    base = client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=16, **GREEDY)
    text = base.choices[0].text
    starts = [i for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip()]
    if not starts:
        pytest.skip(f"the random model's text {text!r} has no usable stop string")
    stop = text[starts[len(starts) // 2]:][:2]
    expected = text[:text.find(stop)]

    cut = client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    chunks = [c for c in client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=16,
                                                   stop=stop, stream=True, **GREEDY)]
    assert "".join(c.choices[0].text for c in chunks) == expected  # a partial stop string was never streamed
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- errors -------------------------------------------------------------------------------------------------

def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_errors_are_openai_shaped_and_leave_others_alone(server: Server) -> None:
    async def run() -> None:
        client = server.async_client()
        # a streaming request in flight while the bad ones come and go
        stream = await client.completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)

        async def consume() -> int:
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        survivor = asyncio.ensure_future(consume())
        good = dict(model=server.model_dir, messages=MESSAGES, max_tokens=2)
        cases = [
            (dict(good, temperature=-1), openai.BadRequestError, "temperature"),
            (dict(good, top_p=2), openai.BadRequestError, "top_p"),
            (dict(good, messages=[{"role": "user", "content": "fox " * 300}]), openai.BadRequestError, "messages"),
            (dict(good, max_tokens=MAX_MODEL_LEN), openai.BadRequestError, "max_tokens"),
            (dict(good, model="no-such-model"), openai.NotFoundError, "model"),
        ]
        for kwargs, exc_type, param in cases:
            with pytest.raises(exc_type) as info:
                await client.chat.completions.create(**kwargs)
            assert _error(info.value)["param"] == param
        with pytest.raises(openai.AuthenticationError) as info:
            await openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert _error(info.value)["code"] == "invalid_api_key"
        assert await survivor == 12

    asyncio.run(run())
    status, body = _post(server, "/v1/completions", b'{"prompt": "x"}')  # no key at all
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(server, "/v1/completions", b"{not json", {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] is None  # not the character offset of the syntax error
    assert server.client().models.list().data  # still serving


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "us\\udfffer", "content": "hi"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}'),
    ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "ok", "\\ud800": 1}'),  # a key, at the top level
    ("/v1/chat/completions", '{"messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"content": "hi"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}], "max_tokens": 2}'),
])
def test_unencodable_or_mistyped_input_is_a_clean_400(server: Server, path: str, body: str) -> None:
    """Lone surrogates (valid JSON escapes, invalid Unicode) anywhere in a body, a role that is not a string, text
    parts that are not strings: 400 with the OpenAI error body, whose message does not echo the input; the server
    keeps serving."""
    status, reply = _post(server, path, body.encode(), {"Authorization": f"Bearer {KEY}"})
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error"
    assert "\ufffd" not in reply["error"]["message"]  # refused by name, not echoed with the bad character replaced
    assert server.client().models.list().data


def test_with_a_key_only_health_is_open(server: Server) -> None:
    """--api-key covers /metrics too and turns the API docs off; /health stays open for load balancers."""
    assert urllib.request.urlopen(server.url + "/health", timeout=10).status == 200
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + path, timeout=10)
        assert info.value.code == (401 if path == "/metrics" else 404), path
    assert "vllm:num_requests_running" in _metrics(server)


def _raw_status(server: Server, head: bytes, body_parts: Iterator[bytes] = iter(())) -> int:
    """Send a request head and then body parts over a raw socket, stopping when the server has answered or closed;
    return the status the server answered with (a server may answer before reading the body)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed while we were still sending
            pass
        reply = sock.recv(65536)
    return int(reply.split(b" ", 2)[1])


def test_key_before_body_and_a_body_limit(server: Server) -> None:
    """Without the key a request is refused from its headers (401), before its body is sent; with the key, a body
    over the limit (64 MiB by default) is a 413, by Content-Length or, chunked, once it grows past the limit; the
    server keeps serving."""
    def head(auth: bool, length: str) -> bytes:
        key = f"Authorization: Bearer {KEY}\r\n" if auth else ""
        return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{key}"
                f"{length}\r\n").encode()

    assert _raw_status(server, head(False, f"Content-Length: {200 << 20}\r\n")) == 401  # no body sent at all
    assert _raw_status(server, head(True, f"Content-Length: {65 << 20}\r\n")) == 413
    chunk = b"y" * (1 << 20)
    chunks = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(70))
    assert _raw_status(server, head(True, "Transfer-Encoding: chunked\r\n"), chunks) == 413
    assert server.client().models.list().data


def _seconds_until_dropped(server: Server, parts: list[bytes], gap: float = 0.0) -> float:
    """Connect, send `parts` `gap` seconds apart, then wait: the seconds until the server closed the connection,
    which it must do without answering."""
    host, port = server.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            for part in parts:
                sock.sendall(part)
                time.sleep(gap)
            reply = sock.recv(65536)
        except ConnectionError:  # reset: the server closed while we were still sending
            reply = b""
    assert reply == b"", reply[:200]
    return time.monotonic() - t0


def test_silent_and_half_sent_connections_are_dropped(server: Server) -> None:
    """--request-read-timeout (2 s here): a connection that sends nothing, part of its headers, its headers and half
    its body, or trickles its headers a byte at a time, is closed once the deadline passes (before, such a
    connection was kept forever); meanwhile other requests are answered, one whose body comes late but within the
    deadline is served, and a kept-alive connection idle past the deadline still serves its next request (uvicorn
    closes idle ones after 5 s)."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    cases = {"silent": ([], 0.0), "half the headers": ([head[:20]], 0.0),
             "half the body": ([head + body[:len(body) // 2]], 0.0),
             "trickled": ([head[i:i + 1] for i in range(len(head))], 0.2)}

    def late_body() -> Iterator[bytes]:
        time.sleep(READ_TIMEOUT / 2)  # the headers now, the body later, within the deadline
        yield body

    with ThreadPoolExecutor(len(cases)) as pool:
        dropped = {name: pool.submit(_seconds_until_dropped, server, *case) for name, case in cases.items()}
        t0 = time.monotonic()
        assert server.client().completions.create(model=server.model_dir, prompt=PROMPT, max_tokens=2).choices
        assert time.monotonic() - t0 < READ_TIMEOUT  # answered before the stalled connections were dropped
        assert _raw_status(server, head, late_body()) == 200
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        for pause in (READ_TIMEOUT + 0.5, 0.0):
            conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}",
                                                           "Content-Type": "application/json"})
            reply = conn.getresponse()
            assert reply.status == 200 and reply.read()
            time.sleep(pause)
        conn.close()
        seconds = {name: f.result() for name, f in dropped.items()}
    assert all(READ_TIMEOUT - 0.1 < t < READ_TIMEOUT + 3 for t in seconds.values()), seconds


def test_a_read_timeout_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4.cli import main

    for value in ("0", "-1", "nan"):
        assert main(["serve", "--request-read-timeout", value]) == 2
    assert capsys.readouterr().err.count("--request-read-timeout must be a positive number of seconds") == 3


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_a_huge_prompt_does_not_stall_the_others(server: Server) -> None:
    """Tokenizing a 10 MB chat body runs off the event loop: /health answers meanwhile (it took 7 s when the
    tokenizer ran on the loop)."""
    import threading

    body = json.dumps({"messages": [{"role": "user", "content": "fox jumps " * (1 << 20)}], "max_tokens": 2})
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(_post(server, "/v1/chat/completions", body.encode(),
                                                            {"Authorization": f"Bearer {KEY}"})[0]))
    t.start()
    time.sleep(0.5)  # the body is being tokenized
    worst = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert urllib.request.urlopen(server.url + "/health", timeout=30).status == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert result == [400]  # far over the context, refused once counted
    assert worst < 1.0, worst


def _big_png_data_url(side: int) -> str:
    """A side x side RGB PNG: a few hundred KB (gradients compress well) that decode to side^2 pixels."""
    import io

    import numpy as np
    from PIL import Image

    ramp = (np.add.outer(np.arange(side, dtype=np.uint16), np.arange(side, dtype=np.uint16)) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([ramp, ramp.T, ramp // 2], -1)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vl-serve")
    # 512: four image spans plus DeepSeek-V4.1's prompt (its reasoning-effort line in thinking mode) pass 256
    with serve_process(make_model("tiny-v41-vl", str(tmp / "tiny-v41-vl"), seed=0), tmp, "--max-model-len",
                       "512") as s:
        yield s


def test_image_decoding_stalls_no_one(vl_server: Server) -> None:
    """A request's images are decoded and preprocessed in a worker thread, neither on the event loop nor on the
    engine thread: while 4 PNGs of 4000x4000 pixels (about 0.4 s each on a CPU) are prepared, /health and short text
    completions answer promptly (on the engine thread a completion waited 1.3 s for them). An image over the pixel
    limit is a 400 naming it, refused from its header."""
    import threading

    from test_image_processor import _png_header

    auth = {"Authorization": f"Bearer {KEY}"}
    url = _big_png_data_url(4000)
    content = [{"type": "text", "text": "Compare"}] + [{"type": "image_url", "image_url": {"url": url}}] * 4
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(_post(vl_server, "/v1/chat/completions", body, auth)[0]))
    t.start()
    time.sleep(0.3)  # the body is in and the images are being decoded
    short = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    health, completion = [], []
    while t.is_alive():
        t0 = time.monotonic()
        assert urllib.request.urlopen(vl_server.url + "/health", timeout=30).status == 200
        health.append(time.monotonic() - t0)
        t0 = time.monotonic()
        assert _post(vl_server, "/v1/completions", short, auth)[0] == 200
        completion.append(time.monotonic() - t0)
    t.join()
    assert result == [200]
    assert max(health) < 0.5 and max(completion) < 0.75, (health, completion)
    assert len(completion) >= 2, "the images were decoded too fast for the test to mean anything"
    bomb = "data:image/png;base64," + base64.b64encode(_png_header(9000, 9000)).decode()
    status, reply = _post(vl_server, "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": bomb}}]}], "max_tokens": 2}).encode(), auth)
    assert status == 400 and "image 0: image too large: 9000x9000" in reply["error"]["message"], reply
    assert "Traceback" not in vl_server.log.read_text()


def test_fan_out_caps(server: Server) -> None:
    """A request of more sequences than the per-request cap (prompts x n) is a 400 before anything is tokenized or
    queued (500 prompts x n=128 queued 64,000 sequences before); a request within the caps runs."""
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = _post(server, "/v1/completions", json.dumps(
        {"prompt": ["fox"] * 500, "n": 128, "max_tokens": 2}).encode(), auth)
    assert status == 400 and "64000 sequences" in body["error"]["message"] and body["error"]["param"] == "prompt"
    status, body = _post(server, "/v1/chat/completions", json.dumps(
        {"messages": MESSAGES, "n": 100, "max_tokens": 2}).encode(), auth)
    assert status == 200  # within the caps
    assert _metrics(server)["vllm:num_requests_waiting"] == 0


def test_a_full_queue_answers_503_with_retry_after() -> None:
    """The server's capacity check against a stub engine whose waiting gauge is at the cap."""
    from types import SimpleNamespace

    from dsv4.serve import api_server
    from dsv4.serve.protocol import APIError

    gauge = SimpleNamespace(value=float(api_server.MAX_WAITING))
    srv = api_server._Server(SimpleNamespace(metrics=SimpleNamespace(waiting=gauge)), "m", None,
                             api_server.ReplyParsers(None, None))
    with pytest.raises(APIError) as info:
        srv._check_capacity(1, 1)
    assert info.value.status == 503 and info.value.headers == {"Retry-After": "1"}
    gauge.value = 0.0
    srv._check_capacity(1, 1)


def test_an_empty_api_key_is_an_error_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4.cli import main

    key_file = tmp_path / "key"
    key_file.write_text("\n")
    assert main(["serve", "--api-key", ""]) == 2
    assert main(["serve", "--api-key-file", str(key_file)]) == 2
    assert capsys.readouterr().err.count("is empty") == 2


def test_a_checkpoint_without_tokenizer_serves_token_ids(tmp_path: Path) -> None:
    """--skip-tokenizer-init (vLLM's name): token-id completions work and return token ids; text requests get a
    400 saying why; without the flag the missing file is one clear error at start-up."""
    d = make_model("tiny-v4", str(tmp_path / "notok"), seed=0)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(d, f))
    res = subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", "--model", d], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and "--skip-tokenizer-init" in res.stderr and "Traceback" not in res.stderr
    with serve_process(d, tmp_path, "--skip-tokenizer-init") as srv:
        auth = {"Authorization": f"Bearer {KEY}"}
        status, body = _post(srv, "/v1/completions", json.dumps({"model": d, "prompt": [5, 6, 7], "max_tokens": 4,
                                                                  "temperature": 0}).encode(), auth)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        status, body = _post(srv, "/v1/completions", json.dumps({"model": d, "prompt": "text"}).encode(), auth)
        assert status == 400 and "tokenizer" in body["error"]["message"]
        status, body = _post(srv, "/v1/chat/completions", json.dumps(
            {"model": d, "messages": [{"role": "user", "content": "hi"}]}).encode(), auth)
        assert status == 400 and "tokenizer" in body["error"]["message"]


# ---- load, disconnects, metrics -----------------------------------------------------------------------------

def test_32_concurrent_streams_with_metrics(server: Server) -> None:
    before = _metrics(server)
    seen: list[dict[str, float]] = []

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(model=server.model_dir, prompt=f"{PROMPT} {i}", max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY)
        text, tokens = "", -1
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return text, tokens

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            seen.append(await asyncio.to_thread(_metrics, server))
            await asyncio.sleep(0.01)

    async def run() -> list[tuple[str, int]]:
        client, done = server.async_client(), asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        results = await asyncio.gather(*(one(client, i) for i in range(32)))
        done.set()
        await watcher
        return results

    results = asyncio.run(run())
    assert [tokens for _, tokens in results] == [6] * 32
    assert max(m["vllm:num_requests_running"] for m in seen) > 0
    assert max(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] for m in seen) > 16  # they queue
    after = _metrics(server)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 32 * 6
    assert after["vllm:request_success_total:length"] - before["vllm:request_success_total:length"] == 32
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 32
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 32
    assert after["vllm:inter_token_latency_seconds_count"] > before["vllm:inter_token_latency_seconds_count"]
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert name in after

    assert not any(name.startswith("vllm:spec_decode") for name in after)  # speculation is off on this server


def _spec_samples(server: Server) -> tuple[dict[str, float], dict[int, float]]:
    """The `vllm:spec_decode_*` samples by name, and the per-position counter by its `position` label."""
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    totals, per_pos = {}, {}
    for m in re.finditer(r'^(vllm:spec_decode_\w+)\{([^}]*)\} (\S+)$', text, re.M):
        pos = re.search(r'position="(\d+)"', m.group(2))
        assert 'model_name="' in m.group(2)
        if pos:
            per_pos[int(pos.group(1))] = float(m.group(3))
        else:
            totals[m.group(1)] = float(m.group(3))
    return totals, per_pos


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_speculative_decoding_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`dsv4 serve --speculative-config` (tiny-v41's DSpark drafter): vLLM's spec_decode counters on /metrics, zero
    at start with a sample per draft position, counting the drafts of a request; the greedy text is the plain
    server's."""
    tmp = tmp_path_factory.mktemp("serve-spec")
    model = make_model("tiny-v41", str(tmp / "tiny-v41"), seed=0)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, **GREEDY}
    with serve_process(model, tmp, "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}') as s:
        totals, per_pos = _spec_samples(s)
        assert totals == {"vllm:spec_decode_num_drafts_total": 0, "vllm:spec_decode_num_draft_tokens_total": 0,
                          "vllm:spec_decode_num_accepted_tokens_total": 0}
        assert per_pos == {0: 0, 1: 0, 2: 0}
        spec_text = s.client().completions.create(**body).choices[0].text
        totals, per_pos = _spec_samples(s)
        assert 'TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter' in urllib.request.urlopen(
            urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})).read().decode()
        # `dsv4 bench serve` reports the run's part of the counters (vLLM's acceptance numbers)
        out = tmp / "bench.json"
        proc = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", s.url, "--api-key",
                               KEY, "--tokenizer", model, "--num-prompts", "3", "--random-input-len", "8",
                               "--random-output-len", "8", "--save-result", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        after, after_pos = _spec_samples(s)
    sd = json.loads(out.read_text())["spec_decode"]
    assert "Speculative Decoding" in proc.stdout and "Acceptance length:" in proc.stdout
    # the bench reads the counters after its probe request (4 tokens: at most 3 verify steps), so its report is the
    # timed requests' part of what the server counted during the bench
    run_drafts = after["vllm:spec_decode_num_drafts_total"] - totals["vllm:spec_decode_num_drafts_total"]
    assert 0 < sd["num_drafts"] <= run_drafts <= sd["num_drafts"] + 3
    run_accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - totals[
        "vllm:spec_decode_num_accepted_tokens_total"]
    assert sd["num_accepted_tokens"] <= run_accepted <= sd["num_accepted_tokens"] + 3 * 3
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"]
    assert all(0 <= sd["num_accepted_tokens_per_pos"][p] <= after_pos[p] - per_pos[p] for p in (0, 1, 2))
    assert sd["acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert sd["acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
    drafts = totals["vllm:spec_decode_num_drafts_total"]
    draft_tokens = totals["vllm:spec_decode_num_draft_tokens_total"]
    accepted = totals["vllm:spec_decode_num_accepted_tokens_total"]
    # 12 tokens: the prefill samples one, each verify step emits its accepted drafts and one more
    assert 0 < drafts <= 11 and drafts <= draft_tokens <= 3 * drafts
    assert sum(per_pos.values()) == accepted <= draft_tokens and set(per_pos) == {0, 1, 2}
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # a draft is accepted only after every draft before it
    with serve_process(model, tmp) as plain:
        assert plain.client().completions.create(**body).choices[0].text == spec_text


def _wait_idle(server: Server, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_kv(server: Server, stream: bool) -> None:
    before = _wait_idle(server)
    body = json.dumps({"model": server.model_dir, "prompt": PROMPT, "max_tokens": 200, "stream": stream,
                       "temperature": 0, "ignore_eos": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:  # leave after the first token
            got = b""
            while b"data:" not in got:
                got += sock.recv(4096)
        else:  # leave once the request is running
            deadline = time.monotonic() + 30
            while _metrics(server)["vllm:num_requests_running"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    after = _wait_idle(server, timeout=20)  # 200 tokens would take far longer than an abort
    assert after["vllm:request_success_total:abort"] == before["vllm:request_success_total:abort"] + 1
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200


# ---- the benchmark --------------------------------------------------------------------------------------------

def test_bench_serve(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", server.url, "--api-key", KEY,
           "--tokenizer", server.model_dir, "--num-prompts", "6", "--random-input-len", "12",
           "--random-output-len", "4", "--max-concurrency", "3", "--request-rate", "50", "--seed", "0",
           "--save-result", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_input_tokens"] == 6 * 12 and res["total_output_tokens"] == 6 * 4
    assert res["duration"] > 0 and res["request_throughput"] > 0
    assert res["output_throughput"] > 0 and res["total_token_throughput"] > res["output_throughput"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert res[f"{stat}_{metric}_ms"] >= 0, f"{stat}_{metric}_ms"
        assert res[f"mean_{metric}_ms"] > 0
    assert res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert len(res["ttfts"]) == len(res["itls"]) == len(res["output_lens"]) == 6
    # after the first token a stream gets (4 - 1) tokens in E2EL - TTFT: 1000 / TPOT per request
    assert res["median_output_tokens_per_s_per_user"] > 0 and "Median output tokens/s per user" in proc.stdout
    assert res["spec_decode"] is None and "Speculative Decoding" not in proc.stdout  # no speculation on this server


def test_server_log_is_clean(server: Server) -> None:
    """Everything above (errors, disconnects) was handled, not crashed through."""
    assert "Traceback" not in server.log.read_text(), server.log.read_text()[-4000:]
