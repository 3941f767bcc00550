"""Does tearing the NCCL process group down hang while a CUDA graph that captured a collective is alive?

usage: torchrun --nproc-per-node 2 benchmarks/nccl_graph_exit.py keep|release
keep: barrier + destroy_process_group with the graph alive; release: the graph deleted (and the device synced)
first. Each rank prints when it has left the group; a hang shows as the launcher's timeout.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    keep = sys.argv[1] == "keep"
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    x = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(x)  # warm on a side stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    if not keep:
        del g
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ({sys.argv[1]}): left the group in {time.perf_counter() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
