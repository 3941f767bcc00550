"""FP8 block-scaled dense linears on the GPU: bf16 (cuBLAS F.linear, bmm for the grouped wo_a) against the W8A16 and
W8A8 Triton kernels of dsv4/ops/fp8_linear.py and (one row) its CUDA-core gemv, at the released V4-Flash
(blocks 128) and V4.1-Flash (blocks 32) dense shapes and M = 1 .. 16384 rows.

usage: PYTHONPATH=. python3 benchmarks/fp8_linear_bench.py [--json PATH] [--shapes v4.wkv,v41.wo_b] [--m 1,8]
                                                           [--rep MS] [--override BLOCK_N=128,num_stages=5]
                                                           [--methods bf16,gemv] [--gemv-config block_n=8,...]

Each time is triton.testing.do_bench_cudagraph's median (the calls replayed from a CUDA graph, as in a decode step;
plain do_bench timed the Python launch of these few-us kernels), with the weights rotated over
enough copies to span > 3x the H200's 60 MB L2, so decode sizes read them from HBM as a model step would. bytes =
weight (+ scales) + x + out; GB/s and TFLOP/s are achieved rates; floor = max(bytes / 4.2e12 B/s, flops / 790e12):
the H200's HBM and dense bf16 peaks. rel_err = ||y - y_bf16|| / ||y_bf16|| (all methods share one random FP8 weight,
so this is the kernels' numerics, not the quantization's). `--override` passes config entries to the W8A16 launch
(keys of dsv4.ops.fp8_linear._config: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, split, num_warps, num_stages) for tuning.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable

import torch
import triton
import triton.testing

from dsv4.ops import fp8_linear
from dsv4.ops.fp8_linear import _launch, dense_linear, fp8_gemv_triton, fp8_linear_dequant, fp8_linear_w8a8_triton
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.weight import QuantWeight

HBM_BPS, PEAK_FLOPS, L2_BYTES = 4.2e12, 790e12, 60e6
# name: (N, K, groups, block); wo_a reads x [M, 8 * 4096] (8 head groups of 8 x 512)
SHAPES = {
    "v4.wq_a": (1024, 4096, 1, (128, 128)), "v4.wq_b": (32768, 1024, 1, (128, 128)),
    "v4.wkv": (512, 4096, 1, (128, 128)), "v4.wo_a": (8192, 4096, 8, (128, 128)),
    "v4.wo_b": (4096, 8192, 1, (128, 128)), "v4.shared_up": (2048, 4096, 1, (128, 128)),
    "v4.shared_down": (4096, 2048, 1, (128, 128)),
    "v41.wq_a": (1280, 5120, 1, (32, 32)), "v41.wq_b": (32768, 1280, 1, (32, 32)),
    "v41.wkv": (512, 5120, 1, (32, 32)), "v41.wo_a": (8192, 4096, 8, (32, 32)),
    "v41.wo_b": (5120, 8192, 1, (32, 32)), "v41.shared_up": (2304, 5120, 1, (32, 32)),
    "v41.shared_down": (5120, 2304, 1, (32, 32)),
}
MS = (1, 8, 32, 64, 512, 4096, 16384)


def _time_us(fn: Callable[[], object], rep_ms: int) -> float:
    # replayed from a CUDA graph, as the engine runs a decode step: the Python launch of a few-us kernel would
    # otherwise be what is timed (the first run's do_bench numbers were 50-130 us for 5 us of bytes)
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def _rotating(fn: Callable[[object], object], copies: list) -> Callable[[], object]:
    """fn over the weight copies in turn, one per call."""
    it = itertools.cycle(copies)
    return lambda: fn(next(it))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--rep", type=int, default=20, help="do_bench rep (ms)")
    ap.add_argument("--override", default="", help="W8A16 config entries, e.g. BLOCK_N=128,num_stages=5")
    ap.add_argument("--methods", default="bf16,w8a16,w8a8,deq+bf16,gemv", help="which of them to time")
    ap.add_argument("--gemv-config", default="", help="the one-row gemv's tiles for every shape, e.g. "
                    "block_n=8,block_k=512,num_warps=4 (default: fp8_linear.gemv_config's choice by width)")
    args = ap.parse_args()
    override = {k: int(v) for k, v in (kv.split("=") for kv in args.override.split(",") if kv)}
    if args.gemv_config:
        gemv = {k: int(v) for k, v in (kv.split("=") for kv in args.gemv_config.split(","))}
        fp8_linear.gemv_config = lambda n, groups=1, bk=128: gemv
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':16s} {'M':>6s} {'method':6s} {'us':>9s} {'GB/s':>7s} {'TFLOP/s':>8s} {'floor us':>9s} "
          f"{'floor%':>6s} {'rel_err':>8s}")
    for name in args.shapes.split(","):
        N, K, G, block = SHAPES[name]
        w = QuantWeight(*quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, block), block)
        copies = max(1, min(64, math.ceil(3 * L2_BYTES / (N * K))))  # > 3x L2 of FP8 weights (bf16: twice that)
        fp8s = [w] + [QuantWeight(w.data.clone(), w.scale.clone(), block) for _ in range(copies - 1)]
        dense = [q.dequantize(torch.bfloat16) for q in fp8s]
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, G * K, device="cuda", generator=g).to(torch.bfloat16)
            methods = {"bf16": (lambda d: dense_linear(x, d, G), dense, 2 * N * K),
                       "w8a16": (lambda q: _launch(x, q, G, False, **override), fp8s, w.nbytes),
                       "w8a8": (lambda q: fp8_linear_w8a8_triton(x, q, G), fp8s, w.nbytes),
                       "deq+bf16": (lambda q: fp8_linear_dequant(x, q, G), fp8s, w.nbytes),
                       "gemv": (lambda q: fp8_gemv_triton(x, q, G), fp8s, w.nbytes)}
            base = dense_linear(x, dense[0], G).float()
            for method, (fn, ws, wbytes) in methods.items():
                if method not in args.methods.split(",") or (method == "gemv" and M > 1):  # the gemv: one row
                    continue
                try:
                    err = ((fn(ws[0]).float() - base).norm() / base.norm()).item()
                    us = _time_us(_rotating(fn, ws), args.rep)
                except Exception as e:  # a config that does not compile: report it, measure the rest
                    print(f"{name:16s} {M:6d} {method:6s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    rows.append(dict(shape=name, M=M, method=method, error=f"{type(e).__name__}: {e}"[:2000]))
                    continue
                nbytes, flops = wbytes + 2 * M * G * K + 2 * M * N, 2 * M * N * K
                floor = max(nbytes / HBM_BPS, flops / PEAK_FLOPS) * 1e6
                row = dict(shape=name, N=N, K=K, groups=G, block=list(block), M=M, method=method, us=us,
                           gbps=nbytes / us * 1e-3, tflops=flops / us * 1e-6, floor_us=floor, rel_err=err)
                rows.append(row)
                print(f"{name:16s} {M:6d} {method:6s} {us:9.1f} {row['gbps']:7.0f} {row['tflops']:8.1f} "
                      f"{floor:9.1f} {floor / us:6.0%} {err:8.1e}", flush=True)
        del fp8s, dense
        torch.cuda.empty_cache()
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    override=override)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
