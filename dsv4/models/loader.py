"""Safetensors checkpoint -> tensors under the engine's parameter names.

The engine's model uses exactly the state-dict names and shapes of transformers' `DeepseekV4ForCausalLM`
(model.md 10.1). Checkpoints come in three spellings, all accepted here, with or without a `model.` prefix:

* HF names (`model.layers.0.self_attn.q_a_proj.weight`, packed `mlp.experts.gate_up_proj`);
* original DeepSeek names (`layers.0.attn.wq_a.weight`, `embed.weight`, `head.weight`, per-expert
  `ffn.experts.E.w1/w2/w3.weight`, `attn.kv_norm` or `attn.norm`);
* the hybrid that transformers 5.23 `save_pretrained` writes: original names under `model.`, but
  `model.embed_tokens.weight`, `model.hc_head.hc_fn`, `model.norm.weight` and per-expert experts.

FP8 block-scaled weights (`X.weight` in float8 plus `X.weight_scale_inv` or `X.scale`) and packed FP4 (e2m1, two
per int8 byte, with per-block scales) are dequantized on load. Per-expert tensors are stacked into
`gate_up_proj [E, 2I, D]` (w1 rows, then w3 rows) and `down_proj [E, D, I]`. `mtp.*` tensors (the speculative
drafters') are ignored by the target's routes; `route_mtp` (V4) and `route_dspark` (V4.1) load them on their own.

Public API: `load_weights` (returns a dict), `iter_weights` (streams, validated up front), `load_into_module`
(fills an `nn.Module`'s parameters and buffers in place), `expected_from_module`, `keeps_fp32`, `param_dtype`,
`dequantize`, `canonical_name`, `CheckpointError`. Every mismatch (missing, unexpected, duplicated, wrong shape)
is collected and raised as one `CheckpointError` before any tensor data is read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from safetensors import safe_open
from torch import nn

from dsv4.quant.formats import MX_BLOCK, block_size_for, dequantize, unpack_fp4  # noqa: F401  (re-exported)
from dsv4.quant.weight import StoredFormat

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 5  # per error category in the message (then a count); the exception attributes keep everything

Shape = tuple[int, ...]
Expected = Mapping[str, "tuple[Shape, torch.dtype | None]"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot fill the model. The message lists every problem found; the attributes keep them:
    `missing` (names), `unexpected` (checkpoint keys), `mismatched` ((name, expected, found)), `other` (text)."""

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None,
                 mismatched: list[tuple[str, Shape, Shape]] | None = None, other: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []
        self.other = other or []


# ---- dtypes ----------------------------------------------------------------------------------------------------
# HF's `_keep_in_fp32_modules_strict` for V4, matched per dotted segment: mHC params, sinks, compressor/indexer
# position biases, router bias, and every norm weight (any segment ending in "norm").
_FP32_SEGMENTS = frozenset({"attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias"})


def keeps_fp32(name: str) -> bool:
    """True for the tensors HF keeps in float32 whatever the model dtype (mHC, sinks, position_bias, router bias,
    norm weights). Takes an internal (HF) name."""
    return any(seg in _FP32_SEGMENTS or seg.endswith("norm") for seg in name.split("."))


def param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor gets in a model of dtype `dtype`: int64 for `tid2eid`, fp32 where `keeps_fp32`, else
    `dtype`."""
    if name.endswith("tid2eid"):
        return torch.int64
    return torch.float32 if keeps_fp32(name) else dtype


# ---- names -----------------------------------------------------------------------------------------------------
_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Original layer-relative module paths (their leaf is `.weight`, or an FP8 scale) -> HF module paths.
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.norm": "self_attn.kv_norm",  # what transformers 5.23 save_pretrained writes for kv_norm
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
# Original layer-relative parameters without a `.weight` leaf -> HF names.
_LAYER_PARAMS = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def v4_original_names() -> tuple[dict[str, str], dict[str, str]]:
    """The inverse of the V4 renames: (top-level HF name -> original name, layer-relative HF name -> original name),
    what a checkpoint in DeepSeek's own spelling calls each tensor (`dsv4.quant.released` writes that layout).
    `attn.norm` (transformers' re-save of kv_norm) is read, never written."""
    top = {hf: orig for orig, hf in _TOP_LEVEL.items() if orig in ("embed.weight", "head.weight", "norm.weight")
           or orig.startswith("hc_head_")}
    layer = {f"{hf}.weight": f"{orig}.weight" for orig, hf in _LAYER_MODULES.items() if orig != "attn.norm"}
    layer |= {hf: orig for orig, hf in _LAYER_PARAMS.items()}
    return top, layer
_EXPERT_RE = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Per-expert piece -> (packed HF parameter, which half). w1 = gate, w3 = up, w2 = down.
_EXPERT_PART = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
                "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", 0), "down_proj": ("down_proj", 0)}


@dataclass(frozen=True)
class _Route:
    name: str  # internal (HF) name
    expert: int | None = None  # per-expert piece: expert index
    half: int = 0  # gate_up_proj: 0 = gate (w1) rows, 1 = up (w3) rows
    # read only [a, b) along dim d, (d, a, b): a sharded tensor's slice (expert, vocabulary, head parallelism)
    span: tuple[int, int, int] | None = None


_PACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _span_route(route_fn: Callable[[str], _Route | None], spans: dict[str, tuple[int, int, int]]
                ) -> Callable[[str], _Route | None]:
    def route(key: str) -> _Route | None:
        r = route_fn(key)
        return replace(r, span=spans[r.name]) if r is not None and r.name in spans else r
    return route


def expert_shard_route(route_fn: Callable[[str], _Route | None], first: int, count: int
                       ) -> Callable[[str], _Route | None]:
    """`route_fn` for a rank that holds the routed experts [first, first + count) only (expert parallelism): other
    experts' per-expert tensors are skipped (never read), this rank's are renumbered from 0, and packed expert
    tensors are read by row slice."""
    def route(key: str) -> _Route | None:
        r = route_fn(key)
        if r is None:
            return None
        if r.expert is not None:
            if not first <= r.expert < first + count:
                return None
            return replace(r, expert=r.expert - first)
        if _PACKED_EXPERTS.search(r.name):
            return replace(r, span=(0, first, first + count))
        return r
    return route


def _split_layer(bare: str, top: dict[str, str], experts: str) -> _Route | tuple[str, str]:
    """The route of a top-level key, of a non-layer key (kept, to be reported if unexpected) or of a per-expert
    piece (packed under `experts`); else (internal layer prefix, layer-relative rest) for the caller to rename."""
    if bare in top:
        return _Route(top[bare])
    m = _LAYER_RE.match(bare)
    if m is None:
        return _Route(bare if bare.startswith("lm_head.") else "model." + bare)
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    e = _EXPERT_RE.match(rest)
    if e is not None:
        packed, half = _EXPERT_PART[e.group(2)]
        return _Route(prefix + experts + packed, expert=int(e.group(1)), half=half)
    return prefix, rest


def route_v4(key: str) -> _Route | None:
    """Internal name of a (weight, not scale) checkpoint key; None for ignored (`mtp.*`) keys. Unknown keys come
    back unchanged (with the `model.` prefix) so that they are reported as unexpected."""
    bare = key[len("model."):] if key.startswith("model.") else key
    if bare.startswith("mtp."):
        return None
    split = _split_layer(bare, _TOP_LEVEL, "mlp.experts.")
    if isinstance(split, _Route):
        return split
    prefix, rest = split
    return _Route(prefix + _v4_layer_name(rest))


def _v4_layer_name(rest: str) -> str:
    """The HF name of a layer-relative V4 key (original, hybrid or HF spelling; per-expert pieces excluded)."""
    if rest in _LAYER_PARAMS:
        return _LAYER_PARAMS[rest]
    module, _, leaf = rest.rpartition(".")
    if module in _LAYER_MODULES:
        return _LAYER_MODULES[module] + "." + leaf
    # Already HF-style (or half-converted): only the two container names differ.
    if rest.startswith("attn."):
        rest = "self_attn." + rest[len("attn."):]
    elif rest.startswith("ffn."):
        rest = "mlp." + rest[len("ffn."):]
    return rest


# The V4 MTP layer's own tensors (docs/dspark.md 4): released name -> name in `MTPLayer` (the rest of the layer is
# named as a target layer); the embedding and head some exports copy under `mtp.{i}.` are the target's (ignored).
_MTP_OWN = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
            "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "shared_head.norm.weight": "norm.weight",
            "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_MTP_SHARED = ("emb.tok_emb.weight", "embed_tokens.weight", "head.weight", "shared_head.head.weight")


def route_mtp(key: str) -> _Route | None:
    """Internal name of a DeepSeek-V4 MTP key (`mtp.{i}.*`) in `MTPDrafter`: the layer's tensors under their HF
    target names (`_v4_layer_name`, experts packed), the MTP's own by `_MTP_OWN`; None for the target's keys and
    for copies of the shared embedding / head."""
    bare = key[len("model."):] if key.startswith("model.") else key
    m = _MTP_RE.match(bare)
    if m is None:
        return None
    prefix, rest = f"mtp.{m.group(1)}.", m.group(2)
    if rest in _MTP_SHARED:
        return None
    if rest in _MTP_OWN:
        return _Route(prefix + _MTP_OWN[rest])
    e = _EXPERT_RE.match(rest)
    if e is not None:
        packed, half = _EXPERT_PART[e.group(2)]
        return _Route(prefix + "mlp.experts." + packed, expert=int(e.group(1)), half=half)
    return _Route(prefix + _v4_layer_name(rest))


# ---- V4.1 names ------------------------------------------------------------------------------------------------
# V4.1's internal names are the reference's original names (model.md 10.2) under `model.`, with packed experts.
# Newer HF-V41 module names map onto them; engram tables are left to `HostTable` (host memory, memory-mapped).
_V41_TOP = {"embed.weight": "model.embed.weight", "embed_tokens.weight": "model.embed.weight",
            "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight"}
_V41_RENAMES = [  # newer HF-V41 -> original, applied to the layer-relative part
    ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."), ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."), ("self_attn.o_a_proj.", "attn.wo_a."), ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"), ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."), ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.indexer.q_b_proj.", "attn.indexer.wq_b."), ("self_attn.indexer.k_proj.", "attn.indexer.wk."),
    ("self_attn.", "attn."), ("mlp.gate.e_score_correction_bias_vl", "ffn.gate.bias_vl"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"), ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."), ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("mlp.", "ffn."),
]
_V41_IGNORED = re.compile(r"^(mtp\.|engram_tables\.|layers\.\d+\.engram\.embed\.)")

# The vision encoder (dsv4/models/vision.py) sits in the V4.1 model as `vision_encoder`; its own state-dict names are
# model.md 10.2's `vision.*`, `aligner.*`, `image_{start,end,newline}`. Newer HF-V41 names the tower `visual` and its
# attention projections `qkv` / `proj`.
VISION_MODULE = "vision_encoder"
_VISION_KEY = re.compile(r"^((vision|visual|aligner)\.|image_(start|end|newline)$)")
_VISUAL_ATTN = [(re.compile(r"^(blocks\.\d+\.attn\.)qkv\."), r"\1wqkv."),
                (re.compile(r"^(blocks\.\d+\.attn\.)proj\."), r"\1wo.")]


def _v41_bare(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def is_vision_key(key: str) -> bool:
    """True for a V4.1 checkpoint key of the vision encoder (ViT, aligner, delimiters) in any spelling."""
    return _VISION_KEY.match(_v41_bare(key)) is not None


def _vision_name(bare: str) -> str:
    """model.md 10.2 name of a (prefix-stripped) vision key."""
    if bare.startswith("visual."):
        rest = bare[len("visual."):]
        for pattern, repl in _VISUAL_ATTN:
            rest = pattern.sub(repl, rest)
        bare = "vision." + rest
    return bare


def route_v41(key: str) -> _Route | None:
    """Internal V4.1 name of a checkpoint key (original, HF-saved or newer-HF spelling); None for keys loaded
    elsewhere or not used (engram tables, `mtp.*`). Vision keys go to `vision_encoder.<model.md 10.2 name>`."""
    bare = _v41_bare(key)
    if _V41_IGNORED.match(bare):
        return None
    if _VISION_KEY.match(bare):
        return _Route(f"{VISION_MODULE}.{_vision_name(bare)}")
    split = _split_layer(bare, _V41_TOP, "ffn.experts.")
    if isinstance(split, _Route):
        return split
    prefix, rest = split
    for old, new in _V41_RENAMES:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return _Route(prefix + rest)


_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")


def route_dspark(key: str) -> _Route | None:
    """Internal name of a DSpark drafter key (`mtp.{s}.*`, docs/dspark.md 1.2) in `DSparkDrafter`: the released
    name, per-expert pieces packed as the target's, newer HF-V41 spellings renamed; None for every other key (the
    target's, loaded by `route_v41`)."""
    m = _MTP_RE.match(_v41_bare(key))
    if m is None:
        return None
    prefix, rest = f"mtp.{m.group(1)}.", m.group(2)
    e = _EXPERT_RE.match(rest)
    if e is not None:
        packed, half = _EXPERT_PART[e.group(2)]
        return _Route(prefix + "ffn.experts." + packed, expert=int(e.group(1)), half=half)
    for old, new in _V41_RENAMES:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return _Route(prefix + rest)


def route_v41_text(key: str) -> _Route | None:
    """`route_v41` for a text-only model built from a checkpoint that has a vision tower: vision keys ignored."""
    return None if is_vision_key(key) else route_v41(key)


def has_vision_weights(model_dir: str) -> bool:
    """Whether the checkpoint in `model_dir` holds vision-encoder tensors (reads the headers only). A directory
    with no weight files (config and tokenizer for load_format "dummy") has none: its model is text-only."""
    if not glob.glob(os.path.join(model_dir, "*.safetensors")) and not os.path.isfile(
            os.path.join(model_dir, INDEX_FILE)):
        return False
    return any(is_vision_key(k) for k in _scan(model_dir))


def canonical_name(key: str) -> str | None:
    """Internal (HF) name for a checkpoint key in any accepted spelling; per-expert keys give the packed name
    (`...mlp.experts.gate_up_proj` / `down_proj`). None for ignored keys (`mtp.*`)."""
    r = route_v4(key)
    return None if r is None else r.name


# ---- quantization ----------------------------------------------------------------------------------------------
_FLOAT8 = {"F8_E4M3", "F8_E5M2"}
_PACKED_FP4 = {"I8", "U8"}  # two e2m1 values per byte, low nibble first (as transformers' Fp8Dequantize)
SCALE_SUFFIX = "_scale"  # a quantized layer's scale buffer: `X.weight` -> `X.weight_scale` (dsv4.quant.layers)


def _scale_target(key: str) -> str:
    """The weight key a scale key would belong to (`X.weight_scale_inv` / `X.scale` -> `X.weight`,
    `X_scale_inv` -> `X`)."""
    if key.endswith(".weight_scale_inv"):
        return key[: -len("_scale_inv")]
    if key.endswith(".scale"):
        return key[: -len("scale")] + "weight"
    if key.endswith("_scale_inv"):
        return key[: -len("_scale_inv")]
    return ""


# ---- checkpoint files ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Info:
    file: str
    shape: Shape
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"


def _read_header(path: str) -> dict[str, _Info]:
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            return {k: _Info(path, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for bad headers and truncated files
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None


def _scan(model_dir: str) -> dict[str, _Info]:
    """Every tensor key of the checkpoint -> (file, shape, dtype), from headers only."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"checkpoint directory {model_dir!r} does not exist")
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("`weight_map` must map tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"bad index {index_path}: {e!r}") from None
        infos: dict[str, _Info] = {}
        problems = []
        for fname in sorted(set(weight_map.values())):
            path = os.path.join(model_dir, fname)
            if not os.path.isfile(path):
                problems.append(f"{fname} (named by the index) does not exist")
                continue
            for k, info in _read_header(path).items():
                if k in infos:
                    problems.append(f"tensor {k!r} is in both {os.path.basename(infos[k].file)} and {fname}")
                infos[k] = info
        for k, fname in weight_map.items():
            if k not in infos or infos[k].file != os.path.join(model_dir, fname):
                if os.path.isfile(os.path.join(model_dir, fname)):
                    problems.append(f"tensor {k!r} is not in {fname}, where the index puts it")
        if problems:
            raise CheckpointError(f"bad index {index_path}:\n  " + "\n  ".join(problems))
        return infos
    single = os.path.join(model_dir, SINGLE_FILE)
    files = [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {model_dir!r}")
    if len(files) > 1:
        raise CheckpointError(f"{len(files)} safetensors files in {model_dir!r} but no {INDEX_FILE}: "
                              f"{[os.path.basename(p) for p in files]}")
    return _read_header(files[0])


def _block_hint(model_dir: str) -> tuple[int, int] | None:
    """`quantization_config.weight_block_size` from config.json, when present."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            qc = json.load(f).get("quantization_config") or {}
        bs = qc.get("weight_block_size")
        return (int(bs[0]), int(bs[1])) if bs else None
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return None


# ---- plan ------------------------------------------------------------------------------------------------------
@dataclass
class _Source:
    """One checkpoint tensor, with its scale when quantized."""

    key: str
    info: _Info
    scale: _Info | None = None
    scale_key: str | None = None
    span: tuple[int, int, int] | None = None  # only [a, b) along dim d, (d, a, b)
    raw: bool = False  # read as stored (a quantized layer keeps the bytes), not dequantized

    @property
    def full_shape(self) -> Shape:
        # Packed FP4 holds two values per byte along the last dim (as stored, when raw).
        if self.scale is not None and self.info.dtype in _PACKED_FP4 and not self.raw:
            return (*self.info.shape[:-1], 2 * self.info.shape[-1])
        return self.info.shape

    @property
    def shape(self) -> Shape:
        shape = self.full_shape
        if self.span is not None:
            d, a, b = self.span
            shape = (*shape[:d], b - a, *shape[d + 1:])
        return shape


@dataclass
class _Target:
    """One internal tensor: a single source, or per-expert pieces {(expert, half): source} to stack."""

    name: str
    single: _Source | None = None
    pieces: dict[tuple[int, int], _Source] = field(default_factory=dict)
    shape: Shape = ()


@dataclass
class _Plan:
    targets: dict[str, _Target]
    block_hint: tuple[int, int] | None


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _scale_source(src: _Source, hint: tuple[int, int] | None, other: list[str], stacked: bool) -> _Source | None:
    """The scale of a weight read as stored, as a source of its own (the quantized layer's `_scale` buffer): its
    span is the weight's cut in blocks, so a cut must fall on a block boundary. `stacked`: the piece is stacked
    on another along its rows (w1 over w3), which keeps one scale grid only if its rows fill whole blocks."""
    logical = replace(src, raw=False, span=None).full_shape
    try:
        block = block_size_for(logical, src.scale.shape, hint)
    except ValueError as e:
        other.append(f"{src.key} (scale {src.scale_key}): {e}")
        return None
    if stacked and logical[-2] % block[0]:
        other.append(f"{src.key}: {logical[-2]} rows are not a multiple of its scale block {block}; stacked with "
                     f"its sibling (w1 over w3) the blocks would straddle both")
        return None
    span = None
    if src.span is not None:
        d, a, b = src.span
        if d == len(logical) - 1 and src.info.dtype in _PACKED_FP4:
            other.append(f"{src.key}: a packed FP4 weight cannot be cut along its packed dim")
            return None
        per = block[d - len(logical) + 2] if d >= len(logical) - 2 else 1
        if a % per:
            other.append(f"{src.key}: the cut [{a}, {b}) along dim {d} does not start on a scale block ({per})")
            return None
        span = (d, a // per, -(-b // per))
    return _Source(src.scale_key, src.scale, span=span, raw=True)


def _make_plan(model_dir: str, expected: Expected, route_fn: Callable[[str], _Route | None] = route_v4,
               infos: dict[str, _Info] | None = None) -> _Plan:
    """Which checkpoint tensors fill which of `expected`'s names, validated (one CheckpointError listing every
    problem). A weight whose name + `_scale` is expected is read as stored, its scale into that name (a quantized
    layer); other quantized weights are dequantized. `infos`: the checkpoint's tensors when not read from the
    files' headers (dummy weights)."""
    infos = _scan(model_dir) if infos is None else infos
    hint = _block_hint(model_dir)
    other: list[str] = []

    # Pair scales with their weights. A key like `attn_hc.scale` is an mHC parameter, not a scale: a key only
    # counts as a scale when its weight sibling exists.
    scale_of: dict[str, str] = {}
    for k in infos:
        w = _scale_target(k)
        if w and w in infos:
            scale_of[w] = k
    scales = set(scale_of.values())

    targets: dict[str, _Target] = {}
    sources_of: dict[str, list[str]] = {}
    n_ignored = 0
    for k, info in infos.items():
        if k in scales:
            continue
        route = route_fn(k)
        if route is None:
            n_ignored += 1
            continue
        sk = scale_of.get(k)
        raw = sk is not None and route.name + SCALE_SUFFIX in expected
        src = _Source(k, info, infos[sk] if sk else None, sk, route.span, raw)
        if route.span is not None:
            d, a, b = route.span
            if len(src.full_shape) <= d or b > src.full_shape[d]:
                other.append(f"{k}: {_fmt(src.full_shape)} has no [{a}, {b}) along dim {d} to shard")
                continue
        if sk is None and info.dtype in _FLOAT8:
            other.append(f"{k}: {info.dtype} tensor without a scale (`.weight_scale_inv` or `.scale`)")
        if sk is not None and info.dtype not in _FLOAT8 | _PACKED_FP4:
            other.append(f"{k}: has scale {sk} but is {info.dtype}, not FP8 or packed FP4")
        if sk is None and route.name + SCALE_SUFFIX in expected:
            other.append(f"{k}: stored as {info.dtype} without a scale, but the model keeps it quantized")
        pairs = [(route.name, src)]
        if raw:
            scale_src = _scale_source(src, hint, other, stacked=route.expert is not None and
                                      route.name.endswith("gate_up_proj"))
            pairs += [(route.name + SCALE_SUFFIX, scale_src)] if scale_src is not None else []
        for name, one in pairs:
            t = targets.setdefault(name, _Target(name))
            sources_of.setdefault(name, []).append(one.key)
            if route.expert is None:
                t.single = one
            elif (route.expert, route.half) in t.pieces:
                other.append(f"{name}: expert {route.expert} given twice "
                             f"({t.pieces[(route.expert, route.half)].key} and {one.key})")
            else:
                t.pieces[(route.expert, route.half)] = one
    if n_ignored:
        logger.info("not loading %d tensors of %s into the module (the mtp.* drafter's, loaded only with "
                    "speculative decoding and into the drafter; engram tables, which stay memory-mapped; other "
                    "ranks' experts; or the target's, when loading the drafter)", n_ignored, model_dir)

    for name, t in targets.items():
        if t.single is not None and (t.pieces or len(sources_of[name]) > 1):
            other.append(f"{name}: given more than once, by {sorted(sources_of[name])}")
            continue
        if t.single is not None:
            t.shape = t.single.shape
            continue
        n_experts = max(e for e, _ in t.pieces) + 1
        halves = (0, 1) if name.endswith(("gate_up_proj", "gate_up_proj" + SCALE_SUFFIX)) else (0,)
        absent = [f"expert {e} {'w1' if h == 0 and len(halves) == 2 else 'w3' if h else 'w2'}"
                  for e in range(n_experts) for h in halves if (e, h) not in t.pieces]
        shapes = {h: {t.pieces[(e, h)].shape for e in range(n_experts) if (e, h) in t.pieces} for h in halves}
        if absent:
            other.append(f"{name}: per-expert tensors missing: {', '.join(absent)}")
        elif any(len(s) != 1 for s in shapes.values()) or any(len(next(iter(s))) != 2 for s in shapes.values()):
            other.append(f"{name}: per-expert shapes disagree: {sorted(set().union(*shapes.values()))}")
        else:
            per = [next(iter(shapes[h])) for h in halves]
            if len({p[1] for p in per}) != 1:
                other.append(f"{name}: w1/w3 shapes disagree: {per}")
            else:
                t.shape = (n_experts, sum(p[0] for p in per), per[0][1])

    missing = [n for n in expected if n not in targets]
    unexpected = [f"{n} (from {', '.join(sorted(sources_of[n]))})" for n in targets if n not in expected]
    mismatched = [(n, tuple(expected[n][0]), t.shape) for n, t in targets.items()
                  if n in expected and t.shape and tuple(expected[n][0]) != t.shape]
    if missing or unexpected or mismatched or other:
        def section(title: str, items: list[str]) -> str:
            shown = items[:_MAX_LISTED] + ([f"... and {len(items) - _MAX_LISTED} more"] if len(items) > _MAX_LISTED
                                           else [])
            return f"{title} ({len(items)}):\n    " + "\n    ".join(shown)

        parts = []
        if missing:
            parts.append(section("missing", [f"{n} {_fmt(tuple(expected[n][0]))}" for n in missing]))
        if unexpected:
            parts.append(section("unexpected", unexpected))
        if mismatched:
            parts.append(section("shape mismatch", [f"{n}: expected {_fmt(e)}, found {_fmt(f)}"
                                                    for n, e, f in mismatched]))
        if other:
            parts.append(section("invalid", other))
        raise CheckpointError(f"checkpoint {model_dir} does not match the model:\n  " + "\n  ".join(parts),
                              missing=missing, unexpected=unexpected, mismatched=mismatched, other=other)
    return _Plan(targets, hint)


_SCALE_DTYPES = {"F8_E8M0": torch.uint8, "U8": torch.uint8, "F32": torch.float32}


def stored_formats(model_dir: str, route_fn: Callable[[str], _Route | None] = route_v4,
                   infos: dict[str, _Info] | None = None) -> dict[str, StoredFormat]:
    """{internal name: StoredFormat} of every weight the checkpoint stores quantized (FP8 or packed FP4 with a
    scale), from the headers (or `infos`): what `dsv4.quant.layers.quantize_model` builds quantized layers for.
    Per-expert pieces give their packed name once; pieces stored in different formats are refused."""
    infos = _scan(model_dir) if infos is None else infos
    hint = _block_hint(model_dir)
    out: dict[str, StoredFormat] = {}
    for k, info in infos.items():
        sk, w = k, _scale_target(k)
        if not w or w not in infos or infos[w].dtype not in _FLOAT8 | _PACKED_FP4:
            continue
        route = route_fn(w)
        if route is None:
            continue
        winfo, fp4 = infos[w], infos[w].dtype in _PACKED_FP4
        logical = (*winfo.shape[:-1], 2 * winfo.shape[-1]) if fp4 else winfo.shape
        if info.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"{sk}: scale stored as {info.dtype}; supported: F8_E8M0/U8 (UE8M0) or float")
        try:
            block = block_size_for(logical, info.shape, hint)
        except ValueError as e:
            raise CheckpointError(f"{w} (scale {sk}): {e}") from None
        fmt = StoredFormat(fp4, block, _SCALE_DTYPES[info.dtype])
        if fp4 and block != (1, MX_BLOCK):
            raise CheckpointError(f"{w}: packed FP4 with scale blocks of {block}; only MXFP4 (1 x {MX_BLOCK}) is "
                                  f"supported")
        if out.setdefault(route.name, fmt) != fmt:
            raise CheckpointError(f"{route.name}: its pieces are stored in different formats "
                                  f"({out[route.name]} and {fmt}, {w})")
    return out


# ---- reading ---------------------------------------------------------------------------------------------------
class _Files:
    """Open safetensors handles, one per file, for the duration of a load."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._handles: dict[str, object] = {}

    def get(self, info: _Info, key: str, span: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor `key`, or only its [a, b) along dim d for span (d, a, b) (read without the rest)."""
        try:
            if info.file not in self._handles:
                self._handles[info.file] = self._stack.enter_context(safe_open(info.file, framework="pt",
                                                                               device="cpu"))
            if span is not None:
                d, a, b = span
                return self._handles[info.file].get_slice(key)[(slice(None),) * d + (slice(a, b),)]
            return self._handles[info.file].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {key!r} from {info.file}: {e}") from None


def _read(src: _Source, files: _Files, device: torch.device, dtype: torch.dtype,
          hint: tuple[int, int] | None) -> torch.Tensor:
    if src.raw:  # the stored bytes, viewed as the layer's dtype (int8 FP4 as uint8, E8M0 scales as uint8)
        t = files.get(src.info, src.key, src.span).to(device)
        if t.element_size() != torch.empty(0, dtype=dtype).element_size():
            raise CheckpointError(f"{src.key}: stored as {src.info.dtype}, which the model cannot keep as {dtype}")
        return t.view(dtype)
    span = src.span
    if span is not None and src.scale is not None and not (span[0] == 0 and len(src.full_shape) == 3):
        # a quantized 2-D weight sliced across its scale blocks: dequantize the whole (dense attention weights
        # are small), then keep the slice; expert-major [E, R, C] tensors slice their scales by expert below
        d, a, b = span
        return _read(replace(src, span=None), files, device, dtype, hint).narrow(d, a, b - a).contiguous()
    t = files.get(src.info, src.key, span).to(device)
    if src.scale is None:
        return t.to(dtype)
    s = files.get(src.scale, src.scale_key, span).to(device)
    try:
        block = block_size_for(src.shape, tuple(s.shape), hint)
    except ValueError as e:
        raise CheckpointError(f"{src.key} (scale {src.scale_key}): {e}") from None
    return dequantize(t, s, block).to(dtype)


def _materialize(t: _Target, files: _Files, device: torch.device, dtype: torch.dtype,
                 hint: tuple[int, int] | None) -> torch.Tensor:
    if t.single is not None:
        return _read(t.single, files, device, dtype, hint)
    # Fill a preallocated [E, rows, cols] so the stack never exists twice.
    out = torch.empty(t.shape, dtype=dtype, device=device)
    gate_rows = t.pieces[(0, 0)].shape[0]
    for (e, half), src in sorted(t.pieces.items()):
        rows = slice(0, gate_rows) if half == 0 else slice(gate_rows, t.shape[1])
        out[e, rows] = _read(src, files, device, dtype, hint)
    return out


# ---- dummy weights (load_format "dummy") --------------------------------------------------------------------
DUMMY_FILE = "<dummy>"
# torch dtype <-> safetensors dtype name (the dummy layouts here, the released writer's headers)
SAFETENSORS_DTYPES = {torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.uint8: "U8", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}
if hasattr(torch, "float8_e8m0fnu"):
    SAFETENSORS_DTYPES[torch.float8_e8m0fnu] = "F8_E8M0"
_ST_TORCH = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def dummy_infos(layout: Mapping[str, tuple[Shape, torch.dtype]]) -> dict[str, _Info]:
    """A checkpoint's tensors as the loader sees them, from a layout {name: (shape, dtype)} with no files."""
    return {k: _Info(DUMMY_FILE, tuple(shape), SAFETENSORS_DTYPES[dt]) for k, (shape, dt) in layout.items()}


class _DummyFiles:
    """Stands in for `_Files`: random tensors of each key's stored shape and dtype, drawn on `device` (no host
    copy of a full-size model), at magnitudes that keep activations finite: floats uniform in +-0.02 (norms and
    mHC scales 1), FP8 codes in +-1 and packed FP4 any byte (|code| <= 6) under block scales of 2^-9 .. 2^-6
    (UE8M0, or float32 2^-7), integer tables (hash routing) below `int_high`."""

    def __init__(self, device: torch.device, int_high: int, seed: int = 0) -> None:
        self.device, self.int_high = device, int_high
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def get(self, info: _Info, key: str, span: tuple[int, int, int] | None = None) -> torch.Tensor:
        shape = list(info.shape)
        if span is not None:
            shape[span[0]] = span[2] - span[1]
        kw = {"device": self.device, "generator": self.gen}
        block_scale = key.endswith((".scale", "_scale_inv"))
        if info.dtype in ("F8_E8M0", "U8") and block_scale:
            return torch.randint(118, 122, shape, dtype=torch.uint8, **kw).view(_ST_TORCH[info.dtype])
        if info.dtype == "F32" and block_scale:
            return torch.full(shape, 2.0 ** -7, device=self.device)
        if info.dtype in ("I8", "U8"):
            return torch.randint(0, 256, shape, dtype=torch.int16, **kw).to(torch.uint8).view(_ST_TORCH[info.dtype])
        if info.dtype == "I64":
            return torch.randint(0, self.int_high, shape, dtype=torch.int64, **kw)
        if "norm" in key or key.endswith("scale"):
            return torch.ones(shape, device=self.device).to(_ST_TORCH[info.dtype])
        t = torch.empty(shape, dtype=torch.float32, device=self.device).uniform_(-0.02, 0.02, generator=self.gen)
        return (t * 50 if info.dtype == "F8_E4M3" else t).to(_ST_TORCH[info.dtype])


def _iterate(plan: _Plan, names: list[str], dtype_of: Callable[[str], torch.dtype],
             device_of: Callable[[str], torch.device], dummy: _DummyFiles | None = None
             ) -> Iterator[tuple[str, torch.Tensor]]:
    with contextlib.ExitStack() as stack:
        files = dummy or _Files(stack)
        for name in names:
            yield name, _materialize(plan.targets[name], files, device_of(name), dtype_of(name), plan.block_hint)


# ---- public entry points ---------------------------------------------------------------------------------------
def iter_weights(model_dir: str, expected: Expected, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Validate the checkpoint against `expected` (raising one CheckpointError listing every problem), then return
    an iterator of (name, tensor), one tensor read at a time.

    `expected` maps each internal name to (shape, dtype). A dtype of None means `param_dtype(name, dtype)`: the
    model dtype, except fp32-kept tensors and int64 `tid2eid`. FP8/FP4 weights are dequantized in fp32 on
    `device`, then cast.
    """
    plan = _make_plan(model_dir, expected)
    dev = torch.device(device)

    def dtype_of(name: str) -> torch.dtype:
        want = expected[name][1]
        return want if want is not None else param_dtype(name, dtype)

    return _iterate(plan, list(expected), dtype_of, lambda _name: dev)


def load_weights(model_dir: str, expected: Expected, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Load every tensor of `expected` from the safetensors checkpoint in `model_dir` (single file or sharded with
    an index), under the internal names, with the dtype rule of `iter_weights`."""
    return dict(iter_weights(model_dir, expected, dtype, device))


def expected_from_module(module: nn.Module) -> dict[str, tuple[Shape, torch.dtype]]:
    """(shape, dtype) of every persistent parameter and buffer of `module`, by state-dict name."""
    return {n: (tuple(t.shape), t.dtype) for n, t in module.state_dict().items()}


@torch.no_grad()
def load_into_module(module: nn.Module, model_dir: str, route_fn: Callable[[str], _Route | None] = route_v4,
                     experts: tuple[int, int] | None = None,
                     spans: dict[str, tuple[int, int, int]] | None = None,
                     dummy_layout: Mapping[str, tuple[Shape, torch.dtype]] | None = None,
                     dummy_int_high: int = 1,
                     check_finite: bool = os.environ.get("DSV4_SKIP_FINITE_CHECK", "0") != "1") -> None:
    """Fill `module`'s parameters and persistent buffers in place from the checkpoint, tensor by tensor, each in
    the dtype and on the device it already has (build the module with `param_dtype`). Every state-dict entry must
    be in the checkpoint (V4 never ties `lm_head` to the embedding, so tied weights are not handled).
    `experts` = (first, count): the module holds those routed experts only (expert parallelism): only they are read.
    `spans`: {internal name: (dim, a, b)}: those tensors hold [a, b) along dim only (the vocabulary-parallel
    embedding and head, the attention heads of a tensor-parallel rank), read by slice.
    `dummy_layout`: no weight files; random tensors of this checkpoint layout {name: (shape, stored dtype)} are
    drawn on the module's device (load_format "dummy"; integer tables below `dummy_int_high`).
    `check_finite`: refuse a checkpoint whose tensors hold NaN or infinities, naming them (one pass over the weights
    as they are loaded; `DSV4_SKIP_FINITE_CHECK=1` turns it off)."""
    if experts is not None:
        route_fn = expert_shard_route(route_fn, *experts)
    if spans:
        route_fn = _span_route(route_fn, spans)
    targets = module.state_dict()
    infos = dummy_infos(dummy_layout) if dummy_layout is not None else None
    plan = _make_plan(model_dir, expected_from_module(module), route_fn, infos)
    dummy = None
    if dummy_layout is not None:
        device = next(iter(targets.values())).device if targets else torch.device("cpu")
        dummy = _DummyFiles(device, dummy_int_high)
    bad: list[str] = []
    for name, tensor in _iterate(plan, list(targets), lambda n: targets[n].dtype, lambda n: targets[n].device,
                                 dummy):
        targets[name].copy_(tensor)
        if check_finite and dummy is None and not all_finite(targets[name]):
            bad.append(name)
    if bad:
        shown = ", ".join(bad[:_MAX_LISTED]) + (f" ... and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED
                                                 else "")
        raise CheckpointError(f"checkpoint {model_dir}: {len(bad)} tensors hold NaN or infinite values: {shown} "
                              f"(a corrupt or badly converted checkpoint; DSV4_SKIP_FINITE_CHECK=1 loads it anyway)",
                              other=bad)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in `t`: float tensors, and FP8 e4m3 by its bit patterns (0x7F / 0xFF are its NaNs; it has
    no infinity); integer tensors (FP4 pairs, UE8M0 scales, ids) have no such values to check. In chunks, so the
    check never holds a mask of a whole multi-GB tensor."""
    flat = t.reshape(-1)
    step = 1 << 26
    for i in range(0, flat.numel(), step):
        part = flat[i: i + step]
        if part.dtype == torch.float8_e4m3fn:
            if ((part.view(torch.uint8) & 0x7F) == 0x7F).any():
                return False
        elif part.is_floating_point() and not torch.isfinite(part).all():
            return False
    return True
