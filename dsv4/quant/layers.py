"""Layers that keep the checkpoint's FP8 / MXFP4 bytes and compute from them, and the swap that puts them in a model.

A model is built as usual (float `nn.Linear`s, float packed experts) on the meta device; `quantize_model` then
replaces the modules whose checkpoint weights are stored quantized: an `nn.Linear` by an `Fp8Linear`, a packed
`Experts` by a `QuantExperts`. Their state-dict entries are the stored tensors (`X.weight` in FP8 or packed FP4 and
`X.weight_scale`; experts `gate_up_proj` + `gate_up_proj_scale`, ...), so the loader fills them with the checkpoint's
bytes as they are. What is stored quantized is read off the checkpoint (or, with dummy weights, its layout), not
listed here: a tensor the model has no quantized layer for (a router weight, say) is dequantized at load instead.
The data are buffers, not parameters: the engine never trains, and buffers keep their dtype through `to_empty`
and the model-dtype pass of `dsv4.models.build`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dsv4.models.layers.moe import Experts
from dsv4.ops.fp8_linear import fp8_linear
from dsv4.quant.weight import QuantWeight, StoredFormat

logger = logging.getLogger(__name__)


def _scale_shape(lead: tuple[int, ...], n: int, k: int, block: tuple[int, int]) -> tuple[int, ...]:
    return (*lead, -(-n // block[0]), -(-k // block[1]))


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as FP8 e4m3 [out, in] and one scale per block (`dsv4.ops.fp8_linear`)."""

    def __init__(self, in_features: int, out_features: int, fmt: StoredFormat, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if fmt.fp4:
            raise ValueError("an Fp8Linear holds FP8 weights; MXFP4 is for routed experts")
        self.in_features, self.out_features, self.block = in_features, out_features, fmt.block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=fmt.data_dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(_scale_shape((), out_features, in_features, fmt.block),
                                                         dtype=fmt.scale_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @property
    def qweight(self) -> QuantWeight:
        return QuantWeight(self.weight, self.weight_scale, self.block)

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """groups > 1: the attention's grouped projection: x [..., G * in_features] and output group g (rows
        [g*out/G, (g+1)*out/G) of W) reads x's chunk g."""
        y = fp8_linear(x, self.qweight, groups)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class QuantExperts(nn.Module):
    """Routed experts as stored: gate_up_proj [E, 2I, D] (w1 rows, then w3 rows) and down_proj [E, D, I], each as
    MXFP4 (packed along the last dim, scales per 32) or FP8 with block scales (`dsv4.ops.moe_quant`)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float, fmt: StoredFormat,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.limit, self.block = limit, fmt.block
        div = 2 if fmt.fp4 else 1
        for name, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
            self.register_buffer(name, torch.empty(n_experts, n, k // div, dtype=fmt.data_dtype, device=device))
            self.register_buffer(f"{name}_scale", torch.empty(_scale_shape((n_experts,), n, k, fmt.block),
                                                              dtype=fmt.scale_dtype, device=device))

    @property
    def gate_up(self) -> QuantWeight:
        return QuantWeight(self.gate_up_proj, self.gate_up_proj_scale, self.block)

    @property
    def down(self) -> QuantWeight:
        return QuantWeight(self.down_proj, self.down_proj_scale, self.block)


def _cut_on_blocks(span: tuple[int, int, int] | None, block: tuple[int, int]) -> bool:
    """Whether a 2-D weight's shard [a, b) along dim d starts on a scale block (so the rank reads whole blocks)."""
    return span is None or span[1] % block[span[0]] == 0


def quantize_model(model: nn.Module, stored: dict[str, StoredFormat],
                   spans: dict[str, tuple[int, int, int]] | None = None) -> list[str]:
    """Swap in quantized layers for the modules whose weights `stored` names ({state-dict name of the float model's
    weight: its stored format}, e.g. from `loader.stored_formats`). Works on a meta-device model, before
    materialization (and after sharding: the layers take the sharded shapes; `spans` are the shards' cuts, and a
    weight whose cut falls inside a scale block stays float, dequantized at load: only small test models have
    such cuts). Returns the names left to dequantize at load (no quantized layer holds them)."""
    spans = spans or {}
    left = dict(stored)
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = next(module.parameters(), torch.empty(0, device="meta")).device
        if isinstance(module, nn.Linear) and f"{name}.weight" in stored:
            fmt = left.pop(f"{name}.weight")
            if fmt.fp4 or not _cut_on_blocks(spans.get(f"{name}.weight"), fmt.block):
                left[f"{name}.weight"] = fmt  # no MXFP4 dense layer, or a shard inside blocks: dequantized at load
                continue
            setattr(parent, leaf, Fp8Linear(module.in_features, module.out_features, fmt, module.bias is not None,
                                            device))
        elif isinstance(module, Experts) and f"{name}.gate_up_proj" in stored:
            fmt = left.pop(f"{name}.gate_up_proj")
            if left.pop(f"{name}.down_proj", None) != fmt:
                raise ValueError(f"{name}: gate_up_proj and down_proj are stored in different formats")
            E, two_i, D = module.gate_up_proj.shape
            setattr(parent, leaf, QuantExperts(E, D, two_i // 2, module.limit, fmt, device))
    if left:
        logger.info("dequantizing %d stored-quantized tensors at load (no quantized layer for them): %s", len(left),
                    ", ".join(sorted(left)[:8]) + (" ..." if len(left) > 8 else ""))
    return sorted(left)
