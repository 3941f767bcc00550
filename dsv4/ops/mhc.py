"""mHC mixes after the projection: (pre, post, comb) with Sinkhorn, for every token at once.

The torch reference takes ~90 tiny kernels per site (Sinkhorn alone is 2 * iters reductions and divisions on
[T, N, N]); the Triton kernel does one token per program with the N x N matrix in registers, one launch per site.
Inputs: m [T, (2+N)N] = normed streams @ fn^T (fp32), base [(2+N)N], scale [3]. Outputs fp32 pre [T, N],
post [T, N], comb [T, N, N] (model.md section 3).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [.., N, N] positive matrices towards doubly stochastic: columns first, then rows/columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_post_torch(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                  hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (pre, post, comb) from the projected mixes `m`."""
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


if triton is not None:

    @triton.jit
    def _hc_post_kernel(m_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, iters, hc_eps,
                        N: tl.constexpr, W: tl.constexpr):
        t = tl.program_id(0)
        # torch.compile hands float arguments to user kernels as fp64: keep the math (and loop-carried values) fp32
        hc_eps = tl.cast(hc_eps, tl.float32)
        row = m_ptr + t * W
        i = tl.arange(0, N)
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(tl.load(row + i) * s_pre + tl.load(base_ptr + i)) + hc_eps
        post = 2.0 * tl.sigmoid(tl.load(row + N + i) * s_post + tl.load(base_ptr + N + i))
        tl.store(pre_ptr + t * N + i, pre)
        tl.store(post_ptr + t * N + i, post)
        jk = i[:, None] * N + i[None, :]  # row-major [j, k]
        c = tl.load(row + 2 * N + jk) * s_comb + tl.load(base_ptr + 2 * N + jk)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + hc_eps
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + jk, c)


def hc_post_triton(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                   hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same as one Triton launch (one token per program)."""
    assert triton is not None, "triton is not installed"
    m = m.float().contiguous()
    T = m.shape[0]
    pre = torch.empty(T, n, dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=m.device)
    if T:
        _hc_post_kernel[(T,)](m, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, iters,
                              hc_eps, N=n, W=m.shape[1])
    return pre, post, comb


def hc_post(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
            hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA (N a power of two), torch elsewhere."""
    if m.is_cuda and triton is not None and n & (n - 1) == 0:
        return hc_post_triton(m, base, scale, n, iters, hc_eps)
    return hc_post_torch(m, base, scale, n, iters, hc_eps)
