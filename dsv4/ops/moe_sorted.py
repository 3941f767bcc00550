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
   same sorted rows: the intermediate stays sorted, so there is one gather for the layer and no scatter;
4. `combine_experts` reads each route's output where the GEMMs left it, through the inverse order (`at`).
Rows past the last expert's end (the -1 rows under expert parallelism) are computed by neither GEMM (their memory is
left as allocated), so their outputs are zeroed; without missing rows there are none.

Quantized experts (MXFP4 / FP8 `QuantWeight`, the released checkpoints): each GEMM first dequantizes the experts to
bf16 (dsv4/ops/expert_dequant.py: one launch, half a byte read and two written per MXFP4 weight), all of them at once
when they fit `DEQUANT_BYTES`, which keeps the path free of host syncs; larger layers (the full-size models' 256 or
384 experts) go in pieces of experts, after one host copy of the experts' row ends.

Numerics: fp32 accumulation and one rounding to bf16 per GEMM, as the Triton kernel; only the order of the fp32 sums
differs, so outputs match it to bf16 rounding, not bit for bit.

Where it runs (`use_sorted_experts`): prefill and mixed steps (not the captured decode steps, which have their own
fixed-shape paths), bf16 activations (experts bf16 or quantized) on a GPU whose CUTLASS path torch has (compute
capability 9.x / 10.x; on others torch falls back to one matmul per expert after a host sync, slower than the Triton
kernel), from `MIN_ROWS` routed rows and enough rows an expert (the thresholds below, measured). On by default
(`DSV4_SORTED_EXPERTS=0` keeps the Triton kernel; benchmarks/moe_prefill_gemm.py compares the two paths). On an H200
it took V4.1-Flash-8l's 16,384-token prefill from 676 to 542 ms and its 32 x 512 prefill from 27.9k to 36.1k
tokens/s. Everywhere torch has `_grouped_mm` (its CPU build included) the functions here compute the same thing,
which is how the CPU tests check them.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from dsv4.ops.expert_dequant import dequantize_experts
from dsv4.ops.host_copy import to_device
from dsv4.ops.moe import group_rows
from dsv4.ops.swiglu import swiglu
from dsv4.quant.weight import QuantWeight

SORTED_EXPERTS = os.environ.get("DSV4_SORTED_EXPERTS", "1") == "1"
SORTED_COMBINE_ROWS = os.environ.get("DSV4_SORTED_COMBINE_ROWS", "1") != "0"
# Where the sorted path wins, measured on an H200 (benchmarks/results/2026-12-05-h200-moe-prefill-sorted,
# `moe_prefill_gemm.py`: one layer's routed experts, V4 / V4.1 Flash expert shapes, top-6). What decides is the rows
# each expert gets: the grouped GEMM's tiles need rows to fill, and every quantized expert is dequantized whole.
# - bf16: 1.36-1.39x the Triton kernel at 192 rows an expert (16 experts, 512 tokens), 1.6-1.7x at 96 (256 experts,
#   4,096 tokens), 1.9-2.1x from 1,536; 0.82x at 12 (256 experts, 512 tokens). MIN_ROWS_PER_EXPERT lies between the
#   loss and the win measured.
# - MXFP4: 0.89-0.97x at 192 rows an expert, 0.94-1.08x at 96 (256 experts: the dequantization's bytes), 1.3-1.6x at
#   384 (256 experts, 16,384 tokens), 1.6-2.1x from 1,536. MIN_QUANT_ROWS_PER_EXPERT lies between 192 and 384.
# MIN_ROWS keeps short steps (host-bound anyway) on the Triton kernel.
MIN_ROWS = 1024
MIN_ROWS_PER_EXPERT = 48
MIN_QUANT_ROWS_PER_EXPERT = 256
# quantized experts: at most this many bytes of them dequantized at once (a V4.1-Flash-8l layer's 16 experts, 0.75 GB
# of gate_up in bf16, in one piece; the full model's 384, 18 GB, in ~18 pieces with one host sync a layer)
DEQUANT_BYTES = 1 << 30


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


def sorted_matmul(a: torch.Tensor, w: torch.Tensor | QuantWeight, routes: SortedRoutes,
                  ends: list[int] | None = None) -> torch.Tensor:
    """Rows of a [R, K] in sorted order times their experts' weights w [E, N, K] (nn.Linear layout) -> [R, N]; rows
    past the last expert's end are not computed (left as allocated). Quantized experts are dequantized to a's dtype
    first (dsv4/ops/expert_dequant.py), all at once when they fit `DEQUANT_BYTES`, else `experts_per_chunk` at a
    time, which needs the experts' row ends on the host (`ends`, a copy of routes.offs)."""
    if not isinstance(w, QuantWeight):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=routes.offs)
    E, N, _ = w.shape
    step = experts_per_chunk(w, a.dtype)
    if step >= E:
        return torch._grouped_mm(a, dequantize_experts(w, 0, E, a.dtype).transpose(1, 2), offs=routes.offs)
    assert ends is not None, "chunked experts need their row ends on the host"
    out = a.new_empty(a.shape[0], N)
    for first in range(0, E, step):
        end = min(E, first + step)
        lo, hi = ends[first - 1] if first else 0, ends[end - 1]
        if hi > lo:  # (no rows: nothing dequantized)
            offs = to_device([e - lo for e in ends[first:end]], a.device, torch.int32)
            wc = dequantize_experts(w, first, end, a.dtype)
            out[lo:hi] = torch._grouped_mm(a[lo:hi], wc.transpose(1, 2), offs=offs)
    return out


def experts_per_chunk(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> int:
    """How many of w's experts are dequantized at once: as many as fit DEQUANT_BYTES (at least one); every expert
    for unquantized weights."""
    E, N, K = w.shape
    if not isinstance(w, QuantWeight):
        return E
    return max(1, DEQUANT_BYTES // (N * K * torch.finfo(dtype).bits // 8))


def experts_sorted(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor | QuantWeight,
                   down: torch.Tensor | QuantWeight, limit: float, weight_before_down: bool,
                   missing: bool) -> torch.Tensor:
    """The routed experts' outputs [T * k, D] in route order (row t * k + j: token t's slot j), as
    `dsv4.models.layers.moe.moe_output`'s grouped matmuls give them to `combine_experts`: with the routing weight
    applied before down (V4.1, fp32 SwiGLU) or not at all (V4: combine weighs). -1 routes give rows of zeros."""
    y, at = experts_sorted_rows(x, weights, idx, gate_up, down, limit, weight_before_down, missing)
    return y if at is None else y.index_select(0, at)


def experts_sorted_rows(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                        gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight, limit: float,
                        weight_before_down: bool, missing: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`experts_sorted`'s rows where the GEMMs leave them: (y [T * k, D] in sorted order, at [T * k]: route row r's
    output is y[at[r]]), for `combine_experts(rows=at)`, which reads them in place. Scattering them to route order
    first took an aten index_copy_ of the whole [T * k, D] (a 16K prefill's 8 `index_elementwise_kernel` calls, 1.6
    ms each on an H100, are most likely these: ~40% of the copy bandwidth). With DSV4_SORTED_COMBINE_ROWS=0
    (comparisons) that scatter is kept: (y in route order, None)."""
    T, k = idx.shape
    E, inter = gate_up.shape[0], down.shape[2]
    routes = sort_routes(idx.flatten(), E, missing)
    ends = None  # (one host copy when a layer's experts are dequantized in chunks)
    if min(experts_per_chunk(gate_up, x.dtype), experts_per_chunk(down, x.dtype)) < E:
        ends = routes.offs.tolist()
    xs = x.index_select(0, routes.order // k)
    gu = sorted_matmul(xs, gate_up, routes, ends)
    g, u = gu[:, :inter], gu[:, inter:]
    if weight_before_down:
        h = swiglu(g, u, limit, weights.flatten().index_select(0, routes.order), fp32=True)
    else:
        h = swiglu(g, u, limit, fp32=False)
    del gu, g, u, xs
    y = sorted_matmul(h, down, routes, ends)
    if routes.valid is not None:
        y = torch.where(routes.valid, y, 0)
    order = routes.order
    if not SORTED_COMBINE_ROWS:
        return torch.empty_like(y).index_copy_(0, order, y), None
    at = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return y, at


def grouped_mm_fast(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> bool:
    """Whether torch runs `_grouped_mm` of x [*, K] and w [E, N, K] (quantized: dequantized to x's dtype) as its
    CUTLASS kernel: CUDA, bf16 operands, compute capability 9.x or 10.x, 16-byte row strides."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if not isinstance(w, QuantWeight) and not (w.dtype == torch.bfloat16 and w.is_contiguous()):
        return False
    major, _ = torch.cuda.get_device_capability(x.device)
    return major in (9, 10) and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0


def use_sorted_experts(x: torch.Tensor, gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight,
                       rows: int) -> bool:
    """The switch `moe_output` asks for a step of `rows` routed rows that is not a captured decode step: on, at
    least MIN_ROWS rows and, per expert of the layer, MIN_ROWS_PER_EXPERT (MIN_QUANT_ROWS_PER_EXPERT for quantized
    experts), and torch's CUTLASS kernel for both matmuls."""
    per_expert = MIN_QUANT_ROWS_PER_EXPERT if isinstance(gate_up, QuantWeight) else MIN_ROWS_PER_EXPERT
    if not SORTED_EXPERTS or rows < max(MIN_ROWS, per_expert * gate_up.shape[0]):
        return False
    return grouped_mm_fast(x, gate_up) and grouped_mm_fast(x, down)
