"""The decode forward's side stream (dsv4/models/layers/side_stream.py): the compressor's publish, the picks and the
shared expert forked beside the main chain give the same tokens as the inline forward, in CUDA graphs and eagerly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from engine_runs import run_to_completion

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.models.layers.side_stream import SIDE
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def _greedy(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return run_to_completion(eng, {str(i): ids for i, ids in enumerate(prompts)}, params)


@pytest.fixture
def side_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SIDE, "enabled", True)


@pytest.mark.parametrize("eager", [False, True])
def test_golden_greedy_with_side_stream(side_on: None, eager: bool) -> None:
    """fp32: the reference's 16 greedy tokens with the forks on (graphs: the forks are edges of the decode graph)."""
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=96, max_num_seqs=4,
                              enforce_eager=eager)
    assert SIDE.active(eng.runner.kv_caches[0].window)
    assert _greedy(eng, [exp["prompt_token_ids"]], 16)["0"] == exp["greedy_token_ids"]
    if not eager:
        assert eng.runner.graphs.enabled


@pytest.mark.parametrize("batch,preset", [(1, None), (3, None), (8, None), (3, "tiny-v41-noengram"), (1, "tiny-v4"),
                                          (5, "tiny-v4")])
def test_bf16_batch_same_tokens_on_and_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, batch: int,
                                           preset: str | None) -> None:
    """bf16, several requests of different lengths: the forks change where work runs, not what it computes, so
    the greedy tokens are the same as the inline forward's, token for token. Also a V4.1 model without engram (no
    engram fork: a fork left unjoined would fail the graph capture) and a V4 one (its CSA / HCA layers' publish
    and picks, window writes and shared experts forked)."""
    path = GOLDEN if preset is None else make_model(preset, str(tmp_path / preset), seed=0)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, 200, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 60, (batch,), generator=g)]
    runs = []
    for on in (False, True):
        monkeypatch.setattr(SIDE, "enabled", on)
        eng = LLMEngine.from_args(path, device="cuda", dtype="bfloat16", max_model_len=160, max_num_seqs=8,
                                  load_tokenizer=preset is None)
        assert eng.runner.graphs.enabled
        runs.append(_greedy(eng, prompts, 24))
        del eng
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
