"""Stored expert weights (MXFP4 or block-FP8 `QuantWeight` [E, N, K]) dequantized to bf16 for a range of experts, one
launch: what the sorted prefill GEMM (dsv4/ops/moe_sorted.py) multiplies when the experts are quantized.

Why dequantize. A large prefill step gives every expert thousands of rows, so its routed experts are compute-bound:
decoding the 4-bit weights once into a bf16 slice (half a byte read and two written per weight, ~0.4 ms for a
V4.1-Flash-8l layer's 16 experts at HBM speed) and running the tensor-core GEMM on it costs far less than decoding
them again in every row block of the W4A16 kernel (dsv4/ops/moe_quant.py's grouped kernel, which redoes the decode for
each block of up to 256 rows). Decode steps keep reading the stored bytes.

Numbers: the same as `QuantWeight.dequantize(dtype)`, bit for bit: the code decoded exactly in fp32, times its
block's scale in fp32 (exact for UE8M0), rounded once to `dtype` (nearest even; by hand under TRITON_INTERPRET, whose
fp32 -> bf16 cast truncates). MXFP4 here; FP8 through `dsv4.ops.fp8_linear.dequantize_triton` on the experts
flattened to rows (when N is a multiple of the block's rows, so no scale block straddles two experts).
"""

from __future__ import annotations

import torch

from dsv4.ops.fp8_linear import dequantize_triton
from dsv4.quant.weight import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use QuantWeight.dequantize
    triton = None

BLOCK_R, BLOCK_B = 16, 128  # a program: 16 rows x 128 bytes (256 values, 8 scales a row)

if triton is not None:
    from dsv4.ops.moe_quant import _e4m3
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne

    @triton.jit
    def _e2m1(n):
        """e2m1 codes (int32 0..15: sign | 2 exponent bits | 1 mantissa bit) -> fp32 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
        their negatives (8 is -0), as the expert kernels decode them (moe_quant `_planes`): the nibble s|e e|m as
        the e4m3 byte s 0 0 e e m 0 0, the same value times 2^-6."""
        return _e4m3(((n & 8) << 4) | ((n & 7) << 2)) * 64.0

    @triton.jit
    def _dequant_mxfp4_kernel(w_ptr, s_ptr, out_ptr, R, KB, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                              INTERPRET: tl.constexpr):
        # rows R (experts x N, flattened), KB bytes a row (K / 2 values pairs), K / 32 = KB / 16 scales a row
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        rows = r.to(tl.int64)[:, None]
        mask = (r < R)[:, None] & (b < KB)[None, :]
        u = tl.load(w_ptr + rows * KB + b[None, :], mask=mask, other=0).to(tl.int32)
        e = tl.load(s_ptr + rows * (KB // 16) + (b // 16)[None, :], mask=mask, other=127).to(tl.int32)
        s = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23)).to(tl.float32, bitcast=True)
        v = tl.join(_e2m1(u & 0xF) * s, _e2m1(u >> 4) * s)  # [BLOCK_R, BLOCK_B, 2]: even, odd column
        v = tl.reshape(v, (BLOCK_R, 2 * BLOCK_B))
        c = tl.program_id(1) * 2 * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
        cmask = (r < R)[:, None] & (c < 2 * KB)[None, :]
        tl.store(out_ptr + rows * (2 * KB) + c[None, :], cast_rne(v, out_ptr.dtype.element_ty, INTERPRET), mask=cmask)


def dequantize_mxfp4_triton(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 weight [..., N, K] -> [..., N, K] in `dtype`, one launch."""
    assert triton is not None, "triton is not installed"
    data = w.data.contiguous()
    KB = data.shape[-1]
    R = data.numel() // KB
    out = torch.empty(w.shape, dtype=dtype, device=data.device)
    if R:
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(KB, BLOCK_B))
        _dequant_mxfp4_kernel[grid](data, w.scale.contiguous().view(torch.uint8), out, R, KB, BLOCK_R=BLOCK_R,
                                    BLOCK_B=BLOCK_B, INTERPRET=INTERPRET)
    return out


def dequantize_experts_triton(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Experts [C, N, K] in `dtype`, one launch: MXFP4, or FP8 whose scale blocks do not straddle two experts
    (N a multiple of the block's rows; else the torch reference)."""
    if w.fp4:
        return dequantize_mxfp4_triton(w, dtype)
    C, N, K = w.shape
    bn, _ = w.block
    if N % bn:
        return w.dequantize(dtype)
    rows = QuantWeight(w.data.reshape(C * N, K), w.scale.reshape(C * N // bn, w.scale.shape[-1]), w.block)
    return dequantize_triton(rows, dtype).view(C, N, K)


def dequantize_experts(w: QuantWeight, first: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts first .. end - 1 of `w` [E, N, K] as a [end - first, N, K] tensor in `dtype`: the kernels on CUDA,
    `QuantWeight.dequantize` elsewhere."""
    part = w[first:end]
    if part.data.is_cuda and triton is not None:
        return dequantize_experts_triton(part, dtype)
    return part.dequantize(dtype)
