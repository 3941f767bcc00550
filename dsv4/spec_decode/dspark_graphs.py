"""The DSpark drafter's proposal replayed as CUDA graphs (speculative config `"drafter_cuda_graphs": true`).

The drafter's reference forward (dspark.py) is a few hundred small kernels a proposal: three stages, each with two
mHC mixes (Sinkhorn iterations), the block attention over the recomputed context window and an MoE, then the
sequential Markov chain of the block's drafts. Eagerly that is launch-bound (about 10 ms a proposal on the H200 at
V4.1-Flash-8l shapes, against a 3.7 ms plain decode step), while its weights and activations are read in about a
millisecond. Captured once per request count, a proposal is one graph launch.

What a graph reads is persistent: the speculator's tap ring (`TapBuffer.values`), and this module's buffers of the
proposing requests' state rows, last committed positions and anchors, which `propose` fills before the replay. The
gather of each request's window from the tap ring is inside the graph. A proposal of S requests replays the graph of
the smallest capture size P >= S; the padding rows [S, P) read state row 0 at position 0 with anchor 0 and their
drafts are dropped: every row of the drafter is its own sequence (its attention sees its own window and block, the
MoE routes each row alone), so padding cannot change a real row. Without a graph of a size that holds the batch
(more requests than the largest capture, or graphs off: CPU, enforce_eager) the proposal runs eagerly, as the
reference.

The captured forward takes the MoE's fixed-shape path (`moe_output(fixed=True)`, no host sync), which computes the
same function as the grouped path of the eager reference; tests/test_dspark_graphs.py checks both against each other
on the CPU, with a stand-in that re-runs the captured closure at replay, and tests/gpu/test_dspark_graphs_gpu.py
checks the real graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dsv4.runtime.cudagraphs import CudaGraphManager
from dsv4.spec_decode.dspark import DSparkDrafter
from dsv4.spec_decode.proposer import DSparkProposer, TapBuffer, as_device


class GraphedDSparkProposer(DSparkProposer):
    """`DSparkProposer` whose proposals replay one CUDA graph per capture size (request counts)."""

    def __init__(self, drafter: DSparkDrafter, embed: nn.Module, lm_head: nn.Module, taps: TapBuffer,
                 capture_sizes: list[int], enabled: bool) -> None:
        super().__init__(drafter, embed, lm_head)
        self.taps = taps
        dev = taps.values.device
        n = taps.values.shape[0]  # state rows: no proposal has more requests
        self.rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.last = torch.zeros(n, dtype=torch.int64, device=dev)
        self.anchors = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs = CudaGraphManager([s for s in capture_sizes if s <= n], enabled=enabled)
        self.num_graph_replays = 0
        self.num_eager_proposals = 0

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        S = len(rows)
        P = self.graphs.padded_size(S)
        if taps is not self.taps or P is None or P not in self.graphs.graphs:
            self.num_eager_proposals += 1
            return super().propose(req_ids, rows, last_positions, anchors, taps)
        self._fill(rows, last_positions, anchors, S, P)
        self.num_graph_replays += 1
        return self.graphs.replay(P)[:S]  # the speculator copies the drafts out before the next replay

    def _fill(self, rows: np.ndarray | torch.Tensor, last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
              S: int, P: int) -> None:
        """The persistent inputs of a proposal of S requests padded to P (padding: state row 0, position 0)."""
        dev = self.rows.device
        self.rows[:S].copy_(as_device(rows, dev))
        self.last[:S].copy_(as_device(last_positions, dev))
        self.anchors[:S].copy_(anchors)
        self.rows[S:P].zero_()
        self.last[S:P].zero_()
        self.anchors[S:P].zero_()

    def _run(self, size: int) -> torch.Tensor:
        """The proposal of the first `size` buffer rows, drafts [size, K]: the window of each row gathered from the
        tap ring (`TapBuffer.gather` on the device: positions last - W + 1 .. last, slot = position % capacity)."""
        last = self.last[:size]
        ctx = self.taps.gather(self.rows[:size], last)
        return self.drafter.propose(ctx, last, self.anchors[:size], self.embed, self.lm_head, fixed=True).tokens

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
