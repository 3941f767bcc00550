"""fp32 math on a stored narrower weight (dsv4/ops/fp32_linear.py) on CUDA, at DeepSeek-V4.1-Flash's shapes (the
router [384, 5120] and the ratio-2 compressor's kv / gate [512, 5120]) and the 8-layer preset's router [16, 5120]:
within the reordering of fp32 sums of the reference's exact products, eagerly and under CUDA-graph replay; the
dispatch takes the kernel up to DECODE_ROWS rows and, beyond, the fp32-output tensor-core GEMM for 16-bit operands
and the torch expression for fp32 ones."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import fp32_linear as fl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("N,K", [(384, 5120), (512, 5120), (16, 5120), (4096, 4096)])
@pytest.mark.parametrize("rows", [1, 4, 32, 64, 65, 1000])
def test_fp32_linear_at_released_shapes(N: int, K: int, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(N + rows)
    x = torch.randn(rows, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().t()  # the exact sum of the exact products
    s = x.double().abs() @ w.double().abs().t()
    for got in (fl.fp32_linear_triton(x, w), fl.fp32_linear_triton(x, w, "narrow"), fl.fp32_linear(x, w),
                fl.fp32_linear_torch(x, w), fl.fp32_linear_mm(x, w)):
        assert got.dtype == torch.float32
        # fp32 accumulation of K exact products: within K * 2^-24 * S of the exact sum (cuBLAS may reduce split-K
        # partials in another order, as may the kernel: the same bound for both)
        assert ((got.double() - ref).abs() <= K * 2.0 ** -24 * s + 1e-30).all()


def test_fp32_linear_graph_replay() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 5120, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(384, 5120, device="cuda", generator=g).to(torch.bfloat16)
    fl.fp32_linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fl.fp32_linear(x, w)
    x.copy_(torch.randn(2, 5120, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fl.fp32_linear_triton(x, w))


def test_dispatch_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # the default (DSV4_FP32_LINEAR_MM_ROWS unset): 16-bit operands take the GEMM from 8 rows; first the kernel up to
    # DECODE_ROWS (DSV4_FP32_LINEAR_MM_ROWS=65), the rule before that default
    assert fl.MM_FROM_ROWS == 8 and fl.path(8, True, True) == "mm" and fl.path(7, True, True) == "triton"
    monkeypatch.setattr(fl, "MM_FROM_ROWS", fl.DECODE_ROWS + 1)
    calls = []
    for name in ("fp32_linear_triton", "fp32_linear_mm", "fp32_linear_torch"):
        monkeypatch.setattr(fl, name, lambda x, w, f=getattr(fl, name), name=name: calls.append((name, x.shape[0])) or
                            f(x, w))
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(16, 64, device="cuda").to(dtype)
        for rows in (1, fl.DECODE_ROWS, fl.DECODE_ROWS + 1):
            fl.fp32_linear(torch.randn(rows, 64, device="cuda").to(dtype), w)
    big = fl.DECODE_ROWS + 1
    assert calls == [("fp32_linear_triton", 1), ("fp32_linear_triton", fl.DECODE_ROWS), ("fp32_linear_torch", big),
                     ("fp32_linear_triton", 1), ("fp32_linear_triton", fl.DECODE_ROWS), ("fp32_linear_mm", big)]
    # mixed dtypes (a bf16 activation on an fp32 weight) keep the torch expression
    calls.clear()
    fl.fp32_linear(torch.randn(big, 64, device="cuda").bfloat16(), torch.randn(16, 64, device="cuda"))
    assert calls == [("fp32_linear_torch", big)]
    # DSV4_FP32_LINEAR_MM_ROWS=8: the GEMM from 8 rows for 16-bit operands, the kernel below and for fp32 ones
    calls.clear()
    monkeypatch.setattr(fl, "MM_FROM_ROWS", 8)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(16, 64, device="cuda").to(dtype)
        for rows in (7, 8, fl.DECODE_ROWS):
            fl.fp32_linear(torch.randn(rows, 64, device="cuda").to(dtype), w)
    assert calls == [("fp32_linear_triton", 7), ("fp32_linear_mm", 8), ("fp32_linear_mm", fl.DECODE_ROWS),
                     ("fp32_linear_triton", 7), ("fp32_linear_triton", 8), ("fp32_linear_triton", fl.DECODE_ROWS)]
    monkeypatch.setattr(fl, "MM_FROM_ROWS", fl.DECODE_ROWS + 1)
    # DSV4_FP32_LINEAR_MM=0 (MM_PREFILL off, for comparisons): the fp32 expression at prefill sizes
    calls.clear()
    monkeypatch.setattr(fl, "MM_PREFILL", False)
    fl.fp32_linear(torch.randn(big, 64, device="cuda").bfloat16(), torch.randn(16, 64, device="cuda").bfloat16())
    assert calls == [("fp32_linear_torch", big)]
