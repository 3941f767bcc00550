"""Tiny transformers DeepseekV4ForCausalLM references for tests (model.md section 11).

Not a test file: test modules import it (`from hf_reference import ...`; pytest puts tests/ on sys.path).
transformers is a test-only dependency, imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

# model.md section 11, verbatim.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 256,
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

# What model.md section 11 reports for the recipe (fp32, unpatched torch.topk, prompt of 40 tokens).
DOC_LOGITS_HEAD = [-0.09426, 0.29896, -0.17728, -0.00372, 0.30876]
DOC_GREEDY_16 = [143, 129, 44, 94, 145, 58, 106, 229, 8, 108, 30, 182, 239, 245, 128, 102]


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The section-11 config.json dict with `overrides` applied. Changing `num_hidden_layers` without giving
    `layer_types` / `mlp_layer_types` cycles / extends the tiny schedules so the lists keep the right length;
    `None` removes a key (to exercise defaults and legacy fields)."""
    raw = copy.deepcopy(TINY_CONFIG)
    n = overrides.get("num_hidden_layers", raw["num_hidden_layers"])
    if n != raw["num_hidden_layers"]:
        if "layer_types" not in overrides:
            raw["layer_types"] = [TINY_CONFIG["layer_types"][i % 4] for i in range(n)]
        if "mlp_layer_types" not in overrides:
            raw["mlp_layer_types"] = ["hash_moe"] * min(n, 2) + ["moe"] * max(0, n - 2)
    for k, v in overrides.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = copy.deepcopy(v)
    return raw


def hf_config(raw: dict[str, Any]) -> Any:
    """config.json dict -> DeepseekV4Config with eager attention (the only backend HF-V4 supports)."""
    from transformers import DeepseekV4Config

    # Deep copy: HF's rope standardisation edits nested dicts in place, which would leak into `raw`.
    kwargs = copy.deepcopy({k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    cfg = DeepseekV4Config(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def build_hf_model(raw: dict[str, Any] | None = None, seed: int = 0, init_seed: int = 1234) -> Any:
    """The section-11 recipe: seeded construction, then sinks / position_bias / hc bases (randn*0.5), router
    bias (randn*0.1) and tid2eid (first top_k of a randperm per token) overwritten from one generator, because
    HF initialises them to zero, which would hide code paths. fp32, eval mode."""
    from transformers import DeepseekV4ForCausalLM

    cfg = hf_config(raw if raw is not None else TINY_CONFIG)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(init_seed)
    for n, p in model.named_parameters():
        if n.endswith(("sinks", "position_bias", ".base", "hc_base")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        if n.endswith("tid2eid"):
            e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            b.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)]))
    return model


def save_hf_model(model: Any, path: str) -> str:
    """`save_pretrained` into `path` (config.json + model.safetensors in transformers' hybrid naming)."""
    model.save_pretrained(path)
    return path


def make_prompt(n: int = 40, seed: int = 7, vocab_size: int = 256, low: int = 2) -> torch.Tensor:
    """The section-11 prompt: `manual_seed(seed); randint(low, vocab, (1, n))`."""
    torch.manual_seed(seed)
    return torch.randint(low, vocab_size, (1, n))


def _stable_topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
                 *, out: Any = None) -> Any:
    """torch.topk with ties broken toward the lowest index: a stable sort keeps equal values in index order."""
    if out is not None:
        raise NotImplementedError("stable_topk does not support out=")
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    # `sorted=False` allows any order, so returning them sorted is still within topk's contract.
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def stable_topk() -> Iterator[None]:
    """Patch `torch.topk` and `Tensor.topk` so ties go to the lowest index while the block runs.

    HF's indexer scores tie often (ReLU zeros) and torch.topk breaks ties differently for different row lengths,
    so decode-vs-prefill references would otherwise disagree by ~5e-2 logits (model.md 11, 12)."""
    saved_fn, saved_method = torch.topk, torch.Tensor.topk
    torch.topk = _stable_topk
    torch.Tensor.topk = _stable_topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = saved_fn, saved_method


@torch.no_grad()
def hf_prefill_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of one full forward through the cache path (fresh DynamicCache, use_cache=True)."""
    from transformers import DynamicCache

    return model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits


@torch.no_grad()
def hf_greedy(model: Any, ids: torch.Tensor, n: int) -> list[int]:
    """`n` greedy tokens after `ids` (batch of one) from `generate` with the cache, EOS disabled."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()
