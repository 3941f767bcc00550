"""The Engram gate and residual update of the hc streams (model.md section 7), one launch per step on CUDA.

From the streams h [T, hc, D] and the wkv projection kv [T, (hc+1) D] (the key of every stream, then the value),
per token t and stream k, in fp32:
    dot = sum_d(h * (q_w * k_w) * key) * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))), 0 on masked (image-span) tokens
    h_k += gate * value, rounded to h's dtype.
The torch reference is ~30 elementwise and reduction kernels per layer and step; the kernel is one program per
token: a pass over D for the three sums of every stream, then the update. Its sums add in another order than
torch's (an fp32 ulp or so of dot and the norms), so outputs may differ from the reference's in the last bit.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def engram_update_torch(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float, gate_mask: torch.Tensor | None) -> torch.Tensor:
    """Reference: h [T, hc, D], kv [T, (hc+1) D], q_weight / k_weight [hc, D], gate_mask [T] bool or None."""
    num_tokens, hc, d = h.shape
    key = kv[:, : hc * d].reshape(num_tokens, hc, d).float()
    value = kv[:, hc * d:].float()
    hf = h.float()
    qk = q_weight.float() * k_weight.float()
    dot = (hf * qk * key).sum(-1)
    dot = dot * torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = dot / math.sqrt(d)
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())
    if gate_mask is not None:
        gate = gate.masked_fill(gate_mask[:, None], 0.0)
    return (hf + gate[..., None] * value[:, None, :]).to(h.dtype)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def _engram_kernel(h_ptr, kv_ptr, qw_ptr, kw_ptr, mask_ptr, out_ptr, D, eps, sqrt_d, HC: tl.constexpr,
                       HAS_MASK: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)  # torch.compile passes float arguments as fp64
        sqrt_d = tl.cast(sqrt_d, tl.float32)
        s = tl.arange(0, HC)
        hrow = h_ptr + t * HC * D
        krow = kv_ptr + t * (HC + 1) * D
        dot = tl.zeros([HC], dtype=tl.float32)
        hh = tl.zeros([HC], dtype=tl.float32)
        kk = tl.zeros([HC], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = (s[:, None] < HC) & (d[None, :] < D)
            off = s[:, None] * D + d[None, :]
            hv = tl.load(hrow + off, mask=m, other=0.0).to(tl.float32)
            kv = tl.load(krow + off, mask=m, other=0.0).to(tl.float32)
            qk = tl.load(qw_ptr + off, mask=m, other=0.0).to(tl.float32) * tl.load(kw_ptr + off, mask=m,
                                                                                   other=0.0).to(tl.float32)
            dot += tl.sum(hv * qk * kv, axis=1)
            hh += tl.sum(hv * hv, axis=1)
            kk += tl.sum(kv * kv, axis=1)
        # IEEE divisions as torch's (mean = sum / D, then / sqrt(D)); rsqrt is libdevice's (the interpreter has none)
        n = tl.zeros([HC], dtype=tl.float32) + D
        if INTERPRET:
            rh, rk = 1.0 / tl.sqrt(hh / n + eps), 1.0 / tl.sqrt(kk / n + eps)
        else:
            rh = libdevice.rsqrt(tl.math.div_rn(hh, n) + eps)
            rk = libdevice.rsqrt(tl.math.div_rn(kk, n) + eps)
        dot = tl.math.div_rn(dot * rh * rk, tl.zeros([HC], dtype=tl.float32) + sqrt_d)
        mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
        signed = tl.where(dot > 0, mag, tl.where(dot < 0, -mag, 0.0))  # sign(dot) * mag, sign(0) = 0
        gate = 1.0 / (1.0 + tl.exp(-signed))
        if HAS_MASK:
            gate = tl.where(tl.load(mask_ptr + t) != 0, 0.0, gate)
        dt = out_ptr.dtype.element_ty
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < D
            m = (s[:, None] < HC) & dm[None, :]
            off = s[:, None] * D + d[None, :]
            hv = tl.load(hrow + off, mask=m, other=0.0).to(tl.float32)
            v = tl.load(krow + HC * D + d, mask=dm, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * HC * D + off, cast_rne(hv + gate[:, None] * v[None, :], dt, INTERPRET), mask=m)


def engram_update_triton(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, gate_mask: torch.Tensor | None) -> torch.Tensor:
    """The same in one launch (hc a power of two, as the released configs have)."""
    assert triton is not None, "triton is not installed"
    T, hc, D = h.shape
    assert hc & (hc - 1) == 0, f"hc_mult {hc} must be a power of two for the kernel"
    h, kv = h.contiguous(), kv.contiguous()
    out = torch.empty_like(h)
    if T:
        mask = gate_mask if gate_mask is not None else h
        _engram_kernel[(T,)](h, kv, q_weight.contiguous(), k_weight.contiguous(), mask, out, D, float(eps),
                             math.sqrt(D), HC=hc, HAS_MASK=gate_mask is not None,
                             BLOCK_D=min(1024, triton.next_power_of_2(D)), INTERPRET=INTERPRET,
                             enable_fp_fusion=False)
    return out


def engram_update(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  gate_mask: torch.Tensor | None) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    hc = h.shape[1]
    if h.is_cuda and triton is not None and hc & (hc - 1) == 0:
        return engram_update_triton(h, kv, q_weight, k_weight, eps, gate_mask)
    return engram_update_torch(h, kv, q_weight, k_weight, eps, gate_mask)
