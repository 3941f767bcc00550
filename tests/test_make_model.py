"""make_model presets: the checkpoint layout matches v4_tensor_shapes and transformers' DeepseekV4ForCausalLM;
writing is deterministic; the cached default model; the `dsv4 make-model` command and its error exits.
V4.1 presets (tiny-v41, tiny-v41-noengram): composite config, the golden checkpoint's key layout, engram sizes
derived from the tokenizer, and the engine loads and generates from them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4 import LLM, SamplingParams
from dsv4.cli import main
from dsv4.make_model import make_model, random_weights, write_tokenizer_files
from dsv4.models.build import build_model
from dsv4.models.config import HASH_MOE, load_model_config, parse_config_dict
from dsv4.models.engram import EngramLayout, build_compressed_token_map
from dsv4.models.presets import (PRESETS, dspark_tensor_shapes, mtp_tensor_shapes, preset_config, v4_tensor_shapes,
                                 v41_tensor_shapes)
from dsv4.spec_decode.config import parse_dspark
from dsv4.tokenizer import Tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
V41_PRESETS = ("tiny-v41", "tiny-v41-noengram")
GOLDEN_V41 = "/work/shared/golden/deepseek-v41-tiny"


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
    # as DeepSeek's releases: no chat template (prompts come from dsv4.chat), the prompt's special tokens single
    assert tok.chat_template is None
    for marker in ("<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>", "｜DSML｜"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensors_match_v4_tensor_shapes(tmp_path: Path, dtype: str) -> None:
    out = make_model("tiny-v4", str(tmp_path), seed=3, dtype=dtype)
    cfg = load_model_config(out)
    # the target's tensors, then its MTP layer's (`mtp.0.*`, the release's names: docs/dspark.md 4)
    expected = v4_tensor_shapes(cfg, dtype) | mtp_tensor_shapes(cfg, dtype)
    assert cfg.num_nextn_predict_layers == 1 and any(k.startswith("mtp.0.") for k in expected)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
    assert got == expected
    if dtype == "bfloat16":  # precision-critical tensors stay float32 on disk
        assert got["model.layers.0.attn_hc.fn"][1] == torch.float32
        assert got["model.layers.0.self_attn.sinks"][1] == torch.float32
        assert got["model.layers.0.self_attn.q_a_proj.weight"][1] == torch.bfloat16
        for name in ("mtp.0.hc_attn_fn", "mtp.0.hc_head_scale", "mtp.0.attn.attn_sink", "mtp.0.ffn.gate.bias"):
            assert got[name][1] == torch.float32, name
        assert got["mtp.0.e_proj.weight"][1] == torch.bfloat16


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
    # The values arrive unchanged: no conversion rule renamed or reshaped any tensor. transformers drops the MTP
    # layer (`mtp.*`, ignored on load), as the engine's target does.
    ours = {k: v for k, v in load_file(os.path.join(tiny_dir, "model.safetensors")).items()
            if not k.startswith("mtp.")}
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


# ---- V4.1 presets ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v41_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("v41")
    return {p: make_model(p, str(root / p), seed=0) for p in V41_PRESETS}


def _shapes_on_disk(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with safe_open(path, framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}


def test_v41_composite_config(v41_dirs: dict[str, str]) -> None:
    for preset, d in v41_dirs.items():
        with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        assert raw["model_type"] == "deepseek_v41" and raw["architectures"] == ["DeepseekV41ForCausalLM"]
        assert raw["image_token_id"] == 129264 and raw["vision_config"]["model_type"] == "deepseek_v41_vision"
        assert raw["vision_config"]["hidden_size"] == 1024 and raw["vision_config"]["min_pixels"] == 295936
        text = raw["text_config"]
        assert text["model_type"] == "deepseek_v41_text" and "dtype" not in raw and text["dtype"] == "float32"
        cfg = load_model_config(d)
        assert cfg.v41 is not None and cfg.num_hidden_layers == 6 and cfg.compress_ratios == (0, 2, 2, 1, 1, 1)
        assert cfg.v41.kv_source_layer_ids == (1, 3) and cfg.v41.index_source_layer_ids == (1, 3, 5)
        assert cfg.rope_compress.rope_type == "yarn" and cfg.rms_norm_eps == 1e-20
        # The vocabulary is exactly the tokenizer's: ids must embed, and the engram map must cover the vocab.
        backend = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        assert cfg.vocab_size == backend.get_vocab_size(with_added_tokens=True)
        assert 0 <= text["dspark_noise_token_id"] < cfg.vocab_size
        if preset == "tiny-v41-noengram":
            assert cfg.v41.engram is None and text["engram_layer_ids"] == []
            continue
        eng = cfg.v41.engram
        assert eng.layer_ids == (1,) and eng.max_ngram_size == 3 and eng.n_heads == 2 and eng.head_dim == 32
        _, size = build_compressed_token_map(backend)
        assert eng.compressed_vocab_size == size == 437
        layout = EngramLayout.from_config([1], eng.vocab_size, 3, 2, size)
        assert eng.num_embeddings == (layout.rows[1],) == (4062,)
        assert backend.id_to_token(eng.pad_id) == "<｜▁pad▁｜>"


@pytest.mark.parametrize("preset", V41_PRESETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v41_tensors_match_v41_tensor_shapes(tmp_path: Path, preset: str, dtype: str) -> None:
    out = make_model(preset, str(tmp_path), seed=3, dtype=dtype)
    cfg = load_model_config(out)
    expected = v41_tensor_shapes(cfg, dtype)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        ds = parse_dspark(json.load(f))
    # tiny-v41 also ships a DSpark drafter (mtp.*, docs/dspark.md 1.2), after the target's tensors
    assert (ds is not None) == (preset == "tiny-v41")
    if ds is not None:
        expected = {**expected, **dspark_tensor_shapes(cfg, ds, dtype)}
    got = _shapes_on_disk(os.path.join(out, "model.safetensors"))
    assert got == expected
    engram = sorted(k for k in got if ".engram." in k)
    if preset == "tiny-v41":
        assert engram == [f"model.layers.1.engram.{n}" for n in
                          ("embed.scale", "embed.weight", "k_weight", "q_weight", "wkv.weight")]
        assert got["model.layers.1.engram.embed.weight"][0] == (4062, 32)
        assert got["model.layers.1.engram.embed.scale"] == ((4062, 1), torch.float32)
        assert got["model.layers.1.engram.wkv.weight"][0] == (5 * 64, 2 * 2 * 32)
    else:
        assert engram == []
    if dtype == "bfloat16":  # HF-V41 keeps the mHC parameters, sinks and router biases in F32
        for name in ("hc_attn_fn", "hc_ffn_base", "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl"):
            assert got[f"model.layers.2.{name}"][1] == torch.float32, name
        assert got["model.layers.2.attn.wq_a.weight"][1] == torch.bfloat16


@pytest.mark.skipif(not os.path.isdir(GOLDEN_V41), reason="golden V4.1 checkpoint not available")
def test_v41_tensor_shapes_match_golden() -> None:
    # The golden checkpoint was saved by HF-V41 itself: its keys, shapes and dtypes are the reference layout.
    cfg = load_model_config(GOLDEN_V41)
    assert _shapes_on_disk(os.path.join(GOLDEN_V41, "model.safetensors")) == v41_tensor_shapes(cfg)


def test_v41_shapes_load_when_dims_differ(tmp_path: Path) -> None:
    # In the presets head_dim == hidden_size, which would hide a swapped axis; the engine's loader checks every
    # shape, so a variant with distinct sizes and two engram layers proves the layout against the engine module.
    config = preset_config("tiny-v41")
    text = config["text_config"]
    text.update(head_dim=48, index_head_dim=24, q_lora_rank=40, moe_intermediate_size=24, engram_layer_ids=[1, 4])
    layout = EngramLayout.from_config([1, 4], 1000, 3, 2, text["engram_compressed_vocab_size"])
    text["engram_num_embeddings"] = [int(layout.rows[1]), int(layout.rows[4])]
    d = str(tmp_path)
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(random_weights(config, seed=0), os.path.join(d, "model.safetensors"))
    write_tokenizer_files(d)
    model = build_model(load_model_config(d), d, torch.float32, "cpu")
    assert set(model.engram_tables) == {1, 4}
    assert model.model.layers[1].attn.compressor.wkv.weight.shape == (48, 64)


def test_v41_weight_init(v41_dirs: dict[str, str]) -> None:
    t = load_file(os.path.join(v41_dirs["tiny-v41"], "model.safetensors"))
    for name, value in t.items():
        if name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base", "gate.bias", "gate.bias_vl")):
            assert value.abs().min() > 0, name  # HF would leave these at 0
        if name.endswith(("norm.weight", "_scale", "embed.scale")):
            assert torch.equal(value, torch.ones_like(value)), name
    for name in ("q_weight", "k_weight"):
        w = t[f"model.layers.1.engram.{name}"]
        assert 0.8 < w.mean() < 1.2 and 0.3 < w.std() < 0.7
    assert 0.9 < t["model.layers.1.engram.embed.weight"].std() < 1.1
    assert 0.01 < t["model.layers.2.attn.wq_b.weight"].std() < 0.03


def test_v41_build_model_and_generate(v41_dirs: dict[str, str]) -> None:
    for preset, d in v41_dirs.items():
        model = build_model(load_model_config(d), d, torch.float32, "cpu")
        assert (model.engram_layout is not None) == (preset == "tiny-v41")
        assert set(model.engram_tables) == ({1} if preset == "tiny-v41" else set())
        out = LLM(model=d, device="cpu", dtype="float32").generate("hello", SamplingParams(max_tokens=8))
        ids = out[0].outputs[0].token_ids
        assert 0 < len(ids) <= 8 and all(0 <= i < 512 for i in ids) and out[0].finished


def test_v41_engram_changes_the_output(v41_dirs: dict[str, str], tmp_path: Path) -> None:
    # Same checkpoint with the engram table zeroed (value 0, so the engram adds nothing): greedy output changes.
    src = v41_dirs["tiny-v41"]
    for name in FILES:
        if name != "model.safetensors":
            Path(tmp_path, name).write_bytes(Path(src, name).read_bytes())
    t = load_file(os.path.join(src, "model.safetensors"))
    t["model.layers.1.engram.embed.weight"].zero_()
    save_file(t, os.path.join(tmp_path, "model.safetensors"))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog."
    with_engram = LLM(model=src, device="cpu", dtype="float32").generate(prompt, greedy)[0].outputs[0].token_ids
    without = LLM(model=str(tmp_path), device="cpu", dtype="float32").generate(prompt, greedy)[0].outputs[0].token_ids
    assert len(with_engram) == 8 and with_engram != without


def test_v41_deterministic(v41_dirs: dict[str, str], tmp_path: Path) -> None:
    d = v41_dirs["tiny-v41"]
    again = make_model("tiny-v41", str(tmp_path / "again"), seed=0)
    for name in FILES:
        assert _digest(os.path.join(d, name)) == _digest(os.path.join(again, name)), name
    other = make_model("tiny-v41", str(tmp_path / "other"), seed=1)
    assert _digest(os.path.join(d, "model.safetensors")) != _digest(os.path.join(other, "model.safetensors"))


def test_cli_make_model_v41(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--preset", "tiny-v41", "--out", str(tmp_path / "m")]) == 0
    assert "tiny-v41" in capsys.readouterr().out
    cfg = load_model_config(str(tmp_path / "m"))
    assert cfg.v41 is not None and cfg.v41.engram is not None
    assert all(os.path.isfile(tmp_path / "m" / f) for f in FILES)
    assert {"tiny-v4", *V41_PRESETS} <= set(PRESETS)
    parse_config_dict(preset_config("tiny-v41-noengram"))  # every preset parses on its own


def test_quant_none_is_the_float_checkpoint(tiny_dir: str, tmp_path: Path) -> None:
    # `--quant none` (the default) writes exactly today's float checkpoint; `released` another layout of the model
    d = make_model("tiny-v4", str(tmp_path / "none"), seed=0, quant="none")
    for name in FILES:
        assert _digest(os.path.join(tiny_dir, name)) == _digest(os.path.join(d, name)), name
    r = make_model("tiny-v4", str(tmp_path / "rel"), seed=0, quant="released")
    assert _digest(os.path.join(tiny_dir, "tokenizer.json")) == _digest(os.path.join(r, "tokenizer.json"))
    with safe_open(os.path.join(r, "model.safetensors"), framework="pt") as f:
        assert "embed.weight" in f.keys() and f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
    with pytest.raises(ValueError, match="not one of"):
        make_model("tiny-v4", str(tmp_path / "bad"), quant="fp8")
