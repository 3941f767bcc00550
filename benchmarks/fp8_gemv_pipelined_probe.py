"""Probe: the one-row FP8 gemv (batch-1 decode) with its weight loads software-pipelined by Triton (`tl.range(...,
num_stages=S)`: cp.async copies S-1 tiles ahead into shared memory) instead of the landed kernel's one tile
prefetched in registers, against the landed `dsv4.ops.fp8_linear.fp8_gemv_triton` and the reference.

Why: Nsight Compute on the H200 put the landed gemv's large shapes at 40-45% of DRAM bandwidth with long-scoreboard
stalls dominating (V4 wq_b: 10.3 of the 16.5 cycles between a warp's issues; benchmarks/results/
2026-12-04-h200-decode-launches): too few bytes in flight, not too many instructions. A second register tile did
not help (gemv_variants.py there); shared-memory stages hold more bytes per SM without the registers.

Form: a program per BLOCK_N outputs; per K tile the e4m3 bytes [BLOCK_N, BLOCK_K] (BLOCK_K divides the scale block,
so one UE8M0 scale per row of the tile) are widened to fp32, multiplied by x, summed along K and scaled once:
fp32 products of exact values, as the reference's, in another order.

Compiled here for sm_90 (Triton 3.9, a JIT launch's divisibility): one 16-byte cp.async (LDGSTS) per thread and
tile, two barriers, and the e4m3 -> fp32 widening as F2FP + HADD2 before the FFMAs: 104 loop instructions for 16
weights a thread at BLOCK_N 16 x BLOCK_K 128 (6.5 a weight, mostly per-tile overhead), 171 for 32 at BLOCK_N 32 (5.3):
wider tiles a thread are what keeps it under the ~7 instructions a weight that HBM allows an SM at full issue.

usage: PYTHONPATH=. python3 benchmarks/fp8_gemv_pipelined_probe.py               (H200: times at V4's shapes)
       TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/fp8_gemv_pipelined_probe.py --check   (values, CPU)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from dsv4.ops.fp8_linear import fp8_gemv_triton, fp8_linear_torch
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight


@triton.jit
def _fp8_gemv_pipelined_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, SK, BN_S: tl.constexpr, BK_S: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    G: tl.constexpr = BLOCK_K // BK_S if BLOCK_K > BK_S else 1  # scale groups along K in a tile
    SUB: tl.constexpr = BLOCK_K // G
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    k = tl.arange(0, BLOCK_K)
    gi = tl.arange(0, G)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + (k0 + k)[None, :], mask=nm[:, None], other=0.0)
        x = tl.load(x_ptr + k0 + k).to(tl.float32)
        part = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, G, SUB]), axis=2)  # [BLOCK_N, G]
        sb = tl.load(s_ptr + (n // BN_S)[:, None] * SK + (k0 + gi * SUB)[None, :] // BK_S, mask=nm[:, None],
                     other=127).to(tl.int32)
        acc += tl.sum(part * (sb << 23).to(tl.float32, bitcast=True), axis=1)  # UE8M0 b -> 2^(b - 127), exact
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


def fp8_gemv_pipelined(x: torch.Tensor, w: QuantWeight, block_n: int = 16, block_k: int = 128, stages: int = 4,
                       num_warps: int = 4) -> torch.Tensor:
    """x [K] (one row), w FP8 [N, K] with UE8M0 scales in (bn, bk) blocks, K a multiple of block_k, block_k <= bk."""
    N, K = w.data.shape
    bn, bk = w.block
    assert K % block_k == 0 and (bk % block_k == 0 or block_k % bk == 0) and w.scale.dtype == torch.uint8
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    _fp8_gemv_pipelined_kernel[(triton.cdiv(N, block_n),)](
        x.contiguous(), w.data, w.scale, out, N, K, w.scale.shape[-1], BN_S=bn, BK_S=bk, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
    return out


def _weight(N: int, K: int, block: tuple[int, int], device: str, g: torch.Generator) -> QuantWeight:
    data, scale = quantize_fp8(torch.randn(N, K, device=device, generator=g) * K ** -0.5, block, True)
    return QuantWeight(data, scale, block)


def check() -> None:
    g = torch.Generator().manual_seed(0)
    for N, K, block, bn, bk in ((40, 256, (32, 32), 16, 32), (300, 512, (128, 128), 32, 64),
                                (72, 256, (32, 32), 16, 128)):
        w = _weight(N, K, block, "cpu", g)
        x = torch.randn(K, generator=g).to(torch.bfloat16).float()  # fp32 out: the interpreter's bf16 cast truncates
        ref = fp8_linear_torch(x[None], w)[0]
        got = fp8_gemv_pipelined(x, w, bn, bk, 2)
        s = x.float().abs() @ w.dequantize().abs().t()
        assert ((got - ref).abs() <= (K + 8) * 2 ** -23 * s).all(), (got - ref).abs().max()
    print("values ok")


def bench() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"v4 wq_b": (32768, 1024, (128, 128)), "v4 wo_b": (4096, 8192, (128, 128)),
              "v4 q_a+kv": (1536, 4096, (128, 128)), "v4 shared gate+up": (4096, 4096, (128, 128)),
              "v41 wq_b": (32768, 1280, (32, 32)), "v41 wo_b": (5120, 8192, (32, 32))}
    for name, (N, K, block) in shapes.items():
        w = _weight(N, K, block, "cuda", g)
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        ref = fp8_linear_torch(x.float(), w)[0]
        floor_us = (w.data.numel() + w.scale.numel()) / 4.8e12 * 1e6
        landed = triton.testing.do_bench_cudagraph(lambda: fp8_gemv_triton(x, w), rep=50) * 1e3
        print(f"{name} [{N}, {K}]: floor {floor_us:.1f} us (4.8 TB/s), landed gemv {landed:.1f} us", flush=True)
        for bn, bk, st, nw in ((16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 3, 8), (32, 256, 3, 4),
                               (16, 256, 6, 4), (128, 128, 3, 8), (32, 64, 8, 4)):
            try:
                got = fp8_gemv_pipelined(x[0], w, bn, bk, st, nw).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = triton.testing.do_bench_cudagraph(lambda: fp8_gemv_pipelined(x[0], w, bn, bk, st, nw),
                                                      rep=50) * 1e3
                print(f"  pipelined BN {bn} BK {bk} stages {st} warps {nw}: {t:.1f} us, rel err {err:.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 (a config the compiler refuses: say so, try the next)
                print(f"  pipelined BN {bn} BK {bk} stages {st}: {type(exc).__name__}: {exc}"[:300])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="values against the reference only (CPU interpreter)")
    args = p.parse_args()
    check() if args.check else bench()
