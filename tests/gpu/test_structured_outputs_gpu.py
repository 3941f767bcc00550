"""Structured outputs on the GPU with FULL decode graphs: the graphs end at the hidden states, the grammar's bitmask
is copied to the device and applied to the logits after the replay, and async scheduling lands the previous
step's tokens before the mask is built; constrained outputs stay valid and every token equals the synchronous
engine's."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams, StructuredOutputsParams
from engine_runs import run_to_completion

pytest.importorskip("xgrammar")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PROMPTS = ["Hello, my name is", "The weather today", "JSON:", "Once upon a time"]


def _run(path: str, async_scheduling: bool, requests: list[tuple[str, SamplingParams]]) -> tuple[dict, LLMEngine]:
    eng = LLMEngine.from_args(path, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                              max_num_batched_tokens=64, block_size=16, async_scheduling=async_scheduling)
    assert eng.runner.graphs.enabled
    for i, (prompt, sp) in enumerate(requests):
        eng.add_request(prompt, sp, request_id=str(i))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (list(c.token_ids), c.text, c.finish_reason)
    return done, eng


def test_constrained_with_graphs_async_equals_sync(tmp_path) -> None:
    path = make_model("tiny-v4", str(tmp_path / "tiny-v4"), seed=0)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    free = (PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    requests = [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=80, structured_outputs=so)),
                free,
                (PROMPTS[2], SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=so)),
                (PROMPTS[3], SamplingParams(temperature=0.8, seed=9, max_tokens=40, logprobs=2,
                                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}")))]
    sync, _ = _run(path, False, requests)
    asyn, eng = _run(path, True, requests)
    assert asyn == sync
    for rid in ("0", "2"):
        obj = json.loads(sync[rid][1])
        assert set(obj) == {"name", "age", "color"} and re.fullmatch("[a-z]{1,8}", obj["name"])
        assert 0 <= obj["age"] <= 120 and obj["color"] in ("red", "green", "blue")
    assert sync["3"][2] == "stop" and re.fullmatch(r"[a-z]{3}-\d{2}", sync["3"][1])
    alone, _ = _run(path, True, [free])
    assert alone["0"][0] == sync["1"][0]  # the free request samples what it samples alone
    eng.step()
    assert eng.runner.req_state.num_active == 0 and not eng.runner.grammars._matchers


def test_constrained_rows_beside_speculation_with_graphs() -> None:
    """The built-in model with its trained DSpark drafter, fp32 on CUDA, `verify_decode` and `drafter_cuda_graphs`:
    a JSON-constrained request verifies placeholder drafts beside two free requests that draft, every verify step a
    replayed decode-row graph (none eager), and every greedy output equals the plain engine's (its decode graphs)."""
    from dsv4.make_model import default_model_dir

    model = default_model_dir()
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    requests = [("def __init__(self", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                ("Person:", SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)),
                ("import os\nimport sys\n", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]

    def run(spec: dict[str, Any] | None) -> tuple[dict[str, list[int]], LLMEngine]:
        e = LLMEngine.from_args(model, device="cuda", dtype="float32", max_num_seqs=4, speculative_config=spec)
        prompts = {str(i): p for i, (p, _) in enumerate(requests)}
        return run_to_completion(e, prompts, {str(i): sp for i, (_, sp) in enumerate(requests)}), e

    plain, _ = run(None)
    got, e = run({"method": "dspark", "verify_decode": True, "drafter_cuda_graphs": True})
    assert got == plain
    obj = json.loads(e.tokenizer.decode(got["1"]))
    assert set(obj) == {"name", "age", "color"} and re.fullmatch(r"[a-z]{1,8}", obj["name"])
    vd = e.runner.speculator.verify_decode
    assert vd.num_decode_steps > 0 and vd.num_eager_steps == 0 and vd.num_graph_replays == vd.num_decode_steps
    assert e.spec_decode_stats.num_accepted_tokens > 0  # the free requests' drafts
