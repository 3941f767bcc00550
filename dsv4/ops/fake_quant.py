"""Block fake-quantisation used inside the DeepSeek-V4.1 model (model.md sections 5 and 12).

V4.1 was trained with quantisation-aware fake quant, so the quantise-dequantise round trips are part of the model's
math, not an optional storage format: the window KV goes through FP8 (e4m3, power-of-two scale per 32 channels), the
compressed KV through FP4 (e2m1, e4m3 scale per 16 channels) and the indexer q/k through FP4 (e2m1, power-of-two
scale per 32 channels). They must be reproduced bit-exactly, so every step follows the reference: fp32 math,
power-of-two scales taken from the fp32 exponent bits of `amax * fp32(1/max)` (a multiply by the rounded reciprocal,
not a division), round-to-nearest-even casts, and one cast back to the input dtype at the end.
Each function returns its input unchanged when the last dim is not a multiple of the block (as the reference does).
`fake_quant_triton` is the same arithmetic in one Triton launch (integer-bit scales, RNE by magic-number addition,
division with round-to-nearest), bit-exact under the interpreter. The public functions (`fp8_fake_quant`, ...)
take it on CUDA: the torch path is ~30 elementwise kernels per call, and a V4.1 decode step makes 2-4 calls per
layer, each kernel 1-2 us of a graph replay. (Its first GPU runs gave +0 where e4m3 keeps -0, from negative values
rounding to zero and then from -0 inputs; the sign bit is now copied, and the tests compare bits, sign of zero
included. An early A/B, before the other decode kernels, measured no
difference at V4.1 batch 1: 7.38 vs 7.28 ms, when host work still dominated the step.)
"""

from __future__ import annotations

import torch

_FP8_MAX = 448.0
_FP4_MAX = 6.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 view of x as [..., last_dim // block, block]."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v for positive normal fp32 v, from the exponent bits (exponent - 127, +1 when the
    mantissa is non-zero): clearing the mantissa gives 2^floor(log2 v), doubled unless v already is a power of two.
    Bit arithmetic, unlike log2/ceil/exp2, is exact on every device."""
    bits = v.view(torch.int32)
    floor = (bits & 0x7F800000).view(torch.float32)
    return torch.where((bits & 0x007FFFFF) != 0, floor * 2.0, floor)


def _amax(xb: torch.Tensor) -> torch.Tensor:
    return xb.abs().amax(dim=-1, keepdim=True)


def fp8_fake_quant_torch(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 fake quant with a power-of-two (ue8m0) scale per `block` channels of the last dim (window KV)."""
    if x.shape[-1] % block != 0:
        return x
    xb = _blocks(x, block)
    amax = _amax(xb).clamp(min=1e-4)
    # A Python float operand is applied in the tensor's dtype, i.e. as fp32(1/448): the reference's multiply by the
    # rounded reciprocal. (For 448 and 6 this lands on the same power of two as a division; we follow it anyway.)
    scale = _pow2_ceil(amax * (1.0 / _FP8_MAX))
    q = (xb / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape).to(x.dtype)


def _e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] onto the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest, ties to the even
    mantissa: 0.25, 1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 go up), sign kept, -0 -> +0.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; torch.round is round-half-to-even, so rounding
    |q| / spacing (exact: the spacings are powers of two) is exactly e2m1's round-to-nearest-even. No lookup tables,
    so nothing is copied to the device (CUDA-graph safe)."""
    a = q.abs()
    g = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                    torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    return torch.where((q < 0) & (g > 0), -g, g)


def _fp4_apply(xb: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    q = _e2m1_round((xb / scale).clamp(-_FP4_MAX, _FP4_MAX))
    return (q * scale).reshape(shape).to(dtype)


def fp4_fake_quant_ue8m0_torch(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 fake quant with a power-of-two scale per `block` channels (indexer queries and keys)."""
    if x.shape[-1] % block != 0:
        return x
    xb = _blocks(x, block)
    # The floor 6*2^-126 keeps the scale a normal fp32 power of two (>= 2^-126).
    amax = _amax(xb).clamp(min=_FP4_MAX * 2.0**-126)
    scale = _pow2_ceil(amax * (1.0 / _FP4_MAX))
    return _fp4_apply(xb, scale, x.shape, x.dtype)


def fp4_fake_quant_e4m3_torch(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 fake quant with an e4m3 scale per `block` channels (compressed KV entries)."""
    if x.shape[-1] % block != 0:
        return x
    xb = _blocks(x, block)
    # Floor 6*2^-9: the scale is then >= 2^-9, the smallest e4m3 subnormal, never 0. The reference divides here.
    # The clamp to 448 makes the cast saturate on every device: torch's CPU cast saturates but its CUDA cast turns
    # anything rounding above 448 into NaN (amax > ~2784; not expected in the model).
    scale = (_amax(xb).clamp(min=_FP4_MAX * 2.0**-9) / _FP4_MAX).clamp(max=_FP8_MAX)
    scale = scale.to(torch.float8_e4m3fn).float()
    return _fp4_apply(xb, scale, x.shape, x.dtype)


# ---- Triton: one launch per call instead of ~30 elementwise kernels ------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch functions above
    triton = None

FP8_UE8M0, FP4_UE8M0, FP4_E4M3 = 0, 1, 2

if triton is not None:

    @triton.jit
    def _rne(v):
        # round-to-nearest-even to an integer for |v| < 2^22: the fp32 add rounds, the subtract is exact
        return (v + 12582912.0) - 12582912.0

    @triton.jit
    def _pow2_ceil_tl(v):
        bits = v.to(tl.int32, bitcast=True)
        floor = (bits & 0x7F800000).to(tl.float32, bitcast=True)
        return tl.where((bits & 0x007FFFFF) != 0, floor * 2.0, floor)

    @triton.jit
    def _e4m3_round(v):
        # e4m3 RNE of |v| <= 448: 3 mantissa bits in the normal range (>= 2^-6), a 2^-9 grid below it
        a = tl.abs(v)
        quantum = ((a.to(tl.int32, bitcast=True) & 0x7F800000) - (3 << 23)).to(tl.float32, bitcast=True)
        quantum = tl.where(a < 0.015625, 0.001953125, quantum)
        r = _rne(a / quantum) * quantum
        # e4m3 keeps the sign of zero, -0 input included: copy v's sign bit (`v < 0` is false for -0, and on the GPU
        # `-r` of +0 compiles to 0 - r = +0); the arithmetic shift makes the int32 mask 0x80000000 or 0
        sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_round_tl(v):
        a = tl.abs(v)
        g = tl.where(a < 2.0, _rne(a * 2.0) * 0.5, tl.where(a < 4.0, _rne(a), _rne(a * 0.5) * 2.0))
        return tl.where((v < 0) & (g > 0), -g, g)

    @triton.jit
    def _fake_quant_kernel(x_ptr, out_ptr, n_blocks, MODE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
        b = tl.program_id(0) * NB + tl.arange(0, NB)
        bm = b < n_blocks
        offs = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + offs, mask=bm[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)[:, None]
        if MODE == 0:
            scale = _pow2_ceil_tl(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
            q = _e4m3_round(tl.minimum(tl.maximum(x / scale, -448.0), 448.0))
        else:
            if MODE == 1:
                scale = _pow2_ceil_tl(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
            else:
                s = tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 0.001953125), tl.full(amax.shape, 6.0, tl.float32)), 448.0)
                scale = _e4m3_round(s)
            q = _e2m1_round_tl(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -6.0), 6.0))
        tl.store(out_ptr + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=bm[:, None])


def fake_quant_triton(x: torch.Tensor, mode: int, block: int) -> torch.Tensor:
    """FP8_UE8M0 / FP4_UE8M0 / FP4_E4M3 fake quant (the functions above) in one Triton launch."""
    assert triton is not None, "triton is not installed"
    if x.shape[-1] % block != 0:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel() // block
    if n:
        nb = 64
        _fake_quant_kernel[(triton.cdiv(n, nb),)](x, out, n, MODE=mode, BLOCK=block, NB=nb)
    return out


# ---- dispatch: Triton on CUDA, torch elsewhere -----------------------------------------------------------------
def _dispatch(x: torch.Tensor, mode: int, block: int) -> torch.Tensor | None:
    return fake_quant_triton(x, mode, block) if x.is_cuda and triton is not None else None


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 fake quant, power-of-two scale per `block` channels (window KV)."""
    out = _dispatch(x, FP8_UE8M0, block)
    return out if out is not None else fp8_fake_quant_torch(x, block)


def fp4_fake_quant_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 fake quant, power-of-two scale per `block` channels (indexer queries and keys)."""
    out = _dispatch(x, FP4_UE8M0, block)
    return out if out is not None else fp4_fake_quant_ue8m0_torch(x, block)


def fp4_fake_quant_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 fake quant, e4m3 scale per `block` channels (compressed KV entries)."""
    out = _dispatch(x, FP4_E4M3, block)
    return out if out is not None else fp4_fake_quant_e4m3_torch(x, block)
