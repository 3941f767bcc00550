"""The decode attention kernel (dsv4.ops.decode_attention) by split size at DeepSeek-V4-Flash's shapes, on one GPU:
how long a decode step's attention takes when each split covers 1, 2 or 4 key tiles (the default rule,
`decode_splits`, gives each split at least MIN_SPLIT_TILES = 2). A batch-1 step of V4-Flash-4l spent 12.4-13.1 us
in this kernel per layer for a 128-key window (H200 profile, benchmarks/results/2026-12-04-h200-decode-launches),
about 8 programs of 2 tiles each.

Cases: H 64, D 512, bf16 cache; window-only (128 keys: the sliding layers) and window + 136 selected entries (a CSA
layer at 544 tokens of context); batch 1, 4, 32. Times are CUDA-graph replays (triton.testing.do_bench_cudagraph),
outputs checked against the default split's.

usage: PYTHONPATH=. python3 benchmarks/decode_attention_splits.py
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from dsv4.ops.decode_attention import _sm_count, decode_sink_attention_triton, decode_splits


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D = 64, 512
    print(f"{'case':14s} {'R':>3s} {'default':>14s} " + " ".join(f"{f'chunk {c}':>10s}" for c in (32, 64, 128)))
    for case, L2 in (("window", 0), ("window+136", 136)):
        for R in (1, 4, 32):
            cache = torch.randn(R * 1024, D, device="cuda", generator=g).to(torch.bfloat16)
            sources = []
            for L in ((128, L2) if L2 else (128,)):
                slots = torch.randint(0, cache.shape[0], (R, L), device="cuda", generator=g)
                mask = torch.ones(R, L, dtype=torch.bool, device="cuda")
                sources.append((cache, slots, mask))
            q = torch.randn(R, H, D, device="cuda", generator=g).to(torch.bfloat16)
            sinks = torch.randn(H, device="cuda", generator=g)
            ref = decode_sink_attention_triton(q, sources, sinks, D ** -0.5).float()
            chunk, splits = decode_splits(R, H, [s[1].shape[1] for s in sources], _sm_count(q.device))
            default_us = triton.testing.do_bench_cudagraph(
                lambda: decode_sink_attention_triton(q, sources, sinks, D ** -0.5), rep=20) * 1e3
            row = [f"{default_us:6.1f} (c{chunk})"]
            for c in (32, 64, 128):
                out = decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=c).float()
                assert (out - ref).abs().max().item() < 2e-2, c
                us = triton.testing.do_bench_cudagraph(
                    lambda c=c: decode_sink_attention_triton(q, sources, sinks, D ** -0.5, chunk=c), rep=20) * 1e3
                row.append(f"{us:10.1f}")
            print(f"{case:14s} {R:3d} {row[0]:>14s} " + " ".join(row[1:]), flush=True)


if __name__ == "__main__":
    main()
