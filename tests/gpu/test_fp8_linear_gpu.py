"""FP8 block-scaled linear kernels (dsv4/ops/fp8_linear.py) on the GPU: the released V4-Flash (blocks 128) and
V4.1-Flash (blocks 32) dense shapes at decode and prefill batch sizes, partial blocks and special values, CUDA-graph
capture, run-to-run determinism.

Bounds (S = sum_k |x_k| |w_k| per output, K the per-group contraction length), as in tests/test_fp8_linear.py
except for the accumulation term (and, as there, + 2^-8 S where float scales meet a bf16 x: the kernels that
multiply the reference's bf16-rounded weight). bf16 MMAs do not accumulate as IEEE fp32: each 16-product step is
aligned to the largest exponent and truncated, about one fp32 ulp of the running sum per step (K/16 of them), and the
kernel adds each K-tile's sum into the fp32 accumulator (K/BLOCK_K more roundings); the fp32 reference (cuBLAS, no TF32)
sums in
its own order. So W8A16: |got - ref32| <= 2^-8 |ref32| + max(K + 8, K/8 + 2) 2^-23 S (the first term: the bf16
output's rounding; the max keeps the CPU test's fp32 term for small K). FP8 MMAs accumulate with ~14 significant
bits within a K-tile, adding <= 2^-12 S to the W8A8 bound (2^-4 S: the activations' e4m3 rounding).
These bounds have not run on a GPU yet.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.fp8_linear import (DECODE_ROWS, fp8_gemv_triton, fp8_linear, fp8_linear_torch, fp8_linear_triton,
                                 fp8_linear_w8a8_triton)
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight

# name: (N, K, groups, block); wo_a reads x [M, 8 * 4096] (8 head groups of 8 x 512)
SHAPES = {
    "v4.wq_a": (1024, 4096, 1, (128, 128)), "v4.wq_b": (32768, 1024, 1, (128, 128)),
    "v4.wkv": (512, 4096, 1, (128, 128)), "v4.wo_a": (8192, 4096, 8, (128, 128)),
    "v4.wo_b": (4096, 8192, 1, (128, 128)), "v4.shared_up": (2048, 4096, 1, (128, 128)),
    "v4.shared_down": (4096, 2048, 1, (128, 128)),
    "v41.wq_a": (1280, 5120, 1, (32, 32)), "v41.wq_b": (32768, 1280, 1, (32, 32)),
    "v41.wkv": (512, 5120, 1, (32, 32)), "v41.wo_a": (8192, 4096, 8, (32, 32)),
    "v41.wo_b": (5120, 8192, 1, (32, 32)), "v41.shared_up": (2304, 5120, 1, (32, 32)),
    "v41.shared_down": (5120, 2304, 1, (32, 32)),
}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    """The fp32 reference must be fp32 (torch's default; asserted rather than set, so no global state changes)."""
    assert not torch.backends.cuda.matmul.allow_tf32


def _weight(N: int, K: int, block: tuple[int, int], ue8m0: bool, g: torch.Generator) -> QuantWeight:
    return QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, block, ue8m0), block)


def _special_weight(N: int, K: int, block: tuple[int, int], ue8m0: bool, g: torch.Generator) -> QuantWeight:
    """Every finite e4m3 code (zeros, subnormals, +-448) under scales 2^-27 (e = 100) .. 2^13 (e = 140)."""
    codes = torch.randint(0, 254, (N, K), device="cuda", generator=g)
    codes = (codes + (codes >= 127)).to(torch.uint8)
    shape = (-(-N // block[0]), -(-K // block[1]))
    e = torch.randint(100, 141, shape, device="cuda", generator=g)
    scale = e.to(torch.uint8) if ue8m0 else 2.0 ** (e - 127).float() * (1 + torch.rand(shape, device="cuda",
                                                                                        generator=g))
    return QuantWeight(codes.view(torch.float8_e4m3fn), scale, block)


def _abs(w: QuantWeight) -> QuantWeight:
    return QuantWeight((w.data.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn), w.scale, w.block)


def _check(x: torch.Tensor, w: QuantWeight, groups: int, got: torch.Tensor, w8a8: bool = False) -> None:
    K = w.data.shape[1]
    ref = fp8_linear_torch(x.float(), w, groups)
    S = fp8_linear_torch(x.float().abs(), _abs(w), groups)
    assert got.dtype == x.dtype and got.shape == ref.shape
    acc = max(K + 8, K / 8 + 2) * 2.0 ** -23 * S
    rnd = 0.0 if x.dtype == torch.float32 else 2.0 ** -8
    if rnd and w.scale.dtype != torch.uint8 and not w8a8:  # the weight rounded to x's dtype, as the 16-bit
        acc = acc + rnd * S  # reference has it (the gemv; W8A16 with 32-wide blocks): half an ulp of each w * s
    err = (got.float() - ref).abs()
    if w8a8:
        A = x.float().abs().amax(-1, keepdim=True)
        W1 = w.dequantize().abs().sum(-1)
        bound = (1 + rnd) * ((2.0 ** -4 + 2.0 ** -12) * S + 2.0 ** -10 / 448 * A * W1 + acc) + rnd * ref.abs()
        assert (got.float() - ref).norm() <= 2.0 ** -4 * ref.norm()
    else:
        bound = acc + rnd * ref.abs()
    assert (err <= bound).all(), (err / bound).max().item()


@pytest.mark.parametrize("M", [1, 8, 32, 64, 512])
@pytest.mark.parametrize("name", list(SHAPES))
def test_released_shapes(name: str, M: int) -> None:
    N, K, groups, block = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    w = _weight(N, K, block, True, g)
    x = torch.randn(M, groups * K, device="cuda", generator=g).to(torch.bfloat16)
    got = fp8_linear_triton(x, w, groups)
    _check(x, w, groups, got)
    if M == 1:  # the dispatcher: the one-row gemv, the W8A16 kernel for decode rows, dequantize + cuBLAS above
        one = fp8_gemv_triton(x, w, groups)
        _check(x, w, groups, one)
        _check(x.float(), w, groups, fp8_gemv_triton(x.float(), w, groups))
        assert torch.equal(fp8_linear(x, w, groups), one)
    elif M <= DECODE_ROWS:
        assert torch.equal(fp8_linear(x, w, groups), got)
    else:
        assert torch.equal(fp8_linear(x, w, groups), fp8_linear_torch(x, w, groups))  # the same numbers, same call
    ref16 = fp8_linear_torch(x, w, groups).float()  # the bf16 model path: within two roundings in norm
    assert (got.float() - ref16).norm() <= 2.0 ** -7 * ref16.norm()
    if M >= 64:
        _check(x, w, groups, fp8_linear_w8a8_triton(x, w, groups), w8a8=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,block,groups", [(96, 160, (128, 128), 1), (40, 72, (32, 32), 1),
                                              (64, 96, (32, 32), 2), (80, 40, (32, 32), 4)])
def test_partial_blocks_and_special_values(dtype: torch.dtype, N: int, K: int, block: tuple[int, int],
                                           groups: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(N * K)
    for ue8m0 in (True, False):
        for w in (_weight(N, K, block, ue8m0, g), _special_weight(N, K, block, ue8m0, g)):
            for M in (1, 3, 17, 70, 300):
                x = torch.randn(M, groups * K, device="cuda", generator=g).to(dtype)
                _check(x, w, groups, fp8_linear_triton(x, w, groups))
                _check(x, w, groups, fp8_linear_w8a8_triton(x, w, groups), w8a8=True)
                if M == 1 and (groups == 1 or (N // groups) % block[0] == 0):
                    _check(x, w, groups, fp8_gemv_triton(x, w, groups))


@pytest.mark.parametrize("name,M", [("v4.wkv", 1), ("v4.wkv", 64), ("v41.wo_b", 8), ("v4.wo_a", 32),
                                    ("v41.wq_b", 512)])
def test_cuda_graph_and_determinism(name: str, M: int) -> None:
    """Captured then replayed on new inputs: bit-equal to eager; eager twice: bit-equal (the split-K partials are
    summed in a fixed order, no atomics)."""
    N, K, groups, block = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(M)
    w = _weight(N, K, block, True, g)
    static_x = torch.randn(M, groups * K, device="cuda", generator=g).to(torch.bfloat16)
    for fn in (fp8_linear_triton, fp8_linear_w8a8_triton, *((fp8_gemv_triton,) if M == 1 else ())):
        fn(static_x, w, groups)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(static_x, w, groups)
        for _ in range(3):
            static_x.copy_(torch.randn(M, groups * K, device="cuda", generator=g))
            graph.replay()
            eager = fn(static_x, w, groups)
            assert torch.equal(static_out, eager)
            assert torch.equal(fn(static_x, w, groups), eager)
