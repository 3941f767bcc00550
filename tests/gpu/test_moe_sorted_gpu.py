"""The sorted-rows routed experts (dsv4/ops/moe_sorted.py: torch's CUTLASS grouped GEMM) on the GPU at Flash expert
shapes (V4-Flash: hidden 4096, expert width 2048; V4.1-Flash: 5120, 2304; 16 experts, top-6), bf16: against the Triton
route-order path (`moe_output` with the switch off) to bf16 rounding, with rows of other ranks' experts zero, without
a host sync; released-format experts (MXFP4, FP8) dequantized whole or in pieces against the W4A16 / W8A16 kernel;
the dequant kernel with subnormal outputs; the switch's conditions; a tiny V4.1 engine with the path on."""

from __future__ import annotations

import pytest
import torch

from dsv4.llm import LLM
from dsv4.models.layers.moe import moe_output
from dsv4.ops import moe_sorted
from dsv4.ops.expert_dequant import dequantize_experts_triton
from dsv4.sampling_params import SamplingParams
from test_moe_quant import fp8_weight, mxfp4_weight

SHAPES = {"v4": (4096, 2048), "v41": (5120, 2304)}
E, TOP_K = 16, 6


def _layer(shape: str, T: int, seed: int) -> tuple[torch.Tensor, ...]:
    D, inter = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, generator=g, **bf)
    gate_up = torch.randn(E, 2 * inter, D, generator=g, **bf) * D ** -0.5
    down = torch.randn(E, D, inter, generator=g, **bf) * inter ** -0.5
    idx = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :TOP_K]
    weights = torch.rand(T, TOP_K, generator=g, device="cuda")
    return x, gate_up, down, idx, weights, torch.zeros(T, D, **bf)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Both accumulate in fp32 and round each GEMM's output (and the SwiGLU) to bf16 once; only the fp32 sums' order
    differs, so the outputs agree to a few bf16 ulps of their scale."""
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= 4 * 2 ** -8 * ref.float().abs().max().item(), err


@pytest.mark.parametrize("shape", ["v4", "v41"])
@pytest.mark.parametrize("T", [200, 2048])
@pytest.mark.parametrize("before", [False, True])
def test_sorted_path_equals_the_triton_path(monkeypatch: pytest.MonkeyPatch, shape: str, T: int,
                                            before: bool) -> None:
    x, gate_up, down, idx, weights, shared = _layer(shape, T, T + before)
    args = (x, weights, idx, gate_up, down, 7.0)
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", False)
    ref = moe_output(*args, weight_before_down=before, fixed=False, shared=shared)
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", True)
    monkeypatch.setattr(moe_sorted, "MIN_ROWS", 1)
    assert moe_sorted.use_sorted_experts(x, gate_up, down, T * TOP_K)
    torch.cuda.set_sync_debug_mode("error")  # sorting, offsets, gathers and GEMMs stay on the device
    try:
        got = moe_output(*args, weight_before_down=before, fixed=False, shared=shared)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _close(got, ref)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("chunk", [False, True])
def test_quantized_experts_equal_the_w4a16_path(monkeypatch: pytest.MonkeyPatch, fmt: str, chunk: bool) -> None:
    """Released-format experts (V4.1-Flash shapes): dequantized then the grouped GEMM, whole or 5 experts at a
    time, against the stored-weight Triton kernel (`expert_grouped_q`), to bf16 rounding."""
    D, inter = SHAPES["v41"]
    g = torch.Generator(device="cuda").manual_seed(4)
    if fmt == "mxfp4":
        gate_up = mxfp4_weight(E, 2 * inter, D, g, scales=(118, 122), extreme=False, device="cuda")
        down = mxfp4_weight(E, D, inter, g, scales=(118, 122), extreme=False, device="cuda")
    else:
        gate_up = fp8_weight(E, 2 * inter, D, (128, 128), True, g, extreme=False, device="cuda")
        down = fp8_weight(E, D, inter, (128, 128), True, g, extreme=False, device="cuda")
    x, _, _, idx, weights, shared = _layer("v41", 1024, 8)
    args = (x, weights, idx, gate_up, down, 7.0)
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", False)
    ref = moe_output(*args, weight_before_down=True, fixed=False, shared=shared)
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", True)
    monkeypatch.setattr(moe_sorted, "MIN_ROWS", 1)
    monkeypatch.setattr(moe_sorted, "MIN_QUANT_ROWS_PER_EXPERT", 0)
    if chunk:
        monkeypatch.setattr(moe_sorted, "DEQUANT_BYTES", 5 * 2 * inter * D * 2)
        assert moe_sorted.experts_per_chunk(gate_up, torch.bfloat16) == 5
    got = moe_output(*args, weight_before_down=True, fixed=False, shared=shared)
    _close(got, ref)


def test_dequant_kernel_keeps_bf16_subnormals() -> None:
    """The MXFP4 dequant kernel on the GPU equals `QuantWeight.dequantize` bit for bit with scale bytes 0 and 1 too
    (products below bf16's smallest normal; the CPU interpreter's cast flushes them), and 254 / 255 (inf, NaN)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    w = mxfp4_weight(4, 64, 256, g, device="cuda")
    w.scale.view(-1)[:8] = torch.tensor([0, 1, 0, 1, 254, 255, 2, 3], dtype=torch.uint8, device="cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        torch.testing.assert_close(dequantize_experts_triton(w, dtype), w.dequantize(dtype), rtol=0, atol=0,
                                   equal_nan=True)


def test_rows_of_other_ranks_experts_are_zero() -> None:
    x, gate_up, down, idx, weights, _ = _layer("v4", 512, 3)
    cut = torch.where(idx >= 8, -1, idx)
    got = moe_sorted.experts_sorted(x, weights, cut, gate_up[:8], down[:8], 7.0, True, missing=True)
    gone = cut.flatten() < 0
    assert gone.any() and (got[gone] == 0).all() and got[~gone].abs().amax() > 0
    full = moe_sorted.experts_sorted(x, weights, idx, gate_up, down, 7.0, True, missing=False)
    _close(got[~gone], full[~gone])


def test_the_switch_needs_bf16() -> None:
    x, gate_up, down, *_ = _layer("v4", 8, 0)
    assert moe_sorted.grouped_mm_fast(x, gate_up) == (torch.cuda.get_device_capability()[0] in (9, 10))
    assert not moe_sorted.grouped_mm_fast(x.float(), gate_up.float())


def test_engine_prefill_through_the_sorted_path(tiny_v41: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tiny V4.1 on CUDA (graphs for decode): the prefill steps take the sorted path; the first token of each
    prompt (decided by the prefill alone) and the prompt logprobs equal the default path's to bf16 noise."""
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 90, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run() -> list:
        llm = LLM(tiny_v41, dtype="bfloat16", max_model_len=512, skip_tokenizer_init=True)
        return llm.generate(prompts, params)

    plain = run()
    calls = []
    real = moe_sorted.experts_sorted_rows
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", True)
    monkeypatch.setattr(moe_sorted, "MIN_ROWS", 1)
    monkeypatch.setattr(moe_sorted, "experts_sorted_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = run()
    assert calls
    for a, b in zip(plain, got):
        t = a.outputs[0].token_ids[0]
        assert b.outputs[0].token_ids[0] == t
        assert abs(a.outputs[0].logprobs[0][t].logprob - b.outputs[0].logprobs[0][t].logprob) < 0.05
