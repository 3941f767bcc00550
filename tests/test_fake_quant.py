"""dsv4.ops.fake_quant vs an independent float64 numpy transcription of model.md sections 5 and 12, bit for bit.

The reference never calls torch's float8 casts: powers of two come from np.frexp, e4m3 and e2m1 rounding are written
out here (3 mantissa bits / bias 7 / max 448 / subnormals; nearest grid point with ties to the even grid index), and
the only fp32 roundings emulated are the ones the spec makes (the products amax*fp32(1/max), the division amax/6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4.ops.fake_quant import fp4_fake_quant_e4m3, fp4_fake_quant_ue8m0, fp8_fake_quant

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16]


# ---- reference (float64 numpy) -------------------------------------------------------------------------------
def f32(v: np.ndarray | float) -> np.ndarray:
    """Round float64 values to the nearest fp32 (RNE), kept as float64 (overflow -> inf, as in torch)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float64)


def bf16(v: np.ndarray) -> np.ndarray:
    """Round values that are fp32 to the nearest bf16 (RNE on the top 16 bits), kept as float64."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """Smallest power of two >= v (v > 0)."""
    m, e = np.frexp(v)  # v = m * 2^e, 0.5 <= m < 1
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Round to float8 e4m3fn: 3 mantissa bits, bias 7 (normal exponents >= -6, subnormal step 2^-9), ties to even,
    saturating at 448; the sign of zero is kept."""
    a = np.abs(v)
    _, e = np.frexp(a)
    exp = np.maximum(e - 1, -6)  # exponent of the leading bit; subnormals share the step of 2^-6's binade
    step = np.ldexp(1.0, exp - 3)
    r = np.minimum(np.round(a / step) * step, 448.0)  # np.round rounds half to even
    return np.copysign(r, v)


E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_rne(v: np.ndarray) -> np.ndarray:
    """Nearest e2m1 grid value; a tie (two nearest points, adjacent indices) goes to the even index (even
    mantissa); sign kept, -0 -> +0."""
    d = np.abs(np.abs(v)[..., None] - E2M1_GRID)
    cand = d == d.min(-1, keepdims=True)
    first = cand.argmax(-1)
    idx = np.where((cand.sum(-1) == 2) & (first % 2 == 1), first + 1, first)
    g = E2M1_GRID[idx]
    return np.where((v < 0) & (g > 0), -g, g)


def ref_quant(x: np.ndarray, kind: str, out_bf16: bool) -> np.ndarray:
    block = 16 if kind == "fp4_e4m3" else 32
    if x.shape[-1] % block:
        return x
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    if kind == "fp8":
        scale = pow2_ceil(f32(np.maximum(amax, f32(1e-4)) * f32(1 / 448)))
        q = e4m3_rne(np.clip(xb / scale, -448, 448))
    else:
        if kind == "fp4_ue8m0":
            scale = pow2_ceil(f32(np.maximum(amax, 6 * 2.0**-126) * f32(1 / 6)))
        else:
            scale = e4m3_rne(f32(np.maximum(amax, 6 * 2.0**-9) / 6))
        q = e2m1_rne(np.clip(xb / scale, -6, 6))
    out = f32((q * scale).reshape(x.shape))
    return bf16(out) if out_bf16 else out


FUNCS = {"fp8": fp8_fake_quant, "fp4_ue8m0": fp4_fake_quant_ue8m0, "fp4_e4m3": fp4_fake_quant_e4m3}


def check(x: torch.Tensor, kind: str, device: str) -> None:
    """The torch result equals the reference bit for bit (sign of zero included)."""
    out = FUNCS[kind](x.to(device))
    assert out.dtype == x.dtype and out.shape == x.shape and out.device.type == device
    got = out.cpu().double().numpy()
    want = ref_quant(x.double().numpy(), kind, x.dtype == torch.bfloat16)
    assert not np.isnan(want).any()
    bad = got.view(np.int64) != want.view(np.int64)
    xs = x.double().numpy()
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. x={xs[bad][:4]} got={got[bad][:4]} want={want[bad][:4]}"


def random_blocks(gen: torch.Generator, shape: tuple[int, ...], block: int) -> torch.Tensor:
    """Normal values with a random magnitude per block (1e-9 .. 1e9), so every scale regime appears."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    nb = shape[-1] // block
    mag = 10.0 ** (torch.rand(*shape[:-1], nb, 1, generator=gen, dtype=torch.float64) * 18 - 9)
    return (x.reshape(*shape[:-1], nb, block) * mag).reshape(shape)


# ---- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(FUNCS))
@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 5, 96), (4, 3, 2, 128), (257, 512)])
def test_random(kind: str, dtype: torch.dtype, device: str, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(hash((kind, shape)) % 2**31)
    block = 16 if kind == "fp4_e4m3" else 32
    check(random_blocks(gen, shape, block).to(dtype), kind, device)
    check((torch.randn(shape, generator=gen) * 3).to(dtype), kind, device)  # the model's usual range


def e4m3_values() -> np.ndarray:
    """All finite non-negative e4m3fn values, ascending."""
    sub = np.arange(8) * 2.0**-9
    normal = [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    v = np.concatenate([sub, normal])
    return v[v <= 448]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_ties(dtype: torch.dtype, device: str) -> None:
    """Values exactly halfway between adjacent e4m3 values (normal and subnormal) times a known power-of-two
    scale: amax = 256*2^k puts the scale at 2^k. The midpoints must be exactly representable in the input dtype
    (bf16 keeps 8 significant bits, enough below 16 but not for all midpoints)."""
    v = e4m3_values()
    mids = (v[:-1] + v[1:]) / 2
    mids = mids[mids < 256]
    if dtype == torch.bfloat16:
        mids = mids[bf16(mids) == mids]
    gen = np.random.default_rng(0)
    rows = []
    for k in (-20, -3, 0, 5, 40):
        vals = np.concatenate([mids, -mids])
        gen.shuffle(vals)
        n = (len(vals) + 30) // 31 * 31
        vals = np.resize(vals, n).reshape(-1, 31)
        rows.append(np.concatenate([np.full((len(vals), 1), 256.0), vals], axis=1) * 2.0**k)
    x = torch.from_numpy(np.concatenate(rows)).to(dtype)
    check(x, "fp8", device)
    # The scale really is 2^k and some ties are rounded down and some up (the test would be vacuous otherwise).
    out = fp8_fake_quant(x.float()).double().numpy()
    assert (np.abs(out) < np.abs(x.double().numpy())).any() and (np.abs(out) > np.abs(x.double().numpy())).any()


E2M1_MIDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["fp4_ue8m0", "fp4_e4m3"])
def test_fp4_ties(kind: str, dtype: torch.dtype, device: str) -> None:
    """Every e2m1 midpoint, both signs, times the block's scale. ue8m0: amax = 5*2^k -> scale 2^k. e4m3: amax =
    6*s for an e4m3 value s -> scale s (6*s/6 is exact)."""
    block = 16 if kind == "fp4_e4m3" else 32
    scales = [2.0**k for k in (-120, -10, 0, 7, 60)] if kind == "fp4_ue8m0" else [1.25 * 2.0**-5, 1.0, 1.75, 3.5 * 2**4]
    rows = []
    for s in scales:
        for sign_seed in range(3):
            signs = np.random.default_rng(sign_seed).choice([-1.0, 1.0], size=block - 1)
            vals = np.resize(E2M1_MIDS, block - 1) * signs
            amax = 5.0 if kind == "fp4_ue8m0" else 6.0
            rows.append(np.concatenate([[amax], vals]) * s)
    x = np.stack(rows)
    assert (x / x[:, :1]).all()
    xt = torch.from_numpy(x).to(dtype)
    assert (xt.double().numpy() == x).all()
    check(xt, kind, device)
    # ties resolved as the spec lists: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (in units of scale)
    out = FUNCS[kind](xt.float()).double().numpy()
    q = np.abs(out[:, 1:] / np.array(scales).repeat(3)[:, None])
    expect = dict(zip(E2M1_MIDS, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    assert (q == np.vectorize(expect.get)(np.abs(x[:, 1:] / np.array(scales).repeat(3)[:, None]))).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(FUNCS))
def test_extremes(kind: str, dtype: torch.dtype, device: str) -> None:
    block = 16 if kind == "fp4_e4m3" else 32
    big = 3e38  # bf16 shares fp32's range; fp4 may round such a block up to 2^128 = inf, as the reference does
    blocks = [
        np.zeros(block),
        -np.zeros(block),  # negative zeros (fp8 keeps the sign, fp4 turns them into +0)
        np.full(block, 0.7),
        np.full(block, -123.456),
        np.full(block, 1e-4),  # at the fp8 amax floor
        np.full(block, 0.9e-4),  # below it
        np.full(block, 6 * 2.0**-9),  # at the e4m3-scale floor
        np.full(block, 5e-3),
        np.full(block, 6 * 2.0**-126),  # at the ue8m0 floor
        np.full(block, 1e-38),  # fp32 subnormal-adjacent
        np.full(block, 1e-40),  # fp32 subnormals
        np.linspace(-1e-6, 1e-6, block),
        np.linspace(-2e-42, 3e-42, block),
        np.full(block, big),
        np.linspace(-big, big, block),
        np.full(block, 448.0),
        np.full(block, 2688.0),  # e4m3 scale exactly 448
        np.full(block, 5000.0),  # e4m3 scale saturates at 448
        np.concatenate([[1e6], np.full(block - 1, 1e-3)]),  # one large value flushes the small ones
        np.concatenate([[-0.0, 0.0], np.full(block - 2, -1e-30)]),
        np.ldexp(1.0, np.arange(block) - block // 2),  # powers of two around 1
        np.ldexp(1.0, np.arange(block) * 8 - 126),  # powers of two across the range
    ]
    x = torch.from_numpy(np.stack(blocks)).to(dtype)
    check(x, kind, device)
    check(x.reshape(-1), kind, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(FUNCS))
def test_scale_boundaries(kind: str, dtype: torch.dtype) -> None:
    """amax at and a few fp32 ulps around max*2^k (max = 448 for fp8, 6 for fp4), where the power-of-two ceiling
    (or the e4m3 rounding of the scale) changes."""
    m = 448.0 if kind == "fp8" else 6.0
    bits = np.array([np.float32(m * 2.0**k).view(np.uint32) for k in range(-12, 12)], dtype=np.int64)
    amax = (bits[:, None] + np.arange(-3, 4)).reshape(-1).astype(np.uint32).view(np.float32).astype(np.float64)
    block = 16 if kind == "fp4_e4m3" else 32
    # small ratios land in the e4m3 subnormals, where a scale off by one power of two changes the rounding
    ratios = np.concatenate([np.linspace(-1, 1, block // 2 - 1), 1.37 * 2.0 ** -np.arange(7, 7 + block // 2)])
    x = np.concatenate([amax[:, None], amax[:, None] * ratios], axis=1)
    check(torch.from_numpy(x).to(dtype), kind, "cpu")


@pytest.mark.parametrize("kind", list(FUNCS))
def test_skip_rule(kind: str) -> None:
    """A last dim that is not a multiple of the block is returned unchanged (the same tensor)."""
    for n in (8, 24, 40, 100):
        if n % (16 if kind == "fp4_e4m3" else 32) == 0:
            continue
        x = torch.randn(3, n).to(torch.bfloat16)
        assert FUNCS[kind](x) is x
    x = torch.randn(2, 48)
    if kind == "fp4_e4m3":
        assert not torch.equal(FUNCS[kind](x), x)  # 48 is a multiple of 16
    else:
        assert FUNCS[kind](x) is x


def test_block_argument() -> None:
    """The block size is a parameter: fp8 with 16-channel blocks quantises each half-block on its own scale."""
    x = torch.cat([torch.full((16,), 1e5), torch.full((16,), 0.01)]).reshape(1, 32)
    small = fp8_fake_quant(x, block=16)
    assert small[0, 16:].eq(fp8_fake_quant(torch.full((1, 16), 0.01), block=16)).all()
    assert fp8_fake_quant(x, block=32)[0, 16:].eq(0).all()  # one shared scale flushes the small half
