"""Routed-expert matmuls computed from the stored low-precision expert weights (no dequantized copy in memory).

The products of dsv4/ops/moe.py, out[r] = W[idx[r]] @ x[r // x_div], with the same contracts (idx -1: a row of zeros
and no weight read; fp32 accumulation; output in x's dtype), where W is a `QuantWeight` [E, N, K]:
- MXFP4 (W4A16): `data` uint8 [E, N, K/2], two e2m1 values a byte along K (low nibble = even column); a nibble is
  sign | 2 exponent bits | 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (8 is -0). `scale`: one
  UE8M0 byte per 32 values along K, [E, N, K/32], the multiplier 2^(byte - 127). Blocks of (1, 32).
- FP8: `data` e4m3 [E, N, K], `scale` [E, ceil(N/bn), ceil(K/bk)] UE8M0 bytes or float32, blocks (bn, bk), e.g.
  (128, 128); a partial last block shares its block's scale.
The logical weight is `w.dequantize(x.dtype)`: decoded in fp32 (a 2- or 4-bit significand times a power of two is
exact; times a float32 scale, rounded once) and rounded once to x's dtype (exact for UE8M0 scales). The torch
references compute with exactly that, bit-identical to a model whose experts were dequantized at load. The kernels
form the same weight values in registers, so they differ from the references only in the order of the fp32 sums
(and, for bf16 x, in the output's one rounding, which that order can move).

Kernels. Both read the stored bytes in place as int32 words (8 MXFP4 or 4 FP8 values, one 16-byte vector load per
row and group) and their scales as a [BLOCK_N, G] tile: a K tile is G groups of SUB columns that share one scale
(SUB = 32 for MXFP4, min(bk, 16) for FP8; bk a power of two), index scale[e, n // bn, k // bk] for both formats.
Decoding: a word becomes one fp32 tensor per value position ("planes"). An e2m1 nibble s|e e|m is moved into the
e4m3 byte s 0 0 e e m 0 0, the same value times 2^-6 (e2m1's subnormal 0.5 lands on e4m3's subnormal 2^-7; the 2^6
goes into the scale multiplier), so both formats go through the hardware e4m3 -> f16 conversion, two values per
instruction straight from the word's halves with inline PTX on NVIDIA GPUs (`PTX_DECODE`; the same math in Triton ops
costs ~30% more instructions in the gemv's loop, and is what the CPU interpreter runs).
- `expert_gemv_q_triton` (decode: small batches, fixed shapes, CUDA-graph capturable, no host sync): a program per
  (row, block of BLOCK_N outputs) streams its expert's rows, the next tile's words, scales and x prefetched into
  registers while this one is decoded; products in fp32 FMA, one partial per (row, group) scaled once by the group's
  power of two (float scales with a narrower x: the weight is scaled and rounded to x's dtype first, as the
  reference). Memory bound in principle: an MXFP4 weight is 0.5 byte (plus 1/32 of scale), so at H200 bandwidth an
  SM has ~4 instructions a weight; the loop compiles to ~5 (sm_90), about the limit. Programs run rows-first, so the
  rows routed to the same expert read its bytes at about the same time (the later reads mostly from L2); a program
  per expert over all its rows would read each expert once by construction (not done here).
- `expert_grouped_q_triton` (prefill / mixed steps): rows sorted by expert on the device, up to BLOCK_M rows of one
  expert per program (the scheme of `expert_grouped_triton`: grid sized for the worst case, no host sync). The
  product is computed transposed, W_tile @ x_rows^T, so the tile decoded to x's dtype in registers is wgmma's A
  operand (Triton still moves it into the MMA's register layout through shared memory: an STS / LDSM pair and a
  barrier each K step, benchmarks/grouped_q_sass.py), and BLOCK_M (wgmma's N) can be as small as 16; it is
  chosen from the mean rows per expert, because every block decodes its expert's weights again. The next K tile's
  words and scales (and, in decode-sized blocks, x rows) are in flight while this one is decoded. fp32 accumulation
  (IEEE products for fp32 x).
  A MoE layer builds the row plan (`dsv4.ops.moe.group_rows`: one launch at decode sizes) once for both matmuls.
Limits of the Triton paths (the torch paths have none): an MXFP4 scale byte above 248 (a multiplier above 2^121)
overflows with the folded 2^6; the data's last dim must be a multiple of 4 bytes.
"""

from __future__ import annotations

import torch

from dsv4.ops.moe import RowPlan, expert_gemv_torch, expert_grouped_torch, group_rows
from dsv4.quant.weight import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


# ---- torch references -------------------------------------------------------------------------------------------
def _used_experts(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts `idx` names, dequantized to x's dtype (only those), and idx renumbered onto them (-1 kept). They
    keep their order, so a reference runs the same calls on the same values as on the whole dequantized weight."""
    used, local = torch.unique(idx.clamp(min=0), return_inverse=True)
    return w[used].dequantize(x.dtype), torch.where(idx < 0, -1, local)


def expert_gemv_q_torch(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Reference: `expert_gemv_torch` on the experts' weights `w.dequantize(x.dtype)` (bit-identical)."""
    return expert_gemv_torch(x, *_used_experts(x, w, idx), x_div)


def expert_grouped_q_torch(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Reference: `expert_grouped_torch` on `w.dequantize(x.dtype)` (one F.linear per expert over its rows:
    bit-identical)."""
    return expert_grouped_torch(x, *_used_experts(x, w, idx), x_div)


# ---- Triton -----------------------------------------------------------------------------------------------------
# Tile sizes (module-level so a benchmark on the GPU can sweep them). The gemv tiles move 4 KB of weight bytes per
# program per iteration in either format (plus the next iteration's, prefetched).
GEMV_Q_CONFIG = {"fp4": dict(block_n=16, block_k=512, num_warps=4), "fp8": dict(block_n=16, block_k=256, num_warps=4)}
# prefetch_x_max_block_m: blocks of at most this many rows (decode steps: few routes per expert) load the next K
# tile's x rows with its weights. H200 (benchmarks/results/2026-12-03-h200-grouped-experts-decode): V4-Flash shapes
# at T=1 (blocks of 16) 103.6 -> 84.0 us (gate_up) and 64.9 -> 40.9 us (down); at T=32 over 256 experts +6%
# (a case the dispatch sends to the gemv); a 32 x 512 prefill (blocks of 64) took 280 ms with it on every block
# against 240-263 before, and compiled for sm_90 it takes 64-row blocks from 168 to 251 registers
# (benchmarks/grouped_q_sass.py): off there.
# max_block_m: prefill blocks. Every block decodes its expert's weights again, so a 64-row block spent about as many
# instructions decoding as the tensor cores took for its products; 256-row blocks (8 warps from wide_block_m rows on:
# at 4 warps a 128-row block needs 254 registers) decode a weight once per 256 rows. H200, V4-Flash-4l released,
# 32 x 512 prefill (benchmarks/results/2026-12-04-h200-gemv-forms-prefill-blocks): 267 ms with blocks of 64, 242 with
# 128, 225 with 256 (bf16: 237). fp32 x (IEEE products, x tiles twice the bytes) keeps blocks of at most 64.
GROUPED_Q_CONFIG = dict(block_n=64, block_k=128, block_k_fp32=64, num_warps=4, block_m=None, max_block_m=256,
                        max_block_m_fp32=64, wide_block_m=128, num_warps_wide=8, prefetch_x_max_block_m=32)
# Decode the words with inline PTX on NVIDIA GPUs (MXFP4: 7 integer ops, 4 e4m3x2 -> f16x2 and 8 f16 -> f32
# conversions per 8 values) rather than the same math in Triton ops, which the compiler spreads over byte extracts
# and repacks (sm_90: 6.1-6.4 instead of 4.7-5.0 instructions a weight in the gemv's loop, which is near the ALU's
# share of HBM bandwidth). False: Triton ops everywhere (what the CPU interpreter always runs).
PTX_DECODE = True

if triton is not None:
    from dsv4.ops.moe import block_rows
    from dsv4.ops.rmsnorm import INTERPRET, cast_rne  # the interpreter's fp32 -> bf16 cast truncates

    @triton.jit
    def _load_scales(s_ptr, n, nm, kg, SK, lim, BN: tl.constexpr, BK: tl.constexpr):
        """The raw scales [BLOCK_N, G] of rows n and the column groups starting at kg: scale[n // BN, kg // BK]
        (groups from column `lim` on masked)."""
        return tl.load(s_ptr + (n // BN)[:, None] * SK + (kg // BK)[None, :], mask=nm[:, None] & (kg < lim)[None, :],
                       other=0)

    @triton.jit
    def _multipliers(s, FP4: tl.constexpr, UE8M0: tl.constexpr):
        """Raw scales -> fp32 multipliers, times 2^6 for MXFP4 (its values are decoded as e4m3 bytes worth 2^-6 of
        them). UE8M0: 2^(byte - 127) from bits, e8m0_to_float's values (byte 0 the subnormal 2^-127, 255 NaN)."""
        if UE8M0:
            e = s.to(tl.int32) + (6 if FP4 else 0)
            bits = tl.where(e == 0, 0x00400000, e << 23)
            return tl.where(s == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)
        return s.to(tl.float32) * (64.0 if FP4 else 1.0)

    @triton.jit
    def _load_weights(w_ptr, n, nm, kg, KW, lim, W: tl.constexpr, VPW: tl.constexpr):
        """The stored weights of rows n, columns kg + [0, W * VPW), as int32 words [BLOCK_N, G, W] of VPW values
        (little-endian; MXFP4: 8, byte i holding columns 2i, 2i + 1; FP8: 4), one 16-byte vector load per row and
        group. KW: words a row; words from `lim` on are masked."""
        kw = (kg // VPW)[None, :, None] + tl.arange(0, W)[None, None, :]
        return tl.load(w_ptr + n[:, None, None] * KW + kw, mask=nm[:, None, None] & (kw < lim), other=0)

    @triton.jit
    def _e4m3(byte):
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _planes(u, FP4: tl.constexpr, PTX: tl.constexpr):
        """Words -> fp32 tensors of u's shape, one per value of a word in column order: 4 e4m3 values (FP8), or 8
        e2m1 values each times 2^-6 (MXFP4). A nibble s|e e|m becomes the e4m3 byte s 0 0 e e m 0 0, the same value
        times 2^-6 (e2m1's subnormal 0.5 lands on e4m3's subnormal 2^-7), four at a time: `ev` holds the even
        columns' bytes, `od` the odd ones'. With PTX the e4m3 pairs go through one conversion each straight from
        the word's halves (lop3 0xE4: bits of the first operand where the mask is set, of the second elsewhere)."""
        if FP4:
            if PTX:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 ev, od, t, h0, h1, h2, h3;
                    .reg .b16 lo, hi;
                    shl.b32 ev, $8, 2;
                    shl.b32 t, $8, 4;
                    lop3.b32 ev, ev, t, 0x1C1C1C1C, 0xE4;
                    and.b32 ev, ev, 0x9C9C9C9C;
                    shr.u32 od, $8, 2;
                    lop3.b32 od, od, $8, 0x1C1C1C1C, 0xE4;
                    and.b32 od, od, 0x9C9C9C9C;
                    mov.b32 {lo, hi}, ev;
                    cvt.rn.f16x2.e4m3x2 h0, lo;
                    cvt.rn.f16x2.e4m3x2 h2, hi;
                    mov.b32 {lo, hi}, od;
                    cvt.rn.f16x2.e4m3x2 h1, lo;
                    cvt.rn.f16x2.e4m3x2 h3, hi;
                    mov.b32 {lo, hi}, h0;
                    cvt.f32.f16 $0, lo;
                    cvt.f32.f16 $2, hi;
                    mov.b32 {lo, hi}, h1;
                    cvt.f32.f16 $1, lo;
                    cvt.f32.f16 $3, hi;
                    mov.b32 {lo, hi}, h2;
                    cvt.f32.f16 $4, lo;
                    cvt.f32.f16 $6, hi;
                    mov.b32 {lo, hi}, h3;
                    cvt.f32.f16 $5, lo;
                    cvt.f32.f16 $7, hi;
                    }""",
                    "=r,=r,=r,=r,=r,=r,=r,=r,r", [u], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
            else:
                u = u.to(tl.uint32, bitcast=True)
                ev = ((u << 2) & 0x1C1C1C1C) | ((u << 4) & 0x80808080)
                od = ((u >> 2) & 0x1C1C1C1C) | (u & 0x80808080)
                return (_e4m3(ev), _e4m3(od), _e4m3(ev >> 8), _e4m3(od >> 8), _e4m3(ev >> 16), _e4m3(od >> 16),
                        _e4m3(ev >> 24), _e4m3(od >> 24))
        else:
            if PTX:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 h0, h1;
                    .reg .b16 lo, hi;
                    mov.b32 {lo, hi}, $4;
                    cvt.rn.f16x2.e4m3x2 h0, lo;
                    cvt.rn.f16x2.e4m3x2 h1, hi;
                    mov.b32 {lo, hi}, h0;
                    cvt.f32.f16 $0, lo;
                    cvt.f32.f16 $1, hi;
                    mov.b32 {lo, hi}, h1;
                    cvt.f32.f16 $2, lo;
                    cvt.f32.f16 $3, hi;
                    }""",
                    "=r,=r,=r,=r,r", [u], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
            else:
                u = u.to(tl.uint32, bitcast=True)
                return _e4m3(u), _e4m3(u >> 8), _e4m3(u >> 16), _e4m3(u >> 24)

    @triton.jit
    def _load_x(xrow, kg, K, W: tl.constexpr, VPW: tl.constexpr):
        """x's columns kg + [0, W * VPW) as fp32 [G, W, VPW] (one contiguous load a group)."""
        xk = kg[:, None, None] + tl.arange(0, W)[None, :, None] * VPW + tl.arange(0, VPW)[None, None, :]
        return tl.load(xrow + xk, mask=xk < K, other=0.0).to(tl.float32)

    @triton.jit
    def _x_planes(xv, G: tl.constexpr, W: tl.constexpr, VPW: tl.constexpr):
        """An x tile [G, W, VPW] -> VPW tiles [G, W], c = 0..VPW-1: the columns that meet the planes of `_planes`
        (the last dim split in halves, c's low bit first)."""
        if VPW == 8:  # c = 4 c2 + 2 c1 + c0
            x_0, x_1 = tl.split(tl.reshape(xv, [G, W, 2, 2, 2]))
            x00, x01 = tl.split(x_0)
            x10, x11 = tl.split(x_1)
            c0, c4 = tl.split(x00)
            c2, c6 = tl.split(x01)
            c1, c5 = tl.split(x10)
            c3, c7 = tl.split(x11)
            return c0, c1, c2, c3, c4, c5, c6, c7
        else:  # c = 2 c1 + c0
            x_0, x_1 = tl.split(tl.reshape(xv, [G, W, 2, 2]))
            c0, c2 = tl.split(x_0)
            c1, c3 = tl.split(x_1)
            return c0, c1, c2, c3

    @triton.jit
    def _load_x_tile(x_ptr, xrows, mm, k0, K, lim, BLOCK_K: tl.constexpr):
        """The rows' x columns k0 + [0, BLOCK_K) [BLOCK_M, BLOCK_K] in x's dtype (columns from `lim` on masked)."""
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(x_ptr + xrows[:, None] * K + k[None, :], mask=mm[:, None] & (k < lim)[None, :], other=0.0)

    @triton.jit
    def _weight(w, sc, ROUND_W: tl.constexpr, dt: tl.constexpr, INTERPRET: tl.constexpr):
        """A decoded tile [BLOCK_N, G, *] for the gemv's products: as it is (its scale applied to the group's partial
        sum), or with float scales and a narrower x the dequantized weight rounded to x's dtype, as
        `dequantize(x.dtype)` does (its scale applied here)."""
        if ROUND_W:
            return cast_rne(w * sc[:, :, None], dt, INTERPRET).to(tl.float32)
        return w

    @triton.jit
    def _expert_gemv_q_kernel(x_ptr, w_ptr, s_ptr, idx_ptr, out_ptr, E, N, K, KW, SK, x_div, FP4: tl.constexpr,
                              UE8M0: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROUND_W: tl.constexpr,
                              BLOCK_N: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr, PTX: tl.constexpr,
                              INTERPRET: tl.constexpr):
        r = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        if idx_ptr is None:  # a dense weight cut into E groups (fp8_linear's one-row path): row r uses group r % E
            e = (r % E).to(tl.int64)
        else:
            e = tl.load(idx_ptr + r).to(tl.int64)
        xrow = x_ptr + (r // x_div).to(tl.int64) * K
        wbase = w_ptr + e * N * KW
        sbase = s_ptr + e * tl.cdiv(N, BN) * SK
        dt = x_ptr.dtype.element_ty
        VPW: tl.constexpr = 8 if FP4 else 4
        W: tl.constexpr = SUB // VPW
        BLOCK_K: tl.constexpr = G * SUB
        k_end = tl.where(e >= 0, K, 0)  # no expert (-1): no loads, a row of zeros
        kw_end = tl.where(e >= 0, KW, 0)
        kg = tl.arange(0, G) * SUB
        # registers double-buffered: the next tile's loads are in flight while this one is decoded
        wq = _load_weights(wbase, n, nm, kg, KW, kw_end, W, VPW)
        sq = _load_scales(sbase, n, nm, kg, SK, k_end, BN, BK)
        xq = _load_x(xrow, kg, k_end, W, VPW)
        # one fp32 partial per (row, group of SUB columns sharing a scale), scaled once per group
        acc = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            wq_next = _load_weights(wbase, n, nm, kg + BLOCK_K, KW, kw_end, W, VPW)  # (masked past the end)
            sq_next = _load_scales(sbase, n, nm, kg + BLOCK_K, SK, k_end, BN, BK)
            xq_next = _load_x(xrow, kg + BLOCK_K, k_end, W, VPW)
            sc = _multipliers(sq, FP4, UE8M0)
            if FP4:
                w0, w1, w2, w3, w4, w5, w6, w7 = _planes(wq, FP4, PTX)
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(xq, G, W, VPW)
                part = _weight(w0, sc, ROUND_W, dt, INTERPRET) * x0[None, :, :]
                part += _weight(w1, sc, ROUND_W, dt, INTERPRET) * x1[None, :, :]
                part += _weight(w2, sc, ROUND_W, dt, INTERPRET) * x2[None, :, :]
                part += _weight(w3, sc, ROUND_W, dt, INTERPRET) * x3[None, :, :]
                part += _weight(w4, sc, ROUND_W, dt, INTERPRET) * x4[None, :, :]
                part += _weight(w5, sc, ROUND_W, dt, INTERPRET) * x5[None, :, :]
                part += _weight(w6, sc, ROUND_W, dt, INTERPRET) * x6[None, :, :]
                part += _weight(w7, sc, ROUND_W, dt, INTERPRET) * x7[None, :, :]
            else:
                w0, w1, w2, w3 = _planes(wq, FP4, PTX)
                x0, x1, x2, x3 = _x_planes(xq, G, W, VPW)
                part = _weight(w0, sc, ROUND_W, dt, INTERPRET) * x0[None, :, :]
                part += _weight(w1, sc, ROUND_W, dt, INTERPRET) * x1[None, :, :]
                part += _weight(w2, sc, ROUND_W, dt, INTERPRET) * x2[None, :, :]
                part += _weight(w3, sc, ROUND_W, dt, INTERPRET) * x3[None, :, :]
            part = tl.sum(part, axis=2)
            acc += part if ROUND_W else part * sc  # (UE8M0: a power of two, the reference's products exactly)
            wq, sq, xq, kg = wq_next, sq_next, xq_next, kg + BLOCK_K
        y = tl.sum(acc, axis=1)
        tl.store(out_ptr + r.to(tl.int64) * N + n, cast_rne(y, dt, INTERPRET), mask=nm)

    @triton.jit
    def _expert_grouped_q_kernel(x_ptr, w_ptr, s_ptr, order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, out_ptr,
                                 E, N, K, KW, SK, x_div, FP4: tl.constexpr, UE8M0: tl.constexpr, BN: tl.constexpr,
                                 BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
                                 SUB: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr, PTX: tl.constexpr,
                                 PREFETCH_X: tl.constexpr, INTERPRET: tl.constexpr):
        # the row-block -> expert map of dsv4/ops/moe.py's grouped kernel (`group_rows`' plan)
        e_safe, rows, mm, xrows = block_rows(order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, E, x_div, BLOCK_M,
                                             BLOCK_E)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        ew = tl.minimum(e_safe, E - 1).to(tl.int64)
        wbase = w_ptr + ew * N * KW
        sbase = s_ptr + ew * tl.cdiv(N, BN) * SK
        dt = x_ptr.dtype.element_ty
        VPW: tl.constexpr = 8 if FP4 else 4
        W: tl.constexpr = SUB // VPW
        BLOCK_K: tl.constexpr = G * SUB
        k_end = tl.where(e_safe < E, K, 0)  # rows with no expert: no weight loads, zeros
        kw_end = tl.where(e_safe < E, KW, 0)
        kg = tl.arange(0, G) * SUB
        # weights and scales double-buffered in registers, as in the gemv; the rows' x too with PREFETCH_X (decode
        # blocks: without it each iteration waited a memory latency for its x tile; prefill blocks run without,
        # see GROUPED_Q_CONFIG)
        wq = _load_weights(wbase, n, nm, kg, KW, kw_end, W, VPW)
        sq = _load_scales(sbase, n, nm, kg, SK, k_end, BN, BK)
        if PREFETCH_X:
            a = _load_x_tile(x_ptr, xrows, mm, 0, K, k_end, BLOCK_K)
        # transposed, acc = W x^T: the decoded weights are the A operand (the module doc says how it reaches the MMA)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            if PREFETCH_X:
                a_next = _load_x_tile(x_ptr, xrows, mm, k0 + BLOCK_K, K, k_end, BLOCK_K)
            else:
                a = _load_x_tile(x_ptr, xrows, mm, k0, K, k_end, BLOCK_K)
            wq_next = _load_weights(wbase, n, nm, kg + BLOCK_K, KW, kw_end, W, VPW)
            sq_next = _load_scales(sbase, n, nm, kg + BLOCK_K, SK, k_end, BN, BK)
            sc = _multipliers(sq, FP4, UE8M0)[:, :, None]
            # the planes joined back in column order (join appends a last dim: the innermost join takes the
            # planes VPW / 2 apart, the outermost neighbours)
            if FP4:
                p0, p1, p2, p3, p4, p5, p6, p7 = _planes(wq, FP4, PTX)
                wv = tl.join(tl.join(tl.join(p0 * sc, p4 * sc), tl.join(p2 * sc, p6 * sc)),
                             tl.join(tl.join(p1 * sc, p5 * sc), tl.join(p3 * sc, p7 * sc)))
            else:
                p0, p1, p2, p3 = _planes(wq, FP4, PTX)
                wv = tl.join(tl.join(p0 * sc, p2 * sc), tl.join(p1 * sc, p3 * sc))
            # to x's dtype: exact for UE8M0 scales, the reference's one rounding for float ones
            wt = cast_rne(tl.reshape(wv, [BLOCK_N, BLOCK_K]), dt, INTERPRET)
            # fp32: full-precision products, not TF32. The CPU interpreter multiplies bf16 tiles as their raw bits,
            # so there they go through fp32 (bf16 products are exact in it)
            if IEEE or INTERPRET:
                acc += tl.dot(wt.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(wt, tl.trans(a))
            wq, sq, kg = wq_next, sq_next, kg + BLOCK_K
            if PREFETCH_X:
                a = a_next
        tl.store(out_ptr + rows[None, :] * N + n[:, None], cast_rne(acc, dt, INTERPRET),
                 mask=mm[None, :] & nm[:, None])


def _kernel_args(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The stored bytes and scales as the kernels take them (views, no copies) and the format's constexprs."""
    scale = w.scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    bn, bk = w.block
    data = w.data.view(torch.int32)  # words of 8 (MXFP4) or 4 (FP8) values
    ptx = PTX_DECODE and not INTERPRET and torch.version.hip is None
    return data, scale, dict(FP4=w.fp4, UE8M0=scale.dtype == torch.uint8, BN=bn, BK=bk, PTX=ptx)


def _groups(bk: int, fp4: bool, block_k: int, K: int) -> tuple[int, int]:
    """(G, SUB) of a K tile of G * SUB columns (at most the next power of two >= K): SUB columns share one scale
    (a divisor of bk). MXFP4: 32 (16 bytes, one vector load a row); FP8: at most 16, one 16-byte vector too, so that
    a group's partial sum stays within a thread."""
    block_k = max(min(block_k, triton.next_power_of_2(K)), 32)
    sub = 32 if fp4 else min(bk, block_k, 16)
    return block_k // sub, sub


def triton_supports(x: torch.Tensor, w: QuantWeight) -> bool:
    """Whether the Triton kernels take this weight: contiguous bytes and scales (uint8/e8m0 or float32), a
    power-of-two column block, fp32/bf16/fp16 x."""
    bk = w.block[1]
    scale_ok = w.scale.dtype in (torch.uint8, torch.float32, getattr(torch, "float8_e8m0fnu", torch.uint8))
    data_ok = ((w.fp4 or w.data.dtype == torch.float8_e4m3fn) and w.data.shape[-1] % 4 == 0
               and w.data.storage_offset() % 4 == 0)  # read as int32 words
    return (triton is not None and w.data.is_contiguous() and w.scale.is_contiguous() and scale_ok and data_ok
            and bk >= 4 and bk & (bk - 1) == 0 and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def expert_gemv_q_triton(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor | None, x_div: int,
                         config: dict[str, int] | None = None) -> torch.Tensor:
    """`expert_gemv_q_torch` in one launch: a program per (row, block of outputs) decoding its expert's bytes in
    registers. Fixed shapes, no host sync (CUDA-graph capturable). `idx` None: one row per x row, row r using
    expert r % E (a dense weight cut into E groups; no index tensor to build inside a captured step). `config`
    replaces GEMV_Q_CONFIG's entry for the format (block_n, block_k, num_warps)."""
    assert triton is not None, "triton is not installed"
    E, N, K = w.shape
    R = idx.numel() if idx is not None else x.shape[0] * x_div
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        data, scale, fmt = _kernel_args(w)
        cfg = config or GEMV_Q_CONFIG["fp4" if w.fp4 else "fp8"]
        G, SUB = _groups(w.block[1], w.fp4, cfg["block_k"], K)
        block_n = min(cfg["block_n"], triton.next_power_of_2(N))
        round_w = not fmt["UE8M0"] and x.dtype != torch.float32
        _expert_gemv_q_kernel[(R, triton.cdiv(N, block_n))](
            x.contiguous(), data, scale, None if idx is None else idx.contiguous(), out, E, N, K, data.shape[-1],
            scale.shape[-1], x_div, **fmt, ROUND_W=round_w, BLOCK_N=block_n, G=G, SUB=SUB, INTERPRET=INTERPRET,
            num_warps=cfg["num_warps"])
    return out


def grouped_q_block_m(R: int, E: int, dtype: torch.dtype) -> int:
    """Rows of one expert per program of `expert_grouped_q_triton` for R routes over E experts and x of `dtype`:
    every block decodes its expert's weights again, so about twice the mean rows per expert (most experts in one
    block), up to GROUPED_Q_CONFIG's limit for the dtype; the MMA's width (x's rows, wgmma's N) can be as small as
    16."""
    cfg = GROUPED_Q_CONFIG
    twice_mean = 2 * -(-R // E)
    limit = cfg["max_block_m_fp32" if dtype == torch.float32 else "max_block_m"]
    return cfg["block_m"] or min(limit, max(16, 1 << (twice_mean - 1).bit_length()))  # next power of 2


def expert_grouped_q_triton(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int,
                            plan: RowPlan | None = None) -> torch.Tensor:
    """`expert_grouped_q_torch` in one launch, with no host sync: rows sorted by expert on the device (`plan`, made
    here unless given: `group_rows` with `grouped_q_block_m`), the grid sized for the worst case (every expert with
    one partly filled block), weight tiles decoded to x's dtype in registers and multiplied with tl.dot."""
    assert triton is not None, "triton is not installed"
    R, (E, N, K) = idx.numel(), w.shape
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R:
        data, scale, fmt = _kernel_args(w)
        cfg = GROUPED_Q_CONFIG
        bm = grouped_q_block_m(R, E, x.dtype)
        plan = plan if plan is not None else group_rows(idx, E, bm)  # no host sync: capturable
        assert plan.block_m == bm, "a plan for another block size"
        order, counts, offsets, block_ends, _ = plan
        fp32 = x.dtype == torch.float32
        G, SUB = _groups(w.block[1], w.fp4, cfg["block_k_fp32" if fp32 else "block_k"], K)
        block_n = min(cfg["block_n"], max(triton.next_power_of_2(N), 16))
        grid = (triton.cdiv(R, bm) + min(E + 1, R), triton.cdiv(N, block_n))
        _expert_grouped_q_kernel[grid](
            x.contiguous(), data, scale, order, counts, offsets, block_ends, out, E, N, K, data.shape[-1],
            scale.shape[-1], x_div, **fmt, BLOCK_M=bm, BLOCK_N=block_n, G=G, SUB=SUB,
            BLOCK_E=triton.next_power_of_2(E + 1), IEEE=fp32, PREFETCH_X=bm <= cfg["prefetch_x_max_block_m"],
            INTERPRET=INTERPRET, num_warps=cfg["num_warps_wide" if bm >= cfg["wide_block_m"] else "num_warps"])
    return out


# ---- dispatch ---------------------------------------------------------------------------------------------------
def expert_gemv_q(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if x.is_cuda and triton_supports(x, w):
        return expert_gemv_q_triton(x, w, idx, x_div)
    return expert_gemv_q_torch(x, w, idx, x_div)


def expert_grouped_q(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int,
                     plan: RowPlan | None = None) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere (which needs no plan)."""
    if x.is_cuda and triton_supports(x, w):
        return expert_grouped_q_triton(x, w, idx, x_div, plan)
    return expert_grouped_q_torch(x, w, idx, x_div)
