"""RMSNorm in the two flavours DeepSeek-V4 uses: the torch references (the CPU path), and on CUDA the fused
Triton kernel of dsv4/ops/rmsnorm.py (one launch instead of ~7 small kernels, the same rounding steps)."""

from __future__ import annotations

import torch
from torch import nn

from dsv4.ops.rmsnorm import MODE_WEIGHTED, rms_norm_triton, triton, unweighted_rms_norm_triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm: fp32 statistic and fp32 weight product, cast once at the end (HF-V4 numerics)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_v41_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4.1 RMSNorm: the normalised value is cast to x's dtype first, then scaled by the weight (model dtype)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def unweighted_rms_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight; the factor is cast to x's dtype before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        return unweighted_rms_norm_triton(x, eps)
    return unweighted_rms_norm_torch(x, eps)


def unweighted_rms_norm_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """unweighted_rms_norm(x.float(), eps); on CUDA one launch that reads x as it is (no fp32 copy first)."""
    if x.is_cuda and triton is not None:
        return unweighted_rms_norm_triton(x, eps, torch.float32)
    return unweighted_rms_norm_torch(x.float(), eps)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32 whatever the model dtype."""

    fused_mode = MODE_WEIGHTED  # its flavour in fused kernels (dsv4.ops.rmsnorm's modes)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
