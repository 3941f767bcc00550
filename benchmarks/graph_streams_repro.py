"""Does using side streams slow a single-stream CUDA graph's replay? (issue 7's open question, without the engine)

usage: PYTHONPATH=. python3 benchmarks/graph_streams_repro.py [--kernels 400] [--width 4096]

A chain of `--kernels` small dependent kernels (a GEMV-sized matmul and an add, alternating) is captured as one
CUDA graph on the main stream; its replay device time (CUDA events, median of 5 x 20 replays) is measured:
1. first, before this process asks torch for any stream beyond the capture's;
2. after a side stream took part in an event round trip with the main stream (what the staged lookback gather does);
3. after a second graph that forks onto two side streams and joins back (what the forked metadata builds record)
   was captured and replayed once;
4. after that second graph is deleted;
5. after recapturing the chain.
A real engine measured its forward graph ~6% slower once side streams had been used
(results/2026-11-30-h200-specialized-decode); if this repro shows the same step, the cause is below the engine.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def replay_us(graph: torch.cuda.CUDAGraph, n: int = 20) -> float:
    """Median over 5 rounds of the mean device time of n back-to-back replays."""
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(1e3 * start.elapsed_time(end) / n)
    return statistics.median(rounds)


def capture_chain(x: torch.Tensor, w: torch.Tensor, kernels: int) -> torch.cuda.CUDAGraph:
    def chain() -> torch.Tensor:
        y = x
        for i in range(kernels // 2):
            y = torch.mm(y, w) if i % 2 == 0 else y + x
            y = y * 0.5
        return y

    chain()  # warm: cuBLAS handles and workspaces outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    return graph


def capture_forked(x: torch.Tensor, streams: list[torch.cuda.Stream]) -> torch.cuda.CUDAGraph:
    def forked() -> None:
        main = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main)
            with torch.cuda.stream(s):
                x.add_(1.0)
        for s in streams:
            main.wait_stream(s)

    forked()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forked()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=400)
    ap.add_argument("--width", type=int, default=4096)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(1, args.width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.width, args.width, device="cuda", dtype=torch.bfloat16) / args.width ** 0.5
    chain = capture_chain(x, w, args.kernels)
    rows = [("fresh process", replay_us(chain))]

    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    side.wait_stream(main_stream)
    main_stream.wait_stream(side)
    torch.cuda.synchronize()
    rows.append(("after a side-stream round trip", replay_us(chain)))

    scratch = torch.zeros(16, device="cuda")
    forked = capture_forked(scratch, [torch.cuda.Stream(), torch.cuda.Stream()])
    forked.replay()
    torch.cuda.synchronize()
    rows.append(("after a forked graph was captured and replayed", replay_us(chain)))

    del forked
    torch.cuda.synchronize()
    rows.append(("after the forked graph was deleted", replay_us(chain)))

    chain = capture_chain(x, w, args.kernels)
    rows.append(("after recapturing the chain", replay_us(chain)))
    print(f"chain of ~{args.kernels} kernels, width {args.width}: replay device time (us)")
    for what, us in rows:
        print(f"  {what:50s} {us:9.1f}")


if __name__ == "__main__":
    main()
