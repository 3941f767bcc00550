"""The adaptive speculation switch (`"adaptive": true`, dsv4/spec_decode/gate.py): speculation runs only while it
emits more tokens per second than plain decoding, from step times and accepted drafts measured as the engine runs.

The state machine with a scripted clock (calibration, trials, backoff that doubles after a lost trial and resets
after a won one, buckets of batch sizes, the margin); engines on tiny-v41 with a clock that charges each step what a
GPU would (a speculative step 1.7x a plain one): a drafter that never helps (acceptance ~0) ends up running almost
only plain steps, an all-accepting one keeps speculating, greedy output equals plain decoding either way; and plain
steps keep the drafter's tap ring as the speculative steps write it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode import gate as G
from dsv4.spec_decode.config import DrafterSpec, parse_speculative_config
from dsv4.spec_decode.gate import SpeculationGate, bucket
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.speculator import PlainSpecOutput
from engine_runs import oracle_sequences, run_to_completion


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _drive(gate: SpeculationGate, clock: _Clock, steps: int, R: int, tokens: float, spec_s: float,
           plain_s: float = 1.0) -> list[bool]:
    """`steps` steady steps of R requests: each speculates when the gate allows (before the step, as the engine
    asks when it proposes drafts), costs spec_s or plain_s, and a speculative one emits `tokens` per request."""
    modes = []
    for _ in range(steps):
        spec = gate.allows(R)
        gate.step(clock.t, spec, R, steady=True)
        if spec:
            for _ in range(R):
                gate.accepted(round(tokens))
        clock.t += spec_s if spec else plain_s
        modes.append(spec)
    return modes


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 3, 3, 4, 4, 5]


def test_calibrates_then_keeps_a_paying_drafter() -> None:
    """First plain steps measure the plain time; then a trial; 3 tokens a step at 1.7x pays (1.76x the rate)."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    assert not gate.allows(1)  # nothing measured yet: plain
    modes = _drive(gate, clock, 200, 1, tokens=3, spec_s=1.7)
    first = modes.index(True)
    assert 0 < first <= G.CALIBRATION_STEPS + 1
    assert all(modes[first:]) and gate.num_closes == 0
    assert gate.plain_s[1] == pytest.approx(1.0) and gate.spec_s[1] == pytest.approx(1.7)


def test_closes_on_a_losing_drafter_and_backs_off() -> None:
    """1 token a step at 1.7x loses: speculation stops after the first trial; the backoffs double up to the
    longest; over a long run the share of speculative steps approaches TRIAL / (TRIAL + MAX_BACKOFF)."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    modes = _drive(gate, clock, 6000, 1, tokens=1, spec_s=1.7)
    assert gate.num_closes > 3 and gate.backoff == G.MAX_BACKOFF
    runs = [len(r) for r in "".join("s" if m else "p" for m in modes).split("p") if r]
    assert max(runs) <= G.TRIAL_STEPS + 1  # never more than a trial (+ the step that judged it)
    tail = modes[3000:]
    assert sum(tail) / len(tail) < 2 * G.TRIAL_STEPS / (G.TRIAL_STEPS + G.MAX_BACKOFF)
    cost = sum(1.7 if m else 1.0 for m in tail) / len(tail)
    assert cost < 1.03  # a drafter that never helps costs ~1% once backed off


@pytest.mark.parametrize("tokens, spec_s, steps", [(1, 1.7, G.EARLY_STEPS), (2, 2.1, G.TRIAL_STEPS)])
def test_a_clear_loss_ends_a_trial_early(tokens: int, spec_s: float, steps: int) -> None:
    """A drafter far below the break-even (1 token a step at 1.7x: 0.59 of plain's rate) ends its trials after
    EARLY_STEPS; one just below it (2 tokens at 2.1x: 0.95) gets whole trials of TRIAL_STEPS before closing."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    modes = _drive(gate, clock, 1000, 1, tokens=tokens, spec_s=spec_s)
    runs = [len(r) for r in "".join("s" if m else "p" for m in modes).split("p") if r]
    assert gate.num_trials >= 4 and gate.num_closes == gate.num_trials
    assert runs == [steps] * gate.num_trials


def test_a_won_trial_resets_the_backoff_and_buckets_are_separate() -> None:
    """The drafter turns good after losing for a while: the next trial wins and the backoff restarts at the
    shortest. A batch size of another bucket is measured on its own (calibrated first)."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    _drive(gate, clock, 400, 1, tokens=1, spec_s=1.7)
    assert gate.backoff > G.MIN_BACKOFF
    modes = _drive(gate, clock, 1200, 1, tokens=4, spec_s=1.7)
    assert gate.backoff == G.MIN_BACKOFF and all(modes[-100:])
    assert 3 not in gate.plain_s and not gate.allows(5)  # bucket 3 (4-7 requests): not measured yet
    modes = _drive(gate, clock, 100, 5, tokens=4, spec_s=1.7)
    assert 3 in gate.plain_s and all(modes[-50:])


def test_the_margin_keeps_a_tie_off() -> None:
    """Exactly plain's rate (2 tokens at 2x) is not enough: speculation must win by MARGIN."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    modes = _drive(gate, clock, 300, 1, tokens=2, spec_s=2.0 * (1 + G.MARGIN))
    assert gate.num_closes > 0 and sum(modes[-100:]) < 40


def test_only_steady_steps_of_one_bucket_are_timed() -> None:
    """An interval is a step's cost only when that step and the next are steady decode steps of the same bucket
    (a prefill or an idle engine between them is not a step time)."""
    clock = _Clock()
    gate = SpeculationGate(clock)
    gate.step(0.0, False, 1, steady=True)
    gate.step(5.0, False, 1, steady=False)  # a prefill came: its interval is not measured, nor the one after it
    gate.step(9.0, False, 1, steady=True)
    assert 1 not in gate.plain_s
    gate.step(10.0, False, 1, steady=True)
    gate.step(11.0, False, 2, steady=True)  # another bucket
    assert gate.plain_s == {1: 1.0}


# ---- engines ---------------------------------------------------------------------------------------------------------
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23]]
GREEDY = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)


def _charge(e: LLMEngine, clock: _Clock, spec_s: float, plain_s: float = 1.0) -> dict[str, int]:
    """Each launched step advances the clock by what it would cost on a GPU; counts steps by kind."""
    sp = e.runner.speculator
    orig = sp.launch
    counts = {"spec": 0, "plain": 0}

    def launch(so: Any) -> Any:
        out = orig(so)
        kind = "plain" if isinstance(out, PlainSpecOutput) else "spec"
        counts[kind] += 1
        clock.t += spec_s if kind == "spec" else plain_s
        return out

    sp.launch = launch  # type: ignore[method-assign]
    return counts


@pytest.fixture(scope="module")
def baseline(tiny_v41: str) -> dict[str, list[int]]:
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=2, max_model_len=512)
    return run_to_completion(e, {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY)


@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_engine_speculates_only_while_it_pays(tiny_v41: str, baseline: dict[str, list[int]], drafter: str) -> None:
    """k = 3 verify steps charged 1.7x a plain step. The checkpoint's random drafter (about nothing accepted):
    after the first trial the engine runs plain steps but for trials, and emits plain decoding's tokens. The
    oracle (all accepted, 4 tokens a step): after calibration it speculates to the end."""
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=2, max_model_len=512,
                            speculative_config={"method": "dspark", "num_speculative_tokens": 3, "adaptive": True})
    sp = e.runner.speculator
    clock = _Clock()
    assert sp.gate is not None
    sp.gate.clock = clock
    if drafter == "oracle":
        sp.set_proposer(OracleProposer(oracle_sequences(PROMPTS, [baseline[str(i)] for i in range(2)]), 4))
    counts = _charge(e, clock, spec_s=1.7)
    assert run_to_completion(e, {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY) == baseline
    st = e.spec_decode_stats
    if drafter == "random":
        assert sp.gate.num_closes >= 2 and counts["plain"] > 4 * counts["spec"]
        assert st.num_accepted_tokens < 0.1 * st.num_draft_tokens
    else:
        assert sp.gate.num_closes == 0 and counts["spec"] > 5 * counts["plain"]
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_trials_start_from_a_plain_step_and_plain_steps_are_pipelined(tiny_v41: str, baseline: dict[str, list[int]],
                                                                      pipelined: bool) -> None:
    """With verify_decode (and async scheduling: pipelined) and the checkpoint's random drafter, steps charged as
    above. Each trial starts with the plain step (its decode forward), after which the drafter proposes: no decode
    batch runs the token-row forward. Pipelined, every plain step is pipelined too: a synchronous step has a prefill,
    drafts to verify (a trial's end) or a rewound request's two tokens. Greedy output equals plain decoding."""
    spec = {"method": "dspark", "num_speculative_tokens": 3, "adaptive": True, "verify_decode": True}
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=2, max_model_len=512, async_scheduling=pipelined,
                            speculative_config=spec)
    sp, sched = e.runner.speculator, e.scheduler
    clock = _Clock()
    assert sp.gate is not None
    sp.gate.clock = clock
    counts = _charge(e, clock, spec_s=1.7)
    token_row_decodes, sync_plain = [], []
    launch, forward, schedule = sp.launch, e.runner.model.forward, sched.schedule

    def watched_launch(so: Any) -> Any:
        decode = all(n == 1 for n in so.num_scheduled_tokens.values())
        calls = len(forwards)
        out = launch(so)
        if decode and len(forwards) > calls:
            token_row_decodes.append(so)
        return out

    forwards: list[int] = []

    def watched_forward(*args: Any, **kw: Any) -> Any:
        forwards.append(1)
        return forward(*args, **kw)

    def watched_schedule() -> Any:
        so = schedule()
        reqs = [sched.requests[q] for q, n in so.num_scheduled_tokens.items() if n == 1]
        if (so.num_scheduled_tokens and len(reqs) == len(so.num_scheduled_tokens) and not so.scheduled_new_reqs
                and not any(r.num_draft_tokens for r in reqs)):
            sync_plain.append(so)
        return so

    sp.launch = watched_launch  # type: ignore[method-assign]
    e.runner.model.forward = watched_forward  # type: ignore[method-assign]
    sched.schedule = watched_schedule  # type: ignore[method-assign]
    assert run_to_completion(e, {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY) == baseline
    assert sp.gate.num_trials >= 3 and sp.num_plain_proposals == sp.gate.num_trials
    assert not token_row_decodes
    assert counts["plain"] > 4 * counts["spec"]
    if pipelined:
        assert sp.pipeline is not None and sp.pipeline.num_steps > 0
        assert not sync_plain, f"{len(sync_plain)} plain steps ran synchronously"


@pytest.mark.parametrize("model", ["tiny_v41", "tiny_v4"])
def test_plain_steps_write_the_taps_speculative_steps_would(model: str, request: pytest.FixtureRequest) -> None:
    """One engine with speculation off for every step (disable_by_batch_size 1: plain decode steps, their graphs'
    forward with the taps beside the hidden states) and one speculating with the checkpoint's drafter (its verify
    steps write the taps of every position they compute; rejected ones are rewritten when recomputed): after the same
    tokens, their tap rings hold the same taps for the last window of positions (DSpark's hc-means of three layers;
    MTP's final streams)."""
    path = request.getfixturevalue(model)
    method = "dspark" if model == "tiny_v41" else "mtp"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = PROMPTS[1]
    plain = run_to_completion(LLMEngine.from_args(path, max_num_seqs=2), {"0": prompt}, params)["0"]
    rings = []
    for off in (True, False):
        spec = {"method": method, "num_speculative_tokens": 3, **({"disable_by_batch_size": 1} if off else {})}
        e = LLMEngine.from_args(path, max_num_seqs=2, speculative_config=spec)
        sp = e.runner.speculator
        assert run_to_completion(e, {"0": prompt}, params)["0"] == plain
        assert (sp.num_plain_steps > 0) == off
        rings.append(sp.taps)
    end = len(prompt) + len(plain) - 1  # positions 0 .. end - 1 computed by both
    pos = np.arange(end - rings[0].window, end)
    got, want = (r.values[0, torch.from_numpy(pos % r.capacity)] for r in rings)
    assert bool(got.abs().sum(dim=-1).gt(0).all())  # every position written
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_plain_graphs_of_every_size_with_the_switch(tiny_v41: str) -> None:
    """Without the switch plain steps run only for batches of disable_by_batch_size or more, so smaller graphs are
    not captured; with it plain steps run at any size: every size is captured."""
    def sizes(adaptive: bool) -> list[int]:
        spec = {"method": "dspark", "disable_by_batch_size": 3, "adaptive": adaptive}
        return LLMEngine.from_args(tiny_v41, max_num_seqs=4, speculative_config=spec).runner.graphs.capture_sizes

    assert sizes(False) == [4] and sizes(True) == [1, 2, 4]


def test_config_switch() -> None:
    mtp = DrafterSpec("deepseek_v4", "mtp", 1)
    assert parse_speculative_config({"method": "mtp", "adaptive": True}, mtp).adaptive
    assert not parse_speculative_config({"method": "mtp"}, mtp).adaptive
    with pytest.raises(Exception, match="adaptive.*true or false"):
        parse_speculative_config({"method": "mtp", "adaptive": "yes"}, mtp)
