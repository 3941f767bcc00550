"""Mixed load (issue 23 item 4): decodes before prefills, the prefill chunk cap (long_prefill_token_threshold) and
the partial-prefill limits (max_num_partial_prefills, max_long_partial_prefills), as vLLM.

Scheduler-level tests drive the real Scheduler and KVCacheManager with test_scheduler's FakeRunner, whose sampled
token depends only on (request, position): any chunking must leave every request's output as expected. One
end-to-end test checks that greedy outputs of the tiny model do not depend on the options.
"""

from __future__ import annotations

import random

import pytest
from test_scheduler import FakeRunner, assert_no_leaks, default_token, expected_output, make_groups

from dsv4 import LLM, SamplingParams
from dsv4.config import SchedulerConfig
from dsv4.engine.request import Request
from dsv4.engine.scheduler import Scheduler
from dsv4.kv.manager import KVCacheManager
from dsv4.models.config import ConfigError
from dsv4.step import RunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(budget: int = 64, threshold: int = 0, partial: int = 1, long_partial: int = 1,
                   max_num_seqs: int = 8, max_model_len: int = 256, window_blocks: int = 400,
                   policy: str = "fcfs") -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          scheduling_policy=policy, long_prefill_token_threshold=threshold,
                          max_num_partial_prefills=partial, max_long_partial_prefills=long_partial)
    cfg.validate()
    return Scheduler(cfg, KVCacheManager(make_groups(window_blocks, max_num_seqs=64), budget))


def make_request(req_id: str, prompt_len: int, max_tokens: int = 4, group: str = "") -> Request:
    return Request(req_id, [default_token("p" + req_id, i) for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens), eos_token_ids=(EOS,), group_id=group)


class Checked:
    """Steps a scheduler with FakeRunner and checks the mixed-load rules on every step."""

    def __init__(self, sched: Scheduler, check_decodes: bool = True) -> None:
        self.sched, self.runner = sched, FakeRunner(sched)
        self.check_decodes = check_decodes  # exact only while nothing is preempted
        self.steps: list[SchedulerOutput] = []
        self.finished_at: dict[str, int] = {}
        self.max_partial = self.max_long_partial = 0

    def step(self) -> SchedulerOutput:
        s = self.sched
        cfg, cap = s.config, s.config.prefill_chunk_cap
        # running decodes before the step (sync scheduling: all but the last sampled token computed)
        decodes = [r.req_id for r in s.running if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1]
        so = s.schedule()
        n = so.num_scheduled_tokens
        prefill_tokens = sum(k for rid, k in n.items() if rid not in decodes)
        if self.check_decodes:
            got = [rid for rid in decodes if rid in n]
            assert all(n[rid] == 1 for rid in got)
            if len(decodes) <= cfg.max_num_batched_tokens:
                assert got == decodes, f"a decode lost its token: {set(decodes) - set(got)}"
            else:
                assert len(got) == cfg.max_num_batched_tokens and prefill_tokens == 0
        if cap:
            assert all(k <= cap for rid, k in n.items() if rid not in decodes), f"chunk over the cap {cap}: {n}"
        # after the step: who is mid-prefill (its prefill not all scheduled), and how many of them are long
        mid = [r for r in s.running if r.num_computed_tokens < r.num_tokens]
        long = [r for r in mid if 0 < cap < r.num_tokens]
        assert len(mid) == s.num_partial_prefills <= cfg.max_num_partial_prefills, [r.req_id for r in mid]
        assert len(long) == s.num_long_partial_prefills <= cfg.max_long_partial_prefills, [r.req_id for r in long]
        self.max_partial = max(self.max_partial, len(mid))
        self.max_long_partial = max(self.max_long_partial, len(long))
        for r in s.update_from_output(so, self.runner.execute(so)):
            if r.is_finished:
                self.finished_at[r.req_id] = len(self.steps)
        self.steps.append(so)
        return so

    def run(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests never finished")


# ---- the chunk cap -----------------------------------------------------------------------------------------------


def test_threshold_caps_every_prefill_chunk_running_and_new() -> None:
    sched = make_scheduler(budget=64, threshold=8)
    c = Checked(sched)
    a = make_request("a", 30)
    sched.add_request(a)
    chunks = [c.step().num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [8, 8, 8, 6]  # the budget had room for all 30 at once: the cap cut it
    c.run()
    assert a.output_token_ids == expected_output(a, 256)
    # without the cap the same prompt is one chunk
    plain = make_scheduler(budget=64)
    b = make_request("b", 30)
    plain.add_request(b)
    assert plain.schedule().num_scheduled_tokens == {"b": 30}


def test_derived_threshold_as_vllm() -> None:
    assert SchedulerConfig(max_model_len=1000).prefill_chunk_cap == 0  # defaults: no cap (vLLM V1)
    assert SchedulerConfig(max_model_len=1000, max_num_partial_prefills=2).prefill_chunk_cap == 40  # 4%
    assert SchedulerConfig(max_model_len=1000, max_num_partial_prefills=2,
                           long_prefill_token_threshold=7).prefill_chunk_cap == 7
    assert SchedulerConfig(long_prefill_token_threshold=7).prefill_chunk_cap == 7


# ---- decodes first -------------------------------------------------------------------------------------------------


def test_decodes_go_before_a_running_prefill() -> None:
    # a long prompt admitted first is still prefilling, in front of two short ones in running order, while they
    # decode: each step the decodes get their token and the prefill the rest
    sched = make_scheduler(budget=10, threshold=8, partial=2)
    c = Checked(sched)
    for r in (make_request("long", 60, max_tokens=2), make_request("s1", 1, 6), make_request("s2", 1, 6)):
        sched.add_request(r)
    assert c.step().num_scheduled_tokens == {"long": 8, "s1": 1, "s2": 1}
    for _ in range(4):
        so = c.step()
        assert [r.req_id for r in sched.running] == ["long", "s1", "s2"]
        assert so.num_scheduled_tokens == {"long": 8, "s1": 1, "s2": 1}
    c.run()


def test_decode_with_drafts_takes_its_budget_before_a_prefill_in_front_of_it() -> None:
    # speculative decoding: a decode verifying 4 drafts needs 5 tokens. The long prefill ahead of it in running
    # order used to take its 8 first and leave the decode 2 (1 draft); decodes first, the prefill gets what is left.
    sched = make_scheduler(budget=10, threshold=8, partial=2)
    long, s = make_request("long", 60, max_tokens=2), make_request("s", 1, max_tokens=10)
    sched.add_request(long)
    sched.add_request(s)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"long": 8, "s": 1}
    sched.update_from_output(so, RunnerOutput(["long", "s"], [[], [7]], [None, None]))
    s.num_draft_tokens = 4  # as a speculative runner reports it (num_draft_tokens)
    for step in range(3):
        so = sched.schedule()
        assert so.num_scheduled_tokens == {"long": 5, "s": 5}, step
        assert list(so.num_scheduled_tokens) == ["long", "s"]  # the runner still sees them in running order
        # every draft rejected: 4 tokens are not computed after all; 4 new drafts for the next step
        sched.update_from_output(so, RunnerOutput(["long", "s"], [[], [8 + step]], [None, None],
                                                  num_uncomputed_tokens=[0, 4], num_draft_tokens=[0, 4]))
    assert long.num_computed_tokens == 8 + 3 * 5 and s.output_token_ids == [7, 8, 9, 10]


@pytest.mark.parametrize("seed", range(8))
def test_random_mixed_load_keeps_every_rule(seed: int) -> None:
    """Random prompts (a few long), caps and limits, arrivals over time, "fair" groups or FIFO; a pool large
    enough that nothing is preempted, so every decode must get its token whenever the budget allows."""
    rng = random.Random(seed)
    partial = rng.randint(1, 3)
    sched = make_scheduler(budget=rng.randint(4, 40), threshold=rng.choice([0, 3, 8, 16]), partial=partial,
                           long_partial=rng.randint(1, partial), max_num_seqs=rng.randint(2, 8),
                           policy=rng.choice(["fair", "fcfs"]))
    c = Checked(sched)
    pending = [make_request(f"r{i}", rng.choice([rng.randint(1, 12), rng.randint(30, 120)]),
                            max_tokens=rng.randint(1, 12), group=f"g{i // rng.randint(1, 3)}") for i in range(14)]
    reqs = list(pending)
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        if sched.has_unfinished_requests():
            c.step()
    assert sched.num_preemptions == 0
    for r in reqs:
        assert r.output_token_ids == expected_output(r, 256)
    assert_no_leaks(sched)


@pytest.mark.parametrize("seed", range(4))
def test_limits_hold_under_preemption(seed: int) -> None:
    rng = random.Random(100 + seed)
    partial = rng.randint(1, 3)
    sched = make_scheduler(budget=rng.randint(4, 24), threshold=rng.choice([3, 5]), partial=partial,
                           long_partial=rng.randint(1, partial), max_num_seqs=4, max_model_len=32, window_blocks=9)
    c = Checked(sched, check_decodes=False)
    reqs = [make_request(f"r{i}", rng.randint(2, 14), max_tokens=rng.randint(6, 16)) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    c.run()
    assert sched.num_preemptions > 0, "the pool was meant to be too small"
    for r in reqs:
        assert r.output_token_ids == expected_output(r, 32)
    assert_no_leaks(sched)


# ---- short prompts next to long ones --------------------------------------------------------------------------------


def test_short_prompt_finishes_while_a_long_one_prefills() -> None:
    def run(**options: int) -> Checked:
        sched = make_scheduler(budget=32, max_model_len=512, **options)
        c = Checked(sched)
        sched.add_request(make_request("long", 200, max_tokens=4))
        c.step()
        sched.add_request(make_request("short", 6, max_tokens=4))
        c.run()
        return c

    capped = run(threshold=8, partial=2)
    assert capped.finished_at["short"] < capped.finished_at["long"]
    assert capped.finished_at["short"] <= 5  # admitted in the step after it arrived, then 3 decodes
    assert capped.max_partial == 1 and capped.max_long_partial == 1
    # today's scheduling (the defaults): the long prefill fills every step, the short prompt waits behind it
    plain = run()
    assert plain.finished_at["short"] > 200 // 32


@pytest.mark.parametrize("partial", [1, 2])
def test_short_prompt_passes_a_long_one_that_has_no_room(partial: int) -> None:
    # one long partial prefill at a time: a second long prompt waits; a short one that arrived after it is admitted
    # (with room for 2 partial prefills the short one may even be left mid-prefill; with 1, only if it completes)
    sched = make_scheduler(budget=16, threshold=8, partial=partial, long_partial=1)
    c = Checked(sched)
    l1, l2, s = make_request("l1", 40, max_tokens=2), make_request("l2", 40, max_tokens=2), make_request("s", 5, 3)
    for r in (l1, l2, s):
        sched.add_request(r)
    assert c.step().num_scheduled_tokens == {"l1": 8, "s": 5}
    assert sched.waiting == [l2]
    c.run()
    assert c.finished_at["s"] < c.finished_at["l1"] < c.finished_at["l2"]
    first_l2 = next(i for i, so in enumerate(c.steps) if "l2" in so.num_scheduled_tokens)
    last_l1_chunk = max(i for i, so in enumerate(c.steps) if so.num_scheduled_tokens.get("l1", 0) > 1)
    assert first_l2 == last_l1_chunk  # admitted in the step that schedules the rest of l1's prefill, not before
    assert c.max_long_partial == 1


def test_partial_limit_two_long_prompts_prefill_together() -> None:
    sched = make_scheduler(budget=64, threshold=8, partial=3, long_partial=2)
    c = Checked(sched)
    reqs = [make_request(f"l{i}", 40, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    assert c.step().num_scheduled_tokens == {"l0": 8, "l1": 8}  # l2: no room for a third long one
    c.run()
    assert c.max_long_partial == 2
    assert all(r.output_token_ids == expected_output(r, 256) for r in reqs)


# ---- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills must be >= 1"),
    ({"max_long_partial_prefills": 0}, "max_long_partial_prefills must be >= 1"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, r"max_long_partial_prefills \(3\) must be <= "
                                                                      r"max_num_partial_prefills \(2\)"),
    ({"max_long_partial_prefills": 2}, r"max_long_partial_prefills \(2\) must be <= max_num_partial_prefills \(1\)"),
])
def test_config_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SchedulerConfig(**kwargs).validate()


# ---- end to end --------------------------------------------------------------------------------------------------


def test_greedy_outputs_do_not_depend_on_the_options(tiny_v41: str) -> None:
    kw = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              block_size=16, seed=0, skip_tokenizer_init=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in (30, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=tiny_v41, **kw).generate(prompts, params)]
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        LLM(model=tiny_v41, max_long_partial_prefills=2, **kw)
    for async_scheduling in (False, True):  # async: placeholders planned ahead of capped chunks
        llm = LLM(model=tiny_v41, long_prefill_token_threshold=8, max_num_partial_prefills=2,
                  async_scheduling=async_scheduling, **kw)
        sched, steps = llm.engine.scheduler, []
        schedule = sched.schedule
        sched.schedule = lambda: steps.append(schedule()) or steps[-1]  # record the steps
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, async_scheduling
        chunks = [n for so in steps for n in so.num_scheduled_tokens.values()]
        assert max(chunks) == 8 and chunks.count(8) >= 5 and sched.num_preemptions == 0  # (30 and 17 chunked)


def test_serve_flags_reach_the_engine(tiny_v41: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4.cli import _build_parser, main

    args = _build_parser().parse_args(["serve", "--long-prefill-token-threshold", "64", "--max-num-partial-prefills",
                                       "3", "--max-long-partial-prefills", "2"])
    got = (args.long_prefill_token_threshold, args.max_num_partial_prefills, args.max_long_partial_prefills)
    assert got == (64, 3, 2)
    defaults = _build_parser().parse_args(["serve"])
    assert defaults.long_prefill_token_threshold is None and defaults.max_num_partial_prefills is None
    # a bad combination fails with one line and exit status 2, before the model is built
    assert main(["serve", "--model", tiny_v41, "--device", "cpu", "--max-num-partial-prefills", "2",
                 "--max-long-partial-prefills", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dsv4: error: max_long_partial_prefills (3) must be <= max_num_partial_prefills (2): the long "
                   "partial prefills are some of the partial prefills"]
