"""The packed varlen attention kernel at the released ViT shapes (16 heads, head_dim 64, up to 9 * 2048 rows) against
per-image attention in fp32, eager and under CUDA graph capture (the vision encoder's graphs replay it with new
boundaries written into the same cu_seqlens buffer); the same for FlashAttention's varlen forward, the graphs'
other backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dsv4.models.vision import per_image_attention, varlen_attention
from dsv4.ops import varlen_attention as varlen_ops
from dsv4.ops.varlen_attention import (
    flash_supported,
    varlen_attention_flash,
    varlen_attention_triton,
)

H, D = 16, 64

# (cu_seqlens, rows); in the graph layout the unused slots repeat the real rows' end and the rows past it are padding
CASES = [
    ([0, 4070, 4071, 6071, 6071], 18432),  # 4070, 1, 2000, then 12361 rows of padding (skipped, 0)
    ([0] + [2048 * i for i in range(1, 10)], 18432),  # nine full 2048-row images
    ([0, 1, 2, 3, 100, 1000, 1000, 5000], 5000),  # tiny and empty sequences
    ([0, 3000, 3001], 4500),  # 1499 rows of padding
]


def _inputs(rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # chunks of one fused [rows, 3 * H * D] projection, as the ViT's wqkv gives them: v stays a strided view (row
    # stride 3 * H * D); q and k become contiguous copies, scaled up for a sharper softmax
    qkv = torch.randn(rows, 3 * H * D, device="cuda", generator=g).to(dtype)
    q, k, v = (t.reshape(rows, H, D) for t in qkv.chunk(3, dim=-1))
    return q * 2, k * 2, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], rows: int) -> torch.Tensor:
    return per_image_attention(q.float(), k.float(), v.float(), cu)  # padding rows past cu[-1]: 0


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_varlen_attention_matches_per_image(case: int, dtype: torch.dtype, tol: float) -> None:
    cu, rows = CASES[case]
    q, k, v = _inputs(rows, dtype, case)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    got = varlen_attention_triton(q, k, v, cu_dev)
    ref = _reference(q, k, v, cu, rows)
    assert got.dtype == dtype and got.shape == (rows, H, D)
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    # the dispatcher takes the kernel for device cu_seqlens on CUDA: the same numbers
    assert torch.equal(varlen_attention(q, k, v, cu_dev), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flash_varlen_matches_per_image(case: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashAttention's varlen forward (DSV4_ENCODER_GRAPH_ATTENTION=flash): the same attention, padding rows 0 (the
    op leaves them unwritten), and the dispatcher takes the op when switched on; fp32 has no FlashAttention kernel,
    so the dispatcher keeps the Triton kernel there."""
    cu, rows = CASES[case]
    q, k, v = _inputs(rows, dtype, 10 + case)
    assert flash_supported(q)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    got = varlen_attention_flash(q, k, v, cu_dev)
    assert got.dtype == dtype and got.shape == (rows, H, D)
    torch.testing.assert_close(got.float(), _reference(q, k, v, cu, rows), rtol=2e-2, atol=2e-2)
    assert not got[cu[-1]:].any()
    monkeypatch.setattr(varlen_ops, "GRAPH_ATTENTION", "flash")
    assert torch.equal(varlen_attention(q, k, v, cu_dev), got)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert torch.equal(varlen_attention(q32, k32, v32, cu_dev), varlen_attention_triton(q32, k32, v32, cu_dev))


@pytest.mark.parametrize("kernel", [varlen_attention_triton, varlen_attention_flash], ids=["triton", "flash"])
def test_varlen_attention_in_cuda_graph(kernel: Callable[..., torch.Tensor]) -> None:
    rows = 18432
    first, second = [0, 4070, 4071, 6071, 6071], [0, 2048, 9000, 9001, rows]  # same slots, new boundaries
    q, k, v = (t.contiguous() for t in _inputs(rows, torch.bfloat16, 7))
    cu = torch.tensor(first, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture: triton compiles on the first launch
        kernel(q, k, v, cu)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, k, v, cu)
    for bounds, seed in ((first, 8), (second, 9)):
        nq, nk, nv = _inputs(rows, torch.bfloat16, seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), _reference(q, k, v, bounds, rows), rtol=2e-2, atol=2e-2)
