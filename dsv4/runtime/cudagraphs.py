"""FULL decode CUDA graphs (runtime.md 1.9): one graph per capture size, replayed for uniform-decode steps.

A uniform-decode step (every request computes exactly one token) of R requests replays the graph of the smallest
capture size P >= R; rows [R, P) are padding (seq_len 0, no visible keys, writes to the trash slot). Everything a
graph reads lives in persistent buffers that the runner fills before the replay; all graphs share one memory
pool; each size is warmed eagerly before it is captured. Mixed and prefill steps run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dsv4.distributed import release_before_teardown

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes + [max_num_seqs]))


def round_capture_sizes(sizes: list[int], decode_query_len: int, max_num_seqs: int) -> list[int]:
    """Round every size up to a whole number of requests of `decode_query_len` tokens (only such token counts can
    be a uniform decode), dropping those beyond max_num_seqs requests; ascending, unique."""
    q = decode_query_len
    limit = max_num_seqs * q
    out = sorted({-(-s // q) * q for s in sizes if s > 0})
    out = [s for s in out if s <= limit]
    return out or [q]


class CudaGraphManager:
    """Captures `run(size) -> output tensor` once per size and replays the smallest graph that holds a batch."""

    def __init__(self, capture_sizes: list[int], enabled: bool) -> None:
        self.capture_sizes = sorted(capture_sizes)
        self.enabled = enabled
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def padded_size(self, num_tokens: int) -> int | None:
        """The capture size a uniform decode of `num_tokens` tokens replays; None: run eagerly."""
        if not self.enabled:
            return None
        return next((s for s in self.capture_sizes if s >= num_tokens), None)

    def capture(self, run: Callable[[int], torch.Tensor], warmups: int = 2) -> None:
        """Capture every size, largest first (later, smaller graphs reuse the pool's blocks)."""
        if not self.enabled:
            return
        self.pool = torch.cuda.graph_pool_handle()
        release_before_teardown(self.release)  # the graphs may hold NCCL collectives (several ranks)
        for size in sorted(self.capture_sizes, reverse=True):
            for _ in range(warmups):  # every kernel compiled and every lazy allocation made outside the graph
                run(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = run(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (sizes %s)", len(self.graphs), self.capture_sizes)

    def replay(self, size: int) -> torch.Tensor:
        """Relaunch the graph of `size`; returns its output buffer (valid until the next replay)."""
        graph, out = self.graphs[size]
        graph.replay()
        return out

    def release(self) -> None:
        """Drop every graph (e.g. before the KV cache is re-initialized)."""
        self.graphs.clear()
        self.pool = None
