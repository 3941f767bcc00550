"""DeepSeek-V4.1 config.json parsing (model.md 1.2): composite and flat layouts, the derived CSA2 schedule, and
clear errors for schedules the model cannot run."""

from __future__ import annotations

import copy
import json
import os

import pytest

from dsv4.models.config import ConfigError, parse_config_dict

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.fixture()
def composite() -> dict:
    with open(os.path.join(GOLDEN, "config.json")) as f:
        return json.load(f)


def _text(raw: dict, **changes) -> dict:
    out = copy.deepcopy(raw)
    out["text_config"].update(changes)
    return out


def test_composite_and_flat_parse_the_same(composite: dict) -> None:
    flat = {**composite["text_config"], "model_type": "deepseek_v41_text"}
    a, b = parse_config_dict(composite), parse_config_dict(flat)
    assert a == b
    s = a.v41
    assert s.kv_source_layer_ids == (1, 3) and s.index_source_layer_ids == (1, 3, 5)
    assert s.candidate_source_layer_id == 3 and s.kv_source_of(4) == 3 and s.index_source_of(4) == 3
    assert s.kv_source_of(0) is None and s.index_source_of(2) == 1
    assert a.compress_ratios == (0, 2, 2, 1, 1, 1) and a.rms_norm_eps == 1e-20
    assert a.rope_main.rope_type == "default" and a.rope_compress.rope_type == "yarn" and a.rope_main.dim == 16
    assert s.engram is not None and s.engram.layer_ids == (1,) and s.engram.compressed_vocab_size == 247


def test_released_schedule_defaults() -> None:
    raw = {"model_type": "deepseek_v41_text", "num_hidden_layers": 40, "num_nextn_predict_layers": 3,
           "vocab_size": 1000, "hidden_size": 64, "q_lora_rank": 16, "head_dim": 64, "qk_rope_head_dim": 16,
           "num_attention_heads": 8, "o_groups": 8, "o_lora_rank": 8, "index_head_dim": 32}
    cfg = parse_config_dict(raw)
    assert cfg.compress_ratios == tuple([0, 0] + [2] * 18 + [1] * 20)
    assert cfg.v41.kv_source_layer_ids == (2, 8, 14, 20)
    assert cfg.v41.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert cfg.v41.candidate_source_layer_id == 20


def test_other_schedule_defaults_to_run_starts() -> None:
    raw = {"model_type": "deepseek_v41_text", "num_hidden_layers": 6, "compress_ratios": [0, 1, 1, 2, 2, 2],
           "vocab_size": 100, "hidden_size": 32, "head_dim": 32, "qk_rope_head_dim": 8, "num_attention_heads": 2,
           "o_groups": 2, "o_lora_rank": 4, "q_lora_rank": 8, "index_head_dim": 16}
    s = parse_config_dict(raw).v41
    assert s.kv_source_layer_ids == (1, 3) and s.index_source_layer_ids == (1, 3) and s.candidate_source_layer_id == 3


@pytest.mark.parametrize("changes,field", [
    (dict(compress_ratios=[0, 3, 2, 1, 1, 1]), "compress_ratios"),
    (dict(kv_source_layer_ids=[0, 3]), "kv_source_layer_ids"),  # ratio 0
    (dict(kv_source_layer_ids=[2, 3], index_source_layer_ids=[2, 3, 5]), "kv_source_layer_ids"),  # layer 1 orphan
    (dict(index_source_layer_ids=[3, 5]), "index_source_layer_ids"),  # KV source 1 is not an index source
    (dict(compress_ratios=[0, 2, 1, 1, 1, 1]), "compress_ratios"),  # consumer 2 has another ratio than source 1
    (dict(candidate_source_layer_id=4), "candidate_source_layer_id"),  # not an index source
    (dict(index_source_layer_ids=[1, 2, 3, 5], candidate_source_layer_id=1), "candidate_source_layer_id"),
    (dict(engram_layer_ids=[9], engram_num_embeddings=[10]), "engram_layer_ids"),
    (dict(gate_temp=0), "gate_temp"),
])
def test_bad_schedules_name_the_field(composite: dict, changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_config_dict(_text(composite, **changes))
