"""What the collectives of a tensor/expert-parallel decode step cost alone: NCCL all-reduce of one step's hidden
rows and all-gather of its logits, eager and inside a CUDA graph (as the decode graph runs them).

usage: torchrun --nproc-per-node 2 benchmarks/nccl_latency.py [HIDDEN] [VOCAB]   (defaults: V4.1-Flash, 5120 129280)

Prints on rank 0, per batch size, microseconds per collective (median of 20 timed replays of a graph holding N
back-to-back collectives, divided by N; eager: the same N calls timed between two syncs).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

N = 18  # the collectives of one V4.1-Flash-8l step: 2 per layer, the embedding's, the logits'


def _time_ms(fn: object, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 5120
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 129280
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    rows = {}
    for b in (1, 32):
        x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(b, vocab // world, device="cuda", dtype=torch.float32)
        parts = [torch.empty_like(logits) for _ in range(world)]

        def reduces() -> None:
            for _ in range(N):
                dist.all_reduce(x)

        def gathers() -> None:
            for _ in range(N):
                dist.all_gather(parts, logits)

        for name, fn in (("all_reduce", reduces), ("all_gather logits", gathers)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            eager = _time_ms(fn) * 1e3 / N
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm on the capture stream
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graph = _time_ms(g.replay) * 1e3 / N
            rows[(b, name)] = (eager, graph, x.numel() * 2 if name == "all_reduce" else logits.numel() * 4)
    del g  # a graph holding NCCL work alive at teardown hangs it (benchmarks/nccl_graph_exit.py)
    if rank == 0:
        print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {world} ranks, {torch.cuda.get_device_name()}")
        print(f"{'batch':>5} {'collective':<18} {'bytes/rank':>10} {'eager us':>9} {'graph us':>9}")
        for (b, name), (eager, graph, nbytes) in rows.items():
            print(f"{b:>5} {name:<18} {nbytes:>10} {eager:>9.1f} {graph:>9.1f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
