"""FP8 block-scaled dense linear: y = x @ W.T with W stored as e4m3 bytes and one scale per (bn x bk) block.

Format (dsv4/quant/formats.py): `w.data` float8_e4m3fn [N, K], `w.scale` [ceil(N/bn), ceil(K/bk)] as UE8M0 bytes
(uint8 e: 2^(e-127)) or float32, `w.block` = (bn, bk): (128, 128) on V4, (32, 32) on V4.1. A partial last block along
N or K shares its block's scale. The logical weight is data * scale, exact in fp32.

`groups` > 1 is the attention's grouped output projection (`grouped_projection` in dsv4/models/layers/attention.py):
x [..., G*K] is G contiguous chunks of K, W [G*Ng, K], and output column n reads chunk n // Ng.

The reference (`fp8_linear_torch`) dequantizes in fp32, rounds once to x's dtype and runs F.linear (bmm for groups):
bit-identical to a model whose weight was dequantized at load, the project's reference path.

Kernels (Triton, one launch, plus a small fixed-order reduction launch for split-K):
* W8A16 (`fp8_linear_triton`): the FP8 tile is loaded as bytes and converted to x's dtype in registers (exact: every
  e4m3 value is a bf16/fp16/fp32 value), multiplied on the tensor cores with fp32 accumulation, and the block scale
  is applied to the fp32 partial product of each K-tile (BLOCK_K divides bk, so one scale per (row, K-tile); a
  per-row scale vector, index n // bn, covers bn < BLOCK_N). Blocks narrower than 128 (V4.1's 32) would make the
  K-tiles that narrow, so there the tile is 128 wide and its weights are scaled before the MMA (fp32 code * scale,
  rounded to x's dtype: the reference's weight, exact for UE8M0 scales). Each tile's product starts from zero and
  is promoted into the fp32 accumulator, so the tensor cores' truncating accumulation spans one K-tile only. The
  product is computed transposed, acc[n, m] = W[n, :] . x[m, :] ("swap AB"): the converted weight is the MMA's A operand
  (which Hopper's wgmma takes from registers, so it need not go back through shared memory) and N, not the tiny
  decode M, fills the MMA's 64-row M dimension.
  Decode (M <= 64, memory-bound): all M rows in one tile, so the weight is read once; when the N tiles are too few
  to fill the SMs, split-K writes fp32 partials [SPLIT, M, N] that a second launch sums in a fixed order (no
  atomics: run-to-run identical). Prefill: a tiled GEMM (128 x 128 tiles, grouped ordering for L2 reuse).
* W8A8 (`fp8_linear_w8a8_triton`, prefill experiment): x quantized on the fly per (row, bk block) to e4m3 with an
  fp32 scale amax/448, FP8 x FP8 tl.dot, both scales applied per K-tile (BLOCK_K = bk). Not equal to the reference
  (the activations are rounded to 3 mantissa bits); it exists to compare with W8A16 at prefill shapes.
Everything is shape-static on the host (no .item(), no host sync): CUDA-graph capturable. Outputs are rounded to
x's dtype to nearest-even (by hand under TRITON_INTERPRET, whose fp32 -> bf16 cast truncates).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsv4.ops.moe_quant import expert_gemv_q_triton
from dsv4.quant.weight import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


# ---- reference ---------------------------------------------------------------------------------------------------
def dense_linear(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [..., G*K] @ weight [G*Ng, K] per group (`groups` = G) -> [..., G*Ng], in the dtypes given. groups > 1 runs
    the ops of `grouped_projection` (reshape, bmm, transpose back), so it gives exactly what that function gives."""
    if groups == 1:
        return F.linear(x, weight)
    lead, (N, K) = x.shape[:-1], weight.shape
    grouped = x.reshape(-1, groups, K).transpose(0, 1)  # [G, T, K]
    y = torch.bmm(grouped, weight.view(groups, N // groups, K).transpose(1, 2))  # [G, T, Ng]
    return y.transpose(0, 1).reshape(*lead, N)


def _check(x: torch.Tensor, w: QuantWeight, groups: int) -> None:
    """Shapes of an FP8 block-scaled linear; raises ValueError when they do not fit."""
    if w.fp4 or w.data.dim() != 2 or w.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected an FP8 e4m3 weight [N, K], got {w.data.dtype} {list(w.data.shape)}")
    N, K = w.data.shape
    if groups < 1 or N % groups or x.shape[-1] != groups * K:
        raise ValueError(f"x [..., {x.shape[-1]}] does not fit weight [{N}, {K}] with {groups} groups")


def fp8_linear_torch(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """Reference: the weight dequantized in fp32 and rounded once to x's dtype, then F.linear (groups: the grouped
    projection). x [..., G*K] -> [..., N] in x.dtype."""
    _check(x, w, groups)
    return dense_linear(x, w.dequantize(x.dtype), groups)


# ---- Triton ------------------------------------------------------------------------------------------------------
_PREFILL_M = 64  # above this many rows: the tiled GEMM; at most this many: one M tile (the weight read once)
DECODE_ROWS = _PREFILL_M  # fp8_linear: the W8A16 kernel up to this many rows, dequantize + cuBLAS above
_REDUCE_BLOCK = 1024

if triton is not None:
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def _tile(M, TILES_N, GROUP_N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's rows m [BLOCK_M], group g, global output columns n [BLOCK_N] and their mask. Programs run
        GROUP_M row tiles per column tile before moving on (the x tiles stay in L2 across the column tiles); a
        column tile lies in one group (TILES_N tiles of the group's GROUP_N columns)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        per_band = GROUP_M * (tl.num_programs(0) // num_m)
        first_m = (pid // per_band) * GROUP_M
        band_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_band) % band_m
        pid_n = (pid % per_band) // band_m
        g = pid_n // TILES_N
        n_in_group = (pid_n % TILES_N) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        return m, g, g * GROUP_N + n_in_group, n_in_group < GROUP_N

    @triton.jit
    def _block_scale(ptr, mask, E8M0: tl.constexpr):
        """fp32 multipliers of the scales at ptr: UE8M0 bytes decoded from bits (as e8m0_to_float: 0 is 2^-127,
        255 NaN), or float32 as stored."""
        if E8M0:
            e = tl.load(ptr, mask=mask, other=127).to(tl.int32)
            bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
            return bits.to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _rne_e4m3(v):
        """fp32 |v| <= 448 -> the nearest e4m3 value (ties to even), as fp32: the interpreter's fp8 cast truncates.
        The spacing is 2^(e-3) for normal exponents e >= -6 and 2^-9 below; 1.5 * 2^23 rounds to an integer."""
        a = tl.abs(v)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        r = ((a / step + 12582912.0) - 12582912.0) * step
        return tl.where(v < 0, -r, r)

    @triton.jit
    def _store(out_ptr, acc, m, n, mmask, nmask, M, N, TRANSPOSED: tl.constexpr, PARTIAL: tl.constexpr,
               INTERPRET: tl.constexpr):
        """acc ([n, m] when TRANSPOSED, else [m, n]) -> out [M, N] rounded to its dtype, or, split-K, the fp32
        partial of this split at ws [SPLIT, M, N]."""
        if TRANSPOSED:
            off = m.to(tl.int64)[None, :] * N + n[:, None]
            mask = nmask[:, None] & mmask[None, :]
        else:
            off = m.to(tl.int64)[:, None] * N + n[None, :]
            mask = mmask[:, None] & nmask[None, :]
        if PARTIAL:
            tl.store(out_ptr + tl.program_id(1).to(tl.int64) * M * N + off, acc, mask=mask)
        else:
            tl.store(out_ptr + off, cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)

    @triton.jit
    def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, s_stride, bn, bk, TILES_N, GROUP_N, K_SPLIT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      KS: tl.constexpr, E8M0: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
        m, g, n, nmask = _tile(M, TILES_N, GROUP_N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = m < M
        x_cols = x_ptr + m.to(tl.int64)[None, :] * x_stride + g * K  # x^T tile [BLOCK_K, BLOCK_M]: group g's chunk
        w_rows = w_ptr + n.to(tl.int64)[:, None] * K  # W tile [BLOCK_N, BLOCK_K]
        s_rows = s_ptr + (n // bn) * s_stride  # each row's scale row (bn < BLOCK_N: several per tile)
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        k_lo = tl.program_id(1) * K_SPLIT  # K_SPLIT is a multiple of BLOCK_K: no tile straddles two splits
        for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            wt = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_cols + k[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
            # fp32 x: full-precision products (not TF32), the fp32 path must match the CPU's. The interpreter
            # multiplies 16-bit tiles as raw bits, so there they go through fp32 (their products are exact in it)
            if KS > 1:  # KS scale blocks across the tile: scale the weights (the reference's w * s, rounded to x's
                # dtype: exact for UE8M0), so one wide MMA replaces KS narrow ones
                sc = k0 // bk + tl.arange(0, KS)
                s = _block_scale(s_rows[:, None] + sc[None, :], nmask[:, None] & (sc < tl.cdiv(K, bk))[None, :], E8M0)
                ws = tl.reshape(tl.reshape(wt.to(tl.float32), [BLOCK_N, KS, BLOCK_K // KS]) * s[:, :, None],
                                [BLOCK_N, BLOCK_K])
                if INTERPRET or dt == tl.float32:
                    acc += tl.dot(cast_rne(ws, dt, INTERPRET).to(tl.float32), xt.to(tl.float32),
                                  input_precision="ieee")
                else:
                    acc += tl.dot(ws.to(dt), xt)
            else:
                if INTERPRET or dt == tl.float32:
                    part = tl.dot(wt.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(wt.to(dt), xt)
                acc += part * _block_scale(s_rows + k0 // bk, nmask, E8M0)[:, None]
        _store(out_ptr, acc, m, n, mmask, nmask, M, N, True, PARTIAL, INTERPRET)

    @triton.jit
    def _w8a8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, s_stride, bn, TILES_N, GROUP_N, K_SPLIT,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     E8M0: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
        # BLOCK_K = bk: a K-tile is one activation quantization group and one weight scale column
        m, g, n, nmask = _tile(M, TILES_N, GROUP_N, BLOCK_M, BLOCK_N, GROUP_M)
        mmask = m < M
        x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride + g * K  # x tile [BLOCK_M, BLOCK_K]
        w_cols = w_ptr + n.to(tl.int64)[None, :] * K  # W^T tile [BLOCK_K, BLOCK_N] (K-major, as fp8 MMAs want)
        s_rows = s_ptr + (n // bn) * s_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_lo = tl.program_id(1) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xa = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            wt = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            # per-row scale amax/448 (at least 2^-126, as quantize_fp8: an all-zero row gets codes 0, not NaN);
            # one reciprocal per row, then a multiply per element
            sx = tl.maximum(tl.max(tl.abs(xa), axis=1) / 448.0, 1.1754943508222875e-38)
            q = tl.minimum(tl.maximum(xa * (1.0 / sx)[:, None], -448.0), 448.0)
            if INTERPRET:  # e4m3 values kept in fp32 (exact), products in fp32 (exact too)
                part = tl.dot(_rne_e4m3(q), wt.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(q.to(tl.float8e4nv), wt)
            acc += part * sx[:, None] * _block_scale(s_rows + k0 // BLOCK_K, nmask, E8M0)[None, :]
        _store(out_ptr, acc, m, n, mmask, nmask, M, N, False, PARTIAL, INTERPRET)

    @triton.jit
    def _split_sum_kernel(ws_ptr, out_ptr, MN, SPLIT, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
        # the split-K partials [SPLIT, M*N] summed in split order: the same bits on every run (SPLIT is a runtime
        # loop bound: one compile for every split count)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.load(ws_ptr + i, mask=mask, other=0.0)
        for s in range(1, SPLIT):
            acc += tl.load(ws_ptr + s * MN + i, mask=mask, other=0.0)
        tl.store(out_ptr + i, cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, s_stride, bn, bk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        E8M0: tl.constexpr, INTERPRET: tl.constexpr):
        # one [BLOCK_N, BLOCK_K] tile: fp32 code * scale, rounded once to the output dtype (the reference's numbers)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (n < N)[:, None] & (k < K)[None, :]
        off = n.to(tl.int64)[:, None] * K + k[None, :]
        w = tl.load(w_ptr + off, mask=mask, other=0.0).to(tl.float32)
        s = _block_scale(s_ptr + (n // bn)[:, None] * s_stride + (k // bk)[None, :], mask, E8M0)
        tl.store(out_ptr + off, cast_rne(w * s, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def dequantize_triton(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """`w.dequantize(dtype)` in one launch (the same numbers: fp32 code * scale, one rounding to `dtype`)."""
    assert triton is not None, "triton is not installed"
    N, K = w.data.shape
    out = torch.empty(N, K, dtype=dtype, device=w.data.device)
    scale = w.scale.view(torch.uint8) if w.scale.dtype == getattr(torch, "float8_e8m0fnu", None) else w.scale
    e8m0 = scale.dtype == torch.uint8
    scale = scale.contiguous() if e8m0 else scale.float().contiguous()
    grid = (triton.cdiv(N, 32), triton.cdiv(K, 128))
    _dequant_kernel[grid](w.data.contiguous(), scale, out, N, K, scale.stride(0), *w.block, BLOCK_N=32, BLOCK_K=128,
                          E8M0=e8m0, INTERPRET=INTERPRET)
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 on an H200; the interpreter's CPU gets that too)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    return min(n & -n, cap)


def _config(M: int, Ng: int, G: int, K: int, bk: int, w8a8: bool, fp32: bool, sms: int) -> dict[str, int]:
    """Tile sizes, split count and launch options for an [M, G*K] x [G*Ng, K]^T product. Shapes only (host ints):
    the same config on every call with these shapes, so capture and replay see one kernel. Untuned guesses to be
    settled on the H200 with benchmarks/fp8_linear_bench.py --override."""
    if w8a8:
        if bk & (bk - 1) or not 32 <= bk <= 128:
            raise ValueError(f"W8A8 needs bk in (32, 64, 128) (one K-tile per quantization group), got {bk}")
        block_k = bk
    else:
        block_k = _pow2_divisor(bk, 32 if fp32 else 128)  # one weight scale per (row, K-tile)
        if block_k < 16:
            raise ValueError(f"bk = {bk} has no power-of-two divisor >= 16 to tile K with")
        if not fp32 and block_k == bk < 128 and 128 % bk == 0:
            block_k = 128  # V4.1's 32-wide blocks: 4 scales a tile, applied to the weights (KS > 1 in the kernel)
    if M <= _PREFILL_M:  # decode: one M tile; W8A16 keeps >= 8 KB of weight per K-step in flight per program
        block_m = 64 if w8a8 else max(16, triton.next_power_of_2(M))  # W8A8: FP8 MMAs want 64 rows (wgmma)
        # wider than 8 KB / BLOCK_K only to cut the x tile re-reads (one per column tile), and only while there
        # are enough column tiles for the SMs
        floor_n = 128 if w8a8 else 8192 // block_k
        block_n = max(floor_n, min(256, 4 * block_m))
        while block_n > floor_n and triton.cdiv(M, block_m) * G * triton.cdiv(Ng, block_n) < sms:
            block_n //= 2
        stages = 4
    else:  # prefill: 128 x 128 tiles
        block_m, block_n = (64 if M <= 128 else 128), 128
        stages = 3 if block_k >= 128 else 4
    if fp32:  # fp32 x multiplies on the CUDA cores (ieee dot): smaller tiles, fewer registers
        block_m, block_n = min(block_m, 64), min(block_n, 64)
    block_n = min(block_n, max(16, triton.next_power_of_2(Ng)))
    tiles = triton.cdiv(M, block_m) * G * triton.cdiv(Ng, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    if tiles < sms:  # too few programs for the SMs: split K, while the fp32 partials [split, M, N] (L2-resident
        # between the two launches) stay within the weight's bytes: 4 M N split <= N K
        split = max(1, min(k_tiles, triton.cdiv(sms, tiles), K // (4 * min(M, _PREFILL_M))))
    # the scaled-weights path holds the tile in fp32 too: 8 warps from 128 rows on (<= 64 fp32 a thread)
    wide = block_m * block_n >= 128 * 64 or (block_k > bk and block_n * block_k >= 128 * 128)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, split=split,
                num_warps=8 if wide else 4, num_stages=stages)


def _launch(x: torch.Tensor, w: QuantWeight, groups: int, w8a8: bool, **override: int) -> torch.Tensor:
    """Both kernels' host side: flatten x to [M, G*K], pick the config (`override` replaces its entries, for tests
    and tuning), launch, and sum the split-K partials when there are several."""
    assert triton is not None, "triton is not installed"
    _check(x, w, groups)
    (N, K), (bn, bk) = w.data.shape, w.block
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0 or K == 0:
        return out.zero_().view(*lead, N)
    data = w.data.contiguous()
    scale = w.scale.view(torch.uint8) if w.scale.dtype == getattr(torch, "float8_e8m0fnu", None) else w.scale
    e8m0 = scale.dtype == torch.uint8
    scale = scale.contiguous() if e8m0 else scale.float().contiguous()
    cfg = _config(M, N // groups, groups, K, bk, w8a8, x.dtype == torch.float32, _num_sms(x.device))
    cfg.update(override)
    k_split = triton.cdiv(triton.cdiv(K, cfg["BLOCK_K"]), cfg.pop("split")) * cfg["BLOCK_K"]  # whole K-tiles
    split = triton.cdiv(K, k_split)  # no empty split
    dst = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    tiles = triton.cdiv(N // groups, cfg["BLOCK_N"])
    ks = max(1, cfg["BLOCK_K"] // bk)  # scale blocks across a K-tile (BLOCK_K a multiple of bk when above it)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * groups * tiles, split)
    if w8a8:
        _w8a8_kernel[grid](x2, data, scale, dst, M, N, K, x2.stride(0), scale.stride(0), bn, tiles, N // groups,
                           k_split, E8M0=e8m0, PARTIAL=split > 1, INTERPRET=INTERPRET, **cfg)
    else:
        _w8a16_kernel[grid](x2, data, scale, dst, M, N, K, x2.stride(0), scale.stride(0), bn, bk, tiles,
                            N // groups, k_split, KS=ks, E8M0=e8m0, PARTIAL=split > 1, INTERPRET=INTERPRET, **cfg)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(M * N, _REDUCE_BLOCK),)](dst, out, M * N, split, BLOCK=_REDUCE_BLOCK,
                                                              INTERPRET=INTERPRET)
    return out.view(*lead, N)


def fp8_linear_triton(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """`fp8_linear_torch` as a W8A16 Triton kernel (one launch, two with split-K); equal to the reference up to the
    fp32 accumulation order and the output's rounding. No host sync: CUDA-graph capturable."""
    return _launch(x, w, groups, w8a8=False)


def fp8_linear_w8a8_triton(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """The same product with x quantized on the fly per (row, bk block) to e4m3 (fp32 scale amax/448) and FP8 x FP8
    MMAs: NOT equal to the reference (each activation carries a relative rounding error up to 2^-4); for measuring
    W8A8 against W8A16 at prefill shapes."""
    return _launch(x, w, groups, w8a8=True)


def fp8_linear_dequant(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """Prefill: the weight dequantized to x's dtype in one launch, then the dense (cuBLAS) product. It writes and
    reads the weight again in 16 bits (5 bytes an element instead of 1), which a GEMM of many rows hides; the
    result is bit-identical to the reference's, which multiplies the same numbers with the same call."""
    _check(x, w, groups)
    return dense_linear(x, dequantize_triton(w, x.dtype), groups)


def _as_groups(w: QuantWeight, groups: int) -> QuantWeight | None:
    """The weight [G*Ng, K] as G "experts" [G, Ng, K] for the gemv of dsv4/ops/moe_quant.py (views, no copies), or
    None when a group's rows do not start on a scale block (Ng % bn)."""
    (N, K), bn = w.data.shape, w.block[0]
    if groups > 1 and (N // groups) % bn:
        return None
    return QuantWeight(w.data.view(groups, N // groups, K), w.scale.view(groups, -1, w.scale.shape[-1]), w.block)


def gemv_config(N: int, groups: int = 1, bk: int = 128) -> dict[str, int]:
    """Tiles of the one-row gemv (block_n rows x block_k columns a program per step) by output width, from the H200
    sweep of benchmarks/fp8_linear_bench.py --methods gemv --gemv-config (benchmarks/results/*-h200-quant-gemv):
    narrow outputs give few programs, so each takes fewer rows and more columns with more warps. V4's grouped output
    projection (wo_a: 8 groups of [1024, 4096], scale blocks of 128) runs 16 x 512 tiles: 15.0 us against 17.3 with
    8 x 512 on the H200 (benchmarks/results/2026-12-04-h200-gemv-forms-prefill-blocks/gemv_pipeline.log; V4.1's, with
    blocks of 32, was not measured)."""
    if groups > 1 and bk >= 128:
        return dict(block_n=16, block_k=512, num_warps=4)
    if N <= 2048:
        return dict(block_n=8, block_k=1024, num_warps=8)
    if N < 16384:
        return dict(block_n=8, block_k=512, num_warps=4)
    return dict(block_n=16, block_k=256, num_warps=4)


def fp8_gemv_triton(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """One row (batch-1 decode): `fp8_linear_torch` on the CUDA cores, the FP8 expert gemv of dsv4/ops/moe_quant.py
    run on the weight's G groups as G experts (a program per (group, block of outputs), bytes decoded in registers,
    fp32 products). The W8A16 kernel pads one row to a 16-wide MMA and converts every weight to bf16 for it; this
    reads the bytes once with fewer instructions a weight (H200: 0.5-0.9x its time)."""
    _check(x, w, groups)
    w3 = _as_groups(w, groups)
    if w3 is None or x.numel() != x.shape[-1]:
        raise ValueError("fp8_gemv_triton takes one row and groups that start on a scale block")
    N, K = w.data.shape
    out = expert_gemv_q_triton(x.reshape(groups, K), w3, None, 1, gemv_config(N, groups, w.block[1]))
    return out.view(*x.shape[:-1], N)


def fp8_linear(x: torch.Tensor, w: QuantWeight, groups: int = 1) -> torch.Tensor:
    """On CUDA: one row (batch-1 decode) `fp8_gemv_triton`; up to DECODE_ROWS rows the W8A16 kernel, which reads the
    FP8 bytes once; more rows (prefill) `fp8_linear_dequant` (faster than both Triton GEMMs there:
    benchmarks/results/*-h200-quant). The torch reference elsewhere (and for a K block the kernel cannot tile: bk
    without a power-of-two divisor >= 16; the released checkpoints' 128 and 32 are fine)."""
    if x.is_cuda and triton is not None and w.block[1] % 16 == 0:
        rows = x.numel() // x.shape[-1]
        if rows == 1 and _as_groups(w, groups) is not None and w.data.shape[1] % 4 == 0:
            return fp8_gemv_triton(x, w, groups)
        if rows <= DECODE_ROWS:
            return fp8_linear_triton(x, w, groups)
        return fp8_linear_dequant(x, w, groups)
    return fp8_linear_torch(x, w, groups)
