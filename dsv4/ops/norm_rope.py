"""RMSNorm then RoPE in one launch: the per-head query norm and the KV latent's norm of an attention layer, each
followed by the rope of its trailing channels, two kernels (three with the window write of a decode step) in one.

The result is bit-identical to the kernels it replaces, the RMSNorm kernel of dsv4/ops/rmsnorm.py then the rope
kernel of dsv4/ops/rope.py: the statistic over the same [ROWS, BLOCK] tile with the same warps (so the same order of
the fp32 sum) through the same jit helpers (`rms_row_factors`, `rms_store_cols`, `rms_apply`), the normed value
rounded to the norm's output dtype, then `rope_rotate` on the rounded values; FMA contraction off, as in both launches. Its torch reference is
the composition of the two torch references, so on the CPU nothing changes.
"""

from __future__ import annotations

import torch

from dsv4.models.layers.norm import rms_norm_torch, rms_norm_v41_torch, unweighted_rms_norm_torch
from dsv4.ops.rmsnorm import MODE_UNWEIGHTED, MODE_V41, MODE_WEIGHTED, norm_tile
from dsv4.ops.rope import apply_rope_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def _norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int) -> torch.Tensor:
    """The torch reference of the RMSNorm flavour `mode` (dsv4.ops.rmsnorm's modes)."""
    if mode == MODE_UNWEIGHTED:
        return unweighted_rms_norm_torch(x, eps)
    assert weight is not None
    return (rms_norm_torch if mode == MODE_WEIGHTED else rms_norm_v41_torch)(x, weight, eps)


def _norm_dtype(x: torch.Tensor, weight: torch.Tensor | None, mode: int) -> torch.dtype:
    """The dtype the norm outputs (and the rope rounds to)."""
    return torch.promote_types(x.dtype, weight.dtype) if mode == MODE_V41 else x.dtype


def rms_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """Reference: rope(norm(x)) for x [T, ..., D] (norm over D in flavour `mode`; weight None when unweighted),
    cos / sin [T, rope_dim / 2] fp32."""
    return apply_rope_torch(_norm_torch(x, weight, eps, mode), cos, sin)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne, rms_apply, rms_row_factors, rms_store_cols
    from dsv4.ops.rope import rope_rotate

    @triton.jit
    def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, n_rows, heads, x_stride,
                              cos_stride, sin_stride, eps, inv_d, D: tl.constexpr, HALF: tl.constexpr,
                              MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                              SLOTS: tl.constexpr, INTERPRET: tl.constexpr):
        eps = tl.cast(eps, tl.float32)  # torch.compile hands float arguments over as fp64
        inv_d = tl.cast(inv_d, tl.float32)
        # one program = ROWS rows x D channels, as _rms_norm_kernel; row = (token, head), its token's cos / sin
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        xrow = x_ptr + rows.to(tl.int64)[:, None] * x_stride
        if SLOTS:  # the row goes to its cache slot (a decode step's window write)
            dst = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dst = rows.to(tl.int64)
        orow = out_ptr + dst[:, None] * D
        dt = x_ptr.dtype.element_ty
        odt = out_ptr.dtype.element_ty  # the norm's output dtype (a cache written in place has that dtype)
        # the statistic as _rms_norm_kernel computes it (the same tile and loop: the same order of the sum)
        r = rms_row_factors(xrow, rmask, D, inv_d, eps, ROWS, BLOCK, INTERPRET)
        nope = D - 2 * HALF
        rms_store_cols(xrow, orow, rmask, r, w_ptr, nope, MODE, dt, odt, BLOCK, INTERPRET)  # channels without rope
        # rope channels as pairs (nope + 2i, nope + 2i + 1): normed and rounded to odt, then rotated
        i = tl.arange(0, BLOCK_H)
        im = i < HALF
        m = rmask[:, None] & im[None, :]
        ca = (nope + 2 * i)[None, :]
        t = (rows // heads).to(tl.int64)[:, None]
        c = tl.load(cos_ptr + t * cos_stride + i[None, :], mask=m, other=1.0)
        s = tl.load(sin_ptr + t * sin_stride + i[None, :], mask=m, other=0.0)
        xa = tl.load(xrow + ca, mask=m, other=0.0).to(tl.float32)
        xb = tl.load(xrow + ca + 1, mask=m, other=0.0).to(tl.float32)
        a = cast_rne(rms_apply(xa, r, w_ptr, ca, im[None, :], MODE, dt, odt, INTERPRET), odt, INTERPRET)
        b = cast_rne(rms_apply(xb, r, w_ptr, ca + 1, im[None, :], MODE, dt, odt, INTERPRET), odt, INTERPRET)
        ra, rb = rope_rotate(a.to(tl.float32), b.to(tl.float32), c, s, 1.0, odt, INTERPRET)
        tl.store(orow + ca, ra, mask=m)
        tl.store(orow + ca + 1, rb, mask=m)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
            sin: torch.Tensor, out: torch.Tensor, slots: torch.Tensor | None) -> None:
    """One launch over every (token, head) row of x [T, ..., D] into `out` (its rows, or with `slots` [T] the rows
    slots[t] of a cache [S, D]); no host sync (safe under CUDA graph capture)."""
    assert triton is not None, "triton is not installed"
    D, half = x.shape[-1], cos.shape[-1]
    assert 2 * half <= D
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, D)  # a view when the leading dims collapse to one row stride, else a copy
    n_rows = x2.shape[0]
    if n_rows == 0:
        return
    # cos/sin [T, half] rows may be strided (the cos | sin halves of one gathered table row): read in place
    cos, sin = (c if c.dtype == torch.float32 and c.stride(-1) == 1 else c.float().contiguous()
                for c in (cos.reshape(-1, half), sin.reshape(-1, half)))
    w = x2 if weight is None else weight.contiguous()  # MODE_UNWEIGHTED never reads w
    block, rows_per_prog, num_warps = norm_tile(D)  # the RMSNorm launch's: the statistic's sum in the same order
    _rms_norm_rope_kernel[(triton.cdiv(n_rows, rows_per_prog),)](
        x2, w, cos, sin, x2 if slots is None else slots, out, n_rows, n_rows // x.shape[0], x2.stride(0),
        cos.stride(0), sin.stride(0), eps, 1.0 / D, D=D, HALF=half, MODE=mode, ROWS=rows_per_prog, BLOCK=block,
        BLOCK_H=max(triton.next_power_of_2(half), 1), SLOTS=slots is not None, INTERPRET=INTERPRET,
        num_warps=num_warps, enable_fp_fusion=False)


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
    """`rms_norm_rope_torch` in one launch (instead of the norm and rope kernels)."""
    out = torch.empty(x.shape, dtype=_norm_dtype(x, weight, mode), device=x.device)
    _launch(x, weight, eps, mode, cos, sin, out, None)
    return out


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        return rms_norm_rope_triton(x, weight, eps, mode, cos, sin)
    return rms_norm_rope_torch(x, weight, eps, mode, cos, sin)


def write_rms_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int,
                              cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: cache[slots] = rope(norm(x)) for rows x [T, D], slots [T] (a decode step's window write)."""
    cache[slots] = rms_norm_rope_torch(x, weight, eps, mode, cos, sin).to(cache.dtype)


def write_rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int,
                               cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The same in one launch (instead of the norm, rope and scatter kernels) when the cache holds the norm's dtype
    (no cast in between) and is contiguous; else the fused norm and rope, then the scatter."""
    assert x.dim() == 2 and cache.dim() == 2 and cache.shape[1] == x.shape[1], (x.shape, cache.shape)
    if cache.dtype == _norm_dtype(x, weight, mode) and cache.is_contiguous():
        _launch(x, weight, eps, mode, cos, sin, cache, slots.contiguous())
    else:
        cache[slots] = rms_norm_rope_triton(x, weight, eps, mode, cos, sin).to(cache.dtype)


def write_rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, cos: torch.Tensor,
                        sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None:
        write_rms_norm_rope_triton(x, weight, eps, mode, cos, sin, cache, slots)
    else:
        write_rms_norm_rope_torch(x, weight, eps, mode, cos, sin, cache, slots)
