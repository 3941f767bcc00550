"""The fused RMSNorm kernel (dsv4/ops/rmsnorm.py) against the torch references on the GPU at real shapes, the
module-level dispatch, and CUDA graph capture. Grid inputs (multiples of 1/8: an fp32 sum of squares exact in any
order) must match bit for bit; Gaussian inputs within the docstring's ulp bound (the summation order differs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import dsv4.models.deepseek_v41 as v41_mod
import dsv4.models.layers.norm as norm_mod
from dsv4.models.deepseek_v41 import RMSNormV41
from dsv4.models.layers.norm import RMSNorm, unweighted_rms_norm, unweighted_rms_norm_torch
from dsv4.ops.rmsnorm import rms_norm_triton, rms_norm_v41_triton, unweighted_rms_norm_triton
from rmsnorm_checks import check_close, grid, pairs, ulps

@pytest.mark.parametrize("rows", [1, 32, 4096])
@pytest.mark.parametrize("D", [512, 1280, 4096, 5120, 7168])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_vs_torch_cuda(dtype: torch.dtype, D: int, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(D + rows)
    w = torch.randn(D, device="cuda", generator=g)
    for eps in (1e-6, 1e-20):
        for name, ref, got in pairs(grid((rows, D), g).to(dtype), w, eps):
            assert ref.dtype == got.dtype and torch.equal(ref, got), (name, eps, int(ulps(ref, got).max()))
        x = (torch.randn(rows, D, device="cuda", generator=g) * 3).to(dtype)
        for name, ref, got in pairs(x, w, eps):
            check_close(name, dtype, ref, got, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_and_wide_rows(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    big = grid((32, 64, 640), g).to(dtype)
    w = torch.randn(512, device="cuda", generator=g)
    # q.view(T, H, D)-like rows of one stride; rows of two strides; mHC's flattened streams (4 x 7168, fp32)
    for x in (big[..., :512], big[:, 3:40, 64:576]):
        for name, ref, got in pairs(x, w, 1e-6):
            assert got.shape == x.shape and torch.equal(ref, got), (name, x.stride())
    h = grid((64, 4 * 7168), g)
    assert torch.equal(unweighted_rms_norm_torch(h, 1e-6), unweighted_rms_norm_triton(h, 1e-6))


def test_module_dispatch_matches_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: object, **kwargs: object) -> torch.Tensor:  # records that the kernel path is taken
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(norm_mod, "rms_norm_triton", counted("weighted", rms_norm_triton))
    monkeypatch.setattr(norm_mod, "unweighted_rms_norm_triton", counted("unweighted", unweighted_rms_norm_triton))
    monkeypatch.setattr(v41_mod, "rms_norm_v41_triton", counted("v41", rms_norm_v41_triton))
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(32, 4096, generator=g) * 3).to(dtype)
        m, m41 = RMSNorm(4096, 1e-6), RMSNormV41(4096, 1e-6).to(dtype)
        with torch.no_grad():
            m.weight.normal_(generator=g)
            m41.weight.copy_(torch.randn(4096, generator=g))
            # CPU and CUDA torch differ in the mean's last step and rsqrt as well as the summation order: the
            # same bound as the kernel-vs-CUDA-torch check covers it
            for name, cpu, gpu in (("weighted", m(x), m.cuda()(x.cuda())),
                                   ("unweighted", unweighted_rms_norm(x, 1e-6), unweighted_rms_norm(x.cuda(), 1e-6)),
                                   ("v41", m41(x), m41.cuda()(x.cuda()))):
                assert gpu.is_cuda
                check_close(name, dtype, cpu, gpu.cpu(), 0)  # 0: rsqrt differs too, not only in a few rows
    assert sorted(set(calls)) == ["unweighted", "v41", "weighted"] and len(calls) == 6


def test_cuda_graph_capture() -> None:
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(8, 64, 512, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(512, device="cuda", generator=g)
    for fn in (rms_norm_triton, rms_norm_v41_triton):  # compile outside the capture
        fn(x, w, 1e-6)
    unweighted_rms_norm_triton(x, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails if a kernel wrapper syncs the host
        outs = [rms_norm_triton(x, w, 1e-6), unweighted_rms_norm_triton(x, 1e-6), rms_norm_v41_triton(x, w, 1e-6)]
    x.copy_(torch.randn(8, 64, 512, device="cuda", generator=g))
    graph.replay()
    eager = [rms_norm_triton(x, w, 1e-6), unweighted_rms_norm_triton(x, 1e-6), rms_norm_v41_triton(x, w, 1e-6)]
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)
