"""Dense 16-bit linears whose one-row products (batch-1 decode) run as the Triton GEMV of dsv4/ops/gemv.py.

`GemvLinear` is an nn.Linear (same parameters, same state dict) whose forward hands a single row on CUDA to
`gemv_triton` and everything else (prefill, several rows, the CPU, torch.compile traces) to F.linear. The engine's
model swaps its plain bias-free linears for it once loaded and merged (`use_gemv_linears`), when
DSV4_BF16_GEMV=1 (its LM head alone: DSV4_BF16_GEMV=head); quantized layers keep their own kernels, and the vision
tower's linears (biased, many rows) stay.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.ops.gemv import gemv_triton, use_gemv

# Off by default: timed on an H100 with `gemv_plan`'s first tiles (16 x 256, 4 warps, 4 programs an SM), the
# batch-1 replay of V4.1-Flash-8l went from 3.163 to 3.411 ms (2026-12-06-h100-decode-b1-lanes-expert-tiles): slower
# than cuBLAS overall. Which shapes lose (and whether other tiles win) is what benchmarks/bf16_gemv_forms.py sweeps;
# its first run recorded no dense product (fixed since), so that is still to be measured.
# DSV4_BF16_GEMV: "0" none, "1" every plain linear, "head" the LM head alone. The LM head runs eagerly after the
# decode graph; its cuBLAS product took ~0.47 ms of a 1.64 ms V4-Flash-4l batch-1 step (synced "logits" phase
# 0.50 ms, H100, 2026-12-07) for 1.06 GB of weight, ~2.2 TB/s: the step's largest single product.
GEMV_SCOPES = {"0": None, "1": "all", "head": "head"}
_scope = os.environ.get("DSV4_BF16_GEMV", "0")
if _scope not in GEMV_SCOPES:
    raise ValueError(f"DSV4_BF16_GEMV={_scope!r}: expected one of {sorted(GEMV_SCOPES)}")
GEMV_SCOPE: str | None = GEMV_SCOPES[_scope]


class GemvLinear(nn.Linear):
    """nn.Linear with the one-row product as a Triton GEMV (bias-free only: `use_gemv_linears` swaps no others)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and use_gemv(x, self.weight):
            return gemv_triton(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def use_gemv_linears(model: nn.Module, scope: str = "all") -> int:
    """Swap the plain nn.Linear modules of `model` without a bias and with a 16-bit weight (scope "all"), or its
    `lm_head` alone (scope "head"), for GemvLinear modules holding the same Parameter (nothing is copied). Returns
    how many were swapped."""
    if scope not in ("all", "head"):
        raise ValueError(f"GEMV scope {scope!r}: expected 'all' or 'head'")
    swapped = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or mod.bias is not None or mod.weight.dtype not in (torch.bfloat16,
                                                                                          torch.float16):
            continue
        if scope == "head" and name != "lm_head":
            continue
        new = GemvLinear(mod.in_features, mod.out_features, bias=False, device="meta", dtype=mod.weight.dtype)
        new.weight = mod.weight
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        swapped += 1
    return swapped
