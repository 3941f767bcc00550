"""Issue 19's acceptance test: a bounded load test of the real server on loopback. Good requests (completions and
chat, streamed or not), bad ones, huge bodies, a fan-out request and clients that leave mid-request all arrive at
once at a server with a small KV pool. It must end with every good request answered as it is when sent alone
(greedy), every bad one refused with the OpenAI error body, and the server idle: nothing running or waiting, no KV
block held, no traceback in its log.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_server import KEY, MAX_MODEL_LEN, PROMPT, Server, _metrics, _raw_status, serve_process

from dsv4.make_model import make_model

# 16 usable blocks of 16 tokens: room for one request of the whole context (256 tokens), not for the load at its
# peak, so requests queue and get preempted
NUM_KV_BLOCKS = 17
BODY_LIMIT_MB = 1
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
NUM_DISCONNECTS = 6  # 4 leave after their first streamed token, 2 while waiting for a whole answer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve-load")
    # One torch thread: the tiny model gains nothing from two, and two spin against any other load on the machine
    # (this test took 53 s instead of 3 s next to another test run on two cores).
    with serve_process(make_model("tiny-v4", str(tmp / "tiny"), seed=0), tmp, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                       "--max-request-body-mb", str(BODY_LIMIT_MB), env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def _good_requests() -> list[tuple[str, dict[str, Any]]]:
    """16 greedy requests of fixed lengths: completions and chat, streamed and not; then the fan-out one."""
    out = []
    for i in range(16):
        greedy = {"max_tokens": 4 + 3 * (i % 5), "temperature": 0, "ignore_eos": True, "stream": i % 4 >= 2}
        if i % 2:
            out.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Fox number {i}?"}],
                                                 **greedy}))
        else:
            out.append(("/v1/completions", {"prompt": f"{PROMPT} {i}", **greedy}))
    out.append(("/v1/completions", {"prompt": PROMPT, "n": 16, "max_tokens": 6, "temperature": 0,
                                    "ignore_eos": True}))
    return out


def _answer(server: Server, path: str, body: dict[str, Any]) -> list[str]:
    """The texts of the choices (by index), streamed or not; every choice must end by its length."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=AUTH, method="POST")
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    with urllib.request.urlopen(req, timeout=60) as resp:
        if body.get("stream"):
            chunks = [json.loads(line[len(b"data: "):]) for line in resp
                      if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
        else:
            chunks = [json.load(resp)]
    for chunk in chunks:
        for c in chunk["choices"]:
            i = c["index"]
            message = c.get("message") or c.get("delta") or {}  # a chat reply is reasoning, then content
            piece = c.get("text") or (message.get("reasoning_content") or "") + (message.get("content") or "")
            texts[i] = texts.get(i, "") + piece
            finish[i] = c.get("finish_reason") or finish.get(i)
    assert set(finish.values()) == {"length"}, finish
    return [texts[i] for i in sorted(texts)]


BAD_REQUESTS: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": 2}'),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": {MAX_MODEL_LEN}}}'.encode()),
    ("/v1/completions", b'{"prompt": "x\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": {"text": "x"}, "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x", "n": "many"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": 5, "content": "hi"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
]


def _refused(server: Server, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(server.url + path, data=body, headers=AUTH, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _huge(server: Server, chunked: bool) -> int:
    """A body twice the limit, announced by Content-Length or sent chunked."""
    size = 2 * BODY_LIMIT_MB << 20
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\n{framing}\r\n\r\n").encode()
    part = b"x" * (64 << 10)
    parts = (b"%x\r\n%s\r\n" % (len(part), part) if chunked else part for _ in range(size // len(part)))
    return _raw_status(server, head, parts)


def _disconnect(server: Server, stream: bool) -> None:
    """A long request whose client leaves: after the first streamed token, or a second into a non-streamed one."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            got = b""
            while b"data:" not in got:
                more = sock.recv(4096)
                assert more, got  # closed before the first token: the request was refused
                got += more
        else:
            time.sleep(1.0)  # queued or running by now; 200 tokens take far longer under this load


def _until_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.05)


def test_mixed_load_ends_correct_and_idle(server: Server) -> None:
    """35 HTTP requests released together (17 good, 10 bad, 2 huge, 6 that leave); then the server must be idle."""
    good = _good_requests()
    alone = [_answer(server, path, body) for path, body in good]  # one at a time: the reference answers
    assert len(alone[-1]) == 16 and len(set(alone[-1])) == 1  # greedy samples of one prompt agree
    before = _until_idle(server)

    start = threading.Barrier(len(good) + len(BAD_REQUESTS) + 2 + NUM_DISCONNECTS, timeout=30)

    def together(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        def run() -> Any:
            start.wait()
            return fn(*args)
        return run

    with ThreadPoolExecutor(start.parties) as pool:
        answers = [pool.submit(together(_answer, server, path, body)) for path, body in good]
        refusals = [pool.submit(together(_refused, server, path, body)) for path, body in BAD_REQUESTS]
        huge = [pool.submit(together(_huge, server, chunked)) for chunked in (False, True)]
        gone = [pool.submit(together(_disconnect, server, i < 4)) for i in range(NUM_DISCONNECTS)]
        for f in gone:
            f.result()
        assert [f.result() for f in answers] == alone
        for f, (path, body) in zip(refusals, BAD_REQUESTS):
            status, reply = f.result()
            assert status == 400 and set(reply["error"]) == {"message", "type", "param", "code"}, (body, reply)
            assert reply["error"]["type"] == "invalid_request_error"
        assert [f.result() for f in huge] == [413, 413]

    after = _until_idle(server)
    aborted = after["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"]
    assert aborted == NUM_DISCONNECTS
    finished = after["vllm:request_success_total:length"] - before["vllm:request_success_total:length"]
    assert finished == len(good)  # (the fan-out's 16 samples are one request)
    assert after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]  # the pool was short (4-7)
    assert "Traceback" not in server.log.read_text()
