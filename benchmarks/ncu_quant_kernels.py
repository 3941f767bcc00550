"""The quantized decode kernels, launched a few times each for Nsight Compute (one GPU): where their time goes when
neither the bytes in flight nor the loop's barriers explained it (benchmarks/results/2026-12-04-h200-gemv-forms-
prefill-blocks). Run under ncu through benchmarks/ncu_quant_kernels.sh, which collects the warp-stall, scheduler,
occupancy and memory sections of each launch; alone it only runs the kernels (and checks them against the torch
references, so a profile of a wrong kernel cannot pass unnoticed).

Kernels, at the released shapes and bf16 x:
- `gemv-fp8-wq_b`: the one-row FP8 gemv (fp8_gemv_triton) on V4 wq_b [32768, 1024], blocks 128;
- `gemv-fp8-wo_b`: the same on V4 wo_b [4096, 8192];
- `gemv-mxfp4-gate_up`: the MXFP4 expert gemv at one token (6 routes of 16 experts, [4096, 4096]);
- `grouped-mxfp4-gate_up-t32`: the grouped MXFP4 kernel at 32 tokens over 16 experts (the batch-32 decode case).

usage: PYTHONPATH=. python3 benchmarks/ncu_quant_kernels.py [--reps N]
"""

from __future__ import annotations

import argparse

import torch

from dsv4.ops.fp8_linear import fp8_gemv_triton, fp8_linear_torch
from dsv4.ops.moe_quant import (expert_gemv_q_torch, expert_gemv_q_triton, expert_grouped_q_torch,
                                expert_grouped_q_triton)
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight


def _mxfp4(E: int, N: int, K: int, g: torch.Generator) -> QuantWeight:
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g)
    scale = torch.randint(112, 125, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
    return QuantWeight(data, scale, (1, 32))


def _close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, (name, err)
    print(f"{name:28s} rel_err {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="launches of each kernel after its warm-up")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name, (N, K) in (("gemv-fp8-wq_b", (32768, 1024)), ("gemv-fp8-wo_b", (4096, 8192))):
        w = QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, (128, 128)),
                        (128, 128))
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        cases.append((name, lambda x=x, w=w: fp8_gemv_triton(x, w), lambda x=x, w=w: fp8_linear_torch(x, w)))
    w4 = _mxfp4(16, 4096, 4096, g)
    x1 = torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16)
    idx1 = torch.randperm(16, device="cuda", generator=g)[:6]
    cases.append(("gemv-mxfp4-gate_up", lambda: expert_gemv_q_triton(x1, w4, idx1, 6),
                  lambda: expert_gemv_q_torch(x1, w4, idx1, 6)))
    x32 = torch.randn(32, 4096, device="cuda", generator=g).to(torch.bfloat16)
    idx32 = torch.stack([torch.randperm(16, device="cuda", generator=g)[:6] for _ in range(32)]).view(-1)
    cases.append(("grouped-mxfp4-gate_up-t32", lambda: expert_grouped_q_triton(x32, w4, idx32, 6),
                  lambda: expert_grouped_q_torch(x32, w4, idx32, 6)))
    for name, kernel, reference in cases:
        _close(kernel(), reference(), name)  # also the warm-up (compile) launch
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        for _ in range(args.reps):
            kernel()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
