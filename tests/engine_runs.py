"""Not a test file: test modules import it (`from engine_runs import ...`; pytest puts tests/ on sys.path, and
tests/gpu/conftest.py does for the GPU tests). One engine run to the end, the loop many tests wrote inline, and a
CPU stand-in for CUDA graph capture and replay."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.cudagraphs import CudaGraphManager
from dsv4.sampling_params import SamplingParams


def run_to_completion(engine: LLMEngine, prompts: Mapping[str, str | list[int]],
                      params: SamplingParams | Mapping[str, SamplingParams]) -> dict[str, list[int]]:
    """Add every prompt under its request id (with its own params when `params` maps ids to them), step the engine
    until nothing is left, and return each request's output token ids by request id."""
    for rid, prompt in prompts.items():
        engine.add_request(prompt, params if isinstance(params, SamplingParams) else params[rid], request_id=rid)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return outs


class RerunGraphs(CudaGraphManager):
    """A CPU stand-in for the CUDA graphs: `capture` keeps the run closure, `replay` runs it again. A graph replays
    its kernels on the addresses it captured, so a closure that reads anything but the persistent buffers its owner
    fills before a replay fails here as it would on the GPU."""

    def capture(self, run: Callable[[int], torch.Tensor], warmups: int = 2) -> None:
        self.run = run
        for size in self.capture_sizes:
            run(size)  # the capture's own pass (all padding)
            self.graphs[size] = (None, None)  # type: ignore[assignment]

    def replay(self, size: int) -> torch.Tensor:
        return self.run(size)
