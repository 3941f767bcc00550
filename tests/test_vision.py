"""DeepSeek-V4.1 vision encoder (dsv4/models/vision.py): the ViT against an independent float64 transcription of
model.md 8.2, packed images against one image at a time, the aligner's unshuffle order, the span layout, the
checkpoint names of model.md 10.2, the loader's routing (original and newer-HF spellings) and the tiny-v41-vl preset."""

from __future__ import annotations

import dataclasses

import json
import math
import os
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsv4.make_model import IMAGE_PLACEHOLDER, make_model
from dsv4.models.config import ConfigError, load_model_config
from dsv4.models.deepseek_v41 import DeepseekV41ForCausalLM
from dsv4.models.loader import (CheckpointError, VISION_MODULE, has_vision_weights, is_vision_key, load_into_module,
                                route_v41, route_v41_text)
from dsv4.models.presets import VISION_PRESETS, preset_config, v41_tensor_shapes, vision_tensor_shapes
from dsv4.models.vision import (Aligner, VisionConfig, VisionEncoder, VisionTower, block_diagonal_attention,
                                cu_seqlens_of, load_vision_config, merge_index, parse_vision_config,
                                per_image_attention, vision_param_dtype)

TINY = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                    downsample_ratio=3, rope_theta=10000.0, max_image_tokens=64, min_pixels=7056)
HIDDEN = 40  # text hidden size != vision hidden size, so a swapped aligner axis cannot go unnoticed
GRIDS = [(2, 5), (1, 1), (4, 3), (3, 7)]


def _randomize(module: nn.Module, seed: int, std: float = 0.3) -> nn.Module:
    """Weights large enough that attention is far from uniform (so rope and masking matter), norms away from 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1 + 0.2 * noise if "norm" in name else std * noise)
    return module


def _patches(grids: list[tuple[int, int]], seed: int, cfg: VisionConfig = TINY) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(sum(h * w for h, w in grids), cfg.patch_dim, generator=gen) * 2 - 1


# ---- an independent float64 transcription of model.md 8.2-8.4, one image at a time ------------------------------
def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _ref_rope(x: torch.Tensor, nh: int, nw: int, theta: float, swap: bool = False) -> torch.Tensor:
    """x [n, heads, d]. Channel j < d/2 pairs with j + d/2 and turns by angle[j]: the first d/4 angles are
    row * theta^(-2i/(d/2)), the next d/4 the same frequencies times the column."""
    d = x.shape[-1]
    half, quarter = d // 2, d // 4
    out = torch.empty_like(x)
    for p in range(nh * nw):
        row, col = divmod(p, nw)
        if swap:
            row, col = col, row
        for j in range(half):
            freq = theta ** (-2 * (j % quarter) / half)
            a = (row if j < quarter else col) * freq
            c, s = math.cos(a), math.sin(a)
            out[p, :, j] = x[p, :, j] * c - x[p, :, j + half] * s
            out[p, :, j + half] = x[p, :, j + half] * c + x[p, :, j] * s
    return out


def _ref_vit(sd: dict[str, torch.Tensor], cfg: VisionConfig, patches: torch.Tensor, nh: int, nw: int,
             swap_rope: bool = False) -> torch.Tensor:
    w = {k: v.double() for k, v in sd.items()}
    n, heads, d, inter = nh * nw, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size
    x = patches.double() @ w["patch_embed.proj.weight"].T + w["patch_embed.proj.bias"]
    for b in range(cfg.num_hidden_layers):
        p = f"blocks.{b}."
        h = _ref_rms(x, w[p + "norm1.weight"], cfg.rms_norm_eps)
        qkv = h @ w[p + "attn.wqkv.weight"].T + w[p + "attn.wqkv.bias"]
        q, k, v = (qkv[:, i * cfg.hidden_size:(i + 1) * cfg.hidden_size].reshape(n, heads, d) for i in range(3))
        q = _ref_rope(q, nh, nw, cfg.rope_theta, swap_rope)
        k = _ref_rope(k, nh, nw, cfg.rope_theta, swap_rope)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        probs = torch.exp(scores - scores.max(-1, keepdim=True).values)
        probs = probs / probs.sum(-1, keepdim=True)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        x = x + o @ w[p + "attn.wo.weight"].T + w[p + "attn.wo.bias"]
        h = _ref_rms(x, w[p + "norm2.weight"], cfg.rms_norm_eps)
        gu = h @ w[p + "mlp.w1.weight"].T
        gate, up = gu[:, :inter], gu[:, inter:]
        x = x + (gate / (1 + torch.exp(-gate)) * up) @ w[p + "mlp.w2.weight"].T
    return _ref_rms(x, w["norm.weight"], cfg.rms_norm_eps)


def _feature_code(c: int, y: int, x: int) -> float:
    return 1 + c * 10000 + y * 100 + x  # never 0, so padding (0) is told apart


def _coded_features(nh: int, nw: int, dim: int) -> torch.Tensor:
    return torch.tensor([[_feature_code(c, y, x) for c in range(dim)] for y in range(nh) for x in range(nw)],
                        dtype=torch.float64)


# ---- config ----------------------------------------------------------------------------------------------------
def test_parse_vision_config_layouts() -> None:
    assert parse_vision_config({"model_type": "deepseek_v41", "text_config": {}}) is None
    assert parse_vision_config({"model_type": "deepseek_v41", "vision_config": None}) is None
    assert parse_vision_config({"vision_config": {}}) == VisionConfig()  # released defaults
    released = VisionConfig()
    assert (released.hidden_size, released.intermediate_size, released.num_hidden_layers, released.head_dim,
            released.patch_size, released.downsample_ratio, released.max_image_tokens, released.min_pixels,
            released.max_wh_ratio, released.rms_norm_eps) == (1024, 2816, 32, 64, 14, 3, 1024, 295936, None, 1e-6)
    composite = {"vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 32, "intermediate_size": 48,
                                   "num_hidden_layers": 2, "num_attention_heads": 2, "max_image_tokens": 64,
                                   "min_pixels": 7056, "max_wh_ratio": 8}}
    cfg = parse_vision_config(composite)
    assert cfg == VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                               max_image_tokens=64, min_pixels=7056, max_wh_ratio=8.0)
    flat = {"vision_dim": 32, "vision_inter_dim": 48, "vision_n_layers": 2, "vision_n_heads": 2,
            "vision_patch_size": 14, "vision_rope_theta": 10000.0, "vision_downsample_ratio": 3,
            "vision_max_n_token": 64, "vision_min_pixels": 7056, "vision_max_wh_ratio": 8}
    assert parse_vision_config(flat) == cfg


@pytest.mark.parametrize("fields, where", [
    ({"hidden_size": 30, "num_attention_heads": 4}, "vision_config.num_attention_heads"),  # 4 heads of 7.5
    ({"hidden_size": 24, "num_attention_heads": 4}, "vision_config.num_attention_heads"),  # head_dim 6: not 4k
    ({"hidden_size": "1024"}, "vision_config.hidden_size"),
    ({"num_hidden_layers": True}, "vision_config.num_hidden_layers"),
    ({"patch_size": 0}, "vision_config.patch_size"),
    ({"downsample_ratio": -3}, "vision_config.downsample_ratio"),
    ({"max_image_tokens": 3}, "vision_config.max_image_tokens"),
    ({"rope_theta": 0}, "vision_config.rope_theta"),
    ({"max_wh_ratio": 0.5}, "vision_config.max_wh_ratio"),
])
def test_parse_vision_config_errors(fields: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=f"`{where}`"):
        parse_vision_config({"vision_config": fields})


def test_parse_vision_config_flat_error_names_flat_field() -> None:
    with pytest.raises(ConfigError, match="`vision_n_heads`"):
        parse_vision_config({"vision_dim": 32, "vision_n_heads": 3})
    with pytest.raises(ConfigError, match="`vision_config`"):
        parse_vision_config({"vision_config": [1, 2]})


# ---- ViT -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, VisionConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                                    num_attention_heads=4, rope_theta=100.0)],
                         ids=["head16", "head8"])
def test_vit_matches_float64_transcription(cfg: VisionConfig) -> None:
    tower = _randomize(VisionTower(cfg), seed=1)
    sd = tower.state_dict()
    for nh, nw in [(3, 4), (1, 1), (2, 5)]:
        patches = _patches([(nh, nw)], seed=nh * 10 + nw, cfg=cfg)
        got = tower(patches, [(nh, nw)]).double()
        want = _ref_vit(sd, cfg, patches, nh, nw)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if nh * nw > 1 and nh != nw:
            # The comparison can fail: the same transcription with rows and columns swapped is far off.
            assert (got - _ref_vit(sd, cfg, patches, nh, nw, swap_rope=True)).abs().max() > 1e-2


def test_packed_images_equal_one_at_a_time() -> None:
    tower = _randomize(VisionTower(TINY), seed=2)
    patches = _patches(GRIDS, seed=3)
    packed = tower(patches, GRIDS)
    alone = torch.cat([tower(p, [g]) for p, g in zip(patches.split([h * w for h, w in GRIDS]), GRIDS)])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # No leakage: changing one image leaves every other image's features exactly as they were.
    changed = patches.clone()
    start = GRIDS[0][0] * GRIDS[0][1] + 1
    changed[start:start + 12] += 1.0  # image 2 (4x3)
    out = tower(changed, GRIDS)
    assert not torch.allclose(out[start:start + 12], packed[start:start + 12])
    assert torch.equal(out[:start], packed[:start]) and torch.equal(out[start + 12:], packed[start + 12:])


def test_block_diagonal_attention_equals_per_image() -> None:
    # The device (graph-safe) path, exercised on CPU: one masked SDPA, plus padding rows past cu_seqlens[-1], which
    # come out 0 (graph buffers' unused rows: the Triton kernel skips them).
    gen = torch.Generator().manual_seed(4)
    n, pad = sum(h * w for h, w in GRIDS), 5
    q, k, v = (torch.randn(n + pad, 2, 16, generator=gen) for _ in range(3))
    cu = cu_seqlens_of(GRIDS)
    assert cu.tolist() == [0, 10, 11, 23, 44] and cu.dtype == torch.int32
    want = per_image_attention(q, k, v, cu.tolist())
    assert want.shape == q.shape and not want[n:].any()
    got = block_diagonal_attention(q, k, v, cu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it differs from unmasked attention, so the mask is doing something
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    assert (full - want).abs().max() > 1e-2


def test_vit_input_checks() -> None:
    tower = VisionTower(TINY)
    with pytest.raises(ValueError, match="do not fit"):
        tower(torch.zeros(5, TINY.patch_dim), [(2, 3)])
    with pytest.raises(ValueError, match="do not fit"):
        tower(torch.zeros(6, 10), [(2, 3)])
    with pytest.raises(ValueError, match="positive"):
        tower(torch.zeros(0, TINY.patch_dim), [(0, 3)])
    # [n, 3, p, p] patches are the same as flattened ones
    p = _patches([(2, 2)], seed=5)
    assert torch.equal(tower(p.reshape(4, 3, 14, 14), [(2, 2)]), tower(p, [(2, 2)]))


# ---- aligner ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nh, nw", [(1, 1), (2, 5), (3, 3), (4, 7), (6, 2)])
def test_aligner_unshuffle_order(nh: int, nw: int) -> None:
    dim, r = 4, 3
    aligner = Aligner(VisionConfig(hidden_size=dim, num_attention_heads=1, intermediate_size=8), HIDDEN).double()
    blocks = aligner.unshuffle(_coded_features(nh, nw, dim), nh, nw)
    lh, lw = math.ceil(nh / r), math.ceil(nw / r)
    assert blocks.shape == (lh * lw, dim * r * r)
    for row in range(lh * lw):
        by, bx = divmod(row, lw)  # row-major block order
        for c in range(dim):
            for ky in range(r):
                for kx in range(r):
                    y, x = by * r + ky, bx * r + kx
                    want = _feature_code(c, y, x) if y < nh and x < nw else 0.0  # zero padding right/bottom
                    assert blocks[row, c * r * r + ky * r + kx] == want, (row, c, ky, kx)


@pytest.mark.parametrize("nh, nw", [(1, 1), (2, 5), (7, 4)])
def test_aligner_mlp_exact_gelu(nh: int, nw: int) -> None:
    aligner = _randomize(Aligner(TINY, HIDDEN), seed=6).double()
    feats = torch.randn(nh * nw, TINY.hidden_size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = aligner(feats, nh, nw)
    h = aligner.unshuffle(feats, nh, nw) @ aligner.w1.weight.T + aligner.w1.bias
    h = h * 0.5 * (1 + torch.special.erf(h / math.sqrt(2)))  # erf GELU, not tanh
    want = h @ aligner.w2.weight.T + aligner.w2.bias
    assert got.shape == (math.ceil(nh / 3) * math.ceil(nw / 3), HIDDEN)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # torch's unfold on the zero-padded grid is the same pixel-unshuffle
    grid = F.pad(feats.reshape(nh, nw, -1).permute(2, 0, 1), (0, -nw % 3, 0, -nh % 3))
    torch.testing.assert_close(aligner.unshuffle(feats, nh, nw), F.unfold(grid[None], 3, stride=3)[0].T)


def test_aligner_packed_equals_per_image() -> None:
    aligner = _randomize(Aligner(TINY, HIDDEN), seed=8)
    feats = torch.randn(sum(h * w for h, w in GRIDS), TINY.hidden_size, generator=torch.Generator().manual_seed(9))
    idx, mask = merge_index(GRIDS, 3)
    per = torch.cat([aligner(f, h, w) for f, (h, w) in zip(feats.split([h * w for h, w in GRIDS]), GRIDS)])
    torch.testing.assert_close(aligner.forward_packed(feats, idx, mask), per, rtol=1e-5, atol=1e-5)
    assert idx.shape == (sum(math.ceil(h / 3) * math.ceil(w / 3) for h, w in GRIDS), 9)
    assert mask[2].tolist() == [True] + [False] * 8  # row 2 is the 1x1 image: one real cell, eight of padding
    assert mask[0].tolist() == [True] * 3 + [True] * 3 + [False] * 3  # 2x5, first block: the third row is padding


# ---- encoder and spans -----------------------------------------------------------------------------------------
def test_span_layout() -> None:
    enc = _randomize(VisionEncoder(TINY, HIDDEN), seed=10)
    for lh, lw in [(1, 1), (2, 3), (3, 1)]:
        rows = torch.arange(lh * lw * HIDDEN, dtype=torch.float32).reshape(lh * lw, HIDDEN) + 1000
        span = enc.span_embeddings(rows, lh, lw)
        assert span.shape == (lh * (lw + 1) + 2, HIDDEN)
        assert torch.equal(span[0], enc.image_start.data) and torch.equal(span[-1], enc.image_end.data)
        for i in range(lh):
            for j in range(lw):
                assert torch.equal(span[1 + i * (lw + 1) + j], rows[i * lw + j])  # reading order
            assert torch.equal(span[1 + i * (lw + 1) + lw], enc.image_newline.data)  # after every row, the last too
    # delimiters are fp32 parameters cast to the rows' dtype
    span = enc.span_embeddings(torch.zeros(2, HIDDEN, dtype=torch.bfloat16), 1, 2)
    assert span.dtype == torch.bfloat16 and torch.equal(span[0], enc.image_start.data.to(torch.bfloat16))
    assert enc.image_start.dtype == torch.float32
    with pytest.raises(ValueError, match="do not fill"):
        enc.span_embeddings(rows, 5, 5)


def test_encoder_encode_and_spans() -> None:
    enc = _randomize(VisionEncoder(TINY, HIDDEN), seed=11)
    patches = _patches(GRIDS, seed=12)
    rows = enc.encode(patches, GRIDS)
    feats = enc.vision(patches, GRIDS).split([h * w for h, w in GRIDS])
    for r, f, (h, w) in zip(rows, feats, GRIDS):
        assert r.shape == (math.ceil(h / 3) * math.ceil(w / 3), HIDDEN)
        torch.testing.assert_close(r, enc.aligner(f, h, w))
    spans = enc(patches, GRIDS)
    assert [s.shape[0] for s in spans] == [1 * 3 + 2, 1 * 2 + 2, 2 * 2 + 2, 1 * 4 + 2]
    torch.testing.assert_close(spans[3], enc.span_embeddings(rows[3], 1, 3))
    assert enc.encode(torch.zeros(0, TINY.patch_dim), []) == []


# ---- checkpoint names ------------------------------------------------------------------------------------------
def test_state_dict_names_are_model_md_10_2() -> None:
    with torch.device("meta"):
        enc = VisionEncoder(VisionConfig(), 5120)  # the released sizes
    sd = {k: tuple(v.shape) for k, v in enc.state_dict().items()}
    literal = {  # model.md 10.2, block 0 and the top-level names
        "vision.patch_embed.proj.weight": (1024, 588), "vision.patch_embed.proj.bias": (1024,),
        "vision.blocks.0.norm1.weight": (1024,), "vision.blocks.0.attn.wqkv.weight": (3072, 1024),
        "vision.blocks.0.attn.wqkv.bias": (3072,), "vision.blocks.0.attn.wo.weight": (1024, 1024),
        "vision.blocks.0.attn.wo.bias": (1024,), "vision.blocks.0.norm2.weight": (1024,),
        "vision.blocks.0.mlp.w1.weight": (5632, 1024), "vision.blocks.0.mlp.w2.weight": (1024, 2816),
        "vision.norm.weight": (1024,), "aligner.w1.weight": (5120, 9216), "aligner.w1.bias": (5120,),
        "aligner.w2.weight": (5120, 5120), "aligner.w2.bias": (5120,), "image_start": (5120,),
        "image_end": (5120,), "image_newline": (5120,),
    }
    assert {k: sd[k] for k in literal if k in sd} == literal
    assert len(sd) == 2 + 32 * 8 + 1 + 4 + 3
    shapes = vision_tensor_shapes(VisionConfig(), 5120, "bfloat16")
    assert {k: s for k, (s, _) in shapes.items()} == sd
    fp32 = sorted(k for k, (_, dt) in shapes.items() if dt == torch.float32)
    assert fp32 == sorted(["image_end", "image_newline", "image_start", "vision.norm.weight"]
                          + [f"vision.blocks.{b}.norm{i}.weight" for b in range(32) for i in (1, 2)])
    assert vision_param_dtype(f"{VISION_MODULE}.vision.blocks.3.norm2.weight", torch.bfloat16) == torch.float32
    assert vision_param_dtype(f"{VISION_MODULE}.aligner.w1.weight", torch.bfloat16) == torch.bfloat16


def test_route_v41_vision_names() -> None:
    m = VISION_MODULE
    cases = {
        "vision.blocks.3.attn.wqkv.weight": f"{m}.vision.blocks.3.attn.wqkv.weight",
        "model.vision.patch_embed.proj.bias": f"{m}.vision.patch_embed.proj.bias",
        "model.visual.blocks.3.attn.qkv.weight": f"{m}.vision.blocks.3.attn.wqkv.weight",
        "model.visual.blocks.3.attn.proj.bias": f"{m}.vision.blocks.3.attn.wo.bias",
        "model.visual.patch_embed.proj.weight": f"{m}.vision.patch_embed.proj.weight",  # not the attn `proj`
        "model.visual.blocks.0.mlp.w1.weight": f"{m}.vision.blocks.0.mlp.w1.weight",
        "model.visual.norm.weight": f"{m}.vision.norm.weight",
        "aligner.w2.bias": f"{m}.aligner.w2.bias",
        "model.aligner.w1.weight": f"{m}.aligner.w1.weight",
        "image_newline": f"{m}.image_newline",
        "model.image_start": f"{m}.image_start",
    }
    for key, name in cases.items():
        assert route_v41(key).name == name, key
        assert is_vision_key(key) and route_v41_text(key) is None
    # text routing untouched
    assert route_v41("model.layers.0.attn.wq_a.weight").name == "model.layers.0.attn.wq_a.weight"
    assert route_v41("model.language_model.embed_tokens.weight").name == "model.embed.weight"
    assert route_v41_text("model.norm.weight").name == "model.norm.weight"
    assert not is_vision_key("model.layers.0.attn.wq_a.weight") and not is_vision_key("model.image_foo")


# ---- the tiny-v41-vl preset and the loader ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41-vl", str(tmp_path_factory.mktemp("tiny-v41-vl")), seed=0)


def _file_tensors(d: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _vl_model(d: str) -> DeepseekV41ForCausalLM:
    """The text model with the encoder attached as the lead will: `model.vision_encoder = VisionEncoder(...)`."""
    cfg = load_model_config(d)
    model = DeepseekV41ForCausalLM(cfg)
    setattr(model, VISION_MODULE, VisionEncoder(load_vision_config(d), cfg.hidden_size))
    return model


def test_preset_writes_config_tokenizer_and_weights(vl_dir: str) -> None:
    assert "tiny-v41-vl" in VISION_PRESETS
    with open(os.path.join(vl_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    preset = preset_config("tiny-v41-vl")
    assert raw["vision_config"] == preset["vision_config"] and raw["image_token_id"] == preset["image_token_id"]
    assert {k: v for k, v in raw["text_config"].items() if k != "dtype"} == preset["text_config"]
    vcfg = parse_vision_config(raw)
    assert vcfg == TINY and load_vision_config(vl_dir) == TINY
    cfg = load_model_config(vl_dir)
    assert cfg.vocab_size == 513 and cfg.v41.image_token_id == raw["image_token_id"] == 512
    tok = tokenizers.Tokenizer.from_file(os.path.join(vl_dir, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 513 and tok.token_to_id(IMAGE_PLACEHOLDER) == 512
    assert 512 in tok.encode(f"look {IMAGE_PLACEHOLDER} here").ids
    # the engram compressed size the config states is the one the written tokenizer gives
    from dsv4.models.engram import build_compressed_token_map
    assert build_compressed_token_map(tok)[1] == cfg.v41.engram.compressed_vocab_size

    got = {k: (tuple(t.shape), t.dtype) for k, t in _file_tensors(vl_dir).items()}
    want = {**v41_tensor_shapes(cfg), **vision_tensor_shapes(vcfg, cfg.hidden_size)}
    assert got == want
    t = _file_tensors(vl_dir)
    assert torch.equal(t["vision.blocks.1.norm2.weight"], torch.ones(32))
    assert t["image_start"].abs().min() > 0 and not torch.equal(t["image_start"], t["image_end"])


def test_preset_bf16_keeps_vision_fp32_tensors(tmp_path: Path) -> None:
    d = make_model("tiny-v41-vl", str(tmp_path), seed=1, dtype="bfloat16")
    t = _file_tensors(d)
    assert t["image_newline"].dtype == t["vision.norm.weight"].dtype == torch.float32
    assert t["vision.blocks.0.attn.wqkv.weight"].dtype == t["aligner.w1.weight"].dtype == torch.bfloat16


def test_loader_round_trip(vl_dir: str, tmp_path: Path) -> None:
    assert has_vision_weights(vl_dir)
    t = _file_tensors(vl_dir)
    model = _vl_model(vl_dir)
    load_into_module(model, vl_dir, route_v41)
    sd = model.state_dict()
    vision_keys = [k for k in t if is_vision_key(k)]
    assert len(vision_keys) == len(vision_tensor_shapes(TINY, 64)) == 26
    for k in vision_keys:
        assert torch.equal(sd[f"{VISION_MODULE}.{k}"], t[k]), k
    assert torch.equal(sd["model.embed.weight"], t["model.embed.weight"])

    # The same tensors under newer HF-V41 names load to the same model.
    renamed = {}
    for k, v in t.items():
        if k.startswith("vision."):
            k = "model.visual." + k[len("vision."):].replace(".attn.wqkv.", ".attn.qkv.").replace(".attn.wo.",
                                                                                                  ".attn.proj.")
        elif is_vision_key(k):
            k = "model." + k
        renamed[k] = v
    assert "model.visual.blocks.0.attn.qkv.weight" in renamed and "model.image_end" in renamed
    d2 = tmp_path / "hf_names"
    d2.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d2 / name).write_bytes((Path(vl_dir) / name).read_bytes())
    save_file(renamed, str(d2 / "model.safetensors"))
    model2 = _vl_model(str(d2))
    load_into_module(model2, str(d2), route_v41)
    sd2 = model2.state_dict()
    assert sd2.keys() == sd.keys() and all(torch.equal(sd2[k], sd[k]) for k in sd)


def test_text_only_model_and_checkpoint(vl_dir: str, tmp_path: Path) -> None:
    cfg = load_model_config(vl_dir)
    assert cfg.vision is not None  # the checkpoint has a tower: the engine's config describes it
    text_model = DeepseekV41ForCausalLM(dataclasses.replace(cfg, vision=None))
    with pytest.raises(CheckpointError) as e:  # the vision tensors have nowhere to go
        load_into_module(text_model, vl_dir, route_v41)
    assert len(e.value.unexpected) == 26 and all(u.startswith(f"{VISION_MODULE}.") for u in e.value.unexpected)
    load_into_module(text_model, vl_dir, route_v41_text)  # a text-only build ignores them
    # tiny-v41 carries a vision_config but no tower: no vision config for the engine
    d = make_model("tiny-v41-noengram", str(tmp_path / "text"), seed=0)
    assert parse_vision_config(json.loads(Path(d, "config.json").read_text())) == VisionConfig()
    assert not has_vision_weights(d) and load_vision_config(d) is None


def test_bf16_encoder_follows_fp32() -> None:
    # Built as the engine builds it: every tensor in `vision_param_dtype` (norms and delimiters stay fp32).
    enc = _randomize(VisionEncoder(TINY, HIDDEN), seed=14, std=0.1)
    low = VisionEncoder(TINY, HIDDEN)
    low.load_state_dict(enc.state_dict())
    for name, p in low.named_parameters():
        p.data = p.data.to(vision_param_dtype(name, torch.bfloat16))
    assert low.vision.blocks[0].norm1.weight.dtype == low.image_end.dtype == torch.float32
    assert low.vision.blocks[0].attn.wqkv.weight.dtype == torch.bfloat16
    patches = _patches(GRIDS, seed=15)
    for a, b in zip(low(patches, GRIDS), enc(patches, GRIDS)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-2)


def test_loaded_encoder_runs(vl_dir: str) -> None:
    model = _vl_model(vl_dir)
    load_into_module(model, vl_dir, route_v41)
    enc = getattr(model, VISION_MODULE)
    grids = [(6, 6), (1, 1), (2, 5)]
    spans = enc(_patches(grids, seed=13), grids)
    assert [s.shape for s in spans] == [(2 * 3 + 2, 64), (4, 64), (1 * 3 + 2, 64)]
    assert all(torch.isfinite(s).all() for s in spans)
    assert torch.equal(spans[1][0], model.state_dict()[f"{VISION_MODULE}.image_start"])
