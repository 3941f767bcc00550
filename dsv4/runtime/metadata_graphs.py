"""CUDA graphs of the decode-metadata builds (runtime.md 5.6; the seed's `AttnMetadataCudaGraphs`).

A FULL decode step replays the forward as one CUDA graph, but the runner still launches the metadata build before
it from the host. `AttnMetadataGraphs` records, at capture time, the build of every uniform-decode step shape a
FULL graph serves and replays it instead, returning the metadata object captured with it: a decode step is then
two graph replays with no eager kernel between them.

A key is (num_reqs, num_reqs_padded, num_tokens, num_tokens_padded): the unpadded counts belong to it because a
build makes host decisions from them (the Triton build takes num_reqs as an argument: padding rows are the rows
past it). Keys come from the forward graphs' capture sizes rounded up to whole requests of the decode query length
q: a graph of S tokens serves S / q padded requests and every real request count that pads to it.

Builds of different KV groups are independent (each reads the step's positions, state rows and its own block table
and writes only its own buffers), so a capture forks them onto side streams; builds whose block tables share
storage stay on one stream, in order (a build may write its table: the seed's sparse-MLA builder clamps it in
place; ours do not, but the rule costs nothing and keeps a future one safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

GraphKey = tuple[int, int, int, int]  # (num_reqs, num_reqs_padded, num_tokens, num_tokens_padded)


def capture_keys(capture_sizes: list[int], decode_query_len: int, max_num_seqs: int) -> list[GraphKey]:
    """The keys of every uniform-decode step the FULL graphs of `capture_sizes` (tokens) serve, largest first: each
    size rounds up to whole requests of `decode_query_len` tokens (sizes past max_num_seqs requests are dropped),
    and a step of n requests replays the smallest graph that holds them."""
    q = decode_query_len
    padded_reqs = sorted({-(-s // q) for s in capture_sizes if s > 0 and -(-s // q) <= max_num_seqs})
    keys: list[GraphKey] = []
    first = 1
    for padded in padded_reqs:
        keys += [(n, padded, n * q, padded * q) for n in range(first, padded + 1)]
        first = padded + 1
    return keys[::-1]


def step_key(num_scheduled: np.ndarray, num_reqs_padded: int | None, decode_query_len: int,
             has_prefill: bool, adaptive: bool = False) -> GraphKey | None:
    """The key of a step, or None when its build cannot be a recorded one: no FULL graph (num_reqs_padded None), a
    prefill (or replaying) row, query lengths other than the decode query length, or adaptive verification (the
    device, not the host, splits the drafts: host query lengths are only bounds)."""
    R = len(num_scheduled)
    q = decode_query_len
    if num_reqs_padded is None or has_prefill or adaptive or R == 0 or not (num_scheduled == q).all():
        return None
    return (R, num_reqs_padded, R * q, num_reqs_padded * q)


@dataclass(frozen=True)
class GroupBuild:
    """One KV group's part of the decode-metadata build."""

    name: str
    table: torch.Tensor  # the block table it reads (builds of tables sharing storage are never forked)
    run: Callable[[GraphKey], None]  # writes the group's persistent metadata buffers for a step of that key
    can_record: bool = True  # writes only persistent buffers, host decisions only from the key


def branches_by_storage(builds: list[GroupBuild]) -> list[list[GroupBuild]]:
    """Builds grouped by the storage of their block tables, in first-seen order, each branch in the builds'
    order: the units that may run concurrently."""
    branches: dict[int, list[GroupBuild]] = {}
    for b in builds:
        branches.setdefault(b.table.untyped_storage().data_ptr(), []).append(b)
    return list(branches.values())


class AttnMetadataGraphs:
    """Recorded decode-metadata builds by key; `replay` returns the metadata captured with a key's build."""

    def __init__(self, capture_sizes: list[int], decode_query_len: int, max_num_seqs: int, fork: bool = True) -> None:
        self.capture_sizes, self.decode_query_len, self.max_num_seqs = capture_sizes, decode_query_len, max_num_seqs
        self.fork = fork
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._side_streams: list[torch.cuda.Stream] = []
        self._warned = False
        self.num_replays = 0
        self.num_misses = 0

    def capture_keys(self) -> list[GraphKey]:
        return capture_keys(self.capture_sizes, self.decode_query_len, self.max_num_seqs)

    def key(self, num_scheduled: np.ndarray, num_reqs_padded: int | None, has_prefill: bool,
            adaptive: bool = False) -> GraphKey | None:
        return step_key(num_scheduled, num_reqs_padded, self.decode_query_len, has_prefill, adaptive)

    @staticmethod
    def can_record(builds: list[GroupBuild]) -> bool:
        """Whether every build may be recorded (else steps build eagerly)."""
        return all(b.can_record for b in builds)

    def build(self, key: GraphKey, builds: list[GroupBuild], finish: Callable[[GraphKey], Any]) -> Any:
        """Run the builds of `key` (forked by storage on CUDA) and return `finish(key)`, the metadata object."""
        branches = branches_by_storage(builds)
        if not self.fork or len(branches) < 2 or not builds[0].table.is_cuda:
            for b in builds:
                b.run(key)
            return finish(key)
        while len(self._side_streams) < len(branches):  # reused: a warm-up and its capture use the same streams
            self._side_streams.append(torch.cuda.Stream(device=builds[0].table.device))
        main = torch.cuda.current_stream(builds[0].table.device)
        for stream, branch in zip(self._side_streams, branches):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                for b in branch:
                    b.run(key)
        for stream in self._side_streams[: len(branches)]:
            main.wait_stream(stream)
        return finish(key)

    def capture(self, key: GraphKey, builds: list[GroupBuild], finish: Callable[[GraphKey], Any],
                pool: Any) -> Any:
        """Build `key` once eagerly (compiles kernels, makes lazy allocations), then record it in `pool` (the
        forward graphs' pool); returns the metadata object that replays of `key` return."""
        self.build(key, builds, finish)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            md = self.build(key, builds, finish)
        self._graphs[key] = (graph, md)
        return md

    def replay(self, key: GraphKey) -> Any | None:
        """Relaunch the recorded build of `key` and return its metadata, or None (warning once) when `key` was
        not recorded: the caller builds eagerly."""
        entry = self._graphs.get(key)
        if entry is None:
            self.num_misses += 1
            if not self._warned:
                self._warned = True
                logger.warning("decode step %s has no recorded metadata build; building it eagerly", key)
            return None
        graph, md = entry
        graph.replay()
        self.num_replays += 1
        return md

    def recorded(self) -> list[GraphKey]:
        return sorted(self._graphs)

    def release(self) -> None:
        """Drop every recording (before the KV cache or the forward graphs are rebuilt: graphs hold addresses)."""
        self._graphs.clear()
