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

import os

import pytest
from test_kernels_interpret import _interpret


# every check runs in a subprocess (TRITON_INTERPRET is read when kernels are defined) with tests/rmsnorm_checks.py
_PRELUDE = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch
from rmsnorm_checks import check_close, grid, pairs, ulps
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
