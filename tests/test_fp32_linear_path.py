"""Which implementation dsv4.ops.fp32_linear takes (`path`): the Triton kernel on CUDA up to DECODE_ROWS rows, the
fp32-output tensor-core GEMM beyond for 16-bit operands of one dtype (and from MM_FROM_ROWS rows when that is set
lower, DSV4_FP32_LINEAR_MM_ROWS), the torch expression off CUDA or for fp32 operands past the kernel's rows. The
implementations' numerics are tested on the GPU (tests/gpu/test_fp32_linear_gpu.py) and under TRITON_INTERPRET."""

from __future__ import annotations

import pytest

from dsv4.ops import fp32_linear as fl


@pytest.fixture(autouse=True)
def with_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fl, "MM_PREFILL", True)  # (torch builds without mm's dtype overload turn it off)
    monkeypatch.setattr(fl, "triton", object())  # as where triton is installed


def test_default_rule() -> None:
    assert fl.MM_FROM_ROWS == 8  # timed default: 8+ 16-bit rows take the GEMM (results/2026-12-06-h100-decode-optins)
    D = fl.DECODE_ROWS
    assert [fl.path(r, True, True) for r in (0, 1, 7, 8, D, D + 1, 10_000)] == ["triton"] * 3 + ["mm"] * 4
    assert [fl.path(r, True, False) for r in (1, D, D + 1)] == ["triton", "triton", "torch"]
    assert {fl.path(r, False, h) for r in (1, D + 1) for h in (False, True)} == {"torch"}


def test_mm_from_fewer_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fl, "MM_FROM_ROWS", fl.DECODE_ROWS + 1)  # DSV4_FP32_LINEAR_MM_ROWS=65: the kernel to 64 rows
    assert [fl.path(r, True, True) for r in (1, 8, 64, 65)] == ["triton", "triton", "triton", "mm"]
    monkeypatch.setattr(fl, "MM_FROM_ROWS", 8)
    assert [fl.path(r, True, True) for r in (1, 7, 8, 64, 65)] == ["triton", "triton", "mm", "mm", "mm"]
    assert [fl.path(r, True, False) for r in (7, 8, 64, 65)] == ["triton", "triton", "triton", "torch"]
    monkeypatch.setattr(fl, "MM_PREFILL", False)  # DSV4_FP32_LINEAR_MM=0: never the GEMM
    assert [fl.path(r, True, True) for r in (8, 64, 65)] == ["triton", "triton", "torch"]


def test_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fl, "triton", None)
    assert [fl.path(r, True, True) for r in (1, 65)] == ["mm", "mm"]
    assert [fl.path(r, True, False) for r in (1, 65)] == ["torch", "torch"]
