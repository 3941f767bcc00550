"""The one-row Triton GEMV (dsv4/ops/gemv.py) on CUDA at the released shapes, under graph replay, and the engine with
its linears swapped (DSV4_BF16_GEMV, dsv4/models/layers/gemv_linear.py) against the engine without.

Bound (as tests/gpu/test_merged_gpu.py): a 16-bit product is within 2^-8 |y| (its output rounding) + (K + 8) 2^-23 S
(fp32 accumulation in any order; S = sum_k |x_k w_k|) of the fp32 reference y. bf16 engines round activations at
every op, so a different summation order may split near-ties: most greedy tokens agree, the first one and its
logprob (within 0.1) must.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4 import LLM, SamplingParams
from dsv4.make_model import make_model
from dsv4.models.layers import gemv_linear
from dsv4.models.layers.gemv_linear import GemvLinear
from dsv4.ops.gemv import gemv_plan, gemv_triton

# (N, K): V4.1-Flash's q_b, q_a + kv merged, kv, wo_b, shared gate + up merged, shared down, indexer q_b, LM head;
# V4-Flash's q_a + kv; an odd width
SHAPES = [(32768, 1280), (1792, 5120), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304), (4096, 1280),
          (129280, 5120), (1536, 4096), (1000, 3000)]


def _within(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref32 = F.linear(x.float(), w.float())
    s = x.float().abs() @ w.float().abs().t()
    err = (got.float() - ref32).abs()
    assert (err <= 2.0 ** -8 * ref32.abs() + (w.shape[1] + 8) * 2.0 ** -23 * s).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", SHAPES)
def test_gemv_at_released_shapes(N: int, K: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(dtype)
    x = torch.randn(1, K, device="cuda", generator=g).to(dtype)
    _within(gemv_triton(x, w), x, w)
    # zeros, and values near the dtype's top (fp32 sums do not overflow)
    big = torch.full((1, K), 2.0 ** 7, device="cuda", dtype=dtype)
    _within(gemv_triton(big, w), big, w)
    assert not gemv_triton(torch.zeros_like(x), w).any()
    # a strided row (a view of a wider activation) and each plan the sweep would try
    wide = torch.randn(3, K + 64, device="cuda", generator=g).to(dtype)
    _within(gemv_triton(wide[1:2, 32:32 + K], w), wide[1:2, 32:32 + K], w)
    for bn, bk, nw in ((8, 128, 4), (32, 512, 8)):
        _within(gemv_triton(x, w, gemv_plan(N, K, 132, bn, bk, nw)), x, w)


def test_gemv_under_graph_replay() -> None:
    """Captured once (a split plan: two launches), replayed on a new x: equal to eager on it."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(512, 5120, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(1, 5120, device="cuda", generator=g).to(torch.bfloat16)
    assert gemv_plan(512, 5120, torch.cuda.get_device_properties(0).multi_processor_count).splits > 1
    gemv_triton(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_triton(x, w)
    x.copy_(torch.randn(1, 5120, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv_triton(x, w))


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 8], list(range(40, 75))]


def _run(model_dir: str, scope: str | None, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    monkeypatch.setattr(gemv_linear, "GEMV_SCOPE", scope)
    # one sequence at a time: every decode step is one row (the GEMV's case), replayed from a CUDA graph
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=1, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    swapped = sum(isinstance(m, GemvLinear) for m in llm.engine.runner.model.modules())
    del llm
    return [(o.outputs[0].token_ids, [max(s.values(), key=lambda lp: lp.logprob).logprob
                                      for s in o.outputs[0].logprobs]) for o in outs], swapped


@pytest.mark.parametrize("scope", ["all", "head"])
@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_engine_bf16_gemv_close_to_cublas(preset: str, scope: str, tmp_path_factory: pytest.TempPathFactory,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens and top logprobs of the engine with the GEMV (every plain linear, or the LM head alone, after
    the graph) close to cuBLAS's: the sums' order differs, so a near-tie may flip a later token."""
    model_dir = make_model(preset, str(tmp_path_factory.mktemp(preset)), seed=1)
    off, n_off = _run(model_dir, None, monkeypatch)
    on, n_on = _run(model_dir, scope, monkeypatch)
    assert n_off == 0 and (n_on == 1 if scope == "head" else n_on > 1)
    same = sum(a == b for (rt, _), (gt, _) in zip(off, on) for a, b in zip(rt, gt))
    assert same >= 0.8 * sum(len(rt) for rt, _ in off)
    for (rt, rl), (gt, gl) in zip(off, on):
        assert rt[0] == gt[0] and abs(rl[0] - gl[0]) < 0.1
