"""Manifold-constrained hyper-connections (mHC): N residual streams mixed around every sublayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.models.layers.norm import unweighted_rms_norm_fp32
from dsv4.ops.mhc import hc_dots_rows, hc_mixes_fused, hc_post, use_dots_rows, use_fused_mixes
from dsv4.ops.mhc_streams import collapse, collapse_rms_norm_triton
from dsv4.ops.mhc_streams import expand as expand_streams


class HyperConnection(nn.Module):
    """One mHC site (the attention or the FFN of a layer): computes (pre, post, comb) from the streams."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def mixes(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, N, D] -> pre [T, N], post [T, N], comb [T, N, N] (all fp32)."""
        return hc_mixes(h, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb) of one site from its input streams h [T, N, D], all in fp32 (model.md section 3): the
    streams' norm, the projection, `hc_post`; with the fused site switched on (dsv4.ops.mhc), two launches on CUDA,
    and for more rows the norm and projection in one (`hc_dots_rows`)."""
    if use_fused_mixes(h):
        return hc_mixes_fused(h, fn, base, scale, iters, hc_eps, norm_eps)
    return hc_post(normed_projection(h, fn, norm_eps), base, scale, h.shape[1], iters, hc_eps)


def normed_projection(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """unweighted_rms_norm(h.flatten(1)) @ fn^T in fp32 (h [T, N, D], fn [M, N*D] fp32): one tiled launch for bf16
    streams of more rows on CUDA (dsv4.ops.mhc.hc_dots_rows), else the fp32 norm and an fp32 GEMM."""
    if use_dots_rows(h, fn):
        return hc_dots_rows(h, fn, norm_eps)
    return F.linear(unweighted_rms_norm_fp32(h.flatten(1), norm_eps), fn.float())


def collapse_norm(h: torch.Tensor, pre: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(collapse(h, pre)): a sublayer's input from the streams, `norm` an RMSNorm of either family (its
    `fused_mode`); with the fused site switched on (dsv4.ops.mhc), one launch on CUDA."""
    if use_fused_mixes(h):
        return collapse_rms_norm_triton(h, pre, norm.weight, norm.eps, norm.fused_mode)
    return norm(collapse(h, pre))


def expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'_k = post_k * y + sum_j comb[j, k] * h_j, in the stream dtype (HF-V4 numerics; `collapse` is
    dsv4.ops.mhc_streams')."""
    return expand_streams(y, h, post, comb, fp32=False)


class HyperHead(nn.Module):
    """V4's learned final collapse of the streams (before the final norm)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        m = normed_projection(h, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(m * self.hc_scale.float() + self.hc_base.float())
        return collapse(h, pre + self.hc_eps)
