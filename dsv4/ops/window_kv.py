"""DeepSeek-V4.1's window KV of a decode step, one launch on CUDA (model.md section 5): the latent wkv(x) through the
V4.1 RMSNorm, rope on its trailing channels, FP8 fake quant (e4m3, power-of-two scale per 32 channels), written to
the window cache at the rows' slots. Unfused that is four launches per layer (norm, rope, fake quant, scatter).

The kernel holds a row as its even and odd channels ([blocks of 32 channels, 16 pairs] each), so a rope pair is one
element of each and an FP8 block one row of both: no shuffles in registers. Numerics follow the torch references op
by op (the statistic as dsv4/ops/rmsnorm.py, the rotation without FMA, the fake quant as dsv4/ops/fake_quant.py);
the statistic's sum may add in another order, so a normed value can be an ulp off, and an FP8 code then flip.
"""

from __future__ import annotations

import torch

from dsv4.models.layers.norm import rms_norm_v41_torch
from dsv4.ops.fake_quant import fp8_fake_quant_torch
from dsv4.ops.rope import apply_rope_torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None

_FP8_BLOCK = 32


def write_window_kv_torch(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference: cache[slots] = fp8(rope(norm(latent))) for latent [R, D], cos / sin [R, rope_dim / 2]."""
    kv = fp8_fake_quant_torch(apply_rope_torch(rms_norm_v41_torch(latent, weight, eps), cos, sin), _FP8_BLOCK)
    cache[slots] = kv.to(cache.dtype)


if triton is not None:
    from dsv4.ops.fake_quant import _e4m3_round, _pow2_ceil_tl
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne

    @triton.jit
    def _window_kv_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, x_stride, cos_stride, sin_stride, eps,
                          inv_d, D: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, INTERPRET: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)  # torch.compile hands float arguments over as fp64
        inv_d = tl.cast(inv_d, tl.float32)
        dt = x_ptr.dtype.element_ty
        # pair j = 16 b + p holds channels 2j (even) and 2j + 1 (odd); block b = FP8 block of channels 32b..32b+31
        j = tl.arange(0, NB)[:, None] * 16 + tl.arange(0, 16)[None, :]
        xrow = x_ptr + r * x_stride
        xe = tl.load(xrow + 2 * j).to(tl.float32)
        xo = tl.load(xrow + 2 * j + 1).to(tl.float32)
        ss = tl.sum(tl.sum(xe * xe + xo * xo, axis=1), axis=0)
        if INTERPRET:
            rs = tl.rsqrt(ss / D + eps)
        else:
            rs = libdevice.rsqrt(ss * inv_d + eps)
        we = tl.load(w_ptr + 2 * j).to(tl.float32)
        wo = tl.load(w_ptr + 2 * j + 1).to(tl.float32)
        ye = cast_rne(cast_rne(xe * rs, dt, INTERPRET).to(tl.float32) * we, dt, INTERPRET).to(tl.float32)
        yo = cast_rne(cast_rne(xo * rs, dt, INTERPRET).to(tl.float32) * wo, dt, INTERPRET).to(tl.float32)
        # rope on the last HALF pairs: cos / sin rounded to the stream dtype, products rounded, no FMA
        i = j - (D // 2 - HALF)
        rope = i >= 0
        c = cast_rne(tl.load(cos_ptr + r * cos_stride + i, mask=rope, other=1.0), dt, INTERPRET).to(tl.float32)
        s = cast_rne(tl.load(sin_ptr + r * sin_stride + i, mask=rope, other=0.0), dt, INTERPRET).to(tl.float32)
        re = cast_rne(ye * c - yo * s, dt, INTERPRET).to(tl.float32)
        ro = cast_rne(yo * c + ye * s, dt, INTERPRET).to(tl.float32)
        ye = tl.where(rope, re, ye)
        yo = tl.where(rope, ro, yo)
        # FP8 e4m3 fake quant per block of 32 channels (one row of both halves)
        amax = tl.maximum(tl.max(tl.abs(ye), axis=1), tl.max(tl.abs(yo), axis=1))[:, None]
        scale = _pow2_ceil_tl(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        qe = _e4m3_round(tl.minimum(tl.maximum(ye / scale, -448.0), 448.0)) * scale
        qo = _e4m3_round(tl.minimum(tl.maximum(yo / scale, -448.0), 448.0)) * scale
        odt = out_ptr.dtype.element_ty
        orow = out_ptr + tl.load(slot_ptr + r).to(tl.int64) * D
        tl.store(orow + 2 * j, cast_rne(cast_rne(qe, dt, INTERPRET).to(tl.float32), odt, INTERPRET))
        tl.store(orow + 2 * j + 1, cast_rne(cast_rne(qo, dt, INTERPRET).to(tl.float32), odt, INTERPRET))


def write_window_kv_triton(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The same in one launch (a program per row; D a multiple of 32 with a power-of-two number of FP8 blocks, and
    latent and cos / sin rows with unit channel stride: the rows may be strided, e.g. the wkv part of a merged
    projection's output, or the halves of a gathered rope-table row)."""
    assert triton is not None, "triton is not installed"
    R, D = latent.shape
    half = cos.shape[-1]
    nb = D // _FP8_BLOCK
    assert D % _FP8_BLOCK == 0 and nb & (nb - 1) == 0 and 2 * half <= D and cache.is_contiguous()
    if R:
        cos, sin = (t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous() for t in (cos, sin))
        latent = latent if latent.stride(-1) == 1 else latent.contiguous()
        _window_kv_kernel[(R,)](latent, weight.contiguous(), cos, sin, slots.contiguous(), cache, latent.stride(0),
                                cos.stride(0), sin.stride(0), float(eps), 1.0 / D, D=D, HALF=half, NB=nb,
                                INTERPRET=INTERPRET, enable_fp_fusion=False)


def write_window_kv(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton on CUDA (where the kernel's shape rules hold), torch elsewhere."""
    nb = latent.shape[-1] // _FP8_BLOCK
    if (latent.is_cuda and triton is not None and latent.shape[-1] % _FP8_BLOCK == 0 and nb & (nb - 1) == 0
            and cache.is_contiguous()):
        write_window_kv_triton(latent, weight, eps, cos, sin, cache, slots)
    else:
        write_window_kv_torch(latent, weight, eps, cos, sin, cache, slots)
