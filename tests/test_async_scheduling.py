"""Async scheduling: step k+1 is scheduled and launched before step k's tokens reach the host.

The oracle is the synchronous engine: every request must end with the same tokens, finish reason, stop reason and
logprobs, through chunked prefill, preemption, stop tokens, length limits, min_tokens, seeded sampling, penalties
(which make the runner land pending tokens early) and aborts; afterwards no row or block may leak. The scheduler's
placeholder bookkeeping is checked directly on worked examples."""

from __future__ import annotations

import os
import time

import pytest
from hf_reference import build_hf_model, make_prompt, save_hf_model, tiny_config

from dsv4.config import SchedulerConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request, RequestStatus
from dsv4.engine.scheduler import Scheduler
from dsv4.kv.manager import KVCacheManager
from dsv4.kv.spec import make_kv_groups
from dsv4.models.config import load_model_config
from dsv4.outputs import RequestOutput
from dsv4.sampling_params import SamplingParams
from dsv4.step import RunnerOutput, SchedulerOutput

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                         "heavily_compressed_attention": 4}, index_topk=3)
    return save_hf_model(build_hf_model(raw), str(tmp_path_factory.mktemp("v4")))


def _run(path: str, requests: list[tuple[list[int], SamplingParams]], async_scheduling: bool,
         abort_after: dict[int, list[str]] | None = None, **kw) -> tuple[dict[str, RequestOutput], LLMEngine]:
    args = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8, load_tokenizer=False)
    args.update(kw)
    eng = LLMEngine.from_args(path, async_scheduling=async_scheduling, **args)
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(prompt, sp, request_id=str(i))
    done: dict[str, RequestOutput] = {}
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if abort_after and step in abort_after:
            eng.abort_request(abort_after[step])
    return done, eng


def _summary(out: RequestOutput) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, round(v.logprob, 5)) for t, v in lp.items())
                                              for lp in c.logprobs])
            for c in out.outputs]


def _assert_same(path: str, requests: list[tuple[list[int], SamplingParams]], **kw) -> dict[str, RequestOutput]:
    sync_done, _ = _run(path, requests, False, **kw)
    async_done, eng = _run(path, requests, True, **kw)
    assert sorted(async_done) == sorted(sync_done)
    for rid in sync_done:
        assert _summary(async_done[rid]) == _summary(sync_done[rid]), rid
    # nothing leaks: the runner dropped every row and the pools are whole again
    eng.step()
    assert eng.runner.req_state.num_active == 0 and not eng.runner._unresolved
    for pool in eng.kv_manager.pools:
        assert pool.num_free == pool.capacity
    return sync_done


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    return [make_prompt(n, seed=seed + i, vocab_size=vocab, low=3)[0].tolist() for i, n in enumerate(lengths)]


def test_greedy_mix_equals_sync(v4_ckpt: str) -> None:
    """Chunked prefills beside decodes, different lengths, a request that reaches max_model_len."""
    p = _prompts(256, (5, 30, 12, 50, 9), seed=1)
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 11, 1, 40, 16)]
    done = _assert_same(v4_ckpt, list(zip(p, greedy)))
    assert done["3"].outputs[0].finish_reason == "length" and len(done["3"].outputs[0].token_ids) == 64 - 50


def test_stops_min_tokens_and_eos_equal_sync(v4_ckpt: str) -> None:
    p = _prompts(256, (14, 8, 21), seed=7)
    free, _ = _run(v4_ckpt, [(p[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))], False)
    toks = free["0"].outputs[0].token_ids
    requests = [
        (p[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[2]], ignore_eos=True)),
        (p[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[2]], min_tokens=5,
                              ignore_eos=True)),
        (p[1], SamplingParams(temperature=0, max_tokens=12)),  # eos counts
        (p[2], SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[toks[0], toks[5]], ignore_eos=True)),
    ]
    done = _assert_same(v4_ckpt, requests)
    assert done["0"].outputs[0].finish_reason == "stop"  # the case where async computes a discarded token


def test_seeded_sampling_penalties_logprobs_n_equal_sync(v4_ckpt: str) -> None:
    """Seeded rows draw by position, so they match across the modes; penalty rows make the runner land the
    pending tokens before it builds their sampling tensors; logprobs travel with the pending output."""
    p = _prompts(256, (10, 17, 6), seed=20)
    requests = [
        (p[0], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True, logprobs=2)),
        (p[1], SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=10, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.5)),
        (p[2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=1.0, logprobs=1)),
        # negative penalties pull the picks back to earlier outputs: a penalty that missed the latest token (not
        # landed yet) would change the next pick
        (p[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=-2.0)),
        (p[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=-1.5)),
    ]
    _assert_same(v4_ckpt, requests)


def test_preemption_under_a_tiny_pool_equals_sync(v4_ckpt: str) -> None:
    p = _prompts(256, (20, 25, 18, 22), seed=40)
    requests = [(q, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for q in p]
    _, sync_eng = _run(v4_ckpt, requests, False, num_kv_blocks=6)
    assert sync_eng.scheduler.num_preemptions > 0  # the pool really is too small
    _, async_eng = _run(v4_ckpt, requests, True, num_kv_blocks=6)
    assert async_eng.scheduler.num_preemptions > 0
    _assert_same(v4_ckpt, requests, num_kv_blocks=6)


def test_abort_in_flight_leaves_others_intact(v4_ckpt: str) -> None:
    p = _prompts(256, (20, 9, 33), seed=60)
    requests = [(q, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)) for q in p]
    alone, _ = _run(v4_ckpt, [requests[1]], False)
    done, eng = _run(v4_ckpt, requests, True, abort_after={4: ["0", "2"]})
    assert "0" not in done and "2" not in done
    assert done["1"].outputs[0].token_ids == alone["0"].outputs[0].token_ids
    eng.step()
    assert eng.runner.req_state.num_active == 0
    for pool in eng.kv_manager.pools:
        assert pool.num_free == pool.capacity


def test_v41_golden_equals_sync() -> None:
    """V4.1: the engram lookback window reads the in-flight tokens from the device history."""
    p = _prompts(288, (13, 7, 26), seed=80)
    requests = [(q, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)) for q, m in zip(p, (9, 14, 5))]
    _assert_same(GOLDEN, requests, max_model_len=96, block_size=16)


# ---- the scheduler's placeholders on worked examples ------------------------------------------------------

def _scheduler(num_blocks: int = 64, max_len: int = 64) -> Scheduler:
    cfg = load_model_config(GOLDEN)
    groups = make_kv_groups(cfg, 16, num_blocks, 4)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_len, async_scheduling=True)
    return Scheduler(sc, KVCacheManager(groups, sc.max_num_batched_tokens))


def _sampled(so: SchedulerOutput, tokens: dict[str, int]) -> RunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return RunnerOutput(ids, [[tokens[r]] if r in tokens else [] for r in ids], [None] * len(ids))


def test_placeholders_plan_ahead_and_land() -> None:
    s = _scheduler()
    req = Request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    s.add_request(req)
    so1 = s.schedule()  # the whole prompt: samples token 1
    assert so1.num_scheduled_tokens == {"a": 10} and req.num_output_placeholders == 1
    so2 = s.schedule()  # before token 1 lands: computes it, samples token 2
    assert so2.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    assert req.num_computed_tokens == 11 and req.num_tokens == 10
    s.update_from_output(so1, _sampled(so1, {"a": 100}))
    assert req.output_token_ids == [100] and req.num_output_placeholders == 1
    so3 = s.schedule()  # 1 known + 1 in flight + this one = max_tokens 3
    assert so3.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    so4 = s.schedule()  # the in-flight tokens already end the request: nothing more to compute
    assert so4.num_scheduled_tokens == {}
    s.update_from_output(so2, _sampled(so2, {"a": 101}))
    s.update_from_output(so3, _sampled(so3, {"a": 102}))
    assert req.output_token_ids == [100, 101, 102] and req.status == RequestStatus.FINISHED_LENGTH


def test_stop_while_a_step_is_in_flight_drops_its_token() -> None:
    s = _scheduler()
    req = Request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[9],
                                                 ignore_eos=True))
    s.add_request(req)
    so1 = s.schedule()
    so2 = s.schedule()
    s.update_from_output(so1, _sampled(so1, {"a": 9}))  # stop token: finished, blocks freed
    assert req.status == RequestStatus.FINISHED_STOPPED and "a" not in s.requests
    assert s.update_from_output(so2, _sampled(so2, {"a": 4})) == []  # the extra token is dropped
    assert req.output_token_ids == [9]
    assert s.schedule().finished_req_ids == {"a"}


def test_preempted_request_waits_for_its_in_flight_token() -> None:
    s = _scheduler()
    a = Request("a", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s.add_request(a)
    so1 = s.schedule()
    s._preempt(s.running.pop())  # as schedule() does when the pool runs dry
    assert a.status == RequestStatus.PREEMPTED and a.num_output_placeholders == 1
    assert s.schedule().num_scheduled_tokens == {}  # not re-admitted before its token lands
    s.update_from_output(so1, _sampled(so1, {"a": 50}))
    assert a.output_token_ids == [50] and a.num_output_placeholders == 0
    so3 = s.schedule()  # re-admitted with every known token, prompt and the landed one
    assert so3.num_scheduled_tokens == {"a": 18}
    assert so3.scheduled_new_reqs[0].output_token_ids == [50]


def test_stop_strings_equal_sync(tmp_path) -> None:
    """Stop strings are found after detokenizing, one step late under async: the text is cut the same way."""
    from dsv4 import LLM
    from dsv4.make_model import make_model

    path = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=16, seed=0, async_scheduling=async_scheduling)
        free = llm.generate("The weather", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        text = free.outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 2]
        outs = llm.generate(["The weather", "Once upon"],
                            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
        runs.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
    assert runs[0] == runs[1]
    assert runs[0][0][2] == "stop"


def test_server_front_with_async_scheduling(tmp_path) -> None:
    """The server's engine thread (AsyncLLMEngine) over an engine with async scheduling: concurrent streams end
    with the synchronous engine's outputs, a stream left early aborts its request, and the pools end up whole."""
    import asyncio

    from dsv4.engine.async_engine import AsyncLLMEngine
    from dsv4.make_model import make_model

    path = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    prompts = ["The weather today", "Once upon a time", "In the beginning"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 15)]
    args = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16)

    async def run(async_scheduling: bool) -> tuple[dict[str, list[int]], AsyncLLMEngine]:
        engine = AsyncLLMEngine.from_args(path, async_scheduling=async_scheduling, **args)
        engine.start()

        async def one(i: int) -> list[int]:
            last = None
            async for out in engine.generate(prompts[i], params[i], request_id=str(i)):
                last = out
            return list(last.outputs[0].token_ids)

        async def left_early() -> None:
            agen = engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), "gone")
            async for out in agen:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await agen.aclose()

        results = await asyncio.gather(*(one(i) for i in range(3)), left_early())
        return {str(i): results[i] for i in range(3)}, engine

    sync_out, sync_engine = asyncio.run(run(False))
    sync_engine.shutdown()
    async_out, engine = asyncio.run(run(True))
    assert async_out == sync_out
    deadline = time.monotonic() + 10  # the abort lands at the thread's next step boundary
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.shutdown()
    assert not engine.engine.has_unfinished_requests()
    for pool in engine.engine.kv_manager.pools:
        assert pool.num_free == pool.capacity


def test_async_scheduling_default_follows_the_device(v4_ckpt: str) -> None:
    """On by default for CUDA (vLLM's default; host work hides behind the GPU's), off on the CPU (nothing to
    overlap); an explicit choice always wins, from the Python API and from every CLI that takes the flag."""
    from dsv4.cli import _build_parser
    from dsv4.engine.engine import default_async_scheduling

    assert default_async_scheduling("cuda", None) and default_async_scheduling("cuda:1", None)
    assert not default_async_scheduling("cpu", None)
    assert default_async_scheduling("cpu", True) and not default_async_scheduling("cuda", False)
    kw = dict(max_model_len=64, load_tokenizer=False)
    assert not LLMEngine.from_args(v4_ckpt, **kw).config.scheduler.async_scheduling
    assert LLMEngine.from_args(v4_ckpt, async_scheduling=True, **kw).config.scheduler.async_scheduling
    parser = _build_parser()
    for argv in (["generate"], ["serve"], ["bench", "latency", "--model", "m"]):
        assert parser.parse_args(argv).async_scheduling is None
        assert parser.parse_args(argv + ["--async-scheduling"]).async_scheduling is True
        assert parser.parse_args(argv + ["--no-async-scheduling"]).async_scheduling is False
