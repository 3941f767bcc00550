"""V4.1's fp32 linears at decode sizes (dsv4.ops.fp32_linear: the router logits and the ratio-2 compressor's kv /
gate rows, fp32 math on the stored bf16 weight) with the Triton path's two tile choices, "narrow" (the first) and
"wide" (the default since 2026-12-06), and the fp32-output tensor-core GEMM (column "mm": where
DSV4_FP32_LINEAR_MM_ROWS would hand 8-64 rows), at the released shapes and the 8-layer preset's router.

usage: PYTHONPATH=. python3 benchmarks/fp32_linear_blocks.py [--rows 1 4 32 64]
       PYTHONPATH=.:benchmarks python3 benchmarks/fp32_linear_blocks.py --sass   (no GPU: sm_90 builds of the tiles)

Why: in a batch-1 decode of V4.1-Flash-8l the narrow kernel took 30.6 us a call on average on an H100, 10 calls a
step (0.31 ms of a 3.9 ms replay, benchmarks/results/2026-12-06-h100-decode-select-radix), for weights of 0.16-5.2
MB whose bytes need 0.1-1.7 us: 2-64 programs walking K = 5120 in 20 dependent steps. The wide tiles give one row
~512 programs of 2 steps. Prediction: ~3-6 us a one-row call, ~0.25 ms less a batch-1 step. Each time is a CUDA-graph
replay (weights rotated past L2: each call reads its weight from HBM, as a decode step does), in microseconds;
floor = weight bytes / HBM bandwidth; both tile choices are checked within the fp32 reordering bound of the exact
(fp64) product.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from dsv4.ops.fp32_linear import decode_blocks, fp32_linear_mm, fp32_linear_triton


def sass(rows: list[int]) -> None:
    """Each tile the two choices take at these rows, built for sm_90 with the local Triton (its ptxas; no driver):
    registers, stack (spills) and the K loop's opcodes per thread (a lead, not a time)."""
    from grouped_q_sass import analyse  # benchmarks/ on the path
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4.ops import fp32_linear

    print(f"triton {triton.__version__}, sm_90, bf16 x and w, 4 warps")
    fn = fp32_linear._fp32_linear_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "N": "i32", "K": "i32", "x_stride": "i32",
           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}  # aligned pointers, K and strides multiples of 16
    tiles = sorted({decode_blocks(R, N, 5120, b) for R in rows for N in (16, 384, 512) for b in ("narrow", "wide")})
    for bn, bk in tiles:
        src = ASTSource(fn=fn, signature=sig, constexprs={"BLOCK_N": bn, "BLOCK_K": bk}, attrs=attrs)
        a = analyse(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"])
        top = " ".join(f"{o} {v}" for o, v in list(a["loop_ops"].items())[:8])
        print(f"BLOCK_N {bn:2d} BLOCK_K {bk:4d}: {a['registers']:3d} registers, stack {a['stack']} B, K loop "
              f"{a['loop_instructions']} instructions: {top}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--sass", action="store_true", help="build the tiles for sm_90 and count; no GPU needed")
    args = ap.parse_args()
    if args.sass:
        return sass(args.rows)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bw = 3.35e12 if "H100" in name else 4.8e12  # HBM bytes/s (H100 SXM, H200)
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 5120
    copies = 16  # 16 weights of up to 5.2 MB rotate past the 50 MB L2
    print(f"{name}; us a call (CUDA-graph replay)")
    print(f"{'rows':>4s} {'N':>5s} {'floor':>6s} {'narrow':>8s} {'tiles':>9s} {'wide':>8s} {'tiles':>9s} {'mm':>8s}")
    for N in (16, 384, 512):  # V4.1-Flash-8l's router; V4.1-Flash's router; the ratio-2 compressor's kv / gate
        ws = [(torch.randn(N, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        for R in args.rows:
            x = torch.randn(R, K, device=dev, generator=g).to(torch.bfloat16)
            ref = x.double() @ ws[0].double().t()
            bound = K * 2.0 ** -24 * (x.double().abs() @ ws[0].double().abs().t())
            row = []
            for blocks in ("narrow", "wide"):
                assert ((fp32_linear_triton(x, ws[0], blocks).double() - ref).abs() <= bound + 1e-30).all(), blocks

                def calls(b: str = blocks, x: torch.Tensor = x, ws: list[torch.Tensor] = ws) -> None:
                    for w in ws:
                        fp32_linear_triton(x, w, b)

                row.append((triton.testing.do_bench_cudagraph(calls, rep=50) * 1e3 / copies,
                            decode_blocks(R, N, K, blocks)))
            # the fp32-output tensor-core GEMM (DSV4_FP32_LINEAR_MM_ROWS): the weight read once for all rows
            assert ((fp32_linear_mm(x, ws[0]).double() - ref).abs() <= bound + 1e-30).all(), "mm"

            def mm_calls(x: torch.Tensor = x, ws: list[torch.Tensor] = ws) -> None:
                for w in ws:
                    fp32_linear_mm(x, w)
            mm_us = triton.testing.do_bench_cudagraph(mm_calls, rep=50) * 1e3 / copies
            floor = N * K * 2 / bw * 1e6
            print(f"{R:4d} {N:5d} {floor:6.2f} {row[0][0]:8.2f} {row[0][1]!s:>9} {row[1][0]:8.2f} "
                  f"{row[1][1]!s:>9} {mm_us:8.2f}", flush=True)


if __name__ == "__main__":
    main()
