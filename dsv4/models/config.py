"""config.json -> ModelConfig for the DeepSeek-V4 family.

One frozen dataclass describes the text model the engine builds. It is parsed once from a checkpoint's
config.json, legacy fields folded in, and validated; every later module reads only this object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_KINDS = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

_LEGACY_RATIO_TO_KIND = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(ValueError):
    """A config.json that the engine cannot run; the message names the offending field."""


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: interleaved pairs on the trailing `dim` channels of a vector."""

    theta: float
    dim: int
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def inv_freq(self) -> "list[float]":
        """Per-pair inverse frequencies (yarn-blended when rope_type == 'yarn'; mscale is always 1)."""
        dim, base = self.dim, self.theta
        extrapolation = [1.0 / (base ** (2 * i / dim)) for i in range(dim // 2)]
        if self.rope_type != "yarn":
            return extrapolation

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        out = []
        for i in range(dim // 2):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
            out.append(extrapolation[i] / self.factor * (1 - keep) + extrapolation[i] * keep)
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a DeepSeek-V4 checkpoint (model.md section 1.1)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    max_position_embeddings: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer: 0 for sliding, else the layer's compress rate
    mlp_layer_types: tuple[str, ...]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    torch_dtype: str | None = None
    quantization_config: Any = field(default=None, compare=False)
    v41: Any = None  # V41Schedule (config_v41.py) for DeepSeek-V4.1; None for V4
    vision: Any = None  # VisionConfig (vision.py) of a V4.1 checkpoint with a vision tower; None for text-only

    # ---- derived views -------------------------------------------------------------------
    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        """Distinct compress rates of the model, ascending (one KV group each)."""
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    def rope_for_layer(self, layer: int) -> RopeConfig:
        return self.rope_main if self.layer_types[layer] == SLIDING else self.rope_compress


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config field `{field_name}`: {msg}")


def _get(raw: dict[str, Any], name: str, default: Any) -> Any:
    value = raw.get(name, default)
    return default if value is None and default is not None else value


# Scalar fields both DeepSeek-V4 and V4.1 configs carry: name -> (type, V4 default). V4.1 overrides some defaults.
_SCALARS: dict[str, tuple[type, Any]] = {
    "vocab_size": (int, 129280), "hidden_size": (int, 4096), "moe_intermediate_size": (int, 2048),
    "num_attention_heads": (int, 64), "q_lora_rank": (int, 1024), "num_experts_per_tok": (int, 6),
    "n_routed_experts": (int, 256), "n_shared_experts": (int, 1), "scoring_func": (str, "sqrtsoftplus"),
    "norm_topk_prob": (bool, True), "routed_scaling_factor": (float, 1.5), "hc_mult": (int, 4),
    "hc_sinkhorn_iters": (int, 20), "hc_eps": (float, 1e-6), "swiglu_limit": (float, 10.0),
    "sliding_window": (int, 128), "o_groups": (int, 8), "o_lora_rank": (int, 1024), "index_n_heads": (int, 64),
    "index_head_dim": (int, 128), "index_topk": (int, 512), "rms_norm_eps": (float, 1e-6),
}


def scalar_fields(raw: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    """The shared scalar fields of `raw`, typed, with the V4 defaults unless `defaults` overrides them."""
    return {name: kind(_get(raw, name, defaults.get(name, default))) for name, (kind, default) in _SCALARS.items()}


def _rope_from_dict(d: dict[str, Any], theta: float, dim: int, max_positions: int, where: str) -> RopeConfig:
    rope_type = d.get("rope_type", d.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config field `{where}`: rope_type {rope_type!r} is not supported (default or yarn)")
    theta = float(d.get("rope_theta") or theta)
    if rope_type == "default":
        return RopeConfig(theta=theta, dim=dim)
    if d.get("factor") is None:
        raise ConfigError(f"config field `{where}`: yarn needs `factor`")
    return RopeConfig(
        theta=theta,
        dim=dim,
        rope_type="yarn",
        factor=float(d["factor"]),
        # As HF: a missing original length defaults to max_position_embeddings.
        original_max_position_embeddings=int(d.get("original_max_position_embeddings") or max_positions),
        beta_fast=float(d.get("beta_fast") or 32),
        beta_slow=float(d.get("beta_slow") or 1),
        # HF-V4 reads `truncate` from the top level of its nested rope dict, where it never is, so it always
        # truncates the correction range (as DeepSeek's reference yarn does); a per-table `truncate` is ignored.
        truncate=True,
    )


def parse_v4_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a `deepseek_v4` config.json dict, folding in the legacy fields, and validate it."""
    model_type = raw.get("model_type")
    if model_type != "deepseek_v4":
        raise ConfigError(
            f"config field `model_type`: {model_type!r} is not supported (this engine runs `deepseek_v4`)"
        )
    n = int(_get(raw, "num_hidden_layers", 43))
    _require(n > 0, "num_hidden_layers", f"must be positive, got {n}")
    head_dim = int(_get(raw, "head_dim", 512))

    # compress rates: dict > legacy scalars > defaults
    rates = {CSA: 4, HCA: 128}
    if isinstance(raw.get("compress_rates"), dict):
        for k, v in raw["compress_rates"].items():
            _require(k in (CSA, HCA), "compress_rates", f"unknown key {k!r}")
            rates[k] = int(v)
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = int(raw["compress_rate_hca"])
    for k, v in rates.items():
        _require(v >= 1, "compress_rates", f"{k} rate must be >= 1, got {v}")

    # layer kinds: explicit > legacy per-layer compress_ratios > default schedule
    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("compress_ratios") is not None:
        legacy = list(raw["compress_ratios"])
        bad = [r for r in legacy if r not in _LEGACY_RATIO_TO_KIND]
        _require(not bad, "compress_ratios", f"entries must be 0, 4 or 128 for deepseek_v4; got {bad}")
        layer_types = [_LEGACY_RATIO_TO_KIND[r] for r in legacy]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = list(layer_types)
    _require(len(layer_types) >= n, "layer_types", f"has {len(layer_types)} entries for {n} layers")
    layer_types = layer_types[:n]
    bad = [t for t in layer_types if t not in ATTENTION_KINDS]
    _require(not bad, "layer_types", f"entries must be one of {ATTENTION_KINDS}; got {bad}")

    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    mlp_types = list(mlp_types)
    _require(len(mlp_types) >= n, "mlp_layer_types", f"has {len(mlp_types)} entries for {n} layers")
    mlp_types = mlp_types[:n]
    bad = [t for t in mlp_types if t not in MLP_KINDS]
    _require(not bad, "mlp_layer_types", f"entries must be one of {MLP_KINDS}; got {bad}")

    # partial rotary: explicit factor > legacy qk_rope_head_dim > 64/512
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        legacy_rope = raw.get("qk_rope_head_dim")
        factor = (legacy_rope / head_dim) if legacy_rope is not None else 64 / 512
    rope_dim = int(head_dim * float(factor))
    _require(0 < rope_dim <= head_dim and rope_dim % 2 == 0, "partial_rotary_factor",
             f"gives a rope dim of {rope_dim} for head_dim {head_dim}; it must be even and in (0, head_dim]")

    rope_theta = float(_get(raw, "rope_theta", 10000.0))
    compress_theta = float(_get(raw, "compress_rope_theta", 160000.0))
    max_positions = int(_get(raw, "max_position_embeddings", 1048576))
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    _require(isinstance(rp, dict), "rope_parameters", "must be a dict")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        # As HF's rope standardisation: a nested table without its own rope_theta inherits the top-level
        # `rope_theta` (not compress_rope_theta). Configs HF writes always carry both thetas explicitly.
        rope_main = _rope_from_dict(rp["main"], rope_theta, rope_dim, max_positions, "rope_parameters.main")
        rope_compress = _rope_from_dict(rp["compress"], rope_theta, rope_dim, max_positions,
                                        "rope_parameters.compress")
    else:
        # A flat dict (legacy `rope_scaling`) applies to the compress rope only, with compress_rope_theta
        # whatever theta the dict holds; main stays plain.
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        rope_main = RopeConfig(theta=rope_theta, dim=rope_dim)
        rope_compress = _rope_from_dict(flat, compress_theta, rope_dim, max_positions, "rope_scaling")

    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    cfg = ModelConfig(
        model_type=model_type,
        num_hidden_layers=n,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=max_positions,
        rope_main=rope_main,
        rope_compress=rope_compress,
        layer_types=tuple(layer_types),
        compress_ratios=tuple(0 if t == SLIDING else rates[t] for t in layer_types),
        mlp_layer_types=tuple(mlp_types),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization_config=raw.get("quantization_config"),
        # legacy aliases: intermediate_size, num_local_experts
        **scalar_fields(raw, moe_intermediate_size=_get(raw, "intermediate_size", 2048),
                        n_routed_experts=_get(raw, "num_local_experts", 256)),
    )
    validate(cfg)
    return cfg


def validate(cfg: ModelConfig) -> None:
    """Cross-field checks the model code relies on; each failure names its field."""
    for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
                 "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "hc_mult", "hc_sinkhorn_iters",
                 "sliding_window", "o_groups", "o_lora_rank", "max_position_embeddings"):
        _require(getattr(cfg, name) > 0, name, f"must be positive, got {getattr(cfg, name)}")
    _require(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
             f"{cfg.num_experts_per_tok} exceeds n_routed_experts {cfg.n_routed_experts}")
    _require(cfg.scoring_func in SCORING_FUNCS, "scoring_func", f"{cfg.scoring_func!r} not in {SCORING_FUNCS}")
    _require(cfg.num_attention_heads % cfg.o_groups == 0, "o_groups",
             f"{cfg.o_groups} does not divide num_attention_heads {cfg.num_attention_heads}")
    if any(t == CSA for t in cfg.layer_types):
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            _require(getattr(cfg, name) > 0, name, f"must be positive for CSA layers, got {getattr(cfg, name)}")
        _require(0 < cfg.qk_rope_head_dim <= cfg.index_head_dim, "index_head_dim",
                 f"{cfg.index_head_dim} is smaller than the rope dim {cfg.qk_rope_head_dim}")
    if cfg.rope_compress.rope_type == "yarn":
        _require(cfg.rope_compress.factor > 0 and cfg.rope_compress.original_max_position_embeddings > 0,
                 "rope_scaling", "yarn factor and original_max_position_embeddings must be positive")
    for e in cfg.eos_token_ids:
        _require(0 <= e < cfg.vocab_size, "eos_token_id", f"{e} is outside the vocabulary [0, {cfg.vocab_size})")


def hub_hint(model: str) -> str:
    """For a model id that looks like a hub id (`org/name`) and is not a local path: how dsv4 takes checkpoints."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not os.path.exists(model):
        return (" (dsv4 loads checkpoints from local directories and downloads nothing: fetch it first, e.g. "
                f"`huggingface-cli download {model} --local-dir DIR`, then pass DIR)")
    return ""


def load_model_config(model_dir: str) -> ModelConfig:
    """Read `<model_dir>/config.json` and parse it."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"checkpoint directory {model_dir!r} does not exist{hub_hint(model_dir)}")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {model_dir!r}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    cfg = parse_config_dict(raw)
    if cfg.v41 is not None:
        # released composite configs describe the vision tower even for text-only checkpoints: build it only
        # when the checkpoint has its weights
        from dsv4.models.vision import load_vision_config

        cfg = dataclasses.replace(cfg, vision=load_vision_config(model_dir))
    return cfg


def parse_config_dict(raw: dict[str, Any]) -> ModelConfig:
    """Dispatch on model_type: deepseek_v4, or deepseek_v41 (composite or flat; also deepseek_v41_text)."""
    model_type = raw.get("model_type")
    if model_type == "deepseek_v4":
        return parse_v4_config(raw)
    if model_type in ("deepseek_v41", "deepseek_v41_text"):
        from dsv4.models.config_v41 import parse_v41_config

        return parse_v41_config(raw)
    raise ConfigError(f"config field `model_type`: {model_type!r} is not supported "
                      "(supported: 'deepseek_v4', 'deepseek_v41')")
