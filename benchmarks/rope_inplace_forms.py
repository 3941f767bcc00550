"""The in-place rope kernel (dsv4.ops.rope.apply_rope_triton_) in its two forms, strided pairs (the default) and one
contiguous run a row (DSV4_ROPE_VEC=1), at V4.1's shapes: queries and attention outputs [T, 64, 512] with 64 rope
channels, index queries [T, 32, 128], for a mixed step's row counts (576, 2,048) and a 16K prefill chunk.

usage: PYTHONPATH=. python3 benchmarks/rope_inplace_forms.py [--tokens 576 2048 16384]

Why: the strided form took 99.5 us a call for 2,048 tokens x 64 heads on an H100 (19 calls a mixed step of
V4.1-Flash-8l, benchmarks/results/2026-12-06-h100-mixed-step-host) where its bytes need ~10 us. Built for sm_90 here
(Triton 3.9), the strided form's x traffic is 16 two-byte loads and 16 two-byte stores a thread; the contiguous
form's is 2 sixteen-byte loads and 2 stores. Each time is a CUDA-graph replay, in microseconds; floor = the rope
channels read and written plus the cos / sin rows, over the HBM bandwidth. Both forms' bits are checked equal.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from dsv4.ops.rope import apply_rope_triton_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[576, 2048, 16384])
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = 3.35e12 if "H100" in torch.cuda.get_device_name(dev) else 4.8e12  # HBM bytes/s (H100 SXM, H200)
    g = torch.Generator(device="cuda").manual_seed(0)
    half = 32
    print(f"{torch.cuda.get_device_name(dev)}; us a call (CUDA-graph replay)")
    print(f"{'T':>6s} {'heads x D':>10s} {'floor':>7s} {'strided':>8s} {'contiguous':>10s}")
    for T in args.tokens:
        for heads, D in ((64, 512), (32, 128)):
            x = torch.randn(T, heads, D, device="cuda", generator=g).to(torch.bfloat16)
            ang = torch.rand(T, half, device="cuda", generator=g) * 1000
            cos, sin = ang.cos(), ang.sin()
            a, b = apply_rope_triton_(x.clone(), cos, sin, vec=False), apply_rope_triton_(x.clone(), cos, sin, vec=True)
            assert torch.equal(a, b), (T, heads, D)
            times = [triton.testing.do_bench_cudagraph(lambda v=v: apply_rope_triton_(x, cos, sin, vec=v), rep=50)
                     for v in (False, True)]
            floor = (T * heads * 2 * half * 2 * 2 + T * half * 4 * 2) / bw * 1e6
            print(f"{T:6d} {f'{heads} x {D}':>10s} {floor:7.1f} {times[0] * 1e3:8.1f} {times[1] * 1e3:10.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
