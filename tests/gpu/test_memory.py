"""KV pool sizing from gpu_memory_utilization after profiling a worst-case step."""

from __future__ import annotations

import pytest

from dsv4.engine.engine import LLMEngine, default_num_blocks
from dsv4.make_model import make_model
from dsv4.models.config import ConfigError
from dsv4.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("m") / "tiny-v41"), seed=0)


def test_pool_is_capped_at_what_the_limits_can_use(tiny: str) -> None:
    eng = LLMEngine.from_args(tiny, device="cuda", max_model_len=256, max_num_seqs=4)
    assert eng.groups[0].num_blocks == default_num_blocks(eng.config)
    eng.add_request(list(range(5, 60)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "r")
    while eng.has_unfinished_requests():
        eng.step()


def test_budget_smaller_than_one_request_fails_at_start(tiny: str) -> None:
    # a budget of ~150 KB: the start-up memory plan refuses it before loading (the weights alone do not fit); a
    # budget that holds the weights but not one request's KV is refused after the profile ("... does not fit")
    with pytest.raises(ConfigError, match=r"do(es)? not fit.*gpu_memory_utilization=1e-06"):
        LLMEngine.from_args(tiny, device="cuda", max_model_len=1024, max_num_seqs=4, gpu_memory_utilization=1e-6)
