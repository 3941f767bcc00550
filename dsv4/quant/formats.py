"""The released checkpoints' low-precision formats: encode, decode, and the byte layouts the kernels read.

* FP8 block-scaled (dense linears; FP8 experts of the Base checkpoints): e4m3 weight [..., N, K] and one scale per
  (bn x bk) block, [..., ceil(N/bn), ceil(K/bk)]; a partial last block along either dim shares its block's scale.
  Scales are UE8M0 (one byte, the exponent of a power of two: 2^(byte - 127)) or float32.
* MXFP4 (routed experts): e2m1 values packed two per byte along K, low nibble = even column, [..., N, K/2], and one
  UE8M0 scale per 32 values along K, [..., N, K/32]. It is the block-scaled layout with blocks of 1 x 32.

In memory a UE8M0 scale is kept as its raw uint8 byte (what the kernels load; torch's float8_e8m0fnu is a view of
the same byte), an FP4 weight as uint8, an FP8 weight as float8_e4m3fn. Decoding is exact in fp32: an e4m3 or e2m1
value times a power of two is representable, so dequantize-then-matmul in fp32 is the reference every kernel is
checked against, and the path `quantization="none"` runs.

The encoders are the project's own (make-model writes released-layout checkpoints with them): scale = the smallest
power of two >= amax / max_code (so nothing saturates), round to nearest even. A float scale is amax / 448.
"""

from __future__ import annotations

import math

import torch

from dsv4.ops.fake_quant import _e2m1_round, _pow2_ceil

FP8_MAX = 448.0
FP4_MAX = 6.0
MX_BLOCK = 32  # MXFP4: values per scale along K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127

Shape = tuple[int, ...]


# ---- decode -----------------------------------------------------------------------------------------------------
def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> fp32 2^(e-127), built from bits (exact everywhere): e=0 is the subnormal 2^-127, 255 NaN."""
    bits = e.to(torch.int32) << 23
    bits = torch.where(e == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(e == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block scale tensor -> fp32 multipliers: raw uint8 / float8_e8m0fnu bytes are UE8M0 exponents, float scales
    are used as they are."""
    if scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return e8m0_to_float(scale.view(torch.uint8))
    return scale.float()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 (two values per byte, low nibble = even column) -> float32, last dim doubled."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    pairs = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def is_packed_fp4(weight: torch.Tensor) -> bool:
    """Whether a stored weight is packed FP4 (one byte holds two values) rather than FP8 or float."""
    return weight.dtype in (torch.int8, torch.uint8)


def block_size_for(shape: Shape, scale_shape: Shape, hint: tuple[int, int] | None = None) -> tuple[int, int]:
    """Block (rows, cols) of a block-scaled weight of logical `shape` [..., R, C] with scales [..., ceil(R/br),
    ceil(C/bc)]: the config's block (`hint`) if it fits both dims, else 128x128 if it does, else the smallest
    block per dim that gives the scale count (exact whenever the dim is a multiple of its block). Raises
    ValueError when nothing fits."""
    if len(scale_shape) != len(shape) or len(shape) < 2 or tuple(scale_shape[:-2]) != tuple(shape[:-2]):
        raise ValueError(f"scale shape {list(scale_shape)} does not fit weight shape {list(shape)}")
    (rows, cols), (srows, scols) = shape[-2:], scale_shape[-2:]

    def fits(br: int, bc: int) -> bool:
        return br > 0 and bc > 0 and math.ceil(rows / br) == srows and math.ceil(cols / bc) == scols

    # Try whole pairs first: a hint that happens to fit one dim says nothing when the other dim disagrees.
    for block in (hint, (128, 128)):
        if block and fits(*block):
            return block
    derived = (math.ceil(rows / srows) if srows else 0, math.ceil(cols / scols) if scols else 0)
    if fits(*derived):
        return derived
    raise ValueError(f"no block size maps weight shape {list(shape)} onto scale shape {list(scale_shape)}")


def expand_scale(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """fp32 per-element multipliers [..., rows, cols] of a block scale [..., ceil(rows/br), ceil(cols/bc)]."""
    s = scale_to_float(scale)
    br, bc = block
    return s.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Block-scaled FP8 (float8 weight) or packed FP4 (int8/uint8 weight) -> float32:
    `w[..., i, j] * scale[..., i // br, j // bc]`. `block_size` is derived from the shapes when not given."""
    w = unpack_fp4(weight) if is_packed_fp4(weight) else weight.float()
    block = block_size or block_size_for(tuple(w.shape), tuple(scale.shape))
    return w * expand_scale(scale, block, *w.shape[-2:])


# ---- encode -----------------------------------------------------------------------------------------------------
def _pow2_scale(amax: torch.Tensor, code_max: float) -> torch.Tensor:
    """The smallest power of two >= amax / code_max (fp32), at least 2^-126 (all-zero blocks get that)."""
    return _pow2_ceil((amax * (1.0 / code_max)).clamp(min=2.0 ** -126))


def _float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Normal fp32 powers of two -> their UE8M0 byte (the biased exponent field)."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block max |w| of [..., R, C] -> [..., ceil(R/br), ceil(C/bc)] (partial blocks padded with zeros)."""
    br, bc = block
    R, C = w.shape[-2:]
    pr, pc = -R % br, -C % bc
    padded = torch.nn.functional.pad(w.abs().float(), (0, pc, 0, pr))
    blocks = padded.reshape(*w.shape[:-2], (R + pr) // br, br, (C + pc) // bc, bc)
    return blocks.amax(dim=(-3, -1))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 weight [..., N, K], scale [..., ceil(N/bn), ceil(K/bk)]): UE8M0 bytes (uint8) when
    `ue8m0`, else fp32 amax / 448."""
    amax = _block_amax(w, block)
    scale = _pow2_scale(amax, FP8_MAX) if ue8m0 else (amax / FP8_MAX).clamp(min=2.0 ** -126)
    q = (w.float() / expand_scale(scale, block, *w.shape[-2:])).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (_float_to_e8m0(scale) if ue8m0 else scale)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (packed e2m1 uint8 [..., N, K/2], UE8M0 scale uint8 [..., N, K/32])."""
    K = w.shape[-1]
    if K % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {MX_BLOCK}, got {K}")
    wb = w.float().reshape(*w.shape[:-1], K // MX_BLOCK, MX_BLOCK)
    scale = _pow2_scale(wb.abs().amax(dim=-1, keepdim=True), FP4_MAX)
    q = _e2m1_round((wb / scale).clamp(-FP4_MAX, FP4_MAX)).reshape(w.shape)
    # value -> nibble: magnitude index in the e2m1 grid, sign in bit 3
    grid = torch.tensor(E2M1_VALUES[:8], device=w.device)
    mag = torch.bucketize(q.abs(), grid)  # exact grid values: the index of the equal entry
    nib = (mag | (q < 0).to(torch.int64) << 3).to(torch.uint8)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous(), _float_to_e8m0(scale[..., 0]).contiguous()
