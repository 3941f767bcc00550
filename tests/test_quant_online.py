"""`quantization="fp8"` on a float checkpoint (dsv4/quant/online.py): the engine loads the released-format copy that
`dsv4 quantize` writes, made once into the cache and reused; its weights stay FP8 / MXFP4 in memory; its greedy
tokens and log-probabilities equal an engine on an explicitly converted copy; a changed checkpoint gets a new copy;
what cannot be converted is one clear error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.make_model import default_model_dir, make_model
from dsv4.models.config import ConfigError
from dsv4.quant import online
from dsv4.quant.convert import quantize_checkpoint
from dsv4.quant.layers import Fp8Linear, QuantExperts

PROMPTS = [[0, 5, 9, 33, 77, 100], [0, 8, 1, 200, 300, 4, 17, 18, 19]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DSV4_CACHE_DIR", str(root))
    return root


def _llm(model_dir: str, quantization: str | None) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, quantization=quantization)


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("preset", [pytest.param("tiny-v4", marks=pytest.mark.slow), "tiny-v41"])
def test_fp8_on_a_float_checkpoint_runs_its_released_copy(tmp_path: Path, cache: Path, preset: str) -> None:
    src = make_model(preset, str(tmp_path / "float"), seed=0)
    explicit = str(tmp_path / "explicit")
    quantize_checkpoint(src, explicit, "released")
    llm = _llm(src, "fp8")
    engine = llm.engine
    copies = list((cache / "quantized").iterdir())
    assert [c.is_dir() for c in copies] == [True]  # one finished copy, no partial directory left
    assert engine.config.model_dir == str(copies[0]) and engine.config.quant is not None
    model = engine.runner.model
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert any(isinstance(m, QuantExperts) for m in model.modules())
    assert _run(llm) == _run(_llm(explicit, "auto"))  # the same weights as `dsv4 quantize` writes, bit for bit
    assert _run(llm) != _run(_llm(src, None))  # ...which are not the float ones (the test could fail)


def test_the_copy_is_made_once_and_remade_when_the_checkpoint_changes(tmp_path: Path, cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = str(tmp_path / "demo")
    shutil.copytree(default_model_dir(), src)  # the built-in model (a trained V4.1 with its drafter)
    calls: list[str] = []
    real = quantize_checkpoint

    def spy(model_dir: str, out_dir: str, quant: str = "released", **kw: object) -> list[str]:
        calls.append(out_dir)
        return real(model_dir, out_dir, quant, **kw)

    monkeypatch.setattr("dsv4.quant.convert.quantize_checkpoint", spy)
    first, q = online.load_dir(src, "fp8")
    assert q == "auto" and len(calls) == 1 and os.path.isfile(os.path.join(first, "config.json"))
    again, _ = online.load_dir(src, "deepseek_v4_fp8")
    assert again == first and len(calls) == 1  # reused
    os.utime(os.path.join(src, "model.safetensors"), ns=(1, 1))  # "retrained": another modification time
    changed, _ = online.load_dir(src, "fp8")
    assert changed != first and len(calls) == 2
    # other switches and already-quantized checkpoints are passed through untouched
    assert online.load_dir(src, None) == (src, None) and online.load_dir(src, "none") == (src, "none")
    assert online.load_dir(first, "fp8") == (first, "fp8")
    # the built-in model runs quantized with its drafter, speculation included
    llm = LLM(src, device="cpu", quantization="fp8", speculative_config={"method": "dspark"})
    out = llm.generate(["def "], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert len(out) > 0 and llm.engine.config.model_dir == changed


def test_what_cannot_be_converted_is_one_error(tmp_path: Path, cache: Path) -> None:
    src = make_model("tiny-v41-vl", str(tmp_path / "vision"), seed=0)
    with pytest.raises(ConfigError, match="--quantization fp8: .*vision tower"):
        _llm(src, "fp8")
    assert not any(p.name.startswith(".") or "partial" in p.name for p in (cache / "quantized").iterdir())
