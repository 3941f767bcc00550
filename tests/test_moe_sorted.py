"""The routed experts over rows sorted by expert (dsv4/ops/moe_sorted.py: torch's grouped GEMM) against the route-order
grouped path and a per-(token, slot) loop in fp64; rows of other ranks' experts (-1) under expert parallelism; the
switch (off by default, never on the CPU); tiny V4 / V4.1 engines with the path forced give the tokens of the default
path. torch's CPU `_grouped_mm` computes what its CUDA kernel does (one matmul per expert), which is what runs here."""

from __future__ import annotations

import pytest
import torch

from dsv4.distributed import ExpertShard, Parallel
from dsv4.llm import LLM
from dsv4.models.layers.moe import moe_output
from dsv4.ops import moe_sorted
from dsv4.make_model import make_model
from dsv4.ops.moe import expert_grouped_torch
from dsv4.ops.moe_quant import expert_grouped_q_torch
from dsv4.ops.swiglu import swiglu_torch
from dsv4.quant.weight import QuantWeight
from dsv4.sampling_params import SamplingParams
from test_moe_fixed import _reference
from test_moe_quant import fp8_weight, mxfp4_weight

D, INTER = 32, 16  # multiples of 8: row strides of 16 bytes, as _grouped_mm checks on every device


def _layer(seed: int, T: int, k: int, E: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    gate_up, down = torch.randn(E, 2 * INTER, D, generator=g) / 4, torch.randn(E, D, INTER, generator=g) / 4
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights, shared = torch.rand(T, k, generator=g), torch.randn(T, D, generator=g)
    return tuple(t.to(dtype) if t.is_floating_point() and t is not weights else t
                 for t in (x, gate_up, down, idx, weights, shared))


def _route_order(x, weights, idx, gate_up, down, limit, before):
    """The grouped path's rows in route order: expert_grouped's torch reference (quantized experts: its twin on the
    stored weights), SwiGLU, down."""
    k, flat = idx.shape[1], idx.flatten()
    grouped = expert_grouped_q_torch if isinstance(gate_up, QuantWeight) else expert_grouped_torch
    gu = grouped(x, gate_up, flat, k)
    inter = gu.shape[1] // 2
    g, u = gu[:, :inter], gu[:, inter:]
    h = swiglu_torch(g, u, limit, weights.flatten(), fp32=True) if before else swiglu_torch(g, u, limit, fp32=False)
    return grouped(h, down, flat, 1)


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (3, 2, 8), (8, 3, 6), (37, 6, 16), (40, 2, 3)])
@pytest.mark.parametrize("before", [False, True])
def test_sorted_rows_equal_the_route_order_rows(T: int, k: int, E: int, before: bool) -> None:
    """fp32: the same products per row (one matmul per expert either way), so equal to fp32 rounding; several experts
    get no row at (1, 1, 4), (3, 2, 8)."""
    x, gate_up, down, idx, weights, _ = _layer(T * 31 + k * 7 + E, T, k, E)
    got = moe_sorted.experts_sorted(x, weights, idx, gate_up, down, 1.5, before, missing=False)
    ref = _route_order(x, weights, idx, gate_up, down, 1.5, before)
    assert got.shape == (T * k, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the rows where the GEMMs leave them: route r's at y[at[r]], rows sorted by expert (stable)
    y, at = moe_sorted.experts_sorted_rows(x, weights, idx, gate_up, down, 1.5, before, missing=False)
    assert torch.equal(y[at], got) and torch.equal(at.sort().values, torch.arange(T * k))
    assert torch.equal(idx.flatten()[at.argsort()], idx.flatten().sort(stable=True).values)


def test_sorted_rows_scattered_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """DSV4_SORTED_COMBINE_ROWS=0 (comparisons): the rows come back in route order, no `at`; the same values."""
    x, gate_up, down, idx, weights, _ = _layer(4, 9, 3, 5)
    y, at = moe_sorted.experts_sorted_rows(x, weights, idx, gate_up, down, 1.5, True, missing=False)
    monkeypatch.setattr(moe_sorted, "SORTED_COMBINE_ROWS", False)
    routed, none = moe_sorted.experts_sorted_rows(x, weights, idx, gate_up, down, 1.5, True, missing=False)
    assert none is None and torch.equal(routed, y[at])


@pytest.mark.parametrize("before", [False, True])
def test_sorted_rows_in_bf16_round_like_the_grouped_path(before: bool) -> None:
    """bf16: both paths accumulate in fp32 and round each GEMM's output once (the SwiGLU in between too), so they
    agree to a few bf16 ulps of the output's scale."""
    x, gate_up, down, idx, weights, _ = _layer(5, 64, 4, 8, torch.bfloat16)
    got = moe_sorted.experts_sorted(x, weights, idx, gate_up, down, 1.5, before, missing=False)
    ref = _route_order(x, weights, idx, gate_up, down, 1.5, before)
    assert got.dtype == torch.bfloat16
    scale = ref.float().abs().max()
    assert (got.float() - ref.float()).abs().max() <= 4 * 2 ** -8 * scale


def test_rows_without_an_expert_are_zero() -> None:
    """-1 routes (another rank's experts) sort last and are computed by neither GEMM: their rows are zeroed; the
    other rows are those of the same routes with the -1 routes sent anywhere."""
    x, gate_up, down, idx, weights, _ = _layer(11, 9, 3, 6)
    cut = idx.clone()
    cut[cut >= 4] = -1
    got = moe_sorted.experts_sorted(x, weights, cut, gate_up[:4], down[:4], 1.5, True, missing=True)
    gone = (cut.flatten() < 0)
    assert gone.any() and (got[gone] == 0).all()
    ref = _route_order(x, weights, cut.clamp(min=0), gate_up[:4], down[:4], 1.5, True)
    torch.testing.assert_close(got[~gone], ref[~gone], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_quantized_experts_in_chunks(monkeypatch: pytest.MonkeyPatch, fmt: str, chunk: int | None) -> None:
    """Quantized experts (the released formats) are dequantized and multiplied: all at once (None) or `chunk` experts
    at a time (DEQUANT_BYTES cut down), with experts that get no row and, under expert parallelism, -1 routes; the
    same rows as the stored-weight grouped path's reference."""
    E, T, k, D_, I_ = 8, 13, 3, 64, 32
    g = torch.Generator().manual_seed(2 + (chunk or 0))
    if fmt == "mxfp4":
        gate_up, down = mxfp4_weight(E, 2 * I_, D_, g, extreme=False), mxfp4_weight(E, D_, I_, g, extreme=False)
    else:
        gate_up, down = (fp8_weight(E, 2 * I_, D_, (32, 32), True, g, extreme=False),
                         fp8_weight(E, D_, I_, (32, 32), False, g, extreme=False))
    if chunk is not None:
        monkeypatch.setattr(moe_sorted, "DEQUANT_BYTES", chunk * 2 * I_ * D_ * 4)  # fp32: `chunk` gate_up experts
        assert moe_sorted.experts_per_chunk(gate_up, torch.float32) == chunk
    x = torch.randn(T, D_, generator=g) / 64
    weights = torch.rand(T, k, generator=g)
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:k] for _ in range(T)])  # experts 6, 7: no rows
    for missing in (False, True):
        cut = torch.where(idx == 3, -1, idx) if missing else idx
        got = moe_sorted.experts_sorted(x, weights, cut, gate_up, down, 1.5, True, missing=missing)
        ref = _route_order(x, weights, cut, gate_up, down, 1.5, True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sorted path on for every non-fixed step (the CPU would never take it)."""
    monkeypatch.setattr(moe_sorted, "use_sorted_experts", lambda *args: True)


@pytest.mark.parametrize("T,k,E", [(1, 2, 8), (8, 3, 6), (40, 6, 16)])
@pytest.mark.parametrize("before", [False, True])
def test_moe_output_through_the_sorted_path(forced: None, T: int, k: int, E: int, before: bool) -> None:
    x, gate_up, down, idx, weights, shared = _layer(T * 100 + k * 10 + E, T, k, E)
    got = moe_output(x, weights, idx, gate_up, down, 1.5, weight_before_down=before, fixed=False, shared=shared)
    ref = _reference(x, weights, idx, gate_up, down, 1.5, before) + shared.double()
    assert torch.allclose(got.double(), ref, atol=1e-4), (got.double() - ref).abs().max()


@pytest.mark.parametrize("before", [False, True])
def test_expert_parallel_parts_through_the_sorted_path(forced: None, before: bool) -> None:
    """Each rank's part (its experts, the others' routes -1) summed over the ranks is the whole layer."""
    T, k, E, world = 21, 6, 16, 4
    x, gate_up, down, idx, weights, shared = _layer(7, T, k, E)
    n = E // world
    total = torch.zeros(T, D, dtype=torch.float64)
    for rank in range(world):
        ep = ExpertShard(rank * n, n, Parallel(), shared_split=True)
        total += moe_output(x, weights, idx, gate_up[rank * n:(rank + 1) * n], down[rank * n:(rank + 1) * n], 1.5,
                            weight_before_down=before, fixed=False, shared=shared / world, ep=ep).double()
    ref = _reference(x, weights, idx, gate_up, down, 1.5, before) + shared.double()
    assert torch.allclose(total, ref, atol=1e-4), (total - ref).abs().max()


def test_the_switch_is_on_by_default_and_needs_the_cutlass_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default (unless DSV4_SORTED_EXPERTS=0), never on the CPU; on (a GPU stand-in) from MIN_ROWS rows and
    MIN_ROWS_PER_EXPERT rows per expert, quantized experts from MIN_QUANT_ROWS_PER_EXPERT (dequantizing them costs
    what the GEMM saves on fewer)."""
    x, gate_up, down, *_ = _layer(0, 4096, 1, 4, torch.bfloat16)
    assert moe_sorted.SORTED_EXPERTS
    assert not moe_sorted.grouped_mm_fast(x, gate_up)  # CPU
    assert not moe_sorted.use_sorted_experts(x, gate_up, down, 1 << 20)
    monkeypatch.setattr(moe_sorted, "grouped_mm_fast", lambda x, w: True)
    # 4 experts: MIN_ROWS decides
    assert moe_sorted.use_sorted_experts(x, gate_up, down, moe_sorted.MIN_ROWS)
    assert not moe_sorted.use_sorted_experts(x, gate_up, down, moe_sorted.MIN_ROWS - 1)
    g = torch.Generator().manual_seed(0)
    E = 256
    wide_up, wide_down = (torch.zeros(E, 8, 8, dtype=torch.bfloat16) for _ in range(2))
    q_up, q_down = mxfp4_weight(E, 64, 32, g), mxfp4_weight(E, 32, 32, g)
    for up, dn, per_expert in ((wide_up, wide_down, moe_sorted.MIN_ROWS_PER_EXPERT),
                               (q_up, q_down, moe_sorted.MIN_QUANT_ROWS_PER_EXPERT)):
        assert per_expert * E > moe_sorted.MIN_ROWS  # the per-expert rule decides at 256 experts
        assert moe_sorted.use_sorted_experts(x, up, dn, per_expert * E)
        assert not moe_sorted.use_sorted_experts(x, up, dn, per_expert * E - 1)
    monkeypatch.setattr(moe_sorted, "SORTED_EXPERTS", False)  # DSV4_SORTED_EXPERTS=0
    assert not moe_sorted.use_sorted_experts(x, gate_up, down, 1 << 20)


@pytest.fixture(scope="module")
def tiny_v41_released(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("tiny-v41-rel")), seed=0, quant="released")


@pytest.mark.parametrize("model", ["tiny_v4", "tiny_v41", "tiny_v41_released"])
def test_engine_tokens_with_the_sorted_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                                            model: str) -> None:
    """Greedy tokens (fp32, CPU) of prompts long enough for several prefill chunks equal the default path's, with
    the sorted path taken by every MoE layer of every step (the released checkpoint's MXFP4 experts dequantized)."""
    path = request.getfixturevalue(model)
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 71)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32, max_model_len=128,
                  skip_tokenizer_init=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    plain = run()
    calls = []
    real = moe_sorted.experts_sorted_rows
    monkeypatch.setattr(moe_sorted, "use_sorted_experts", lambda *args: True)
    monkeypatch.setattr(moe_sorted, "experts_sorted_rows",
                        lambda *a, **kw: calls.append(a[2].shape[0]) or real(*a, **kw))
    assert run() == plain
    assert max(calls) == 32  # a whole prefill chunk's tokens went through it
