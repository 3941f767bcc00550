"""A second CUDA stream for the independent chains of a decode forward (issue 24; the side-stream pattern of the
seeds, and SGLang's alternate stream in DeepSeek's decode graphs at small batch).

At small batch a decode layer is a chain of launches, most of them a few microseconds of fixed latency next to a
few bandwidth-bound products. Some chains do not depend on each other: the compressor's publish and the indexer's
selection read the attention input and the query latent but not the queries or the window write; the shared expert
reads the FFN input but not the router. Forking one onto a side stream lets the GPU run it beside the other; under
CUDA graph capture the fork and join become edges of the graph (the driver runs the branches concurrently).
Engram's hash and table rows read only the tokens: they start at the top of the forward, on a lane of their own.
V4.1's delayed mHC lets each site's mixes (pre, post, comb) run beside its sublayer on the "mhc" lane: the
sublayer's input is collapsed with the previous site's pre, and the mixes are first read by the site's expand.

`SIDE.fork(t)` runs its body on the side stream after everything the current stream has enqueued so far; `SIDE.join(t)`
makes the current stream wait for everything the side stream has enqueued so far. On by default
(`DSV4_DECODE_SIDE_STREAM=0` turns it off); off the GPU and while torch.compile traces, both run inline: the body runs
on the current stream where it stands, so the results are the same values in the same order of dependent work.

Memory: a tensor the side stream allocates goes back to the side stream's blocks when freed, and the side stream
allocates again only inside a fork, after that fork's wait, i.e. after every main-stream kernel enqueued before it
(the consumers of what it made before). A main-stream tensor the side stream reads must stay referenced until the
main stream has joined, which every caller here does by holding it to the end of the forward that forks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Timed (2026-12-06-h100-decode-optins, H100, V4.1-Flash-8l): the batch-1 replay 3.377 -> 3.317 ms, batch 64
# unchanged (7.19 / 7.20 ms): at 64 rows the products fill the GPU and the forked chains only queue beside them.
ENABLED = os.environ.get("DSV4_DECODE_SIDE_STREAM", "1") == "1"

# Lanes besides the default "layer" one (the compressor's publish, the indexer's picks, the shared expert):
MHC_LANE = "mhc"  # V4.1's mHC mixes of a site, beside its sublayer (`DecoderLayerV41.forward_decode`)
WINDOW_LANE = "window"  # a decode layer's window write, beside its query projection
ROUTER_LANE = "router"  # a MoE's routing, beside its every-expert gate / up product (dsv4.models.layers.moe)


class SideStream:
    """Side streams per (device, lane), created on first use and kept (a capture and its warm-up use the same ones).
    Work on one lane runs in order: a chain that should not queue behind another one takes a lane of its own."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self.enabled = ENABLED

    def active(self, t: torch.Tensor) -> bool:
        """Whether forks on t's device go to a side stream (else they run inline)."""
        return self.enabled and t.is_cuda and not torch.compiler.is_compiling()

    def _stream(self, device: torch.device, lane: str) -> torch.cuda.Stream:
        key = (device.index if device.index is not None else torch.cuda.current_device(), lane)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key[0])
        return self._streams[key]

    @contextmanager
    def fork(self, t: torch.Tensor, lane: str = "layer") -> Iterator[None]:
        """Run the body on the lane's side stream, after the work the current stream has enqueued so far."""
        if not self.active(t):
            yield
            return
        side = self._stream(t.device, lane)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            yield

    def join(self, t: torch.Tensor, lane: str = "layer") -> None:
        """The current stream waits for the work the lane's side stream has enqueued so far."""
        if self.active(t):
            torch.cuda.current_stream(t.device).wait_stream(self._stream(t.device, lane))


SIDE = SideStream()
