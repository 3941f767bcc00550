"""`dsv4 quantize`: a float dsv4 checkpoint (make_model's, or a trained one such as `dsv4 train-demo`'s) rewritten in
the released layout of its family, as `dsv4 make-model --quant` writes random weights: FP8 block-scaled dense
projections, MXFP4 (or the V4 Base's FP8) routed experts, V4.1's FP8 Engram tables, everything else in bf16 / fp32,
under the release's tensor names, with `quantization_config` in config.json (dsv4.quant.released).

The same quantization as make_model's released writer, tensor for tensor: a random float checkpoint and its
`--quant released` twin of the same preset and seed are byte-identical after conversion (tests/test_quantize_cli.py).
One float tensor is read, quantized and written at a time (`write_sharded`), so a converted checkpoint needs no more
memory than its largest tensor.

A drafter (`mtp.*`: V4.1's DSpark stages, V4's MTP layer) is kept, under its own names, in bf16 (fp32 where the float
layout keeps fp32): the release's drafter format is not modelled here (`released_layout` has no drafter), and dsv4
loads drafters at full precision anyway. Vision towers are refused, as by `make-model --quant`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterator

import torch
from safetensors import safe_open

from dsv4.models.config import parse_config_dict
from dsv4.models.presets import disk_dtype, tensor_shapes, text_config
from dsv4.quant.released import (QUANT_CHOICES, RELEASE_DTYPE, Layout, quantize_released, release_quant,
                                 released_config, released_layout, write_sharded)

# non-weight files carried over as they are (the tokenizer, generation defaults, chat template)
_CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
            "chat_template.jinja")


class _Reader:
    """Every tensor of a checkpoint directory's safetensors files, by name, read one at a time."""

    def __init__(self, model_dir: str) -> None:
        self.where: dict[str, str] = {}
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise ValueError(f"{model_dir}: no *.safetensors weight files")
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self.where[name] = path

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self.where[name], framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.where[name], framework="pt") as f:
            return f.get_tensor(name)


def quantize_checkpoint(model_dir: str, out_dir: str, quant: str = "released", max_shard_bytes: int = 4 << 30
                        ) -> list[str]:
    """Write `model_dir`'s float checkpoint in the released layout (`quant`: a make-model --quant choice other than
    "none") to `out_dir`; returns the weight files. Refuses, naming the problem, a checkpoint that is already
    quantized, has a vision tower, or lacks a tensor of its config's layout (or has one of another shape)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" in config or "quantization_config" in text_config(config):
        raise ValueError(f"{model_dir} is already quantized (config.json has a quantization_config)")
    if quant == "none" or quant not in QUANT_CHOICES:
        raise ValueError(f"quant {quant!r}: choose one of {[q for q in QUANT_CHOICES if q != 'none']}")
    cfg = parse_config_dict(config)
    qcfg = release_quant(quant, cfg)
    assert qcfg is not None
    src = _Reader(model_dir)
    expected = tensor_shapes(cfg)
    drafter = [n for n in src.where if n.startswith("mtp.")]
    unknown = [n for n in src.where if n not in expected and not n.startswith("mtp.")]
    if unknown:
        what = "a vision tower" if any("vision" in n for n in unknown) else "tensors outside its config's layout"
        raise ValueError(f"{model_dir} has {what} (e.g. {unknown[0]!r}): the released layout is written for the "
                         "text model and its drafter only")
    for name, (shape, _) in expected.items():
        if name not in src.where:
            raise ValueError(f"{model_dir}: tensor {name!r} of its config's layout is missing")
        if src.shape(name) != shape:
            raise ValueError(f"{model_dir}: tensor {name!r} has shape {list(src.shape(name))}, its config says "
                             f"{list(shape)}")
    layout: Layout = released_layout(cfg, qcfg)
    for name in drafter:
        layout[name] = (src.shape(name), disk_dtype(name, RELEASE_DTYPE))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in expected:
            yield from quantize_released(name, src.get(name), cfg, qcfg).items()
        for name in drafter:
            yield name, src.get(name).to(layout[name][1])

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(released_config(config, qcfg), f, indent=2, ensure_ascii=False)
        f.write("\n")
    for name in _CARRIED:
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copyfile(os.path.join(model_dir, name), os.path.join(out_dir, name))
    return write_sharded(layout, tensors(), out_dir, max_shard_bytes)
