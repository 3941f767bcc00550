"""`compile_decode` on the GPU: inductor compiles the decode forward (the Triton kernels included, as user kernels)
before the graphs are captured, and greedy tokens stay those of the uncompiled graphs. The CPU test
(tests/test_compile_decode.py) cannot reach inductor's handling of the Triton kernels: it once passed their float
arguments as fp64, which broke the attention kernel's loop-carried fp32 state at compile time."""

from __future__ import annotations

import json
import os

import torch
from hf_reference import build_hf_model, make_prompt, save_hf_model, tiny_config

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def _greedy(path: str, prompts: list[list[int]], compile_decode: bool, dtype: str) -> list[list[int]]:
    torch._dynamo.reset()
    eng = LLMEngine.from_args(path, device="cuda", dtype=dtype, max_model_len=96, max_num_seqs=2,
                              cudagraph_capture_sizes=(2,), compile_decode=compile_decode, load_tokenizer=False)
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id=str(i))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


def test_compiled_golden_v41_reproduces_reference() -> None:
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    ids = exp["prompt_token_ids"]
    got = _greedy(GOLDEN, [ids, ids[:7]], compile_decode=True, dtype="float32")
    assert got[0] == exp["greedy_token_ids"][:12]
    assert got == _greedy(GOLDEN, [ids, ids[:7]], compile_decode=False, dtype="float32")


def test_compiled_v4_equals_uncompiled(tmp_path) -> None:
    """fp32 only: in bf16, inductor's fusions round differently from the eager kernels, so greedy tokens of a tiny
    random model may legitimately flip; fp32 keeps them identical."""
    raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                         "heavily_compressed_attention": 4}, index_topk=3)
    path = save_hf_model(build_hf_model(raw), str(tmp_path / "v4"))
    prompts = [make_prompt(n, seed=60 + n, vocab_size=256, low=3)[0].tolist() for n in (13, 30)]
    assert _greedy(path, prompts, True, "float32") == _greedy(path, prompts, False, "float32")
