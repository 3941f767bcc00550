"""Merged sibling projections (dsv4/models/layers/merged.py): one module computing two linears of one input.

Why the CPU comparisons are exact (torch.equal): each output column of a linear is one dot product of x's row with
that column's weight row, and the CPU's GEMM reduces it over K in an order that does not depend on the other
columns as long as every sibling is at least 16 wide (checked here at the tiny models' and the releases' shapes,
all >= 32); the FP8 layers' torch path dequantizes each block elementwise (code * scale, exact in fp32) before that
same product. So the merged module and the separate ones multiply the same numbers in the same order. An fp32
sibling only 8 wide, of more than 4 rows, goes through another CPU kernel that sums K in another order: there the
outputs agree within fp32 rounding, |a - b| <= 2 K 2^-24 S with S = sum_k |x_k w_k| (each side within K 2^-24 S of
the exact sum; no model has such a sibling). (GPU kernels pick tiles and split-K by the output width: there the
results may differ by fp32 accumulation order, tests/gpu/test_merged_gpu.py bounds that.)

Engine level: greedy tokens and logprobs of the tiny V4 / V4.1 checkpoints, float and released, are those of the
engine with merging off (exact, as above), the expected groups merged (or, where the FP8 blocks forbid it, did not),
and the weights take the same bytes either way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv4 import LLM, SamplingParams
from dsv4.make_model import make_model
from dsv4.models.layers import merged
from dsv4.models.layers.merged import (V4_COMPRESSOR_CSA, V4_COMPRESSOR_HCA, MergedLinear, merge_blocker,
                                       merge_linears, merge_siblings, merged_name, project)
from dsv4.quant.formats import quantize_fp8
from dsv4.quant.layers import Fp8Linear
from dsv4.quant.weight import StoredFormat


def _float_linear(k: int, n: int, dtype: torch.dtype, g: torch.Generator, bias: bool = False) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


def _fp8_linear(k: int, n: int, block: tuple[int, int], ue8m0: bool, g: torch.Generator) -> Fp8Linear:
    data, scale = quantize_fp8(torch.randn(n, k, generator=g) * k ** -0.5, block, ue8m0)
    lin = Fp8Linear(k, n, StoredFormat(False, block, scale.dtype))
    lin.weight, lin.weight_scale = data, scale
    return lin


def _check_equal(mods: list[nn.Module], x: torch.Tensor, exact: bool = True) -> None:
    assert merge_blocker(mods) is None
    m = merge_linears(mods)
    with torch.no_grad():
        got = m(x)
        assert len(got) == len(mods)
        for part, mod in zip(got, mods):
            ref = mod(x)
            if exact:
                assert torch.equal(part, ref), (part - ref).abs().max()
            else:  # fp32 rounding of two summation orders (module docstring)
                s = x.abs().double() @ mod.weight.abs().double().t()
                bound = 2 * x.shape[-1] * 2.0 ** -24 * s
                assert ((part.double() - ref.double()).abs() <= bound).all()


# (K, sibling widths): the tiny models', the V4 / V4.1 releases' (q_a + kv, shared gate + up) and odd ones
FLOAT_SHAPES = [(64, (32, 32)), (64, (32, 64)), (4096, (1024, 512)), (4096, (2048, 2048)), (5120, (1280, 512)),
                (100, (48, 40, 16))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,widths", FLOAT_SHAPES)
def test_merged_float_linear_equals_separate(k: int, widths: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(k + sum(widths))
    mods = [_float_linear(k, n, dtype, g) for n in widths]
    for rows in (1, 3, 64, 300):
        _check_equal(mods, torch.randn(rows, k, generator=g).to(dtype))
    _check_equal(mods, torch.randn(2, 5, k, generator=g).to(dtype))  # leading dims


def test_merged_narrow_fp32_sibling_within_rounding() -> None:
    """An 8-wide fp32 sibling: exact up to 4 rows, within fp32 rounding beyond (module docstring)."""
    g = torch.Generator().manual_seed(4)
    mods = [_float_linear(100, n, torch.float32, g) for n in (48, 40, 8)]
    for rows in (1, 3):
        _check_equal(mods, torch.randn(rows, 100, generator=g))
    for rows in (5, 64, 300):
        _check_equal(mods, torch.randn(rows, 100, generator=g), exact=False)


def test_merged_float_linear_with_bias() -> None:
    g = torch.Generator().manual_seed(1)
    mods = [_float_linear(48, n, torch.float32, g, bias=True) for n in (16, 24)]
    _check_equal(mods, torch.randn(7, 48, generator=g))


# (K, widths, block): blocks of 128 (V4) and 32 (V4.1); the last sibling may end in a partial block
FP8_MERGE = [(256, (128, 128), (128, 128)), (4096, (1024, 512), (128, 128)), (5120, (1280, 512), (32, 32)),
             (96, (32, 32), (32, 32)), (256, (128, 70), (128, 128)), (160, (64, 32, 40), (32, 32))]


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,widths,block", FP8_MERGE)
def test_merged_fp8_linear_equals_separate(k: int, widths: tuple[int, ...], block: tuple[int, int],
                                           dtype: torch.dtype, ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(k + sum(widths) + ue8m0)
    mods = [_fp8_linear(k, n, block, ue8m0, g) for n in widths]
    m = merge_linears(mods)
    assert isinstance(m.proj, Fp8Linear) and m.proj.weight.dtype == torch.float8_e4m3fn
    assert m.proj.weight_scale.dtype == mods[0].weight_scale.dtype
    assert m.proj.weight_scale.shape == (-(-sum(widths) // block[0]), -(-k // block[1]))
    for rows in (1, 5, 70):
        _check_equal(mods, torch.randn(rows, k, generator=g).to(dtype))


@pytest.mark.parametrize("mods,needle", [
    # V4's tiny q_a (32 rows) under 128-row blocks: kv's scale rows would start inside q_a's last block
    (lambda g: [_fp8_linear(64, 32, (128, 128), True, g), _fp8_linear(64, 32, (128, 128), True, g)], "multiple"),
    (lambda g: [_fp8_linear(64, 40, (32, 32), True, g), _fp8_linear(64, 32, (32, 32), True, g)], "multiple"),
    (lambda g: [_fp8_linear(64, 32, (32, 32), True, g), _fp8_linear(64, 32, (32, 64), True, g)], "scale blocks"),
    (lambda g: [_fp8_linear(64, 32, (32, 32), True, g), _fp8_linear(64, 32, (32, 32), False, g)], "scale dtypes"),
    (lambda g: [_fp8_linear(64, 32, (32, 32), True, g), _float_linear(64, 32, torch.float32, g)], "not all"),
    (lambda g: [_float_linear(64, 32, torch.float32, g), _float_linear(48, 32, torch.float32, g)], "input widths"),
    (lambda g: [_float_linear(64, 32, torch.float32, g), _float_linear(64, 32, torch.bfloat16, g)], "dtypes"),
    (lambda g: [_float_linear(64, 32, torch.float32, g), _float_linear(64, 32, torch.float32, g, True)], "biases"),
])
def test_illegal_merges_are_refused(mods, needle: str) -> None:
    why = merge_blocker(mods(torch.Generator().manual_seed(2)))
    assert why is not None and needle in why


def test_unaligned_fp8_merge_would_be_wrong() -> None:
    """Why the block rule: a sibling ending inside a scale block would hand its partial block's scale row to the
    next sibling's first rows (the merged weight reads scale row n // bn), so merging it anyway changes the next
    sibling's output."""
    g = torch.Generator().manual_seed(5)
    mods = [_fp8_linear(64, 40, (32, 32), True, g), _fp8_linear(64, 32, (32, 32), True, g)]
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        q, kv = merge_linears(mods)(x)  # forced past merge_blocker
        assert torch.equal(q, mods[0](x)) and not torch.equal(kv, mods[1](x))


class _Attn(nn.Module):
    def __init__(self, q: nn.Module, kv: nn.Module) -> None:
        super().__init__()
        self.q_a_proj, self.kv_proj = q, kv


def test_merge_siblings_replaces_frees_and_falls_back() -> None:
    """Legal groups become one MergedLinear (the originals gone, the bytes the same), illegal ones stay as loaded;
    `project` gives the same outputs either way; only the owners named in SIBLINGS merge."""
    g = torch.Generator().manual_seed(3)
    model = nn.Module()
    model.ok = nn.Module()
    model.ok.self_attn = _Attn(_fp8_linear(64, 32, (32, 32), True, g), _fp8_linear(64, 16, (32, 32), True, g))
    model.bad = nn.Module()
    model.bad.self_attn = _Attn(_fp8_linear(64, 32, (128, 128), True, g), _fp8_linear(64, 16, (128, 128), True, g))
    model.other = _Attn(_float_linear(64, 8, torch.float32, g), _float_linear(64, 8, torch.float32, g))  # not an owner
    x = torch.randn(3, 64, generator=g)
    before = {k: project(a, x, "q_a_proj", "kv_proj") for k, a in
              (("ok", model.ok.self_attn), ("bad", model.bad.self_attn), ("other", model.other))}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    summary = merge_siblings(model)
    assert summary.merged == {"q_a_proj_kv_proj": 1}
    assert list(summary.kept) == [("q_a_proj_kv_proj", "an output width is not a multiple of the scale block rows 128")]
    assert isinstance(model.ok.self_attn.q_a_proj_kv_proj, MergedLinear)
    assert not hasattr(model.ok.self_attn, "q_a_proj") and not hasattr(model.ok.self_attn, "kv_proj")
    assert isinstance(model.bad.self_attn.q_a_proj, Fp8Linear) and isinstance(model.other.q_a_proj, nn.Linear)
    assert sum(t.numel() * t.element_size() for t in model.state_dict().values()) == nbytes
    for k, a in (("ok", model.ok.self_attn), ("bad", model.bad.self_attn), ("other", model.other)):
        for got, ref in zip(project(a, x, "q_a_proj", "kv_proj"), before[k]):
            assert torch.equal(got, ref)


# ---- engine level ----------------------------------------------------------------------------------------------
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 8], list(range(40, 75)), [11] * 19]
# V4's released blocks are 128 rows: at the tiny widths (32) nothing merges; these widths let both groups merge
V4_FP8_MERGEABLE = {"q_lora_rank": 128, "moe_intermediate_size": 128}
# checkpoint -> {merged module name: count} expected with merging on (4 V4 layers, 6 V4.1 layers)
# tiny V4's compressors (bf16 in the released layout, so merged there too): 2 CSA layers (five projections with the
# indexer's) and 1 HCA layer (the kv / gate pair)
V4_COMPRESSORS = {merged_name(V4_COMPRESSOR_CSA): 2, merged_name(V4_COMPRESSOR_HCA): 1}
CASES = {
    "v4-float": ("tiny-v4", None, None, {"gate_proj_up_proj": 4, "q_a_proj_kv_proj": 4, **V4_COMPRESSORS}),
    "v41-float": ("tiny-v41", None, None, {"w1_w3": 6, "wq_a_wkv": 6}),
    "v4-released": ("tiny-v4", "released", None, V4_COMPRESSORS),  # FP8 32-row siblings, 128-row blocks: separate
    "v4-released-128": ("tiny-v4", "released", V4_FP8_MERGEABLE,
                        {"gate_proj_up_proj": 4, "q_a_proj_kv_proj": 4, **V4_COMPRESSORS}),
    "v41-released": ("tiny-v41", "released", None, {"w1_w3": 6, "wq_a_wkv": 6}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {name: make_model(preset, str(tmp_path_factory.mktemp(name)), seed=1, quant=quant, overrides=over)
            for name, (preset, quant, over, _) in CASES.items()}


def _engine(model_dir: str, merge: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[LLM, list]:
    monkeypatch.setattr(merged, "MERGE_SIBLINGS", merge)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                 for o in outs]


def _merged_counts(model: nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, MergedLinear):
            leaf = name.rpartition(".")[2]
            out[leaf] = out.get(leaf, 0) + 1
    return out


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("case", list(CASES))
def test_engine_tokens_unchanged_by_merging(checkpoints: dict[str, str], case: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    off_llm, off = _engine(checkpoints[case], False, monkeypatch)
    on_llm, on = _engine(checkpoints[case], True, monkeypatch)
    off_model, on_model = off_llm.engine.runner.model, on_llm.engine.runner.model
    assert _merged_counts(off_model) == {}
    assert _merged_counts(on_model) == CASES[case][3]
    if CASES[case][1] is not None:  # the released checkpoints' merges are FP8 ones, but for the bf16 compressors'
        for name, m in on_model.named_modules():
            if isinstance(m, MergedLinear):
                assert isinstance(m.proj, nn.Linear if name.endswith(tuple(V4_COMPRESSORS)) else Fp8Linear), name
    assert _weight_bytes(on_model) == _weight_bytes(off_model)
    for (ref_tokens, ref_lps), (tokens, lps) in zip(off, on):
        assert tokens == ref_tokens
        assert lps == ref_lps  # exact: see the module docstring
