"""make_model presets: the checkpoint layout matches v4_tensor_shapes and transformers' DeepseekV4ForCausalLM;
writing is deterministic; the cached default model; the `dsv4 make-model` command and its error exits."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv4.cli import main
from dsv4.make_model import default_model_dir, make_model
from dsv4.models.config import HASH_MOE, load_model_config
from dsv4.models.presets import PRESETS, v4_tensor_shapes
from dsv4.tokenizer import Tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v4", str(tmp_path_factory.mktemp("tiny")), seed=0)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_checkpoint_files_and_config(tiny_dir: str) -> None:
    assert all(os.path.isfile(os.path.join(tiny_dir, f)) for f in FILES)
    with open(os.path.join(tiny_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert raw["model_type"] == "deepseek_v4" and raw["architectures"] == ["DeepseekV4ForCausalLM"]
    cfg = load_model_config(tiny_dir)
    assert cfg.vocab_size == 512 and cfg.num_hidden_layers == 4
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"}
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_ids[0])
    assert tok.chat_template is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensors_match_v4_tensor_shapes(tmp_path: Path, dtype: str) -> None:
    out = make_model("tiny-v4", str(tmp_path), seed=3, dtype=dtype)
    expected = v4_tensor_shapes(load_model_config(out), dtype)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    assert got == expected
    if dtype == "bfloat16":  # precision-critical tensors stay float32 on disk
        assert got["model.layers.0.attn_hc.fn"][1] == torch.float32
        assert got["model.layers.0.self_attn.sinks"][1] == torch.float32
        assert got["model.layers.0.self_attn.q_a_proj.weight"][1] == torch.bfloat16


def test_weight_init_exercises_every_path(tiny_dir: str) -> None:
    cfg = load_model_config(tiny_dir)
    t = load_file(os.path.join(tiny_dir, "model.safetensors"))
    for layer, kind in enumerate(cfg.mlp_layer_types):
        if kind == HASH_MOE:
            table = t[f"model.layers.{layer}.mlp.gate.tid2eid"]
            assert table.dtype == torch.int64 and table.min() >= 0 and table.max() < cfg.n_routed_experts
            assert all(len(set(row.tolist())) == cfg.num_experts_per_tok for row in table)
        else:
            assert t[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].abs().min() > 0
    for name, value in t.items():
        if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            assert value.abs().min() > 0, name
        if name.endswith(("norm.weight", ".scale", "hc_scale")):
            assert torch.equal(value, torch.ones_like(value)), name
    assert 0.01 < t["model.layers.1.self_attn.q_b_proj.weight"].std() < 0.03


def test_transformers_loads_it(tiny_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # The values arrive unchanged: no conversion rule renamed or reshaped any tensor.
    ours = load_file(os.path.join(tiny_dir, "model.safetensors"))
    theirs = model.state_dict()
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        assert torch.equal(theirs[name], value), name
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 12]])).logits
    assert logits.shape == (1, 9, 512) and torch.isfinite(logits).all()


def test_deterministic(tiny_dir: str, tmp_path: Path) -> None:
    again = make_model("tiny-v4", str(tmp_path / "again"), seed=0)
    for name in FILES:
        assert _digest(os.path.join(tiny_dir, name)) == _digest(os.path.join(again, name)), name
    other = make_model("tiny-v4", str(tmp_path / "other"), seed=1)
    assert _digest(os.path.join(tiny_dir, "model.safetensors")) != _digest(os.path.join(other, "model.safetensors"))
    assert _digest(os.path.join(tiny_dir, "tokenizer.json")) == _digest(os.path.join(other, "tokenizer.json"))


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("nope", str(tmp_path))
    assert "tiny-v4" in PRESETS


def test_default_model_dir_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_HOME", str(tmp_path))
    first = default_model_dir()
    assert os.path.dirname(first) == str(tmp_path)
    assert all(os.path.isfile(os.path.join(first, f)) for f in FILES)
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert default_model_dir() == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp  # not rebuilt
    assert os.listdir(tmp_path) == [os.path.basename(first)]  # no temporary directory left behind


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--preset", "tiny-v4", "--out", str(tmp_path / "m"), "--seed", "2"]) == 0
    assert os.path.isfile(tmp_path / "m" / "model.safetensors")
    assert main(["make-model", "--preset", "nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown preset" in err and "Traceback" not in err


def test_cli_user_errors_exit_2(tiny_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_dir, "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and err.count("\n") == 1
