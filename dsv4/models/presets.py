"""Model presets for `dsv4 make-model`, and the tensor layouts of DeepSeek-V4 and V4.1 checkpoints.

`v4_tensor_shapes(cfg)` is the single statement of which tensors a V4 checkpoint holds (HF DeepseekV4ForCausalLM
state-dict names, model.md section 10.1) and their shapes; the writer, the loader and the tests share it.
`v41_tensor_shapes(cfg)` does the same for V4.1 in the layout HF-V41 `save_pretrained` writes (model.md 10.2, the
golden checkpoint's key set): original names under `model.`, `lm_head.weight`, per-expert `w1/w2/w3`.
`vision_tensor_shapes(vcfg, hidden)` lists the vision encoder's tensors (model.md 10.2 names, no prefix), which the
presets of `VISION_PRESETS` add to the text tensors.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch

from dsv4.models.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from dsv4.models.config_v41 import IMAGE_TOKEN_ID, RELEASED_INDEX_SOURCES, RELEASED_KV_SOURCES, RELEASED_RATIOS
from dsv4.models.vision import VisionConfig, vision_param_dtype
from dsv4.spec_decode.config import DSparkConfig

# Tensors kept in float32 whatever the checkpoint dtype, as DeepSeek ships them and HF keeps them: the mHC
# parameters, attention sinks, compressor position biases and the router bias are precision-critical.
_FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                  "self_attn.sinks", "position_bias", "e_score_correction_bias")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The size of the built-in byte-level BPE vocabulary (dsv4.make_model trains it): 9 added tokens + 256 byte
# symbols + 247 merges. A preset's vocab_size must be at least this.
TOKENIZER_VOCAB_SIZE = 512

# tiny-v4: model.md section 11 (verified against transformers' DeepseekV4ForCausalLM) with the vocabulary
# widened to the built-in tokenizer. All three attention kinds, both MoE kinds, both ropes (yarn bends the
# compress table), HCA ratio 8, CSA top-4 selection and a window smaller than a typical prompt.
_TINY_V4: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,
    "num_nextn_predict_layers": 1,  # one MTP layer (`mtp.0.*`, released names), as DeepSeek-V4 ships
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

# tiny-v41 text config: model.md section 11.1 (the golden checkpoint's config, executed on HF-V41) with the vocabulary
# of the built-in tokenizer. The whole CSA2 schedule in 6 layers: window-only layer 0, a ratio-2 KV group
# (source 1, consumer 2), a ratio-1 KV group (source 3, consumers 4-5) with a re-index source 5 inside candidate source
# 3's blocks; engram on layer 1. The two engram sizes that depend on the tokenizer are filled in by preset_config.
_TINY_V41_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "architectures": ["DeepseekV41ForCausalLM"],
    "vocab_size": TOKENIZER_VOCAB_SIZE,  # = the tokenizer size: ids must embed, and the engram map must cover them
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "gate_temp": 1.0,
    "swiglu_limit": 10.0,
    "compress_ratios": [0, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 2,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "sliding_window": 8,
    "engram_layer_ids": [1],
    "engram_vocab_size": 1000,
    "engram_num_embeddings": None,  # filled in: the hash layout's rows per engram layer
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_id": 2,  # the tokenizer's <｜▁pad▁｜>, as DeepSeek's pad id 2
    "engram_compressed_vocab_size": None,  # filled in: distinct keys of the tokenizer's compressed token map
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,
    "num_nextn_predict_layers": 0,
    # HF-V41's strict config rejects None and warns outside the vocabulary; unused without DSpark layers.
    "dspark_noise_token_id": TOKENIZER_VOCAB_SIZE - 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "hidden_act": "silu",
}

# DeepseekV41VisionConfig defaults (model.md section 1.2): the composite layout carries them though the text model
# never reads them.
_V41_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "patch_size": 14,
    "downsample_ratio": 3,
    "rope_theta": 10000.0,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}


# tiny-v41-vl's vision tower: head_dim 16 (the 2D rope needs a multiple of 4), hidden 32 != the text's 64 and
# intermediate 48, so no swapped axis goes unnoticed; a minimum of 84x84 pixels = 6x6 patches = a 2x2 aligner grid.
_TINY_VISION: dict[str, Any] = {
    **_V41_VISION,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_image_tokens": 64,
    "min_pixels": 14 * 14 * 9 * 4,
}


def _composite_v41(text: dict[str, Any], vision: dict[str, Any] = _V41_VISION,
                   image_token_id: int = IMAGE_TOKEN_ID) -> dict[str, Any]:
    """The released composite config.json layout (what HF-V41 reloads; its flat save does not round-trip)."""
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "image_token_id": image_token_id,
        "tie_word_embeddings": False,
        "text_config": copy.deepcopy(text),
        "vision_config": copy.deepcopy(vision),
    }


# ---- benchmark presets: released Flash shapes per layer, fewer layers and experts, so one GPU holds them ----------
# The vocabulary is the released 129280 ids (make_model writes a synthetic tokenizer of that size), the experts are cut
# to 16 (top-6 as released, so a batch-1 step reads 6 of 16), and the layers to the first few of the released schedule.

# DeepSeek-V4-Flash (model.md 1.1; the released config.json's compress_ratios start [0, 0, 4, 128, ...]): the first 4
# layers: two window-only layers, one CSA (ratio 4, indexer top-512), one HCA (ratio 128); the first 3 are hash-MoE.
_V4_FLASH_4L: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "partial_rotary_factor": 0.125,  # qk rope 64 of 512
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 16,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,  # the MTP layer is not written
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

# DeepSeek-V4.1-Flash (model.md 1.2) in 8 layers with the released topology in small: a window-only layer, a ratio-2
# group (KV source 1, consumers 2-3), a ratio-1 group (KV source 4, consumers 5-7) whose re-index source 6 searches
# inside candidate source 4's blocks; engram on layer 1 with the released hash shape (n-grams 2..4, 8 heads, rows of
# 256) but primes from 100003 instead of 16M, so its host table is 2.4M rows (1.2 GB bf16) instead of 384M.
_V41_FLASH_8L_TEXT: dict[str, Any] = {
    **_TINY_V41_TEXT,
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "moe_intermediate_size": 2304,
    "n_routed_experts": 16,
    "num_experts_per_tok": 6,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 4, 6],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "engram_layer_ids": [1],
    "engram_vocab_size": 100003,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "dspark_noise_token_id": 128799,  # the released id (inside the 129280-id vocabulary)
}

# ---- config-only presets: the released models at full size --------------------------------------------------------
# Their checkpoints are hundreds of GB, so make_model refuses to write weights for them; `--config-only` writes
# config.json + tokenizer for `--load-format dummy`, and the layout/size code (released.py, the decode floor) reads
# their shapes. Fields the release does not publish keep the cut-down presets' choices (noted per field).

# DeepSeek-V4-Flash (peers_v4.md 1.1, model.md 1.1): _V4_FLASH_4L at the released depth and expert count. The
# released compress_ratios [0, 0] + [4, 128] * 20 + [4] become layer kinds; the first 3 layers are hash-routed.
_V4_FLASH: dict[str, Any] = {
    **_V4_FLASH_4L,
    "num_hidden_layers": 43,
    "n_routed_experts": 256,
    "layer_types": [SLIDING] * 2 + [CSA, HCA] * 20 + [CSA],
    "mlp_layer_types": [HASH_MOE] * 3 + [MOE] * 40,
    # released: num_nextn_predict_layers 1 (one MTP layer, `mtp.0.*`); the engine has no MTP, so none is declared
}

# DeepSeek-V4.1-Flash (peers_v4.md 1.2, model.md 1.2): _V41_FLASH_8L_TEXT with the released 40-layer schedule instead
# of its 8-layer miniature (ratios 0,0 | 2 x 18 | 1 x 20; KV sources 2, 8, 14, 20; index sources 2, 8, ..., 36;
# candidate source = the last KV source, 20), 384 experts, engram on layers 1 and 14 with the released prime base
# 16,000,000 (rows 384,006,168 and 384,016,682, as released). Not published / not modeled, kept from the 8l preset:
# engram_compressed_vocab_size is our synthetic tokenizer's (released 99092, from DeepSeek's tokenizer; the engine
# requires the config to match the tokenizer it ships with); num_nextn_predict_layers 0 (released 3 DSpark stages,
# not modeled; the released compress_ratios list also carries their 3 trailing zeros); gate_temp 1.0 (HF default).
_V41_FLASH_TEXT: dict[str, Any] = {
    **_V41_FLASH_8L_TEXT,
    "num_hidden_layers": 40,
    "n_routed_experts": 384,
    "compress_ratios": RELEASED_RATIOS[:40],
    "kv_source_layer_ids": list(RELEASED_KV_SOURCES),
    "index_source_layer_ids": list(RELEASED_INDEX_SOURCES),
    "candidate_source_layer_id": RELEASED_KV_SOURCES[-1],
    "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000,
}

# tiny-v41's DSpark drafter (docs/dspark.md): the released structure (3 window-only stages, a block of K tokens, a
# rank-r Markov head, target layers = HF's default, the last 3 layers that are not KV sources: [2, 4, 5]) at tiny
# sizes: K 4, r 16, 8 experts top-2 per stage. Only tiny-v41 carries it; the big presets add the released drafter
# with make_model(..., drafter=True) (`DRAFTER_FIELDS`).
_TINY_DSPARK: dict[str, Any] = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 4,
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
}
# The released V4.1-Flash drafter's fields (docs/dspark.md 1.1), for a big preset written with its drafter.
DRAFTER_FIELDS: dict[str, Any] = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-v4": _TINY_V4,
    "tiny-v41": _composite_v41({**_TINY_V41_TEXT, **_TINY_DSPARK}),
    "tiny-v41-noengram": _composite_v41({**_TINY_V41_TEXT, "engram_layer_ids": []}),
    # tiny-v41 plus a vision tower. The image token must embed, so the vocabulary grows by one id: the tokenizer's
    # added placeholder `<｜deepseek_image｜>` (make_model writes it), which the config names as image_token_id.
    "tiny-v41-vl": _composite_v41({**_TINY_V41_TEXT, "vocab_size": TOKENIZER_VOCAB_SIZE + 1}, vision=_TINY_VISION,
                                  image_token_id=TOKENIZER_VOCAB_SIZE),
    "v4-flash-4l": _V4_FLASH_4L,
    "v41-flash-8l": _composite_v41(_V41_FLASH_8L_TEXT),
    "v41-flash-8l-noengram": _composite_v41({**_V41_FLASH_8L_TEXT, "engram_layer_ids": []}),
    "v4-flash": _V4_FLASH,
    "v41-flash": _composite_v41(_V41_FLASH_TEXT),
}

# Presets whose weights are never written (hundreds of GB): make_model refuses them unless asked for the config only.
CONFIG_ONLY_PRESETS = frozenset({"v4-flash", "v41-flash"})

# Presets written in bf16 by default and streamed tensor by tensor (per-chunk seeded draws, sharded safetensors):
# they are several GB. The tiny presets keep float32 and their original single-generator draws.
LARGE_PRESETS = frozenset({"v4-flash-4l", "v41-flash-8l", "v41-flash-8l-noengram"})

# Presets whose checkpoint holds vision weights (the other V4.1 presets carry a `vision_config` but no tower), and
# whose tokenizer holds the image placeholder as its last id (= image_token_id).
VISION_PRESETS = frozenset({"tiny-v41-vl"})


def preset_dtype(name: str) -> str:
    """The checkpoint dtype `dsv4 make-model` uses for preset `name` when none is given."""
    return "bfloat16" if name in LARGE_PRESETS | CONFIG_ONLY_PRESETS else "float32"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the text model's fields: `text_config` of a composite V4.1 config, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


@functools.lru_cache(maxsize=4)
def compressed_vocab_size(vocab_size: int, image_token: bool = False) -> int:
    """Distinct keys of the engram compressed token map of the tokenizer make_model writes for `vocab_size` ids
    (the built-in BPE, extended with synthetic words beyond 512 ids; with `image_token`, the last id is the image
    placeholder)."""
    from dsv4.make_model import synthetic_tokenizer  # lazy: make_model imports this module
    from dsv4.models.engram import build_compressed_token_map

    return build_compressed_token_map(synthetic_tokenizer(vocab_size, image_token))[1]


def _fill_engram_sizes(text: dict[str, Any], image_token: bool = False) -> None:
    """Set the tokenizer-derived compressed vocab size and the hash layout's table rows (computed, not guessed:
    the engine refuses a compressed size that differs from its tokenizer's, and a table smaller than the layout)."""
    from dsv4.models.engram import EngramLayout

    size = compressed_vocab_size(int(text["vocab_size"]), image_token)
    text["engram_compressed_vocab_size"] = size
    layer_ids = list(text["engram_layer_ids"])
    layout = EngramLayout.from_config(layer_ids, text["engram_vocab_size"], text["engram_max_ngram_size"],
                                      text["engram_n_heads"], size)
    text["engram_num_embeddings"] = [int(layout.rows[layer]) for layer in layer_ids]


def preset_config(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A fresh copy of preset `name`'s config.json dict (V4.1 presets with their engram sizes filled in).

    `overrides` replace text-model fields first (a scaled-down variant of a preset: same schedule, smaller sizes);
    the engram sizes are then computed for the result."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = copy.deepcopy(PRESETS[name])
    text = text_config(config)
    text.update(copy.deepcopy(overrides or {}))
    if "engram_layer_ids" in text:
        _fill_engram_sizes(text, image_token=name in VISION_PRESETS)
    return config


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def v4_tensor_shapes(cfg: ModelConfig, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a DeepSeek-V4 checkpoint in HF naming -> (shape, on-disk dtype).

    `dtype` is the checkpoint dtype; the fp32-critical tensors stay float32 and `tid2eid` is int64."""
    wdtype = torch_dtype(dtype)
    V, D, N = cfg.vocab_size, cfg.hidden_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    IH, ihd = cfg.index_n_heads, cfg.index_head_dim
    mix = (2 + N) * N  # mHC: pre (N) + post (N) + residual mixing (N*N) weights per token

    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, D),
        "lm_head.weight": (V, D),
        "model.norm.weight": (D,),
        "model.hc_head.hc_fn": (N, N * D),
        "model.hc_head.hc_base": (N,),
        "model.hc_head.hc_scale": (1,),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        for hc in ("attn_hc", "ffn_hc"):
            shapes[p + hc + ".fn"] = (mix, N * D)
            shapes[p + hc + ".base"] = (mix,)
            shapes[p + hc + ".scale"] = (3,)
        a = p + "self_attn."
        shapes[a + "q_a_proj.weight"] = (ql, D)
        shapes[a + "q_a_norm.weight"] = (ql,)
        shapes[a + "q_b_proj.weight"] = (H * hd, ql)
        shapes[a + "kv_proj.weight"] = (hd, D)
        shapes[a + "kv_norm.weight"] = (hd,)
        shapes[a + "o_a_proj.weight"] = (G * ol, H * hd // G)
        shapes[a + "o_b_proj.weight"] = (D, G * ol)
        shapes[a + "sinks"] = (H,)
        kind, m = cfg.layer_types[layer], cfg.compress_ratios[layer]
        if kind != SLIDING:
            coff = 2 if kind == CSA else 1  # CSA pools two overlapping windows, so twice the channels
            c = a + "compressor."
            shapes[c + "kv_proj.weight"] = (coff * hd, D)
            shapes[c + "gate_proj.weight"] = (coff * hd, D)
            shapes[c + "position_bias"] = (m, coff * hd)
            shapes[c + "kv_norm.weight"] = (hd,)
            if kind == CSA:
                x = c + "indexer."
                shapes[x + "kv_proj.weight"] = (2 * ihd, D)
                shapes[x + "gate_proj.weight"] = (2 * ihd, D)
                shapes[x + "position_bias"] = (m, 2 * ihd)
                shapes[x + "kv_norm.weight"] = (ihd,)
                shapes[x + "q_b_proj.weight"] = (IH * ihd, ql)
                shapes[x + "scorer.weights_proj.weight"] = (IH, D)
        f = p + "mlp."
        shapes[f + "gate.weight"] = (E, D)
        if cfg.mlp_layer_types[layer] == HASH_MOE:
            shapes[f + "gate.tid2eid"] = (V, k)
        else:
            shapes[f + "gate.e_score_correction_bias"] = (E,)
        shapes[f + "experts.gate_up_proj"] = (E, 2 * I, D)
        shapes[f + "experts.down_proj"] = (E, D, I)
        # One shared expert of width I, as HF builds it (V4 ships n_shared_experts = 1).
        shapes[f + "shared_experts.gate_proj.weight"] = (I, D)
        shapes[f + "shared_experts.up_proj.weight"] = (I, D)
        shapes[f + "shared_experts.down_proj.weight"] = (D, I)

    return {name: (shape, disk_dtype(name, wdtype)) for name, shape in shapes.items()}


# V4.1 tensors HF-V41 keeps in float32 whatever the save dtype (model.md 11.1); the engram scale is a dummy F32.
_V41_FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                      "attn.attn_sink", "gate.bias", "gate.bias_vl", "engram.embed.scale")
# V4's MTP layer in released names: its own hc_head (the rest of its fp32 tensors end like V4.1's)
_MTP_FP32_SUFFIXES = ("hc_head_fn", "hc_head_base", "hc_head_scale")


def disk_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The on-disk dtype of tensor `name` (a `tensor_shapes` name, V4 or V4.1) in a checkpoint of float dtype `dtype`:
    int64 for `tid2eid`, float32 for the precision-critical tensors of either version, else `dtype`. The V4 and V4.1
    suffix sets do not overlap in meaning (V4 names never end like V4.1's and vice versa), so one rule serves both."""
    if name.endswith("tid2eid"):
        return torch.int64
    return torch.float32 if name.endswith(_FP32_SUFFIXES + _V41_FP32_SUFFIXES + _MTP_FP32_SUFFIXES) else dtype


def v41_tensor_shapes(cfg: ModelConfig, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a DeepSeek-V4.1 text checkpoint as HF-V41 saves it -> (shape, on-disk dtype).

    Which layers own a compressor, an indexer (with keys) or an engram comes from `cfg.v41`. Engram tables are
    float with a dummy all-ones `embed.scale` [rows, head_dim/32], as HF saves float tables (section 7)."""
    v41 = cfg.v41
    if v41 is None:
        raise ValueError("v41_tensor_shapes needs a DeepSeek-V4.1 config")
    wdtype = torch_dtype(dtype)
    V, D, N = cfg.vocab_size, cfg.hidden_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    IH, ihd = cfg.index_n_heads, cfg.index_head_dim
    mix = (2 + N) * N
    eng = v41.engram
    rows = {} if eng is None else dict(zip(eng.layer_ids, eng.num_embeddings))

    shapes: dict[str, tuple[int, ...]] = {
        "model.embed.weight": (V, D),
        "lm_head.weight": (V, D),
        "model.norm.weight": (D,),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes[p + "ffn_norm.weight"] = (D,)
        for site in ("attn", "ffn"):
            shapes[p + f"hc_{site}_fn"] = (mix, N * D)
            shapes[p + f"hc_{site}_base"] = (mix,)
            shapes[p + f"hc_{site}_scale"] = (3,)
        a = p + "attn."
        shapes[a + "wq_a.weight"] = (ql, D)
        shapes[a + "q_norm.weight"] = (ql,)
        shapes[a + "wq_b.weight"] = (H * hd, ql)
        shapes[a + "wkv.weight"] = (hd, D)
        shapes[a + "kv_norm.weight"] = (hd,)
        shapes[a + "wo_a.weight"] = (G * ol, H * hd // G)
        shapes[a + "wo_b.weight"] = (D, G * ol)
        shapes[a + "attn_sink"] = (H,)
        is_kv_source = layer in v41.kv_source_layer_ids
        if is_kv_source:
            # One latent per entry (ratio 2 pools aligned pairs with a gate; ratio 1 projects every token).
            shapes[a + "compressor.wkv.weight"] = (hd, D)
            if cfg.compress_ratios[layer] > 1:
                shapes[a + "compressor.wgate.weight"] = (hd, D)
            shapes[a + "compressor.norm.weight"] = (hd,)
        if layer in v41.index_source_layer_ids:
            shapes[a + "indexer.wq_b.weight"] = (IH * ihd, ql)
            shapes[a + "indexer.weights_proj.weight"] = (IH, D)
            if is_kv_source:  # the group's indexer keys are derived from the compressor's latents
                shapes[a + "indexer.wk.weight"] = (ihd, hd)
                shapes[a + "indexer.k_norm.weight"] = (ihd,)
        shapes.update(_moe_shapes(p + "ffn.", E, D, I))
        if layer in rows:
            g = p + "engram."
            cols = (eng.max_ngram_size - 1) * eng.n_heads  # one table row per (n-gram size, hash head)
            shapes[g + "embed.weight"] = (rows[layer], eng.head_dim)
            shapes[g + "embed.scale"] = (rows[layer], eng.head_dim // 32)
            shapes[g + "wkv.weight"] = ((N + 1) * D, cols * eng.head_dim)  # N stream keys, then one value
            shapes[g + "q_weight"] = (N, D)
            shapes[g + "k_weight"] = (N, D)

    return {name: (shape, disk_dtype(name, wdtype)) for name, shape in shapes.items()}


def vision_tensor_shapes(vcfg: VisionConfig, hidden_size: int, dtype: str = "float32"
                         ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the V4.1 vision encoder under its model.md 10.2 name (the released checkpoint's, without a
    prefix) -> (shape, on-disk dtype). `hidden_size` is the text model's. The ViT norm weights and the delimiter
    vectors are float32 whatever `dtype`, as shipped."""
    wdtype = torch_dtype(dtype)
    D, I, H, r = vcfg.hidden_size, vcfg.intermediate_size, hidden_size, vcfg.downsample_ratio
    shapes: dict[str, tuple[int, ...]] = {
        "vision.patch_embed.proj.weight": (D, vcfg.patch_dim),
        "vision.patch_embed.proj.bias": (D,),
    }
    for b in range(vcfg.num_hidden_layers):
        p = f"vision.blocks.{b}."
        shapes[p + "norm1.weight"] = (D,)
        shapes[p + "attn.wqkv.weight"] = (3 * D, D)
        shapes[p + "attn.wqkv.bias"] = (3 * D,)
        shapes[p + "attn.wo.weight"] = (D, D)
        shapes[p + "attn.wo.bias"] = (D,)
        shapes[p + "norm2.weight"] = (D,)
        shapes[p + "mlp.w1.weight"] = (2 * I, D)  # [gate | up]
        shapes[p + "mlp.w2.weight"] = (D, I)
    shapes["vision.norm.weight"] = (D,)
    shapes["aligner.w1.weight"] = (H, D * r * r)
    shapes["aligner.w1.bias"] = (H,)
    shapes["aligner.w2.weight"] = (H, H)
    shapes["aligner.w2.bias"] = (H,)
    for name in ("image_start", "image_end", "image_newline"):
        shapes[name] = (H,)
    return {name: (shape, vision_param_dtype(name, wdtype)) for name, shape in shapes.items()}


def _moe_shapes(f: str, E: int, D: int, I: int, vision_bias: bool = True) -> dict[str, tuple[int, ...]]:
    """An MoE FFN under prefix `f` (a V4.1 target layer's, a drafter stage's, a V4 MTP layer's), in the checkpoint's
    order: the router (with V4.1's vision bias), E routed experts, and one shared expert of width I, as HF-V41
    builds it (V4.1 ships n_shared_experts = 1)."""
    shapes = {f + "gate.weight": (E, D), f + "gate.bias": (E,)}
    if vision_bias:
        shapes[f + "gate.bias_vl"] = (E,)
    for e in range(E):
        shapes[f + f"experts.{e}.w1.weight"] = (I, D)
        shapes[f + f"experts.{e}.w2.weight"] = (D, I)
        shapes[f + f"experts.{e}.w3.weight"] = (I, D)
    for w, shape in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
        shapes[f + f"shared_experts.{w}.weight"] = shape
    return shapes


def _draft_layer_shapes(p: str, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The mHC mixes, norms and window-only attention of a drafter layer under prefix `p` (a DSpark stage, a V4 MTP
    layer: the same names in the same order)."""
    D, N, H, hd, ql = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol, mix = cfg.o_groups, cfg.o_lora_rank, (2 + cfg.hc_mult) * cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {}
    for site in ("attn", "ffn"):
        shapes[p + f"hc_{site}_fn"] = (mix, N * D)
        shapes[p + f"hc_{site}_base"] = (mix,)
        shapes[p + f"hc_{site}_scale"] = (3,)
    shapes[p + "attn_norm.weight"] = (D,)
    shapes[p + "ffn_norm.weight"] = (D,)
    a = p + "attn."
    shapes[a + "attn_sink"] = (H,)
    shapes[a + "wq_a.weight"] = (ql, D)
    shapes[a + "q_norm.weight"] = (ql,)
    shapes[a + "wq_b.weight"] = (H * hd, ql)
    shapes[a + "wkv.weight"] = (hd, D)
    shapes[a + "kv_norm.weight"] = (hd,)
    shapes[a + "wo_a.weight"] = (G * ol, H * hd // G)
    shapes[a + "wo_b.weight"] = (D, G * ol)
    return shapes


def dspark_tensor_shapes(cfg: ModelConfig, ds: DSparkConfig, dtype: str = "float32"
                         ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a V4.1 DSpark drafter as released (docs/dspark.md 1.2: `mtp.{s}.*`, per-expert w1/w2/w3,
    which dsv4 packs at load as the target's) -> (shape, on-disk dtype)."""
    wdtype = torch_dtype(dtype)
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, ds.n_routed_experts
    V, r, S = cfg.vocab_size, ds.markov_rank, ds.num_stages
    shapes: dict[str, tuple[int, ...]] = {}
    for s in range(S):
        p = f"mtp.{s}."
        shapes.update(_draft_layer_shapes(p, cfg))
        shapes.update(_moe_shapes(p + "ffn.", E, D, I))
    shapes["mtp.0.main_proj.weight"] = (D, len(ds.target_layer_ids) * D)
    shapes["mtp.0.main_norm.weight"] = (D,)
    last = f"mtp.{S - 1}."
    shapes[last + "norm.weight"] = (D,)
    shapes[last + "markov_head.embed.weight"] = (V, r)
    shapes[last + "markov_head.head.weight"] = (V, r)
    shapes[last + "confidence_head.proj.weight"] = (1, D + r)
    return {name: (shape, disk_dtype(name, wdtype)) for name, shape in shapes.items()}


def mtp_tensor_shapes(cfg: ModelConfig, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of a DeepSeek-V4 checkpoint's MTP layers as released (docs/dspark.md 4: `mtp.{i}.*` in DeepSeek's
    own names, a window-only V4 layer with top-k MoE and per-expert w1/w2/w3, plus e_proj / h_proj, enorm / hnorm,
    norm and its hc_head) -> (shape, on-disk dtype). The embedding and LM head are the target's."""
    wdtype = torch_dtype(dtype)
    D, N, I, E = cfg.hidden_size, cfg.hc_mult, cfg.moe_intermediate_size, cfg.n_routed_experts
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{i}."
        shapes.update(_draft_layer_shapes(p, cfg))
        shapes.update(_moe_shapes(p + "ffn.", E, D, I, vision_bias=False))
        for name in ("e_proj", "h_proj"):
            shapes[p + f"{name}.weight"] = (D, D)
        for name in ("enorm", "hnorm", "norm"):
            shapes[p + f"{name}.weight"] = (D,)
        shapes[p + "hc_head_fn"] = (N, N * D)
        shapes[p + "hc_head_base"] = (N,)
        shapes[p + "hc_head_scale"] = (1,)
    return {name: (shape, disk_dtype(name, wdtype)) for name, shape in shapes.items()}


def tensor_shapes(cfg: ModelConfig, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`v41_tensor_shapes` for a V4.1 config, else `v4_tensor_shapes`."""
    return v41_tensor_shapes(cfg, dtype) if cfg.v41 is not None else v4_tensor_shapes(cfg, dtype)


def checkpoint_size(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[int, int]:
    """(parameters, bytes) of a tensor layout from `tensor_shapes`."""
    numel = {name: math.prod(shape) for name, (shape, _) in shapes.items()}
    nbytes = sum(numel[name] * dt.itemsize for name, (_, dt) in shapes.items())
    return sum(numel.values()), nbytes


def default_model_dir() -> str:
    """The built-in default model; see dsv4.make_model.default_model_dir (imported lazily: make_model
    imports this module)."""
    from dsv4.make_model import default_model_dir as _default_model_dir

    return _default_model_dir()
