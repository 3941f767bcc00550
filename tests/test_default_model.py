"""The built-in default model: the trained demo checkpoint shipped in dsv4/assets/ (issue 25).

These check what a user of `dsv4 generate` / `LLM()` / `dsv4 serve` without a model gets: the shipped files, a model
that predicts held-out Python far better than chance, and a drafter whose drafts get accepted.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.make_model import ASSETS_DIR, DEFAULT_MODEL_NAME, default_model_dir
from dsv4.models.config import load_model_config
from dsv4.spec_decode.config import parse_dspark
from dsv4.train.evaluate import evaluate

SIZE_BUDGET = 50e6  # bytes of everything under dsv4/assets (issue 25: keep the repository and the install light)


def test_default_model_is_the_shipped_demo() -> None:
    path = default_model_dir()
    assert path == os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)
    cfg = load_model_config(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert parse_dspark(json.load(f)) is not None  # with its DSpark drafter
    assert cfg.model_type == "deepseek_v41"
    assert set(cfg.compress_ratios) == {0, 1, 2} and cfg.v41.engram.layer_ids  # every V4.1 attention kind, Engram on
    with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
        gen = json.load(f)
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95  # the sampling defaults train-demo writes
    with open(os.path.join(path, "train_info.json"), encoding="utf-8") as f:
        assert json.load(f)["settings"]["seed"] == 0  # the record of the run that made it
    size = sum(p.stat().st_size for p in Path(ASSETS_DIR).rglob("*") if p.is_file())
    assert size <= SIZE_BUDGET, f"dsv4/assets holds {size / 1e6:.1f} MB"


def test_incomplete_install_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / DEFAULT_MODEL_NAME / "config.json").write_text("{}")
    monkeypatch.setattr("dsv4.make_model.ASSETS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model.safetensors, tokenizer.json missing"):
        default_model_dir()


def test_default_model_predicts_held_out_python() -> None:
    # held-out standard-library modules the model never trained on; a random-weight model of this vocabulary
    # scores a perplexity in the thousands, the shipped one 73 over all held-out text (fp32 on the CPU)
    report = evaluate(default_model_dir(), prompts=[], max_windows=2, n_held_out_prompts=0, device="cpu")
    assert report["tokens"] == 2 * 511
    assert report["perplexity"] < 150, report["perplexity"]


def test_default_drafter_is_accepted_and_exact() -> None:
    # the shipped DSpark drafter, trained on the frozen target: greedy speculative decoding emits the target's
    # greedy tokens, and its drafts are accepted well above a random drafter's ~0 (1.34 of 4 in training's own
    # held-out measurement)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def __init__(self", "import os\nimport sys\n\n\ndef main(", "    for i in range("]
    plain = [o.outputs[0].token_ids for o in LLM(device="cpu").generate(prompts, params)]
    llm = LLM(device="cpu", speculative_config={"method": "dspark"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.engine.spec_decode_stats
    assert stats.num_drafts > 0 and stats.mean_acceptance_length > 1.5, stats.mean_acceptance_length


def test_greedy_def_writes_a_definition() -> None:
    # "def " ends in a lone space token: trained with --space-split-rate 0.1 the model has seen such prompts and
    # names a function next (greedy: "_get_code_to_write(self, name, value):"); the model trained without it
    # answered with a comment (" # and not d[L] ...")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = LLM(device="cpu").generate(["def "], params)[0].outputs[0].text
    assert re.match(r"[A-Za-z_]\w*\(", text), text


def test_generate_without_a_model_prints_code_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    assert main(["generate", "--prompt", "def ", "--max-tokens", "32", "--device", "cpu"]) == 0
    elapsed = time.perf_counter() - start
    text = capsys.readouterr().out
    assert "prompt: 'def '" in text and len(text.split("\n", 1)[1].strip()) > 20
    assert elapsed < 30, f"{elapsed:.1f} s"  # ~3 s on two cores, the model's build included
