"""x @ W^T in fp32 from a weight stored in a narrower dtype: the math of `F.linear(x.float(), W.float())` without
the fp32 copy of W that expression makes on every call.

DeepSeek-V4.1 computes its router logits and its ratio-2 compressor's kv / gate rows in fp32 from bf16 weights
(model.md 12). Written as above, a decode step converts each weight to fp32 (a kernel writing twice the weight's
bytes), then runs cuBLAS's fp32 GEMV over the copy (two more kernels at one row: a dot and a reduce), and converts x:
four launches and ~5x the weight's bytes, per layer. At decode sizes (up to DECODE_ROWS rows) the Triton path reads
the stored weight once, widening each element in registers: every product is the reference's exact fp32 product,
only the order of the fp32 sums differs (as between any two GEMM implementations). Larger inputs (prefill) with
bf16 / fp16 operands go to one cuBLAS GEMM on the tensor cores with fp32 output (`torch.mm(..., out_dtype=fp32)`):
a product of two bf16 (or fp16) values is exact in fp32 and the tensor cores accumulate in fp32, so it is the same
math again, where the fp32 expression ran on the CUDA cores at a fraction of the speed (a 16K-token V4.1-Flash-8l
prefill 412.6 -> 408.8 ms on an H100, benchmarks/results/2026-12-05-h100-fp32-linear-prefill). fp32 inputs (an fp32
model) keep the torch expression.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

DECODE_ROWS = 64  # up to this many rows the Triton path; it re-reads the weight per row (from L2 after the first)
# The Triton path's tiles (`decode_blocks`). "wide" (default): few outputs and most of K a program, so that a
# one-row call spreads over the SMs and each program has K in 2-3 wide loads. "narrow": the first tiles (8-16
# outputs x 256 of K a program, 20 steps over K = 5120), kept for comparison: a one-row call of V4.1-Flash-8l took
# 30.6 us on average on an H100 (10 a decode step: 0.31 of a 3.9 ms graph replay,
# benchmarks/results/2026-12-06-h100-decode-select-radix/decode131k-radix-s64.log) for weights of 0.16-5.2 MB,
# 2-64 programs each walking 20 dependent load steps (latency-bound: the weight's bytes need ~2 us).
BLOCKS = os.environ.get("DSV4_FP32_LINEAR_BLOCKS", "wide")
if BLOCKS not in ("wide", "narrow"):
    raise ValueError(f"DSV4_FP32_LINEAR_BLOCKS={BLOCKS!r}: expected 'wide' or 'narrow'")
PROGRAMS_PER_CALL = 512  # ~4 a streaming multiprocessor: enough loads in flight to stream the weight
TILE_ELEMENTS = 8192  # a program's BLOCK_N x BLOCK_K weight tile: 64 fp32 partial sums a thread at 4 warps
HALF_DTYPES = (torch.bfloat16, torch.float16)  # operands whose products fp32 holds exactly
# the tensor-core path needs torch's `mm.dtype` overload (torch >= 2.8); DSV4_FP32_LINEAR_MM=0 keeps the fp32
# expression at prefill sizes (comparisons)
MM_PREFILL = os.environ.get("DSV4_FP32_LINEAR_MM", "1") == "1" and "dtype" in torch.ops.aten.mm.overloads()
# The fewest rows that take that GEMM instead of the Triton kernel (16-bit operands). The kernel re-reads the whole
# weight for every row (from L2), so its time grows with the rows: 37-49 us at 64 rows of V4.1's [384 / 512, 5120]
# weights on an H100 against a ~1.2-1.6 us byte floor (2026-12-06-h100-fp32-linear-tiles; two such calls a batch-64
# decode step of V4.1-Flash-8l took 50 + 61 us, 2026-12-06-h100-decode-b64-splits). The GEMM reads it once for all
# rows. Default 8: 8+ rows take the GEMM (the batch-64 decode replay 7.19 -> 7.14 ms on an H100,
# 2026-12-06-h100-decode-optins); DSV4_FP32_LINEAR_MM_ROWS=65 keeps the kernel up to 64 rows
# (`benchmarks/fp32_linear_blocks.py` has its column).
MM_FROM_ROWS = int(os.environ.get("DSV4_FP32_LINEAR_MM_ROWS", "8"))


def fp32_linear_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: x [..., K] (any float dtype), w [N, K] -> [..., N] fp32."""
    return F.linear(x.float(), w.float())


if triton is not None:

    @triton.jit
    def _fp32_linear_kernel(x_ptr, w_ptr, out_ptr, N, K, x_stride, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # lane-wise partial sums, reduced once at the end
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(x_ptr + r * x_stride + k, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        tl.store(out_ptr + r * N + n, tl.sum(acc, axis=1), mask=nm)


def fp32_linear_triton(x: torch.Tensor, w: torch.Tensor, blocks: str = BLOCKS) -> torch.Tensor:
    """The same in one launch: a program per (row, block of outputs), the weight read in its stored dtype; `blocks`
    picks the tiles (`decode_blocks`)."""
    assert triton is not None, "triton is not installed"
    N, K = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    R = x2.shape[0]
    out = torch.empty(R, N, dtype=torch.float32, device=x.device)
    if R and N:
        block_n, block_k = decode_blocks(R, N, K, blocks)
        _fp32_linear_kernel[(R, triton.cdiv(N, block_n))](x2, w, out, N, K, x2.stride(0), BLOCK_N=block_n,
                                                          BLOCK_K=block_k, num_warps=4)
    return out.view(*lead, N)


def decode_blocks(R: int, N: int, K: int, blocks: str = "wide") -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the Triton path for R rows of N outputs over K. "wide": BLOCK_N the power of two that
    gives each row ~PROGRAMS_PER_CALL / R programs (1-16 outputs a program), BLOCK_K the rest of a TILE_ELEMENTS
    tile (up to 4,096, K's power of two if smaller): one row of a [512, 5120] weight is 512 programs of 2 steps
    over K. "narrow": the tiles before 2026-12-06."""
    k_pow2 = max(16, 1 << (K - 1).bit_length())  # K's power of two
    if blocks == "narrow":
        return (8 if N <= 1024 else 16), min(256, k_pow2)
    per_row = max(1, PROGRAMS_PER_CALL // R)
    want = -(-N // per_row)  # outputs a program for ~per_row programs a row
    block_n = min(16, 1 << max(0, (want - 1).bit_length()))
    return block_n, min(k_pow2, 4096, TILE_ELEMENTS // block_n)


def fp32_linear_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same for 16-bit x and w of one dtype on CUDA: one tensor-core GEMM writing fp32 (exact products, fp32
    sums)."""
    assert x.dtype == w.dtype and x.dtype in HALF_DTYPES and x.is_cuda, (x.dtype, w.dtype, x.device)
    K = w.shape[1]
    return torch.mm(x.reshape(-1, K), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])


def path(rows: int, on_cuda: bool, half_pair: bool) -> str:
    """Which implementation `fp32_linear` takes for `rows` rows: "mm" (the fp32-output tensor-core GEMM: CUDA,
    16-bit operands of one dtype (`half_pair`), from MM_FROM_ROWS rows), else "triton" (CUDA, up to DECODE_ROWS
    rows), else "mm" again where it may, else "torch"."""
    mm = MM_PREFILL and on_cuda and half_pair
    if mm and rows >= MM_FROM_ROWS:
        return "mm"
    if on_cuda and triton is not None and rows <= DECODE_ROWS:
        return "triton"
    return "mm" if mm else "torch"


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """On CUDA: Triton at decode sizes (up to DECODE_ROWS rows), the fp32-output tensor-core GEMM beyond for 16-bit
    operands (from MM_FROM_ROWS rows, where set lower); torch elsewhere (`path`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    which = path(rows, x.is_cuda, x.dtype == w.dtype and x.dtype in HALF_DTYPES)
    if which == "triton":
        return fp32_linear_triton(x, w)
    return fp32_linear_mm(x, w) if which == "mm" else fp32_linear_torch(x, w)
