"""Async scheduling on the GPU, with FULL decode graphs: the pending tokens travel through pinned copies and an
event while the next step runs, and every request still ends exactly as with the synchronous engine."""

from __future__ import annotations

import json
import os

import pytest
from hf_reference import make_prompt

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def _run(async_scheduling: bool, dtype: str) -> dict[str, tuple]:
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        golden = json.load(f)["prompt_token_ids"]
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype=dtype, max_model_len=96, max_num_seqs=4,
                              max_num_batched_tokens=24, load_tokenizer=False, async_scheduling=async_scheduling)
    prompts = [golden] + [make_prompt(n, seed=90 + n, vocab_size=288, low=3)[0].tolist() for n in (7, 31, 12)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=-1.5),
              # ignore_eos everywhere: a stop would let async compute one discarded row, which changes later
              # batch shapes and so, in bf16, possibly the rounding of the other rows (the CPU tests cover stops)
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, request_id=str(i))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                lps = None if c.logprobs is None else [sorted(lp) for lp in c.logprobs]
                done[out.request_id] = (c.token_ids, c.finish_reason, lps)
    return done


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_equals_sync_with_graphs(dtype: str) -> None:
    sync, asyn = _run(False, dtype), _run(True, dtype)
    assert asyn == sync
    if dtype == "float32":
        with open(os.path.join(GOLDEN, "expected.json")) as f:
            assert sync["0"][0] == json.load(f)["greedy_token_ids"]
