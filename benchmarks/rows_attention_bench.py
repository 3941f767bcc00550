"""The sink attention kernels of dsv4.ops.decode_attention by row count at DeepSeek-V4.1-Flash's shapes, on one GPU:
the split kernel (flash-decoding: splits, an fp32 workspace and a merge launch) against the rows kernel (one program
per row and value half, all 64 heads), from decode batches to a 16K-token prefill, and what the default picks.

Cases: H 64, D 512, bf16 caches: a sliding layer (128 window keys), a CSA layer (window + 512 selected entries) and
an HCA layer (window + 128 entries through a block table: a 16K prompt at ratio 128). Rows see every key (the
prefill rows of a long prompt do). The FLOP model counts the useful work, 4 * R * H * D * keys (logits and values);
the fraction (of the best rows time) is of the dense bf16 peak given by --peak-tflops (H200 / H100 SXM: 989). Times: CUDA-graph replays
below 1024 rows, triton.testing.do_bench above; outputs checked against each other.

usage: PYTHONPATH=. python3 benchmarks/rows_attention_bench.py [--rows 32,128,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing

from dsv4.ops import decode_attention
from dsv4.ops.decode_attention import TableSource, _sm_count, decode_sink_attention_triton, use_rows_kernel

H, D, W = 64, 512, 128


def _sources(case: str, R: int, g: torch.Generator) -> list:
    cache = torch.randn(max(R, 256) * 4, D, device="cuda", generator=g).to(torch.bfloat16)
    n = cache.shape[0]
    window = (cache, torch.randint(0, n, (R, W), device="cuda", generator=g),
              torch.ones(R, W, dtype=torch.bool, device="cuda"))
    if case == "window":
        return [window]
    if case == "window+512":
        return [window, (cache, torch.randint(0, n, (R, 512), device="cuda", generator=g),
                         torch.ones(R, 512, dtype=torch.bool, device="cuda"))]
    BS, width = 64, 128  # window + 128 HCA entries through a block table
    table = torch.randint(0, n // BS, (R, width // BS), device="cuda", generator=g, dtype=torch.int32)
    return [window, TableSource(cache, table, torch.full((R,), width, device="cuda"), BS, width)]


def _time_us(fn, R: int) -> float:
    if R < 1024:
        return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=50) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,256,512,1024,4096,16384")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--block-n", default="16,32", help="key tiles of the rows kernel to time (ROWS_BLOCK_N)")
    ap.add_argument("--stages", type=int, default=None, help="ROWS_STAGES for every rows-kernel timing")
    ap.add_argument("--row-splits", default="", help="key splits of the rows kernel to time too, e.g. 2,4 (at the "
                    "default BLOCK_N, merged by the split kernel's merge: DSV4_ROWS_SPLITS)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    sm = _sm_count(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, {sm} SMs, torch {torch.__version__}, triton {triton.__version__}")
    block_ns = [int(b) for b in args.block_n.split(",")]
    row_splits = [int(x) for x in args.row_splits.split(",") if x]
    if args.stages is not None:
        decode_attention.ROWS_STAGES = args.stages
    default_bn = decode_attention.ROWS_BLOCK_N
    print(f"{'case':11s} {'R':>6s} {'split us':>10s} " + " ".join(f"{f'rows n{b} us':>12s}" for b in block_ns)
          + "".join(f" {f'rows s{x} us':>12s}" for x in row_splits) + f" {'speed-up':>8s} {'rows %peak':>10s} default (rows: BLOCK_N {default_bn}, "
          f"stages {decode_attention.ROWS_STAGES})")
    out = []
    for case in ("window", "window+512", "window+hca128"):
        keys = W + {"window": 0, "window+512": 512, "window+hca128": 128}[case]
        for R in (int(r) for r in args.rows.split(",")):
            sources = _sources(case, R, g)
            q = torch.randn(R, H, D, device="cuda", generator=g).to(torch.bfloat16)
            sinks = torch.randn(H, device="cuda", generator=g)
            split = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=False).float()
            t_split = _time_us(lambda: decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=False), R)
            t_rows, diff = {}, 0.0
            for bn in block_ns:
                decode_attention.ROWS_BLOCK_N = bn
                rows = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True).float()
                diff = max(diff, (split - rows).abs().max().item())
                assert diff < 3e-2, (case, R, bn, diff)
                t_rows[bn] = _time_us(lambda: decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True), R)
            decode_attention.ROWS_BLOCK_N = default_bn
            t_splits = {}
            for x in row_splits:
                rows = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True, row_splits=x).float()
                diff = max(diff, (split - rows).abs().max().item())
                assert diff < 3e-2, (case, R, x, diff)
                def call(x: int = x, q: torch.Tensor = q, sources: list = sources, sinks: torch.Tensor = sinks) -> None:
                    decode_sink_attention_triton(q, sources, sinks, D ** -0.5, rows=True, row_splits=x)
                t_splits[x] = _time_us(call, R)
            best = min(list(t_rows.values()) + list(t_splits.values()))
            frac = 4 * R * H * D * keys / (best * 1e-6) / (args.peak_tflops * 1e12)
            default = "rows" if use_rows_kernel(R, H, sm) else "split"
            print(f"{case:11s} {R:6d} {t_split:10.1f} " + " ".join(f"{t_rows[b]:12.1f}" for b in block_ns)
                  + "".join(f" {t_splits[x]:12.1f}" for x in row_splits) + f" {t_split / best:7.2f}x {100 * frac:9.1f}% {default}", flush=True)
            out.append(dict(case=case, rows=R, keys=keys, split_us=t_split, rows_us=t_rows, rows_splits_us=t_splits,
                            max_diff=diff,
                            best_rows_peak_fraction=frac, default=default))
            del sources, q
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "stages": decode_attention.ROWS_STAGES, "rows": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
