"""FP8 block-scaled linear (dsv4/ops/fp8_linear.py): the torch reference against the dequantize-at-load path and the
model's grouped projection (bit for bit), and the Triton kernels against the reference under TRITON_INTERPRET=1 (in
subprocesses: the flag is read when the kernels are defined).

Error bounds, with S = sum_k |x_k| |w_k| per output (w dequantized) and K the contraction length (per group):
* fp32 x: both sides round each of the K products and K partial sums in fp32, in different orders; the kernel also
  scales each K-tile's sum (exact for power-of-two scales, one rounding for float scales) where the reference rounds
  each w * s. |got - ref| <= (K + 8) 2^-23 S covers it with room.
* 16-bit x: the kernel's products are exact in fp32 (8- or 11-bit x times a 4-bit e4m3 significand), so before its
  final rounding it is within (K + 8) 2^-24 S of the exact fp32 product y; rounding to bf16 (8 significant bits)
  moves it by at most half an ulp <= 2^-8 |y|: |got - ref32| <= 2^-8 |ref32| + (K + 8) 2^-23 S, against ref32 =
  the reference run in fp32 (brief: compare to the fp32 reference, one bf16 rounding plus accumulation). Where a
  kernel multiplies the weight as the 16-bit reference has it (w * s rounded to x's dtype: the one-row gemv, and
  W8A16 with 32-wide blocks), float scales add that rounding, half an ulp of each weight: + 2^-8 S in bf16.
* W8A8: x is quantized per (row, bk block) with scale s = amax/448. An e4m3 value has 4 significant bits, so
  rounding x/s to it errs by at most 2^-4 |x| in the normal range and by half the subnormal step, 2^-10 s, below
  2^-6 s: |x~ - x| <= 2^-4 |x| + 2^-10 amax / 448. Summed against |w|: |got - ref32| <= 2^-4 S + 2^-10/448 A W1 +
  the 16-bit output rounding and accumulation terms above, with A = the row's max |x| and W1 = sum_k |w_nk|.
  Statistically the error is much smaller (random rounding errors, rms ~ 2^-4 / sqrt(3) relative), so the relative
  Frobenius error is also held below 2^-4; and the quantization itself is checked exactly against a torch
  emulation (x quantized with torch's e4m3 cast, then the fp32 product).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_kernels_interpret import _interpret as _interpret_fresh
from test_kernels_interpret import _tiers

from dsv4.models.layers.attention import grouped_projection
from dsv4.ops.fp8_linear import fp8_linear, fp8_linear_torch
from dsv4.quant.formats import dequantize, quantize_fp8
from dsv4.quant.weight import QuantWeight

# shared by the subprocesses: random block-scaled weights (realistic or every finite e4m3 code with wild scales),
# and the bound check of the module docstring
_HELPERS = """
import torch
from dsv4.ops.fp8_linear import dense_linear, fp8_linear_torch, fp8_linear_triton, fp8_linear_w8a8_triton, _launch
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight

def make_weight(N, K, block, ue8m0, g, special=False, e_range=(100, 140)):
    bn, bk = block
    shape = (-(-N // bn), -(-K // bk))
    if not special:  # the project's encoder on a gaussian weight
        return QuantWeight(*quantize_fp8(torch.randn(N, K, generator=g), block, ue8m0), block)
    codes = torch.randint(0, 254, (N, K), generator=g)
    codes = (codes + (codes >= 127)).to(torch.uint8)  # every code but the NaNs 0x7f, 0xff: zeros, subnormals, +-448
    codes[0, :3] = torch.tensor([0x7E, 0xFE, 0x80], dtype=torch.uint8)  # 448, -448, -0
    lo, hi = e_range
    e = torch.randint(lo, hi + 1, shape, generator=g)
    e.view(-1)[0], e.view(-1)[-1] = lo, hi
    if ue8m0:
        scale = e.to(torch.uint8)
    else:  # arbitrary float scales over the same range
        scale = (2.0 ** (e - 127).float()) * (1 + torch.rand(shape, generator=g))
    return QuantWeight(codes.view(torch.float8_e4m3fn), scale, block)

def abs_weight(w):
    return QuantWeight((w.data.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn), w.scale, w.block)

def check(x, w, groups, got, what, w_rounded=False):
    # w_rounded: the kernel multiplies the weight rounded to x's dtype, as the reference does for a 16-bit x
    # (exact for UE8M0 scales; with float scales each w * s moves by up to half an ulp: 2^-8 relative in bf16)
    K = w.data.shape[1]
    ref = fp8_linear_torch(x.float(), w, groups)
    S = fp8_linear_torch(x.float().abs(), abs_weight(w), groups)
    assert got.dtype == x.dtype and got.shape == ref.shape, (what, got.dtype, got.shape)
    acc = (K + 8) * 2.0 ** -23 * S
    if w_rounded and x.dtype != torch.float32 and w.scale.dtype != torch.uint8:
        acc = acc + torch.finfo(x.dtype).eps / 2 * S
    bound = acc if x.dtype == torch.float32 else acc + 2.0 ** -8 * ref.abs()
    err = (got.float() - ref).abs()
    assert (err <= bound).all(), (what, (err / bound).max().item())
    if x.dtype == torch.bfloat16 and w.scale.dtype == torch.uint8:
        # the bf16 reference (weights exact in bf16): the same rounding of nearly the same fp32 value
        same = (got == fp8_linear_torch(x, w, groups)).float().mean().item()
        assert same > 0.98, (what, same)
"""


def _interpret(code: str, **names: object) -> None:
    """`code` after _HELPERS, run as test_kernels_interpret's `_interpret` runs its code (`names` set first)."""
    _interpret_fresh(_HELPERS + textwrap.dedent(code), **names)


# ---- the reference -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K,block,ue8m0", [(96, 160, (128, 128), True), (40, 72, (32, 32), False),
                                             (256, 256, (128, 128), False), (64, 96, (32, 32), True)])
def test_reference_is_dequantize_then_linear(dtype: torch.dtype, N: int, K: int, block: tuple[int, int],
                                             ue8m0: bool) -> None:
    """Bit for bit what a model with the weight dequantized at load computes, for [M, K] and [..., K] inputs; and
    the dispatcher takes the reference on the CPU."""
    g = torch.Generator().manual_seed(N + K)
    w = QuantWeight(*quantize_fp8(torch.randn(N, K, generator=g), block, ue8m0), block)
    dense = dequantize(w.data, w.scale, block).to(dtype)
    for shape in ((1, K), (5, K), (2, 3, K)):
        x = torch.randn(shape, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x, dense)
        got = fp8_linear_torch(x, w)
        assert got.dtype == dtype and got.shape == (*shape[:-1], N)
        assert torch.equal(got, ref)
        assert torch.equal(fp8_linear(x, w), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,G,Ng,K,block", [(3, 8, 64, 64, (32, 32)), (1, 2, 128, 160, (128, 128)),
                                            (7, 4, 20, 40, (32, 32))])
def test_reference_groups_is_grouped_projection(dtype: torch.dtype, T: int, G: int, Ng: int, K: int,
                                                block: tuple[int, int]) -> None:
    """groups > 1: exactly the model's grouped projection on the dequantized weight (out [T, H, D] flattened to
    [T, G*K]); and out[:, g*Ng:(g+1)*Ng] = x[:, g*K:(g+1)*K] @ W[g*Ng:(g+1)*Ng].T (within fp32 summation order)."""
    g = torch.Generator().manual_seed(T * G)
    w = QuantWeight(*quantize_fp8(torch.randn(G * Ng, K, generator=g), block), block)
    heads = 2 * G
    out = torch.randn(T, heads, G * K // heads, generator=g).to(dtype)
    ref = grouped_projection(out, w.dequantize(dtype), G)
    got = fp8_linear_torch(out.reshape(T, -1), w, G)
    assert got.dtype == dtype and torch.equal(got, ref)
    lead = fp8_linear_torch(out.reshape(1, T, -1), w, G)  # leading dims flatten into the rows
    assert lead.shape == (1, T, G * Ng) and torch.equal(lead[0], ref)
    wd, xf = w.dequantize(), out.reshape(T, -1).float()
    per_group = torch.cat([xf[:, i * K:(i + 1) * K] @ wd[i * Ng:(i + 1) * Ng].T for i in range(G)], dim=1)
    assert torch.allclose(fp8_linear_torch(xf, w, G), per_group, rtol=1e-5, atol=1e-5)


def test_reference_rejects_bad_shapes() -> None:
    w = QuantWeight(*quantize_fp8(torch.randn(64, 32), (32, 32)), (32, 32))
    for x, groups in ((torch.randn(2, 33), 1), (torch.randn(2, 64), 3), (torch.randn(2, 32), 2)):
        with pytest.raises(ValueError):
            fp8_linear_torch(x, w, groups)


# ---- the Triton kernels under the interpreter --------------------------------------------------------------------
@pytest.mark.slow  # 8 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_w8a16_kernel_matches_reference() -> None:
    """fp32 and bf16 activations, M = 1, 3, 17 (one M tile, split-K) and 70 (the tiled GEMM), blocks 128 and 32,
    UE8M0 and float32 scales, N and K not multiples of the block, 2 and 4 groups (a group boundary inside a scale
    block), leading dims, no rows."""
    _interpret("""
        g = torch.Generator().manual_seed(0)
        cases = [(96, 160, (128, 128), 1), (40, 72, (32, 32), 1), (64, 96, (32, 32), 2), (80, 40, (32, 32), 4),
                 (256, 128, (128, 128), 2)]
        for N, K, block, groups in cases:
            for ue8m0 in (True, False):
                w = make_weight(N, K, block, ue8m0, g)
                for dtype in (torch.float32, torch.bfloat16):
                    for M in (1, 3, 17, 70):
                        x = torch.randn(M, groups * K, generator=g).to(dtype)
                        what = (N, K, block, groups, ue8m0, dtype, M)
                        check(x, w, groups, fp8_linear_triton(x, w, groups), what, w_rounded=True)
        w = make_weight(96, 160, (128, 128), True, g)
        x = torch.randn(2, 3, 160, generator=g).to(torch.bfloat16)
        check(x, w, 1, fp8_linear_triton(x, w), "leading dims")
        xs = torch.randn(6, 200, generator=g).to(torch.bfloat16)[:, 20:180]  # rows 200 apart
        check(xs, w, 1, fp8_linear_triton(xs, w), "strided rows")
        assert fp8_linear_triton(x[:0], w).shape == (0, 3, 96)
        x = torch.randn(5, 160, generator=g).to(torch.float16)
        check(x, w, 1, fp8_linear_triton(x, w), "fp16")
        print("ok")
    """)


@pytest.mark.slow  # 9 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_one_row_gemv_matches_reference() -> None:
    """The one-row path (`fp8_gemv_triton`: the FP8 expert gemv over the weight's groups), which `fp8_linear` takes
    for a single row on CUDA: fp32 and bf16 x, blocks 128 and 32 with partial ones, UE8M0 and float scales, every
    finite e4m3 code under wild scales, 1, 2 and 4 groups, the four tile configs (each over some of the cases; the
    grouped projection's on a two-group case); shapes it cannot take (a group starting inside a scale block, two
    rows) are refused."""
    _interpret("""
        from dsv4.ops.fp8_linear import fp8_gemv_triton
        from dsv4.ops import fp8_linear as fl
        g = torch.Generator().manual_seed(4)
        configs = [fl.gemv_config(n) for n in (512, 4096, 32768)] + [fl.gemv_config(8192, 8)]
        cases = [(96, 160, (128, 128), 1), (40, 72, (32, 32), 1), (64, 96, (32, 32), 2), (256, 128, (128, 128), 2),
                 (128, 40, (32, 32), 4)]
        for c, (N, K, block, groups) in enumerate(cases):
            i = c % len(configs)  # each config over several cases
            fl.gemv_config = lambda n, groups=1, bk=128, cfg=configs[i]: cfg
            # both scale kinds in every case, the gaussian and the every-code weights on alternate cases
            for ue8m0, special in ((True, c % 2 == 0), (False, c % 2 == 1)):
                w = make_weight(N, K, block, ue8m0, g, special=special)
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(1, groups * K, generator=g).to(dtype)
                    got = fp8_gemv_triton(x, w, groups)
                    check(x, w, groups, got, (N, K, block, groups, ue8m0, i), w_rounded=True)
                    if dtype == torch.bfloat16 and not ue8m0:  # the same weights as the bf16 reference
                        ref16 = fp8_linear_torch(x, w, groups).float()
                        assert (got.float() - ref16).abs().max() <= 2.0 ** -7 * ref16.abs().max(), i
        x = torch.randn(1, 1, 160, generator=g).to(torch.bfloat16)
        assert fp8_gemv_triton(x, make_weight(96, 160, (128, 128), True, g)).shape == (1, 1, 96)
        for x, w, groups in ((torch.randn(1, 2 * 40), make_weight(80, 40, (32, 32), True, g), 2),  # 40 % 32
                             (torch.randn(2, 160), make_weight(96, 160, (128, 128), True, g), 1)):
            try:
                fp8_gemv_triton(x, w, groups)
            except ValueError:
                pass
            else:
                raise AssertionError("accepted a shape it cannot take")
        print("ok")
    """)


def test_dequantize_kernel_is_exact() -> None:
    """The prefill path's dequantize kernel gives the reference's numbers bit for bit (fp32 code * scale, one
    rounding), for partial blocks, float and UE8M0 scales, and every finite e4m3 code; so `fp8_linear_dequant`
    multiplies exactly the reference's weight."""
    _interpret("""
        from dsv4.ops.fp8_linear import dequantize_triton, fp8_linear_dequant
        g = torch.Generator().manual_seed(3)
        for N, K, block in ((96, 160, (128, 128)), (40, 72, (32, 32)), (33, 300, (32, 32))):
            for ue8m0 in (True, False):
                w = make_weight(N, K, block, ue8m0, g)
                codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
                codes = codes[~codes.float().isnan()]
                flat = w.data.view(-1).clone()
                flat[: codes.numel()] = codes[: flat.numel()]
                w = QuantWeight(flat.view(N, K), w.scale, block)
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    got, ref = dequantize_triton(w, dtype), w.dequantize(dtype)
                    assert torch.equal(got, ref), (N, K, block, ue8m0, dtype)
                x = torch.randn(70, K, generator=g)
                assert torch.equal(fp8_linear_dequant(x, w), fp8_linear_torch(x, w))
        print("ok")
    """)


@pytest.mark.slow  # 9 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_w8a16_kernel_special_values_and_configs() -> None:
    """Every finite e4m3 code (zeros, -0, subnormals below 2^-6, +-448) under scales from 2^-27 (e = 100) to 2^13
    (e = 140), mixed and uniform, UE8M0 and float; then one input through forced configs: no split, every K-tile
    its own split, BLOCK_N below and above bn, BLOCK_K below bk; the split-K sum must not depend on run."""
    _interpret("""
        g = torch.Generator().manual_seed(1)
        for N, K, block in ((96, 160, (128, 128)), (40, 72, (32, 32))):
            for e_range in ((100, 140), (100, 100), (140, 140)):
                for ue8m0 in (True, False):
                    w = make_weight(N, K, block, ue8m0, g, special=True, e_range=e_range)
                    for dtype in (torch.float32, torch.bfloat16):
                        for M in (1, 17, 70):
                            x = torch.randn(M, K, generator=g).to(dtype)
                            what = (N, K, block, e_range, ue8m0, dtype, M)
                            check(x, w, 1, fp8_linear_triton(x, w), what, w_rounded=True)
        w = make_weight(96, 256, (32, 32), True, g, special=True)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(9, 2 * 256, generator=g).to(dtype)
            for over in (dict(split=1), dict(split=8), dict(split=3, BLOCK_N=16), dict(BLOCK_N=64, BLOCK_K=16),
                         dict(BLOCK_M=64, BLOCK_N=32, GROUP_M=1, split=1), dict(BLOCK_M=16, GROUP_M=2)):
                got = _launch(x, w, 2, False, **over)
                check(x, w, 2, got, over, w_rounded=True)
                assert torch.equal(got, _launch(x, w, 2, False, **over)), over
        print("ok")
    """)


# (N, K, block, groups, ue8m0, dtype, M)
_W8A8_CASES = [(N, K, block, groups, ue8m0, dtype, M)
               for N, K, block, groups in ((96, 160, (128, 128), 1), (40, 72, (32, 32), 1), (64, 96, (32, 32), 2),
                                           (256, 256, (128, 128), 1))
               for ue8m0 in (True, False) for dtype in (torch.float32, torch.bfloat16) for M in (1, 17, 70)]


@pytest.mark.parametrize("cases", _tiers(_W8A8_CASES, [(96, 160, (128, 128), 1, True, torch.bfloat16, 17),
                                                       (64, 96, (32, 32), 2, False, torch.float32, 17)]))
def test_w8a8_kernel_within_quantization_bound(cases: list) -> None:
    """W8A8: equal to a torch emulation of its activation quantization (within fp32 accumulation order), and within
    the derived bound of the unquantized reference; blocks 128 and 32, both scale kinds, groups, partial blocks,
    rows of zeros and rows of tiny values (subnormal e4m3 codes). The main tier runs 17 rows in two cases (blocks
    128, UE8M0 scales, bf16, a partial K block; blocks 32, float scales, fp32, two groups), the slow tier the other
    combinations."""
    _interpret("""
        def emulate(x, w, groups):  # x quantized per (row, bk block) as the kernel does, then the fp32 product
            K, bk = w.data.shape[1], w.block[1]
            xf = x.float().reshape(x.shape[0], groups, K)
            pad = -K % bk
            xb = torch.nn.functional.pad(xf, (0, pad)).reshape(x.shape[0], groups, -1, bk)
            s = (xb.abs().amax(-1, keepdim=True) / 448.0).clamp(min=2.0 ** -126)
            q = (xb * (1.0 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            return fp8_linear_torch(q.reshape(x.shape[0], groups, -1)[..., :K].reshape(x.shape[0], -1), w, groups)

        g = torch.Generator().manual_seed(2)
        for N, K, block, groups, ue8m0, dtype, M in CASES:
            w = make_weight(N, K, block, ue8m0, g)
            x = torch.randn(M, groups * K, generator=g).to(dtype)
            x[0, :K // 2] = 0  # a partly zero block
            if M > 1:
                x[1] *= 2.0 ** -20  # small rows: their own scale
                x[1, ::3] *= 2.0 ** -16  # and values below 2^-6 * scale: subnormal codes
            if M > 2:
                x[2] = 0
            got = fp8_linear_w8a8_triton(x, w, groups)
            what = (N, K, block, groups, ue8m0, dtype, M)
            assert got.dtype == dtype and got.shape == (M, N), what
            ref = fp8_linear_torch(x.float(), w, groups)
            S = fp8_linear_torch(x.float().abs(), abs_weight(w), groups)
            A = x.float().abs().amax(-1, keepdim=True)
            W1 = w.dequantize().abs().sum(-1)
            acc = (K + 8) * 2.0 ** -23 * S
            rnd = 0 if dtype == torch.float32 else 2.0 ** -8  # the output's rounding, of |ref| + error
            bound = (1 + rnd) * (2.0 ** -4 * S + 2.0 ** -10 / 448 * A * W1 + acc) + rnd * ref.abs()
            err = (got.float() - ref).abs()
            assert (err <= bound).all(), (what, (err / bound).max().item())
            assert ((got.float() - ref).norm() <= 2.0 ** -4 * ref.norm()), what
            if M > 2:
                assert got[2].eq(0).all(), what
            # the emulation rounds q * s too, and its |x~| may exceed |x| by 2^-4: twice acc covers it
            emu = emulate(x, w, groups)
            e_err = (got.float() - emu).abs()
            e_bound = 2 * acc + rnd * emu.abs()
            assert (e_err <= e_bound).all(), (what, (e_err / e_bound).max().item())
        print("ok")
    """, CASES=cases)
