"""mHC's rows projection (dsv4.ops.mhc.hc_dots_rows: m = norm(h) @ fn^T of bf16 streams h [T, 4, 5120], fn
[24, 20480] as three bf16 parts) by column split count, at the row counts of a mixed step (576: 64 decodes + a
512-token chunk; 2,048), of a 16K prefill chunk (16,384) and of a decode batch (64), on one GPU.

usage: PYTHONPATH=. python3 benchmarks/mhc_rows_splits.py [--rows 64 576 2048 16384] [--splits 1 2 4 8 16 20]

Why: in a 2,048-token mixed step of V4.1-Flash-8l each of the 16 calls took 168 us on an H100
(benchmarks/results/2026-12-06-h100-mixed-step-host), against a floor of ~25 us for reading h (84 MB at 2,048 rows)
once: the single pass runs one program per 64 rows (32 programs for 132 SMs), each walking 320 column steps. The
`auto` column is `rows_splits` (what DSV4_MHC_ROWS_SPLIT_K=1 picks). Each time is a CUDA-graph replay of the call
(both launches), in microseconds; every split count's m is checked within the fp32 summation bound of an fp64
reference, as tests/gpu/test_kernels_gpu.py does.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from dsv4.ops.mhc import hc_dots_rows, rows_splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 576, 2048, 16384])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 20])
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bw = 3.35e12 if "H100" in torch.cuda.get_device_name(dev) else 4.8e12  # HBM bytes/s (H100 SXM, H200)
    g = torch.Generator(device="cuda").manual_seed(0)
    M, K = 24, 4 * 5120
    fn = torch.nn.Parameter(torch.randn(M, K, device="cuda", generator=g) * K ** -0.5)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; us a call (CUDA-graph replay); floor = h's bytes / "
          f"{bw / 1e12:.2f} TB/s")
    print(f"{'T':>6s} {'floor':>7s} {'auto S':>6s} " + " ".join(f"{f'S={s}':>8s}" for s in args.splits)
          + f" {'auto':>8s}")
    for T in args.rows:
        h = (torch.randn(T, 4, 5120, device="cuda", generator=g) * 3).to(torch.bfloat16)
        hd = h.flatten(1).double()
        r = torch.rsqrt(hd.square().mean(1) + 1e-6)
        ref = (hd @ fn.double().T) * r[:, None]
        bound = (K * 2.0 ** -24 + 2.0 ** -21) * (hd.abs() @ fn.double().abs().T) * r[:, None]
        auto = rows_splits(T, K, sms)
        times = []
        for s in [*args.splits, auto]:
            got = hc_dots_rows(h, fn, 1e-6, splits=s)
            assert ((got.double() - ref).abs() <= bound).all(), (T, s)
            t = triton.testing.do_bench_cudagraph(lambda s=s: hc_dots_rows(h, fn, 1e-6, splits=s), rep=50)
            times.append(f"{t * 1e3:8.1f}")
        floor = h.numel() * h.element_size() / bw * 1e6
        print(f"{T:6d} {floor:7.1f} {auto:6d} " + " ".join(times), flush=True)


if __name__ == "__main__":
    main()
