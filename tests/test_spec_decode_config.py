"""`--speculative-config` parsing and its validation against the checkpoint's drafter (dsv4/spec_decode/config.py):
DSpark for DeepSeek-V4.1, MTP for DeepSeek-V4, one ConfigError naming the field for everything else."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest

from dsv4.models.config import ConfigError
from dsv4.spec_decode.config import (DEFAULT_DISABLE_BY_BATCH_SIZE, DSPARK, MTP, DrafterSpec, SpeculativeConfig,
                                     drafter_spec, parse_dspark, parse_speculative_config)

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny", "config.json")


@pytest.fixture()
def v41() -> dict:
    """The golden tiny V4.1 config with a drafter: three stages (the golden checkpoint itself has none)."""
    with open(GOLDEN) as f:
        raw = json.load(f)
    raw["text_config"]["num_nextn_predict_layers"] = 3
    return raw


@pytest.fixture()
def v4() -> dict:
    return {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1}


def _with(raw: dict, **changes: object) -> dict:
    out = copy.deepcopy(raw)
    out["text_config"].update(changes)
    return out


def _error(value: object, spec: DrafterSpec) -> str:
    with pytest.raises(ConfigError) as e:
        parse_speculative_config(value, spec)
    return str(e.value)


def test_v41_checkpoint_has_dspark_with_its_fields(v41: dict) -> None:
    spec = drafter_spec(v41)
    assert spec.method == DSPARK and spec.num_layers == 3
    ds = spec.dspark
    assert ds is not None
    assert (ds.num_stages, ds.block_size, ds.noise_token_id, ds.target_layer_ids) == (3, 5, 287, (2, 4, 5))
    assert (ds.markov_rank, ds.n_routed_experts, ds.num_experts_per_tok) == (256, 128, 3)
    flat = {**v41["text_config"], "model_type": "deepseek_v41_text"}
    assert drafter_spec(flat) == dataclasses.replace(spec, model_type="deepseek_v41_text")


def test_dspark_defaults_to_the_block_size_and_accepts_fewer(v41: dict) -> None:
    spec = drafter_spec(v41)
    assert parse_speculative_config({"method": "dspark"}, spec) == SpeculativeConfig(
        DSPARK, 5, DEFAULT_DISABLE_BY_BATCH_SIZE[DSPARK], verify_decode=True, drafter_cuda_graphs=True)
    got = parse_speculative_config('{"method": "dspark", "num_speculative_tokens": 3, "disable_by_batch_size": 8}',
                                   spec)
    assert got == SpeculativeConfig(DSPARK, 3, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.num_speculative_tokens = 4  # type: ignore[misc]


def test_defaults_are_the_measured_ones_and_each_can_be_turned_off(v41: dict, v4: dict) -> None:
    """Absent keys: the measured break-even batch (DSpark 32, MTP none measured), verify rows and drafter graphs on,
    the adaptive switch off. An explicit null batch means no limit (vLLM's default); false turns a switch off."""
    assert DEFAULT_DISABLE_BY_BATCH_SIZE == {DSPARK: 32, MTP: None}
    dspark, mtp = drafter_spec(v41), drafter_spec(v4)
    d = parse_speculative_config({"method": "dspark"}, dspark)
    assert d is not None and (d.disable_by_batch_size, d.verify_decode, d.drafter_cuda_graphs, d.adaptive) == (
        32, True, True, False)
    m = parse_speculative_config({"method": "mtp"}, mtp)
    assert m is not None and (m.disable_by_batch_size, m.verify_decode, m.drafter_cuda_graphs) == (None, True, True)
    off = parse_speculative_config('{"method": "dspark", "disable_by_batch_size": null, "verify_decode": false, '
                                   '"drafter_cuda_graphs": false}', dspark)
    assert off is not None and (off.disable_by_batch_size, off.verify_decode, off.drafter_cuda_graphs) == (
        None, False, False)


@pytest.mark.parametrize("k", [0, 6, 7, -1])
def test_dspark_k_outside_the_block_is_refused(v41: dict, k: int) -> None:
    msg = _error({"method": "dspark", "num_speculative_tokens": k}, drafter_spec(v41))
    assert "`num_speculative_tokens`" in msg and "dspark_block_size" in msg


@pytest.mark.parametrize("k", ["5", 5.0, True])
def test_k_must_be_an_integer(v41: dict, k: object) -> None:
    assert "must be an integer" in _error({"method": "dspark", "num_speculative_tokens": k}, drafter_spec(v41))


def test_mtp_on_v41_is_refused(v41: dict) -> None:
    msg = _error({"method": "mtp"}, drafter_spec(v41))
    assert "`method`" in msg and "no MTP module" in msg and '"dspark"' in msg


def test_checkpoint_without_a_drafter(v41: dict) -> None:
    spec = drafter_spec(_with(v41, num_nextn_predict_layers=0))
    assert spec.method is None and spec.dspark is None
    assert "ships none" in _error({"method": "dspark"}, spec)


def test_v4_has_mtp(v4: dict) -> None:
    spec = drafter_spec(v4)
    assert spec == DrafterSpec("deepseek_v4", MTP, 1)
    assert parse_speculative_config({"method": "mtp"}, spec) == SpeculativeConfig(MTP, 1, None)
    assert parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2}, spec).num_speculative_tokens == 2
    assert "`num_speculative_tokens`" in _error({"method": "mtp", "num_speculative_tokens": 9}, spec)
    msg = _error({"method": "dspark"}, spec)
    assert "`method`" in msg and "1 MTP layer(s)" in msg


def test_v4_refresh_with_dspark_fields_has_no_runnable_drafter(v4: dict) -> None:
    raw = {**v4, "dspark_block_size": 5, "dspark_target_layer_ids": [40, 41, 42]}
    assert drafter_spec(raw).method is None
    assert drafter_spec({**v4, "num_nextn_predict_layers": 0}).method is None


def test_no_config_means_no_speculation(v41: dict) -> None:
    spec = drafter_spec(v41)
    assert parse_speculative_config(None, spec) is None
    assert parse_speculative_config("  ", spec) is None


@pytest.mark.parametrize("value, field, hint", [
    ({"method": "dspark", "num_speculative_token": 5}, "num_speculative_token",
     "did you mean `num_speculative_tokens`"),
    ({"method": "dspark", "draft_sample_method": "probabilistic"}, "draft_sample_method", "vLLM option"),
    ({"method": "dspark", "foo": 1}, "foo", "accepted keys: method, num_speculative_tokens"),
    ({"method": "deepseek_mtp"}, "method", "use `mtp`"),
    ({"method": "eagle"}, "method", "dspark or mtp"),
    ({}, "method", "None is not supported"),
    ({"method": "dspark", "disable_by_batch_size": 0}, "disable_by_batch_size", "must be >= 1"),
])
def test_bad_fields_name_the_field(v41: dict, value: dict, field: str, hint: str) -> None:
    msg = _error(value, drafter_spec(v41))
    assert f"`{field}`" in msg and hint in msg


def test_bad_json(v41: dict) -> None:
    spec = drafter_spec(v41)
    assert "not valid JSON" in _error("{method: dspark}", spec)
    assert "JSON object" in _error("[1, 2]", spec)


def test_dspark_fields_are_validated(v41: dict) -> None:
    for changes, field in [({"dspark_target_layer_ids": [2, 4, 6]}, "dspark_target_layer_ids"),
                           ({"dspark_target_layer_ids": [2, 2, 4]}, "dspark_target_layer_ids"),
                           ({"dspark_noise_token_id": 288}, "dspark_noise_token_id"),
                           ({"dspark_noise_token_id": None}, "dspark_noise_token_id"),
                           ({"dspark_block_size": 0}, "dspark_block_size"),
                           ({"dspark_num_experts_per_tok": 129}, "dspark_num_experts_per_tok")]:
        with pytest.raises(ConfigError, match=f"`{field}`"):
            parse_dspark(_with(v41, **changes))


def test_target_layers_default_to_the_last_non_kv_source_layers(v41: dict) -> None:
    raw = _with(v41)
    del raw["text_config"]["dspark_target_layer_ids"]
    ds = parse_dspark(raw)
    assert ds is not None and ds.target_layer_ids == (2, 4, 5)  # KV sources are 1 and 3
