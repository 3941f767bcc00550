"""`quantization_config` of a checkpoint and the engine's `quantization` switch -> one frozen QuantConfig.

The released checkpoints say (config.json, top level; V4.1 may nest it under `text_config`):
  V4 / V4-Pro:   {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
                 with `expert_dtype: "fp4"` beside it (MXFP4 experts; the Base checkpoints say "fp8" and store
                 float32 scales)
  V4.1-Flash:    {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
The switch takes what vLLM takes for these checkpoints where it makes sense: `auto` (None) = what the checkpoint
says, `none` = dequantize every FP8/FP4 tensor at load (the reference path), `fp8` / `deepseek_v4_fp8` = the
checkpoint's FP8 format; a float checkpoint is first quantized into the released layout of its family (cached:
dsv4/quant/online.py, called by the engine before `load_quant_config`), never silently run unquantized.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from dsv4.models.config import ConfigError

QUANTIZATION_CHOICES = ("auto", "none", "fp8", "deepseek_v4_fp8")
_FMTS = ("e4m3", "float8_e4m3fn")
_EXPERT_DTYPES = ("fp4", "fp8")
_SCALE_FMTS = ("ue8m0", "float")


class QuantConfigError(ConfigError):
    """A `quantization_config` or `quantization` value the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's weights are stored (and kept in memory): FP8 e4m3 dense weights with one scale per
    `block` (rows, cols), UE8M0 (`scale_fmt` "ue8m0") or float32 scales, and routed experts in MXFP4 (`expert_dtype`
    "fp4") or in the dense FP8 format ("fp8")."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"

    @property
    def ue8m0(self) -> bool:
        """Whether dense scales are UE8M0 bytes (else float32)."""
        return self.scale_fmt == "ue8m0"

    def to_json(self) -> dict[str, Any]:
        """The `quantization_config` dict a released-layout checkpoint carries."""
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": self.scale_fmt,
                "weight_block_size": list(self.block), "expert_dtype": self.expert_dtype}


def _text(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else {}


def parse_quant_config(config: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's QuantConfig from its config.json dict; None for a float checkpoint. Raises QuantConfigError
    naming the field for a format the engine cannot run."""
    qc = config.get("quantization_config", _text(config).get("quantization_config"))
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"config field `quantization_config` must be an object, got {qc!r}")
    method = qc.get("quant_method", "fp8")
    if method not in ("fp8", "deepseek_v4_fp8"):
        raise QuantConfigError(f"quantization_config.quant_method {method!r} is not supported "
                               f"(supported: 'fp8', the DeepSeek-V4/V4.1 release format)")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in _FMTS:
        raise QuantConfigError(f"quantization_config.fmt {fmt!r} is not supported (supported: 'e4m3')")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise QuantConfigError(f"quantization_config.activation_scheme {act!r} is not supported (supported: "
                               f"'dynamic')")
    bs = qc.get("weight_block_size", [128, 128])
    if (not isinstance(bs, (list, tuple)) or len(bs) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
        raise QuantConfigError(f"quantization_config.weight_block_size must be two positive integers, got {bs!r}")
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in _SCALE_FMTS:
        raise QuantConfigError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported "
                               f"(supported: 'ue8m0', or none for float32 scales)")
    expert = qc.get("expert_dtype", config.get("expert_dtype", _text(config).get("expert_dtype", "fp8")))
    if expert not in _EXPERT_DTYPES:
        raise QuantConfigError(f"expert_dtype {expert!r} is not supported (supported: 'fp4' MXFP4, 'fp8')")
    return QuantConfig((int(bs[0]), int(bs[1])), scale_fmt, expert)


def resolve_quantization(requested: str | None, config: dict[str, Any]) -> QuantConfig | None:
    """The QuantConfig the engine runs: None = every weight in the model dtype (dequantized at load)."""
    choice = "auto" if requested is None else requested
    if choice not in QUANTIZATION_CHOICES:
        raise QuantConfigError(f"quantization {requested!r} is not supported; choose one of "
                               f"{list(QUANTIZATION_CHOICES)}")
    if choice == "none":
        return None
    qcfg = parse_quant_config(config)
    if qcfg is None and choice != "auto":
        raise QuantConfigError(f"quantization {choice!r} asks for FP8 weights but the checkpoint has no "
                               f"`quantization_config` (it is a float checkpoint: use 'auto' or 'none')")
    return qcfg


def load_quant_config(model_dir: str, requested: str | None = None) -> QuantConfig | None:
    """`resolve_quantization` for the checkpoint in `model_dir` (its config.json)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise QuantConfigError(f"cannot read {model_dir}/config.json: {e}") from None
    return resolve_quantization(requested, config if isinstance(config, dict) else {})
