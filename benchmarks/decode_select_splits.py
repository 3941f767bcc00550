"""The decode step's indexer selection (dsv4.ops.indexer.decode_select_triton: scores of a row's visible compressed
entries, top-k, slots, and for DeepSeek-V4.1 the candidate blocks) on one GPU, by visible entries and split count,
at 64 index heads of 128 (V4's; `--heads 32` for V4.1's), top-k 512, bf16 keys. The first use: a batch-1 step of
V4-Flash-4l spent 26.4 + 6.0 us in its two kernels for ~136 entries (H200,
benchmarks/results/2026-12-04-h200-decode-launches). The second: after a 131,072-token prompt the selection took 3.5
of a 7.0 ms V4.1-Flash-8l step on an H100 (2026-12-05-h100-rows-attention-prefill), with 16 splits a row; this says
which split count (MAX_SPLITS) long rows want, per kind of index layer. V4.1's index layers at 131,072 tokens: a
ratio-2 layer scores 65,536 entries (plain), the ratio-1 candidate source 131,072 (candidate), a later ratio-1 layer
the 16,384 entries of its 2,048 candidate blocks (pooled, --lens 131072).

usage: PYTHONPATH=. python3 benchmarks/decode_select_splits.py [--mode plain|candidate|pooled] [--batches 1 32]
           [--lens 136 512 2048 8192] [--splits 1 2 4 8 16 | --groups 1 2 4 8] [--merge-warps 4 8] [--heads 64]
           [--split-warps 4 8] [--radix] [--radix-splits 64 128 256]
   V4.1 at long context: --heads 32 --mode candidate --lens 8192 32768 131072 --splits 16 32 64 (then pooled,
   plain)

Modes: plain (V4's index layers, and V4.1's without candidates); candidate (V4.1's candidate source: also the top
2,048 of the entries' 8-entry blocks); pooled (a later V4.1 index layer: only entries of 2,048 candidate blocks of
8). Each time is the whole selection (both kernels) replayed in a CUDA graph, in microseconds; every split count's
slots are checked against the default's.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from dsv4.ops.indexer import decode_select_triton, merge_groups, select_plan

D, K, BS = 128, 512, 16
CAND_BLOCK, KEEP_BLOCKS = 8, 2048  # V4.1-Flash's candidate_block_size, candidate_topk_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["plain", "candidate", "pooled"], default="plain")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--lens", type=int, nargs="+", default=[136, 512, 2048, 8192])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--heads", type=int, default=64, help="index heads (V4-Flash 64, V4.1-Flash 32)")
    ap.add_argument("--groups", type=int, nargs="+", default=None,
                    help="instead of split counts: merge group counts at the default split count (1 = one merge "
                         "program a row)")
    ap.add_argument("--merge-warps", type=int, nargs="+", default=[None],
                    help="warps of the merge kernels (default: the kernel's own choice by selection kind)")
    ap.add_argument("--split-warps", type=int, nargs="+", default=[None],
                    help="warps of the scoring (split) kernel (default: SPLIT_WARPS)")
    ap.add_argument("--radix", action="store_true",
                    help="one more column: the default counts with the merge as a radix select (radix=True)")
    ap.add_argument("--radix-splits", type=int, nargs="+", default=[],
                    help="more columns: the radix merge at these split counts (past MAX_SPLITS too: its cost grows "
                         "with the keys, not with sorted lists)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    # (splits, groups, merge warps, split warps) per column; None = the shape-derived default
    if args.groups:
        cols = [(None, gr, mw, sw) for gr in args.groups for mw in args.merge_warps for sw in args.split_warps]
    else:
        cols = [(sp, None, mw, sw) for sp in args.splits for mw in args.merge_warps for sw in args.split_warps]
    label = lambda c: ((f"G={c[1]}" if args.groups else f"S={c[0]}")  # noqa: E731
                       + (f"/w{c[2]}" if len(args.merge_warps) > 1 else "")
                       + (f"/s{c[3]}" if len(args.split_warps) > 1 else ""))
    print(f"mode {args.mode}; us for the whole selection; default S, G = the engine's shape-derived split and group"
          " counts (R: its merge is the radix select); the --splits / --groups columns are the sort merge")
    print(f"{'R':>3s} {'n':>6s} {'default S, G':>16s} " + " ".join(f"{label(c):>9s}" for c in cols)
          + (f" {'radix':>9s}" if args.radix else "") + "".join(f" {f'radix S={sp}':>12s}" for sp in args.radix_splits))
    for R in args.batches:
        for n in args.lens:
            blocks = -(-n // BS)
            keys = torch.randn(R * blocks * BS, D, device="cuda", generator=g).to(torch.bfloat16)
            table = torch.randperm(R * blocks, device="cuda", generator=g).view(R, blocks).to(torch.int32)
            nn = torch.full((R,), n, dtype=torch.int64, device="cuda")
            q = torch.randn(R, args.heads, D, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(R, args.heads, device="cuda", generator=g)
            k = min(K, n)
            pool, cb, keep = None, 1, 0
            if args.mode == "candidate":
                cb, keep = CAND_BLOCK, KEEP_BLOCKS
            elif args.mode == "pooled":
                nb = -(-n // CAND_BLOCK)
                cb = CAND_BLOCK
                pool = torch.stack([torch.randperm(nb, device="cuda", generator=g)[:KEEP_BLOCKS] for _ in range(R)])
                if pool.shape[1] < KEEP_BLOCKS:  # fewer blocks than kept: the rest -1, as the candidate source gives
                    pool = torch.nn.functional.pad(pool, (0, KEEP_BLOCKS - pool.shape[1]), value=-1)

            def run(c: tuple = (None, None, None, None), radix: bool | None = None):  # noqa: ANN202
                return decode_select_triton(q, w, keys, table, BS, nn, n, D ** -0.5, k, pool, cb, keep, splits=c[0],
                                            groups=c[1], merge_warps=c[2], radix=radix, split_warps=c[3])

            ref = run()
            S, rdx = select_plan(R, q.device)
            form = "R" if rdx else f"G{merge_groups(S)}"
            times = [f"{triton.testing.do_bench_cudagraph(run, rep=20) * 1e3:6.1f} S{S} {form}"]
            for c in cols:
                got = run(c, radix=False)
                assert torch.equal(got[1].sort(dim=1).values, ref[1].sort(dim=1).values), c
                assert keep == 0 or torch.equal(got[3], ref[3]), c
                times.append(f"{triton.testing.do_bench_cudagraph(lambda c=c: run(c, radix=False), rep=20) * 1e3:9.1f}")
            if args.radix:
                got = run(radix=True)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), "radix"
                assert keep == 0 or torch.equal(got[3], ref[3]), "radix blocks"
                times.append(f"{triton.testing.do_bench_cudagraph(lambda: run(radix=True), rep=20) * 1e3:9.1f}")
            for sp in args.radix_splits:
                got = run((sp, None, None, None), radix=True)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), ("radix", sp)
                assert keep == 0 or torch.equal(got[3], ref[3]), ("radix blocks", sp)
                t = triton.testing.do_bench_cudagraph(lambda sp=sp: run((sp, None, None, None), radix=True), rep=20)
                times.append(f"{t * 1e3:12.1f}")
            print(f"{R:3d} {n:6d} {times[0]:>16s} " + " ".join(times[1:]), flush=True)


if __name__ == "__main__":
    main()
