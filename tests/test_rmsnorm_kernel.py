"""The fused RMSNorm Triton kernel (dsv4/ops/rmsnorm.py) against the three torch references, under
TRITON_INTERPRET=1 (the CPU interpreter; each check runs in a subprocess because the flag is read when kernels
are defined).

Two kinds of input. "Grid" rows hold multiples of 1/8 in [-2, 2] (times a power of two): every square and every
partial sum of squares is exact in fp32, so the statistic does not depend on the summation order and the kernel
must equal the reference bit for bit - this checks every rounding step. Gaussian rows give a statistic whose last
bits depend on the order the kernel and torch sum in; there the bound of dsv4/ops/rmsnorm.py's docstring holds
(ulps of the output dtype: fp32 <= 8; bf16 <= 1 weighted, <= 2 unweighted / V4.1; a V4.1 fp32 output from bf16
x and an fp32 weight within 2^-6 relative, its normalised value having been rounded to bf16).
"""

from __future__ import annotations

import pytest
from test_kernels_interpret import _interpret


# shared by every check: the three (reference, kernel) pairs and an ulp distance
_PRELUDE = """
import torch
from dsv4.models.deepseek_v41 import RMSNormV41
from dsv4.models.layers.norm import rms_norm_torch, unweighted_rms_norm_torch
from dsv4.ops.rmsnorm import rms_norm_triton, rms_norm_v41_triton, unweighted_rms_norm_triton

def v41_ref(x, w, eps):
    m = RMSNormV41(w.shape[0], eps)
    m.weight.data = w
    return m(x)  # CPU tensor: the torch path of the forward

def pairs(x, w, eps):
    yield "weighted", rms_norm_torch(x, w.float(), eps), rms_norm_triton(x, w.float(), eps)
    yield "unweighted", unweighted_rms_norm_torch(x, eps), unweighted_rms_norm_triton(x, eps)
    yield "v41", v41_ref(x, w.to(x.dtype), eps), rms_norm_v41_triton(x, w.to(x.dtype), eps)
    if x.dtype != torch.float32:  # an fp32 weight: the product (and output) is fp32
        yield "v41_w32", v41_ref(x, w, eps), rms_norm_v41_triton(x, w, eps)

def ulps(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bits = {torch.float32: (torch.int32, 31), torch.bfloat16: (torch.int16, 15)}[a.dtype]
    def ordered(t):  # sign-magnitude bits -> integers in the order of the values
        i = t.contiguous().view(bits[0]).long()
        return torch.where(i < 0, -(i & (2 ** bits[1] - 1)), i)
    return (ordered(a) - ordered(b)).abs()

BOUND = {(torch.float32, "weighted"): 8, (torch.float32, "unweighted"): 8, (torch.float32, "v41"): 8,
         (torch.bfloat16, "weighted"): 1, (torch.bfloat16, "unweighted"): 2, (torch.bfloat16, "v41"): 2}

def check_close(name, dtype, ref, got, rows):
    assert ref.dtype == got.dtype and ref.shape == got.shape, (name, ref.dtype, got.dtype)
    if name == "v41_w32":  # the normalised value went through bf16: a flip there is 2^-8..2^-7 relative
        assert torch.allclose(got, ref, rtol=2 ** -6, atol=0), name
    else:
        assert ulps(ref, got).max() <= BOUND[dtype, name], (name, dtype, int(ulps(ref, got).max()))
    if rows >= 32:  # only the rows whose statistic came out different differ
        assert (ref == got).float().mean() > 0.5, (name, dtype, (ref == got).float().mean())

def grid(shape, g, scale=1.0):
    return torch.randint(-16, 17, shape, generator=g).float() / 8 * scale
"""


@pytest.mark.parametrize("shape", [(1, 64), (5, 128), (3, 1280), (2, 1536), (1, 7168), (2, 9000), (2, 3, 512)])
def test_bit_exact_on_grid_inputs(shape: tuple) -> None:
    _interpret(_PRELUDE + f"""
g = torch.Generator().manual_seed({sum(shape)})
D = {shape}[-1]
for dtype in (torch.float32, torch.bfloat16):
    for scale, eps in ((1.0, 1e-6), (2.0 ** -10, 1e-6), (1.0, 1e-20)):  # 2^-10: eps is a visible part of the mean
        x = grid({shape}, g, scale).to(dtype)
        w = torch.randn(D, generator=g)
        for name, ref, got in pairs(x, w, eps):
            assert ref.dtype == got.dtype and ref.shape == got.shape, (name, ref.dtype, got.dtype)
            assert torch.equal(ref, got), (name, dtype, scale, eps, int(ulps(ref, got).max()))
print("ok")
""")


def test_bit_exact_on_strided_rows() -> None:
    _interpret(_PRELUDE + """
g = torch.Generator().manual_seed(7)
for dtype in (torch.float32, torch.bfloat16):
    big = grid((4, 6, 200), g).to(dtype)
    w = torch.randn(128, generator=g)
    # rows of one stride (a view is passed), rows of two strides (copied first), one row inside a bigger one
    for x in (big[:, :, :128], big[:, 1:4, 8:136], big[:, :, :128].transpose(0, 1), big[2, 3, 64:192]):
        assert x.stride(-1) == 1
        for name, ref, got in pairs(x, w, 1e-6):
            assert got.shape == x.shape and torch.equal(ref, got), (name, dtype, x.shape, x.stride())
print("ok")
""")


@pytest.mark.parametrize("shape", [(1, 128), (33, 64), (33, 1280), (9, 1536), (4, 7168), (3, 9000)])
def test_within_bound_on_gaussian_inputs(shape: tuple) -> None:
    _interpret(_PRELUDE + f"""
g = torch.Generator().manual_seed({shape[0]})
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn({shape}, generator=g) * 3).to(dtype)
    w = torch.randn({shape}[-1], generator=g)
    for name, ref, got in pairs(x, w, 1e-6):
        check_close(name, dtype, ref, got, {shape[0]})
print("ok")
""")
