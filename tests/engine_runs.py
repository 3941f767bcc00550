"""Not a test file: test modules import it (`from engine_runs import ...`; pytest puts tests/ on sys.path, and
tests/gpu/conftest.py does for the GPU tests). One engine run to the end, the loop many tests wrote inline, and a
CPU stand-in for CUDA graph capture and replay."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.cudagraphs import CudaGraphManager
from dsv4.runtime.input_batch import InputBatch
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.verify_decode import VerifyDecode, verify_capture_sizes


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


# ---- the multi-row verify decode (dsv4/spec_decode/verify_decode.py) -----------------------------------------------
def run_prompts(model_dir: str, prompts: Sequence[list[int]], params: SamplingParams,
                spec: dict[str, Any] | None = None, oracle: dict[str, list[int]] | None = None, oracle_block: int = 4,
                pad: bool = False, graphs: bool = False, **kw: Any) -> tuple[dict[str, list[int]], LLMEngine]:
    """Outputs by request id ("0", "1", .. in prompt order) of one run of `speculative_engine(...)`, and the engine."""
    e = speculative_engine(model_dir, spec, oracle, oracle_block, pad, graphs, **kw)
    return run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, params), e


def prefix_or_preemption_case(case: str) -> tuple[list[list[int]], dict[str, Any]]:
    """(prompts, engine kwargs) of the speculative tests' two pressure cases on tiny-v41: "prefix_cache" (prompts
    sharing a 38-token prefix, one at a time: later ones hit the cache) or "preemption" (4 prompts in a pool too
    small for all of them)."""
    if case == "prefix_cache":
        shared = [0] + [(11 * j) % 450 + 5 for j in range(37)]
        return [shared + [9, 10], shared + [12, 13, 14], shared + [9, 10]], dict(block_size=4, max_num_seqs=1)
    prompts = [[0] + [(7 * i + j) % 400 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    return prompts, dict(block_size=4, num_kv_blocks=20, enable_prefix_caching=False, max_num_seqs=4)


def against_plain(model_dir: str, prompts: Sequence[list[int]], params: SamplingParams, spec: dict[str, Any],
                  oracle_block: int, wrong_every: int = 4, **kw: Any
                  ) -> tuple[dict[str, list[int]], dict[str, list[int]], LLMEngine]:
    """(plain decoding's outputs, the speculative engine's, that engine): `spec` with an oracle of plain's
    continuations that is wrong every `wrong_every` positions (`oracle_sequences`); `kw` for both engines."""
    base = run_prompts(model_dir, prompts, params, **kw)[0]
    oracle = oracle_sequences(prompts, [base[str(i)] for i in range(len(prompts))], wrong_every)
    outs, e = run_prompts(model_dir, prompts, params, spec, oracle, oracle_block, **kw)
    return base, outs, e


def speculative_engine(model_dir: str, spec: dict[str, Any] | None = None, oracle: dict[str, list[int]] | None = None,
                       oracle_block: int = 4, pad: bool = False, graphs: bool = False, **kw: Any) -> LLMEngine:
    """An engine (max_num_seqs 4 unless given) with speculative config `spec`, an OracleProposer of `oracle`
    (drafting `oracle_block` tokens), and with `pad` the verify steps padded to the graph sizes (`pad_like_graphs`;
    `graphs`: and replayed)."""
    from dsv4.spec_decode.proposer import OracleProposer

    kw.setdefault("max_num_seqs", 4)
    e = LLMEngine.from_args(model_dir, speculative_config=spec, **kw)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, oracle_block))
    if pad:
        pad_like_graphs(e.runner.speculator.verify_decode, graphs)
    return e


def cache_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    """Every tensor of the engine's per-layer KV caches (window KV, entries, indexer keys, compressor rings)."""
    return [getattr(c, f.name) for c in engine.runner.kv_caches for f in dataclasses.fields(c)
            if isinstance(getattr(c, f.name), torch.Tensor)]


def pad_like_graphs(vd: VerifyDecode, graphs: bool = False) -> None:
    """Verify steps padded to the graph sizes (requests 1, 2, 4): run eagerly (an enabled manager with nothing
    captured, as a GPU run whose graph of some size is missing), or `graphs`: "replayed" by `RerunGraphs`, captured
    as the runner captures them. Padding rows must leave the real rows' outputs and caches alone."""
    sizes = verify_capture_sizes([1, 2, 4], vd.q, 4, None)
    vd.graphs = (RerunGraphs if graphs else CudaGraphManager)(sizes, enabled=True)
    if graphs:
        vd.capture()


def compare_verify_with_eager(engine: LLMEngine) -> list[int]:
    """Make every decode-row verify step of `engine` also run through the eager token-row forward from the same
    caches (cloned before, restored after) and check that the hidden states (so the logits rejection.verify gets),
    the drafter's taps and every cache after the step (window KV, entries, indexer keys, compressor rings) agree
    within fp32 round-off. Returns the list the compared steps' token counts are appended to."""
    r = engine.runner
    vd = r.speculator.verify_decode
    assert vd is not None
    orig = vd.forward
    compared: list[int] = []

    def both(batch: InputBatch, taps: dict[int, torch.Tensor | None] | None) -> torch.Tensor:
        tensors = cache_tensors(engine)
        before = [t.clone() for t in tensors]
        md = r.model_state.prepare_attn(batch, r.block_tables)
        extra = dict(r.model_state.prepare_inputs(batch, r.req_state))
        eager_taps = dict.fromkeys(taps) if taps is not None else None
        if eager_taps is not None:
            extra["taps"] = eager_taps
        want = r.model(batch.input_ids, md, r.kv_caches, **extra).clone()
        eager_state = [t.clone() for t in tensors]
        for t, b in zip(tensors, before):
            t.copy_(b)
        # VerifyDecode.reference_forward (the GPU test's and the precision benchmark's) is this same eager forward,
        # and leaves the caches as it found them (the decode-row step below must then match the eager state)
        assert torch.equal(vd.reference_forward(batch), want)
        got = orig(batch, taps)
        # every cache the step writes as the eager step left it, but for row 0 (the trash slot / null ring block,
        # which both paths' masked writes hit)
        for t, w in zip(tensors, eager_state):
            torch.testing.assert_close(t[1:], w[1:], rtol=1e-5, atol=1e-6)
        T = batch.num_tokens
        assert got.shape[0] == T
        torch.testing.assert_close(r.model.compute_logits(got), r.model.compute_logits(want), rtol=1e-5, atol=1e-5)
        if taps is not None:
            assert eager_taps is not None
            for i in taps:
                torch.testing.assert_close(taps[i], eager_taps[i], rtol=1e-4, atol=1e-5)
        compared.append(T)
        return got

    vd.forward = both  # type: ignore[method-assign]
    return compared
