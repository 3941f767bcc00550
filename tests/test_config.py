"""config.json -> ModelConfig: the tiny config, legacy fields, rope tables against HF, and field-naming errors."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from dsv4.models.config import (CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, ModelConfig, RopeConfig,
                                load_model_config, parse_config_dict)
from hf_reference import TINY_CONFIG, build_hf_model, hf_config, save_hf_model, tiny_config

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
# V4-Flash-like shapes for the rope (real head_dim 512, rope dim 64, yarn on 65536 original positions).
V4_ROPE = dict(head_dim=512, partial_rotary_factor=None, qk_rope_head_dim=64, index_head_dim=128,
               max_position_embeddings=1048576, rope_parameters=None,
               rope_scaling=dict(YARN, original_max_position_embeddings=65536))


def test_tiny_config() -> None:
    cfg = parse_config_dict(tiny_config())
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.compress_ratios == (0, 4, 8, 4)
    assert cfg.compressed_ratios == (4, 8)
    assert cfg.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == \
        (256, 64, 4, 4, 32)
    assert cfg.qk_rope_head_dim == 8
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size) == (32, 2, 16, 32)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 2, 1)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (2, 16, 4, 16)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.swiglu_limit) == (4, 20, 1e-6, 10.0)
    assert cfg.rope_main == RopeConfig(theta=10000.0, dim=8)
    assert cfg.rope_compress == RopeConfig(theta=160000.0, dim=8, rope_type="yarn", factor=16.0,
                                           original_max_position_embeddings=64)
    assert cfg.rope_for_layer(0) is cfg.rope_main and cfg.rope_for_layer(1) is cfg.rope_compress
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0 and not cfg.tie_word_embeddings
    assert cfg.num_nextn_predict_layers == 0


def test_hf_saved_config_parses_the_same(tmp_path: Any) -> None:
    """The config.json that transformers writes (nested rope_parameters, derived lists) means the same model."""
    save_hf_model(build_hf_model(), str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        saved = json.load(f)
    assert isinstance(saved["rope_parameters"].get("main"), dict)  # HF rewrote the flat dict as nested
    assert load_model_config(str(tmp_path)) == parse_config_dict(tiny_config(dtype="float32"))


def _hf_view(raw: dict[str, Any]) -> tuple:
    cfg = hf_config(raw)
    rates = cfg.compress_rates
    return (tuple(cfg.layer_types), tuple(0 if t == SLIDING else rates[t] for t in cfg.layer_types),
            tuple(cfg.mlp_layer_types), cfg.qk_rope_head_dim)


def _our_view(cfg: ModelConfig) -> tuple:
    return cfg.layer_types, cfg.compress_ratios, cfg.mlp_layer_types, cfg.qk_rope_head_dim


LEGACY = {
    # real V4 configs ship per-layer compress_ratios, one entry longer than the layers (the MTP layer)
    "compress_ratios": dict(layer_types=None, compress_rates=None, compress_ratios=[0, 4, 128, 4, 0]),
    "compress_rate_scalars": dict(compress_rates=None, compress_rate_csa=8, compress_rate_hca=16),
    "num_hash_layers": dict(mlp_layer_types=None, num_hash_layers=1),
    "default_hash_layers": dict(mlp_layer_types=None, num_hidden_layers=5, layer_types=None),
    "qk_rope_head_dim": dict(partial_rotary_factor=None, qk_rope_head_dim=16),
    "default_rotary": dict(partial_rotary_factor=None, head_dim=64, index_head_dim=16),
    "long_layer_types": dict(layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA]),
}


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_legacy_fields_fold_like_hf(case: str) -> None:
    raw = tiny_config(**LEGACY[case])
    assert _our_view(parse_config_dict(raw)) == _hf_view(raw)


def test_legacy_values() -> None:
    """The folds, spelled out (so a shared mistake with HF would still show)."""
    cfg = parse_config_dict(tiny_config(**LEGACY["compress_ratios"]))
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA) and cfg.compress_ratios == (0, 4, 128, 4)
    cfg = parse_config_dict(tiny_config(**LEGACY["compress_rate_scalars"]))
    assert cfg.compress_ratios == (0, 8, 16, 8)
    assert parse_config_dict(tiny_config(**LEGACY["num_hash_layers"])).mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert parse_config_dict(tiny_config(**LEGACY["default_hash_layers"])).mlp_layer_types == \
        (HASH_MOE,) * 3 + (MOE,) * 2
    assert parse_config_dict(tiny_config(**LEGACY["qk_rope_head_dim"])).qk_rope_head_dim == 16
    assert parse_config_dict(tiny_config(**LEGACY["default_rotary"])).qk_rope_head_dim == 8  # 64 * 64/512


def test_flat_rope_scaling_applies_to_compress_only() -> None:
    cfg = parse_config_dict(tiny_config(rope_parameters=None, rope_scaling=dict(YARN, rope_theta=1.0)))
    assert cfg.rope_main == RopeConfig(theta=10000.0, dim=8)
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.theta == 160000.0
    assert cfg.rope_compress.factor == 16.0 and cfg.rope_compress.original_max_position_embeddings == 64


def test_nested_rope_parameters() -> None:
    cfg = parse_config_dict(tiny_config(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 5000.0},
        "compress": dict(YARN, rope_theta=80000.0, factor=4.0)}))
    assert cfg.rope_main == RopeConfig(theta=5000.0, dim=8)
    assert cfg.rope_compress.theta == 80000.0 and cfg.rope_compress.factor == 4.0


ROPE_CASES = {
    "tiny_flat_yarn": {},
    "default_both": dict(rope_parameters=None),
    "legacy_rope_scaling": dict(rope_parameters=None, rope_scaling=YARN),
    "legacy_type_key": dict(rope_parameters=None, rope_scaling={"type": "yarn", "factor": 16.0,
                                                                "original_max_position_embeddings": 64}),
    "flat_theta_ignored": dict(rope_parameters=dict(YARN, rope_theta=1234.0)),
    "yarn_factor4_betas": dict(rope_parameters=dict(YARN, factor=4.0, beta_fast=16, beta_slow=2)),
    "yarn_no_original_len": dict(rope_parameters={"rope_type": "yarn", "factor": 8.0}),
    "v4_flash": V4_ROPE,
    "v4_truncate_false": dict(V4_ROPE, rope_scaling=dict(V4_ROPE["rope_scaling"], truncate=False)),
    "v4_thetas": dict(V4_ROPE, rope_theta=50000.0, compress_rope_theta=1e6),
    "nested": dict(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        "compress": dict(YARN, rope_theta=80000.0, partial_rotary_factor=0.25)}),
    "nested_yarn_main": dict(rope_parameters={
        "main": dict(YARN, rope_theta=5000.0, factor=2.0, partial_rotary_factor=0.25),
        "compress": dict(YARN, rope_theta=80000.0, partial_rotary_factor=0.25)}),
    "nested_without_thetas": dict(rope_parameters={"main": {"rope_type": "default"}, "compress": dict(YARN)}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_matches_hf(case: str) -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = tiny_config(**ROPE_CASES[case])
    ours = parse_config_dict(raw)
    rot = DeepseekV4RotaryEmbedding(hf_config(raw))
    for table, hf in ((ours.rope_main, rot.main_inv_freq), (ours.rope_compress, rot.compress_inv_freq)):
        mine = torch.tensor(table.inv_freq(), dtype=torch.float32)
        assert mine.shape == hf.shape
        # HF computes base ** (i/dim) in float32; ours in float64 then rounds: a few ulp apart at most.
        torch.testing.assert_close(mine, hf.float(), rtol=3e-7, atol=0.0)


def test_yarn_table_bends() -> None:
    """Guard against a yarn table that silently equals the default one: for V4-Flash the ramp is low=15, high=25
    (model.md 1.1): pairs 0..15 keep the frequency, 25..31 are divided by 16."""
    r = parse_config_dict(tiny_config(**V4_ROPE)).rope_compress
    plain = RopeConfig(theta=r.theta, dim=r.dim).inv_freq()
    bent = r.inv_freq()
    assert bent[:16] == plain[:16]
    assert all(abs(b * 16 - p) <= 1e-12 * p for b, p in zip(bent[25:], plain[25:]))
    assert all(p / 16 < b < p for b, p in zip(bent[16:25], plain[16:25]))


ERRORS = {
    "model_type": dict(model_type="deepseek_v3"),
    "layer_types": dict(layer_types=[SLIDING, CSA, "full_attention", CSA]),
    "layer_types ": dict(layer_types=[SLIDING, CSA, HCA]),  # too short
    "mlp_layer_types": dict(mlp_layer_types=[HASH_MOE, "dense", MOE, MOE]),
    "o_groups": dict(o_groups=3),
    "num_experts_per_tok": dict(num_experts_per_tok=9),
    "compress_ratios": dict(layer_types=None, compress_ratios=[0, 4, 64, 4]),
    "partial_rotary_factor": dict(partial_rotary_factor=0.1),
    "scoring_func": dict(scoring_func="relu"),
    "eos_token_id": dict(eos_token_id=300),
}


@pytest.mark.parametrize("field_name", sorted(ERRORS))
def test_errors_name_the_field(field_name: str) -> None:
    with pytest.raises(ConfigError, match=f"`{field_name.strip()}`"):
        parse_config_dict(tiny_config(**ERRORS[field_name]))


def test_load_model_config_errors(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    assert load_model_config(str(tmp_path)).hidden_size == 64
