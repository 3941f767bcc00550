"""Routed-expert matmuls: out[r] = W[idx[r]] @ x[r // x_div] for every (token, slot) row r.

W [E, N, K] (row-major, nn.Linear layout), idx [R] expert per row, x [R / x_div, K] -> out [R, N], fp32
accumulation, output in x's dtype. idx -1 marks a row with no expert here (under expert parallelism, a route to
another rank's expert): its output row is 0 and none of W is read for it. Two shapes of the same product:
- `expert_gemv`, small decode batches: a program per row reads its expert's weights in place (the torch reference
  gathers W[idx] into a temporary first: twice the bytes and a copy kernel). Fixed shapes, no host sync.
- `expert_grouped`, prefill and mixed steps (many rows per expert): rows sorted by expert, one tiled matmul per
  block of up to BLOCK_M rows of one expert, every expert in one launch. The torch reference is one F.linear per
  expert that has rows (a Python loop and a host sync for the counts: fine on the CPU, not on the GPU's hot path).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


def expert_gemv_torch(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Reference: gather the experts' weights, then one batched matmul."""
    xr = x.repeat_interleave(x_div, dim=0) if x_div > 1 else x
    return torch.bmm(w[idx.clamp(min=0)], xr[:, :, None])[..., 0].masked_fill((idx < 0)[:, None], 0)


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
        for k0 in range(0, tl.where(e >= 0, K, 0), BLOCK_K):  # no expert (-1): no loads, a row of zeros
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            xv = tl.load(xrow + k, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(wbase + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + r * N + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


# Outputs a program of the per-row expert gemv. On an H100 at V4.1-Flash-8l's shapes (6 rows of distinct experts,
# weights past L2; benchmarks/bf16_gemv_forms.py) 8 takes the gate_up product from 112.3 to 97.6 us (copy floor
# 94.9) and the down product from 54.9 to 50.0 (floor 47.5), the best of 18 tiles; the batch-1 replay 3.169 ->
# 3.005 ms, batch 64 6.298 -> 6.272 (2026-12-06-h100-decode-b1-lanes-expert-tiles). DSV4_EXPERT_GEMV_BLOCK_N=16
# gives the earlier tiles.
EXPERT_GEMV_BLOCK_N = int(os.environ.get("DSV4_EXPERT_GEMV_BLOCK_N", "8"))


def expert_gemv_triton(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """The same in one launch: a program per (row, block of outputs)."""
    assert triton is not None, "triton is not installed"
    R, (N, K) = idx.numel(), w.shape[1:]
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        block_n = EXPERT_GEMV_BLOCK_N
        _expert_gemv_kernel[(R, triton.cdiv(N, block_n))](x.contiguous(), w, idx.contiguous(), out, N, K, x_div,
                                                          BLOCK_N=block_n, BLOCK_K=256)
    return out


def expert_gemv(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton is not None and w.is_contiguous():
        return expert_gemv_triton(x, w, idx, x_div)
    return expert_gemv_torch(x, w, idx, x_div)


# ---- grouped: many rows per expert ------------------------------------------------------------------------------
def expert_grouped_torch(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Reference: one F.linear per expert over its rows (in expert order)."""
    out = torch.zeros(idx.numel(), w.shape[1], dtype=x.dtype, device=x.device)  # rows with no expert stay 0
    order = torch.argsort(idx, stable=True)
    start = int((idx < 0).sum())  # (they sort first)
    for e, c in enumerate(torch.bincount(idx[idx >= 0], minlength=w.shape[0]).tolist()):
        rows = order[start:start + c]
        start += c
        if c:
            out[rows] = F.linear(x[rows // x_div], w[e])
    return out


GROUPED_BLOCK_M = 64  # rows of one expert per program: a tl.dot tile; at most one partly filled block per expert


class RowPlan(NamedTuple):
    """The device-side plan of a grouped expert matmul (`group_rows`): rows sorted by expert (stable; rows with no
    expert last, in a bucket E of their own), the E + 1 buckets' row counts, first rows and inclusive cumsum of
    blocks of `block_m` rows. A MoE layer builds it once for both of its matmuls (same routes, same block size)."""

    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    block_ends: torch.Tensor
    block_m: int


# Up to this many rows `group_rows` sorts in one Triton program (a bitonic sort of the (expert, row) keys in
# registers); beyond it (prefill) torch's sort, scan and scatter (~10 launches). H200, CUDA-graph replays
# (benchmarks/results/2026-12-03-h200-grouped-experts-decode): 2.1 us against 47 us at 192 rows, 9.4 against 50 at
# 768, but 77 against 56 at 3072 (one program's sort grows as R log^2 R).
PLAN_KERNEL_MAX_ROWS = 1024


def group_rows_torch(idx: torch.Tensor, E: int, block_m: int) -> RowPlan:
    """`group_rows` by torch ops. Counted with scatter_add, not bincount (which syncs with the host for its size):
    capturable in a decode graph."""
    idx = torch.where(idx < 0, E, idx).long()
    order = torch.argsort(idx, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))
    offsets = torch.cumsum(counts, 0) - counts
    return RowPlan(order, counts, offsets, torch.cumsum((counts + block_m - 1) // block_m, 0), block_m)


def group_rows(idx: torch.Tensor, E: int, block_m: int) -> RowPlan:
    """The plan for routes `idx` [R] (-1: no expert) over E experts: one launch on CUDA for up to
    PLAN_KERNEL_MAX_ROWS rows (the decode steps), torch ops otherwise. No host sync either way."""
    R = idx.numel()
    if not (idx.is_cuda and triton is not None and 0 < R <= PLAN_KERNEL_MAX_ROWS):
        return group_rows_torch(idx, E, block_m)
    return group_rows_triton(idx, E, block_m)


if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def block_rows(order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, E, x_div, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr):
        """Program b's rows of `group_rows`' plan: row block b of the bucket whose block range holds b (buckets:
        the experts, then the rows with no expert, which get zeros and read no weights; the grid is sized for the
        worst case, surplus programs store nothing). Returns (bucket, its rows [BLOCK_M], mask, x rows)."""
        b = tl.program_id(0)
        ev = tl.arange(0, BLOCK_E)
        ends = tl.load(block_ends_ptr + ev, mask=ev <= E, other=2147483647)
        e = tl.sum((ends <= b).to(tl.int32), axis=0)
        e_safe = tl.minimum(e, E)
        cnt = tl.where(e <= E, tl.load(counts_ptr + e_safe), 0)
        first_block = tl.load(block_ends_ptr + e_safe) - (cnt + BLOCK_M - 1) // BLOCK_M
        m = (b - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < cnt
        rows = tl.load(order_ptr + tl.load(offsets_ptr + e_safe) + m, mask=mm, other=0).to(tl.int64)
        return e_safe, rows, mm, rows // x_div

    @triton.jit
    def _group_rows_kernel(idx_ptr, order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, R, E, BLOCK_M: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
        # one program: the keys bucket * BLOCK_R + row sort to the stable order (padding past R, bucket E + 1, last)
        r = tl.arange(0, BLOCK_R)
        e = tl.load(idx_ptr + r, mask=r < R, other=0).to(tl.int32)
        e = tl.where(r < R, tl.where(e < 0, E, e), E + 1)
        order = tl.sort(e * BLOCK_R + r) % BLOCK_R
        tl.store(order_ptr + r, order.to(tl.int64), mask=r < R)
        counts = tl.histogram(e, BLOCK_E)  # BLOCK_E >= E + 2 bins: every key lands in one
        ev = tl.arange(0, BLOCK_E)
        em = ev <= E
        tl.store(counts_ptr + ev, counts.to(tl.int64), mask=em)
        tl.store(offsets_ptr + ev, (tl.cumsum(counts, 0) - counts).to(tl.int64), mask=em)
        tl.store(block_ends_ptr + ev, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, 0).to(tl.int64), mask=em)

    @triton.jit
    def _expert_grouped_kernel(x_ptr, w_ptr, order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, out_ptr, E, N, K,
                               x_div, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_E: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        e_safe, rows, mm, xrows = block_rows(order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, E, x_div, BLOCK_M,
                                             BLOCK_E)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        wbase = w_ptr + tl.minimum(e_safe, E - 1).to(tl.int64) * N * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, tl.where(e_safe < E, K, 0), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            a = tl.load(x_ptr + xrows[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            wt = tl.load(wbase + n[None, :] * K + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            # fp32: full-precision products, not TF32 (the fp32 path must match the CPU's). The CPU interpreter
            # multiplies bf16 tiles as their raw bits, so there they go through fp32 (bf16 products are exact in it)
            if IEEE or INTERPRET:
                acc += tl.dot(a.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, wt)
        dt = out_ptr.dtype.element_ty
        tl.store(out_ptr + rows[:, None] * N + n[None, :], cast_rne(acc, dt, INTERPRET), mask=mm[:, None] & nm[None, :])


def group_rows_triton(idx: torch.Tensor, E: int, block_m: int) -> RowPlan:
    """`group_rows_torch`'s plan in one launch (one program; up to PLAN_KERNEL_MAX_ROWS rows)."""
    assert triton is not None, "triton is not installed"
    R = idx.numel()
    assert 0 < R <= PLAN_KERNEL_MAX_ROWS, R
    dev = idx.device
    order = torch.empty(R, dtype=torch.int64, device=dev)
    counts, offsets, block_ends = (torch.empty(E + 1, dtype=torch.int64, device=dev) for _ in range(3))
    block_r = max(16, triton.next_power_of_2(R))
    _group_rows_kernel[(1,)](idx.contiguous(), order, counts, offsets, block_ends, R, E, BLOCK_M=block_m,
                             BLOCK_R=block_r, BLOCK_E=max(16, triton.next_power_of_2(E + 2)), num_warps=4)
    return RowPlan(order, counts, offsets, block_ends, block_m)


def expert_grouped_triton(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int,
                          plan: RowPlan | None = None) -> torch.Tensor:
    """The same in one launch, with no host sync: the sort, counts and block ranges are device tensors and the grid
    is sized for the worst case (every expert with one partly filled block)."""
    assert triton is not None, "triton is not installed"
    assert x.dtype == w.dtype, "tl.dot takes operands of one dtype"
    R, (E, N, K) = idx.numel(), w.shape
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        bm = GROUPED_BLOCK_M
        plan = plan if plan is not None else group_rows(idx, E, bm)
        assert plan.block_m == bm, "a plan for another block size"
        order, counts, offsets, block_ends, _ = plan
        block_n, block_k = 64, 64 if x.dtype == torch.float32 else 128
        grid = (triton.cdiv(R, bm) + min(E + 1, R), triton.cdiv(N, block_n))
        _expert_grouped_kernel[grid](x.contiguous(), w, order, counts, offsets, block_ends, out, E, N, K, x_div,
                                     BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
                                     BLOCK_E=triton.next_power_of_2(E + 1), IEEE=x.dtype == torch.float32,
                                     INTERPRET=INTERPRET)
    return out


def expert_grouped(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, x_div: int,
                   plan: RowPlan | None = None) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere (which needs no plan)."""
    if x.is_cuda and triton is not None and w.is_contiguous() and x.dtype == w.dtype:
        return expert_grouped_triton(x, w, idx, x_div, plan)
    return expert_grouped_torch(x, w, idx, x_div)


# ---- combine: the slots' outputs and the shared expert, one launch ------------------------------------------------
def combine_experts_torch(y: torch.Tensor, weights: torch.Tensor | None, shared: torch.Tensor, k: int,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE output from the routed rows y [T*k, D] (the down projections, model dtype) and the shared expert's
    output [T, D]. V4.1 (weights None: applied before the down projection) sums the slots and the shared expert in
    fp32 and rounds once; V4 (weights [T*k] fp32, applied here) sums the weighted slots in fp32, rounds to the model
    dtype, then adds the shared expert in the model dtype. `rows` [T*k]: slot t * k + j's output is y[rows[t * k +
    j]] (the sorted experts' rows, read where they are), else y[t * k + j]."""
    if rows is not None:
        y = y.index_select(0, rows)
    T = y.shape[0] // k
    if weights is None:
        return (y.float().view(T, k, -1).sum(dim=1) + shared.float()).to(y.dtype)
    routed = (y * weights[:, None]).float().view(T, k, -1).sum(dim=1)
    return routed.to(y.dtype) + shared


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, s_ptr, rows_ptr, out_ptr, D, K: tl.constexpr, WEIGHTED: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < D
        dt = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):  # the slots in order, one fp32 add each (torch's sum over the slot dim)
            if ROWS:
                row = tl.load(rows_ptr + t * K + j).to(tl.int64)
            else:
                row = t * K + j
            yv = tl.load(y_ptr + row * D + c, mask=m, other=0.0).to(tl.float32)
            if WEIGHTED:
                yv = yv * tl.load(w_ptr + t * K + j)
            acc += yv
        sv = tl.load(s_ptr + t * D + c, mask=m, other=0.0).to(tl.float32)
        if WEIGHTED:
            out = cast_rne(cast_rne(acc, dt, INTERPRET).to(tl.float32) + sv, dt, INTERPRET)
        else:
            out = cast_rne(acc + sv, dt, INTERPRET)
        tl.store(out_ptr + t * D + c, out, mask=m)


def combine_experts_triton(y: torch.Tensor, weights: torch.Tensor | None, shared: torch.Tensor,
                           k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The same in one launch (instead of 4-5 elementwise kernels and a reduction); `rows` read in it."""
    assert triton is not None, "triton is not installed"
    T, D = shared.shape
    y, shared = y.contiguous(), shared.contiguous()
    out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    if T:
        w = weights.float().contiguous() if weights is not None else y
        block = min(1024, triton.next_power_of_2(D))
        r = rows.contiguous() if rows is not None else y
        _combine_kernel[(T, triton.cdiv(D, block))](y, w, shared, r, out, D, K=k, WEIGHTED=weights is not None,
                                                    ROWS=rows is not None, BLOCK=block, INTERPRET=INTERPRET,
                                                    enable_fp_fusion=False)
    return out


def combine_experts(y: torch.Tensor, weights: torch.Tensor | None, shared: torch.Tensor, k: int,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if y.is_cuda and triton is not None and shared.dtype == y.dtype:
        return combine_experts_triton(y, weights, shared, k, rows)
    return combine_experts_torch(y, weights, shared, k, rows)
