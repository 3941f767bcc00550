"""FULL decode CUDA graphs on the GPU: replay == eager for every capture size, the golden V4.1 tokens through
graphs, mixed prefill+decode steps, preemption under a tiny pool."""

from __future__ import annotations

import json
import os

import pytest

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def _run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 12) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
                        request_id=str(i))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


@pytest.fixture(scope="module")
def presets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("presets")
    return {name: make_model(name, str(root / name), seed=1) for name in ("tiny-v4", "tiny-v41")}


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41", "golden"])
def test_graph_replay_equals_eager(name: str, presets: dict) -> None:
    """Every capture size is hit (1..8 running requests as they finish at different times); tokens identical to
    the eager forward at the same padded shapes, logprobs within fp32 noise."""
    path = GOLDEN if name == "golden" else presets[name]
    prompts = [list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(8)]
    results = {}
    for eager in (True, False):
        eng = LLMEngine.from_args(path, device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8,
                                  max_num_batched_tokens=64, enforce_eager=eager)
        if not eager:
            assert sorted(eng.runner.graphs.graphs) == [1, 2, 4, 8]
        else:  # same padded shapes as the graphs, so the same kernels: fake-quant rounding must agree bit for bit
            eng.runner.graphs.padded_size = lambda n: next(s for s in (1, 2, 4, 8) if s >= n)
        outs = {}
        for i, p in enumerate(prompts):  # staggered lengths: batch sizes 8 down to 1
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, logprobs=2),
                            request_id=str(i))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
        results[eager] = outs
    for rid, out in results[True].items():
        g = results[False][rid]
        assert g.token_ids == out.token_ids, rid
        for a, b in zip(out.logprobs, g.logprobs):
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_golden_through_graphs_with_preemption_and_mixed_steps() -> None:
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    ids = exp["prompt_token_ids"]
    # a tiny pool forces preemptions; a budget of 5 mixes prefill chunks with decodes
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=96, max_num_seqs=4,
                              max_num_batched_tokens=5, block_size=8, num_kv_blocks=10)
    done = _run(eng, [ids, ids[:20], ids[10:], ids[:7]], max_tokens=16)
    assert done["0"].token_ids == exp["greedy_token_ids"]
    assert eng.scheduler.num_preemptions > 0
    assert eng.runner.graphs.graphs, "graphs were captured"


def test_bf16_graphs_run(presets: dict) -> None:
    eng = LLMEngine.from_args(presets["tiny-v41"], device="cuda", dtype="bfloat16", max_model_len=128,
                              max_num_seqs=4)
    done = _run(eng, [list(range(5, 25)), list(range(7, 12))])
    assert all(len(o.token_ids) == 12 for o in done.values())
