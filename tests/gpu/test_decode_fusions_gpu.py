"""Fusions of the V4.1 decode step's small launches that must not change a bit: the attention's ropes inside its
kernels (dsv4.ops.decode_attention.ROPE_FUSED) and each mHC site's expand with the next sublayer's collapse and
norm (dsv4.ops.mhc_streams.expand_collapse_rms_norm_triton, DSV4_MHC_EXPAND_COLLAPSE). Each switched off gives the
unfused launches; the step's logits must be the same bits (bf16 and fp32, batches 1 and 5, in CUDA graphs), and the
golden fp32 tokens must hold with everything on."""

from __future__ import annotations

import json
import os

import pytest
import torch
from engine_runs import run_to_completion

from dsv4.engine.engine import LLMEngine
from dsv4.models import deepseek_v41
from dsv4.ops import decode_attention
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def _decode_logits(dtype: str, batch: int) -> list[torch.Tensor]:
    """Every decode step's logits of a greedy run of `batch` requests (FULL graphs)."""
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype=dtype, max_model_len=128, max_num_seqs=8)
    assert eng.runner.graphs.enabled
    seen: list[torch.Tensor] = []
    model = eng.runner.model
    real = model.compute_logits

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden)
        seen.append(out.clone())
        return out
    model.compute_logits = keep
    g = torch.Generator().manual_seed(batch)
    prompts = {str(i): torch.randint(10, 200, (int(n),), generator=g).tolist()
               for i, n in enumerate(torch.randint(5, 60, (batch,), generator=g))}
    run_to_completion(eng, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    del eng
    torch.cuda.empty_cache()
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("batch", [1, 5])
def test_fusions_keep_every_bit(monkeypatch: pytest.MonkeyPatch, dtype: str, batch: int) -> None:
    monkeypatch.setattr(decode_attention, "ROPE_FUSED", False)
    monkeypatch.setattr(deepseek_v41, "FUSED_EXPAND_COLLAPSE", False)
    off = _decode_logits(dtype, batch)
    monkeypatch.setattr(decode_attention, "ROPE_FUSED", True)
    monkeypatch.setattr(deepseek_v41, "FUSED_EXPAND_COLLAPSE", True)
    on = _decode_logits(dtype, batch)
    assert len(on) == len(off) >= 12
    for a, b in zip(on, off):
        assert torch.equal(a, b), (a - b).abs().max()


def test_golden_tokens_with_the_fusions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepseek_v41, "FUSED_EXPAND_COLLAPSE", True)  # opt-in: measured slower, kept tested
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    assert decode_attention.ROPE_FUSED and deepseek_v41.FUSED_EXPAND_COLLAPSE
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=96, max_num_seqs=4)
    out = run_to_completion(eng, {"0": exp["prompt_token_ids"]},
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert out["0"] == exp["greedy_token_ids"]
