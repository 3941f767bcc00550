"""Scheduler: continuous batching, chunked prefill, preemption, aborts, stops, length limits.

The scheduler is driven by `FakeRunner`, which keeps its own rows the way the real runner does (only from the
SchedulerOutput deltas), checks the contract on every step, and samples a deterministic token per position once
a request's known tokens are all computed. Because a token depends only on (request, position), the output of
every request is known in advance whatever the schedule: preemption and chunking must not change it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from dsv4.config import SchedulerConfig
from dsv4.engine.request import Request, RequestStatus
from dsv4.engine.scheduler import Scheduler
from dsv4.kv.manager import KVCacheManager
from dsv4.kv.spec import COMPRESSED, NULL_BLOCK, STATE, WINDOW, KVGroupSpec
from dsv4.sampling_params import SamplingParams
from dsv4.step import RunnerOutput, SchedulerOutput

EOS = 2
TokenFn = Callable[[str, int], int]


def default_token(req_id: str, pos: int) -> int:
    """A deterministic token for position `pos` of `req_id`, never EOS."""
    return 10 + (sum(map(ord, req_id)) * 31 + pos * 7) % 1000


def make_groups(window_blocks: int, block_size: int = 4, ratio: int = 4, comp_block_size: int = 2,
                max_num_seqs: int = 64) -> tuple[KVGroupSpec, ...]:
    """Window + one compressed group sized like make_kv_groups + a compressor-state group."""
    comp_blocks = math.ceil((window_blocks - 1) / ratio) + max_num_seqs + 1
    return (
        KVGroupSpec("window", WINDOW, (0, 1), block_size, 1, window_blocks),
        KVGroupSpec(f"compressed_{ratio}", COMPRESSED, (1,), comp_block_size, ratio, comp_blocks),
        KVGroupSpec("compressor_state", STATE, (1,), 2 * ratio, 1, max_num_seqs + 1, prefix_cacheable=False),
    )


def make_scheduler(max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 256, window_blocks: int = 200,
                   block_size: int = 4) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    # pools sized for 64 sequences, more than any test admits: max_num_seqs must be enforced by the scheduler
    groups = make_groups(window_blocks, block_size=block_size, max_num_seqs=64)
    return Scheduler(cfg, KVCacheManager(groups))


def make_request(req_id: str, prompt_len: int, **sp: object) -> Request:
    sp.setdefault("max_tokens", 8)
    return Request(req_id, [default_token("p" + req_id, i) for i in range(prompt_len)],
                   SamplingParams(**sp), eos_token_ids=(EOS,))


@dataclass
class Row:
    tokens: list[int]
    blocks: list[list[int]]
    num_computed: int


class FakeRunner:
    """Mirrors the runner's bookkeeping from SchedulerOutput deltas and checks the contract each step."""

    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = default_token) -> None:
        self.sched = scheduler
        self.groups = scheduler.kv_manager.groups
        self.token_fn = token_fn
        self.rows: dict[str, Row] = {}
        self.resumed_with_outputs = 0  # NewRequestData that carried previously generated tokens

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        cfg = self.sched.config
        new_ids = {r.req_id for r in so.scheduled_new_reqs}
        assert not new_ids & so.finished_req_ids, "a request dropped and re-added in one step"
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        for r in so.scheduled_new_reqs:
            assert r.req_id not in self.rows, f"{r.req_id} sent as new while the runner holds its row"
            if r.output_token_ids:
                self.resumed_with_outputs += 1
                assert r.num_computed_tokens == 0
            self.rows[r.req_id] = Row(r.prompt_token_ids + r.output_token_ids, [list(b) for b in r.block_ids],
                                      r.num_computed_tokens)
        c = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            row = self.rows[rid]
            assert row.num_computed == num_computed
            if new_blocks is not None:
                assert any(new_blocks), "empty block delta must be sent as None"
                for held, add in zip(row.blocks, new_blocks):
                    held.extend(add)
        assert set(so.num_scheduled_tokens) == new_ids | set(c.req_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert 0 < so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens, "a step without work: stall"
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(self.rows) <= cfg.max_num_seqs
        for g in range(len(self.groups)):  # no block is held twice, the null block by nobody
            owned = [b for row in self.rows.values() for b in row.blocks[g]]
            assert len(owned) == len(set(owned)) and NULL_BLOCK not in owned

        out = RunnerOutput([], [], [])
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            assert n > 0
            end = row.num_computed + n
            assert end <= len(row.tokens) <= cfg.max_model_len
            for spec, held in zip(self.groups, row.blocks):
                assert len(held) == spec.num_blocks_for(end), (spec.name, len(held), end)
            row.num_computed = end
            sampled = []
            if end == len(row.tokens):  # prompt (and every earlier output) computed: sample the next token
                sampled = [self.token_fn(rid, end)]
                row.tokens += sampled
            out.req_ids.append(rid)
            out.sampled_token_ids.append(sampled)
            out.logprobs.append(None)
        return out


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 20000) -> list[SchedulerOutput]:
    """Step until every request has finished; returns the SchedulerOutputs."""
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        so = sched.schedule()
        outputs.append(so)
        sched.update_from_output(so, runner.execute(so))
        assert sched.num_running <= sched.config.max_num_seqs
    raise AssertionError("requests never finished")


def assert_no_leaks(sched: Scheduler) -> None:
    kv = sched.kv_manager
    assert [p.num_free for p in kv.pools] == [p.capacity for p in kv.pools]
    assert not sched.running and not sched.waiting and not sched.requests


def expected_output(req: Request, max_len: int) -> list[int]:
    n = req.num_prompt_tokens
    m = min(req.sampling_params.max_tokens or max_len, max_len - n)
    return [default_token(req.req_id, n + k) for k in range(m)]


# ---- chunked prefill and batching ------------------------------------------------------------------------------


def test_chunked_prefill_under_7_token_budget_mixes_prefill_and_decode() -> None:
    sched = make_scheduler(budget=7)
    runner = FakeRunner(sched)
    a, b = make_request("a", 10), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    steps = []
    for _ in range(4):
        so = sched.schedule()
        steps.append(so)
        sched.update_from_output(so, runner.execute(so))
    assert [s.num_scheduled_tokens for s in steps] == [
        {"a": 7},  # a's first chunk takes the whole budget; b waits
        {"a": 3, "b": 4},  # a finishes its prompt, b's first chunk gets the rest
        {"a": 1, "b": 1},  # a decodes while b finishes its prompt: mixed step
        {"a": 1, "b": 1},  # both decode
    ]
    assert [r.req_id for r in steps[0].scheduled_new_reqs] == ["a"]
    assert steps[1].scheduled_cached_reqs.req_ids == ["a"] and steps[1].scheduled_cached_reqs.num_computed_tokens == [7]
    assert [r.req_id for r in steps[1].scheduled_new_reqs] == ["b"]
    assert steps[2].scheduled_cached_reqs.num_computed_tokens == [10, 4]
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2
    assert a.num_computed_tokens == a.num_tokens - 1  # the last sampled token is not computed yet


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_respect_budget_and_max_num_seqs(seed: int) -> None:
    rng = random.Random(seed)
    max_num_seqs = rng.randint(1, 6)
    sched = make_scheduler(max_num_seqs=max_num_seqs, budget=rng.randint(1, 40), max_model_len=64,
                           block_size=rng.choice([1, 2, 4, 16]), window_blocks=400)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 30)) for i in range(rng.randint(1, 15))]
    for r in reqs:
        sched.add_request(r)
    outs = run_all(sched, runner)
    assert max(len(so.num_scheduled_tokens) for so in outs) <= max_num_seqs
    for r in reqs:
        assert r.output_token_ids == expected_output(r, 64)
        assert r.finish_reason == "length"
        assert r.num_tokens <= 64
    assert_no_leaks(sched)


def test_requests_arriving_mid_run_join_the_batch() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    reqs = [make_request("a", 6, max_tokens=20)]
    sched.add_request(reqs[0])
    for step in range(30):
        if step in (3, 7):
            reqs.append(make_request(f"late{step}", 9, max_tokens=5))
            sched.add_request(reqs[-1])
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert all(r.output_token_ids == expected_output(r, 256) for r in reqs)
    assert_no_leaks(sched)


# ---- preemption ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_preemption_under_tiny_pool_recomputes_and_loses_nothing(seed: int) -> None:
    rng = random.Random(seed)
    # 8 window blocks of 4 tokens = 32 tokens for everyone; several requests grow past that together
    sched = make_scheduler(max_num_seqs=4, budget=rng.randint(4, 24), max_model_len=32, window_blocks=9)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", rng.randint(3, 14), max_tokens=rng.randint(6, 16)) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    outs = run_all(sched, runner)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to be too small"
    assert runner.resumed_with_outputs > 0, "resumed requests must carry the tokens generated before preemption"
    preempted_ids = {rid for so in outs for rid in so.finished_req_ids}
    assert {r.req_id for r in reqs if r.num_preemptions} <= preempted_ids
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r, 32)
    assert_no_leaks(sched)


def test_preemption_takes_the_latest_request_and_puts_it_first_in_line() -> None:
    # 4 window blocks of 4 tokens; a and b each 8 tokens prefilled -> the pool is full
    sched = make_scheduler(budget=64, max_model_len=16, window_blocks=5)
    runner = FakeRunner(sched)
    a, b, c = make_request("a", 8, max_tokens=6), make_request("b", 8, max_tokens=6), make_request("c", 2)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # a's decode needs a 3rd block: b is preempted
    assert so.num_scheduled_tokens == {"a": 1}
    assert "b" in so.finished_req_ids and not so.scheduled_new_reqs
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    assert sched.kv_manager.get_block_ids("b") == ([], [], [])
    sched.update_from_output(so, runner.execute(so))
    run_all(sched, runner)
    assert [r.output_token_ids for r in (a, b, c)] == [expected_output(r, 16) for r in (a, b, c)]
    assert_no_leaks(sched)


def test_single_request_growing_past_the_pool_finishes_with_length() -> None:
    # 3 blocks of 4 tokens hold 12 tokens: the request stops there instead of looping on preemption
    sched = make_scheduler(max_model_len=100, window_blocks=4)
    assert sched.max_len == 12
    r = make_request("a", 5, max_tokens=None)
    sched.add_request(r)
    run_all(sched, FakeRunner(sched))
    assert r.finish_reason == "length" and r.num_tokens == 12
    assert_no_leaks(sched)


# ---- admission -------------------------------------------------------------------------------------------------


def test_add_request_rejects_requests_that_can_never_run() -> None:
    sched = make_scheduler(max_model_len=20, window_blocks=200)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 20))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("ok", 19))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("ok", 3))
    small = make_scheduler(max_model_len=100, window_blocks=3)  # 8 tokens
    with pytest.raises(ValueError, match="KV cache"):
        small.add_request(make_request("big", 8))
    small.add_request(make_request("fits", 7))
    assert small.get_num_unfinished_requests() == 1 and sched.get_num_unfinished_requests() == 1


def test_max_num_seqs_limits_admission_not_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=100)
    runner = FakeRunner(sched)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=2))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_running == 2 and sched.num_waiting == 3
    sched.update_from_output(so, runner.execute(so))
    run_all(sched, runner)
    assert_no_leaks(sched)


# ---- aborts and finishes ---------------------------------------------------------------------------------------


def test_abort_frees_blocks_and_is_reported_once() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=8)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", 6, max_tokens=50) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    r0, _, r2, _ = reqs
    assert r0.status == RequestStatus.RUNNING and r2.status == RequestStatus.WAITING
    used_before = [p.capacity - p.num_free for p in sched.kv_manager.pools]
    aborted = sched.abort_requests(["r0", "r2", "nope"])
    assert aborted == [r0, r2]
    assert r0.finish_reason == r2.finish_reason == "abort"
    used_after = [p.capacity - p.num_free for p in sched.kv_manager.pools]
    assert used_after[0] == used_before[0] - math.ceil(6 / 4) and used_after[2] == used_before[2] - 1
    assert sched.kv_manager.get_block_ids("r0") == ([], [], [])
    so = sched.schedule()
    assert {"r0", "r2"} <= so.finished_req_ids
    assert "r0" not in so.num_scheduled_tokens and "r2" not in so.num_scheduled_tokens
    sched.update_from_output(so, runner.execute(so))
    assert not {"r0", "r2"} & sched.schedule().finished_req_ids
    sched.abort_requests([r.req_id for r in reqs])
    assert not sched.has_unfinished_requests()
    assert_no_leaks(sched)


def test_abort_between_schedule_and_update_drops_the_tokens() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    r = make_request("a", 4)
    sched.add_request(r)
    so = sched.schedule()
    ro = runner.execute(so)
    sched.abort_requests(["a"])
    assert sched.update_from_output(so, ro) == []
    assert r.output_token_ids == [] and r.finish_reason == "abort"
    assert_no_leaks(sched)


def test_finish_requests_with_a_stop_string() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    r = make_request("a", 4, max_tokens=10)
    sched.add_request(r)
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert sched.finish_requests(["a"], "stop", stop_reason="END") == [r]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == "END" and r.finish_reason == "stop"
    assert r.num_output_tokens == 3
    assert "a" in sched.schedule().finished_req_ids
    assert_no_leaks(sched)


# ---- token-level stops -----------------------------------------------------------------------------------------


def scripted(tokens: list[int]) -> TokenFn:
    """Output k of every request is tokens[k] (then a non-stop filler)."""

    def fn(req_id: str, pos: int) -> int:
        k = pos - 4  # prompts are 4 tokens
        return tokens[k] if k < len(tokens) else 500 + k

    return fn


@pytest.mark.parametrize(
    "script, params, expected_len, reason, stop_reason",
    [
        ([5, 6, 7, 8, 9, 10, 11], dict(max_tokens=5), 5, "length", None),
        ([5, 6, EOS, 8, 9], dict(max_tokens=10), 3, "stop", None),
        ([5, 6, EOS, 8, 9], dict(max_tokens=10, ignore_eos=True), 10, "length", None),
        ([5, EOS, 6, EOS, 8, EOS], dict(max_tokens=10, min_tokens=5), 6, "stop", None),
        ([5, EOS, 6, EOS, 8, EOS], dict(max_tokens=10, min_tokens=3), 4, "stop", None),  # len 4 >= 3 counts
        ([5, EOS, 6, EOS], dict(max_tokens=10, min_tokens=2), 2, "stop", None),  # boundary: len == min_tokens
        ([5, 77, 6, 7], dict(max_tokens=10, stop_token_ids=[77]), 2, "stop", 77),
        ([77, 78, 6, 7], dict(max_tokens=10, stop_token_ids=[78], min_tokens=1), 2, "stop", 78),
        ([78, 5, 6, 7, 78], dict(max_tokens=10, stop_token_ids=[78], min_tokens=2), 5, "stop", 78),
        ([5, 6, 77], dict(max_tokens=3, stop_token_ids=[77]), 3, "stop", 77),  # stop wins over max_tokens
        ([EOS, 6], dict(max_tokens=10, stop_token_ids=[EOS]), 1, "stop", EOS),  # stop_token_ids checked first
        ([5, 6, 7], dict(max_tokens=None), 12, "length", None),  # max_model_len 16 - prompt 4
        ([5, 6, EOS], dict(max_tokens=None, ignore_eos=True), 12, "length", None),
    ],
)
def test_stop_semantics(script: list[int], params: dict, expected_len: int, reason: str,
                        stop_reason: int | None) -> None:
    sched = make_scheduler(max_model_len=16, budget=3)  # budget 3: the prompt takes two chunks
    runner = FakeRunner(sched, scripted(script))
    r = make_request("a", 4, **params)
    sched.add_request(r)
    run_all(sched, runner)
    assert r.num_output_tokens == expected_len
    assert r.output_token_ids == [scripted(script)("a", 4 + k) for k in range(expected_len)]
    assert r.finish_reason == reason and r.stop_reason == stop_reason
    assert r.num_tokens <= 16
    assert_no_leaks(sched)


def test_update_returns_changed_requests_only() -> None:
    sched = make_scheduler(budget=5)
    runner = FakeRunner(sched)
    a, b = make_request("a", 3, max_tokens=1), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()  # a: 3 (complete, samples), b: 2 (partial prefill)
    assert so.num_scheduled_tokens == {"a": 3, "b": 2}
    changed = sched.update_from_output(so, runner.execute(so))
    assert changed == [a] and a.finish_reason == "length" and b.num_output_tokens == 0


# ---- compressed groups -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_compressed_group_block_counts_follow_the_tokens(block_size: int) -> None:
    sched = make_scheduler(budget=5, block_size=block_size)
    runner = FakeRunner(sched)  # checks len(blocks) == num_blocks_for(end) in every group, every step
    r = make_request("a", 37, max_tokens=20)
    sched.add_request(r)
    counts = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        if r.req_id in sched.requests:
            counts.append((r.num_computed_tokens, [len(b) for b in sched.kv_manager.get_block_ids("a")]))
    for n, (w, c, s) in counts:
        assert w == math.ceil(n / block_size)
        assert c == math.ceil((n // 4) / 2)  # ratio 4, 2 entries per compressed block
        assert s == 1
    assert {n for n, _ in counts} >= {5, 35, 37, 40, 55}
    assert_no_leaks(sched)


# ---- Request ---------------------------------------------------------------------------------------------------


def test_request_properties() -> None:
    r = Request("x", [1, 2, 3], SamplingParams(), eos_token_ids=(EOS,))
    assert r.status == RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    r.output_token_ids += [7, 8]
    assert r.num_prompt_tokens == 3 and r.num_output_tokens == 2 and r.num_tokens == 5
    assert r.all_token_ids == [1, 2, 3, 7, 8]
    r.all_token_ids.append(9)
    assert r.num_tokens == 5, "all_token_ids must be a copy"
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"
