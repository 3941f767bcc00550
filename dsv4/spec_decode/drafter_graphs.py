"""The drafter's proposal replayed as CUDA graphs (speculative config `"drafter_cuda_graphs": true`): DeepSeek-V4.1's
DSpark drafter and DeepSeek-V4's MTP layer.

Both reference forwards (dspark.py, mtp.py) are hundreds of small kernels a proposal: mHC mixes (Sinkhorn
iterations), the attention over the context window recomputed from the taps, an MoE; DSpark's three stages and the
sequential Markov chain of its block, or the MTP layer re-applied k times. Eagerly that is launch-bound (DSpark: about
10 ms a proposal on the H200 at V4.1-Flash-8l shapes, against a 3.7 ms plain decode step), while the weights and
activations are read in about a millisecond. Captured once per request count, a proposal is one graph launch.

What a graph reads is persistent: the speculator's tap ring (`TapBuffer.values`), the device token history (MTP:
the token after each context position), and this module's buffers of the proposing requests' state rows, last
committed positions and anchors, which `propose` fills before the replay. The gathers of each request's window
from the tap ring and the history are inside the graph. A proposal of S requests replays the graph of the smallest
capture size P >= S; the padding rows [S, P) read state row 0 at position 0 with anchor 0 and their drafts are
dropped: every row of the drafter is its own sequence (its attention sees its own window and drafts, the MoE routes
each row alone), so padding cannot change a real row. Without a graph of a size that holds the batch (more
requests than the largest capture, or graphs off: CPU, enforce_eager) the proposal runs eagerly, as the reference.

The captured forward takes the MoE's fixed-shape path (`moe_output(fixed=True)`, no host sync), which computes the
same function as the grouped path of the eager reference; tests/test_drafter_graphs.py checks both against each
other on the CPU, with a stand-in that re-runs the captured closure at replay, and tests/gpu/test_dspark_graphs_gpu.py
checks the real graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dsv4.runtime.cudagraphs import CudaGraphManager
from dsv4.spec_decode.dspark import DSparkDrafter
from dsv4.spec_decode.mtp import MTPDrafter
from dsv4.spec_decode.proposer import DSparkProposer, MTPProposer, TapBuffer, as_device


class ProposalGraphs:
    """The graph half of a graphed proposer (mixed in before the eager proposer): persistent inputs, one graph per
    capture size (request counts), the replay. The subclass supplies `_fixed_proposal` (the capturable forward);
    `propose` replays a graph when one holds the batch, else it is the eager proposer's (next in the MRO)."""

    def _init_graphs(self, taps: TapBuffer, capture_sizes: list[int], enabled: bool) -> None:
        self.taps = taps
        dev = taps.values.device
        n = taps.values.shape[0]  # state rows: no proposal has more requests
        self.rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.last = torch.zeros(n, dtype=torch.int64, device=dev)
        self.anchors = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs = CudaGraphManager([s for s in capture_sizes if s <= n], enabled=enabled)
        self.num_graph_replays = 0
        self.num_eager_proposals = 0

    def _fixed_proposal(self, rows: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Drafts [S, K] of the buffer rows given, fixed shapes and no host read (what a graph captures)."""
        raise NotImplementedError

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        """The drafts of a replayed graph (valid until the next replay: the speculator copies them out first), or
        the eager proposer's (counted) when no captured graph holds the batch."""
        S = len(rows)
        P = self.graphs.padded_size(S)
        if taps is not self.taps or P is None or P not in self.graphs.graphs:
            self.num_eager_proposals += 1
            return super().propose(req_ids, rows, last_positions, anchors, taps)  # type: ignore[misc]
        dev = self.rows.device  # the persistent inputs, padded with state row 0, position 0, anchor 0
        self.rows[:S].copy_(as_device(rows, dev))
        self.last[:S].copy_(as_device(last_positions, dev))
        self.anchors[:S].copy_(anchors)
        self.rows[S:P].zero_()
        self.last[S:P].zero_()
        self.anchors[S:P].zero_()
        self.num_graph_replays += 1
        return self.graphs.replay(P)[:S]

    def _run(self, size: int) -> torch.Tensor:
        return self._fixed_proposal(self.rows[:size], self.last[:size], self.anchors[:size])

    def capture(self) -> None:
        """Capture every size (no-op when graphs are off) on all-padding inputs (they read and write nothing but this
        module's buffers and the graph pool)."""
        if not self.graphs.enabled:
            return
        self.graphs.release()
        self.rows.zero_()
        self.last.zero_()
        self.anchors.zero_()
        with torch.inference_mode():
            self.graphs.capture(self._run)

    def dummy_forward(self) -> torch.Tensor:
        """The largest proposal on padding inputs: the start-up memory profile counts its activations."""
        with torch.inference_mode():
            return self._run(self.graphs.capture_sizes[-1] if self.graphs.capture_sizes else 1)


class GraphedDSparkProposer(ProposalGraphs, DSparkProposer):
    """`DSparkProposer` whose proposals replay one CUDA graph per capture size."""

    def __init__(self, drafter: DSparkDrafter, embed: nn.Module, lm_head: nn.Module, taps: TapBuffer,
                 capture_sizes: list[int], enabled: bool) -> None:
        DSparkProposer.__init__(self, drafter, embed, lm_head)
        self._init_graphs(taps, capture_sizes, enabled)

    def _fixed_proposal(self, rows: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Each row's window gathered from the tap ring (positions last - W + 1 .. last), then the drafter."""
        ctx = self.taps.gather(rows, last)
        return self.drafter.propose(ctx, last, anchors, self.embed, self.lm_head, fixed=True).tokens


class GraphedMTPProposer(ProposalGraphs, MTPProposer):
    """`MTPProposer` whose proposals replay one CUDA graph per capture size (the anchors are read from the token
    history inside the graph, as the eager proposer reads them)."""

    def __init__(self, drafter: MTPDrafter, k: int, embed: nn.Module, lm_head: nn.Module,
                 token_history: torch.Tensor, taps: TapBuffer, capture_sizes: list[int], enabled: bool) -> None:
        MTPProposer.__init__(self, drafter, k, embed, lm_head, token_history)
        self._init_graphs(taps, capture_sizes, enabled)

    def _fixed_proposal(self, rows: torch.Tensor, last: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return self.propose_on_device(rows, last, self.taps, fixed=True)
