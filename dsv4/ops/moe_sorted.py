"""The routed experts of a large prefill step as two grouped GEMMs over rows sorted by expert (torch._grouped_mm).

Why. A prefill step's MoE is most of its FLOPs (V4.1-Flash-8l, 16,384 tokens: 56% of 117 TFLOP) and compute-bound:
every expert gets thousands of rows. `dsv4.ops.moe.expert_grouped` computes it in 64 x 64 Triton tiles whose rows are
gathered in the kernel; on the H200 it ran at ~205 TFLOP/s (benchmarks/results/2026-12-04-h200-decode-launches,
`prefill_router_off.log`: V4-Flash-4l, 512 tokens, the quantized twin of that kernel at 376 us a call), about a fifth
of the bf16 peak. torch's `_grouped_mm` is a CUTLASS grouped GEMM for sm_90 / sm_100 in bf16 (TMA, warp-specialized,
large tiles) that takes each group's row range from a device tensor of offsets: no host sync, capturable.

How. For routes `idx` [T, k] (expert per (token, slot) row r = t * k + j; -1: an expert of another rank):
1. sort the rows by expert (stable; -1 rows last) and take each expert's inclusive row end (`SortedRoutes`);
2. gather x's rows in that order once (xs[i] = x[order[i] // k]);
3. gate_up on the sorted rows, SwiGLU (V4.1: the routing weight applied before down, also gathered), down on the
   same sorted rows: the intermediate stays sorted, so there is one gather and one scatter for the layer;
4. scatter back to route order (into xs's memory, which is no longer needed) for `combine_experts`.
Rows past the last expert's end (the -1 rows under expert parallelism) are computed by neither GEMM (their memory is
left as allocated), so their outputs are zeroed before the scatter; without missing rows there are none.

Numerics: fp32 accumulation and one rounding to bf16 per GEMM, as the Triton kernel; only the order of the fp32 sums
differs, so outputs match it to bf16 rounding, not bit for bit.

Where it runs (`use_sorted_experts`): prefill and mixed steps (not the captured decode steps, which have their own
fixed-shape paths), unquantized bf16 experts on a GPU whose CUTLASS path torch has (compute capability 9.x / 10.x; on
others torch falls back to one matmul per expert after a host sync, slower than the Triton kernel), from
`MIN_ROWS` routed rows. Off by default until measured on the H200 (`DSV4_SORTED_EXPERTS=1` turns it on;
benchmarks/moe_prefill_gemm.py compares the two paths). Everywhere torch has `_grouped_mm` (its CPU build included)
the functions here compute the same thing, which is how the CPU tests check them.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from dsv4.ops.moe import group_rows
from dsv4.ops.swiglu import swiglu

SORTED_EXPERTS = os.environ.get("DSV4_SORTED_EXPERTS", "0") == "1"
# below this many routed rows a step keeps the Triton kernel (a short prompt is host-bound, and its experts get few
# rows each); to be set from benchmarks/moe_prefill_gemm.py
MIN_ROWS = 1024


class SortedRoutes(NamedTuple):
    """Routes sorted by expert: `order` [R] route rows in sorted order (stable; rows with no expert last), `offs`
    [E] int32 each expert's inclusive end in that order, `valid` [R, 1] bool whether sorted row i has an expert
    (None when every row has one)."""

    order: torch.Tensor
    offs: torch.Tensor
    valid: torch.Tensor | None


def sort_routes(flat: torch.Tensor, E: int, missing: bool) -> SortedRoutes:
    """The sorted order of routes `flat` [R] (expert ids, -1 = none) over E experts, on the device (no host sync).
    `missing`: whether some route may be -1 (expert parallelism); then `valid` marks the rows with an expert."""
    plan = group_rows(flat, E, 1)  # (block size unused here)
    offs = torch.cumsum(plan.counts[:E], 0).to(torch.int32)
    valid = None
    if missing:
        valid = (torch.arange(flat.numel(), device=flat.device) < offs[-1])[:, None]
    return SortedRoutes(plan.order, offs, valid)


def sorted_matmul(a: torch.Tensor, w: torch.Tensor, routes: SortedRoutes) -> torch.Tensor:
    """Rows of a [R, K] in sorted order times their experts' weights w [E, N, K] (nn.Linear layout) -> [R, N]; rows
    past the last expert's end are not computed (left as allocated)."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=routes.offs)


def experts_sorted(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, limit: float, weight_before_down: bool, missing: bool) -> torch.Tensor:
    """The routed experts' outputs [T * k, D] in route order (row t * k + j: token t's slot j), as
    `dsv4.models.layers.moe.moe_output`'s grouped matmuls give them to `combine_experts`: with the routing weight
    applied before down (V4.1, fp32 SwiGLU) or not at all (V4: combine weighs). -1 routes give rows of zeros."""
    T, k = idx.shape
    E, inter = gate_up.shape[0], down.shape[2]
    routes = sort_routes(idx.flatten(), E, missing)
    xs = x.index_select(0, routes.order // k)
    gu = sorted_matmul(xs, gate_up, routes)
    g, u = gu[:, :inter], gu[:, inter:]
    if weight_before_down:
        h = swiglu(g, u, limit, weights.flatten().index_select(0, routes.order), fp32=True)
    else:
        h = swiglu(g, u, limit, fp32=False)
    del gu, g, u
    y = sorted_matmul(h, down, routes)
    if routes.valid is not None:
        y = torch.where(routes.valid, y, 0)
    return xs.index_copy_(0, routes.order, y)  # (xs has y's shape: [R, D])


def grouped_mm_fast(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch runs `_grouped_mm` of x [*, K] and w [E, N, K] as its CUTLASS kernel: CUDA, bf16 operands,
    compute capability 9.x or 10.x, 16-byte row strides."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    major, _ = torch.cuda.get_device_capability(x.device)
    return major in (9, 10) and w.is_contiguous() and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0


def use_sorted_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: int) -> bool:
    """The switch `moe_output` asks for a step of `rows` routed rows that is not a captured decode step."""
    return SORTED_EXPERTS and rows >= MIN_ROWS and grouped_mm_fast(x, gate_up) and grouped_mm_fast(x, down)
