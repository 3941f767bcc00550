"""The decode step's indexer selection (dsv4.ops.indexer.decode_select_triton: scores of a row's visible compressed
entries, top-k, slots) at DeepSeek-V4-Flash's shapes (64 index heads of 128, top-k 512, bf16 keys), on one GPU, by
visible entries and split count. A batch-1 step of V4-Flash-4l spent 26.4 + 6.0 us in its two kernels for ~136
entries (H200 profile, benchmarks/results/2026-12-04-h200-decode-launches): this says whether that is the split
layout (16 programs a row, most of them empty at short contexts) or the scoring itself.

usage: PYTHONPATH=. python3 benchmarks/decode_select_splits.py
"""

from __future__ import annotations

import torch
import triton.testing

from dsv4.ops.indexer import decode_select_triton, select_splits


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D, K, BS = 64, 128, 512, 16
    print(f"{'R':>3s} {'n':>6s} {'default S':>12s} " + " ".join(f"{f'S={s}':>8s}" for s in (1, 2, 4, 8, 16)))
    for R in (1, 32):
        for n in (136, 512, 2048, 8192):
            blocks = -(-n // BS)
            keys = torch.randn(R * blocks * BS, D, device="cuda", generator=g).to(torch.bfloat16)
            table = torch.randperm(R * blocks, device="cuda", generator=g).view(R, blocks).to(torch.int32)
            nn = torch.full((R,), n, dtype=torch.int64, device="cuda")
            q = torch.randn(R, H, D, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(R, H, device="cuda", generator=g)
            k = min(K, n)

            def run(s: int | None = None):
                return decode_select_triton(q, w, keys, table, BS, nn, n, D ** -0.5, k, splits=s)

            ref = run()[1]
            times = [f"{triton.testing.do_bench_cudagraph(run, rep=20) * 1e3:6.1f} S{select_splits(R, q.device)}"]
            for s in (1, 2, 4, 8, 16):
                assert torch.equal(run(s)[1].sort(dim=1).values, ref.sort(dim=1).values), s
                times.append(f"{triton.testing.do_bench_cudagraph(lambda s=s: run(s), rep=20) * 1e3:8.1f}")
            print(f"{R:3d} {n:6d} {times[0]:>12s} " + " ".join(times[1:]), flush=True)


if __name__ == "__main__":
    main()
