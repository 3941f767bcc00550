"""One-row products x [1, K] @ W[N, K]^T of 16-bit weights: the batch-1 decode step's dense linears as a Triton
GEMV that streams W once, in place of cuBLAS.

Why: at batch 1 a decode step of V4.1-Flash-8l spends ~1.3 ms of its 3.3 ms graph replay in cuBLAS's bf16 products
(78 launches with their split-K reduces) against ~0.98 ms for their weight bytes at the H100's copy bandwidth: ~75%
(benchmarks/results/2026-12-06-h100-decode-optins). A GEMV's only work is reading W; what decides its speed is how
many bytes every SM keeps in flight and how evenly the programs cover the SMs. Here each program owns BLOCK_N
outputs of one K chunk and walks it in BLOCK_K steps, keeping lane-wise fp32 partial sums in registers (one
reduction at the end, no cross-warp traffic inside the loop); narrow outputs (few programs) split K over more
programs (`gemv_plan`) and a second launch adds the chunks' fp32 sums in order. The products and sums are fp32,
as cuBLAS's; only the order of the sums differs.

Status: the LM head's product runs here by default (DSV4_BF16_GEMV=head, dsv4/models/layers/gemv_linear.py): with
the wide tiles (WIDE_TILE) 335 us a call against cuBLAS's 363 on an H100. Every dense linear (DSV4_BF16_GEMV=1) stays
opt-in: at the default 16 x 256 tiles the mid-sized products (1536 to 32768 outputs) take 1.1-1.4x cuBLAS's time, and
the sweep's best tiles per shape won at most ~1.5 us a call over cuBLAS (benchmarks/bf16_gemv_forms.py,
benchmarks/results/2026-12-07-h100-decode-b32-rows-lm-head). The same loop runs the routed experts' gemv
(dsv4/ops/moe.py) at 8 outputs a program.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsv4.ops.indexer import _sm_count  # (cached per device: no properties query per call)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Programs a call aims for per streaming multiprocessor: enough independent loads in flight to cover HBM latency
# (a program keeps one BLOCK_N x BLOCK_K tile, 8 KB at 16 x 256, in flight at a time)
PROGRAMS_PER_SM = 4


class GemvPlan(NamedTuple):
    block_n: int  # outputs a program
    block_k: int  # columns a loop step
    splits: int  # K chunks (programs per output block); > 1 adds a reduce launch
    num_warps: int


# Tiles for wide outputs: the LM head (129280 x 4096, 1.06 GB) took 343.5 us a call with 32 x 512 tiles against
# 390.9 with 16 x 256 and 380.5 for cuBLAS, the best of 54 tilings (H100, copy bandwidth 3.00 TB/s, cold L2;
# benchmarks/results/2026-12-07-h100-decode-b32-rows-lm-head). A wide product has programs enough without a split;
# bigger tiles then mean fewer, longer programs, each with more bytes in flight.
WIDE_TILE = (32, 512)
# "Wide": at least this many waves of WIDE_TILE programs (programs_per_sm a SM) before any split
WIDE_WAVES = 4


def gemv_plan(N: int, K: int, sms: int, block_n: int | None = None, block_k: int | None = None,
              num_warps: int = 4, programs_per_sm: int = PROGRAMS_PER_SM) -> GemvPlan:
    """Tiles of one call, from shapes only (a decode step is captured): `block_n` x `block_k` tiles (by default
    WIDE_TILE for wide outputs, else 16 x 256), and K split into chunks (whole BLOCK_K steps, at least 4 steps each)
    until output blocks x splits reach `programs_per_sm` a SM."""
    if block_n is None and block_k is None:
        wide = -(-N // WIDE_TILE[0]) >= WIDE_WAVES * programs_per_sm * sms
        block_n, block_k = WIDE_TILE if wide else (16, 256)
    block_n = 16 if block_n is None else block_n
    block_k = 256 if block_k is None else block_k
    blocks = -(-N // block_n)
    steps = -(-K // block_k)
    want = -(-programs_per_sm * sms // blocks)
    splits = max(1, min(want, steps // 4))
    return GemvPlan(block_n, block_k, splits, num_warps)


def gemv_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: F.linear (x [1, K] or [K], w [N, K])."""
    return F.linear(x, w)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, N, K, w_stride, CHUNK, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        c = tl.program_id(1)
        nm = n < N
        rows = w_ptr + n[:, None].to(tl.int64) * w_stride
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # lane-wise partial sums, reduced once at the end
        k_lo = c * CHUNK
        for k0 in range(k_lo, tl.minimum(k_lo + CHUNK, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        s = tl.sum(acc, axis=1)
        if SPLIT:
            tl.store(part_ptr + c * N + n, s, mask=nm)
        else:
            tl.store(out_ptr + n, s.to(out_ptr.dtype.element_ty), mask=nm)

    @triton.jit
    def _gemv_reduce_kernel(part_ptr, out_ptr, N, S, BLOCK: tl.constexpr):
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        nm = n < N
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(S):  # in chunk order: the result does not depend on scheduling
            s += tl.load(part_ptr + c * N + n, mask=nm, other=0.0)
        tl.store(out_ptr + n, s.to(out_ptr.dtype.element_ty), mask=nm)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, plan: GemvPlan | None = None) -> torch.Tensor:
    """The same in one launch (two when K is split): x [1, K] (or [K]) and w [N, K] of one 16-bit dtype, w's rows
    contiguous; returns [1, N] (or [N]) in x's dtype. `plan` overrides `gemv_plan` (benchmarks, tests)."""
    assert triton is not None, "triton is not installed"
    N, K = w.shape
    assert x.numel() == K and x.dtype == w.dtype and w.stride(1) == 1, (x.shape, x.dtype, w.shape, w.stride())
    xv = x.reshape(K)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    if N == 0:
        return out.view(*x.shape[:-1], N)
    if plan is None:
        plan = gemv_plan(N, K, _sm_count(x.device))
    steps = -(-K // plan.block_k)
    chunk = -(-steps // plan.splits) * plan.block_k  # whole steps a chunk
    splits = -(-K // chunk)  # (rounding may leave fewer chunks than asked)
    part = torch.empty(splits, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    _gemv_kernel[(triton.cdiv(N, plan.block_n), splits)](xv, w, out, part, N, K, w.stride(0), chunk,
                                                         BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                                                         SPLIT=splits > 1, num_warps=plan.num_warps)
    if splits > 1:
        _gemv_reduce_kernel[(triton.cdiv(N, 1024),)](part, out, N, splits, BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], N)


def use_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` takes the Triton path: one row on CUDA, 16-bit operands of one dtype, w's rows contiguous."""
    return (triton is not None and x.is_cuda and x.numel() == w.shape[1] and x.dtype == w.dtype
            and x.dtype in HALF_DTYPES and w.stride(1) == 1)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T for one row: the Triton GEMV on CUDA (`use_gemv`), else F.linear."""
    return gemv_triton(x, w) if use_gemv(x, w) else gemv_torch(x, w)
