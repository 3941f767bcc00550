"""The one-row GEMV (dsv4/ops/gemv.py) against the exact product, under TRITON_INTERPRET=1, and its plan."""

from __future__ import annotations

import pytest
import torch
from test_kernels_interpret import _interpret

from dsv4.ops.gemv import gemv, gemv_plan, use_gemv


def test_gemv_matches_the_exact_product() -> None:
    """Every plan shape (one launch; K split into chunks with the reduce; chunks that do not divide K; a last
    partial output block; K not a multiple of BLOCK_K) within the fp32 reordering bound of an fp64 product plus the
    output's bf16 / fp16 rounding (one ulp). A dropped or doubled K chunk, a shifted row or a lost partial block breaks it."""
    _interpret("""
        import torch
        from dsv4.ops.gemv import GemvPlan, gemv_triton
        g = torch.Generator().manual_seed(0)
        cases = [(40, 300, GemvPlan(16, 64, 1, 4)), (40, 300, GemvPlan(16, 64, 3, 4)),
                 (33, 1000, GemvPlan(8, 128, 4, 4)), (16, 512, GemvPlan(16, 128, 2, 4)),
                 (7, 130, GemvPlan(8, 32, 5, 4)), (64, 256, GemvPlan(32, 64, 8, 4))]
        for dt in (torch.bfloat16, torch.float16):
            for N, K, plan in cases:
                w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dt)
                x = torch.randn(1, K, generator=g).to(dt)
                got = gemv_triton(x, w, plan)
                assert got.shape == (1, N) and got.dtype == dt, (got.shape, got.dtype)
                ref = x.double() @ w.double().t()
                # one unit in the last place of the output dtype: the interpreter's fp32 -> bf16 cast truncates
                eps = 2.0 ** -7 if dt == torch.bfloat16 else 2.0 ** -10
                bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()) + ref.abs() * eps
                assert ((got.double() - ref).abs() <= bound + 1e-30).all(), (dt, N, K, plan)
                # a 1-D x gives a 1-D result; a strided weight view (rows of a wider matrix) reads its own rows
                assert torch.equal(gemv_triton(x[0], w, plan), got[0])
                wide = torch.randn(N, K + 24, generator=g).to(dt)
                wide[:, :K] = w
                assert torch.equal(gemv_triton(x, wide[:, :K], plan), got), (N, K, plan)
        print("ok")
    """)


@pytest.mark.parametrize("N,K,sms", [(32768, 1280, 132), (512, 5120, 132), (5120, 8192, 132), (16, 5120, 78),
                                     (129280, 5120, 132), (1, 64, 132)])
def test_gemv_plan_fills_the_gpu_and_keeps_chunks_whole(N: int, K: int, sms: int) -> None:
    """Output blocks x splits reach PROGRAMS_PER_SM programs a SM when K has the steps for it; each chunk keeps at
    least 4 BLOCK_K steps; wide outputs are not split."""
    p = gemv_plan(N, K, sms)
    blocks, steps = -(-N // p.block_n), -(-K // p.block_k)
    assert p.splits >= 1 and (p.splits == 1 or steps // p.splits >= 4)
    if blocks >= 4 * sms:
        assert p.splits == 1
    else:
        assert blocks * p.splits >= 4 * sms or p.splits == max(1, steps // 4)


@pytest.mark.parametrize("N,sms,wide", [(129280, 132, True), (129280, 78, True), (67584, 132, True),
                                         (67552, 132, False), (32768, 132, False), (8192, 16, True)])
def test_gemv_plan_takes_the_wide_tile_only_for_wide_outputs(N: int, sms: int, wide: bool) -> None:
    """The default tiles: WIDE_TILE once cdiv(N, 32) programs make WIDE_WAVES waves (the LM head; 67584 = 4 x 4 x 132
    x 32 is the edge on 132 SMs), 16 x 256 below; tiles given by the caller win over both."""
    from dsv4.ops.gemv import WIDE_TILE

    p = gemv_plan(N, 4096, sms)
    assert (p.block_n, p.block_k) == (WIDE_TILE if wide else (16, 256)), p
    if wide:
        assert p.splits == 1
    assert gemv_plan(N, 4096, sms, 8, 128)[:2] == (8, 128)
    assert gemv_plan(N, 4096, sms, block_n=8)[:2] == (8, 256)


def test_gemv_dispatch_off_the_gpu_is_f_linear() -> None:
    """On the CPU (and for several rows, or mixed dtypes) `gemv` is F.linear itself."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    x = torch.randn(1, 40, generator=g).to(torch.bfloat16)
    assert not use_gemv(x, w)
    assert torch.equal(gemv(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("scope", ["all", "head"])
def test_engine_swaps_its_plain_linears_and_keeps_its_weights(scope: str, tmp_path_factory: pytest.TempPathFactory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on, the engine's bias-free 16-bit nn.Linear modules all become GemvLinear holding the same
    Parameters (the state dict's names and bytes unchanged; merged siblings included), or (scope "head") its LM head
    alone, and on the CPU (F.linear either way) the greedy tokens are the same as with the switch off."""
    from torch import nn

    from dsv4 import LLM, SamplingParams
    from dsv4.make_model import make_model
    from dsv4.models.layers import gemv_linear
    from dsv4.models.layers.gemv_linear import GemvLinear

    model_dir = make_model("tiny-v41", str(tmp_path_factory.mktemp("tiny-v41")), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(gemv_linear, "GEMV_SCOPE", scope if on else None)
        llm = LLM(model_dir, dtype="bfloat16", max_model_len=64, max_num_seqs=2, block_size=8)
        model = llm.engine.runner.model
        plain = [m for m in model.modules()
                 if type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.bfloat16]
        swapped = [n for n, m in model.named_modules() if isinstance(m, GemvLinear)]
        sd = model.state_dict()
        runs[on] = ([o.outputs[0].token_ids for o in llm.generate([[5, 9, 31, 2], [77, 3]], params)],
                    {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, len(plain), swapped)
        del llm
    (t0, sd0, plain0, sw0), (t1, sd1, plain1, sw1) = runs[False], runs[True]
    assert sw0 == [] and sd1 == sd0 and t1 == t0
    if scope == "all":
        assert plain1 == 0 and len(sw1) == plain0 > 0
    else:
        assert sw1 == ["lm_head"] and plain1 == plain0 - 1
