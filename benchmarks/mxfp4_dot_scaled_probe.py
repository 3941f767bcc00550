"""Probe: routed MXFP4 experts through Triton's `tl.dot_scaled` (bf16 x, e2m1 weights with their UE8M0 scales) on the
tensor cores, against the landed CUDA-core kernel (`dsv4.ops.moe_quant.expert_gemv_q_triton`) and the reference.

Why: the landed one-row gemv decodes every weight with ~4.7 instructions and reaches ~31% of its bytes' time on the
H200 (36 us for the 6 routes of a V4-Flash gate_up at batch 1; benchmarks/results/2026-12-04-h200-decode-launches);
the grouped kernel of batch-32 decode moves each decoded tile through shared memory (~4x its floor). `dot_scaled`
leaves the e2m1 decode to Triton's own lowering (on sm_90 an upcast to bf16 feeding the MMA). A decode row is padded
to the MMA's 16 rows: 15/16 of the products are wasted, which the tensor cores can afford at these sizes.

One program per (route, block of BLOCK_N outputs); the route's x row is row 0 of a [16, BLOCK_K] tile. The stored
bytes [E, N, K/2] (low nibble = even column) are read as dot_scaled's right operand [BLOCK_K/2, BLOCK_N] (packed
along K) and the scales [E, N, K/32] as its [BLOCK_N, BLOCK_K/32] scale tile.

Compiled here for sm_90 with Triton 3.9 (ASTSource with the divisibility a JIT launch specializes; the device has
3.6): the weight loads become cp.async (LDGSTS) pipelined over the stages, the e2m1 -> bf16 upcast is a byte-permute
lookup (PRMT) with the scale applied as HMUL2, and the product one HGMMA per 64 x 16 x 16; the loop issues ~6.3
instructions a weight per thread at BLOCK_N 64, BLOCK_K 256 (807 for 128 weights), more than the landed gemv's ~4.7
(benchmarks/results/2026-12-04-h200-decode-launches, ncu). Loading the bytes [BLOCK_N, BLOCK_K/2] and transposing, or
swapping the operands (W as dot_scaled's left operand, x^T on the right), compiles to the same count. So for one row
this is not expected to win on instructions; what it may still win at batch 32 is the grouped kernel's shared-memory
round trip of each decoded tile. The timing decides.

A grouped form (`grouped_dot_scaled`: up to BLOCK_M routes of one expert per program, the landed grouped kernel's
row plan) is timed at batch-32 decode against `expert_grouped_q_triton`.

usage: PYTHONPATH=. python3 benchmarks/mxfp4_dot_scaled_probe.py            (H200: times, V4-Flash shapes)
       TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/mxfp4_dot_scaled_probe.py --check   (CPU: values only)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from dsv4.ops.moe import block_rows, group_rows
from dsv4.ops.moe_quant import expert_gemv_q_torch, expert_gemv_q_triton, expert_grouped_q_triton
from dsv4.quant.formats import quantize_mxfp4
from dsv4.quant.weight import QuantWeight


@triton.jit
def _gemv_dot_scaled_kernel(x_ptr, w_ptr, s_ptr, idx_ptr, out_ptr, N, K, x_div, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    e = tl.load(idx_ptr + r).to(tl.int64)
    e_safe = tl.maximum(e, 0)
    m = tl.arange(0, 16)
    KH, KS = K // 2, K // 32
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    if e >= 0:  # a route to no expert (-1) gives a row of zeros and reads no weight
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            kx = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + (r // x_div) * K + kx[None, :] + m[:, None] * 0,
                        mask=(m[:, None] == 0) & (kx[None, :] < K), other=0.0).to(tl.bfloat16)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            w = tl.load(w_ptr + e_safe * N * KH + n[None, :] * KH + kb[:, None],
                        mask=nm[None, :] & (kb[:, None] < KH), other=0)
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(s_ptr + e_safe * N * KS + n[:, None] * KS + ks[None, :],
                        mask=nm[:, None] & (ks[None, :] < KS), other=127)
            acc = tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc)
    row = tl.sum(tl.where(m[:, None] == 0, acc, 0.0), axis=0)  # row 0: the route's product
    tl.store(out_ptr + r * N + n, row.to(out_ptr.dtype.element_ty), mask=nm)


def gemv_dot_scaled(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int, block_n: int = 64,
                    block_k: int = 256, stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    E, N, K = w.shape
    R = idx.numel()
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    _gemv_dot_scaled_kernel[(R, triton.cdiv(N, block_n))](
        x.contiguous(), w.data, w.scale, idx.contiguous(), out, N, K, x_div, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, num_warps=num_warps)
    return out


@triton.jit
def _grouped_dot_scaled_kernel(x_ptr, w_ptr, s_ptr, order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, out_ptr, E,
                               N, K, x_div, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_E: tl.constexpr, STAGES: tl.constexpr):
    """Up to BLOCK_M routes of one expert per program (the landed grouped kernel's row plan), x rows [BLOCK_M, BK]
    against the expert's packed bytes as dot_scaled's right operand."""
    e_safe, rows, mm, xrows = block_rows(order_ptr, counts_ptr, offsets_ptr, block_ends_ptr, E, x_div, BLOCK_M,
                                         BLOCK_E)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    ew = tl.minimum(e_safe, E - 1).to(tl.int64)
    KH, KS = K // 2, K // 32
    k_end = tl.where(e_safe < E, K, 0)  # rows with no expert: zeros, no weight loads
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, k_end, BLOCK_K, num_stages=STAGES):
        kx = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + xrows[:, None] * K + kx[None, :], mask=mm[:, None] & (kx[None, :] < K),
                    other=0.0).to(tl.bfloat16)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(w_ptr + ew * N * KH + n[None, :] * KH + kb[:, None], mask=nm[None, :] & (kb[:, None] < KH),
                    other=0)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + ew * N * KS + n[:, None] * KS + ks[None, :], mask=nm[:, None] & (ks[None, :] < KS),
                    other=127)
        acc = tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc)
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


def grouped_dot_scaled(x: torch.Tensor, w: QuantWeight, idx: torch.Tensor, x_div: int, block_m: int = 16,
                       block_n: int = 64, block_k: int = 256, stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    E, N, K = w.shape
    R = idx.numel()
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    order, counts, offsets, block_ends, _ = group_rows(idx, E, block_m)
    grid = (triton.cdiv(R, block_m) + min(E + 1, R), triton.cdiv(N, block_n))
    _grouped_dot_scaled_kernel[grid](
        x.contiguous(), w.data, w.scale, order, counts, offsets, block_ends, out, E, N, K, x_div, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(E + 1), STAGES=stages,
        num_warps=num_warps)
    return out


def _weights(E: int, N: int, K: int, device: str, g: torch.Generator) -> QuantWeight:
    # expert by expert: quantize_mxfp4's int64 intermediates of all 384 V4.1 experts at once are 32 GiB
    parts = [quantize_mxfp4(torch.randn(1, N, K, device=device, generator=g) * K ** -0.5) for _ in range(E)]
    return QuantWeight(torch.cat([d for d, _ in parts]), torch.cat([s for _, s in parts]), (1, 32))


def check() -> None:
    """Values against the reference (a route of -1, partial N tiles, two x rows shared by three routes each)."""
    g = torch.Generator().manual_seed(0)
    for E, N, K, bn, bk in ((4, 48, 128, 32, 64), (3, 64, 256, 64, 128)):
        w = _weights(E, N, K, "cpu", g)
        x = torch.randn(2, K, generator=g).to(torch.bfloat16)
        idx = torch.tensor([0, E - 1, -1, 1, 2, 0])
        ref = expert_gemv_q_torch(x, w, idx, 3).float()
        got = gemv_dot_scaled(x, w, idx, 3, bn, bk).float()
        s = x.float().abs().repeat_interleave(3, 0) @ w.dequantize().abs().max(0).values.t()
        assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 2 ** -16 * s + 1e-6).all(), (got - ref).abs().max()
        assert (got[2] == 0).all()
        for bm in (16, 32):
            got = grouped_dot_scaled(x, w, idx, 3, bm, bn, bk).float()
            assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 2 ** -16 * s + 1e-6).all(), (got - ref).abs().max()
            assert (got[2] == 0).all()
    print("values ok")


def bench() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"v4 gate_up (6 routes of 256)": (256, 4096, 4096, 6), "v4 down (6 routes)": (256, 4096, 2048, 6),
             "v41 gate_up (6 routes of 384)": (384, 4608, 5120, 6)}
    for name, (E, N, K, R) in cases.items():
        w = _weights(E, N, K, "cuda", g)
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randperm(E, device="cuda", generator=g)[:R]
        ref = expert_gemv_q_torch(x, w, idx, R).float()
        floor_us = R * (w.data[0].numel() + w.scale[0].numel()) / 4.8e12 * 1e6
        landed = triton.testing.do_bench_cudagraph(lambda: expert_gemv_q_triton(x, w, idx, R), rep=50) * 1e3
        print(f"{name}: floor {floor_us:.1f} us (4.8 TB/s), landed gemv {landed:.1f} us", flush=True)
        for bn, bk, st, nw in ((64, 256, 3, 4), (128, 256, 3, 4), (64, 512, 2, 4), (128, 128, 4, 4),
                               (256, 256, 3, 8), (32, 512, 3, 4)):
            try:
                got = gemv_dot_scaled(x, w, idx, R, bn, bk, st, nw).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = triton.testing.do_bench_cudagraph(lambda: gemv_dot_scaled(x, w, idx, R, bn, bk, st, nw),
                                                      rep=50) * 1e3
                print(f"  dot_scaled BN {bn} BK {bk} stages {st} warps {nw}: {t:.1f} us, rel err {err:.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 (a config the compiler refuses: say so, try the next)
                print(f"  dot_scaled BN {bn} BK {bk} stages {st} warps {nw}: {type(exc).__name__}: {exc}"[:300])


def bench_grouped() -> None:
    """Batch-32 decode: 32 tokens x 6 routes over 16 experts (V4-Flash-4l) and 256 (V4-Flash)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (E, N, K) in {"v4 gate_up": (16, 4096, 4096), "v4 down": (16, 4096, 2048),
                            "v4 gate_up, 256 experts": (256, 4096, 4096)}.items():
        w = _weights(E, N, K, "cuda", g)
        x = torch.randn(32, K, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:6] for _ in range(32)]).flatten()
        ref = expert_gemv_q_torch(x, w, idx, 6).float()
        hit = int(torch.unique(idx).numel())
        floor_us = hit * (w.data[0].numel() + w.scale[0].numel()) / 4.8e12 * 1e6
        landed = triton.testing.do_bench_cudagraph(lambda: expert_grouped_q_triton(x, w, idx, 6), rep=50) * 1e3
        print(f"{name} (192 routes, {hit} experts hit): floor {floor_us:.1f} us, landed grouped {landed:.1f} us",
              flush=True)
        for bm, bn, bk, st, nw in ((16, 64, 256, 3, 4), (16, 128, 256, 3, 4), (32, 64, 256, 3, 4),
                                   (16, 128, 128, 4, 4), (16, 256, 256, 3, 8)):
            try:
                got = grouped_dot_scaled(x, w, idx, 6, bm, bn, bk, st, nw).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = triton.testing.do_bench_cudagraph(lambda: grouped_dot_scaled(x, w, idx, 6, bm, bn, bk, st, nw),
                                                      rep=50) * 1e3
                print(f"  dot_scaled BM {bm} BN {bn} BK {bk} stages {st} warps {nw}: {t:.1f} us, rel err {err:.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"  dot_scaled BM {bm} BN {bn} BK {bk}: {type(exc).__name__}: {exc}"[:300])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="values against the reference only (CPU interpreter)")
    args = p.parse_args()
    if args.check:
        check()
    else:
        bench()
        bench_grouped()
