"""`dsv4 bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

Requests go to /v1/completions with streaming and `stream_options.include_usage` (the server's usage gives exact
token counts). The dataset is vLLM's `random`: prompts of `--random-input-len` random token ids (sent as ids, so
the length is exact) when a tokenizer is at hand, else random words. Definitions, as in `vllm bench serve`:
TTFT = time from sending a request to its first streamed chunk; TPOT = per request (E2EL - TTFT) /
(output tokens - 1), then averaged; ITL = every gap between streamed chunks, pooled over requests; E2EL = time
from sending to the last chunk. Throughputs divide by the benchmark's wall-clock duration. Tokens/s per user = per
request (output tokens - 1) / (E2EL - TTFT), the rate one stream sees after its first token.

Speculative decoding (a server whose /metrics carries vLLM's `vllm:spec_decode_*` counters, as `dsv4 serve
--speculative-config` does): the counters are read before and after the timed requests, and their differences give
the run's drafts, draft tokens, accepted tokens, acceptance rate (accepted / draft tokens), acceptance length
(1 + accepted / drafts: tokens a verify step emits per request) and per-position acceptance (accepted at position
i / drafts). A server without them (or whose /metrics cannot be read) reports `spec_decode: null`.

The HTTP client is a few lines of asyncio (HTTP/1.1, chunked transfer): no dependency beyond the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# Filler vocabulary for prompts when no tokenizer is available (roughly one token per word).
_WORDS = ("the of and to in is was for on that with as by at from his her which or are an be this had not but "
          "they have one you were all there their we can been has more when will would who so no time if out up "
          "about into than them only other new some could these two may first then do any like my now over such "
          "our man me even most made after also did many before must through back years where much your way well "
          "down should because each just those people how too little state good very make world still own see "
          "men work long get here between both life being under never day same another know while last might us "
          "great old year off come since against go came right used take three").split()

METRICS = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 bench serve` (vLLM's names)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default %(default)s)")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions path (default %(default)s)")
    parser.add_argument("--model", help="model name to request (default: the server's first model)")
    parser.add_argument("--tokenizer", help="checkpoint directory whose tokenizer draws the random prompts "
                                            "(default: --model or the served model name, if a directory)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--random-output-len", type=int, default=128, help="output tokens (default 128)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths are uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight (default: unbounded)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="dataset and arrival seed (default 0)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly the output length (default on)")
    parser.add_argument("--save-result", metavar="FILE", help="write every metric and per-request data as JSON")


@dataclass
class RequestResult:
    """What one request measured."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


# ---- a minimal streaming HTTP client -------------------------------------------------------------------------

class HTTPStatusError(Exception):
    """A non-200 answer; the message holds the status and the body."""


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while (size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16)) > 0:
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def post_sse(url: str, payload: dict[str, Any], api_key: str | None) -> AsyncIterator[str]:
    """POST `payload` as JSON and yield the `data:` fields of the SSE answer as they arrive."""
    u = urllib.parse.urlsplit(url)
    secure = u.scheme == "https"
    reader, writer = await asyncio.open_connection(u.hostname, u.port or (443 if secure else 80),
                                                   ssl=ssl.create_default_context() if secure else None,
                                                   limit=1 << 22)
    try:
        body = json.dumps(payload).encode()
        head = [f"POST {u.path or '/'}{'?' + u.query if u.query else ''} HTTP/1.1", f"Host: {u.netloc}",
                "Content-Type: application/json", f"Content-Length: {len(body)}", "Accept: text/event-stream",
                "Connection: close"]
        if api_key:
            head.append(f"Authorization: Bearer {api_key}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        if status != 200:
            text = b"".join([c async for c in _body(reader, headers)]).decode(errors="replace")
            raise HTTPStatusError(f"HTTP {status}: {text}")
        buf = b""
        async for data in _body(reader, headers):
            buf += data
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                if raw.startswith(b"data:"):
                    yield raw[5:].strip().decode()
    finally:
        writer.close()


def _get_json(url: str, api_key: str | None) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


# ---- speculative decoding counters (/metrics) ------------------------------------------------------------------

_SPEC_PREFIX = "vllm:spec_decode_"
_SPEC_SAMPLE = re.compile(r'^(vllm:spec_decode_\w+?)(?:\{([^}]*)\})?\s+(\S+)\s*$', re.M)


def parse_spec_counters(text: str) -> dict[str, Any] | None:
    """vLLM's speculative-decoding counters in a Prometheus text page, summed over label sets (one per served
    model): {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": {position: n}}; None when
    the page has none."""
    names = {"num_drafts_total": "num_drafts", "num_draft_tokens_total": "num_draft_tokens",
             "num_accepted_tokens_total": "num_accepted_tokens"}
    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for m in _SPEC_SAMPLE.finditer(text):
        name, labels, value = m.group(1)[len(_SPEC_PREFIX):], m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos_total":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        elif name in names:
            out[names[name]] = out.get(names[name], 0.0) + value
    if len(out) < len(names):
        return None
    out["accepted_per_pos"] = per_pos
    return out


def _spec_counters(base: str, api_key: str | None) -> dict[str, Any] | None:
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return parse_spec_counters(resp.read().decode("utf-8", errors="replace"))
    except OSError:  # no /metrics (another server, or a key it refuses): nothing to report
        return None


def spec_decode_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's speculative-decoding numbers from the counters before and after it (None without counters)."""
    if before is None or after is None:
        return None
    drafts = int(after["num_drafts"] - before["num_drafts"])
    draft_tokens = int(after["num_draft_tokens"] - before["num_draft_tokens"])
    accepted = int(after["num_accepted_tokens"] - before["num_accepted_tokens"])
    per_pos = [int(after["accepted_per_pos"].get(p, 0) - before["accepted_per_pos"].get(p, 0))
               for p in sorted(after["accepted_per_pos"])]
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate_per_pos": [n / drafts if drafts else 0.0 for n in per_pos]}


# ---- the benchmark ---------------------------------------------------------------------------------------------

def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   tokenizer_dir: str | None, words_per_token: float = 1.0) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) pairs: random token ids (non-special) with a tokenizer, else random words
    (`words_per_token` of them per requested token)."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - range_ratio)), math.ceil(n * (1 + range_ratio))))

    vocab: list[int] | None = None
    if tokenizer_dir is not None:
        from dsv4.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(tokenizer_dir)
        special = set(tok.all_special_ids)
        vocab = [i for i in range(tok.vocab_size) if i not in special]
    out: list[tuple[str | list[int], int]] = []
    for _ in range(num):
        n_in, n_out = length(input_len), length(output_len)
        if vocab:
            prompt: str | list[int] = rng.choices(vocab, k=n_in)
        else:
            prompt = " ".join(rng.choices(_WORDS, k=max(1, round(n_in * words_per_token))))
        out.append((prompt, n_out))
    return out


async def _one(url: str, model: str, prompt: str | list[int], output_len: int, args: argparse.Namespace
               ) -> RequestResult:
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async for data in post_sse(url, payload, args.api_key):
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            if "error" in obj:
                raise HTTPStatusError(str(obj["error"].get("message", obj["error"])))
            if obj.get("choices"):
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
            if obj.get("usage"):
                res.output_tokens = obj["usage"]["completion_tokens"]
                res.prompt_len = obj["usage"]["prompt_tokens"]
        res.latency = last - start
        res.success = done and chunks > 0
        if not res.success:
            res.error = "the stream ended without [DONE]" if not done else "no tokens were streamed"
        elif res.output_tokens == 0:  # a server without usage in streams: one chunk per token
            res.output_tokens = chunks
    except Exception as e:  # one failed request is a data point, not the end of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(url: str, model: str, dataset: list[tuple[str | list[int], int]], args: argparse.Namespace
               ) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(prompt: str | list[int], output_len: int) -> RequestResult:
        async with limit if limit is not None else contextlib.nullcontext():
            return await _one(url, model, prompt, output_len, args)

    start = time.perf_counter()
    tasks = []
    for i, (prompt, output_len) in enumerate(dataset):
        if i and math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        tasks.append(asyncio.ensure_future(limited(prompt, output_len)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace, model: str,
              spec_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's result dict: counts, throughputs, mean/median/std/p90/p99 (ms) of each latency, per-request data."""
    import numpy as np  # here, not at the top: the CLI imports this module for its options

    ok = [r for r in results if r.success]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": args.base_url,
        "endpoint": args.endpoint, "model_id": model, "num_prompts": len(results),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "duration": duration, "completed": len(ok),
        "failed": len(results) - len(ok), "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    per_user = [(r.output_tokens - 1) / (r.latency - r.ttft) for r in ok if r.output_tokens > 1 and r.latency > r.ttft]
    out.update({"mean_output_tokens_per_s_per_user": float(np.mean(per_user)) if per_user else 0.0,
                "median_output_tokens_per_s_per_user": float(np.median(per_user)) if per_user else 0.0,
                "spec_decode": spec_decode})
    for name in METRICS:
        ms = np.asarray(values[name] or [0.0]) * 1000
        out.update({f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                    f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
                    f"p99_{name}_ms": float(np.percentile(ms, 99))})
    out.update({"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                "errors": [r.error for r in results]})
    return out


def print_result(res: dict[str, Any]) -> None:
    """The table `vllm bench serve` prints."""
    def row(label: str, value: Any) -> None:
        print(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", res["max_concurrency"] or "unbounded")
    row("Request rate configured (RPS):", res["request_rate"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for name in METRICS:
        print("{s:{c}^{n}}".format(s=_TITLES[name], n=50, c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms):",
                res[f"{stat}_{name}_ms"])
    print("{s:{c}^{n}}".format(s="Per user", n=50, c="-"))
    row("Mean output tokens/s per user:", res["mean_output_tokens_per_s_per_user"])
    row("Median output tokens/s per user:", res["median_output_tokens_per_s_per_user"])
    sd = res.get("spec_decode")
    if sd is not None:
        print("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        row("Acceptance rate (%):", 100.0 * sd["acceptance_rate"])
        row("Acceptance length:", sd["acceptance_length"])
        row("Drafts:", sd["num_drafts"])
        row("Draft tokens:", sd["num_draft_tokens"])
        row("Accepted tokens:", sd["num_accepted_tokens"])
        print("Per-position acceptance (%): " + ", ".join(f"{100 * r:.1f}" for r in sd["acceptance_rate_per_pos"]))
    print("=" * 50)
    if res["failed"]:
        first = next(e for e in res["errors"] if e)
        print(f"first error: {first}")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`; print the table, save the JSON if asked, return the result."""
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    base = args.base_url.rstrip("/")
    try:
        model = args.model or _get_json(f"{base}/v1/models", args.api_key)["data"][0]["id"]
    except OSError as e:
        raise ValueError(f"cannot reach the server at {base}: {e}") from None
    tokenizer_dir = next((d for d in (args.tokenizer, args.model, model)
                          if d and os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
    dataset = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.seed, tokenizer_dir)
    url = base + args.endpoint
    # One request first, as vLLM does: a misconfigured run fails in seconds, with the server's message.
    probe = asyncio.run(_one(url, model, dataset[0][0], min(dataset[0][1], 4), args))
    if not probe.success:
        raise ValueError(f"the test request failed: {probe.error}")
    if tokenizer_dir is None and probe.prompt_len:
        # No tokenizer: the probe's usage says how many tokens a word makes, so prompts land near the asked length.
        scale = len(str(dataset[0][0]).split()) / probe.prompt_len
        dataset = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.seed, None, words_per_token=scale)
        print(f"no tokenizer given: random words, {1 / scale:.2f} tokens per word on this server")
    print(f"benchmarking {model} at {url}: {args.num_prompts} prompts, {args.random_input_len} in / "
          f"{args.random_output_len} out, rate {args.request_rate}, concurrency {args.max_concurrency or 'inf'}")
    before = _spec_counters(base, args.api_key)
    results, duration = asyncio.run(_run(url, model, dataset, args))
    res = summarize(results, duration, args, model, spec_decode_delta(before, _spec_counters(base, args.api_key)))
    print_result(res)
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
        print(f"saved {args.save_result}")
    return res
