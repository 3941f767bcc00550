"""Released-layout (FP8 / MXFP4) checkpoints run as stored: the engine with quantized layers gives the tokens and
logprobs of the same engine on the same checkpoint with everything dequantized at load (`quantization="none"`),
its weights stay at their stored size, and formats it cannot run are refused with one error naming them.

Why the CPU bound is 0: an FP8 or FP4 value times a power-of-two (or float32) scale is exact in fp32, so the
quantized layers' torch references (dequantize in fp32, then the same matmul) multiply the very numbers the
dequantize-at-load model holds. Any difference is a bug, not rounding. (The GPU kernels accumulate in another
order; tests/gpu bounds them.)"""

from __future__ import annotations

import json
import math
import os

import pytest
from safetensors import safe_open

from dsv4 import LLM, SamplingParams
from dsv4.make_model import make_model
from dsv4.models.config import ConfigError
from dsv4.models.loader import CheckpointError
from dsv4.quant.config import load_quant_config
from dsv4.quant.layers import Fp8Linear, QuantExperts

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 8], list(range(40, 75)), [11] * 19]
RUNS = {  # preset -> released formats to write
    "tiny-v4": ("released", "released-fp8-experts"),
    "tiny-v41": ("released",),
}
# FP8 experts stack w1 over w3 under one scale grid: their width must fill whole 128-row blocks
OVERRIDES = {"released-fp8-experts": {"moe_intermediate_size": 128}}


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    out = {}
    for preset, quants in RUNS.items():
        for quant in quants:
            out[(preset, quant)] = make_model(preset, str(tmp_path_factory.mktemp(f"{preset}-{quant}")), seed=1,
                                              quant=quant, overrides=OVERRIDES.get(quant))
    return out


def _llm(model_dir: str, quantization: str, **kw: object) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
                block_size=8, quantization=quantization)
    return LLM(model_dir, **{**args, **kw})


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _weight_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _disk_bytes(model_dir: str) -> int:
    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    numel = 1
                    for d in s.get_shape():
                        numel *= d
                    total += numel * (1 if s.get_dtype() in ("F8_E4M3", "F8_E8M0", "I8", "U8") else
                                      {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}[s.get_dtype()])
    return total


@pytest.mark.parametrize("preset,quant", [(p, q) for p, qs in RUNS.items() for q in qs])
def test_quantized_engine_equals_dequantized_reference(released: dict, preset: str, quant: str) -> None:
    d = released[(preset, quant)]
    q_llm = _llm(d, "auto")
    model = q_llm.engine.runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    ref = _run(_llm(d, "none"))
    got = _run(q_llm)
    for (ref_tokens, ref_lps), (tokens, lps) in zip(ref, got):
        assert tokens == ref_tokens
        assert lps == ref_lps  # exact: see the module docstring
    # chunked prefill and batching change nothing either: one request at a time, whole prompts
    alone = _llm(d, "auto", max_num_seqs=1, max_num_batched_tokens=128)
    assert [t for t, _ in _run(alone)] == [t for t, _ in ref]


@pytest.mark.parametrize("preset", list(RUNS))
def test_quantized_weights_are_not_dequantized_at_load(released: dict, preset: str) -> None:
    d = released[(preset, "released")]
    disk = _disk_bytes(d)
    # the float checkpoint's embedding/head dominate a tiny model: the bound is on the whole model against the
    # whole checkpoint, and the dequantized model (fp32) must exceed it, or the test could not fail
    q = _weight_bytes(_llm(d, "auto", dtype="bfloat16"))
    full = _weight_bytes(_llm(d, "none", dtype="bfloat16"))
    assert q <= 1.1 * disk, (q, disk)
    assert full > 1.1 * disk, (full, disk)


def _edit_config(model_dir: str, fn) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    fn(config)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)


@pytest.mark.parametrize("field,value,needle", [
    ("quant_method", "awq", "quant_method 'awq'"),
    ("weight_block_size", [128], "weight_block_size"),
    ("fmt", "e5m2", "fmt 'e5m2'"),
    ("scale_fmt", "e4m3", "scale_fmt 'e4m3'"),
    ("expert_dtype", "int4", "expert_dtype 'int4'"),
])
def test_unsupported_quantization_config_is_refused(tmp_path, field: str, value, needle: str) -> None:
    d = make_model("tiny-v4", str(tmp_path), seed=1, quant="released")
    _edit_config(d, lambda c: c["quantization_config"].__setitem__(field, value))
    with pytest.raises(ConfigError, match=needle):
        _llm(d, "auto")


def test_quantization_switch_values(tmp_path) -> None:
    float_dir = make_model("tiny-v4", str(tmp_path / "float"), seed=1)
    # fp8 asked of a float checkpoint: the engine runs its released copy (tests/test_quant_online.py); the
    # checkpoint's own config is never taken for an FP8 one
    with pytest.raises(ConfigError, match="no `quantization_config`"):
        load_quant_config(float_dir, "fp8")
    with pytest.raises(ConfigError, match="quantization 'gptq' is not supported"):
        _llm(float_dir, "gptq")
    _llm(float_dir, "auto")  # a float checkpoint runs as it is


def test_fp8_experts_whose_width_straddles_a_block_are_refused(tmp_path) -> None:
    d = make_model("tiny-v4", str(tmp_path), seed=1, quant="released-fp8-experts")  # width 32, blocks of 128
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight: 32 rows are not a multiple"):
        _llm(d, "auto")
    _llm(d, "none")  # dequantized at load, nothing is stacked under one grid


def test_unsupported_stored_tensor_is_refused_naming_it(tmp_path) -> None:
    """An FP4 weight with a scale block other than MXFP4's 1 x 32: one error naming the tensor."""
    from safetensors.torch import load_file, save_file

    d = make_model("tiny-v4", str(tmp_path), seed=1, quant="released")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("experts.0.w1.scale"))
    tensors[key] = tensors[key][:, :1].contiguous()  # one scale per row: blocks of 1 x K
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=key.removesuffix(".scale")):
        _llm(d, "auto")


@pytest.mark.parametrize("preset,quant", [("tiny-v41", "released"), ("tiny-v4", "released"), ("tiny-v4", None)])
def test_dummy_load_format_needs_no_weight_files(tmp_path, preset: str, quant: str | None) -> None:
    d = make_model(preset, str(tmp_path), seed=1, quant=quant, config_only=True)
    assert not [f for f in os.listdir(d) if f.endswith(".safetensors")]
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        _llm(d, "auto")  # without dummy, the missing weights are one clear error
    llm = _llm(d, "auto", load_format="dummy")
    model = llm.engine.runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules()) == (quant is not None)
    # the dummy weights are random (not zeros: they would hide unwritten tensors) and the model runs on them
    assert all(t.float().abs().sum() > 0 for n, t in model.state_dict().items() if n.endswith("weight"))
    for tokens, lps in _run(llm):  # random but sane magnitudes: finite logits
        assert len(tokens) == 12
        assert all(math.isfinite(lp) for step in lps for lp in step.values())


def test_cli_quantization_switch(released: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv4 generate --quantization auto|none` give the same greedy text; a value dsv4 does not take is refused by
    the parser (exit 2) before any model is built."""
    from dsv4.cli import main

    d = released[("tiny-v41", "released")]
    texts = []
    for q in ("auto", "none"):
        assert main(["generate", "--model", d, "--prompt", "hello", "--max-tokens", "6", "--temperature", "0",
                     "--device", "cpu", "--quantization", q]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and "--- prompt: 'hello'" in texts[0]
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", d, "--quantization", "awq"])
    assert exc.value.code == 2
