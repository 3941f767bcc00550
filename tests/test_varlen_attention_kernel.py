"""The packed varlen attention kernel (dsv4/ops/varlen_attention.py) against per-image attention in fp64, on small
random inputs under TRITON_INTERPRET=1 (the CPU interpreter; each check runs in a subprocess because the flag is read
when kernels are defined). Blocks of 16 rows / keys, so that short inputs still straddle blocks and boundaries."""

from __future__ import annotations

import pytest
import torch
from test_kernels_interpret import _interpret, _tiers

from dsv4.ops.varlen_attention import row_sequence_ids

# (cu_seqlens, rows): the rows past cu_seqlens[-1] are padding (attend to nothing, come out 0)
CASES = [
    ([0, 37], 37),  # one sequence, not a multiple of the block
    ([0, 1, 2, 19, 20, 53, 53, 70], 70),  # many short ones, lengths 1, an empty one, boundaries inside blocks
    ([0, 16, 48, 64, 64], 64),  # block-aligned boundaries, unused slots repeating the end (the graph layout, full)
    ([0, 23, 23], 23),  # a full buffer
    ([0, 20, 33, 33], 45),  # the graph layout with padding: rows 33..44, a block straddling real and padding rows
    ([0, 5, 16], 48),  # padding from a block boundary on: whole blocks of padding rows
    ([0], 9),  # no sequence at all: every row is padding
    ([0, 40], 48),  # padding rows in a block whose key tiles every real row sees whole (no mask): still 0
    ([0, 3, 70, 71], 90),  # a long sequence's blocks walk unmasked tiles; blocks straddle short ones at both ends
]


def test_row_sequence_ids() -> None:
    cu = torch.tensor([0, 1, 2, 19, 20, 53, 53, 70], dtype=torch.int32)
    ids = row_sequence_ids(cu, 75)
    assert ids.dtype == torch.int32
    assert ids[:3].tolist() == [0, 1, 2] and ids[18].item() == 2 and ids[19].item() == 3
    assert ids[52].item() == 4 and ids[53].item() == 6 and ids[70:].tolist() == [7] * 5  # 7 = S, the extra one


# (dtype, tol, cu, rows, strided, H, D): every boundary case in each dtype, every other one strided (q/k/v as views
# of one fused [rows, 3, H, D] buffer, the ViT's wqkv), with three head shapes
_PER_IMAGE_CASES = [(dtype, tol, cu, rows, i % 2 == 1, H, D)
                    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2))
                    for i, (cu, rows) in enumerate(CASES) for H, D in ((1, 16), (3, 32), (2, 16))]


@pytest.mark.parametrize("cases", _tiers(_PER_IMAGE_CASES, [
    (torch.float32, 1e-4, [0, 1, 2, 19, 20, 53, 53, 70], 70, True, 3, 32),
    (torch.bfloat16, 2e-2, [0, 20, 33, 33], 45, False, 2, 16)]))
def test_varlen_kernel_matches_per_image(cases: list) -> None:
    """The main tier runs the many short sequences (strided, fp32: the masking check too) and the graph layout
    with padding (bf16), the slow tier every other case and head shape."""
    _interpret("""
        import torch
        from dsv4.models.vision import per_image_attention
        from dsv4.ops.varlen_attention import varlen_attention_triton
        g = torch.Generator().manual_seed(0)
        worst = 0.0
        for dtype, tol, cu, rows, strided, H, D in CASES:
            # q, k scaled up: sharper softmax, so a wrong mask or a wrong rescale shows
            q, k = ((torch.randn(rows, H, D, generator=g) * 2).to(dtype) for _ in range(2))
            v = torch.randn(rows, H, D, generator=g).to(dtype)
            if strided:  # strided inputs: q/k/v as views of one fused [rows, 3, H, D] buffer (the ViT's wqkv)
                qkv = torch.stack((q, k, v), 1)
                q, k, v = qkv.unbind(1)
            ref = per_image_attention(q.double(), k.double(), v.double(), cu)  # zeros past cu[-1]
            got = varlen_attention_triton(q, k, v, torch.tensor(cu, dtype=torch.int32), block_m=16, block_n=16)
            assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
            err = (got.double() - ref).abs().max().item()
            assert torch.allclose(got.double(), ref, rtol=tol, atol=tol), (dtype, cu, rows, H, D, err)
            assert not got[cu[-1]:].any(), cu  # padding rows exactly 0
            worst = max(worst, err)
            # attending across the boundaries would differ: the masking is doing something
            if len(set(cu)) > 2 and dtype == torch.float32:  # two non-empty sequences or more
                full = per_image_attention(q.double(), k.double(), v.double(), [0, cu[-1]])
                assert (full - ref).abs().max() > 1e-2
        print("worst", worst)
        print("ok")
    """, CASES=cases)


def test_varlen_kernel_other_blocks_and_scale() -> None:
    # Larger blocks than the sequences (one program spans them all), int64 cu_seqlens, head_dim 24 (padded to 32
    # in the kernel), an explicit scale, fp16.
    _interpret("""
        import torch
        import torch.nn.functional as F
        from dsv4.ops.varlen_attention import varlen_attention_triton
        g = torch.Generator().manual_seed(1)
        cu, rows, H, D, scale = [0, 5, 12, 30], 33, 2, 24, 0.3
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
            q, k, v = (torch.randn(rows, H, D, generator=g).to(dtype) for _ in range(3))
            ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].double().transpose(0, 1) for t in (q, k, v)),
                                                            scale=scale).transpose(0, 1)
                             for a, b in zip(cu[:-1], cu[1:])] + [torch.zeros(rows - cu[-1], H, D).double()])
            for bm, bn in ((64, 32), (16, 64)):
                got = varlen_attention_triton(q, k, v, torch.tensor(cu), scale=scale, block_m=bm, block_n=bn)
                err = (got.double() - ref).abs().max()
                assert torch.allclose(got.double(), ref, rtol=tol, atol=tol), (dtype, bm, bn, err)
        print("ok")
    """)


def _flash_stand_in(real, calls):
    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale=None):
        assert dropout == 0.0 and not causal and not debug
        return real(q, k, v, cu_q, cu_k, max_q, max_k, scale, calls), None, None, None, None
    return stand_in


def test_flash_wrapper_boundaries_and_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """`varlen_attention_flash` around a CPU stand-in of FlashAttention's varlen forward (CUDA-only; the real one runs
    in tests/gpu/test_varlen_attention_gpu.py): it must get int32 boundaries for both q and k and max lengths = rows
    (a bound that needs no host read), and the rows past cu_seqlens[-1], which the op leaves unwritten, must come out
    0 whatever the op left there; CPU inputs are never handed to it (flash_supported)."""
    from dsv4.models.vision import per_image_attention
    from dsv4.ops import varlen_attention as ops
    calls = []

    def real(q, k, v, cu_q, cu_k, max_q, max_k, scale, calls):
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and max_q == max_k == q.shape[0]
        calls.append(scale)
        out = torch.full_like(q, float("nan"))  # unwritten rows: garbage
        bounds = cu_q.tolist()
        out[: bounds[-1]] = per_image_attention(q.double(), k.double(), v.double(), bounds).to(q.dtype)[: bounds[-1]]
        return out

    monkeypatch.setattr(ops, "_flash_forward", lambda: _flash_stand_in(real, calls))
    wrapper, scale, seed = ops.varlen_attention_flash, 0.2, 3
    assert not ops.flash_supported(torch.zeros(4, 2, 16, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(seed)
    for cu, rows in CASES:
        q, k, v = (torch.randn(rows, 2, 16, generator=g) for _ in range(3))
        got = wrapper(q, k, v, torch.tensor(cu, dtype=torch.int64), scale=scale)
        ref = per_image_attention(q.double(), k.double(), v.double(), cu)
        assert not got.isnan().any(), cu
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert not got[cu[-1]:].any()
    assert calls == [scale] * len(CASES)
    assert wrapper(*(torch.zeros(0, 2, 16) for _ in range(3)), torch.zeros(1)).shape == (0, 2, 16)
