"""Checkpoint loader: HF-saved, original-named, sharded and FP8/FP4 checkpoints onto the HF state-dict names,
and one CheckpointError for every kind of mismatch."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4.models.build import build_model
from dsv4.models.config import load_model_config
from dsv4.models.loader import (CheckpointError, all_finite, canonical_name, dequantize, expected_from_module,
                                keeps_fp32, load_into_module, load_weights, param_dtype, unpack_fp4)
from hf_reference import build_hf_model, save_hf_model, tiny_config

FP8_MAX = 448.0


# ---- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model() -> Any:
    return build_hf_model()


@pytest.fixture(scope="module")
def state(hf_model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def expected(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], None]]:
    return {k: (tuple(v.shape), None) for k, v in state.items()}


@pytest.fixture(scope="module")
def hf_dir(hf_model: Any, tmp_path_factory: Any) -> str:
    return save_hf_model(hf_model, str(tmp_path_factory.mktemp("hf_saved")))


def _hf_saved_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write(dirpath: Any, tensors: dict[str, torch.Tensor], shards: int = 1, config: dict | None = None) -> str:
    """Write `tensors` as one model.safetensors or `shards` files with an index (keys dealt round-robin, so one
    expert's pieces and a weight's scale usually land in different files)."""
    os.makedirs(dirpath, exist_ok=True)
    if config is not None:
        with open(os.path.join(dirpath, "config.json"), "w") as f:
            json.dump(config, f)
    if shards == 1:
        save_file(tensors, os.path.join(dirpath, "model.safetensors"))
        return str(dirpath)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    weight_map = {}
    for i, (k, v) in enumerate(sorted(tensors.items())):
        parts[i % shards][k] = v.contiguous()
        weight_map[k] = names[i % shards]
    for name, part in zip(names, parts):
        save_file(part, os.path.join(dirpath, name))
    with open(os.path.join(dirpath, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return str(dirpath)


def _assert_equal_state(loaded: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> None:
    assert set(loaded) == set(state)
    for k, v in state.items():
        want = v.to(param_dtype(k, dtype))
        assert loaded[k].dtype == want.dtype, k
        assert torch.equal(loaded[k], want), k


# ---- original DeepSeek naming (the inverse of the loader's table, written independently here) ----------------
_ORIG_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
             "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
             "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_ORIG_LAYER = [  # (HF suffix, original suffix), most specific first
    ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"), ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"), ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"), ("self_attn.sinks", "attn.attn_sink"),
    ("mlp.gate.weight", "ffn.gate.weight"), ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
]


def to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict -> original DeepSeek checkpoint: no `model.` prefix, per-expert w1/w2/w3."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if k in _ORIG_TOP:
            out[_ORIG_TOP[k]] = v
            continue
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", k)
        assert m, k
        layer, rest = m.group(1), m.group(2)
        if rest == "mlp.experts.gate_up_proj":
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = v[e, :half].clone()
                out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = v[e, half:].clone()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = v[e].clone()
            continue
        new = dict(_ORIG_LAYER)[rest]
        out[f"layers.{layer}.{new}"] = v
    return out


# ---- round trips -----------------------------------------------------------------------------------------------
def test_hf_save_layout(hf_dir: str) -> None:
    """What transformers 5.23 save_pretrained writes (the hybrid layout the loader must read)."""
    keys = set(_hf_saved_tensors(hf_dir))
    assert {"head.weight", "model.embed_tokens.weight", "model.norm.weight", "model.hc_head.hc_fn"} <= keys
    assert "model.layers.0.attn.norm.weight" in keys  # kv_norm comes back as attn.norm
    assert "model.layers.1.attn.indexer.compressor.ape" in keys
    assert "model.layers.0.ffn.experts.7.w3.weight" in keys  # per-expert, not packed
    assert "model.layers.2.ffn.gate.bias" in keys and "model.layers.0.ffn.gate.tid2eid" in keys
    assert not any("gate_up_proj" in k or "self_attn" in k for k in keys)


def test_hf_saved_roundtrip_fp32(hf_dir: str, state: dict, expected: dict) -> None:
    _assert_equal_state(load_weights(hf_dir, expected, torch.float32), state)


def test_hf_saved_bf16_keeps_fp32_like_hf(hf_dir: str, state: dict, expected: dict) -> None:
    from transformers import DeepseekV4ForCausalLM

    loaded = load_weights(hf_dir, expected, torch.bfloat16)
    _assert_equal_state(loaded, state, torch.bfloat16)
    hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).state_dict()
    assert {k: v.dtype for k, v in loaded.items()} == {k: hf_bf16[k].dtype for k in loaded}
    assert sum(keeps_fp32(k) for k in loaded) > 40  # the rule really keeps something


def test_original_names_sharded(tmp_path: Any, state: dict, expected: dict) -> None:
    orig = to_original(state)
    assert "layers.0.attn.kv_norm.weight" in orig and "embed.weight" in orig
    d = _write(tmp_path / "orig", orig, shards=3)
    _assert_equal_state(load_weights(d, expected, torch.float32), state)


def test_hf_names_single_file_any_name(tmp_path: Any, state: dict, expected: dict) -> None:
    os.makedirs(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "hf" / "weights.safetensors"))
    _assert_equal_state(load_weights(str(tmp_path / "hf"), expected, torch.float32), state)


def test_mixed_prefixes_and_mtp_ignored(tmp_path: Any, state: dict, expected: dict, caplog: Any) -> None:
    orig = to_original(state)
    # every other key under `model.`, the other spellings of the head and the embedding
    mixed = {("model." + k if i % 2 else k): v for i, (k, v) in enumerate(sorted(orig.items()))
             if k not in ("head.weight", "embed.weight")}
    mixed["lm_head.weight"], mixed["embed_tokens.weight"] = orig["head.weight"], orig["embed.weight"]
    mixed["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    mixed["mtp.0.attn.wq_a.scale"] = torch.ones(1, 1)
    d = _write(tmp_path / "mixed", mixed)
    with caplog.at_level(logging.INFO, logger="dsv4.models.loader"):
        loaded = load_weights(d, expected, torch.float32)
    _assert_equal_state(loaded, state)
    assert [r for r in caplog.records if "mtp" in r.getMessage()]


def test_load_into_module(hf_dir: str, state: dict) -> None:
    fresh = build_hf_model(seed=99, init_seed=5)
    sinks = "model.layers.0.self_attn.sinks"
    assert not torch.equal(fresh.state_dict()[sinks], state[sinks])
    load_into_module(fresh, hf_dir)
    after = fresh.state_dict()
    for k, v in state.items():
        assert torch.equal(after[k], v), k
    assert set(expected_from_module(fresh)) == set(state)


def test_canonical_names() -> None:
    assert canonical_name("layers.3.attn.norm.weight") == "model.layers.3.self_attn.kv_norm.weight"
    assert canonical_name("model.layers.3.attn.kv_norm.weight") == "model.layers.3.self_attn.kv_norm.weight"
    assert canonical_name("layers.1.attn.compressor.norm.weight") == \
        "model.layers.1.self_attn.compressor.kv_norm.weight"
    assert canonical_name("layers.2.ffn.experts.5.w3.weight") == "model.layers.2.mlp.experts.gate_up_proj"
    assert canonical_name("model.layers.2.hc_ffn_scale") == "model.layers.2.ffn_hc.scale"
    assert canonical_name("model.layers.2.ffn_hc.scale") == "model.layers.2.ffn_hc.scale"
    assert canonical_name("head.weight") == canonical_name("model.lm_head.weight") == "lm_head.weight"
    assert canonical_name("mtp.0.emb.weight") is None


# ---- quantized weights -----------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 quantization (ceil blocks at the edges): scale = amax/448 per block (or its power-of-two ceil
    for UE8M0), q = e4m3(w / scale)."""
    br, bc = block
    rows, cols = w.shape
    sr, sc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.reshape(sr, br, sc, bc).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (padded.reshape(sr, br, sc, bc) / scale[:, None, :, None]).reshape(sr * br, sc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def my_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Reference formula, element by element: w[i, j] = q[i, j] * scale[i // br, j // bc]."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // block[0]
    j = torch.arange(cols)[None, :] // block[1]
    return q.float() * scale.float()[i, j]


def test_dequantize_ceil_blocks() -> None:
    w = torch.randn(200, 130)
    q, s = quantize_fp8(w, (128, 128))
    assert s.shape == (2, 2)
    out = dequantize(q, s)  # block derived: 128 fits ceil(200/128) = 2, ceil(130/128) = 2
    assert torch.equal(out, my_dequant(q, s, (128, 128)))
    q, s = quantize_fp8(w, (24, 40))
    assert torch.equal(dequantize(q, s, (24, 40)), my_dequant(q, s, (24, 40)))


# (checkpoint key, block, scale key suffix, UE8M0 power-of-two scales)
FP8_WEIGHTS = [
    ("head.weight", (128, 128), ".scale", False),  # [256, 64]: 2 x 1 blocks of 128
    ("layers.0.attn.wq_a.weight", (24, 24), ".weight_scale_inv", False),  # ceil blocks, needs the config hint
    ("layers.1.attn.wq_b.weight", (24, 24), ".scale", True),  # float8_e8m0fnu scales
    ("layers.3.attn.wo_b.weight", (24, 24), ".scale", False),
]


def _fp8_checkpoint(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Original-named checkpoint with some weights FP8 (incl. every expert of layer 2, 16x16 blocks) -> (tensors,
    {internal name or expert key: exact expected dequant})."""
    orig = to_original(state)
    exact: dict[str, torch.Tensor] = {}
    for key, block, suffix, pow2 in FP8_WEIGHTS:
        q, s = quantize_fp8(orig[key], block, pow2)
        orig[key] = q
        scale_key = key[: -len(".weight")] + suffix
        orig[scale_key] = s.to(torch.float8_e8m0fnu) if pow2 else s
        assert not pow2 or torch.equal(orig[scale_key].float(), s)
        exact[key] = my_dequant(q, s, block)
    for key in [k for k in orig if k.startswith("layers.2.ffn.experts.")]:
        q, s = quantize_fp8(orig[key], (16, 16))
        orig[key], orig[key[: -len(".weight")] + ".scale"] = q, s
        exact[key] = my_dequant(q, s, (16, 16))
    return orig, exact


def test_fp8_block_scaled(tmp_path: Any, state: dict, expected: dict) -> None:
    ckpt, exact = _fp8_checkpoint(state)
    d = _write(tmp_path / "fp8", ckpt, shards=2,
               config=tiny_config(quantization_config={"quant_method": "fp8", "weight_block_size": [24, 24]}))
    loaded = load_weights(d, expected, torch.float32)
    name_of = {"head.weight": "lm_head.weight", "layers.0.attn.wq_a.weight": "model.layers.0.self_attn.q_a_proj.weight",
               "layers.1.attn.wq_b.weight": "model.layers.1.self_attn.q_b_proj.weight",
               "layers.3.attn.wo_b.weight": "model.layers.3.self_attn.o_b_proj.weight"}
    for key, name in name_of.items():
        assert torch.equal(loaded[name], exact[key]), name
        orig = state[name]
        err = (loaded[name] - orig).abs()
        # e4m3: 3 mantissa bits (relative half-ulp 2^-4); UE8M0 scales waste up to 1 bit of range
        assert bool((err <= orig.abs() * 2.0**-4 + 2.0**-8 * orig.abs().max()).all()), name
        assert err.max() > 0  # really went through FP8
    gu = loaded["model.layers.2.mlp.experts.gate_up_proj"]
    dn = loaded["model.layers.2.mlp.experts.down_proj"]
    for e in range(8):
        assert torch.equal(gu[e, :32], exact[f"layers.2.ffn.experts.{e}.w1.weight"])
        assert torch.equal(gu[e, 32:], exact[f"layers.2.ffn.experts.{e}.w3.weight"])
        assert torch.equal(dn[e], exact[f"layers.2.ffn.experts.{e}.w2.weight"])
    torch.testing.assert_close(gu, state["model.layers.2.mlp.experts.gate_up_proj"], atol=0.02, rtol=0.07)
    # everything that was not quantized is bit-exact
    quantized = set(name_of.values()) | {"model.layers.2.mlp.experts.gate_up_proj",
                                         "model.layers.2.mlp.experts.down_proj"}
    for k, v in state.items():
        if k not in quantized:
            assert torch.equal(loaded[k], v.to(loaded[k].dtype)), k
    # bf16 target: dequantize in fp32, then one rounding
    bf = load_weights(d, expected, torch.bfloat16)
    assert torch.equal(bf["model.layers.0.self_attn.q_a_proj.weight"],
                       exact["layers.0.attn.wq_a.weight"].to(torch.bfloat16))


def test_fp8_packed_hf_experts(tmp_path: Any, state: dict, expected: dict) -> None:
    """HF-named packed experts with `gate_up_proj_scale_inv` [E, R/b, C/b]."""
    ckpt = dict(state)
    name = "model.layers.3.mlp.experts.gate_up_proj"
    qs, ss = zip(*(quantize_fp8(w, (16, 16)) for w in state[name]))
    ckpt[name], ckpt[name + "_scale_inv"] = torch.stack(qs), torch.stack(ss)
    loaded = load_weights(_write(tmp_path / "packed", ckpt), expected, torch.float32)
    want = torch.stack([my_dequant(q, s, (16, 16)) for q, s in zip(qs, ss)])
    assert torch.equal(loaded[name], want)


def _pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [R, C] -> int8 [R, C/2], even column in the low nibble."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).view(torch.int8)


def test_fp4_packed_experts(tmp_path: Any, state: dict, expected: dict) -> None:
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    g = torch.Generator().manual_seed(3)
    orig = to_original(state)
    want = []
    for e in range(8):
        key = f"layers.3.ffn.experts.{e}.w2.weight"  # [64, 32] -> packed [64, 16], scales [64, 1] (1 x 32 blocks)
        codes = torch.randint(0, 16, (64, 32), generator=g)
        scale = torch.exp2(torch.randint(-8, 2, (64, 1), generator=g).float())
        orig[key] = _pack_fp4(codes)
        orig[key[: -len(".weight")] + ".scale"] = scale.to(torch.float8_e8m0fnu)
        want.append(lut[codes] * scale)
    assert torch.equal(unpack_fp4(orig["layers.3.ffn.experts.7.w2.weight"]), lut[codes])  # nibble order
    loaded = load_weights(_write(tmp_path / "fp4", orig), expected, torch.float32)
    assert torch.equal(loaded["model.layers.3.mlp.experts.down_proj"], torch.stack(want))


# ---- errors ----------------------------------------------------------------------------------------------------
def _error(d: str, expected: dict) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_weights(d, expected, torch.float32)
    return info.value


def test_missing_unexpected_and_shape_in_one_error(tmp_path: Any, hf_dir: str, expected: dict) -> None:
    t = _hf_saved_tensors(hf_dir)
    del t["model.layers.1.attn.attn_sink"]
    del t["model.layers.2.ffn.experts.3.w3.weight"]
    t["model.layers.0.attn.bogus.weight"] = torch.zeros(2, 2)
    t["model.layers.0.attn.wq_a.weight"] = torch.zeros(31, 64)
    err = _error(_write(tmp_path / "bad", t), expected)
    msg = str(err)
    assert "model.layers.1.self_attn.sinks [4]" in msg and err.missing == ["model.layers.1.self_attn.sinks"]
    assert "model.layers.0.attn.bogus.weight" in msg and len(err.unexpected) == 1
    assert "model.layers.0.self_attn.q_a_proj.weight: expected [32, 64], found [31, 64]" in msg
    assert "expert 3 w3" in msg


def test_a_large_mismatch_lists_a_few_names_and_a_count(tmp_path: Any, hf_dir: str, expected: dict) -> None:
    """A whole layer missing is a short message (the first few names, then how many more), not a line per tensor;
    the exception keeps every name."""
    t = {k: v for k, v in _hf_saved_tensors(hf_dir).items() if not k.startswith("model.layers.1.")}
    err = _error(_write(tmp_path / "bad", t), expected)
    assert len(err.missing) > 10
    assert f"missing ({len(err.missing)})" in str(err) and f"... and {len(err.missing) - 5} more" in str(err)
    assert len(str(err).splitlines()) <= 10


def test_nan_and_inf_weights_are_named_at_load(tmp_path: Any, hf_dir: str, expected: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    t = _hf_saved_tensors(hf_dir)
    t["model.layers.0.attn.wq_a.weight"][3, 5] = float("nan")
    t["model.layers.2.ffn.experts.1.w2.weight"][0, 0] = float("inf")
    d = _write(tmp_path / "nan", t)
    module = build_model(load_model_config(hf_dir), None, torch.float32, "cpu")
    with pytest.raises(CheckpointError, match="2 tensors hold NaN or infinite values") as info:
        load_into_module(module, d)
    assert info.value.other == ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.2.mlp.experts.down_proj"]
    load_into_module(module, d, check_finite=False)  # skippable
    fp8 = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    assert all_finite(fp8) and not all_finite(torch.cat([fp8, torch.tensor([0x7F], dtype=torch.uint8).view(fp8.dtype)]))


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "duplicate", "fp8_without_scale", "expert_shape"])
def test_single_problem(tmp_path: Any, hf_dir: str, expected: dict, case: str) -> None:
    t = _hf_saved_tensors(hf_dir)
    if case == "missing":
        del t["head.weight"]
        needle = "lm_head.weight [256, 64]"
    elif case == "unexpected":
        t["model.layers.9.attn.wq_a.weight"] = torch.zeros(32, 64)
        needle = "model.layers.9.self_attn.q_a_proj.weight (from model.layers.9.attn.wq_a.weight)"
    elif case == "shape":
        t["model.layers.3.attn.compressor.ape"] = torch.zeros(8, 64)
        needle = "model.layers.3.self_attn.compressor.position_bias: expected [4, 64], found [8, 64]"
    elif case == "duplicate":
        t["model.layers.0.attn.kv_norm.weight"] = t["model.layers.0.attn.norm.weight"].clone()
        needle = "model.layers.0.self_attn.kv_norm.weight: given more than once"
    elif case == "fp8_without_scale":
        t["model.layers.0.attn.wq_a.weight"] = t["model.layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
        needle = "model.layers.0.attn.wq_a.weight: F8_E4M3 tensor without a scale"
    else:
        t["model.layers.0.ffn.experts.5.w2.weight"] = torch.zeros(64, 31)
        needle = "model.layers.0.mlp.experts.down_proj: per-expert shapes disagree"
    assert needle in str(_error(_write(tmp_path / case, t), expected))


def test_corrupt_file(tmp_path: Any, hf_dir: str, expected: dict) -> None:
    d = tmp_path / "trunc"
    os.makedirs(d)
    data = open(os.path.join(hf_dir, "model.safetensors"), "rb").read()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    assert "model.safetensors" in str(_error(str(d), expected))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "model.safetensors" in str(_error(str(d), expected))


def test_broken_index(tmp_path: Any, state: dict, expected: dict) -> None:
    d = _write(tmp_path / "idx", to_original(state), shards=2)
    index = os.path.join(d, "model.safetensors.index.json")
    good = json.load(open(index))
    _assert_equal_state(load_weights(d, expected, torch.float32), state)

    with open(index, "w") as f:
        f.write("{oops")
    assert "model.safetensors.index.json" in str(_error(d, expected))

    bad = json.loads(json.dumps(good))
    bad["weight_map"]["embed.weight"] = "model-00009-of-00009.safetensors"
    json.dump(bad, open(index, "w"))
    assert "model-00009-of-00009.safetensors (named by the index) does not exist" in str(_error(d, expected))

    bad = json.loads(json.dumps(good))
    other = {v for v in good["weight_map"].values() if v != good["weight_map"]["embed.weight"]}.pop()
    bad["weight_map"]["embed.weight"] = other
    json.dump(bad, open(index, "w"))
    assert f"'embed.weight' is not in {other}" in str(_error(d, expected))

    json.dump({"metadata": {}}, open(index, "w"))
    assert "bad index" in str(_error(d, expected))


def test_no_or_ambiguous_files(tmp_path: Any, state: dict, expected: dict) -> None:
    os.makedirs(tmp_path / "empty")
    assert "no *.safetensors" in str(_error(str(tmp_path / "empty"), expected))
    d = tmp_path / "two"
    os.makedirs(d)
    save_file({"a": torch.zeros(1)}, str(d / "a.safetensors"))
    save_file({"b": torch.zeros(1)}, str(d / "b.safetensors"))
    assert "no model.safetensors.index.json" in str(_error(str(d), expected))


def test_keeps_fp32_rule() -> None:
    for name in ["model.layers.0.attn_hc.fn", "model.layers.0.ffn_hc.scale", "model.hc_head.hc_base",
                 "model.layers.1.self_attn.sinks", "model.layers.1.self_attn.compressor.indexer.position_bias",
                 "model.layers.2.mlp.gate.e_score_correction_bias", "model.norm.weight",
                 "model.layers.1.self_attn.compressor.kv_norm.weight", "model.layers.0.input_layernorm.weight"]:
        assert keeps_fp32(name) and param_dtype(name, torch.bfloat16) == torch.float32, name
    for name in ["model.layers.1.self_attn.compressor.kv_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"]:
        assert param_dtype(name, torch.bfloat16) == torch.bfloat16, name
    assert param_dtype("model.layers.0.mlp.gate.tid2eid", torch.bfloat16) == torch.int64
