"""The memory plan (dsv4.engine.memory_plan) and the engram placement decision (dsv4.models.engram_host): weights
by kind from the config, the refusal of a configuration that cannot fit (with its numbers), the report of a started
engine against what the model holds."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsv4.config import CacheConfig, ConfigError, EngineConfig, ParallelConfig, SchedulerConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.memory_plan import KINDS, kind_of, planned_weight_bytes, weights_fit_error
from dsv4.models.build import checkpoint_layout
from dsv4.models.config import parse_config_dict
from dsv4.models.engram_host import AUTO_DEVICE_SHARE, decide_placement
from dsv4.models.presets import preset_config
from dsv4.quant.released import V41_RELEASE

GIB = 1 << 30
H200 = 143771 * (1 << 20)  # total memory torch reports for an H200


def _config(preset: str, **kw) -> EngineConfig:
    cfg = preset_config(preset)
    cfg = cfg if not isinstance(cfg, dict) else parse_config_dict(cfg)
    return EngineConfig(model_dir=None, model=cfg, scheduler=SchedulerConfig(), cache=CacheConfig(), **kw)


@pytest.mark.parametrize("name, kind", [
    ("model.layers.3.ffn.experts.7.w1.weight", "experts"), ("model.layers.3.ffn.experts.gate_up_proj", "experts"),
    ("model.layers.3.ffn.shared_experts.w2.weight", "dense"), ("model.layers.1.engram.embed.weight", "engram"),
    ("model.layers.1.engram.embed.scale", "engram"), ("model.layers.1.engram.wkv.weight", "dense"),
    ("model.embed.weight", "dense"), ("lm_head.weight", "dense"), ("vision_encoder.blocks.0.attn.qkv.weight", "vision"),
    ("model.vision.blocks.0.attn.qkv.weight", "vision"), ("mtp.0.attn.wkv.weight", "drafter"),
    ("mtp.0.ffn.experts.3.w1.weight", "drafter")])
def test_kind_of(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_plan_sums_the_layout_and_splits_by_kind() -> None:
    c = _config("tiny-v41")
    lay = checkpoint_layout(c.model, torch.float32, None)
    plan = planned_weight_bytes(c, torch.float32)
    assert set(plan) == set(KINDS) and plan["drafter"] == 0
    assert sum(plan.values()) == sum(math.prod(s) * d.itemsize for s, d in lay.values())
    experts = sum(math.prod(s) * d.itemsize for n, (s, d) in lay.items() if ".experts." in n)
    assert plan["experts"] == experts > 0 and plan["engram"] > 0
    # expert parallelism over 2 ranks halves the experts, tensor parallelism divides the dense bytes (a lower bound)
    ep = planned_weight_bytes(dataclasses.replace(c, parallel=ParallelConfig(tensor_parallel_size=2,
                                                                              expert_parallel=True)), torch.float32)
    assert ep["experts"] == experts // 2 and ep["dense"] == plan["dense"] // 2 and ep["engram"] == plan["engram"]
    # bf16 halves every float tensor
    assert planned_weight_bytes(c, torch.bfloat16)["dense"] < plan["dense"]


def test_released_v41_flash_needs_more_than_one_h200_and_fits_with_eight() -> None:
    """The released V4.1-Flash (FP8 dense, MXFP4 experts, FP8 engram tables, ~511 GB stored, of it ~203 GB of
    tables): refused on one H200 even with the tables on the host, with the numbers; fits on eight with EP."""
    c = _config("v41-flash", quant=V41_RELEASE)
    plan = planned_weight_bytes(c, torch.bfloat16)
    assert 180 * GIB < plan["engram"] < 200 * GIB  # two tables of 384M rows x 264 B
    assert 250 * GIB < plan["experts"] < 300 * GIB
    err = weights_fit_error(plan, H200, H200 - GIB, 0.9, "auto")
    assert err is not None and "do not fit" in err and "engram tables in host memory, not counted" in err
    assert f"{plan['experts'] / GIB:.2f}" in err and "gpu_memory_utilization=0.9" in err
    with pytest.raises(ConfigError, match="engram tables take"):  # tables forced onto a GPU they cannot fit
        weights_fit_error(plan, H200, H200 - GIB, 0.9, "device")
    ep8 = planned_weight_bytes(dataclasses.replace(c, parallel=ParallelConfig(tensor_parallel_size=8,
                                                                               expert_parallel=True)), torch.bfloat16)
    assert weights_fit_error(ep8, H200, H200 - GIB, 0.9, "auto") is None  # tables on the host
    assert weights_fit_error(ep8, H200, H200 - GIB, 0.9, "host") is None


def test_fit_counts_engram_only_on_the_device() -> None:
    plan = dict.fromkeys(KINDS, 0) | {"dense": 10 * GIB, "experts": 50 * GIB, "engram": 30 * GIB}
    total = free = 100 * GIB
    assert weights_fit_error(plan, total, free, 0.9, "host") is None  # 60 GiB on the GPU
    assert weights_fit_error(plan, total, free, 0.9, "auto") is None  # 30 > 25% of free: host
    assert "engram tables on the device" in weights_fit_error(plan, total, free, 0.85, "device")  # 90 > 85
    assert weights_fit_error(plan, total, free, 0.9, "device") is None  # 90 <= 90
    assert weights_fit_error(plan, total, 55 * GIB, 0.9, "host") is not None  # free memory bounds it too


@pytest.mark.parametrize("total, free, placement, on_device", [
    (10 * GIB, 100 * GIB, "auto", True), (25 * GIB, 100 * GIB, "auto", True), (26 * GIB, 100 * GIB, "auto", False),
    (1, 100 * GIB, "host", False), (90 * GIB, 100 * GIB, "device", True)])
def test_decide_placement(total: int, free: int, placement: str, on_device: bool) -> None:
    assert AUTO_DEVICE_SHARE == 0.25
    got, why = decide_placement(total, free, placement)
    assert got == on_device and placement in why and f"{total / GIB:.2f} GiB" in why
    assert ("on the device" if on_device else "in host memory") in why


def test_decide_placement_errors() -> None:
    with pytest.raises(ConfigError, match="engram_placement must be one of auto, device, host"):
        decide_placement(1, 1, "gpu")
    with pytest.raises(ConfigError, match="take 2.00 GiB but the GPU has 1.00 GiB free"):
        decide_placement(2 * GIB, GIB, "device")
    with pytest.raises(ConfigError, match="engram_placement must be one of"):
        dataclasses.replace(_config("tiny-v41"), engram_placement="gpu").validate()


def test_report_of_a_started_engine(tmp_path) -> None:
    from dsv4.make_model import make_model

    path = make_model("tiny-v41", str(tmp_path / "m"), seed=0)
    eng = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=2)
    rep = eng.memory
    held = sum(t.numel() * t.element_size() for t in eng.runner.model.state_dict().values())
    tables = sum(t.nbytes for t in eng.runner.model.engram_tables.values())
    assert sum(rep.weights.values()) == held + tables  # a CPU engine: the tables are in its device's memory
    assert rep.weights["engram"] == tables > 0 and rep.engram_host == 0 and rep.graphs is None
    assert rep.kv_pool > 0 and rep.device == "cpu"
    assert rep.host_resident is None or rep.host_resident > held
    assert eng.weight_plan["experts"] == rep.weights["experts"]  # the plan's estimate, exact for the experts
    text = "\n".join(rep.lines())
    assert "KV pool" in text and "engram tables" in text and rep.to_json()["kv_pool"] == rep.kv_pool
    assert rep.image_cache == 0 and "image cache" not in text  # no vision tower: no image cache held back


def test_report_counts_the_image_cache_of_a_vision_model(tmp_path) -> None:
    from dsv4.make_model import make_model

    path = make_model("tiny-v41-vl", str(tmp_path / "m"), seed=0)
    for mb in (128, 0):
        rep = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=2, image_cache_mb=mb).memory
        assert rep.image_cache == mb * 2**20 and ("image cache up to 0.12 GiB" in "\n".join(rep.lines())) == (mb > 0)


@pytest.mark.parametrize("preset, method", [("tiny-v41", "dspark"), ("tiny-v4", "mtp")])
def test_plan_and_report_count_the_drafter(tmp_path, preset: str, method: str) -> None:
    """With speculative decoding the plan counts the drafter's weights before loading, exactly what the loaded
    drafter holds (an fp32 CPU engine: every tensor in the model dtype); without it, nothing."""
    from dsv4.make_model import make_model

    path = make_model(preset, str(tmp_path / "m"), seed=0)
    eng = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=2, speculative_config={"method": method})
    held = sum(t.numel() * t.element_size() for t in eng.runner.speculator.proposer.drafter.state_dict().values())
    assert eng.weight_plan["drafter"] == held == eng.memory.weights["drafter"] > 0
    assert "drafter" in "\n".join(eng.memory.lines())
    plain = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=2)
    assert plain.weight_plan["drafter"] == plain.memory.weights["drafter"] == 0
