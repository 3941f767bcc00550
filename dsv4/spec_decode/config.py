"""Speculative decoding settings: what the checkpoint ships (a DSpark drafter or an MTP layer, read from its
config.json) and what the user asked for (a vLLM-shaped `--speculative-config`), validated against each other.

docs/dspark.md describes the drafters; this module only decides whether a request for one is runnable.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4.models.config import ConfigError

DSPARK = "dspark"
MTP = "mtp"
METHODS = (DSPARK, MTP)

# An MTP layer is re-applied autoregressively when k exceeds the layer count (vLLM does the same), so k is not bounded
# by the checkpoint; acceptance decays geometrically with depth and peers run at most 3 steps (docs/dspark.md), so a
# larger value is almost certainly a typo for a DSpark block size.
MAX_MTP_STEPS = 8

# `--speculative-config`'s help, shared by every command that takes it (dsv4.cli, dsv4.bench)
SPECULATIVE_CONFIG_HELP = (
    'speculative decoding with the checkpoint\'s drafter, as vLLM: \'{"method": "dspark" | "mtp", '
    '"num_speculative_tokens": k, "disable_by_batch_size": B}\' (k defaults to the DSpark block size / the MTP layer '
    "count; with B or more running requests a step decodes plainly, without drafts; B defaults to the measured "
    "break-even, 32 for DSpark, and null means never); by default steps where every request verifies k drafts run "
    "as k + 1 decode rows each with CUDA graphs, the drafter's proposals replay CUDA graphs and, on CUDA, async "
    "scheduling pipelines the steady verify steps (\"verify_decode\": false, \"drafter_cuda_graphs\": false turn "
    "them off); \"adaptive\": true (experimental) speculates only while the measured step times and acceptance "
    "say it pays")

# `disable_by_batch_size` when the user gives none: the running-request count from which speculation stops paying.
# DSpark (benchmarks/results/2026-12-05-h200-spec-break-even, V4.1-Flash-8l bf16, k = 5, verify rows and the drafter
# as CUDA graphs, pipelined): a full speculative step costs 2.32x / 2.14x / 2.91x a plain step at batch 1 / 8 / 32,
# so at the 2.8-3.5 tokens a step reported for V4.1's DSpark on typical text (docs/dspark.md) speculation gains
# 1.2-1.6x below 32 requests and 0.96-1.2x at 32: from 32 on a step decodes plainly. MTP has a measured step at
# batch 1 only (the k = 3 proposal alone costs 1.5 plain steps: 2026-12-05-h200-spec-pipelined), no break-even, so
# no default limit.
DEFAULT_DISABLE_BY_BATCH_SIZE: dict[str, int | None] = {DSPARK: 32, MTP: None}

_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", "verify_decode", "drafter_cuda_graphs",
         "adaptive")
# Keys vLLM accepts that dsv4 does not implement yet: refused with a message that says so, not as a typo.
_VLLM_ONLY_KEYS = ("model", "draft_tensor_parallel_size", "draft_sample_method", "rejection_sample_method",
                   "enable_adaptive_verification", "prompt_lookup_max", "prompt_lookup_min", "quantization",
                   "max_model_len", "revision", "code_revision", "speculative_token_tree", "parallel_drafting",
                   "use_local_argmax_reduction", "attention_backend", "kv_cache_dtype")
_OTHER_METHODS = {"deepseek_mtp": MTP, "eagle": None, "eagle3": None, "ngram": None, "medusa": None,
                  "draft_model": None, "suffix": None, "dflash": None}


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter of a DeepSeek-V4.1 checkpoint (config.json `dspark_*` fields, docs/dspark.md section 1)."""

    num_stages: int  # num_nextn_predict_layers: the checkpoint's `mtp.{0..S-1}.*` stages
    block_size: int  # tokens proposed by one drafter forward (anchor + block_size - 1 noise rows)
    noise_token_id: int  # the input id of every block row after the anchor
    target_layer_ids: tuple[int, ...]  # target layers whose input streams (mean over hc) feed main_proj, in order
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int


@dataclass(frozen=True)
class DrafterSpec:
    """What speculative method a checkpoint can run: `method` None when it ships no drafter."""

    model_type: str
    method: str | None
    num_layers: int  # draft layers in the checkpoint (`mtp.{i}` prefixes)
    dspark: DSparkConfig | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `--speculative-config`.

    `verify_decode` (dsv4's own key, default on; DSpark and MTP): a verify step in which every request
    verifies drafts in k + 1 tokens (its anchor and k drafts; a request rewound after a rejection is drafted k - 1
    after its recomputed token) runs as k + 1 decode rows per request through the model's fixed-shape decode
    forward (dsv4/spec_decode/verify_decode.py) instead of the eager token-row forward; any other step with drafts
    (fewer drafts near max_model_len, a prefill, images) stays eager; a request near its max_tokens verifies all k
    drafts, those past max_tokens dropped, and a constrained request k placeholders never accepted. The greedy
    output is the same either way.

    `drafter_cuda_graphs` (dsv4's own key, default on since measured on the H200; DSpark and MTP): on CUDA without
    enforce_eager the drafter's proposals replay one CUDA graph per request count (dsv4/spec_decode/drafter_graphs.py)
    instead of its eager, launch-bound forward. The drafts are the same either way.

    `adaptive` (dsv4's own key, default off: on the H200 it keeps ~0.9x plain decoding with a useless drafter, but
    its exactness in fp32 on a GPU is unproven, benchmarks/results/2026-12-05-h100-spec-adaptive-fp32): speculation
    runs only while it emits more tokens per second than plain decoding at the batch's size, both measured as the
    engine runs (step times and accepted drafts: dsv4/spec_decode/gate.py); `disable_by_batch_size` still applies on
    top."""

    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int | None = None
    verify_decode: bool = True
    drafter_cuda_graphs: bool = True
    adaptive: bool = False


def _spec_error(field: str, msg: str) -> ConfigError:
    return ConfigError(f"speculative config field `{field}`: {msg}")


def _text_fields(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's fields of a config.json: V4.1 composite configs nest them under `text_config`."""
    text = raw.get("text_config")
    return text if isinstance(text, Mapping) else raw


def _int_list(raw: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"config field `{name}`: must be a list of integers, got {value!r}")
    return tuple(value)


def _positive(raw: Mapping[str, Any], name: str, default: int) -> int:
    value = raw.get(name)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field `{name}`: must be a positive integer, got {value!r}")
    return value


def _noise_token_id(raw: Mapping[str, Any]) -> int:
    """As HF-V41's strict config: an integer (None is refused), default the released 128799."""
    value = raw.get("dspark_noise_token_id", 128799)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config field `dspark_noise_token_id`: must be an integer token id, got {value!r}")
    return value


def _default_target_layers(raw: Mapping[str, Any], n_layers: int, stages: int) -> tuple[int, ...]:
    """HF-V41's default (model.md 1.2): the last `stages` layers that are not KV sources."""
    kv_sources = set(_int_list(raw, "kv_source_layer_ids") or ())
    plain = [i for i in range(n_layers) if i not in kv_sources]
    return tuple(plain[-stages:])


def parse_dspark(raw: Mapping[str, Any]) -> DSparkConfig | None:
    """The DSpark drafter of a DeepSeek-V4.1 config.json (composite or flat); None without draft stages."""
    text = _text_fields(raw)
    stages = int(text.get("num_nextn_predict_layers") or 0)
    if stages <= 0:
        return None
    n_layers = int(text.get("num_hidden_layers") or 40)
    vocab = int(text.get("vocab_size") or 129280)
    targets = _int_list(text, "dspark_target_layer_ids") or _default_target_layers(text, n_layers, stages)
    bad = [t for t in targets if not 0 <= t < n_layers]
    if bad or not targets or len(set(targets)) != len(targets):
        raise ConfigError(f"config field `dspark_target_layer_ids`: {list(targets)} must be distinct backbone "
                          f"layers in [0, {n_layers})")
    cfg = DSparkConfig(
        num_stages=stages,
        block_size=_positive(text, "dspark_block_size", 5),
        noise_token_id=_noise_token_id(text),
        target_layer_ids=targets,
        markov_rank=_positive(text, "dspark_markov_rank", 256),
        n_routed_experts=_positive(text, "dspark_n_routed_experts", 128),
        num_experts_per_tok=_positive(text, "dspark_num_experts_per_tok", 3),
    )
    if not 0 <= cfg.noise_token_id < vocab:
        # the noise rows embed this id with the target's embedding table
        raise ConfigError(f"config field `dspark_noise_token_id`: {cfg.noise_token_id} is outside the vocabulary "
                          f"[0, {vocab})")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(f"config field `dspark_num_experts_per_tok`: {cfg.num_experts_per_tok} exceeds "
                          f"dspark_n_routed_experts {cfg.n_routed_experts}")
    return cfg


def drafter_spec(raw: Mapping[str, Any]) -> DrafterSpec:
    """What a config.json's checkpoint ships: V4.1 = DSpark (it has no MTP module), V4 = one MTP layer.

    V4 refreshes with a bundled DSpark drafter (V4-Flash-0731, V4-Pro-0813) are deepseek_v4 configs with `dspark_*`
    fields; their drafter differs from V4.1's (docs/dspark.md section 4) and dsv4 does not build it yet, so they
    are reported as having no runnable drafter rather than as MTP checkpoints (0731 has no usable MTP head)."""
    model_type = str(raw.get("model_type"))
    text = _text_fields(raw)
    nextn = int(text.get("num_nextn_predict_layers") or 0)
    if model_type in ("deepseek_v41", "deepseek_v41_text"):
        dspark = parse_dspark(raw)
        return DrafterSpec(model_type, DSPARK if dspark else None, nextn, dspark)
    if text.get("dspark_target_layer_ids"):
        return DrafterSpec(model_type, None, nextn)
    return DrafterSpec(model_type, MTP if nextn > 0 else None, nextn)


def _check_int(value: Any, field: str, low: int, high: int | None = None, why: str = "") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _spec_error(field, f"must be an integer, got {value!r}")
    if high is None and value < low:
        raise _spec_error(field, f"{value} must be >= {low}")
    if high is not None and not low <= value <= high:
        raise _spec_error(field, f"{value} is out of range [{low}, {high}]: {why}")
    return value


def _unknown_key_hint(key: str) -> str:
    if key in _VLLM_ONLY_KEYS:
        return f"`{key}` is a vLLM option dsv4 does not implement"
    close = difflib.get_close_matches(key, _KEYS, n=1)
    return f"unknown key `{key}`" + (f" (did you mean `{close[0]}`?)" if close else "")


def parse_speculative_config(value: str | Mapping[str, Any] | None, spec: DrafterSpec) -> SpeculativeConfig | None:
    """A vLLM-shaped `{"method", "num_speculative_tokens", "disable_by_batch_size"}` (a dict or its JSON text; plus
    dsv4's `verify_decode` and `drafter_cuda_graphs`), checked against the checkpoint's drafter. None (or an empty
    string) means no speculative decoding."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative config is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"speculative config must be a JSON object, got {type(value).__name__}")
    unknown = [k for k in value if k not in _KEYS]
    if unknown:
        raise _spec_error(unknown[0], f"{_unknown_key_hint(unknown[0])}; accepted keys: {', '.join(_KEYS)}")

    method = value.get("method")
    if method not in METHODS:
        alias = _OTHER_METHODS.get(method) if isinstance(method, str) else None
        hint = f" (use `{alias}`)" if alias else ""
        raise _spec_error("method", f"{method!r} is not supported{hint}; dsv4 runs {' or '.join(METHODS)}")
    if spec.method is None:
        raise _spec_error("method", f"{method!r} needs a drafter, and this {spec.model_type} checkpoint ships none "
                                    "that dsv4 can run")
    if method != spec.method:
        has = ("a DSpark drafter (DeepSeek-V4.1 has no MTP module)" if spec.method == DSPARK
               else f"{spec.num_layers} MTP layer(s) and no DSpark drafter")
        raise _spec_error("method", f"{method!r} does not match the checkpoint, which has {has}; "
                                    f"use \"method\": \"{spec.method}\"")

    k = value.get("num_speculative_tokens")
    if spec.method == DSPARK:
        assert spec.dspark is not None
        block = spec.dspark.block_size
        # the drafter always runs its full block (its block attention is non-causal and trained at this size); a
        # smaller k verifies only the first k drafts, a larger one cannot be drafted in one forward
        k = block if k is None else _check_int(k, "num_speculative_tokens", 1, block,
                                               f"the checkpoint's DSpark block (dspark_block_size) is {block}")
    else:
        k = spec.num_layers if k is None else _check_int(
            k, "num_speculative_tokens", 1, MAX_MTP_STEPS,
            "the MTP layer is re-applied per step; peers use at most 3 steps")

    # absent: the measured break-even; an explicit null: speculate at every batch size (vLLM's default)
    batch = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE[method])
    if batch is not None:
        batch = _check_int(batch, "disable_by_batch_size", 1)
    verify_decode = value.get("verify_decode", True)
    if not isinstance(verify_decode, bool):
        raise _spec_error("verify_decode", f"must be true or false, got {verify_decode!r}")
    graphs = value.get("drafter_cuda_graphs", True)
    if not isinstance(graphs, bool):
        raise _spec_error("drafter_cuda_graphs", f"must be true or false, got {graphs!r}")
    adaptive = value.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise _spec_error("adaptive", f"must be true or false, got {adaptive!r}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, disable_by_batch_size=batch,
                             verify_decode=verify_decode, drafter_cuda_graphs=graphs, adaptive=adaptive)


def load_speculative_config(model_dir: str, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """`parse_speculative_config` against the drafter of the checkpoint in `model_dir` (read from its config.json
    only, no weights): the CLI checks `--speculative-config` with it before loading or spawning anything."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    return parse_speculative_config(value, drafter_spec(raw))
