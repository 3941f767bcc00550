"""Speculative decoding (dsv4.spec_decode) on the GPU: tiny V4.1 with its DSpark drafter, fp32 on CUDA. Greedy
outputs with a random drafter and with the oracle drafter equal plain decoding (the plain engine with its CUDA
graphs), under batching, chunked prefill and preemption; the oracle's drafts are all accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.proposer import OracleProposer
from engine_runs import run_to_completion

SPEC = {"method": "dspark", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _run(path: str, prompts: list[list[int]], spec: dict | None, oracle: dict[str, list[int]] | None = None,
         **kw: Any) -> tuple[dict[str, list[int]], LLMEngine]:
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4, speculative_config=spec, **kw)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, 4))
    return run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, GREEDY), e


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8},
                                {"num_kv_blocks": 7, "max_model_len": 128, "max_num_batched_tokens": 64}])
def test_speculative_greedy_equals_plain_on_cuda(tmp_path, kw: dict[str, Any]) -> None:
    path = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 13, 40, 2)]
    plain, e0 = _run(path, prompts, None, **kw)
    assert e0.runner.graphs.enabled  # the reference is the graph-captured plain decode
    rand, e1 = _run(path, prompts, SPEC, **kw)
    assert rand == plain and e1.spec_decode_stats.num_drafts > 0
    oracle = {str(i): p + plain[str(i)] for i, p in enumerate(prompts)}
    orc, e2 = _run(path, prompts, SPEC, oracle, **kw)
    st = e2.spec_decode_stats
    assert orc == plain and st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens


def test_mtp_greedy_equals_plain_on_cuda(tmp_path) -> None:
    """tiny-v4's MTP layer: random drafts (rejected: the compressor rings restored) and the oracle's."""
    path = make_model("tiny-v4", str(tmp_path / "m"), seed=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 13, 40, 2)]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    plain, e0 = _run(path, prompts, None, max_num_batched_tokens=16)
    assert e0.runner.graphs.enabled
    rand, e1 = _run(path, prompts, spec, max_num_batched_tokens=16)
    assert rand == plain and e1.spec_decode_stats.num_drafts > 0
    oracle = {str(i): p + plain[str(i)] for i, p in enumerate(prompts)}
    for seq in oracle.values():  # right for a while, then wrong: partial acceptance
        for j in range(8, len(seq), 5):
            seq[j] = (seq[j] + 1) % 400
    orc, e2 = _run(path, prompts, spec, oracle)
    st = e2.spec_decode_stats
    assert orc == plain and 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_disable_by_batch_size_replays_the_decode_graphs(tmp_path) -> None:
    """disable_by_batch_size 3 over 4 requests: graphs are captured for sizes >= 3 only, the full batch's decode
    steps replay them (no drafts), and drafting resumes once fewer than 3 run; the output is plain decoding's."""
    path = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 13, 40, 2)]
    plain, _ = _run(path, prompts, None)
    spec = {**SPEC, "disable_by_batch_size": 3}
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4, speculative_config=spec)
    runner = e.runner
    assert runner.graphs.enabled and min(runner.graphs.capture_sizes) >= 3
    replays: list[int] = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda size: (replays.append(size), replay(size))[1]
    lengths = [24, 6, 12, 24]
    out = run_to_completion(e, {str(i): p for i, p in enumerate(prompts)},
                            {str(i): SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                             for i, n in enumerate(lengths)})
    assert all(out[str(i)] == plain[str(i)][:n] for i, n in enumerate(lengths))
    assert replays and runner.speculator.num_plain_steps > 0 and e.spec_decode_stats.num_drafts > 0
