"""Interleaved-pair RoPE on the trailing channels of a vector (and its inverse): torch reference and Triton.

Channels 2i, 2i+1 of the trailing `2 * cos.shape[-1]` form one complex number rotated by angle i; the leading
(nope) channels pass through. cos/sin are rounded to x's dtype first and the rotation runs in fp32 (the
reference's numerics); `inverse` rotates by -angle (undoing the rope carried by V on the attention output).

The kernel is bit-identical to the reference: every product rounded on its own (`mul.rn`, which is never
contracted with the subtraction into one FMA rounding), results rounded to nearest-even. `rope_rotate` is that
arithmetic, shared with the kernels that fuse a norm before the rope (dsv4/ops/norm_rope.py); `rope_tile` applies it
to a tile a kernel holds (the decode attention's queries and outputs, dsv4/ops/decode_attention.py).

`apply_rope_` rotates in place, touching only the rope channels: a fresh projection's queries or an attention output
need no copy of their nope channels. At V4.1's head_dim 512 with rope 64 that is an eighth of the bytes: a 16K
prefill's query and output ropes moved 2 GB each, 0.67 ms a call on an H100.
"""

from __future__ import annotations

import os

import torch

ROPE_INPLACE = os.environ.get("DSV4_ROPE_INPLACE", "1") != "0"
# The in-place kernel's pairs loaded as one contiguous run a row (the default; DSV4_ROPE_VEC=0 is the strided form).
# The strided form took 99.5 us a call for 2,048 tokens x 64 heads on an H100 (2026-12-06-h100-mixed-step-host: 19
# calls a mixed step), ~10% of the bandwidth its 34 MB need: `benchmarks/rope_inplace_forms.py` compares the two
# (2026-12-06-h100-decode-b64-splits: 151 -> 8 us at 2,048 tokens x 64 heads).
ROPE_VEC = os.environ.get("DSV4_ROPE_VEC", "1") == "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None
else:
    from triton.language.extra import libdevice

    from dsv4.ops.rmsnorm import INTERPRET, cast_rne


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [T, ..., D]; cos/sin: [T, D_rope/2] fp32."""
    rd = 2 * cos.shape[-1]
    cos = cos.to(x.dtype).float()
    sin = sin.to(x.dtype).float()
    if inverse:
        sin = -sin
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope = x[..., -rd:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def apply_rope_torch_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope_torch` written into x's rope channels (its nope channels are what the copy would hold); x."""
    rd = 2 * cos.shape[-1]
    x[..., -rd:] = apply_rope_torch(x[..., -rd:], cos, sin, inverse)
    return x


if triton is not None:

    @triton.jit
    def _mul_rn(x, y, INTERPRET: tl.constexpr):
        """x * y rounded on its own: a `mul.rn` is never contracted into an FMA, whatever the launch's
        enable_fp_fusion (so kernels that keep contraction for their other math can fuse a rope)."""
        if INTERPRET:
            return x * y
        return libdevice.mul_rn(x, y)

    @triton.jit
    def rope_rotate(a, b, cos, sin, sign, dt: tl.constexpr, INTERPRET: tl.constexpr):
        """Pairs (a, b) (fp32 values of dt) rotated by the angles of cos / sin (fp32; sign -1: the inverse), as
        `apply_rope_torch`: cos / sin rounded to dt, the fp32 products rounded one by one (`_mul_rn`), the two
        results rounded to dt (returned in dt)."""
        c = cast_rne(cos, dt, INTERPRET).to(tl.float32)
        s = cast_rne(sin, dt, INTERPRET).to(tl.float32) * sign
        ac = _mul_rn(a, c, INTERPRET)
        bs = _mul_rn(b, s, INTERPRET)
        bc = _mul_rn(b, c, INTERPRET)
        as_ = _mul_rn(a, s, INTERPRET)
        return cast_rne(ac - bs, dt, INTERPRET), cast_rne(bc + as_, dt, INTERPRET)

    @triton.jit
    def rope_tile(x, cos_row, sin_row, sign, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                  dt: tl.constexpr, INTERPRET: tl.constexpr, col0):
        """Rows x [M, BLOCK_D] (values of dt: channels [col0, col0 + BLOCK_D) of rows of D, col0 even) with the
        pairs of the rows' trailing 2 * HALF channels rotated by the angles of one position (cos_row / sin_row:
        HALF fp32 values), as `apply_rope_torch` of each row; returned in dt, the other channels unchanged. For
        kernels that rope a tile they hold anyway (a query tile on load, an output row before its store): no
        launch of its own."""
        M: tl.constexpr = x.shape[0]
        a, b = tl.split(tl.reshape(x.to(tl.float32), [M, BLOCK_D // 2, 2]))
        i = col0 // 2 + tl.arange(0, BLOCK_D // 2) - (D // 2 - HALF)  # the pair's angle, for the rope pairs
        rm = (i >= 0) & (i < HALF)
        c = tl.load(cos_row + i, mask=rm, other=1.0)
        s = tl.load(sin_row + i, mask=rm, other=0.0)
        ra, rb = rope_rotate(a, b, c[None, :], s[None, :], sign, dt, INTERPRET)
        ra = tl.where(rm[None, :], ra, a.to(dt))
        rb = tl.where(rm[None, :], rb, b.to(dt))
        return tl.reshape(tl.join(ra, rb), [M, BLOCK_D])

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, sign, cos_stride, sin_stride, D: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
        sign = tl.cast(sign, tl.float32)  # torch.compile hands float arguments over as fp64
        row = tl.program_id(0)  # one (token, head) row of D channels
        t = row // heads
        base = x_ptr + row * D
        obase = out_ptr + row * D
        d = tl.arange(0, BLOCK_D)
        nope = D - 2 * HALF
        keep = d < nope
        tl.store(obase + d, tl.load(base + d, mask=keep), mask=keep)
        i = tl.arange(0, BLOCK_H)
        im = i < HALF
        c = tl.load(cos_ptr + t * cos_stride + i, mask=im)
        s = tl.load(sin_ptr + t * sin_stride + i, mask=im)
        a = tl.load(base + nope + 2 * i, mask=im).to(tl.float32)
        b = tl.load(base + nope + 2 * i + 1, mask=im).to(tl.float32)
        ra, rb = rope_rotate(a, b, c, s, sign, x_ptr.dtype.element_ty, INTERPRET)
        tl.store(obase + nope + 2 * i, ra, mask=im)
        tl.store(obase + nope + 2 * i + 1, rb, mask=im)

    @triton.jit
    def _rope_inplace_kernel(x_ptr, cos_ptr, sin_ptr, rows, heads, sign, cos_stride, sin_stride, D: tl.constexpr,
                             HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, VEC: tl.constexpr,
                             INTERPRET: tl.constexpr):
        """BLOCK_R (token, head) rows a program, their rope pairs only (one row's are 2 * HALF elements: a program a
        row would be a million tiny programs at 16K tokens x 64 heads). VEC: each row's pairs are loaded and stored
        as one contiguous run of 2 * HALF elements and split into (a, b) in registers, instead of two strided
        element loads; the same arithmetic, the same bits."""
        sign = tl.cast(sign, tl.float32)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        i = tl.arange(0, BLOCK_H)
        m = (r < rows)[:, None] & (i < HALF)[None, :]
        t = r // heads
        c = tl.load(cos_ptr + t[:, None] * cos_stride + i[None, :], mask=m)
        s = tl.load(sin_ptr + t[:, None] * sin_stride + i[None, :], mask=m)
        if VEC:
            j = tl.arange(0, 2 * BLOCK_H)
            mj = (r < rows)[:, None] & (j < 2 * HALF)[None, :]
            run = x_ptr + r[:, None] * D + (D - 2 * HALF) + j[None, :]
            a, b = tl.split(tl.reshape(tl.load(run, mask=mj).to(tl.float32), [BLOCK_R, BLOCK_H, 2]))
            ra, rb = rope_rotate(a, b, c, s, sign, x_ptr.dtype.element_ty, INTERPRET)
            tl.store(run, tl.reshape(tl.join(ra, rb), [BLOCK_R, 2 * BLOCK_H]), mask=mj)
        else:
            base = x_ptr + r[:, None] * D + (D - 2 * HALF) + 2 * i[None, :]
            a = tl.load(base, mask=m).to(tl.float32)
            b = tl.load(base + 1, mask=m).to(tl.float32)
            ra, rb = rope_rotate(a, b, c, s, sign, x_ptr.dtype.element_ty, INTERPRET)
            tl.store(base, ra, mask=m)
            tl.store(base + 1, rb, mask=m)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, half] rows as the kernels read them: fp32 with unit stride along half, rows possibly strided (the
    cos | sin halves of one gathered table row are read in place)."""
    return tuple(c if c.dtype == torch.float32 and c.stride(-1) == 1 else c.float().contiguous()
                 for c in (cos.reshape(-1, half), sin.reshape(-1, half)))


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The same as one launch over every (token, head) row."""
    assert triton is not None, "triton is not installed"
    x = x.contiguous()
    D, half = x.shape[-1], cos.shape[-1]
    rows = x.numel() // D
    out = torch.empty_like(x)
    if rows:
        cos, sin = rope_tables(cos, sin, half)
        _rope_kernel[(rows,)](x, cos, sin, out, rows // x.shape[0], -1.0 if inverse else 1.0, cos.stride(0),
                              sin.stride(0), D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D),
                              BLOCK_H=triton.next_power_of_2(half), INTERPRET=INTERPRET, enable_fp_fusion=False)
    return out


def apply_rope_triton_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                       vec: bool | None = None) -> torch.Tensor:
    """`apply_rope_triton` in place, rope channels only; x (a non-contiguous x: the copy, written back). `vec`
    (default ROPE_VEC): each row's pairs as one contiguous load and store."""
    assert triton is not None, "triton is not installed"
    if not x.is_contiguous():
        return x.copy_(apply_rope_triton(x, cos, sin, inverse))
    D, half = x.shape[-1], cos.shape[-1]
    rows = x.numel() // D
    if rows:
        cos, sin = rope_tables(cos, sin, half)
        block_r = 32
        _rope_inplace_kernel[(triton.cdiv(rows, block_r),)](
            x, cos, sin, rows, rows // x.shape[0], -1.0 if inverse else 1.0, cos.stride(0), sin.stride(0), D=D,
            HALF=half, BLOCK_H=triton.next_power_of_2(half), BLOCK_R=block_r,
            VEC=ROPE_VEC if vec is None else vec, INTERPRET=INTERPRET, enable_fp_fusion=False)
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        return apply_rope_triton(x, cos, sin, inverse)
    return apply_rope_torch(x, cos, sin, inverse)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """In place (x's rope channels; x is returned): Triton on CUDA, torch elsewhere. For tensors nothing else reads
    before the rope: a projection's fresh output, an attention output. Callers use the result: with
    DSV4_ROPE_INPLACE=0 (comparisons) it is `apply_rope`'s copy."""
    if not ROPE_INPLACE:
        return apply_rope(x, cos, sin, inverse)
    if x.is_cuda and triton is not None:
        return apply_rope_triton_(x, cos, sin, inverse)
    return apply_rope_torch_(x, cos, sin, inverse)
