"""What the RMSNorm kernel tests share (tests/test_rmsnorm_kernel.py under the interpreter, tests/gpu/test_rmsnorm_gpu.py
on CUDA): the (reference, kernel) pairs of the three flavours, an ulp distance, the bounds of dsv4/ops/rmsnorm.py's
docstring, and grid inputs (multiples of 1/8: an fp32 sum of squares that is exact in any order)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dsv4.models.layers.norm import rms_norm_torch, unweighted_rms_norm_torch
from dsv4.ops.rmsnorm import rms_norm_triton, rms_norm_v41_triton, unweighted_rms_norm_triton

BOUND = {(torch.float32, "weighted"): 8, (torch.float32, "unweighted"): 8, (torch.float32, "v41"): 8,
         (torch.bfloat16, "weighted"): 1, (torch.bfloat16, "unweighted"): 2, (torch.bfloat16, "v41"): 2,
         (torch.bfloat16, "unweighted_fp32"): 8}  # bf16 in, fp32 out: fp32 ulps


def v41_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNormV41's torch path: normalised value cast to x's dtype, then times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def pairs(x: torch.Tensor, w: torch.Tensor, eps: float) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(flavour, torch reference, kernel) for every flavour on x with weight w."""
    yield "weighted", rms_norm_torch(x, w.float(), eps), rms_norm_triton(x, w.float(), eps)
    yield "unweighted", unweighted_rms_norm_torch(x, eps), unweighted_rms_norm_triton(x, eps)
    yield "v41", v41_ref(x, w.to(x.dtype), eps), rms_norm_v41_triton(x, w.to(x.dtype), eps)
    if x.dtype != torch.float32:  # an fp32 weight: the product (and output) is fp32
        yield "v41_w32", v41_ref(x, w, eps), rms_norm_v41_triton(x, w, eps)
        # mHC: the streams normalised in fp32 straight from bf16 (no upcast copy first)
        yield "unweighted_fp32", unweighted_rms_norm_torch(x.float(), eps), unweighted_rms_norm_triton(x, eps,
                                                                                                   torch.float32)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place (fp32 or bf16)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    it, sign = {torch.float32: (torch.int32, 31), torch.bfloat16: (torch.int16, 15)}[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> integers in the order of the values
        i = t.contiguous().view(it).long()
        return torch.where(i < 0, -(i & (2 ** sign - 1)), i)
    return (ordered(a) - ordered(b)).abs()


def check_close(name: str, dtype: torch.dtype, ref: torch.Tensor, got: torch.Tensor, rows: int) -> None:
    """Within the flavour's ulp bound; with >= 32 rows, most elements identical (only rows whose statistic came
    out different may differ)."""
    assert ref.dtype == got.dtype and ref.shape == got.shape, (name, ref.dtype, got.dtype)
    if name == "v41_w32":  # the normalised value went through bf16: a flip there is 2^-8..2^-7 relative
        assert torch.allclose(got, ref, rtol=2 ** -6, atol=0), name
    else:
        assert ulps(ref, got).max() <= BOUND[dtype, name], (name, dtype, int(ulps(ref, got).max()))
    if rows >= 32:
        assert (ref == got).float().mean() > 0.5, (name, dtype, (ref == got).float().mean())


def grid(shape: tuple[int, ...], g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2] times `scale`, on the generator's device."""
    return torch.randint(-16, 17, shape, generator=g, device=g.device).float() / 8 * scale
