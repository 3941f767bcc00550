"""Mixture of experts: routers (top-k with a selection bias, or hash), clamped SwiGLU experts, shared expert."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.models.layers.merged import project
from dsv4.models.layers.side_stream import ROUTER_LANE, SIDE
from dsv4.ops import moe_sorted
from dsv4.ops.moe import GROUPED_BLOCK_M, combine_experts, expert_gemv, expert_grouped, group_rows
from dsv4.ops.moe_quant import expert_gemv_q, expert_grouped_q, grouped_q_block_m
from dsv4.ops.router import route_v4
from dsv4.ops.swiglu import swiglu
from dsv4.quant.weight import QuantWeight

if TYPE_CHECKING:
    from dsv4.distributed import ExpertShard

# The every-expert decode path (captured steps with more routes than experts) in token-major row order
# (default; DSV4_MOE_TOKEN_MAJOR=0: expert-major). Expert-major rows cost two copies a layer that token-major
# rows do not: the gate_up einsum is one [T, D] x [D, E*2I] GEMM whose token-major output it permutes and clones
# into expert-major rows (8 MB at batch 64 on V4.1-Flash-8l, ~13 us), and the [E, T, D] down output was cast to
# fp32 as a whole before the sum over experts (16 MB, ~9.5 us); 2026-12-06-h100-decode-b64-splits's timeline.
# Token-major: one F.linear on gate_up viewed [E*2I, D], routing weights wmat [T, E] flat as they lie, the down bmm
# over a transposed view of h, and the sum over experts accumulated in fp32 from bf16. Timed
# (2026-12-06-h100-decode-optins): the batch-64 replay 7.19 -> 6.88 ms on an H100.
MOE_TOKEN_MAJOR = os.environ.get("DSV4_MOE_TOKEN_MAJOR", "1") == "1"
# The routing of an every-expert step on its side lane (`routes_beside`; DSV4_ROUTER_LANE=0: inline, before the
# experts' products, for comparisons). Not yet timed (2026-12-07).
ROUTER_BESIDE = os.environ.get("DSV4_ROUTER_LANE", "1") == "1"


class SharedExpert(nn.Module):
    """The always-on expert (same clamp as the routed ones)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self, x, "gate_proj", "up_proj")  # one product once merged (dsv4.models.layers.merged)
        return self.down_proj(swiglu(gate, up, self.limit, fp32=False))


class Router(nn.Module):
    """Top-k router (`e_score_correction_bias` steers selection only) or hash router (`tid2eid`)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, vocab_size: int, is_hash: bool,
                 scoring_func: str, routed_scaling_factor: float) -> None:
        super().__init__()
        self.is_hash, self.top_k = is_hash, top_k
        self.scoring_func, self.routed_scaling_factor = scoring_func, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k], expert ids [T, k]). Ties in selection go to the lowest expert id."""
        if self.is_hash:
            return route_v4(F.linear(x, self.weight), None, self.tid2eid, input_ids, self.scoring_func, self.top_k,
                            self.routed_scaling_factor)
        return route_v4(F.linear(x, self.weight), self.e_score_correction_bias, None, input_ids, self.scoring_func,
                        self.top_k, self.routed_scaling_factor)


class Experts(nn.Module):
    """Routed experts packed as gate_up_proj [E, 2I, D] (w1 rows first) and down_proj [E, D, I] (see
    `moe_output` for the computation)."""

    def __init__(self, n_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden, inter))
        self.limit = limit

    # the weights as `moe_output` takes them (dsv4.quant.layers.QuantExperts gives QuantWeights under these names)
    @property
    def gate_up(self) -> torch.Tensor:
        return self.gate_up_proj

    @property
    def down(self) -> torch.Tensor:
        return self.down_proj


class MoE(nn.Module):
    """routed(x) + shared(x)."""

    ep: ExpertShard | None = None  # expert parallelism: this rank's slice of the experts (dsv4.distributed)

    def __init__(self, hidden: int, inter: int, n_experts: int, top_k: int, vocab_size: int, is_hash: bool,
                 scoring_func: str, routed_scaling_factor: float, limit: float) -> None:
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, vocab_size, is_hash, scoring_func, routed_scaling_factor)
        self.experts = Experts(n_experts, hidden, inter, limit)
        self.shared_experts = SharedExpert(hidden, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, fixed: bool = False) -> torch.Tensor:
        """fixed: shapes fixed by the batch and no host sync (captured decode steps), see `moe_output`."""
        # a captured decode step's shared expert runs on a side stream beside the router and the routed products
        # (SIDE; inline off the GPU or with it switched off), joined just before the sum reads it
        with SIDE.fork(x) if fixed else contextlib.nullcontext():
            shared = self.shared_experts(x)
        e = self.experts
        beside = routes_beside(x, e.gate_up, self.gate.top_k, fixed, self.ep)
        with SIDE.fork(x, ROUTER_LANE) if beside else contextlib.nullcontext():
            weights, idx = self.gate(x, input_ids)
        return moe_output(x, weights, idx, e.gate_up, e.down, e.limit, weight_before_down=False,
                          fixed=fixed, shared=shared, ep=self.ep, join=(lambda: SIDE.join(x)) if fixed else None,
                          route_join=(lambda: SIDE.join(x, ROUTER_LANE)) if beside else None)


def every_expert(T: int, k: int, E: int, fixed: bool, quant: bool) -> bool:
    """Whether `moe_output` runs every expert on every token (a captured step with more routes than experts, the
    experts in the model dtype): its products then read no routing, only its weighted sum does."""
    return fixed and T * k > E and not quant


def routes_beside(x: torch.Tensor, gate_up: torch.Tensor | QuantWeight, top_k: int, fixed: bool,
                  ep: ExpertShard | None) -> bool:
    """Whether a MoE computes its routing on the router's side lane (ROUTER_LANE): where `moe_output` runs every
    expert (`every_expert`; not under expert parallelism, which remaps the routes first), the router's launches
    (~30 us at batch 32-64 on V4.1-Flash-8l, H100) need not hold up the experts' gate / up product."""
    return ROUTER_BESIDE and ep is None and every_expert(x.shape[0], top_k, gate_up.shape[0], fixed,
                                                          isinstance(gate_up, QuantWeight))


def moe_output(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor | QuantWeight,
               down: torch.Tensor | QuantWeight, limit: float, weight_before_down: bool, fixed: bool,
               shared: torch.Tensor, ep: ExpertShard | None = None, missing: bool = False,
               join: Callable[[], None] | None = None,
               route_join: Callable[[], None] | None = None) -> torch.Tensor:
    """The MoE layer's output [T, D] in x's dtype: the routed experts as per-(token, slot) rows, summed over the
    slots with the shared expert's output `shared` [T, D] (`combine_experts` gives the numerics).

    Prefill and mixed steps (not fixed) group the rows by expert (`expert_grouped`: one launch on CUDA), or from
    `dsv4.ops.moe_sorted.MIN_ROWS` rows in bf16, where switched on, sort them and run torch's grouped GEMM
    (`experts_sorted`; quantized experts dequantized for it).
    Captured decode steps (fixed) need shapes fixed by (tokens, top_k, experts) and no host sync: when
    tokens*top_k <= experts each (token, slot) row gathers its expert's weights (`expert_gemv`: reads at most what is
    hit); otherwise every expert runs on every token and the routing weights mask the sum (each expert's weights are
    read once: at that batch size nearly all of them are hit anyway).
    V4 weights the expert output after w2 (in the model dtype); V4.1 before w2, in fp32 (`weight_before_down`).
    Quantized experts (QuantWeight: MXFP4 or FP8 as stored) go through `dsv4.ops.moe_quant`: a captured step with
    more routes than experts groups its rows by expert (`expert_grouped_q` counts them without a host sync), so each
    hit expert's bytes are read once per block of rows, instead of the every-expert einsum (which would need the
    experts in the model dtype).
    With expert parallelism (`ep`), gate_up / down hold this rank's experts only: the routes to other ranks' experts
    weigh 0 and have id -1 (the matmuls skip them: a decode step reads only this rank's hit experts) and the partial
    outputs are summed over the ranks, with the shared expert's parts when it is split too
    (else the replicated shared expert is added after the sum); `missing` says that routes may be -1.
    `join`: called before the first read of `shared` (a shared expert computed on a side stream is joined there,
    after the routed products are enqueued, so that the two overlap). `route_join` (only where `every_expert`):
    called before the first read of `weights` / `idx`, after the experts' gate / up product is enqueued (a
    routing computed on a side stream, `routes_beside`).
    """
    join = join or _nothing
    assert route_join is None or (ep is None and every_expert(idx.shape[0], idx.shape[1], gate_up.shape[0], fixed,
                                                                isinstance(gate_up, QuantWeight)))
    route_join = route_join or _nothing
    if ep is not None:
        w, i = ep.local_routes(weights, idx)
        if ep.shared_split:  # `shared` is this rank's part of the shared expert: one all-reduce sums everything
            return ep.par.all_reduce_(moe_output(x, w, i, gate_up, down, limit, weight_before_down, fixed, shared,
                                                 missing=True, join=join))
        part = moe_output(x, w, i, gate_up, down, limit, weight_before_down, fixed, torch.zeros_like(shared),
                          missing=True)
        join()
        return ep.par.all_reduce_(part) + shared
    T, k = idx.shape
    E = gate_up.shape[0]
    inter = down.shape[2]
    quant = isinstance(gate_up, QuantWeight)
    if not fixed and moe_sorted.use_sorted_experts(x, gate_up, down, T * k):
        routed, at = moe_sorted.experts_sorted_rows(x, weights, idx, gate_up, down, limit, weight_before_down,
                                                    missing)
        join()
        return combine_experts(routed, None if weight_before_down else weights.flatten(), shared, k, at)
    if not every_expert(T, k, E, fixed, quant):
        flat = idx.flatten()
        matmul = _routed_matmul(x, flat, E, quant, per_row=fixed and T * k <= E)
        gu = matmul(x, gate_up, k)  # [T*k, 2I]
        g, u = gu[:, :inter], gu[:, inter:]
        if weight_before_down:
            routed = matmul(swiglu(g, u, limit, weights.flatten(), fp32=True), down, 1)
            join()
            return combine_experts(routed, None, shared, k)
        routed = matmul(swiglu(g, u, limit, fp32=False), down, 1)
        join()
        return combine_experts(routed, weights.flatten(), shared, k)
    if MOE_TOKEN_MAJOR:
        gu = F.linear(x, gate_up.reshape(E * 2 * inter, gate_up.shape[2])).view(T * E, 2 * inter)
        route_join()
        return _every_expert_token_major(x, gu, _route_matrix(weights, idx, E), down, limit, weight_before_down,
                                         shared, join)
    gu = torch.einsum("td,efd->etf", x, gate_up).reshape(E * T, 2 * inter)  # expert-major rows
    route_join()
    wmat = _route_matrix(weights, idx, E)
    g, u = gu[:, :inter], gu[:, inter:]
    if weight_before_down:
        h = swiglu(g, u, limit, wmat.t().reshape(E * T), fp32=True).view(E, T, inter)
        # batched over experts, then summed: an einsum contracting (e, i) at once would copy all of `down`
        routed = torch.bmm(h, down.transpose(1, 2)).float().sum(dim=0)
        join()
        return (routed + shared.float()).to(x.dtype)
    y = torch.einsum("eti,edi->etd", swiglu(g, u, limit, fp32=False).view(E, T, inter), down)
    routed = (y.float() * wmat.t()[:, :, None]).sum(dim=0).to(x.dtype)
    join()
    return routed + shared


def _route_matrix(weights: torch.Tensor, idx: torch.Tensor, E: int) -> torch.Tensor:
    """The routing weights as a dense [T, E] fp32 matrix (0 for experts a token does not route to)."""
    # (other ranks' routes, id -1, weigh 0: clamped onto expert 0 they add nothing, hence add, not set)
    return torch.zeros(idx.shape[0], E, dtype=torch.float32, device=idx.device).scatter_add_(
        1, idx.clamp(min=0), weights.float())


def _every_expert_token_major(x: torch.Tensor, gu: torch.Tensor, wmat: torch.Tensor, down: torch.Tensor,
                              limit: float, weight_before_down: bool, shared: torch.Tensor,
                              join: Callable[[], None]) -> torch.Tensor:
    """`moe_output`'s every-expert branch with rows in (token, expert) order (MOE_TOKEN_MAJOR), from the gate / up
    product gu [T * E, 2I] (one F.linear on gate_up viewed [E * 2I, D]): the same products and the same fp32
    weighting and sum, without the expert-major copies."""
    T, E, inter = x.shape[0], wmat.shape[1], down.shape[2]
    g, u = gu[:, :inter], gu[:, inter:]
    h = swiglu(g, u, limit, wmat.reshape(T * E), fp32=True) if weight_before_down else swiglu(g, u, limit, fp32=False)
    y = torch.bmm(h.view(T, E, inter).transpose(0, 1), down.transpose(1, 2))  # [E, T, D]
    if weight_before_down:
        routed = y.sum(dim=0, dtype=torch.float32)
        join()
        return torch.add(routed, shared).to(x.dtype)
    routed = (y.float() * wmat.t()[:, :, None]).sum(dim=0).to(x.dtype)
    join()
    return routed + shared


def _nothing() -> None:
    """moe_output's `join` when the shared expert's output is ready where it stands."""


def _routed_matmul(x: torch.Tensor, flat: torch.Tensor, E: int, quant: bool,
                   per_row: bool) -> Callable[[torch.Tensor, torch.Tensor | QuantWeight, int], torch.Tensor]:
    """(a, w, x_div) -> the routed rows' product for routes `flat`: per row (`expert_gemv*`) or grouped by expert
    (`expert_grouped*`). Grouped, both of the layer's matmuls share one row plan (same routes, same block size):
    built once here on CUDA, where the Triton kernels read it (the torch references need none)."""
    if per_row:
        gemv = expert_gemv_q if quant else expert_gemv
        return lambda a, w, x_div: gemv(a, w, flat, x_div)
    grouped = expert_grouped_q if quant else expert_grouped
    block_m = grouped_q_block_m(flat.numel(), E, x.dtype) if quant else GROUPED_BLOCK_M
    plan = group_rows(flat, E, block_m) if x.is_cuda else None
    return lambda a, w, x_div: grouped(a, w, flat, x_div, plan)
