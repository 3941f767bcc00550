"""The quantized-expert kernels (dsv4/ops/moe_quant.py) at the released shapes on the GPU: V4-Flash gate_up
[4096, 4096] and down [4096, 2048], V4.1-Flash gate_up [4608, 5120] and down [5120, 2304] (16 experts instead of
256/384), MXFP4 and FP8 (128 x 128 UE8M0 blocks), bf16 activations, against the torch reference in fp32 (cuBLAS
without TF32). The decode kernel (a program per row) with and without its inline-PTX decoder;
bit-exact on a grid where every sum is exact; CUDA-graph replay equal to eager; rows with no expert zero. Builders and
bound: tests/test_moe_quant.py."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4.ops import moe_quant
from dsv4.ops.moe_quant import expert_gemv_q_triton, expert_grouped_q_torch, expert_grouped_q_triton
from dsv4.quant.weight import QuantWeight
from test_moe_quant import assert_close, fp8_weight, mxfp4_weight

SHAPES = {"v4-gate_up": (4096, 4096), "v4-down": (4096, 2048), "v41-gate_up": (4608, 5120), "v41-down": (5120, 2304)}
E, TOP_K = 16, 6
# the decode kernel (a program per row)
GEMVS = {"per-row": expert_gemv_q_triton}


@functools.lru_cache(maxsize=4)
def _weights(fmt: str, N: int, K: int, coarse: bool = False) -> QuantWeight:
    g = torch.Generator(device="cuda").manual_seed(N * 7 + K + coarse)
    if fmt == "mxfp4":
        return mxfp4_weight(E, N, K, g, scales=(125, 129) if coarse else (112, 124), extreme=not coarse,
                            device="cuda")
    return fp8_weight(E, N, K, (128, 128), True, g, coarse=coarse, device="cuda")


def _routes(T: int, g: torch.Generator, holes: bool = True) -> torch.Tensor:
    """Distinct experts per token (top-6 of 16), flattened to T * 6 rows; with `holes` every 5th row has none."""
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :TOP_K].reshape(-1)
    if holes:
        idx[2::5] = -1
    return idx


def _inputs(shape: str, R: int, g: torch.Generator, coarse: bool = False) -> tuple[torch.Tensor, int]:
    """x for R rows: the gate_up projections read one x row per token (x_div = 6), the down projections one per row
    (x_div = 1; a single row for R = 1)."""
    K = SHAPES[shape][1]
    x_div = TOP_K if shape.endswith("gate_up") and R % TOP_K == 0 else 1
    if coarse:  # multiples of 1/4 up to 1: with the coarse weights every fp32 sum is exact
        x = torch.randint(-4, 5, (R // x_div, K), generator=g, device="cuda").float().div(4)
    else:
        x = torch.randn(R // x_div, K, generator=g, device="cuda")
    return x.to(torch.bfloat16), x_div


@pytest.fixture(params=[True, False], ids=["ptx", "triton-ops"])
def ptx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(moe_quant, "PTX_DECODE", request.param)
    return request.param


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("R", [1, 6, 48, 192])
@pytest.mark.parametrize("kernel", list(GEMVS))
def test_gemv(fmt: str, shape: str, R: int, kernel: str, ptx: bool) -> None:
    """Random weights (UE8M0 scales 2^-15..2^-3, MXFP4 also 2^-27 and 2^23), rows spread over the 16 experts,
    some with none; within the fp32 summation bound plus the output's bf16 rounding."""
    w = _weights(fmt, *SHAPES[shape])
    g = torch.Generator(device="cuda").manual_seed(R)
    x, x_div = _inputs(shape, R, g)
    idx = torch.randint(0, E, (R,), generator=g, device="cuda")
    if R > 1:
        idx[1::4] = -1
    got = GEMVS[kernel](x, w, idx, x_div)
    assert got.dtype == torch.bfloat16 and got.shape == (R, w.shape[1])
    assert_close(got, expert_grouped_q_torch(x.float(), w, idx, x_div), x, w, idx, x_div)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("shape", ["v4-gate_up", "v41-gate_up", "v41-down"])
@pytest.mark.parametrize("kernel", list(GEMVS))
def test_gemv_exact_on_a_coarse_grid(fmt: str, shape: str, kernel: str, ptx: bool) -> None:
    """Every fp32 sum exact in any order (coarse weights and x, see tests/test_moe_quant.py): the output is the
    exact product rounded once to bf16, bit for bit -- every decoded value and column is right."""
    w = _weights(fmt, *SHAPES[shape], coarse=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    x, x_div = _inputs(shape, 48, g, coarse=True)
    idx = torch.randint(0, E, (48,), generator=g, device="cuda")
    idx[3::7] = -1
    ref = expert_grouped_q_torch(x.float(), w, idx, x_div)
    assert torch.equal(GEMVS[kernel](x, w, idx, x_div), ref.to(torch.bfloat16))
    assert torch.equal(GEMVS[kernel](x.float(), w, idx, x_div), ref)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("kernel", list(GEMVS))
def test_gemv_cuda_graph_replay(fmt: str, kernel: str) -> None:
    """Captured once, replayed on new x and routes (written into the captured tensors): equal to eager."""
    gemv = GEMVS[kernel]
    w = _weights(fmt, *SHAPES["v41-gate_up"])
    g = torch.Generator(device="cuda").manual_seed(3)
    x, _ = _inputs("v41-gate_up", 48, g)
    idx = _routes(8, g)
    gemv(x, w, idx, TOP_K)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, idx, TOP_K)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        idx.copy_(_routes(8, g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv(x, w, idx, TOP_K))
        assert out[idx < 0].eq(0).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [64, 512, 2048])
def test_grouped(fmt: str, shape: str, T: int) -> None:
    """Prefill: T tokens x top-6 distinct experts, every 5th route to another rank (-1). bf16 on tensor cores:
    their accumulation is not IEEE (each MMA step aligns to its largest term and truncates, about an fp32 ulp of
    the running sum per 16 products: the bound of tests/gpu/test_kernels_gpu.py, (K/16 + 1) 2^-23 S) plus the
    reference's K 2^-24 S and the output's rounding."""
    N, K = SHAPES[shape]
    w = _weights(fmt, N, K)
    g = torch.Generator(device="cuda").manual_seed(T)
    idx = _routes(T, g)
    x, x_div = _inputs(shape, T * TOP_K, g)
    got = expert_grouped_q_triton(x, w, idx, x_div)
    assert got.dtype == torch.bfloat16 and got.shape == (T * TOP_K, N)
    ref = expert_grouped_q_torch(x.float(), w, idx, x_div)
    assert_close(got, ref, x, w, idx, x_div, gamma=K * 2.0 ** -24 + (K / 16 + 1) * 2.0 ** -23)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_grouped_fp32_exact_on_a_coarse_grid(fmt: str) -> None:
    """fp32 x (IEEE products and sums, no TF32) on the coarse grid: bit for bit."""
    w = _weights(fmt, *SHAPES["v41-gate_up"], coarse=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    idx = _routes(512, g)
    x, x_div = _inputs("v41-gate_up", 512 * TOP_K, g, coarse=True)
    x = x.float()
    assert torch.equal(expert_grouped_q_triton(x, w, idx, x_div), expert_grouped_q_torch(x, w, idx, x_div))


@pytest.mark.parametrize("weight_before_down", [False, True], ids=["v4", "v41"])
@pytest.mark.parametrize("T", [8, 32])
def test_moe_layer_builds_one_plan(weight_before_down: bool, T: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured decode step's MoE layer (more routes than experts: the grouped kernel) builds its row plan once
    for both matmuls, and its output equals the same layer with each matmul building its own plan (the same plan:
    the outputs are bit-identical)."""
    from dsv4.models.layers import moe as moe_layer
    gate_up, down = _weights("mxfp4", *SHAPES["v4-gate_up"]), _weights("mxfp4", *SHAPES["v4-down"])
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, SHAPES["v4-gate_up"][1], generator=g, device="cuda").to(torch.bfloat16)
    idx = _routes(T, g, holes=False).view(T, TOP_K)
    weights = torch.rand(T, TOP_K, generator=g, device="cuda")
    shared = torch.randn(T, SHAPES["v4-down"][0], generator=g, device="cuda").to(torch.bfloat16)
    calls = []
    real = moe_layer.group_rows
    monkeypatch.setattr(moe_layer, "group_rows", lambda *a: calls.append(a) or real(*a))
    args = (x, weights, idx, gate_up, down, 10.0, weight_before_down, True, shared)
    once = moe_layer.moe_output(*args)
    assert len(calls) == 1
    monkeypatch.setattr(moe_layer, "group_rows", lambda *a: None)  # each matmul then makes its own
    assert torch.equal(once, moe_layer.moe_output(*args))
