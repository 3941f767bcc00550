"""Plain steps of a speculative engine under CUDA graphs (their graphs output the drafter's taps beside the hidden
states) and the adaptive switch (`"adaptive": true`, dsv4/spec_decode/gate.py) with real step times: tiny V4.1 and
its random DSpark drafter, fp32 on CUDA. Greedy output equals the plain engine's; plain steps replay graphs and
leave the tap ring as speculative steps leave it; a drafter that never helps gets switched off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams
from engine_runs import run_to_completion

PARAMS = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int], list[int]]:
    path = make_model("tiny-v41", str(tmp_path_factory.mktemp("m")), seed=0)
    prompt = torch.randint(5, 200, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4)
    assert e.runner.graphs.enabled
    return path, prompt, run_to_completion(e, {"0": prompt}, PARAMS)["0"]


def _engine(path: str, spec: dict) -> LLMEngine:
    return LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4,
                               speculative_config={"method": "dspark", "num_speculative_tokens": 3, **spec})


def test_plain_graph_steps_write_the_taps(setup: tuple) -> None:
    """disable_by_batch_size 1: every decode step is a plain graph replay; its taps equal those the speculative
    engine's (eager) verify steps wrote for the same positions."""
    path, prompt, plain = setup
    rings = []
    for spec in ({"disable_by_batch_size": 1}, {}):
        e = _engine(path, spec)
        replays = []
        replay = e.runner.graphs.replay
        e.runner.graphs.replay = lambda size, replay=replay: (replays.append(size), replay(size))[1]
        assert run_to_completion(e, {"0": prompt}, PARAMS)["0"] == plain
        assert bool(replays) == ("disable_by_batch_size" in spec)
        rings.append(e.runner.speculator.taps)
    end = len(prompt) + len(plain) - 1
    pos = torch.from_numpy(np.arange(end - rings[0].window, end))
    got, want = (r.values[0, pos % r.capacity] for r in rings)
    assert bool(got.abs().sum(dim=-1).gt(0).all())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_adaptive_switch_turns_a_random_drafter_off(setup: tuple) -> None:
    """The random drafter (nothing accepted) at an eager verify step against a graph-replayed plain step: after its
    first trial the switch runs plain steps (graphs) but for trials; the output is plain decoding's."""
    path, prompt, plain = setup
    e = _engine(path, {"adaptive": True})
    sp = e.runner.speculator
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    want = run_to_completion(LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4),
                             {"0": prompt}, params)["0"]
    assert run_to_completion(e, {"0": prompt}, params)["0"] == want
    assert sp.gate.num_closes >= 1 and sp.num_plain_steps > 100
    assert sp.gate.spec_s[1] > sp.gate.plain_s[1]
