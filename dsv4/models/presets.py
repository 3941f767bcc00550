"""Model presets for `dsv4 make-model`, and the tensor layout of a DeepSeek-V4 checkpoint.

`v4_tensor_shapes(cfg)` is the single statement of which tensors a V4 checkpoint holds (HF DeepseekV4ForCausalLM
state-dict names, model.md section 10.1) and their shapes; the writer, the loader and the tests share it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dsv4.models.config import CSA, HASH_MOE, SLIDING, ModelConfig

# Tensors kept in float32 whatever the checkpoint dtype, as DeepSeek ships them and HF keeps them: the mHC
# parameters, attention sinks, compressor position biases and the router bias are precision-critical.
_FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                  "self_attn.sinks", "position_bias", "e_score_correction_bias")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The size of the built-in byte-level BPE vocabulary (dsv4.make_model trains it): 5 special tokens + 256 byte
# symbols + 251 merges. A preset's vocab_size must be at least this.
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
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-v4": _TINY_V4,
}


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of preset `name`'s config.json dict."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


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

    def disk_dtype(name: str) -> torch.dtype:
        if name.endswith("tid2eid"):
            return torch.int64
        return torch.float32 if name.endswith(_FP32_SUFFIXES) else wdtype

    return {name: (shape, disk_dtype(name)) for name, shape in shapes.items()}


def default_model_dir() -> str:
    """The cached built-in default model; see dsv4.make_model.default_model_dir (imported lazily: make_model
    imports this module)."""
    from dsv4.make_model import default_model_dir as _default_model_dir

    return _default_model_dir()
