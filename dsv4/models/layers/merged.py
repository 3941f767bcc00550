"""Sibling projections of one input merged into one (vLLM's merged column-parallel linear).

At batch-1 decode every linear is one GEMV launch whose time is mostly fixed cost (H200, V4-Flash released, per
layer: shared-expert gate 6.4 us + up 6.3 us, attention q_a 5.0 us + kv 4.4 us, each 1-2 us of it reading weights),
so two projections of the same x cost nearly twice one of both widths. After the checkpoint is loaded,
`merge_siblings` concatenates such siblings' weights along N into one module (`MergedLinear`) and drops the
originals (the weights are not held twice); the parent's forward asks `project` for the siblings' outputs, which
are then views of one [.., N1 + N2] product. Prefill runs the same merged product (same math).

What merges (`SIBLINGS`, by checkpoint names; both models, float and released): the shared expert's gate and up
projections, the attention's q_a and kv projections, and (V4) the compressor's bf16 projections with its indexer's
(the indexer keys' kv / gate and the head weights: five GEMVs of one input). Each group merges only when it is legal
(`merge_blocker`), else stays as loaded and `project` calls the modules one by one.

Numerics: each output column of a linear is one dot product over K, whatever the other columns; the torch paths
(CPU, and the FP8 layers' reference, which dequantizes elementwise per block) give the separate modules' bits
(tests/test_merged.py). GPU kernels pick tiles and split-K by the output width, so there the merged outputs may
differ from the separate ones by fp32 accumulation order (tests/gpu/test_merged_gpu.py bounds it).

Only the engine's model merges (`build_model(merge=MERGE_SIBLINGS)`); models built for training or weight export
keep the checkpoint's module names, and the speculative drafters (loaded apart) run their siblings separately.
`DSV4_MERGE_SIBLINGS=0` turns merging off (read at import; tests flip `MERGE_SIBLINGS`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

MERGE_SIBLINGS = os.environ.get("DSV4_MERGE_SIBLINGS", "1") == "1"


@dataclass(frozen=True)
class Siblings:
    """Linear projections `names` (in output order; submodule paths under the owner) that a module named `owner`
    (the last part of its path) applies to one input; its forward reads them through `project(module, x, *names)`.
    Several groups of one owner are alternatives: the first whose modules all exist is the one merged (or kept)."""

    owner: str
    names: tuple[str, ...]

    @property
    def merged(self) -> str:
        """The merged module's attribute name on the owner."""
        return merged_name(self.names)


# V4 Compressor (bf16 in the released checkpoints): its kv / gate projections and, in a CSA layer, its indexer's
# kv / gate projections and head weights, five products of the attention's input (five cuBLAS GEMVs, ~30 us of a
# batch-1 CSA layer on the H200); the plain pair in an HCA layer.
V4_COMPRESSOR_CSA = ("kv_proj", "gate_proj", "indexer.kv_proj", "indexer.gate_proj", "indexer.scorer.weights_proj")
V4_COMPRESSOR_HCA = ("kv_proj", "gate_proj")

SIBLINGS = (
    Siblings("shared_experts", ("gate_proj", "up_proj")),  # V4 SharedExpert
    Siblings("shared_experts", ("w1", "w3")),  # V4.1 MoEV41.shared_experts
    Siblings("self_attn", ("q_a_proj", "kv_proj")),  # V4 Attention
    Siblings("attn", ("wq_a", "wkv")),  # V4.1 AttentionV41
    Siblings("compressor", V4_COMPRESSOR_CSA),  # before the pair: an owner's groups are alternatives, first wins
    Siblings("compressor", V4_COMPRESSOR_HCA),
)


def merged_name(names: tuple[str, ...]) -> str:
    return "_".join(names).replace(".", "_")


def _submodule(parent: nn.Module, path: str) -> nn.Module | None:
    """parent's submodule at the dotted `path`, or None when any step is missing or not a module."""
    m: object = parent
    for part in path.split("."):
        m = getattr(m, part, None)
        if not isinstance(m, nn.Module):
            return None
    return m


def _drop(parent: nn.Module, path: str) -> None:
    """Delete parent's submodule at the dotted `path` (from the module that holds it)."""
    owner, _, leaf = path.rpartition(".")
    delattr(parent.get_submodule(owner) if owner else parent, leaf)


class MergedLinear(nn.Module):
    """Sibling linears as one: `proj` (an nn.Linear or Fp8Linear) holds their weight rows concatenated in order;
    forward returns each sibling's output, views of the one product [..., sum(sizes)] (rows strided by the
    total width: the consumers' kernels read rows through a stride, and a single row is contiguous)."""

    def __init__(self, proj: nn.Module, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.proj, self.sizes = proj, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(x).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


def project(parent: nn.Module, x: torch.Tensor, *names: str) -> tuple[torch.Tensor, ...]:
    """The outputs of `parent`'s sibling projections `names` of x: one product when `merge_siblings` merged them,
    else one per module."""
    merged = getattr(parent, merged_name(names), None)
    if isinstance(merged, MergedLinear):
        return merged(x)
    return tuple(parent.get_submodule(n)(x) for n in names)


def merge_blocker(mods: list[nn.Module]) -> str | None:
    """Why the linears `mods` (in output order) cannot be one module, or None when they can: all exactly nn.Linear
    or all exactly Fp8Linear (a subclass may compute otherwise), one input width, weight dtype and device, biases on
    all or none; FP8 also one scale block and scale dtype, and every sibling but the last ending on a scale block
    (its scale rows then stack under one grid; the last one's partial block stays the merged weight's last)."""
    from dsv4.quant.layers import Fp8Linear  # here: dsv4.quant.layers imports the MoE layers, which import this

    kinds = {type(m) for m in mods}
    if len(kinds) != 1 or kinds.pop() not in (nn.Linear, Fp8Linear):
        return "not all nn.Linear or all Fp8Linear: " + ", ".join(sorted({type(m).__name__ for m in mods}))
    first = mods[0]
    if any(m.in_features != first.in_features for m in mods):
        return "input widths differ"
    if any((m.weight.dtype, m.weight.device) != (first.weight.dtype, first.weight.device) for m in mods):
        return "weight dtypes or devices differ"
    if len({m.bias is None for m in mods}) != 1 or (
            first.bias is not None and any(m.bias.dtype != first.bias.dtype for m in mods)):
        return "biases differ"
    if isinstance(first, Fp8Linear):
        if any((m.block, m.weight_scale.dtype) != (first.block, first.weight_scale.dtype) for m in mods):
            return "scale blocks or scale dtypes differ"
        bn = first.block[0]
        if any(m.out_features % bn for m in mods[:-1]):
            return f"an output width is not a multiple of the scale block rows {bn}"
    return None


def merge_linears(mods: list[nn.Module]) -> MergedLinear:
    """One MergedLinear of the linears `mods` (legal per `merge_blocker`), weights (scales, biases) concatenated
    along N on their device."""
    from dsv4.quant.layers import Fp8Linear
    from dsv4.quant.weight import StoredFormat

    first = mods[0]
    K, N, bias = first.in_features, sum(m.out_features for m in mods), first.bias is not None
    with torch.no_grad():
        if isinstance(first, Fp8Linear):
            fmt = StoredFormat(fp4=False, block=first.block, scale_dtype=first.weight_scale.dtype)
            proj = Fp8Linear(K, N, fmt, bias, device="meta")
            proj.weight = torch.cat([m.weight for m in mods])  # buffers: keep their FP8 / scale dtypes
            proj.weight_scale = torch.cat([m.weight_scale for m in mods])
        else:
            proj = nn.Linear(K, N, bias, device="meta")
            proj.weight = nn.Parameter(torch.cat([m.weight for m in mods]), requires_grad=first.weight.requires_grad)
        if bias:
            proj.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=first.bias.requires_grad)
    return MergedLinear(proj, tuple(m.out_features for m in mods))


@dataclass(frozen=True)
class MergeSummary:
    """What `merge_siblings` did: {merged name: groups merged}, {(merged name, reason): groups kept separate}."""

    merged: dict[str, int]
    kept: dict[tuple[str, str], int]


def merge_siblings(model: nn.Module, siblings: tuple[Siblings, ...] = SIBLINGS) -> MergeSummary:
    """Merge every legal group of `siblings` in the loaded `model` (in place; after sharding and quantized-layer
    swapping, which both act on the modules by their checkpoint names). Each group's originals are dropped as it
    merges, so at most one group's weights are held twice at a time."""
    merged: Counter[str] = Counter()
    kept: Counter[tuple[str, str]] = Counter()
    for path, module in list(model.named_modules()):
        owner = path.rpartition(".")[2]
        for s in siblings:
            mods = [_submodule(module, n) for n in s.names] if owner == s.owner else [None]
            if any(m is None for m in mods):
                continue
            why = merge_blocker(mods)
            if why is not None:
                kept[(s.merged, why)] += 1
            else:
                setattr(module, s.merged, merge_linears(mods))
                for n in s.names:
                    _drop(module, n)
                merged[s.merged] += 1
            del mods
            break  # the owner's other groups are alternatives to this one (its forward projects this group)
    summary = MergeSummary(dict(merged), dict(kept))
    if merged or kept:
        logger.info("sibling projections merged: %s%s", ", ".join(f"{n} x{c}" for n, c in merged.items()) or "none",
                    "".join(f"; {n} kept separate x{c} ({why})" for (n, why), c in kept.items()))
    return summary
