"""Pipelined speculative steps (async scheduling with `"verify_decode": true`, dsv4/spec_decode/pipelined.py): the
steady verify steps are scheduled before the previous step's acceptance reaches the host, their counts, acceptance
and drafts kept on the device. Greedy output equals plain decoding with the random, a partly wrong and an all-right
(oracle) drafter, through arrivals (drains), aborts, stop tokens, max_tokens, prefix caching, preemption, sampled
requests beside greedy ones, and the graph path; the device acceptance rule equals the host rule.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from dsv4.config import SchedulerConfig
from dsv4.engine.engine import LLMEngine, speculative_async_request
from dsv4.make_model import default_model_dir
from dsv4.models.config import ConfigError
from dsv4.runtime.sampler import SamplingTensors
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import SpeculativeConfig
from dsv4.spec_decode.drafter_graphs import GraphedDSparkProposer, GraphedMTPProposer
from dsv4.spec_decode.pipelined import PipelinedVerify, accept_greedy, verify_on_device
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.verify_decode import verify_capture_sizes
from engine_runs import (RerunGraphs, demo_code_prompts, oracle_sequences, prefix_or_preemption_case, run_to_completion,
                         top_k_probs)
from test_spec_decode import _chi_square_p, pair_chi_square_p

# lengths 5, 13, 2, 8: the first verify step's anchor at odd and even positions (ratio-2 pairs)
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23], [0, 44],
           [0, 7, 70, 170, 270, 370, 3, 4]]
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def _spec(k: int, method: str = "dspark", **extra: Any) -> dict[str, Any]:
    # no batch-size limit: the tests' batches (up to 64) all draft
    return {"method": method, "num_speculative_tokens": k, "verify_decode": True, "disable_by_batch_size": None,
            **extra}


def _engine(model_dir: str, k: int | None, oracle: dict[str, list[int]] | None = None, pipelined: bool = True,
            method: str = "dspark", **kw: Any) -> LLMEngine:
    kw.setdefault("max_num_seqs", 4)
    e = LLMEngine.from_args(model_dir, speculative_config=_spec(k, method) if k else None,
                            async_scheduling=pipelined if k else False, **kw)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, 4))
    return e


@pytest.fixture(scope="module")
def baseline(tiny_v41: str) -> dict[str, list[int]]:
    """Plain decoding of every prompt (greedy: batching does not change the tokens)."""
    return run_to_completion(_engine(tiny_v41, None), {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY)


@pytest.fixture(scope="module")
def baseline_v4(tiny_v4: str) -> dict[str, list[int]]:
    """tiny-v4's plain decoding of every prompt (the MTP cases)."""
    return run_to_completion(_engine(tiny_v4, None), {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY)


def _oracle(baseline: dict[str, list[int]], ids: list[int], wrong_every: int = 0) -> dict[str, list[int]]:
    """Request r (prompt ids[r]) drafts its plain continuation (`oracle_sequences`)."""
    return oracle_sequences([PROMPTS[i] for i in ids], [baseline[str(i)] for i in ids], wrong_every)


def _host_accept(target: list[int], ids: list[int], known: int) -> int:
    """The synchronous rule (dsv4.spec_decode.rejection.verify, greedy rows): the drafts are ids[known:]; draft x_i
    is accepted while every draft before it was and it equals the target's token at the row before it."""
    j = 0
    for i in range(known, len(ids)):
        if target[i - 1] != ids[i]:
            break
        j += 1
    return j


def test_device_acceptance_equals_the_host_rule() -> None:
    g = torch.Generator().manual_seed(0)
    for q in (2, 3, 4, 6):
        R = 64
        ids = torch.randint(0, 3, (R, q), generator=g)
        target = torch.randint(0, 3, (R, q), generator=g)
        # some rows all accepted, some with the run broken at every depth (3 symbols: many matches)
        target[:8, :-1] = ids[:8, 1:]
        known = torch.randint(1, min(q, 3), (R,), generator=g)
        j = accept_greedy(target, ids, known)
        want = [_host_accept(t, i, int(a)) for t, i, a in zip(target.tolist(), ids.tolist(), known.tolist())]
        assert j.tolist() == want
        assert (j <= q - known).all() and (j >= 0).all()


@pytest.mark.parametrize("known", [1, 2])
def test_device_rejection_sampling_keeps_the_target_distribution(known: int) -> None:
    """verify_on_device on fixed logits, many requests, unseeded draws from one generator: the first emitted token
    is distributed as the anchor row's p (temperature and top-k applied), whatever the draft, and the second, given
    the first draft accepted, as the next row's. A row before the anchor (known = 2: two known tokens pending)
    verifies nothing. Fails for an off-by-one between drafts and rows."""
    V, q, n = 8, 4, 4000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(q, V, generator=gen) * 1.5
    a = known - 1  # the anchor row
    row = [3] * q
    row[known] = int(logits[a].argmax())  # a likely first draft, then a second choice
    row[known + 1] = int(logits[a + 1].argsort()[-2])
    ids = torch.tensor([row] * n)
    params = [SamplingParams(temperature=0.8, top_k=6)] * (n * q)
    st = SamplingTensors.build(params, [[]] * len(params), [[]] * len(params), V, "cpu")
    j, bonus = verify_on_device(logits.repeat(n, 1), ids, torch.full((n,), known), st, gen)
    first = torch.where(j > 0, ids[:, known], bonus).tolist()
    p = torch.softmax(torch.where(logits >= logits.topk(6).values[:, -1:], logits, -torch.inf) / 0.8, dim=-1)

    def check(tokens: list[int], probs: torch.Tensor) -> None:
        counts = Counter(tokens)
        m = len(tokens)
        keep = [v for v in range(V) if probs[v] > 0]
        assert set(counts) <= set(keep)
        assert _chi_square_p([counts[v] for v in keep], [m * float(probs[v]) for v in keep]) > 1e-3

    check(first, p[a])
    acc = j > 0
    second = torch.where(j[acc] > 1, ids[acc, known + 1], bonus[acc]).tolist()
    assert len(second) > 500
    check(second, p[a + 1])
    assert (j == 0).any() and (j == q - known).any()


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("ids", [[0], [2, 1], [3, 0, 2, 1]], ids=["b1", "b2", "b4"])
@pytest.mark.parametrize("wrong_every", [0, 3, -1], ids=["accept", "reject", "random"])
def test_greedy_equals_plain_decoding(tiny_v41: str, baseline: dict[str, list[int]], k: int, ids: list[int],
                                      wrong_every: int) -> None:
    """All drafts accepted, a wrong draft every 3 positions (partial acceptance at every depth, rejected rows in
    the rings' slack) or the checkpoint's random drafter (almost nothing accepted); k + 1 = 2, 3, 4 rows a request.
    After the prefill step everything is pipelined, and an all-accepting drafter stays all accepted."""
    oracle = None if wrong_every < 0 else _oracle(baseline, ids, wrong_every)
    e = _engine(tiny_v41, k, oracle)
    outs = run_to_completion(e, {str(r): PROMPTS[i] for r, i in enumerate(ids)}, GREEDY)
    assert outs == {str(r): baseline[str(i)] for r, i in enumerate(ids)}
    sp = e.runner.speculator
    assert sp.pipeline is not None and sp.pipeline.num_steps > 0 and not sp.pipeline.in_flight
    st = e.spec_decode_stats
    if wrong_every == 0:
        assert st.num_accepted_tokens == st.num_draft_tokens > 0
    elif wrong_every == 3 and k > 1:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("ids", [[0], [3, 0, 2]], ids=["b1", "b3"])
@pytest.mark.parametrize("wrong_every", [0, 3, -1], ids=["accept", "reject", "random"])
def test_mtp_greedy_equals_plain_decoding(tiny_v4: str, baseline_v4: dict[str, list[int]], k: int, ids: list[int],
                                          wrong_every: int) -> None:
    """DeepSeek-V4 with its MTP layer (or the oracle): a rejection needs no restore (its compressor rings keep k + 1
    rows of slack); every verify step after the prefill is pipelined."""
    oracle = None if wrong_every < 0 else _oracle(baseline_v4, ids, wrong_every)
    e = _engine(tiny_v4, k, oracle, method="mtp")
    outs = run_to_completion(e, {str(r): PROMPTS[i] for r, i in enumerate(ids)}, GREEDY)
    assert outs == {str(r): baseline_v4[str(i)] for r, i in enumerate(ids)}
    sp = e.runner.speculator
    assert sp.pipeline is not None and sp.pipeline.num_steps > 0
    st = e.spec_decode_stats
    if wrong_every == 0:
        assert st.num_accepted_tokens == st.num_draft_tokens > 0
    elif wrong_every == 3 and k > 1:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_steady_steps_are_pipelined(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """One request (its drafts right for its first 14 tokens, then mostly wrong): its first step prefills
    (synchronous), every later verify step is pipelined, and the last step only lands the one in flight (the request
    ended there; its tokens of the step in flight are dropped)."""
    e = _engine(tiny_v41, 3, _oracle(baseline, [1]))
    vd = e.runner.speculator.verify_decode
    e.add_request(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id="0")
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
    pipe = e.runner.speculator.pipeline
    assert pipe.num_steps == vd.num_decode_steps == steps - 2  # the prefill and the last landing are the others


def test_scheduler_counts_and_device_counts_agree(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """Mid-run, after the in-flight step lands: the scheduler's computed counts and the host mirrors equal the
    device's counts, and no placeholder is left (a planted off-by-one in either would show here first)."""
    e = _engine(tiny_v41, 2, _oracle(baseline, [0, 1], 3))
    for r, i in enumerate([0, 1]):
        e.add_request(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id=str(r))
    for _ in range(8):
        e.step()
    landed, e._in_flight = e._in_flight, None
    assert landed is not None and landed[0].pipelined
    e._apply_output(landed[0], landed[1].result())
    pipe, rs = e.runner.speculator.pipeline, e.runner.req_state
    for req in e.scheduler.running:
        row = rs.req_id_to_row[req.req_id]
        assert req.num_output_placeholders == 0
        assert req.num_computed_tokens == rs.num_computed[row] == int(pipe.computed[row])
        assert req.num_tokens == rs.num_tokens[row] == int(pipe.tokens[row])
        assert rs.token_history[row, : req.num_tokens].tolist() == req.all_token_ids


def test_pipelined_steps_free_window_blocks_only_behind_the_device(tiny_v41: str,
                                                                    baseline: dict[str, list[int]]) -> None:
    """A pipelined schedule counts positions up to a step ahead of the device (more after rejections): the window
    blocks it frees must be behind what the device has surely computed, the start of the step it schedules, or a
    block the step still reads could go to another request."""
    e = _engine(tiny_v41, 3, _oracle(baseline, [1, 3], 3), block_size=4)
    pipe, rs, kv = e.runner.speculator.pipeline, e.runner.req_state, e.kv_manager
    seen: list[tuple[int, int]] = []
    orig = kv.allocate_slots

    def spy(req_id: str, num_tokens: int, num_computed: int = 0) -> Any:
        if pipe.device_ahead and req_id in rs.req_id_to_row:  # a pipelined schedule: the device's start is known
            seen.append((num_computed, int(pipe.computed[rs.req_id_to_row[req_id]])))
        return orig(req_id, num_tokens, num_computed)

    kv.allocate_slots = spy  # type: ignore[method-assign]
    outs = run_to_completion(e, {"0": PROMPTS[1], "1": PROMPTS[3]}, GREEDY)
    assert outs == {"0": baseline["1"], "1": baseline["3"]}
    assert len(seen) > 4 and all(freed_behind <= start for freed_behind, start in seen)
    assert any(freed_behind < start for freed_behind, start in seen)  # (the bound is not always tight)


class _HostReads(TorchFunctionMode):
    """Records every call that brings a tensor's values to the host (on a GPU: a sync), outside graph replays."""

    READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.in_graph = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS and not self.in_graph and not _cpu_only_check():
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _cpu_only_check() -> bool:
    """Whether the read comes from a check that runs on CPU tensors only (the rope table's range check)."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_name == "_check_range":
            return True
        f = f.f_back
    return False


@pytest.mark.parametrize("method", ["dspark", "mtp"])
@pytest.mark.parametrize("drafter_graphs", [True, False], ids=["drafter-graphs", "eager-drafter"])
def test_pipelined_launch_reads_nothing_on_the_host(tiny_v41: str, baseline: dict[str, list[int]], tiny_v4: str,
                                                    baseline_v4: dict[str, list[int]], drafter_graphs: bool,
                                                    method: str) -> None:
    """The CPU side of the GPU test's sync check: a pipelined launch (after the first, which copies the host counts)
    calls nothing that reads a tensor's values on the host (tolist, item, bool, numpy, ...), outside what the CUDA
    graphs replay (the verify rows, and the drafter when its graphs are on: replayed by the stand-in here), with a
    greedy and a sampled request. The eager drafter takes the MoE's fixed-shape path there (the grouped one reads
    its group sizes). DSpark (V4.1) and MTP (V4: its ring copies and restores on the device too). A planted
    `.tolist()` of the acceptance makes it fail."""
    model, want = (tiny_v41, baseline) if method == "dspark" else (tiny_v4, baseline_v4)
    e = LLMEngine.from_args(model, max_num_seqs=4, async_scheduling=True,
                            speculative_config=_spec(3, method, drafter_cuda_graphs=drafter_graphs))
    sp = e.runner.speculator
    vd, p, pipe = sp.verify_decode, sp.proposer, sp.pipeline
    vd.graphs = RerunGraphs(verify_capture_sizes([1, 2, 4], vd.q, 4, None), enabled=True)
    vd.capture()
    managers = [vd.graphs]
    if drafter_graphs:
        assert isinstance(p, GraphedDSparkProposer if method == "dspark" else GraphedMTPProposer)
        p.graphs = RerunGraphs([1, 2, 4], enabled=True)
        p.capture()
        managers.append(p.graphs)
    mode = _HostReads()
    for graphs in managers:
        replay = graphs.replay

        def quiet(size: int, replay: Any = replay) -> torch.Tensor:
            mode.in_graph += 1
            try:
                return replay(size)
            finally:
                mode.in_graph -= 1

        graphs.replay = quiet  # type: ignore[method-assign]
    launch = PipelinedVerify.launch
    checked = []

    def watched(so: Any) -> Any:
        if not pipe.device_ahead:
            return launch(pipe, so)
        with mode:
            out = launch(pipe, so)
        checked.append(len(mode.reads))
        return out

    pipe.launch = watched  # type: ignore[method-assign]
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, ignore_eos=True)
    outs = run_to_completion(e, {"0": PROMPTS[1], "1": PROMPTS[3]}, {"0": GREEDY, "1": sampled})
    assert outs["0"] == want["1"]
    assert len(checked) > 3 and mode.reads == [], sorted(set(mode.reads))


def test_arrivals_aborts_and_stop_tokens(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """Requests arriving while others decode (the engine lands the pipelined step and runs the admission step
    synchronously, then pipelines again), one aborted mid-run, one stopped by a stop token of its plain output:
    the others' outputs are plain decoding's, the stopped one is plain's up to its stop token."""
    e = _engine(tiny_v41, 3, _oracle(baseline, [0, 1, 2, 3], 4))
    stop = baseline["3"][6]
    cut = baseline["3"][: baseline["3"].index(stop) + 1]
    e.add_request(PROMPTS[0], GREEDY, request_id="0")
    outs: dict[str, list[int]] = {}
    step = 0
    while e.has_unfinished_requests() or step < 3:
        if step == 2:
            e.add_request(PROMPTS[1], GREEDY, request_id="1")
            e.add_request(PROMPTS[2], GREEDY, request_id="2")
        if step == 4:
            e.add_request(PROMPTS[3], SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[stop]),
                          request_id="3")
        if step == 6:
            e.abort_request("2")
        for o in e.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    assert outs["0"] == baseline["0"] and outs["1"] == baseline["1"] and outs["3"] == cut
    assert "2" not in outs or outs["2"] == baseline["2"][: len(outs["2"])]
    assert e.runner.speculator.pipeline.num_steps > 0 and not e.scheduler.running


def test_plain_steps_above_the_batch_limit_are_pipelined(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """disable_by_batch_size 3 and four requests of 4, 7, 10 and 14 tokens (right drafts but every third): while
    three or more decode, the plain steps are pipelined (one token a request); when the batch shrinks below 3,
    speculation resumes with a plain step after which the drafter proposes, and the verify steps are pipelined.
    No plain step runs synchronously; outputs are plain decoding's, cut at each max_tokens."""
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=4, async_scheduling=True,
                            speculative_config=_spec(3, disable_by_batch_size=3))
    e.runner.speculator.set_proposer(OracleProposer(_oracle(baseline, [0, 1, 2, 3], 3), 4))
    lengths = [4, 7, 10, 14]
    for i, n in enumerate(lengths):
        e.add_request(PROMPTS[i], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), request_id=str(i))
    sched, sp = e.scheduler, e.runner.speculator
    schedule, sync_plain = sched.schedule, []

    def watched_schedule() -> Any:  # a synchronous step of one known token a request and no admission
        so = schedule()
        n = so.num_scheduled_tokens
        if n and not so.scheduled_new_reqs and all(v == 1 and not sched.requests[q].num_draft_tokens
                                                   for q, v in n.items()):
            sync_plain.append(so)
        return so

    sched.schedule = watched_schedule  # type: ignore[method-assign]
    outs: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    assert outs == {str(i): baseline[str(i)][:n] for i, n in enumerate(lengths)}
    assert sp.num_plain_steps > 0 and sp.num_plain_proposals > 0 and sp.pipeline.num_steps > 0
    assert not sync_plain


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_queued_requests_wait_while_every_slot_is_taken(tiny_v41: str, baseline: dict[str, list[int]],
                                                         policy: str) -> None:
    """Four requests, two slots: while both slots decode and the other two wait (no fairness preemption among
    single-sequence requests), the steps are pipelined; a finish frees a slot and the next step admits
    synchronously. Outputs are plain decoding's."""
    e = _engine(tiny_v41, 2, _oracle(baseline, [0, 1, 2, 3], 4), max_num_seqs=2, scheduling_policy=policy)
    pipe = e.runner.speculator.pipeline
    waited_pipelined = 0
    for r, i in enumerate([0, 1, 2, 3]):
        e.add_request(PROMPTS[i], GREEDY, request_id=str(r))
    outs: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        before, waiting = pipe.num_steps, len(e.scheduler.waiting)
        for o in e.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        waited_pipelined += pipe.num_steps > before and waiting > 0
    assert outs == {str(r): baseline[str(i)] for r, i in enumerate([0, 1, 2, 3])}
    assert waited_pipelined > 0 and e.scheduler.num_preemptions == 0


def test_fairness_preemption_is_not_held_back(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """A request fanned out to four sequences holds every slot when a single request arrives: under "fair" one of
    the four gives its slot up (preempted, recomputed later), so steady pipelined steps must not run past that
    decision. Every sequence ends with plain decoding's tokens."""
    e = _engine(tiny_v41, 2, max_num_seqs=4, scheduling_policy="fair")
    fan = SamplingParams(n=4, max_tokens=14, temperature=0, ignore_eos=True)
    e.add_request(PROMPTS[1], fan, request_id="fan")
    for _ in range(3):
        e.step()
    assert e.runner.speculator.pipeline.num_steps > 0
    e.add_request(PROMPTS[0], GREEDY, request_id="late")
    outs: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o
    assert [list(c.token_ids) for c in outs["fan"].outputs] == [baseline["1"]] * 4
    assert list(outs["late"].outputs[0].token_ids) == baseline["0"]
    assert e.scheduler.num_preemptions > 0


@pytest.mark.parametrize("case", ["prefix_cache", "preemption"])
def test_prefix_caching_and_preemption(tiny_v41: str, case: str) -> None:
    """Units cached at landings are hits for later requests (outputs unchanged); a pool too small for everyone
    preempts in the synchronous steps, never in a pipelined one."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts, kw = prefix_or_preemption_case(case)
    named = {str(i): p for i, p in enumerate(prompts)}
    base = run_to_completion(_engine(tiny_v41, None, **kw), named, params)
    oracle = oracle_sequences(prompts, [base[str(i)] for i in range(len(prompts))], 4)
    e = _engine(tiny_v41, 3, oracle, **kw)
    assert run_to_completion(e, named, params) == base
    assert e.runner.speculator.pipeline.num_steps > 0
    if case == "prefix_cache":
        assert e.kv_manager.prefix is not None and e.kv_manager.prefix.hits > 0
    else:
        assert e.scheduler.num_preemptions > 0


def _top_k_targets(model_dir: str, prompts: list[list[int]], K: int) -> list[dict[int, float]]:
    """The target's next-token distribution after each prompt at temperature 1, top-k K (from plain decoding's
    logprobs, renormalised over the K best)."""
    e = _engine(model_dir, None, max_num_seqs=8)
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=1, temperature=0, logprobs=K), request_id=str(i))
    lps: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                lps[o.request_id] = o.outputs[0].logprobs[0]
    return [top_k_probs(lps[str(i)], K) for i in range(len(prompts))]


def test_sampled_requests_are_pipelined(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """Unseeded sampled requests (temperature, top-p, top-k: params that read no outputs) beside a greedy one: the
    steps are pipelined, the greedy request's output is plain decoding's, the sampled ones run to their length."""
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, top_k=20, ignore_eos=True)
    e = _engine(tiny_v41, 3)
    outs = run_to_completion(e, {str(i): PROMPTS[i] for i in range(3)}, {"0": sampled, "1": GREEDY, "2": sampled})
    assert outs["1"] == baseline["1"] and len(outs["0"]) == len(outs["2"]) == 14
    assert e.runner.speculator.pipeline.num_steps >= 3


@pytest.mark.slow
def test_pipelined_sampling_follows_the_target_softmax(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """Through the engine with the oracle drafter (its drafts are the greedy continuation: often accepted, often
    not): the second token, which the first verify step emits and which is pipelined, follows the target's
    distribution given the first (temperature 1, top-k 4, unseeded: the device's own draws)."""
    prompt, K, rounds, batch = PROMPTS[0], 4, 10, 64
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=K, ignore_eos=True)
    e = _engine(tiny_v41, 1, {str(i): prompt + baseline["0"] for i in range(rounds * batch)}, max_num_seqs=batch)
    outs: dict[str, list[int]] = {}
    for r in range(rounds):  # a round at a time: nobody waits, so the verify steps are pipelined
        outs.update(run_to_completion(e, {str(r * batch + i): prompt for i in range(batch)}, params))
    pairs = Counter(tuple(o[:2]) for o in outs.values())
    firsts = sorted({t1 for t1, _ in pairs})
    targets = _top_k_targets(tiny_v41, [prompt] + [prompt + [t] for t in firsts], K)
    assert pair_chi_square_p(pairs, targets[0], targets[1:]) > 1e-3
    st = e.spec_decode_stats
    assert e.runner.speculator.pipeline.num_steps >= rounds and 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.parametrize("k", [2, 3])
def test_seeded_requests_are_pipelined_and_draw_what_the_synchronous_path_draws(
        tiny_v41: str, baseline: dict[str, list[int]], k: int) -> None:
    """Seeded sampled requests (seeds 7 and 8, top-p) beside a greedy one: their draws are functions of (seed,
    output count) set on the device (dsv4/runtime/seeded_noise.py), so they are pipelined and emit exactly the
    tokens the synchronous speculative engine emits (same logits: both verify as decode rows), and those of a
    third engine whose pipelined steps start at other points (max_num_seqs 2: the third request waits)."""
    params = {"0": GREEDY,
              "1": SamplingParams(max_tokens=14, temperature=0.8, seed=7, ignore_eos=True),
              "2": SamplingParams(max_tokens=14, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)}
    named = {str(i): PROMPTS[i] for i in range(3)}
    sync_e = _engine(tiny_v41, k, pipelined=False)
    sync = run_to_completion(sync_e, named, params)
    e = _engine(tiny_v41, k)
    outs = run_to_completion(e, named, params)
    assert outs == sync and outs["0"] == baseline["0"]
    assert e.runner.speculator.pipeline.num_steps >= 3  # the seeded requests ran pipelined
    assert sync_e.runner.speculator.pipeline is None
    staggered = run_to_completion(_engine(tiny_v41, k, max_num_seqs=2), named, params)
    assert staggered == sync
    assert len({tuple(outs["1"]), tuple(outs["2"])}) == 2 and len(outs["1"]) == 14


def test_graph_path_and_the_trained_drafter() -> None:
    """The built-in trained model (its drafter gets part of its drafts accepted) with the verify rows and the
    drafter's proposals replayed by the CPU stand-in for CUDA graphs (device inputs only: a host read in either
    would break the real graphs too): greedy output equals plain decoding, most steps pipelined."""
    model = default_model_dir()
    prompts = demo_code_prompts(model)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = run_to_completion(LLMEngine.from_args(model, max_num_seqs=4), prompts, params)
    e = LLMEngine.from_args(model, max_num_seqs=4, async_scheduling=True,
                            speculative_config=_spec(3, drafter_cuda_graphs=True))
    sp = e.runner.speculator
    vd = sp.verify_decode
    vd.graphs = RerunGraphs(verify_capture_sizes([1, 2, 4], vd.q, 4, None), enabled=True)
    vd.capture()
    p = sp.proposer
    assert isinstance(p, GraphedDSparkProposer)
    p.graphs = RerunGraphs([1, 2, 4], enabled=True)
    p.capture()
    assert run_to_completion(e, prompts, params) == plain
    st = e.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert sp.pipeline.num_steps > 0 and vd.num_graph_replays == vd.num_decode_steps
    assert p.num_graph_replays > 0 and p.num_eager_proposals == 0


def test_config(tiny_v41: str, tmp_path: Any) -> None:
    """Async scheduling with speculation needs verify_decode (on by default); the scheduler then pipelines k + 1
    tokens. Without async scheduling (the CPU's default) nothing is pipelined."""
    with pytest.raises(ConfigError, match="verify_decode"):
        LLMEngine.from_args(tiny_v41, speculative_config={"method": "dspark", "num_speculative_tokens": 2,
                                                          "verify_decode": False}, async_scheduling=True)
    on = LLMEngine.from_args(tiny_v41, speculative_config={"method": "dspark", "num_speculative_tokens": 2},
                             async_scheduling=True)  # the default verify_decode: pipelined
    assert on.config.scheduler.spec_pipeline_tokens == 3
    e = _engine(tiny_v41, 3)
    assert e.config.scheduler.async_scheduling and e.config.scheduler.spec_pipeline_tokens == 4
    assert e.runner.speculator.pipeline is not None
    off = _engine(tiny_v41, 3, pipelined=False)
    assert off.config.scheduler.spec_pipeline_tokens == 0 and off.runner.speculator.pipeline is None
    assert not LLMEngine.from_args(tiny_v41, speculative_config=_spec(3)).config.scheduler.async_scheduling
    # unset async_scheduling: the device's default (CUDA: pipelined) on one process; off with eager verify steps
    # and over several ranks (pipelined steps there never ran)
    rows, eager = SpeculativeConfig("dspark", 3, 32, True), SpeculativeConfig("dspark", 3, 32, False)
    assert speculative_async_request(rows, None, 1) is None
    assert speculative_async_request(eager, None, 1) is False and speculative_async_request(rows, None, 2) is False
    assert speculative_async_request(rows, True, 2) is True and speculative_async_request(None, None, 2) is None
    bad = e.config.__class__(**{**e.config.__dict__, "scheduler": SchedulerConfig(spec_pipeline_tokens=3)})
    with pytest.raises(ConfigError, match="spec_pipeline_tokens"):
        bad.validate()
    assert np.array_equal(accept_greedy(torch.tensor([[5, 6]]), torch.tensor([[1, 5]]), torch.tensor([1])),
                          torch.tensor([1]))
