"""Routed-expert matmuls from quantized expert weights (dsv4/ops/moe_quant.py): the torch references equal the bf16
path of dsv4/ops/moe.py on the dequantized weights bit for bit, and the Triton kernels (gemv and grouped, MXFP4 and
FP8 with UE8M0 or float scales) match the references under TRITON_INTERPRET=1 (each check in a fresh process: the flag
is read when kernels are defined): bit for bit on a coarse grid where every fp32 sum is exact in any order, within
their arithmetic's bound on random data with every nibble, extreme scales, FP8 subnormals and +-448.

The builders and the bound are shared with tests/gpu/test_moe_quant_gpu.py."""

from __future__ import annotations

import math
import os
import textwrap

import pytest
import torch
from test_kernels_interpret import _interpret as _interpret_check

from dsv4.ops.moe import expert_gemv_torch, expert_grouped_torch
from dsv4.ops.moe_quant import expert_gemv_q, expert_gemv_q_torch, expert_grouped_q, expert_grouped_q_torch
from dsv4.quant.weight import QuantWeight

FP8_SPECIAL = (0x01, 0x02, 0x07, 0x81, 0x87, 0x08, 0x7E, 0xFE, 0x00, 0x80)  # subnormals, smallest normal, +-448, +-0


def mxfp4_weight(E: int, N: int, K: int, g: torch.Generator, scales: tuple[int, int] = (118, 130),
                 extreme: bool = True, device: str = "cpu") -> QuantWeight:
    """Random MXFP4 experts: uniform bytes (every nibble in both positions; the first 256 bytes are 0..255, so -0 = 8
    and +-6 = 7, 15 are there), UE8M0 scales in `scales`, with `extreme` every 7th 100 and every 11th 150 (2^-27,
    2^23); the last expert's first row is zero."""
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8, device=device)
    data.view(-1)[:256] = torch.arange(min(256, data.numel()), dtype=torch.uint8, device=device)
    scale = torch.randint(scales[0], scales[1] + 1, (E, N, K // 32), generator=g, dtype=torch.uint8, device=device)
    if extreme:
        scale.view(-1)[::7] = 100
        scale.view(-1)[3::11] = 150
    data[-1, 0] = 0
    return QuantWeight(data, scale, (1, 32))


def fp8_weight(E: int, N: int, K: int, block: tuple[int, int], ue8m0: bool, g: torch.Generator,
               coarse: bool = False, extreme: bool = True, device: str = "cpu") -> QuantWeight:
    """Random FP8 experts [E, N, K] with block scales [E, ceil(N/bn), ceil(K/bk)]: uniform e4m3 bytes (NaN replaced
    by +-448) led by FP8_SPECIAL; `coarse`: only exponents 2^-2..2^0 (for sums exact in fp32). Scales: UE8M0 bytes
    118..130 (`extreme`: also 100, 150; `coarse`: 125..127), or float32 in [0.5, 1.5) * 2^(-10..10)."""
    bits = torch.randint(0, 256, (E, N, K), generator=g, dtype=torch.uint8, device=device)
    if coarse:
        bits = (bits & 0x87) | (torch.randint(5, 8, bits.shape, generator=g, device=device).to(torch.uint8) << 3)
    else:
        bits[(bits & 0x7F) == 0x7F] -= 1
        bits.view(-1)[:len(FP8_SPECIAL)] = torch.tensor(FP8_SPECIAL, dtype=torch.uint8, device=device)
    bn, bk = block
    sshape = (E, math.ceil(N / bn), math.ceil(K / bk))
    if ue8m0:
        lo, hi = (125, 127) if coarse else (118, 130)
        scale = torch.randint(lo, hi + 1, sshape, generator=g, dtype=torch.uint8, device=device)
        if extreme and not coarse:
            scale.view(-1)[::5] = 100
            scale.view(-1)[2::7] = 150
    else:
        exps = torch.randint(-10, 11, sshape, generator=g, device=device).float()
        scale = (torch.rand(sshape, generator=g, device=device) + 0.5) * torch.exp2(exps)
    return QuantWeight(bits.view(torch.float8_e4m3fn), scale, block)


def magnitude(w: QuantWeight) -> QuantWeight:
    """|W| as a QuantWeight (sign bits cleared): for the bound's sum of |w| |x|."""
    mask = 0x77 if w.fp4 else 0x7F
    data = w.data.view(torch.uint8) & mask
    return QuantWeight(data if w.fp4 else data.view(torch.float8_e4m3fn), w.scale.abs() if w.scale.is_floating_point()
                       else w.scale, w.block)


def routes(R: int, E: int, g: torch.Generator, holes: bool = True, device: str = "cpu") -> torch.Tensor:
    """Random experts for R rows; with `holes` every 4th row from the second has none (-1, another rank's)."""
    idx = torch.randint(0, E, (R,), generator=g, device=device)
    if holes and R > 1:
        idx[1::4] = -1
    return idx


def assert_close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: QuantWeight, idx: torch.Tensor,
                 x_div: int, gamma: float | None = None) -> None:
    """got (a kernel) against ref (the torch reference) within what their arithmetic allows. Both add the same fp32
    products (the weights are exact, or rounded the same way) in different orders, each within K 2^-24 S of the
    exact sum (recursive summation with the products' rounding), S = sum |w| |x| over the row: |got - ref| <=
    gamma S with gamma = 2 K 2^-24 (`gamma`: another accumulator's bound, e.g. tensor cores'); a bf16 output adds
    half an ulp (<= 2^-8 relative) of rounding on each side. Rows with no expert: exactly 0."""
    K = w.shape[-1]
    S = expert_grouped_q_torch(x.abs().float(), magnitude(w), idx, x_div).double()
    g64, r64 = got.double(), ref.double()
    bound = (gamma if gamma is not None else 2 * K * 2.0 ** -24) * S + 1e-30
    if got.dtype != torch.float32 or ref.dtype != torch.float32:
        bound = bound + 2.0 ** -8 * 1.01 * (g64.abs() + r64.abs())
    err = (g64 - r64).abs()
    assert torch.isfinite(g64).all() and (err <= bound).all(), (err / bound).max().item()
    assert got[idx < 0].eq(0).all()


# ---- the references ---------------------------------------------------------------------------------------------
def _weights(kind: str, E: int, N: int, K: int, g: torch.Generator) -> QuantWeight:
    if kind == "mxfp4":
        return mxfp4_weight(E, N, K, g)
    block = (128, 128) if kind.endswith("128") else (32, 64)
    return fp8_weight(E, N, K, block, kind.startswith("fp8-ue8m0"), g)


@pytest.mark.parametrize("kind,N,K", [("mxfp4", 48, 96), ("fp8-ue8m0-128", 96, 128), ("fp8-f32-128", 96, 128),
                                      ("fp8-ue8m0-32x64", 48, 96), ("fp8-f32-32x64", 48, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_equal_the_bf16_path_on_dequantized_weights(kind: str, N: int, K: int, dtype: torch.dtype) -> None:
    """`expert_*_q_torch(x, w, ...)` == `expert_*_torch(x, w.dequantize(x.dtype), ...)` bit for bit (a model whose
    experts were dequantized at load gives the same numbers), idx with -1, x_div 1, 2 and 3; on the CPU the
    dispatchers are the references."""
    g = torch.Generator().manual_seed(sum(map(ord, kind)) + (dtype == torch.bfloat16))
    E = 6
    w = _weights(kind, E, N, K, g)
    wd = w.dequantize(dtype)
    for T, x_div in ((1, 1), (5, 1), (4, 3), (30, 2)):
        x = torch.randn(T, K, generator=g).to(dtype)
        idx = routes(T * x_div, E, g)
        for ref_fn, q_fn, dispatch in ((expert_gemv_torch, expert_gemv_q_torch, expert_gemv_q),
                                       (expert_grouped_torch, expert_grouped_q_torch, expert_grouped_q)):
            ref = ref_fn(x, wd, idx, x_div)
            got = q_fn(x, w, idx, x_div)
            assert got.dtype == dtype and got.shape == (T * x_div, N)
            assert torch.equal(got, ref) and torch.equal(dispatch(x, w, idx, x_div), ref), (ref_fn.__name__, T)
            assert got[idx < 0].eq(0).all()


# ---- the kernels, in the interpreter ----------------------------------------------------------------------------
def _interpret(code: str) -> None:
    """test_kernels_interpret's `_interpret`, with this folder first on the check's sys.path (its helpers)."""
    prelude = f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
    _interpret_check(prelude + textwrap.dedent(code))


@pytest.mark.slow  # 9 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_kernels_are_exact_on_a_coarse_grid() -> None:
    """Values on a grid where every fp32 partial sum is exact (MXFP4 codes times scales 2^-2..2^2: multiples of
    2^-3 up to 24; e4m3 values of 2^-2..2^0 times scales 2^-2..2^0: multiples of 2^-7 up to 1.875; x: multiples of
    1/4 up to 1; so every partial sum is a multiple of 2^-5 (2^-9) below 24 K (1.875 K), exact in fp32 for K up to
    8192 -- the released shapes too, see tests/gpu): any summation order gives the exact sum, so both
    kernels equal the references bit for bit, fp32 and bf16 (one rounding of the same value). Every nibble / byte
    value is decoded here; a wrong bit or column anywhere shows."""
    _interpret("""
        import torch
        from test_moe_quant import mxfp4_weight, fp8_weight, routes
        from dsv4.ops.moe_quant import (expert_gemv_q_torch, expert_gemv_q_triton, expert_grouped_q_torch,
                                        expert_grouped_q_triton)
        from dsv4.ops.moe_quant import GEMV_Q_CONFIG
        for cfg in GEMV_Q_CONFIG.values():  # two K tiles, one N block: fewer programs for the interpreter
            cfg.update(block_n=64, block_k=64)
        g = torch.Generator().manual_seed(0)
        for kind, E, N, K in (("mxfp4", 5, 48, 128), ("fp8-128", 4, 40, 128), ("fp8-32x64", 6, 48, 96)):
            if kind == "mxfp4":
                w = mxfp4_weight(E, N, K, g, scales=(125, 129), extreme=False)
            else:
                w = fp8_weight(E, N, K, (128, 128) if kind == "fp8-128" else (32, 64), True, g, coarse=True)
            for dtype in (torch.float32, torch.bfloat16):
                for T, x_div in ((1, 1), (5, 1), (4, 3)):
                    x = torch.randint(-4, 5, (T, K), generator=g).float().div(4).to(dtype)
                    x[0, : K // 2] = 0
                    idx = routes(T * x_div, E, g)
                    for ref_fn, fn in ((expert_gemv_q_torch, expert_gemv_q_triton),
                                       (expert_grouped_q_torch, expert_grouped_q_triton)):
                        ref, got = ref_fn(x, w, idx, x_div), fn(x, w, idx, x_div)
                        assert got.dtype == dtype and got.shape == ref.shape == (T * x_div, N)
                        assert torch.equal(got, ref), (kind, dtype, T, fn.__name__, (got - ref).abs().max())
                        assert ref.abs().max() > 0
        print("ok")
    """)


@pytest.mark.slow  # 12 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_gemv_kernel_matches_reference() -> None:
    """The decode kernel on random data: every nibble, UE8M0 scales 2^-27 and 2^23
    among ordinary ones, FP8 subnormals and +-448, float scales (bf16 x: the weight rounded to bf16 first, as the
    reference does), full and partial (N 48, K 96 with 32 x 64 blocks) scale blocks, rows with no expert, a zero row
    of x, R 1 .. 40 with x_div 1 and 3, N off the block size, K over two tiles (the prefetch of the next one)."""
    _interpret("""
        import torch
        from test_moe_quant import mxfp4_weight, fp8_weight, routes, assert_close
        from dsv4.ops.moe_quant import GEMV_Q_CONFIG, expert_gemv_q_torch, expert_gemv_q_triton
        for cfg in GEMV_Q_CONFIG.values():  # K over two tiles; N 96 over a full block and a partial one
            cfg.update(block_n=64, block_k=64)
        g = torch.Generator().manual_seed(1)
        f32, bf16 = torch.float32, torch.bfloat16
        cases = [("mxfp4", 5, 40, 128, [(f32, 40, 1), (bf16, 1, 1), (bf16, 3, 3)]),
                 ("mxfp4", 4, 96, 64, [(f32, 5, 1), (bf16, 4, 3)]),
                 ("fp8-ue8m0", 4, 96, 128, [(f32, 1, 1), (bf16, 5, 1)]),
                 ("fp8-f32", 4, 96, 128, [(f32, 4, 3), (bf16, 40, 1)]),
                 ("fp8-ue8m0-32x64", 3, 48, 96, [(f32, 5, 1), (bf16, 3, 3)]),
                 ("fp8-f32-32x64", 3, 48, 96, [(f32, 3, 3), (bf16, 1, 1)])]
        for kind, E, N, K, shapes in cases:
            if kind == "mxfp4":
                w = mxfp4_weight(E, N, K, g)
            else:
                w = fp8_weight(E, N, K, (32, 64) if kind.endswith("32x64") else (128, 128), "ue8m0" in kind, g)
            for dtype, T, x_div in shapes:
                x = torch.randn(T, K, generator=g).to(dtype)
                x[-1] = 0
                idx = routes(T * x_div, E, g)
                ref = expert_gemv_q_torch(x, w, idx, x_div)
                got = expert_gemv_q_triton(x, w, idx, x_div)
                assert got.dtype == dtype and got.shape == (T * x_div, N)
                assert_close(got, ref, x, w, idx, x_div)
                assert got[(T - 1) * x_div:].eq(0).all()  # the zero row of x
        print("ok")
    """)


def test_grouped_block_rows_follow_the_mean_within_the_dtype_limit() -> None:
    """Blocks of about twice the mean rows per expert (a power of two, at least 16), capped at 256 rows for
    bf16 / fp16 x (prefill: a weight decoded once per 256 rows) and 64 for fp32 x; a fixed block_m wins."""
    from dsv4.ops.moe_quant import GROUPED_Q_CONFIG, grouped_q_block_m
    bf16, f32 = torch.bfloat16, torch.float32
    assert grouped_q_block_m(6, 16, bf16) == 16  # batch-1 decode
    assert grouped_q_block_m(192, 16, bf16) == 32  # batch 32 over the cut-down presets' 16 experts: 12 a expert
    assert grouped_q_block_m(192, 256, bf16) == 16
    assert grouped_q_block_m(3072, 16, bf16) == 256  # 512 tokens: 192 a expert
    assert grouped_q_block_m(32 * 512 * 6, 16, bf16) == 256
    assert grouped_q_block_m(32 * 512 * 6, 16, f32) == 64
    assert grouped_q_block_m(600, 16, torch.float16) == 128  # 37.5 a expert
    saved = GROUPED_Q_CONFIG["block_m"]
    try:
        GROUPED_Q_CONFIG["block_m"] = 16
        assert grouped_q_block_m(32 * 512 * 6, 16, bf16) == 16
    finally:
        GROUPED_Q_CONFIG["block_m"] = saved


@pytest.mark.slow  # 7 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_grouped_kernel_matches_reference() -> None:
    """The grouped kernel on random data (as the gemv test), plus the grouping: one expert with more than a block
    of rows (bf16 blocks of 256 and fp32 blocks of 64, the largest of each, and blocks of 16: several full blocks
    and a partial one), experts with none, more experts than rows, rows with no expert in a bucket of their own;
    fp32 (IEEE) and bf16."""
    _interpret("""
        import torch
        from test_moe_quant import mxfp4_weight, fp8_weight, routes, assert_close
        from dsv4.ops.moe_quant import GROUPED_Q_CONFIG, expert_grouped_q_torch, expert_grouped_q_triton
        g = torch.Generator().manual_seed(2)
        M = GROUPED_Q_CONFIG["max_block_m"]  # (fp32 x: max_block_m_fp32 caps the same cases at 64)
        cases = [("mxfp4", 5, 40, 128, [(1, 1), (40, 1), (3, 3)]), ("mxfp4", 3, 32, 64, [(2 * M + 5, 1)]),
                 ("fp8-ue8m0", 4, 96, 128, [(5, 1), (13, 3)]), ("fp8-f32", 9, 96, 128, [(1, 1), (5, 1)]),
                 ("fp8-ue8m0-32x64", 3, 48, 96, [(40, 1), (3, 3)]), ("fp8-f32-32x64", 3, 48, 96, [(M + 9, 1)])]
        for kind, E, N, K, shapes in cases:
            if kind == "mxfp4":
                w = mxfp4_weight(E, N, K, g)
            else:
                w = fp8_weight(E, N, K, (32, 64) if kind.endswith("32x64") else (128, 128), "ue8m0" in kind, g)
            for dtype in (torch.float32, torch.bfloat16):
                for T, x_div in shapes:
                    R = T * x_div
                    x = torch.randn(T, K, generator=g).to(dtype)
                    idx = routes(R, E, g)
                    if R > M:
                        idx[: M + 9] = 1  # one expert with more than a block
                        idx[idx == 0] = 2  # and one with none
                        idx[R // 3:: 5] = -1
                    ref, got = expert_grouped_q_torch(x, w, idx, x_div), expert_grouped_q_triton(x, w, idx, x_div)
                    assert got.dtype == dtype and got.shape == (R, N)
                    assert_close(got, ref, x, w, idx, x_div)
                    if R > M:  # also in blocks of 16 rows: the hot expert in full blocks and a partial one
                        GROUPED_Q_CONFIG["block_m"] = 16
                        assert_close(expert_grouped_q_triton(x, w, idx, x_div), ref, x, w, idx, x_div)
                        GROUPED_Q_CONFIG["block_m"] = None
        print("ok")
    """)


def test_expert_dequant_kernels_are_exact() -> None:
    """dsv4/ops/expert_dequant.py (the sorted prefill GEMM's weights) gives `QuantWeight.dequantize`'s numbers bit for
    bit: MXFP4 with every nibble in both positions, scale bytes 0 and 1 (2^-127, 2^-126: subnormal products), 100,
    150, 254 (overflow to inf) and 255 (NaN), rows and bytes that leave partial tiles; FP8 experts flattened to rows
    (UE8M0 and float scales, blocks of 128 and 32), and the torch fallback when a block straddles two experts; bf16,
    fp16 and fp32. (bf16 runs with scale bytes 2 and 3 in place of 0 and 1: the interpreter's fp32 -> bf16 cast
    flushes bf16 subnormals to zero, the GPU's does not; tests/gpu/test_moe_sorted_gpu.py checks them there.)"""
    _interpret("""
        import torch
        from test_moe_quant import mxfp4_weight, fp8_weight
        from dsv4.ops.expert_dequant import dequantize_experts_triton
        from dsv4.quant.weight import QuantWeight
        g = torch.Generator().manual_seed(9)
        cases = []
        for E, N, K in ((3, 20, 64), (2, 8, 320)):
            w = mxfp4_weight(E, N, K, g)
            w.scale.view(-1)[5:9] = torch.tensor([0, 254, 255, 1], dtype=torch.uint8)
            cases.append(w)
        cases += [fp8_weight(2, 256, 160, (128, 128), True, g), fp8_weight(3, 64, 96, (32, 32), False, g),
                  fp8_weight(2, 40, 64, (32, 32), True, g)]  # 40 % 32: a block straddles the experts
        for w in cases:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):  # bf16 last: it changes w
                if dtype == torch.bfloat16 and w.fp4:
                    w = QuantWeight(w.data, torch.where(w.scale < 2, w.scale + 2, w.scale), w.block)
                got, ref = dequantize_experts_triton(w, dtype), w.dequantize(dtype)
                assert got.shape == ref.shape and got.dtype == dtype
                torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
        print("ok")
    """)
