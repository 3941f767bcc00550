"""Structured outputs through xgrammar (dsv4.structured) on the random-weight tiny-v4 model and its byte-level BPE
tokenizer, which spells any text: whatever the model prefers, the output must follow the JSON schema, regex,
choice or grammar; free requests batched with constrained ones must sample exactly what they sample alone; async
scheduling must give the tokens the synchronous engine gives; a bad spec fails its own request only; the server's
engine compiles grammars off its engine thread, so a slow compile stalls no other request."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from dsv4 import LLM, SamplingParams, StructuredOutputsParams
from dsv4.engine.async_engine import AsyncLLMEngine
from dsv4.engine.engine import LLMEngine, RequestError
from dsv4.make_model import make_model
from dsv4.outputs import RequestOutput
from dsv4.structured import GrammarCompiler

pytest.importorskip("xgrammar")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, my name is", "The weather today", "JSON:", "Once upon a time"]
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                   block_size=16, seed=0)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny-v4")), seed=0)


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    return LLM(model=path, **ENGINE_ARGS)


def _validate(obj: Any) -> None:
    """SCHEMA, checked by hand (no jsonschema dependency)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "color", "tags"}, obj
    assert isinstance(obj["name"], str) and re.fullmatch(r"[a-z]{1,8}", obj["name"]), obj
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120, obj
    assert obj["color"] in ("red", "green", "blue"), obj
    tags = obj["tags"]
    assert isinstance(tags, list) and 1 <= len(tags) <= 3, obj
    assert all(isinstance(t, str) and re.fullmatch(r"[a-z]{1,5}", t) for t in tags), obj


def _constrained(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_json_schema_outputs_parse_and_validate(llm: LLM) -> None:
    so = _constrained(json=SCHEMA, disable_any_whitespace=True)
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so) for s in range(4)]
    outs = llm.generate(PROMPTS + PROMPTS, [greedy] * 4 + seeded)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        _validate(json.loads(c.text))
    assert len({o.outputs[0].text for o in outs}) > 1  # the model still chooses within the schema


def test_json_schema_as_text_and_json_object(llm: LLM) -> None:
    # Left alone, this model fills a free-form object's strings with random text longer than any max_tokens: a
    # bias towards '"' and '}' closes them early, and the grammar keeps the biased tokens where JSON allows them
    tok = llm.tokenizer
    bias = {tok.token_to_id('"'): 6.0, tok.token_to_id("}"): 3.0}
    object_params = [SamplingParams(temperature=t, seed=1, max_tokens=60, logit_bias=bias,
                                    structured_outputs=_constrained(json_object=True, disable_any_whitespace=True))
                     for t in (0.0, 1.0)]
    outs = llm.generate(PROMPTS[:3], [
        SamplingParams(temperature=0, max_tokens=80,
                       structured_outputs=_constrained(json=json.dumps(SCHEMA), disable_any_whitespace=True)),
        *object_params])
    _validate(json.loads(outs[0].outputs[0].text))
    for out in outs[1:]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert isinstance(json.loads(out.outputs[0].text), dict)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    choices = ["yes", 'no "way"', "new\nline", "ünï"]
    cases = [(_constrained(regex=r"[a-z]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
             (_constrained(choice=choices), lambda t: t in choices),
             (_constrained(grammar='root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3})* ")"'),
              lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t))]
    for so, ok in cases:
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)]
        params += [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so) for s in range(3)]
        for out in llm.generate(PROMPTS, params):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_free_requests_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)]
    alone = llm.generate(PROMPTS[:2], free)
    constrained = [SamplingParams(temperature=0, max_tokens=100,
                                  structured_outputs=_constrained(json=SCHEMA, disable_any_whitespace=True)),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=100,
                                  structured_outputs=_constrained(regex=r"[a-z]{3}-\d{2}"))]
    mixed = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                         [constrained[0], free[0], constrained[1], free[1]])
    assert _tokens([mixed[1], mixed[3]]) == _tokens(alone)
    for a, m in zip(alone[1].outputs[0].logprobs, mixed[3].outputs[0].logprobs):  # batch size moves the last bits
        assert a.keys() == m.keys() and all(abs(a[t].logprob - m[t].logprob) < 1e-4 for t in a)
    _validate(json.loads(mixed[0].outputs[0].text))
    assert re.fullmatch(r"[a-z]{3}-\d{2}", mixed[2].outputs[0].text)
    # and the constrained ones sample as they do alone
    assert _tokens(llm.generate([PROMPTS[2], PROMPTS[3]], constrained)) == _tokens([mixed[0], mixed[2]])


def _run_engine(path: str, async_scheduling: bool, requests: list[tuple[str, SamplingParams]],
                **kw: Any) -> tuple[dict[str, list[int]], LLMEngine]:
    args = {**ENGINE_ARGS, **kw}
    eng = LLMEngine.from_args(path, async_scheduling=async_scheduling, **args)
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(prompt, sp, request_id=str(i))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done, eng


def test_async_scheduling_and_preemption_give_the_sync_tokens(path: str) -> None:
    """The grammar advances on every token before the next mask is built, with steps launched ahead (async) and
    with requests preempted and resumed (a tiny KV pool): the matcher of a resumed request is rebuilt from its
    outputs."""
    json_so = _constrained(json=SCHEMA, disable_any_whitespace=True)
    requests = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=80, structured_outputs=json_so)),
                (PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
                (PROMPTS[2], SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=json_so)),
                (PROMPTS[3], SamplingParams(temperature=0.8, seed=9, max_tokens=40,
                                            structured_outputs=_constrained(regex=r"[a-z]{3}-\d{2}")))]
    sync, _ = _run_engine(path, False, requests)
    asynced, eng = _run_engine(path, True, requests, num_kv_blocks=6, max_num_batched_tokens=16)
    assert eng.scheduler.num_preemptions > 0  # the pool really is too small
    assert asynced == sync
    tok = eng.tokenizer
    _validate(json.loads(tok.decode(sync["0"])))
    _validate(json.loads(tok.decode(sync["2"])))
    assert re.fullmatch(r"[a-z]{3}-\d{2}", tok.decode(sync["3"]))
    eng.step()
    assert eng.runner.req_state.num_active == 0 and not eng.runner.grammars._matchers  # no matcher leaks
    assert eng.grammar_compiler.num_held == 0  # finished requests released their grammars


def test_bad_spec_fails_alone(llm: LLM) -> None:
    eng = llm.engine
    good = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40,
                                                      structured_outputs=_constrained(choice=["a", "b"])))
    bad = [(_constrained(json={"type": "foo"}), "invalid JSON schema: Unsupported type"),
           (_constrained(json='{"type": '), "invalid JSON schema"),
           (_constrained(regex="[a-"), "invalid regex"),
           (_constrained(grammar="root ::= foo"), 'invalid grammar: .*Rule "foo" is not defined')]
    for so, msg in bad:
        with pytest.raises(RequestError, match=msg):
            eng.add_request(PROMPTS[1], SamplingParams(max_tokens=8, structured_outputs=so))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(done) == [good] and done[good].outputs[0].text in ("a", "b")
    aborted = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=8, structured_outputs=_constrained(regex="x+")))
    assert eng.grammar_compiler.num_held == 1
    eng.abort_request([aborted])
    assert eng.grammar_compiler.num_held == 0  # an aborted request releases its grammar too


def test_params_shape_errors() -> None:
    for kw, msg in [({}, "exactly one .* got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                    ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty"),
                    ({"json": 3}, "JSON schema"), ({"regex": ""}, "non-empty string"),
                    ({"json_object": False}, "got none")]:
        with pytest.raises(ValueError, match=msg):
            StructuredOutputsParams(**kw)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_max_tokens_cut_is_length_not_valid(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=6, structured_outputs=_constrained(json=SCHEMA, disable_any_whitespace=True)))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_grammar_end_wins_over_ignore_eos_and_min_tokens(llm: LLM) -> None:
    """The grammar allows only EOS once `[a-z]{3}` is complete: min_tokens' EOS ban would leave nothing to sample,
    and ignore_eos would run past the grammar's end; the request stops there instead."""
    so = _constrained(regex="[a-z]{3}")
    for sp in (SamplingParams(temperature=0, max_tokens=30, min_tokens=10, structured_outputs=so),
               SamplingParams(temperature=1.0, seed=2, max_tokens=30, ignore_eos=True, structured_outputs=so)):
        c = llm.generate(PROMPTS[0], sp)[0].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{3}", c.text), c.text


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    """As vLLM's raw logprobs: computed from the logits the sampler sees, after the grammar's mask."""
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, logprobs=12,
                                                structured_outputs=_constrained(regex="[0-9]")))[0].outputs[0]
    first = c.logprobs[0]
    digits = {tid for tid, lp in first.items() if lp.decoded_token in "0123456789" and lp.logprob > float("-inf")}
    assert len(digits) == 10  # the ten one-digit tokens, and nothing else, carry the probability
    assert abs(sum(2.718281828459045 ** first[t].logprob for t in digits) - 1.0) < 1e-4
    assert all(lp.logprob == float("-inf") for t, lp in first.items() if t not in digits)


def test_compiler_caches_and_needs_xgrammar(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = GrammarCompiler(llm.tokenizer, 512, [1], cache_size=2)
    a, b, c = (_constrained(regex=r) for r in ("a+", "b+", "c+"))
    ga = compiler.compile(a)
    assert compiler.compile(_constrained(regex="a+")) is ga  # equal specs share one grammar
    compiler.compile(b)
    compiler.compile(c)  # evicts a, the least recently used
    assert compiler.compile(a) is not ga
    # without xgrammar, a constrained request fails alone with the install hint
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(llm.engine, "grammar_compiler", GrammarCompiler(llm.tokenizer, 512, [1]))
    with pytest.raises(ValueError, match=re.escape("pip install 'dsv4[structured]'")):
        llm.engine.add_request(PROMPTS[0], SamplingParams(structured_outputs=_constrained(regex="x")))
    assert not llm.engine.has_unfinished_requests()


# ---- compiling off the engine thread (the server's path) -----------------------------------------------------------

def test_compiler_shares_concurrent_compiles_and_holds_grammars(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads asking for one spec at once get one compile; a held grammar outlives the LRU until released."""
    compiler = GrammarCompiler(llm.tokenizer, 512, [1], cache_size=1)
    calls: list[str] = []
    started, release = threading.Event(), threading.Event()
    real = compiler._compile

    def slow(*key: Any) -> Any:
        calls.append(key[1])
        started.set()
        assert release.wait(30)
        return real(*key)

    monkeypatch.setattr(compiler, "_compile", slow)
    a = _constrained(regex="a+")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(compiler.compile, a)
        assert started.wait(30)
        second = pool.submit(compiler.compile, _constrained(regex="a+"))
        time.sleep(0.2)  # the second caller is waiting on the first one's compile, not compiling
        release.set()
        assert first.result() is second.result()
    assert calls == ["a+"]

    key = compiler.hold(a, first.result())
    compiler.compile(_constrained(regex="b+"))  # evicts a from the one-entry LRU, but a is held
    assert compiler.compile(a) is first.result() and calls == ["a+", "b+"]
    compiler.release(key)
    assert compiler.num_held == 0
    compiler.compile(_constrained(regex="c+"))
    compiler.compile(a)  # released and evicted: compiled again
    assert calls == ["a+", "b+", "c+", "a+"]


def test_server_engine_compiles_grammars_off_the_engine_thread(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLMEngine (the server's engine) compiles a structured request's grammar in its pool: while that compile
    hangs, a running free request keeps stepping (it would stall if the engine thread compiled); once it lands, the
    request runs to a valid output. A bad spec fails its own add_request with the compiler's message, nothing else;
    every grammar a request held is released when it ends."""
    engine = AsyncLLMEngine.from_args(path, **ENGINE_ARGS)
    compiler = engine.engine.grammar_compiler
    assert compiler is not None
    started, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real = compiler._compile

    def slow(*key: Any) -> Any:
        threads.append(threading.current_thread().name)
        if key[0] == "regex":  # the valid spec hangs until the test has seen the free request step on
            started.set()
            assert release.wait(60)
        return real(*key)

    monkeypatch.setattr(compiler, "_compile", slow)
    engine.start()
    free_tokens: list[int] = []

    async def free() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for out in engine.generate(PROMPTS[1], params, "free"):
            free_tokens.append(len(out.outputs[0].token_ids))

    async def until(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def main() -> str:
        running = asyncio.ensure_future(free())
        await until(lambda: free_tokens, "the free request never started")
        constrained = asyncio.ensure_future(_last(engine.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, structured_outputs=_constrained(
                regex=r"[a-z]{3}-\d{2}")), "constrained")))
        await until(started.is_set, "the compile never started")
        seen = free_tokens[-1]
        await until(lambda: free_tokens[-1] >= seen + 5, "the free request stalled while a grammar compiled")
        assert not constrained.done()
        release.set()
        text = (await constrained).outputs[0].text
        with pytest.raises(RequestError, match="structured outputs: invalid JSON schema: Unsupported type"):
            await engine.add_request(PROMPTS[2], SamplingParams(structured_outputs=_constrained(json={"type": "foo"})),
                                     "bad")
        await running
        return text

    try:
        text = asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()
    assert re.fullmatch(r"[a-z]{3}-\d{2}", text), text
    assert free_tokens[-1] == 200 and threads and all(t.startswith("dsv4-grammars") for t in threads), threads
    assert "bad" not in engine.engine.requests and compiler.num_held == 0


async def _last(outputs: Any) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    assert last is not None
    return last


@pytest.mark.parametrize("spec", [pytest.param({"method": "dspark"}, marks=pytest.mark.slow),
                                  {"method": "dspark", "verify_decode": True}], ids=["eager", "verify_decode"])
def test_speculation_beside_constrained_requests(spec: dict[str, Any]) -> None:
    """The built-in model with its trained DSpark drafter: constrained requests draft nothing, free ones beside them
    draft and get drafts accepted, and every greedy output is the one without speculation; the constrained outputs
    follow their grammars. With verify_decode a constrained row verifies k placeholder drafts that are always
    rejected (its one real row is its anchor's), so the batch stays a uniform multi-row decode."""
    from dsv4.make_model import default_model_dir

    model = default_model_dir()
    json_so = _constrained(json=SCHEMA, disable_any_whitespace=True)
    requests = [("def __init__(self", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                ("Person:", SamplingParams(temperature=0, max_tokens=80, structured_outputs=json_so)),
                ("import os\nimport sys\n", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                ("Code:", SamplingParams(temperature=0.8, seed=9, max_tokens=40,
                                         structured_outputs=_constrained(regex=r"[a-z]{3}-\d{2}")))]
    args = dict(ENGINE_ARGS, max_num_batched_tokens=256)
    plain, _ = _run_engine(model, False, requests, **args)
    got, eng = _run_engine(model, False, requests, speculative_config=spec, **args)
    assert {k: got[k] for k in "012"} == {k: plain[k] for k in "012"}
    _validate(json.loads(eng.tokenizer.decode(got["1"])))
    assert re.fullmatch(r"[a-z]{3}-\d{2}", eng.tokenizer.decode(got["3"]))
    st = eng.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # the free requests' drafts (the constrained: none)
    vd = eng.runner.speculator.verify_decode
    if vd is not None:  # every step with drafts a decode-row step, the constrained rows' placeholders included
        assert vd.num_decode_steps > 0 and vd.num_eager_steps == 0
