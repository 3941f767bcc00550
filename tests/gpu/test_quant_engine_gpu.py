"""Released-layout checkpoints on CUDA: the engine keeps FP8 / MXFP4 weights as stored (Triton W8A16 / W4A16
kernels, CUDA graphs) and gives the dequantize-at-load engine's greedy tokens; weights stay at their stored size.

fp32 bound: both engines multiply the same fp32 values (an FP8 / FP4 code times a power-of-two scale is exact);
only the summation order differs (Triton tiles vs cuBLAS / torch), ~K * 2^-24 relative per dot product, which
through a 4-6 layer tiny model stays far below 1e-3 in logprobs. bf16: weights decoded to bf16 are exact too, the
activations round to bf16 (2^-8) in both engines at different points: greedy tokens may split on near-ties, so
bf16 asserts agreement of most tokens and a logprob bound, not identity."""

from __future__ import annotations

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.make_model import make_model
from dsv4.quant.layers import Fp8Linear, QuantExperts

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 8], list(range(40, 75)), [11] * 19]


@pytest.fixture(scope="module", params=["tiny-v4", "tiny-v41"])
def released(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(request.param, str(tmp_path_factory.mktemp(request.param)), seed=1, quant="released")


def _run(model_dir: str, quantization: str, dtype: str, **kw: object) -> tuple[list, LLM]:
    llm = LLM(model_dir, dtype=dtype, device="cuda", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, quantization=quantization, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [max(s.values(), key=lambda lp: lp.logprob).logprob
                                      for s in o.outputs[0].logprobs]) for o in outs], llm


@pytest.mark.parametrize("eager", [True, False])
def test_fp32_quantized_engine_matches_dequantized_on_cuda(released: str, eager: bool) -> None:
    ref, _ = _run(released, "none", "float32", enforce_eager=eager)
    got, llm = _run(released, "auto", "float32", enforce_eager=eager)
    model = llm.engine.runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    for (rt, rl), (gt, gl) in zip(ref, got):
        assert gt == rt
        assert max(abs(a - b) for a, b in zip(rl, gl)) < 1e-3


def test_bf16_quantized_engine_close_to_dequantized_on_cuda(released: str) -> None:
    ref, _ = _run(released, "none", "bfloat16")
    got, _ = _run(released, "auto", "bfloat16")
    same = sum(a == b for (rt, _), (gt, _) in zip(ref, got) for a, b in zip(rt, gt))
    assert same >= 0.8 * sum(len(rt) for rt, _ in ref)
    # the first token of every request comes from the same prompt: its logprob within the bf16 bound
    for (rt, rl), (gt, gl) in zip(ref, got):
        assert rt[0] == gt[0] and abs(rl[0] - gl[0]) < 0.1
