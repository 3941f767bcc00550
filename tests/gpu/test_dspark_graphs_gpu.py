"""The DSpark drafter's proposal as real CUDA graphs (`"drafter_cuda_graphs": true`, dsv4/spec_decode/drafter_graphs.py),
fp32 on CUDA: on random tap rings the replayed drafts equal the eager proposer's (1, 2 and 3 requests: exact and
padded graphs); the built-in trained model decodes greedily exactly as plain decoding, with the eager drafter's
acceptance counts, alone and together with the multi-row verify graphs (`verify_decode`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import default_model_dir
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.drafter_graphs import GraphedDSparkProposer
from dsv4.spec_decode.proposer import DSparkProposer
from dsv4.tokenizer import Tokenizer
from engine_runs import run_to_completion

PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _engine(path: str, spec: dict[str, Any] | None) -> LLMEngine:
    return LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4, speculative_config=spec)


@pytest.fixture(scope="module")
def demo() -> tuple[str, dict[str, list[int]], dict[str, list[int]]]:
    model = default_model_dir()
    tok = Tokenizer.from_dir(model)
    texts = ["def __init__(self", "import os\nimport sys\n\n\ndef main(", "class Queue:\n    def "]
    prompts = {str(i): [tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for i, t in enumerate(texts)}
    e = _engine(model, None)
    assert e.runner.graphs.enabled
    return model, prompts, run_to_completion(e, prompts, PARAMS)


def test_replayed_drafts_equal_the_eager_proposers(tiny_v41: str) -> None:
    e = _engine(tiny_v41, {"method": "dspark", "drafter_cuda_graphs": True})
    p = e.runner.speculator.proposer
    assert isinstance(p, GraphedDSparkProposer) and p.graphs.enabled and sorted(p.graphs.graphs) == [1, 2, 4]
    taps = e.runner.speculator.taps
    g = torch.Generator(device="cuda").manual_seed(7)
    taps.values.copy_(torch.randn(taps.values.shape, generator=g, device="cuda"))
    for rows, last in (([2], [0]), ([0, 3], [17, 5]), ([3, 1, 2], [9, 30, 2]), ([1, 1, 0], [6, 6, 40])):
        rows_np, last_np = np.array(rows, dtype=np.int64), np.array(last, dtype=np.int64)
        anchors = torch.randint(5, 400, (len(rows),), generator=g, device="cuda")
        want = DSparkProposer.propose(p, [], rows_np, last_np, anchors, taps)
        before = p.num_graph_replays
        got = p.propose([], rows_np, last_np, anchors, taps).clone()
        assert p.num_graph_replays == before + 1
        assert torch.equal(got, want), (rows, last)


@pytest.mark.parametrize("verify_decode", [False, True])
def test_greedy_equals_plain_with_the_eager_drafters_acceptance(demo: tuple, verify_decode: bool) -> None:
    model, prompts, plain = demo
    eager = _engine(model, {"method": "dspark", "verify_decode": verify_decode})
    assert run_to_completion(eager, prompts, PARAMS) == plain
    e = _engine(model, {"method": "dspark", "verify_decode": verify_decode, "drafter_cuda_graphs": True})
    p = e.runner.speculator.proposer
    assert isinstance(p, GraphedDSparkProposer) and p.graphs.enabled
    # the start-up report's graph memory is what the captures added (it read -6.65 GiB on 2026-12-02: the capture's
    # own emptying of the allocator cache was counted)
    assert e.memory.graphs is not None and e.memory.graphs >= 0
    assert run_to_completion(e, prompts, PARAMS) == plain
    assert p.num_graph_replays > 0 and p.num_eager_proposals == 0
    a, b = e.spec_decode_stats, eager.spec_decode_stats
    assert 0 < a.num_accepted_tokens < a.num_draft_tokens
    assert a.num_accepted_tokens_per_pos == b.num_accepted_tokens_per_pos
