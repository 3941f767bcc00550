"""The MoE output (routed experts plus the shared expert's output) against a per-token, per-slot loop in fp64: the
grouped path of prefill and mixed steps and both fixed-shape branches of captured decode steps (per-slot GEMV when
tokens*top_k <= experts, all experts otherwise), in both weighting orders (V4, V4.1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.distributed import ExpertShard, Parallel
from dsv4.models.layers import moe as moe_layer
from dsv4.models.layers.moe import moe_output
from dsv4.ops.swiglu import clamped_swiglu


def _reference(x, weights, idx, gate_up, down, limit, before):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e, w = int(idx[t, j]), float(weights[t, j])
            g, u = F.linear(x[t].double(), gate_up[e].double()).chunk(2)
            h = clamped_swiglu(g, u, limit)
            out[t] += F.linear(h * w, down[e].double()) if before else F.linear(h, down[e].double()) * w
    return out


def _layer(seed: int, T: int, k: int, E: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of one MoE layer: x [T, D], gate_up, down, distinct routes idx [T, k], weights, shared."""
    g = torch.Generator().manual_seed(seed)
    D, inter = 24, 10
    x = torch.randn(T, D, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, D, generator=g), torch.randn(E, D, inter, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, gate_up, down, idx, torch.rand(T, k, generator=g), torch.randn(T, D, generator=g)


@pytest.fixture(params=[False, True], ids=["expert-major", "token-major"])
def row_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both row orders of the every-expert branch (DSV4_MOE_TOKEN_MAJOR); the other branches ignore it."""
    monkeypatch.setattr(moe_layer, "MOE_TOKEN_MAJOR", request.param)
    return request.param


@pytest.mark.parametrize("T,k,E", [(1, 2, 8), (3, 2, 8), (8, 3, 6), (5, 6, 16), (40, 2, 3)])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("fixed", [False, True])
def test_moe_output_matches_a_loop(T: int, k: int, E: int, before: bool, fixed: bool, row_order: bool) -> None:
    x, gate_up, down, idx, weights, shared = _layer(T * 100 + k * 10 + E, T, k, E)
    got = moe_output(x, weights, idx, gate_up, down, 1.5, weight_before_down=before, fixed=fixed, shared=shared)
    assert got.dtype == torch.float32 and got.shape == x.shape
    ref = _reference(x, weights, idx, gate_up, down, 1.5, before) + shared.double()
    assert torch.allclose(got.double(), ref, atol=1e-4)


@pytest.mark.parametrize("T,k,E,world", [(1, 6, 16, 2), (3, 2, 8, 4), (5, 6, 16, 2), (40, 2, 4, 2)])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("fixed", [False, True])
def test_expert_parallel_parts_sum_to_the_whole(T: int, k: int, E: int, world: int, before: bool,
                                                 fixed: bool, row_order: bool) -> None:
    """Expert parallelism in one process: each rank's part (its slice of the experts, the other ranks' routes
    skipped as id -1, its share of the shared expert's output), summed over the ranks as the all-reduce would, is
    the whole layer's output; all three paths (grouped, per-slot GEMV, all experts)."""
    x, gate_up, down, idx, weights, shared = _layer(T * 100 + k * 10 + E + world, T, k, E)
    D = x.shape[1]
    total = torch.zeros(T, D, dtype=torch.float64)
    n = E // world
    for rank in range(world):
        ep = ExpertShard(rank * n, n, Parallel(), shared_split=True)  # Parallel(): the sum is done here
        w, i = ep.local_routes(weights, idx)
        assert (i == -1).eq(w == 0).all() and i.max() < n
        part = moe_output(x, weights, idx, gate_up[rank * n:(rank + 1) * n], down[rank * n:(rank + 1) * n], 1.5,
                          weight_before_down=before, fixed=fixed, shared=shared / world, ep=ep)
        total += part.double()
    ref = _reference(x, weights, idx, gate_up, down, 1.5, before) + shared.double()
    assert torch.allclose(total, ref, atol=1e-4), (total - ref).abs().max()


class _Ops(TorchDispatchMode):
    """The aten ops dispatched while active, with their output sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, out.numel() if isinstance(out, torch.Tensor) else 0))
        return out


@pytest.mark.parametrize("before", [False, True])
def test_token_major_rows_copy_nothing_per_expert(before: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token-major every-expert branch in bf16: the expert-major branch's outputs up to the fp32 sum's order, and
    fewer copies the size of all experts' gate_up or down outputs: none in V4.1's order (the expert-major branch
    makes two: the permuted gate_up output and the fp32 cast of the down output), in V4's order only the fp32 cast
    that its weighting after w2 needs. (Copies the size of h are the CPU swiglu reference's own fp32 casts.)"""
    T, k, E = 64, 6, 16
    x, gate_up, down, idx, weights, shared = (t.bfloat16() if t.is_floating_point() else t for t in _layer(7, T, k, E))
    weights = weights.float()
    outs, copies = {}, {}
    for token_major in (False, True):
        monkeypatch.setattr(moe_layer, "MOE_TOKEN_MAJOR", token_major)
        with _Ops() as ops:
            outs[token_major] = moe_output(x, weights, idx, gate_up, down, 1.5, weight_before_down=before,
                                           fixed=True, shared=shared)
        inter = down.shape[2]
        copies[token_major] = [n for name, n in ops.ops if name in ("clone", "_to_copy", "contiguous", "copy_")
                               and n > E * T * inter]
    assert len(copies[False]) == 2 and copies[True] == ([] if before else [E * T * x.shape[1]]), copies
    ref = _reference(x.float(), weights, idx, gate_up.float(), down.float(), 1.5, before) + shared.double()
    for token_major, got in outs.items():
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), ref, atol=0.05 * ref.abs().max().item()), token_major
    assert torch.allclose(outs[True].float(), outs[False].float(), atol=2e-2 * outs[False].abs().max().item())


@pytest.mark.parametrize("T,k,E,world", [(1, 2, 8, 1), (8, 3, 6, 1), (40, 2, 3, 1), (3, 2, 8, 2), (40, 2, 4, 2)])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_join_comes_before_the_shared_output_is_read(T: int, k: int, E: int, world: int, before: bool, split: bool,
                                                     row_order: bool) -> None:
    """`join` (a side stream's shared expert joined, dsv4/models/layers/side_stream.py) runs once, after the routed
    products and before anything reads `shared`: here `shared` holds NaN until join fills it, so a read before the
    join poisons the output. Every fixed branch (per-slot GEMV, every expert in both row orders), with and without
    expert parallelism (shared split or added after the sum)."""
    x, gate_up, down, idx, weights, shared = _layer(T * 100 + k * 10 + E + world, T, k, E)
    D, n = x.shape[1], E // world
    total = torch.zeros(T, D, dtype=torch.float64)
    for rank in range(world):
        ep = None if world == 1 else ExpertShard(rank * n, n, Parallel(), shared_split=split)
        part_shared = shared / world if ep is not None and split else shared
        pending = torch.full_like(shared, float("nan"))
        calls = []

        def join(dst: torch.Tensor = pending, src: torch.Tensor = part_shared, calls: list = calls) -> None:
            calls.append(1)
            dst.copy_(src)
        part = moe_output(x, weights, idx, gate_up[rank * n:(rank + 1) * n], down[rank * n:(rank + 1) * n], 1.5,
                          weight_before_down=before, fixed=True, shared=pending, ep=ep, join=join)
        assert len(calls) == 1
        # without a split, each rank adds the whole shared output after its sum: count it once
        total += part.double() - (shared.double() if ep is not None and not split and rank > 0 else 0)
    ref = _reference(x, weights, idx, gate_up, down, 1.5, before) + shared.double()
    assert torch.allclose(total, ref, atol=1e-4), (total - ref).abs().max()
