"""Merged sibling projections (dsv4/models/layers/merged.py) on CUDA: the merged FP8 / cuBLAS product at the released
shapes against the separate modules' (one-row gemv, W8A16 and dequantize + cuBLAS paths), under CUDA-graph replay,
and the engine's greedy tokens and logprobs with merging on against merging off (CUDA graphs; one run compiled).

Bounds: the GPU kernels pick tiles and split-K by the output width, so the merged product may sum K in another order
than the separate one. With 16-bit x, each is within 2^-8 |y| (its output rounding) + (K + 8) 2^-23 S (fp32
accumulation; S = sum_k |x_k w_k|) of the fp32 reference y (tests/test_fp8_linear.py derives it; UE8M0 scales make
the weights exact), plus 2^-8 S where cuBLAS (many rows, float weights) may reduce split-K partials in bf16 (torch's
default allow_bf16_reduced_precision_reduction). fp32 engines: the per-dot-product differences, ~K 2^-24 relative, stay far below 1e-3 in
logprobs through the tiny models, and greedy tokens are equal; bf16 engines round activations at every op, so
near-ties may split: most tokens agree and the first one's logprob within 0.1 (as tests/gpu/test_quant_engine_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsv4 import LLM, SamplingParams
from dsv4.make_model import make_model
from dsv4.models.layers import merged
from dsv4.models.layers.merged import MergedLinear, merge_blocker, merge_linears
from dsv4.ops.fp8_linear import fp8_linear_torch
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.layers import Fp8Linear
from dsv4.quant.weight import StoredFormat

# (K, sibling widths, scale block): the releases' q_a + kv and shared gate + up
RELEASED = {"v4.q_a+kv": (4096, (1024, 512), (128, 128)), "v4.shared": (4096, (2048, 2048), (128, 128)),
            "v41.q_a+kv": (5120, (1280, 512), (32, 32)), "v41.shared": (5120, (2304, 2304), (32, 32))}


def _fp8(k: int, n: int, block: tuple[int, int], g: torch.Generator) -> Fp8Linear:
    data, scale = quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5, block, True)
    lin = Fp8Linear(k, n, StoredFormat(False, block, scale.dtype), device="cuda")
    lin.weight, lin.weight_scale = data, scale
    return lin


def _within(got: torch.Tensor, ref32: torch.Tensor, s: torch.Tensor, k: int) -> None:
    err = (got.float() - ref32).abs()
    assert (err <= 2.0 ** -8 * ref32.abs() + (2.0 ** -8 + (k + 8) * 2.0 ** -23) * s).all(), err.max()


@pytest.mark.parametrize("rows", [1, 4, 64, 200])  # gemv, W8A16, W8A16 (one M tile), dequantize + cuBLAS
@pytest.mark.parametrize("shape", list(RELEASED))
def test_merged_fp8_at_released_shapes(shape: str, rows: int) -> None:
    k, widths, block = RELEASED[shape]
    g = torch.Generator(device="cuda").manual_seed(rows + k)
    mods = [_fp8(k, n, block, g) for n in widths]
    assert merge_blocker(mods) is None
    m = merge_linears(mods)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    for part, mod in zip(m(x), mods):
        sep = mod(x)
        ref32 = fp8_linear_torch(x.float(), mod.qweight)
        s = x.float().abs() @ mod.qweight.dequantize().abs().t()
        _within(part, ref32, s, k)
        _within(sep, ref32, s, k)


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_merged_float_linear_on_cuda(rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows)
    k, widths = 4096, (1024, 512)
    mods = [nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for n in widths]
    with torch.no_grad():
        for mod in mods:
            mod.weight.copy_(torch.randn(mod.weight.shape, device="cuda", generator=g) * k ** -0.5)
        m = merge_linears(mods)
        x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
        for part, mod in zip(m(x), mods):
            ref32 = F.linear(x.float(), mod.weight.float())
            s = x.float().abs() @ mod.weight.float().abs().t()
            _within(part, ref32, s, k)
            _within(mod(x), ref32, s, k)


def test_merged_fp8_under_graph_replay() -> None:
    """Captured once at one row, replayed on a new x: equal to eager on it."""
    k, widths, block = RELEASED["v4.q_a+kv"]
    g = torch.Generator(device="cuda").manual_seed(7)
    m = merge_linears([_fp8(k, n, block, g) for n in widths])
    x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
    m(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = m(x)
    x.copy_(torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, m(x)):
        assert torch.equal(a, b)


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 8], list(range(40, 75)), [11] * 19]
# V4's released blocks are 128 rows: these widths let both of its groups merge (the tiny ones, 32, cannot)
V4_FP8_MERGEABLE = {"q_lora_rank": 128, "moe_intermediate_size": 128}
CASES = {"v4-float": ("tiny-v4", None, None), "v41-float": ("tiny-v41", None, None),
         "v4-released": ("tiny-v4", "released", V4_FP8_MERGEABLE), "v41-released": ("tiny-v41", "released", None)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {name: make_model(preset, str(tmp_path_factory.mktemp(name)), seed=1, quant=quant, overrides=over)
            for name, (preset, quant, over) in CASES.items()}


def _run(model_dir: str, merge: bool, dtype: str, monkeypatch: pytest.MonkeyPatch,
         **kw: object) -> tuple[list, int, int]:
    """(per prompt: greedy tokens, their logprobs), the merged groups, the weights' bytes."""
    monkeypatch.setattr(merged, "MERGE_SIBLINGS", merge)
    llm = LLM(model_dir, dtype=dtype, device="cuda", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    model = llm.engine.runner.model
    groups = sum(isinstance(m, MergedLinear) for m in model.modules())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del llm
    return [(o.outputs[0].token_ids, [max(s.values(), key=lambda lp: lp.logprob).logprob
                                      for s in o.outputs[0].logprobs]) for o in outs], groups, nbytes


@pytest.mark.parametrize("case,compile_decode", [(c, False) for c in CASES] + [("v4-float", True),
                                                                              ("v41-released", True)])
def test_engine_fp32_merged_equals_unmerged_with_cuda_graphs(checkpoints: dict[str, str], case: str,
                                                             compile_decode: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    off, off_groups, off_bytes = _run(checkpoints[case], False, "float32", monkeypatch, compile_decode=compile_decode)
    on, on_groups, on_bytes = _run(checkpoints[case], True, "float32", monkeypatch, compile_decode=compile_decode)
    # q_a + kv, gate + up a layer; V4 also its 3 compressors' projections (2 CSA, 1 HCA layer)
    assert off_groups == 0 and on_groups == (2 * 4 + 3 if case.startswith("v4-") else 2 * 6)
    assert on_bytes == off_bytes
    for (rt, rl), (gt, gl) in zip(off, on):
        assert gt == rt
        assert max(abs(a - b) for a, b in zip(rl, gl)) < 1e-3


@pytest.mark.parametrize("case", ["v4-released", "v41-released"])
def test_engine_bf16_merged_close_to_unmerged(checkpoints: dict[str, str], case: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    off, _, _ = _run(checkpoints[case], False, "bfloat16", monkeypatch)
    on, _, _ = _run(checkpoints[case], True, "bfloat16", monkeypatch)
    same = sum(a == b for (rt, _), (gt, _) in zip(off, on) for a, b in zip(rt, gt))
    assert same >= 0.8 * sum(len(rt) for rt, _ in off)
    for (rt, rl), (gt, gl) in zip(off, on):
        assert rt[0] == gt[0] and abs(rl[0] - gl[0]) < 0.1
