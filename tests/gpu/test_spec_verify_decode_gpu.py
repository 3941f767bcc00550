"""The multi-row decode verify step (`"verify_decode": true`, dsv4/spec_decode/verify_decode.py) on the GPU with its
CUDA graphs: tiny V4.1 with its DSpark drafter, fp32 on CUDA. Greedy outputs with the random drafter, the oracle
drafter and a partly wrong oracle equal plain decoding (the plain engine with its CUDA graphs); every uniform
verify step replays a graph of R * (k + 1) rows; the graph's logits equal the eager token-row forward's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.runtime.input_batch import InputBatch
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.proposer import OracleProposer
from engine_runs import oracle_sequences, run_to_completion

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _spec(k: int) -> dict[str, Any]:
    return {"method": "dspark", "num_speculative_tokens": k, "verify_decode": True}


def _engine(path: str, spec: dict[str, Any] | None, oracle: dict[str, list[int]] | None = None) -> LLMEngine:
    e = LLMEngine.from_args(path, device="cuda", dtype="float32", max_num_seqs=4, speculative_config=spec)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, 4))
    return e


def _generate(e: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    return run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, GREEDY)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]], dict[str, list[int]]]:
    path = make_model("tiny-v41", str(tmp_path_factory.mktemp("m")), seed=0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 13, 40, 2)]
    e0 = _engine(path, None)
    assert e0.runner.graphs.enabled  # the reference is the graph-captured plain decode
    return path, prompts, _generate(e0, prompts)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("drafter", ["dspark", "oracle", "wrong"])
def test_verify_decode_graphs_greedy_equal_plain(setup: tuple, k: int, drafter: str) -> None:
    path, prompts, plain = setup
    oracle = None
    if drafter != "dspark":
        oracle = oracle_sequences(prompts, [plain[str(i)] for i in range(len(prompts))], 3 if drafter == "wrong" else 0)
    e = _engine(path, _spec(k), oracle)
    vd = e.runner.speculator.verify_decode
    assert vd.graphs.enabled and sorted(vd.graphs.graphs) == [k + 1, 2 * (k + 1), 4 * (k + 1)]
    assert _generate(e, prompts) == plain
    # every uniform verify step (at most 4 requests) replays a graph
    assert vd.num_decode_steps > 0 and vd.num_graph_replays == vd.num_decode_steps
    st = e.spec_decode_stats
    if drafter == "oracle":
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


def test_graph_logits_equal_the_eager_forward(setup: tuple) -> None:
    """Each replayed verify step is also run by the eager token-row forward from the same caches (cloned before,
    restored after): the logits agree to the kernels' round-off (Triton decode kernels vs the token-row path)."""
    path, prompts, plain = setup
    e = _engine(path, _spec(3))
    r = e.runner
    vd = r.speculator.verify_decode
    orig = vd.forward
    diffs: list[float] = []

    def both(batch: InputBatch, taps: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        want = r.model.compute_logits(vd.reference_forward(batch))
        got = orig(batch, taps)
        diffs.append(float((r.model.compute_logits(got) - want).abs().max()))
        return got

    vd.forward = both  # type: ignore[method-assign]
    assert _generate(e, prompts) == plain
    assert diffs and vd.num_graph_replays == len(diffs)
    # a wrong row, position or partner moves logits by O(1); the two paths' kernels differ in rounding only (an FP4
    # / FP8 fake-quant step may flip on it, hence not fp32 round-off)
    assert max(diffs) < 1e-2, diffs
