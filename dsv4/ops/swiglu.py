"""The experts' clamped SwiGLU, silu(min(g, L)) * clamp(u, -L, L), as one launch on CUDA.

Two numerics, as the models use them:
- fp32 (V4.1): g and u are upcast, everything is fp32, an optional per-row weight multiplies the result (V4.1
  weights routed experts before w2), and one cast to g's dtype ends it;
- stream (V4, transformers' numerics): the ops run in g's dtype, so silu's result and the product are each
  rounded to it.
The torch expression is 6-8 elementwise kernels (upcasts, two clamps, silu, products, cast); in a decode graph each
costs 1-2 us whatever its size, and every layer has two (routed and shared experts). The kernel follows torch's CUDA
silu, x / (1 + expf(-x)), with the accurate expf and an IEEE division, and rounds every product separately (no FMA
contraction), so on the GPU it should give torch's bits; the CPU's silu is vectorised differently (ulp-level).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L), in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_torch(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                 fp32: bool = True) -> torch.Tensor:
    """Reference: g, u [R, I] (any strides), weight [R] fp32 (fp32 numerics only) -> [R, I] in g's dtype."""
    if not fp32:
        assert weight is None, "the stream numerics take no weight"
        return clamped_swiglu(g, u, limit)
    h = clamped_swiglu(g.float(), u.float(), limit)
    if weight is not None:
        h = h * weight[:, None]
    return h.to(g.dtype)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, w_ptr, out_ptr, I, g_stride, u_stride, limit, HAS_W: tl.constexpr,
                       FP32: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < I
        dt = out_ptr.dtype.element_ty
        L = tl.cast(limit, tl.float32)  # torch.compile hands float arguments over as fp64
        g = tl.load(g_ptr + r * g_stride + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * u_stride + i, mask=m, other=0.0).to(tl.float32)
        a = tl.minimum(g, L)
        if INTERPRET:  # no libdevice in the interpreter
            e = tl.exp(-a)
        else:  # torch's CUDA silu calls expf: libdevice's __nv_expf, not tl.exp's fast exp2 path
            e = libdevice.exp(-a)
        s = tl.math.div_rn(a, 1.0 + e)
        c = tl.minimum(tl.maximum(u, -L), L)
        if FP32:
            h = s * c
            if HAS_W:
                h = h * tl.load(w_ptr + r)
        else:
            h = cast_rne(s, dt, INTERPRET).to(tl.float32) * c
        tl.store(out_ptr + r * I + i, cast_rne(h, dt, INTERPRET), mask=m)


def swiglu_triton(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                  fp32: bool = True) -> torch.Tensor:
    """The same in one launch (rows may be strided, e.g. the two halves of one gate_up output)."""
    assert triton is not None, "triton is not installed"
    assert fp32 or weight is None, "the stream numerics take no weight"
    R, I = g.shape
    if g.stride(1) != 1:
        g = g.contiguous()
    if u.stride(1) != 1:
        u = u.contiguous()
    out = torch.empty(R, I, dtype=g.dtype, device=g.device)
    if R:
        w = weight.float().contiguous() if weight is not None else out
        block = min(1024, triton.next_power_of_2(I))
        _swiglu_kernel[(R, triton.cdiv(I, block))](g, u, w, out, I, g.stride(0), u.stride(0), float(limit),
                                                   HAS_W=weight is not None, FP32=fp32, BLOCK=block,
                                                   INTERPRET=INTERPRET, enable_fp_fusion=False)
    return out


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
           fp32: bool = True) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if g.is_cuda and triton is not None and g.dim() == 2:
        return swiglu_triton(g, u, limit, weight, fp32)
    return swiglu_torch(g, u, limit, weight, fp32)
