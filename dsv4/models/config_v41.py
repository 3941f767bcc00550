"""config.json -> ModelConfig for DeepSeek-V4.1 (model.md section 1.2): composite (`text_config` /
`vision_config`) or flat text-only, with the derived CSA2 schedule (KV sources, index sources, candidate source)
validated, including the constraints the reference relies on without checking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.models.config import (MOE, ModelConfig, RopeConfig, _get, _require, _rope_from_dict, scalar_fields,
                                validate)

V41_KV_SOURCE = "shared_compressed_attention"
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
IMAGE_TOKEN_ID = 129264


@dataclass(frozen=True)
class EngramConfig:
    """Engram conditional memory (model.md section 7)."""

    layer_ids: tuple[int, ...]
    vocab_size: int
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    pad_id: int
    compressed_vocab_size: int


@dataclass(frozen=True)
class V41Schedule:
    """Which layers own compressed KV, which run the indexer, and the candidate pre-selection."""

    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # < 0: no candidate pre-selection
    candidate_topk_blocks: int
    candidate_block_size: int
    gate_temp: float
    image_token_id: int
    engram: EngramConfig | None

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose entries layer `layer` reads (the last one at or before it)."""
        s = [k for k in self.kv_source_layer_ids if k <= layer]
        return s[-1] if s else None

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k layer `layer` uses (the last one at or before it)."""
        s = [k for k in self.index_source_layer_ids if k <= layer]
        return s[-1] if s else None


def _default_sources(ratios: list[int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """KV sources (and index sources, None = same as KV sources) when the config gives none."""
    n = len(ratios)
    if ratios == RELEASED_RATIOS[:n]:
        return RELEASED_KV_SOURCES, RELEASED_INDEX_SOURCES
    starts = [i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r)]
    return tuple(starts), None


def parse_v41_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a `deepseek_v41` config.json (composite) or a flat `deepseek_v41`/`deepseek_v41_text` one."""
    top = raw
    if isinstance(raw.get("text_config"), dict):
        raw = {**raw["text_config"]}
    image_token_id = int(top.get("image_token_id", raw.get("image_token_id", IMAGE_TOKEN_ID)))
    n = int(_get(raw, "num_hidden_layers", 40))
    _require(n > 0, "num_hidden_layers", f"must be positive, got {n}")
    nextn = int(raw.get("num_nextn_predict_layers") or 0)
    head_dim = int(_get(raw, "head_dim", 512))

    ratios = raw.get("compress_ratios")
    if ratios is None:
        ratios = RELEASED_RATIOS[: n + nextn] if n == 40 else [0] * min(2, n) + [2] * ((n - 1) // 2)
    ratios = list(ratios)[: n + nextn]
    ratios += [0] * (n + nextn - len(ratios))
    ratios = [int(r) for r in ratios[:n]]
    bad = [r for r in ratios if r not in (0, 1, 2)]
    _require(not bad, "compress_ratios", f"DeepSeek-V4.1 supports ratios 0, 1 and 2; got {bad}")

    kv_default, idx_default = _default_sources(ratios)
    kv_sources = tuple(int(x) for x in (raw.get("kv_source_layer_ids") or kv_default))
    idx_given = raw.get("index_source_layer_ids")
    idx_sources = tuple(int(x) for x in (idx_given if idx_given is not None else (idx_default or kv_sources)))
    cand = raw.get("candidate_source_layer_id")
    cand = (kv_sources[-1] if kv_sources else -1) if cand is None else int(cand)

    # HF's checks
    for k in kv_sources:
        _require(0 <= k < n and ratios[k] > 0, "kv_source_layer_ids",
                 f"layer {k} is out of range or has compress ratio 0")
    _require(list(kv_sources) == sorted(set(kv_sources)), "kv_source_layer_ids", "must be strictly increasing")
    _require(list(idx_sources) == sorted(set(idx_sources)), "index_source_layer_ids", "must be strictly increasing")
    for i, r in enumerate(ratios):
        if r > 0:
            _require(any(k <= i for k in kv_sources), "kv_source_layer_ids",
                     f"layer {i} has compress ratio {r} but no KV source at or before it")
    for k in idx_sources:
        _require(0 <= k < n and ratios[k] > 0 and any(s <= k for s in kv_sources), "index_source_layer_ids",
                 f"layer {k} needs ratio > 0 and a KV source at or before it")
    if cand >= 0:
        _require(cand in idx_sources, "candidate_source_layer_id", f"layer {cand} is not an index source")
    # What the reference relies on without checking (model.md 1.2): refuse configs that break it.
    for k in kv_sources:
        _require(k in idx_sources, "index_source_layer_ids",
                 f"KV source {k} must also be an index source (its group needs its own indexer keys)")

    def kv_src(i: int) -> int:
        return max(k for k in kv_sources if k <= i)

    for i, r in enumerate(ratios):
        if r > 0:
            _require(r == ratios[kv_src(i)], "compress_ratios",
                     f"layer {i} has ratio {r} but its KV source {kv_src(i)} has ratio {ratios[kv_src(i)]}")
    if cand >= 0:
        for k in idx_sources:
            if k > cand:
                _require(kv_src(k) == kv_src(cand), "candidate_source_layer_id",
                         f"index source {k} reads another KV group than the candidate source {cand}")

    engram = None
    layer_ids = tuple(int(x) for x in (raw.get("engram_layer_ids") or ()))
    if layer_ids:
        num_emb = tuple(int(x) for x in (raw.get("engram_num_embeddings") or [0] * len(layer_ids)))
        _require(len(num_emb) == len(layer_ids), "engram_num_embeddings", "needs one entry per engram layer")
        for i in layer_ids:
            _require(0 <= i < n, "engram_layer_ids", f"layer {i} is out of range")
        pad = raw.get("engram_pad_id", raw.get("engram_pad_token_id", 2))
        engram = EngramConfig(
            layer_ids=layer_ids,
            vocab_size=int(_get(raw, "engram_vocab_size", 16000000)),
            num_embeddings=num_emb,
            max_ngram_size=int(_get(raw, "engram_max_ngram_size", 4)),
            n_heads=int(_get(raw, "engram_n_heads", 8)),
            head_dim=int(_get(raw, "engram_head_dim", 256)),
            pad_id=int(pad if pad is not None else 2),
            compressed_vocab_size=int(_get(raw, "engram_compressed_vocab_size", 99092)),
        )
        _require(engram.max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")

    rope_dim = int(_get(raw, "qk_rope_head_dim", 64))
    _require(0 < rope_dim <= head_dim and rope_dim % 2 == 0, "qk_rope_head_dim",
             f"{rope_dim} must be even and in (0, head_dim={head_dim}]")
    rope_theta = float(_get(raw, "rope_theta", 10000.0))
    compress_theta = float(_get(raw, "compress_rope_theta", 160000.0))
    max_positions = int(_get(raw, "max_position_embeddings", 1048576))
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        rope_main = _rope_from_dict(rp["main"], rope_theta, rope_dim, max_positions, "rope_parameters.main")
        rope_compress = _rope_from_dict(rp["compress"], compress_theta, rope_dim, max_positions,
                                        "rope_parameters.compress")
    else:
        flat = raw.get("rope_scaling") or (rp if isinstance(rp, dict) else {}) or {}
        flat = {k: v for k, v in flat.items() if k not in ("rope_theta", "partial_rotary_factor")}
        rope_main = RopeConfig(theta=rope_theta, dim=rope_dim)
        rope_compress = _rope_from_dict(flat, compress_theta, rope_dim, max_positions, "rope_scaling")

    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    schedule = V41Schedule(
        kv_source_layer_ids=kv_sources, index_source_layer_ids=idx_sources, candidate_source_layer_id=cand,
        candidate_topk_blocks=int(_get(raw, "candidate_topk_blocks", 2048)),
        candidate_block_size=int(_get(raw, "candidate_block_size", 8)),
        gate_temp=float(_get(raw, "gate_temp", 1.0)), image_token_id=image_token_id, engram=engram,
    )
    _require(schedule.gate_temp > 0, "gate_temp", f"must be > 0, got {schedule.gate_temp}")
    _require(schedule.candidate_block_size > 0 and schedule.candidate_topk_blocks > 0, "candidate_block_size",
             "candidate_block_size and candidate_topk_blocks must be positive")
    cfg = ModelConfig(
        model_type="deepseek_v41",
        num_hidden_layers=n,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        max_position_embeddings=max_positions,
        rope_main=rope_main,
        rope_compress=rope_compress,
        layer_types=tuple(V41_KV_SOURCE if i in kv_sources else "sliding_attention" for i in range(n)),
        compress_ratios=tuple(ratios),
        mlp_layer_types=(MOE,) * n,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(top.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=nextn,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization_config=top.get("quantization_config", raw.get("quantization_config")),
        v41=schedule,
        # V4.1-Flash defaults where they differ from V4's
        **scalar_fields(raw, hidden_size=5120, moe_intermediate_size=2304, q_lora_rank=1280, n_routed_experts=384,
                        index_n_heads=32, rms_norm_eps=1e-20),
    )
    validate(cfg)
    if kv_sources:
        _require(0 < cfg.qk_rope_head_dim <= cfg.index_head_dim, "index_head_dim",
                 f"{cfg.index_head_dim} is smaller than the rope dim {cfg.qk_rope_head_dim}")
    return cfg
