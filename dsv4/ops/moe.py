"""Per-slot expert GEMV for small decode batches: out[r] = W[idx[r]] @ x[r // x_div], reading each expert's
weights in place (the torch reference gathers W[idx] into a temporary first: twice the bytes and a copy kernel).

W [E, N, K] (row-major, nn.Linear layout), idx [R] expert per (token, slot) row, x [R / x_div, K] -> out [R, N],
fp32 accumulation, output in x's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def expert_gemv_torch(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Reference: gather the experts' weights, then one batched matmul."""
    xr = x.repeat_interleave(x_div, dim=0) if x_div > 1 else x
    return torch.bmm(w[idx], xr[:, :, None])[..., 0]


if triton is not None:

    @triton.jit
    def _expert_gemv_kernel(x_ptr, w_ptr, idx_ptr, out_ptr, N, K, x_div, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        r = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        e = tl.load(idx_ptr + r).to(tl.int64)
        xrow = x_ptr + (r // x_div) * K
        wbase = w_ptr + e * N * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(xrow + k, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(wbase + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + r * N + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def expert_gemv_triton(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """The same in one launch: a program per (row, block of outputs)."""
    assert triton is not None, "triton is not installed"
    R, (N, K) = idx.numel(), w.shape[1:]
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        block_n = 16
        _expert_gemv_kernel[(R, triton.cdiv(N, block_n))](x.contiguous(), w, idx.contiguous(), out, N, K, x_div,
                                                          BLOCK_N=block_n, BLOCK_K=256)
    return out


def expert_gemv(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None and w.is_contiguous():
        return expert_gemv_triton(x, w, idx, x_div)
    return expert_gemv_torch(x, w, idx, x_div)
