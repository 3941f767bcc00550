"""Probe: a grouped MXFP4 expert kernel whose decoded weights could reach the tensor cores from registers.

usage: PYTHONPATH=. python3 benchmarks/mxfp4_register_a_probe.py [check] [sass] [bench]
  check  values against `expert_grouped_q_torch` (the CPU interpreter: TRITON_INTERPRET=1; on a GPU, compiled)
  sass   sm_90 SASS of the K loop, compiled here (Triton's own ptxas, no GPU): shared-memory traffic and MMAs
  bench  on a GPU: this kernel against the landed `expert_grouped_q_triton` at V4-Flash-4l's batch-32 shapes

Why (benchmarks/results/2026-12-04-h200-decode-launches, section 3): the landed grouped kernel (moe_quant.py) runs
at ~4x its floor at batch 32 with L1/shared-memory throughput at 81-87% and DRAM at 17%. It decodes a [64, 128] tile
of e2m1 nibbles, joins the two nibble planes back into column order (`tl.join` + reshape) and hands the bf16 tile
to `tl.dot`: the join is not elementwise, so the tile goes through shared memory before the MMA (16 KB written and
read for 4 KB of weights a K step), on top of x's tile.

This form has no join. The weights are re-laid out once (`permute_groups`): in each group of 32 columns (one UE8M0
scale) byte i holds column i in its low nibble and column 16 + i in its high nibble. A K step of one group is then
two MMAs of K = 16, each of whose A operand is an elementwise function of the same [BLOCK_N, 16] byte tile: low or
high nibble -> e2m1 as fp16 bits -> fp32 * (scale * 2^14) -> bf16. A chain of elementwise ops from a load to a dot
operand is what Triton may convert in registers instead of through shared memory (the mixed-precision matmul
pattern); whether it does at sm_90 is what `sass` looks at (STS / LDS / BAR counts in the loop, and whether the
HGMMAs take A from registers).

Value path: e2m1 nibble v: magnitude bits (v & 7) shifted to fp16's exponent / mantissa (<< 9) give 2^(e - 15) (1 +
m / 2) for e > 0 and the subnormal 2^-14 m / 2 for e = 0; times 2^14 that is e2m1's value exactly; the sign bit
(v & 8) << 12. The UE8M0 scale 2^(s - 127) is a power of two: the product is exact in fp32 and rounds once to bf16,
as the reference's dequantization (bf16 x: the landed kernel's weights are exact there too).
"""

from __future__ import annotations

import os
import sys

import torch

from dsv4.ops.moe import block_rows, group_rows
from dsv4.ops.moe_quant import expert_grouped_q_torch, grouped_q_block_m
from dsv4.quant.formats import quantize_mxfp4
from dsv4.quant.weight import QuantWeight

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def permute_groups(data: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., K / 2] (byte j: column 2j low nibble, 2j + 1 high) -> per group of 32 columns, byte i holds
    column i (low nibble) and column 16 + i (high nibble)."""
    lo, hi = data & 0xF, data >> 4
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., K] nibbles in column order
    g = vals.unflatten(-1, (-1, 2, 16))  # [..., K / 32, half, i]
    return (g[..., 0, :] | (g[..., 1, :] << 4)).flatten(-2).to(torch.uint8)


if triton is not None:
    @triton.jit
    def _e2m1(nib, scale):
        """bf16 values of e2m1 nibbles (int16 in 0..15) times `scale` (fp32, broadcast)."""
        bits = ((nib & 7) << 9) | ((nib & 8) << 12)
        half = bits.to(tl.float16, bitcast=True)
        return (half.to(tl.float32) * scale).to(tl.bfloat16)

    def _pair_ptx(src: str, shift_mag: int, shift_sign: int, scale: str, dst: str) -> str:
        """PTX for two nibbles of `src` (bytes spread into bf16 lanes) -> bf16x2 `dst`: magnitude bits shifted to
        bf16's 8..6, sign to 15, times 2^126 (k) and the scale pair."""
        return f"""
            shl.b32 t, {src}, {shift_mag};
            and.b32 t, t, 0x01C001C0;
            shl.b32 u, {src}, {shift_sign};
            and.b32 u, u, 0x80008000;
            or.b32 t, t, u;
            mul.rn.bf16x2 t, t, k;
            mul.rn.bf16x2 {dst}, t, {scale};"""

    # $4: four bytes; $5, $6: the scale for bytes 0-1 and 2-3; out $0, $1: low nibbles, $2, $3: high nibbles
    _E2M1_PTX = tl.constexpr("{\n .reg .b32 a, b, t, u, k;\n mov.b32 k, 0x7E807E80;\n"
                             " prmt.b32 a, $4, 0, 0x4140;\n prmt.b32 b, $4, 0, 0x4342;"
                             + _pair_ptx("a", 6, 12, "$5", "$0") + _pair_ptx("b", 6, 12, "$6", "$1")
                             + _pair_ptx("a", 2, 8, "$5", "$2") + _pair_ptx("b", 2, 8, "$6", "$3") + "\n}")

    @triton.jit
    def _e2m1_ptx(byte, scale_bf16):
        """(low, high) nibbles of uint8 `byte` as bf16 times `scale_bf16` (bf16, broadcast to byte's shape): four bytes
        a call. A nibble s|e e|m shifted to bf16's bits 15 | 8..6 is its e2m1 value times 2^-126 (e = 0: the
        subnormal 2^-127 for m = 1); times 2^126 (0x7E80) exact, then times the scale (a power of two: exact)."""
        return tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,=r,=r,r,r,r", [byte, scale_bf16],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    @triton.jit
    def _grouped_register_a_kernel(x_ptr, w_ptr, s_ptr, order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, out_ptr,
                                   E, N, K, x_div, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_E: tl.constexpr, PTX: tl.constexpr, INTERPRET: tl.constexpr):
        e_safe, rows, mm, xrows = block_rows(order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, E, x_div, BLOCK_M,
                                             BLOCK_E)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        ew = tl.minimum(e_safe, E - 1).to(tl.int64)
        KB = K // 2
        KS = K // 32
        wrow = w_ptr + ew * N * KB + n.to(tl.int64)[:, None] * KB
        srow = s_ptr + ew * N * KS + n.to(tl.int64) * KS
        k_end = tl.where(e_safe < E, K, 0)
        i16 = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        # pointers advanced each step (not recomputed from k0: fewer integer instructions in the loop)
        wp = wrow + i16[None, :]
        sp = srow
        xp = x_ptr + xrows[None, :] * K + i16[:, None]
        for k0 in range(0, k_end, 32):
            raw = tl.load(wp, mask=nm[:, None], other=0)
            byte = raw.to(tl.int16)
            s = tl.load(sp, mask=nm, other=127).to(tl.int32)
            # 2^(s - 127) * 2^14 as fp32 bits: exponent s + 14 (UE8M0 scales of real weights are far from 241+)
            scale = ((s + 14) << 23).to(tl.float32, bitcast=True)[:, None]
            x_lo = tl.load(xp, mask=mm[None, :], other=0.0)
            x_hi = tl.load(xp + 16, mask=mm[None, :], other=0.0)
            wp += 16
            sp += 1
            xp += 32
            if PTX:
                # 2^(s - 127) as bf16 bits (s = 0: the subnormal 2^-127)
                sb = tl.where(s == 0, 0x40, s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
                w_lo, w_hi = _e2m1_ptx(raw, tl.broadcast_to(sb[:, None], [BLOCK_N, 16]))
                acc += tl.dot(w_lo, x_lo)
                acc += tl.dot(w_hi, x_hi)
            elif INTERPRET:  # the interpreter multiplies bf16 tiles as raw bits: in fp32 (bf16 products are exact)
                acc += tl.dot(_e2m1(byte & 15, scale).to(tl.float32), x_lo.to(tl.float32), input_precision="ieee")
                acc += tl.dot(_e2m1(byte >> 4, scale).to(tl.float32), x_hi.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(_e2m1(byte & 15, scale), x_lo)
                acc += tl.dot(_e2m1(byte >> 4, scale), x_hi)
        out = acc.to(tl.bfloat16)
        tl.store(out_ptr + rows[None, :] * N + n[:, None], out, mask=mm[None, :] & nm[:, None])


def grouped_register_a(x: torch.Tensor, data_perm: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, x_div: int,
                       block_n: int = 64, num_warps: int = 4, ptx: bool = False) -> torch.Tensor:
    """`expert_grouped_q_torch(x, w, idx, x_div)` for bf16 x and MXFP4 w (UE8M0 scales, blocks (1, 32)), from w's
    bytes permuted by `permute_groups`."""
    E, N, KB = data_perm.shape
    K, R = 2 * KB, idx.numel()
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    bm = grouped_q_block_m(R, E, x.dtype)
    order, counts, offsets, block_ends, _ = group_rows(idx, E, bm)
    grid = (triton.cdiv(R, bm) + min(E + 1, R), triton.cdiv(N, block_n))
    _grouped_register_a_kernel[grid](x.contiguous(), data_perm, scale.view(torch.uint8), order, counts, offsets,
                                     block_ends, out, E, N, K, x_div, BLOCK_M=bm, BLOCK_N=block_n,
                                     BLOCK_E=triton.next_power_of_2(E + 1), PTX=ptx and not INTERPRET,
                                     INTERPRET=INTERPRET, num_warps=num_warps)
    return out


def _weights(E: int, N: int, K: int, device: str, g: torch.Generator) -> QuantWeight:
    parts = [quantize_mxfp4(torch.randn(1, N, K, device=device, generator=g) * K ** -0.5) for _ in range(E)]
    return QuantWeight(torch.cat([d for d, _ in parts]), torch.cat([s for _, s in parts]), (1, 32))


def check(device: str) -> None:
    """Against the reference: 3 and 5 experts, partial N tiles, rows with no expert, x rows shared by routes;
    zero, subnormal-range and saturated e2m1 values come with the random draws (checked below)."""
    g = torch.Generator(device=device).manual_seed(0)
    for E, N, K, T, k, bn in ((3, 48, 64, 5, 2, 32), (5, 96, 128, 9, 3, 64)):
        w = _weights(E, N, K, device, g)
        w.data[0, 0, :2] = torch.tensor([0x8F, 0x07], dtype=torch.uint8)  # -6 and -0, 6 and 0 (saturated, zeros)
        nibs = torch.stack([w.data & 0xF, w.data >> 4]).flatten()
        assert {0, 1, 7, 8, 9, 15} <= set(nibs.unique().tolist()), "the draws miss an edge value"
        x = torch.randn(T, K, device=device, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, E, (T * k,), device=device, generator=g)
        idx[1] = -1
        ref = expert_grouped_q_torch(x, w, idx, k)
        for ptx in ((False, True) if device == "cuda" else (False,)):
            got = grouped_register_a(x, permute_groups(w.data), w.scale, idx, k, block_n=bn, ptx=ptx)
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            assert (got[1] == 0).all()
    print("values ok")


def sass() -> None:
    """The K loop of the kernel compiled for sm_90 here (benchmarks/grouped_q_sass.py's reader)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from grouped_q_sass import analyse
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _grouped_register_a_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "order_ptr": "*i64", "counts_ptr": "*i64",
           "offsets_ptr": "*i64", "block_ends_ptr": "*i64", "out_ptr": "*bf16", "E": "i32", "N": "i32", "K": "i32",
           "x_div": "i32"}
    for block_m, block_n, warps, ptx in ((16, 64, 4, False), (32, 64, 4, False), (32, 128, 4, False),
                                         (32, 128, 8, False), (16, 64, 4, True), (32, 64, 4, True),
                                         (32, 128, 4, True), (32, 128, 8, True)):
        consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_E=32, PTX=ptx, INTERPRET=False)
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a != "x_div"}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        row = analyse(kernel.asm["cubin"])
        ops = row["loop_ops"]
        per_weight = row["loop_instructions"] / (block_n * 32 / (32 * warps))
        smem = {k: ops.get(k, 0) for k in ("STS", "LDS", "LDSM", "STSM", "BAR", "HGMMA", "HMMA", "WARPGROUP")}
        print(f"{'PTX' if ptx else 'triton'} decode, BLOCK_M {block_m} BLOCK_N {block_n} warps {warps}: "
              f"{row['registers']} registers, stack "
              f"{row['stack']}, loop {row['loop_instructions']} instructions ({per_weight:.1f} a weight), {smem}")
        print("   ", " ".join(f"{k} {v}" for k, v in list(ops.items())[:16]))


def bench() -> None:
    from dsv4.ops.moe_quant import expert_grouped_q_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (E, N, K, T, k) in {"gate_up b32 (16 experts)": (16, 4096, 4096, 32, 6),
                                  "down b32 (16 experts)": (16, 4096, 2048, 32, 6)}.items():
        w = _weights(E, N, K, "cuda", g)
        perm = permute_groups(w.data)
        x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(0, E, (T * k,), device="cuda", generator=g)
        ref = expert_grouped_q_triton(x, w, idx, k).float()
        floor_us = (w.data.numel() + w.scale.numel()) / 4.8e12 * 1e6
        landed = triton.testing.do_bench_cudagraph(lambda: expert_grouped_q_triton(x, w, idx, k), rep=50) * 1e3
        print(f"{name}: floor {floor_us:.1f} us (every expert, 4.8 TB/s), landed {landed:.1f} us", flush=True)
        for bn, warps, ptx in ((64, 4, True), (128, 4, True), (128, 8, True), (64, 4, False)):
            got = grouped_register_a(x, perm, w.scale, idx, k, bn, warps, ptx).float()
            err = (got - ref).abs().max().item()
            t = triton.testing.do_bench_cudagraph(
                lambda: grouped_register_a(x, perm, w.scale, idx, k, bn, warps, ptx), rep=50) * 1e3
            print(f"  register-A form, {'PTX' if ptx else 'triton'} decode, BLOCK_N {bn}, {warps} warps: {t:.1f} us "
                  f"(max |diff| vs landed {err:.3g})", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["check"]
    if "check" in parts:
        check("cuda" if torch.cuda.is_available() else "cpu")
    if "sass" in parts:
        sass()
    if "bench" in parts:
        bench()
