"""Dense 16-bit linears whose one-row products (batch-1 decode) run as the Triton GEMV of dsv4/ops/gemv.py.

`GemvLinear` is an nn.Linear (same parameters, same state dict) whose forward hands a single row on CUDA to
`gemv_triton` and everything else (prefill, several rows, the CPU, torch.compile traces) to F.linear. The engine's
model swaps its LM head for it once loaded and merged (`use_gemv_linears`; DSV4_BF16_GEMV=head, the default), or
every plain bias-free linear (DSV4_BF16_GEMV=1, opt-in), or none (=0); quantized layers keep their own kernels, and
the vision tower's linears (biased, many rows) stay.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.ops.gemv import gemv_triton, use_gemv

# DSV4_BF16_GEMV: "0" none, "1" every plain linear, "head" (default) the LM head alone.
# The LM head is on by default: it runs eagerly after the decode graph and is a step's largest single product (1.06 GB
# at V4's 129280 x 4096). With `gemv_plan`'s wide tiles it took 335 us a call against cuBLAS's 363, and the batch-1
# step went 1.576 -> 1.545 ms on V4-Flash-4l and 3.279 -> 3.252 ms on V4.1-Flash-8l (H100, one `bench latency` run
# each, benchmarks/results/2026-12-07-h100-decode-b32-rows-lm-head). Every linear ("1") stays opt-in: at the 16 x 256
# tiles the mid-sized products lose to cuBLAS (e.g. 4096 x 4096: 18.5 against 16.1 us; the same results), and the
# batch-1 replay of V4.1-Flash-8l was 0.25 ms slower with them (2026-12-06-h100-decode-b1-lanes-expert-tiles).
GEMV_SCOPES = {"0": None, "1": "all", "head": "head"}
_scope = os.environ.get("DSV4_BF16_GEMV", "head")
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
