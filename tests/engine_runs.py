"""Not a test file: test modules import it (`from engine_runs import ...`; pytest puts tests/ on sys.path, and
tests/gpu/conftest.py does for the GPU tests). One engine run to the end, the loop many tests wrote inline, and a
CPU stand-in for CUDA graph capture and replay."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


def oracle_sequences(prompts: Sequence[list[int]], outputs: Sequence[list[int]], wrong_every: int = 0
                     ) -> dict[str, list[int]]:
    """The OracleProposer's sequences for requests "0", "1", ..: request r drafts prompts[r] + outputs[r] (its
    plain continuation), with a wrong token every `wrong_every` positions (0: none) from position len(prompt) + 2 +
    r on, so the rejections fall at offsets that differ per request."""
    out = {}
    for r, (prompt, output) in enumerate(zip(prompts, outputs)):
        seq = list(prompt) + list(output)
        if wrong_every:
            for j in range(len(prompt) + 2 + r, len(seq), wrong_every):
                seq[j] = (seq[j] + 1) % 500
        out[str(r)] = seq
    return out


def demo_code_prompts(model_dir: str) -> dict[str, list[int]]:
    """Three short code prompts (BOS first) in the built-in trained model's tokens, by request id "0".."2"."""
    from dsv4.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    texts = ["def __init__(self", "import os\nimport sys\n\n\ndef main(", "class Queue:\n    def "]
    return {str(i): [tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for i, t in enumerate(texts)}


def top_k_probs(logprobs: Mapping[int, Any], k: int) -> dict[int, float]:
    """A position's logprobs (token -> Logprob) as the distribution of temperature 1, top-k k: the k best,
    renormalised."""
    best = sorted(logprobs.items(), key=lambda kv: -kv[1].logprob)[:k]
    z = sum(math.exp(v.logprob) for _, v in best)
    return {t: math.exp(v.logprob) / z for t, v in best}


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
