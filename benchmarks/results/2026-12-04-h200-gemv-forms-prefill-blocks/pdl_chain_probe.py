"""Probe: what programmatic dependent launch (PDL) saves between the small dependent kernels of a decode step, when
they replay from a CUDA graph (one Hopper GPU).

A batch-1 decode step is ~200 kernels in a row, most of them a few microseconds; between two dependent kernels the
GPU drains the first, then launches the second. With PDL (Triton: `launch_pdl=True` at launch, `gdc_wait()` in the
kernel before it reads what earlier kernels wrote or writes anything) the second kernel's programs are launched while
the first finishes, and may read what no kernel writes (weights) before they wait.

Chains, each captured in one CUDA graph and replayed (median of 30 replays timed with device events):
- `tiny`: 200 dependent elementwise kernels over 4096 fp32 values (one program each);
- `gemv`: 40 dependent one-row products y = W x with W int8 [4096, 4096] (16 MB, 256 programs, a 1-byte weight
  read once), alternating with a tiny kernel; `gemv-prefetch`: the same with each program's first weight tile
  loaded before `gdc_wait()`.
Every chain runs without PDL and with it; the outputs must be bit-equal (a missed wait would show as a race).

usage: PYTHONPATH=. python3 benchmarks/pdl_chain_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tiny(x_ptr, y_ptr, N, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N)
    tl.store(y_ptr + i, x * 0.5 + 1.0, mask=i < N)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
          PREFETCH: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if PREFETCH:  # the weights are written by no kernel: their first tile may be read before the wait
        w = tl.load(w_ptr + n[:, None] * K + k[None, :])
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        w = tl.load(w_ptr + n[:, None] * K + k[None, :])
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next = tl.load(w_ptr + n[:, None] * K + (k0 + BLOCK_K + k)[None, :], mask=(k0 + BLOCK_K + k < K)[None, :],
                         other=0)
        x = tl.load(x_ptr + k0 + k)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    tl.store(y_ptr + n, tl.sum(acc, axis=1) * (1.0 / K))


def _chain(kind: str, pdl: bool, bufs: list[torch.Tensor], w: torch.Tensor) -> None:
    kw = dict(launch_pdl=True) if pdl else {}
    if kind == "tiny":
        for i in range(200):
            _tiny[(1,)](bufs[i % 2], bufs[(i + 1) % 2], 4096, BLOCK=4096, GDC=pdl, num_warps=4, **kw)
        return
    for i in range(40):
        _gemv[(4096 // 16,)](bufs[0], w, bufs[1], 4096, 4096, BLOCK_N=16, BLOCK_K=256, GDC=pdl,
                             PREFETCH=kind == "gemv-prefetch", num_warps=4, **kw)
        _tiny[(1,)](bufs[1], bufs[0], 4096, BLOCK=4096, GDC=pdl, num_warps=4, **kw)


def _replay_us(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median of `reps` timed replays (device events), after 5 untimed ones."""
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8, device="cuda", generator=g)
    print(f"{'chain':14s} {'kernels':>7s} {'no PDL us':>10s} {'PDL us':>8s} {'us saved a kernel':>18s} equal")
    for kind, kernels in (("tiny", 200), ("gemv", 80), ("gemv-prefetch", 80)):
        results, times = [], []
        for pdl in (False, True):
            bufs = [torch.randn(4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)),
                    torch.zeros(4096, device="cuda")]
            start = bufs[0].clone()
            _chain(kind, pdl, bufs, w)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _chain(kind, pdl, bufs, w)
            bufs[0].copy_(start)
            graph.replay()
            torch.cuda.synchronize()
            results.append(bufs[0].clone())
            times.append(_replay_us(graph))
        equal = torch.equal(results[0], results[1])
        print(f"{kind:14s} {kernels:7d} {times[0]:10.1f} {times[1]:8.1f} {(times[0] - times[1]) / kernels:18.2f} "
              f"{equal}", flush=True)


if __name__ == "__main__":
    main()
