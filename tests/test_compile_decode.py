"""The fixed-shape decode forward traces under torch.compile (what `compile_decode` does before capturing the decode
graphs) and the traced forward equals the eager one on real engine decode steps, for V4 and V4.1 (engram included:
its hash tensors once broke tracing, since dynamo cannot guard on numpy-backed tensors).

The CPU runs the torch paths, not the Triton kernels the GPU dispatches to, so this checks that the model code is
traceable without graph-break errors or guard failures and that tracing keeps the numerics; `aot_eager` keeps it
fast and needs no C++ compiler (inductor's code generation is torch's to test)."""

from __future__ import annotations

import os

import pytest
import torch
from hf_reference import build_hf_model, make_prompt, save_hf_model, tiny_config

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


# both (11-16 s each on two cores) in the slow tier, which CI also runs: the main tier stays under 10 minutes
@pytest.mark.slow
@pytest.mark.parametrize("which", ["v4", "v41"])
def test_compiled_decode_forward_equals_eager(which: str, tmp_path) -> None:
    if which == "v4":
        raw = tiny_config(sliding_window=6, compress_rates={"compressed_sparse_attention": 2,
                                                             "heavily_compressed_attention": 4}, index_topk=3)
        path, vocab = save_hf_model(build_hf_model(raw), str(tmp_path / "v4")), 256
    else:
        path, vocab = GOLDEN, 288
    eng = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=3, load_tokenizer=False)
    model = eng.runner.model
    eager = model.forward_decode
    torch._dynamo.reset()
    compiled = torch.compile(eager, backend="aot_eager", dynamic=False)
    diffs: list[float] = []

    def both(input_ids: torch.Tensor, dmd, caches, **kw) -> torch.Tensor:
        before = [{k: v.clone() for k, v in vars(c).items() if isinstance(v, torch.Tensor)} for c in caches]
        ref = eager(input_ids, dmd, caches, **kw)
        after = [{k: v.clone() for k, v in vars(c).items() if isinstance(v, torch.Tensor)} for c in caches]
        for c, s in zip(caches, before):
            for k, v in s.items():
                getattr(c, k).copy_(v)
        got = compiled(input_ids, dmd, caches, **kw)
        diffs.append((got - ref).abs().max().item())
        for c, s in zip(caches, after):  # the same cache writes
            for k, v in s.items():
                assert torch.allclose(getattr(c, k), v, atol=1e-5), k
        return got

    model.forward_decode = both
    for i, n in enumerate((9, 17, 4)):
        eng.add_request(make_prompt(n, seed=50 + i, vocab_size=vocab, low=3)[0].tolist(),
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), request_id=str(i))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(diffs) >= 4, diffs  # decode steps went through the traced forward
    assert max(diffs) < 1e-5, diffs
