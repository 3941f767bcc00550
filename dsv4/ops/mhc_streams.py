"""mHC stream collapse and expand around a sublayer, one launch each on CUDA (model.md section 3).

collapse: x[t] = sum_j pre[t, j] * h[t, j] in fp32, cast to the stream dtype ([T, N, D] -> [T, D]). V4 and V4.1
agree here (V4's fp32 `pre` promotes the product).
expand: h'[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * h[t, j] ([T, D], [T, N, D] -> [T, N, D]), in one of
two numerics:
- fp32 (V4.1): every term in fp32, one cast to the stream dtype at the end;
- stream dtype (V4, transformers' numerics): post and comb are cast to the stream dtype first; post * y is rounded
  to it, the mix is a matmul in it (fp32 accumulation, one rounding), and their sum is rounded again.

The torch references take 4 (collapse) and 6 (expand) kernels, twice per layer; in a decode graph each is 1-2 us
whatever its size. The kernels round every product and add the N terms in order j = 0..N-1 in fp32 (no FMA
contraction, like torch's separate multiply and sum kernels); torch's reduction (and the matmul) may add the same
terms in another order, so the fp32 sums can differ in their last bits, which the final cast to bf16 can turn into
one ulp where they straddle a rounding boundary.

collapse_rms_norm: norm(collapse(h, pre)) in one launch (the sublayer's input; `rms_norm` HF-V4 weighted, or V4.1's
flavour), a program per token: the collapse as above, rounded to the stream dtype, then the norm with the rounding
steps of dsv4/ops/rmsnorm.py. Part of the fused mHC site (dsv4.ops.mhc.FUSED_MIXES: decode-sized steps).

expand_collapse_rms_norm: a site's expand (fp32 numerics) and the next sublayer's input from the new streams,
norm(collapse(h', pre_next)), in one launch: the same arithmetic as the two kernels (h' rounded to the stream dtype
as stored, then collapsed), a program per token. At batch 1 the pair is two dependent launches on the step's
critical chain at every mHC site (32 a V4.1-Flash-8l step); one program holds a token's N x D streams.
"""

from __future__ import annotations

import os

import torch

from dsv4.ops.rmsnorm import MODE_WEIGHTED

# expand + the next sublayer's collapse and norm in one launch where the fused mHC site runs: opt-in
# (DSV4_MHC_EXPAND_COLLAPSE=1; the same bits either way). Measured slower than the two launches it replaces: 6.04 us a
# site against 1.86 + 2.85, batch-1 replay 2.862 against 2.844 ms on an H100
# (benchmarks/results/2026-12-07-h100-vision-fused-expand-ab)
FUSED_EXPAND_COLLAPSE = os.environ.get("DSV4_MHC_EXPAND_COLLAPSE", "0") == "1"

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch references
    triton = None


def collapse_torch(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Reference: h [T, N, D] (stream dtype), pre [T, N] fp32 -> [T, D] in h's dtype."""
    return (pre.unsqueeze(-1) * h.float()).sum(dim=1).to(h.dtype)


def expand_torch(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fp32: bool) -> torch.Tensor:
    """Reference: y [T, D], h [T, N, D] (stream dtype), post [T, N], comb [T, N, N] fp32 -> [T, N, D] in h's dtype."""
    if fp32:
        out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.matmul(comb.transpose(-1, -2), h.float())
        return out.to(h.dtype)
    dt = h.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne, rms_apply, rms_factor  # (the interpreter's cast truncates)

    @triton.jit
    def _collapse_row(h_ptr, pre_ptr, t, d, dm, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
        """sum_j pre[t, j] h[t, j, d] in fp32, the terms rounded and added in order j = 0..N-1 (the launches disable
        FMA contraction)."""
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(N):
            p = tl.load(pre_ptr + t * N + j)
            acc += p * tl.load(h_ptr + (t * N + j) * D + d, mask=dm, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _collapse_kernel(h_ptr, pre_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr,
                         INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = d < D
        acc = _collapse_row(h_ptr, pre_ptr, t, d, dm, D, N, BLOCK_D)
        tl.store(out_ptr + t * D + d, cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=dm)

    @triton.jit
    def _expand_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, FP32: tl.constexpr,
                       BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        dm = d < D
        k = tl.arange(0, N)
        dt = out_ptr.dtype.element_ty
        y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + t * N + k)
        if not FP32:
            post = cast_rne(post, dt, INTERPRET).to(tl.float32)
        a = post[:, None] * y[None, :]  # [N, BLOCK_D], output stream k by channel
        if not FP32:
            a = cast_rne(a, dt, INTERPRET).to(tl.float32)
        mix = tl.zeros([N, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(N):
            c = tl.load(comb_ptr + (t * N + j) * N + k)  # comb[t, j, :]: stream j's weight in every output k
            if not FP32:
                c = cast_rne(c, dt, INTERPRET).to(tl.float32)
            hj = tl.load(h_ptr + (t * N + j) * D + d, mask=dm, other=0.0).to(tl.float32)
            mix += c[:, None] * hj[None, :]
        if not FP32:
            mix = cast_rne(mix, dt, INTERPRET).to(tl.float32)
        offs = (t * N + k[:, None]) * D + d[None, :]
        tl.store(out_ptr + offs, cast_rne(a + mix, dt, INTERPRET), mask=dm[None, :])

    @triton.jit
    def _collapse_norm_kernel(h_ptr, pre_ptr, w_ptr, out_ptr, D, eps, inv_d, N: tl.constexpr, MODE: tl.constexpr,
                              BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)
        inv_d = tl.cast(inv_d, tl.float32)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        dt = h_ptr.dtype.element_ty
        odt = out_ptr.dtype.element_ty
        xf = cast_rne(_collapse_row(h_ptr, pre_ptr, t, d, dm, D, N, BLOCK_D), dt, INTERPRET).to(tl.float32)
        r = rms_factor(tl.sum(xf * xf, axis=0), D, inv_d, eps, INTERPRET)  # (x^2 rounded before the sum)
        tl.store(out_ptr + t * D + d, cast_rne(rms_apply(xf, r, w_ptr, d, dm, MODE, dt, odt, INTERPRET), odt,
                                               INTERPRET), mask=dm)

    @triton.jit
    def _store_stream(hout_ptr, pre_ptr, t, k, a, mix, xacc, d, dm, D, N: tl.constexpr, dt: tl.constexpr,
                      INTERPRET: tl.constexpr):
        """Output stream k = a + mix rounded to the stream dtype and stored; returns xacc plus its collapse term,
        as `_collapse_row` adds the stored streams (k in order)."""
        hk = cast_rne(a + mix, dt, INTERPRET)
        tl.store(hout_ptr + (t * N + k) * D + d, hk, mask=dm)
        return xacc + tl.load(pre_ptr + t * N + k) * hk.to(tl.float32)

    @triton.jit
    def _expand_collapse_norm_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, hout_ptr, x_ptr, D, eps, inv_d,
                                     N: tl.constexpr, MODE: tl.constexpr, BLOCK_D: tl.constexpr,
                                     INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        eps = tl.cast(eps, tl.float32)
        inv_d = tl.cast(inv_d, tl.float32)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        dt = hout_ptr.dtype.element_ty
        odt = x_ptr.dtype.element_ty
        y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
        xacc = tl.zeros([BLOCK_D], dtype=tl.float32)
        if N == 4:
            # (mHC's four streams, every model's): the streams loaded once, all before the first store, so the
            # program waits for memory once, not once an output stream (the stores could alias the loads)
            h0 = tl.load(h_ptr + (t * N + 0) * D + d, mask=dm, other=0.0)
            h1 = tl.load(h_ptr + (t * N + 1) * D + d, mask=dm, other=0.0)
            h2 = tl.load(h_ptr + (t * N + 2) * D + d, mask=dm, other=0.0)
            h3 = tl.load(h_ptr + (t * N + 3) * D + d, mask=dm, other=0.0)
            for k in tl.static_range(N):
                a = tl.load(post_ptr + t * N + k) * y
                mix = tl.zeros([BLOCK_D], dtype=tl.float32)
                mix += tl.load(comb_ptr + (t * N + 0) * N + k) * h0.to(tl.float32)
                mix += tl.load(comb_ptr + (t * N + 1) * N + k) * h1.to(tl.float32)
                mix += tl.load(comb_ptr + (t * N + 2) * N + k) * h2.to(tl.float32)
                mix += tl.load(comb_ptr + (t * N + 3) * N + k) * h3.to(tl.float32)
                xacc = _store_stream(hout_ptr, pre_ptr, t, k, a, mix, xacc, d, dm, D, N, dt, INTERPRET)
        else:
            for k in tl.static_range(N):
                # output stream k as `_expand_kernel` (FP32) computes it: post_k y + (sum_j comb[j, k] h_j, j in
                # order)
                a = tl.load(post_ptr + t * N + k) * y
                mix = tl.zeros([BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(N):
                    c = tl.load(comb_ptr + (t * N + j) * N + k)
                    mix += c * tl.load(h_ptr + (t * N + j) * D + d, mask=dm, other=0.0).to(tl.float32)
                xacc = _store_stream(hout_ptr, pre_ptr, t, k, a, mix, xacc, d, dm, D, N, dt, INTERPRET)
        xf = cast_rne(xacc, dt, INTERPRET).to(tl.float32)
        r = rms_factor(tl.sum(xf * xf, axis=0), D, inv_d, eps, INTERPRET)
        tl.store(x_ptr + t * D + d, cast_rne(rms_apply(xf, r, w_ptr, d, dm, MODE, dt, odt, INTERPRET), odt,
                                             INTERPRET), mask=dm)


def _block_d(D: int) -> int:
    return min(1024, triton.next_power_of_2(D))


def collapse_triton(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The same in one launch (N a power of two)."""
    assert triton is not None, "triton is not installed"
    T, N, D = h.shape
    h, pre = h.contiguous(), pre.float().contiguous()
    out = torch.empty(T, D, dtype=h.dtype, device=h.device)
    if T:
        bd = _block_d(D)
        _collapse_kernel[(T, triton.cdiv(D, bd))](h, pre, out, D, N=N, BLOCK_D=bd, INTERPRET=INTERPRET,
                                                  enable_fp_fusion=False)
    return out


def expand_triton(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  fp32: bool) -> torch.Tensor:
    """The same in one launch (N a power of two)."""
    assert triton is not None, "triton is not installed"
    T, N, D = h.shape
    y, h = y.contiguous(), h.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty(T, N, D, dtype=h.dtype, device=h.device)
    if T:
        bd = _block_d(D)
        _expand_kernel[(T, triton.cdiv(D, bd))](y, h, post, comb, out, D, N=N, FP32=fp32, BLOCK_D=bd,
                                                INTERPRET=INTERPRET, enable_fp_fusion=False)
    return out


def _use_triton(h: torch.Tensor) -> bool:
    n = h.shape[1]
    return h.is_cuda and triton is not None and n & (n - 1) == 0


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    return collapse_triton(h, pre) if _use_triton(h) else collapse_torch(h, pre)


def expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    return expand_triton(y, h, post, comb, fp32) if _use_triton(h) else expand_torch(y, h, post, comb, fp32)


def collapse_rms_norm_torch(h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float,
                            mode: int) -> torch.Tensor:
    """Reference: the sublayer's normed input from the streams h [T, N, D] and pre [T, N]; `mode` MODE_WEIGHTED
    (HF-V4 `rms_norm`) or MODE_V41 (V4.1's RMSNorm)."""
    from dsv4.models.layers.norm import rms_norm_torch, rms_norm_v41_torch
    x = collapse_torch(h, pre)
    return rms_norm_torch(x, weight, eps) if mode == MODE_WEIGHTED else rms_norm_v41_torch(x, weight, eps)


def collapse_rms_norm_triton(h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float,
                             mode: int) -> torch.Tensor:
    """The same in one launch (N a power of two, D at most 16384)."""
    assert triton is not None, "triton is not installed"
    T, N, D = h.shape
    h, pre, weight = h.contiguous(), pre.float().contiguous(), weight.contiguous()
    out_dtype = h.dtype if mode == MODE_WEIGHTED else torch.promote_types(h.dtype, weight.dtype)
    out = torch.empty(T, D, dtype=out_dtype, device=h.device)
    if T:
        block = triton.next_power_of_2(D)
        _collapse_norm_kernel[(T,)](h, pre, weight, out, D, eps, 1.0 / D, N=N, MODE=mode, BLOCK_D=block,
                                    INTERPRET=INTERPRET, num_warps=min(16, max(1, block // 512)),
                                    enable_fp_fusion=False)
    return out


def expand_collapse_rms_norm_torch(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                                   pre: torch.Tensor, weight: torch.Tensor, eps: float,
                                   mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the expanded streams h' (fp32 numerics) and the next sublayer's input norm(collapse(h', pre))."""
    h2 = expand_torch(y, h, post, comb, fp32=True)
    return h2, collapse_rms_norm_torch(h2, pre, weight, eps, mode)


def expand_collapse_rms_norm_triton(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                                    pre: torch.Tensor, weight: torch.Tensor, eps: float,
                                    mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in one launch (N a power of two, D at most 16384): the bits of `expand_triton(..., fp32=True)` and
    `collapse_rms_norm_triton` on its output."""
    assert triton is not None, "triton is not installed"
    T, N, D = h.shape
    y, h, weight = y.contiguous(), h.contiguous(), weight.contiguous()
    post, comb, pre = post.float().contiguous(), comb.float().contiguous(), pre.float().contiguous()
    h2 = torch.empty_like(h)
    out_dtype = h.dtype if mode == MODE_WEIGHTED else torch.promote_types(h.dtype, weight.dtype)
    x = torch.empty(T, D, dtype=out_dtype, device=h.device)
    if T:
        block = triton.next_power_of_2(D)
        # 8 warps at V4.1's D 5120 (BLOCK_D 8192): 255 registers, no spill on sm_90; 16 warps spilled 32 bytes a
        # thread (256 before the streams were loaded once), 32 warps 48 (benchmarks/mhc_expand_collapse_sass.py)
        _expand_collapse_norm_kernel[(T,)](y, h, post, comb, pre, weight, h2, x, D, eps, 1.0 / D, N=N, MODE=mode,
                                           BLOCK_D=block, INTERPRET=INTERPRET,
                                           num_warps=min(8, max(1, block // 1024)), enable_fp_fusion=False)
    return h2, x
