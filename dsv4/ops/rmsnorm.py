"""Fused RMSNorm: one Triton launch per norm instead of the reference's ~7 elementwise/reduction kernels.

The torch references (the CPU path) are `rms_norm_torch` / `unweighted_rms_norm_torch` in
dsv4/models/layers/norm.py and the torch branch of `RMSNormV41.forward` in dsv4/models/deepseek_v41.py; one
kernel covers the three with a MODE constexpr (xf = x.float(), r = rsqrt(mean(xf^2) + eps) in fp32):
  MODE_WEIGHTED (HF-V4)   y = (w.float() * (xf * r)).to(x.dtype)
  MODE_UNWEIGHTED         y = x * r.to(x.dtype)                     (a product in x.dtype)
  MODE_V41                y = (xf * r).to(x.dtype) * w              (in promote(x.dtype, w.dtype))

Exactness. Every rounding step of the references is reproduced: the same casts at the same points, x^2 rounded
before it is summed and no other mul+add contracted into an FMA (the launch sets enable_fp_fusion=False), the
mean as torch's CUDA mean computes it (sum * fp32(1/D)), and rsqrt = libdevice's __nv_rsqrtf, the rsqrtf that
torch's CUDA rsqrt kernel calls. The one step that cannot be reproduced is the order of the fp32 sum of the D
squares (torch's reduction tree is its own), so: whenever that sum is order-independent (e.g. inputs on a coarse
grid, as the tests use) the output is bit-identical to the reference; in general a fraction of the rows get a
statistic a few fp32 ulps away, which shows in those rows as a difference of a few ulps for fp32 outputs (r's
perturbation, which the approximate rsqrt can enlarge, plus two roundings: up to 5 seen, 8 tested) and 1 ulp for
bf16 weighted outputs; the unweighted and V4.1 flavours round an intermediate (r, resp. the normalised value) to
bf16 and multiply again, and a 1-ulp change of one bf16 factor moves a bf16 product by up to 2 ulps, hence <= 2
there (an fp32 V4.1 output from bf16 x and an fp32 weight: 2^-8..2^-7 relative). Most elements are identical.

Under TRITON_INTERPRET=1 (the CPU tests) the reference runs on the CPU, whose mean is sum / D and rsqrt 1/sqrt;
the kernel follows those there, and rounds fp32 -> bf16 to nearest-even by hand because the interpreter's cast
truncates.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None

MODE_WEIGHTED, MODE_UNWEIGHTED, MODE_V41 = 0, 1, 2
_MAX_BLOCK = 8192  # widest chunk of a row held in registers; longer rows (mHC's 4 * hidden) loop over chunks
_ROW_ELEMS = 2048  # small D: pack rows into one program up to this many elements
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as triton does


if triton is not None:

    @triton.jit
    def bf16_dot(a, b, acc, UPCAST: tl.constexpr):
        """acc + a @ b of bf16 tiles with fp32 accumulation. The CPU interpreter multiplies bf16 tiles as their raw
        uint16 bits, so there (UPCAST) the tiles go through fp32 first: the same numbers, as bf16 x bf16 products
        are exact in fp32."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def cast_rne(y, dt: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 -> dt with round-to-nearest-even. The compiled cast is RNE already; the interpreter truncates
        fp32 -> bf16, so there the low 16 bits are rounded off by hand first (finite values only)."""
        if INTERPRET and dt == tl.bfloat16:
            b = y.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            y = b.to(tl.float32, bitcast=True)
        return y.to(dt)

    @triton.jit
    def rms_factor(ss, D, inv_d, eps, INTERPRET: tl.constexpr):
        """rsqrt(mean + eps) from the sum of squares `ss` of D values, as the references compute it: on the CPU
        (the interpreter's tests) mean = sum / D and rsqrt = 1 / sqrt; torch's CUDA mean is sum * fp32(1/D)
        (`inv_d`) and its rsqrt calls rsqrtf, i.e. libdevice's __nv_rsqrtf."""
        if INTERPRET:
            return tl.rsqrt(ss / D + eps)
        return libdevice.rsqrt(ss * inv_d + eps)

    @triton.jit
    def rms_apply(xf, r, w_ptr, cols, cmask, MODE: tl.constexpr, dt: tl.constexpr, odt: tl.constexpr,
                  INTERPRET: tl.constexpr):
        """The normalised values (fp32, before the output's rounding to odt) of x (as fp32 `xf`, stored as dt)
        with factor r, in the flavour MODE (the module doc's table); w_ptr + cols: the weight (not read by
        MODE_UNWEIGHTED)."""
        if MODE == 0:  # (w.float() * (xf * r)).to(x.dtype)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            return w * (xf * r)
        elif MODE == 1:  # x * r.to(x.dtype), x upcast to the output dtype first (the same when they agree)
            return xf * cast_rne(r, odt, INTERPRET).to(tl.float32)
        else:  # (xf * r).to(x.dtype) * w, rounded to promote(x.dtype, w.dtype)
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            return cast_rne(xf * r, dt, INTERPRET).to(tl.float32) * w

    @triton.jit
    def rms_row_factors(xrow, rmask, D, inv_d, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        INTERPRET: tl.constexpr):
        """rsqrt(mean(x^2) + eps) [ROWS, 1] of the rows at xrow ([ROWS, 1] pointers, D channels): the squares summed
        over [ROWS, BLOCK] tiles in column order, the order every launch that norms rows shares (`norm_tile`)."""
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c0 in range(0, D, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = rmask[:, None] & (cols < D)[None, :]
            xf = tl.load(xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += xf * xf  # the launch disables FMA fusion: x^2 is rounded before the add, as in torch
        return rms_factor(tl.sum(acc, axis=1), D, inv_d, eps, INTERPRET)[:, None]

    @triton.jit
    def rms_store_cols(xrow, orow, rmask, r, w_ptr, N, MODE: tl.constexpr, dt: tl.constexpr, odt: tl.constexpr,
                       BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        """Channels [0, N) of the rows at xrow normed with their factors r, rounded to odt, stored at orow."""
        for c0 in range(0, N, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            cmask = cols < N
            m = rmask[:, None] & cmask[None, :]
            xf = tl.load(xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            y = rms_apply(xf, r, w_ptr, cols[None, :], cmask[None, :], MODE, dt, odt, INTERPRET)
            tl.store(orow + cols[None, :], cast_rne(y, odt, INTERPRET), mask=m)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, x_stride, eps, inv_d, D: tl.constexpr, MODE: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        # torch.compile hands float arguments to user kernels as fp64: keep the math (and loop-carried values) fp32
        eps = tl.cast(eps, tl.float32)
        inv_d = tl.cast(inv_d, tl.float32)
        # one program = ROWS rows x D channels; a row is read twice (statistic, then output), chunk by chunk
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        xrow = x_ptr + rows.to(tl.int64)[:, None] * x_stride  # rows may be strided (views), channels are not
        orow = out_ptr + rows.to(tl.int64)[:, None] * D
        dt = x_ptr.dtype.element_ty
        odt = out_ptr.dtype.element_ty
        r = rms_row_factors(xrow, rmask, D, inv_d, eps, ROWS, BLOCK, INTERPRET)
        rms_store_cols(xrow, orow, rmask, r, w_ptr, D, MODE, dt, odt, BLOCK, INTERPRET)


def norm_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK columns, ROWS a program, warps) of the RMSNorm launch for rows of D: the tile fixes the order of the
    statistic's fp32 sum, so a kernel that fuses the norm with more (dsv4/ops/norm_rope.py) takes the same one."""
    block = min(triton.next_power_of_2(D), _MAX_BLOCK)
    rows_per_prog = max(1, _ROW_ELEMS // block)
    return block, rows_per_prog, min(16, max(1, rows_per_prog * block // 512))


def _rms_norm_launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """One launch over every row of x [..., D]; no host sync (safe under CUDA graph capture)."""
    assert triton is not None, "triton is not installed"
    D = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, D)  # a view when the leading dims collapse to one row stride, else a copy
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows = x2.shape[0]
    if n_rows == 0 or D == 0:
        return out
    w = x2 if weight is None else weight.contiguous()  # MODE_UNWEIGHTED never reads w
    block, rows_per_prog, num_warps = norm_tile(D)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows_per_prog),)](
        x2, w, out, n_rows, x2.stride(0), eps, 1.0 / D, D=D, MODE=mode, ROWS=rows_per_prog, BLOCK=block,
        INTERPRET=INTERPRET, num_warps=num_warps, enable_fp_fusion=False)
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` (HF-V4 weighted RMSNorm) in one launch."""
    return _rms_norm_launch(x, weight, eps, MODE_WEIGHTED, x.dtype)


def unweighted_rms_norm_triton(x: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`unweighted_rms_norm` in one launch; with `out_dtype` fp32, `unweighted_rms_norm(x.float(), eps)` without
    the upcast copy (mHC normalises the bf16 streams in fp32)."""
    return _rms_norm_launch(x, None, eps, MODE_UNWEIGHTED, out_dtype or x.dtype)


def rms_norm_v41_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNormV41.forward` in one launch."""
    return _rms_norm_launch(x, weight, eps, MODE_V41, torch.promote_types(x.dtype, weight.dtype))
