"""The released checkpoints' layout (dsv4.quant.released): names the loader routes onto `tensor_shapes`, shapes and
dtypes, byte totals against the published sizes, and `make-model --quant released` checkpoints that are the float
preset's model up to FP8 / MXFP4 rounding (in memory, and streamed into shards for the large presets)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.cli import main
from dsv4.make_model import make_model
from dsv4.models.config import load_model_config, parse_config_dict
import dsv4.models.loader as loader
from dsv4.models.loader import _scale_target, load_into_module, route_v41
from dsv4.models.presets import CONFIG_ONLY_PRESETS, preset_config, tensor_shapes
from dsv4.quant.config import QuantConfig, parse_quant_config
from dsv4.quant.formats import MX_BLOCK, _block_amax, dequantize, scale_to_float
import dsv4.quant.released as rel
from dsv4.quant.released import (DENSE, ENGRAM_TABLE, EXPERT, V4_BASE_RELEASE, V4_RELEASE, V41_RELEASE, quant_kind,
                                 release_quant, released_layout, released_pieces, stored_nbytes)

E8M0 = torch.float8_e8m0fnu
GB = 1e9
GIB = 2 ** 30


def _route_v4():
    return getattr(loader, "route_v4", None) or getattr(loader, "_route")  # the V4 router (renamed route_v4)


def _cfg(preset: str, overrides: dict | None = None):
    return parse_config_dict(preset_config(preset, overrides))


def _qcfg(preset: str) -> QuantConfig:
    return release_quant("released", _cfg(preset))


def _nbytes(layout: dict) -> int:
    return sum(math.prod(s) * dt.itemsize for s, dt in layout.values())


# ---- names and kinds ---------------------------------------------------------------------------------------------
def test_quant_kind() -> None:
    dense = ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.3.self_attn.o_b_proj.weight",
             "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
             "model.layers.0.mlp.shared_experts.down_proj.weight", "model.layers.0.attn.wkv.weight",
             "model.layers.4.attn.indexer.wq_b.weight", "model.layers.1.engram.wkv.weight",
             "model.layers.0.ffn.shared_experts.w3.weight", "layers.0.attn.wo_a.weight"]
    experts = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
               "model.layers.5.ffn.experts.3.w1.weight", "layers.5.ffn.experts.300.w2.weight"]
    floats = ["model.embed_tokens.weight", "lm_head.weight", "model.embed.weight", "model.norm.weight",
              "model.hc_head.hc_fn", "model.layers.0.attn_hc.fn", "model.layers.0.hc_attn_fn",
              "model.layers.0.mlp.gate.weight", "model.layers.0.ffn.gate.weight", "model.layers.0.mlp.gate.tid2eid",
              "model.layers.2.self_attn.compressor.kv_proj.weight",
              "model.layers.2.self_attn.compressor.gate_proj.weight",
              "model.layers.2.self_attn.compressor.indexer.kv_proj.weight",
              "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
              "model.layers.1.attn.compressor.wkv.weight", "model.layers.1.attn.compressor.wgate.weight",
              "model.layers.1.attn.indexer.wk.weight", "model.layers.1.attn.indexer.weights_proj.weight",
              "model.layers.0.self_attn.sinks", "model.layers.0.attn.attn_sink", "model.layers.0.ffn.gate.bias",
              "model.layers.1.engram.q_weight", "model.layers.1.engram.embed.scale",
              "model.layers.0.self_attn.q_a_norm.weight", "model.layers.0.attn.kv_norm.weight"]
    assert [quant_kind(n) for n in dense] == [DENSE] * len(dense)
    assert [quant_kind(n) for n in experts] == [EXPERT] * len(experts)
    assert quant_kind("model.layers.1.engram.embed.weight") == ENGRAM_TABLE
    assert [n for n in floats if quant_kind(n) is not None] == []


def _expected_scale(weight: tuple[tuple[int, ...], torch.dtype], kind: str, qcfg: QuantConfig
                    ) -> tuple[tuple[int, ...], torch.dtype]:
    (N, K), dt = weight
    if dt == torch.int8:  # MXFP4: K/2 bytes, one UE8M0 per 32 values
        return (N, 2 * K // MX_BLOCK), E8M0
    if kind == ENGRAM_TABLE:
        return (N, K // MX_BLOCK), E8M0
    bn, bk = qcfg.block
    return (math.ceil(N / bn), math.ceil(K / bk)), (E8M0 if qcfg.ue8m0 else torch.float32)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41", "v4-flash", "v41-flash"])
def test_layout_is_what_the_loader_routes_onto_tensor_shapes(preset: str) -> None:
    cfg, qcfg = _cfg(preset), _qcfg(preset)
    v41 = cfg.v41 is not None
    assert qcfg == (V41_RELEASE if v41 else V4_RELEASE)
    layout, shapes = released_layout(cfg, qcfg), tensor_shapes(cfg, "bfloat16")
    route = route_v41 if v41 else _route_v4()
    covered: dict[str, set[tuple[int, int]]] = {}
    for key, (shape, dt) in layout.items():
        assert not key.startswith("model.") and not key.startswith("mtp.")
        if key.endswith(".scale"):  # the loader pairs it with its weight; shape = the ceil blocks of that weight
            weight = _scale_target(key)
            assert weight in layout, key
            assert (shape, dt) == _expected_scale(layout[weight], quant_kind(weight), qcfg), key
            continue
        kind = quant_kind(key)
        logical = (*shape[:-1], 2 * shape[-1]) if dt == torch.int8 else shape
        assert dt == {DENSE: torch.float8_e4m3fn, ENGRAM_TABLE: torch.float8_e4m3fn,
                      EXPERT: torch.int8}.get(kind, dt), key
        assert (kind is not None) == (key.removesuffix(".weight") + ".scale" in layout), key
        r = route(key)
        if r is None:  # V4.1 engram tables: read by name (build.py / HostTable), not through the module loader
            assert v41 and kind == ENGRAM_TABLE
            name, piece = "model." + key, None
        elif r.expert is not None:
            packed = r.name.rsplit(".", 1)[-1]
            assert packed in ("gate_up_proj", "down_proj")
            piece = (r.expert, r.half)
            # V4 checkpoints name the packed tensor; V4.1's tensor_shapes keep one tensor per expert
            w = "w2" if packed == "down_proj" else ("w1", "w3")[r.half]
            name = r.name if not v41 else f"{r.name.rsplit('.', 1)[0]}.{r.expert}.{w}.weight"
        else:
            name, piece = r.name, None
        assert name in shapes, f"{key} -> {name}: not a tensor of tensor_shapes"
        full, float_dtype = shapes[name]
        if piece is None or v41:
            want = full
        else:  # a piece of V4's packed [E, 2I, D] (w1 rows, then w3 rows) or [E, D, I]
            want = (full[1] // 2, full[2]) if name.endswith("gate_up_proj") else full[1:]
        assert logical == want, (key, logical, want)
        if kind is None:  # float tensors: as in the bf16 float checkpoint (mHC, sinks, biases fp32; tid2eid int64)
            assert dt == float_dtype, key
        assert piece not in covered.setdefault(name, set()), f"{key}: {name} {piece} given twice"
        covered[name].add(piece)
    dummy = {n for n in shapes if n.endswith(".engram.embed.scale")}  # the float layout's stand-in for the scale
    assert set(covered) == set(shapes) - dummy
    E = cfg.n_routed_experts
    for name, pieces in covered.items():
        if name.endswith("gate_up_proj"):
            assert pieces == {(e, h) for e in range(E) for h in (0, 1)}, name
        elif name.endswith("down_proj"):
            assert pieces == {(e, 0) for e in range(E)}, name


def test_stored_nbytes_by_hand() -> None:
    v4, v41 = _cfg("v4-flash"), _cfg("v41-flash")
    # FP8 [32768, 1024] with 128x128 UE8M0 blocks: 1 B per value + 256 x 8 one-byte scales
    assert stored_nbytes("model.layers.0.self_attn.q_b_proj.weight", (32768, 1024), v4, V4_RELEASE) \
        == 32768 * 1024 + 256 * 8
    # the Base format's float32 scales
    assert stored_nbytes("model.layers.0.self_attn.q_b_proj.weight", (32768, 1024), v4, V4_BASE_RELEASE) \
        == 32768 * 1024 + 256 * 8 * 4
    # 256 experts x (w1 + w3) [2048, 4096] MXFP4: 0.5 B per value + one scale byte per 32
    assert stored_nbytes("model.layers.5.mlp.experts.gate_up_proj", (256, 4096, 4096), v4, V4_RELEASE) \
        == 256 * 2 * (2048 * 4096 // 2 + 2048 * 4096 // 32)
    assert stored_nbytes("model.layers.5.mlp.experts.gate_up_proj", (256, 4096, 4096), v4, V4_BASE_RELEASE) \
        == 256 * 2 * (2048 * 4096 + 16 * 32 * 4)  # 16 x 32 float32 blocks per expert matrix
    # per-expert blocks: I = 32 < 128 rows gives one block row per half (the packed tensor would give one in all)
    tiny = _cfg("tiny-v4")
    assert stored_nbytes("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64), tiny, V4_BASE_RELEASE) \
        == 8 * 2 * (32 * 64 + 1 * 4)
    # V4.1: an engram row is 256 FP8 bytes + 8 UE8M0 bytes (264 B/row, peers_v4.md 1.2); the float dummy scale: 0
    assert stored_nbytes("model.layers.1.engram.embed.weight", (384006168, 256), v41, V41_RELEASE) \
        == 384006168 * 264
    assert stored_nbytes("model.layers.1.engram.embed.scale", (384006168, 8), v41, V41_RELEASE) == 0
    # 32x32 blocks; float tensors at the release dtype: bf16, fp32 kept, int64 tid2eid
    assert stored_nbytes("model.layers.0.attn.wo_b.weight", (5120, 8192), v41, V41_RELEASE) \
        == 5120 * 8192 + 160 * 256
    assert stored_nbytes("model.embed.weight", (129280, 5120), v41, V41_RELEASE) == 129280 * 5120 * 2
    assert stored_nbytes("model.layers.0.hc_attn_fn", (24, 20480), v41, V41_RELEASE) == 24 * 20480 * 4
    assert stored_nbytes("model.layers.0.mlp.gate.tid2eid", (129280, 6), v4, V4_RELEASE) == 129280 * 6 * 8
    for preset in ("tiny-v4", "tiny-v41", "v4-flash"):  # the per-tensor count adds up to the layout
        cfg, q = _cfg(preset), _qcfg(preset)
        assert sum(stored_nbytes(n, s, cfg, q) for n, (s, _) in tensor_shapes(cfg).items()) \
            == _nbytes(released_layout(cfg, q))


def test_v41_flash_size_against_the_published_checkpoint() -> None:
    """Published (peers_v4.md 1.2): 510,313,343,553 bytes, which also hold the DSpark drafter (mtp.*: 3 stages, each
    with 128 MXFP4 experts of the backbone's width, plus attention / heads) and the vision tower; our layout is the
    40-layer text backbone with its engram tables only. So: published - ours = the DSpark experts (exact below) +
    the drafter's non-expert weights + vision (~0.48B ViT/aligner params: 0.5-1 GB; a drafter stage's dense part
    ~0.17 GB FP8 like a backbone layer, plus its heads): a remainder of 0.5 to 3 GB."""
    cfg, q = _cfg("v41-flash"), _qcfg("v41-flash")
    assert cfg.v41.engram.num_embeddings == (384006168, 384016682)  # the released tables' rows
    layout = released_layout(cfg, q)
    ours = _nbytes(layout)
    dspark_expert_values = 3 * 128 * 3 * 2304 * 5120
    dspark_experts = dspark_expert_values // 2 + dspark_expert_values // 32
    rest = 510_313_343_553 - ours - dspark_experts
    assert 0.5 * GB < rest < 3 * GB, (ours, rest)
    # The vLLM recipe's per-component table (GiB, one decimal): routed + DSpark experts 259.5, engram values
    # 183.1, UE8M0 scales 21.9 (experts', engram's and dense blocks'). The engram total is the published fixture's.
    kinds = {k: sum(math.prod(s) * dt.itemsize for n, (s, dt) in layout.items()
                    if not n.endswith(".scale") and quant_kind(n) == k) for k in (EXPERT, ENGRAM_TABLE)}
    scales = sum(math.prod(s) * dt.itemsize for n, (s, dt) in layout.items() if n.endswith(".scale"))
    assert abs((kinds[EXPERT] + dspark_expert_values // 2) / GIB - 259.5) < 0.06
    assert abs(kinds[ENGRAM_TABLE] / GIB - 183.1) < 0.06
    assert abs((scales + dspark_expert_values // 32) / GIB - 21.9) < 0.06
    engram = sum(math.prod(s) for n, (s, _) in layout.items() if ".engram.embed." in n)
    assert engram == 202_758_032_400


def test_v4_flash_size_against_the_published_checkpoint() -> None:
    """Published (peers_v4.md 1.1): "~160 GB on disk (46 shards)" for V4-Flash, which also holds one MTP layer
    (mtp.0: a block of the backbone's shape). Ours is the 43-layer backbone: ours + one average layer must round to
    160 GB (157.5-162.5 GB); and the 284B-parameter figure matches the float layout's count (284.3B)."""
    cfg, q = _cfg("v4-flash"), _qcfg("v4-flash")
    ours = _nbytes(released_layout(cfg, q))
    embed_head = 2 * 129280 * 4096 * 2
    per_layer = (ours - embed_head) / 43
    assert 157.5 * GB < ours + per_layer < 162.5 * GB, ours
    assert 283.5e9 < sum(math.prod(s) for s, _ in tensor_shapes(cfg).values()) < 284.5e9


# ---- the writer ---------------------------------------------------------------------------------------------------
def _read_dir(d: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def _per_block(amax: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    return amax.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def check_release(released: dict[str, torch.Tensor], floats: dict[str, torch.Tensor], cfg, qcfg: QuantConfig
                  ) -> dict[str, int]:
    """Every released tensor against the float model's: stored dtypes and shapes as `released_layout`, FP8 within
    2^-4 of its block amax (e4m3: 3 mantissa bits, half an ulp of a value <= amax), MXFP4 within half an e2m1 step
    (<= 1 scale unit, <= amax/4: scaled amax is in (3, 6], the widest step is 4 -> 6), float tensors exactly the
    float value in the release dtype. Returns how many tensors of each kind were checked."""
    layout = released_layout(cfg, qcfg)
    assert {k: (tuple(t.shape), t.dtype) for k, t in released.items()} == layout
    counts: dict[str, int] = {}
    for name, t in floats.items():
        kind = quant_kind(name)
        for piece, _, index in released_pieces(name, tuple(t.shape), cfg):
            if name.endswith(".engram.embed.scale"):
                continue
            w = (t[index] if index is not None else t).float()
            got = released[piece]
            counts[kind or "float"] = counts.get(kind or "float", 0) + 1
            if kind is None:
                assert torch.equal(got, w.to(got.dtype)), piece
                continue
            scale = released[piece.removesuffix(".weight") + ".scale"]
            if kind == EXPERT and qcfg.expert_dtype == "fp4":
                block, bound = (1, MX_BLOCK), 2.0 ** -2
            else:
                block, bound = ((1, MX_BLOCK) if kind == ENGRAM_TABLE else qcfg.block), 2.0 ** -4
            # the release's encoding: UE8M0 = the smallest power of two >= amax / code max; float32 = amax / 448
            code_max = 6.0 if got.dtype == torch.int8 else 448.0
            ratio = _block_amax(w, block) / scale_to_float(scale)
            nonzero = _block_amax(w, block) > 0
            if scale.dtype == E8M0:
                assert ((ratio > code_max / 2) & (ratio <= code_max))[nonzero].all(), piece
            else:
                assert torch.allclose(ratio[nonzero], torch.full_like(ratio[nonzero], code_max)), piece
            deq = dequantize(got, scale, block)
            err = (deq - w).abs()
            amax = _per_block(_block_amax(w, block), block, w.shape)
            assert (err <= bound * amax).all(), (piece, (err / amax).max().item())
            if block == (1, MX_BLOCK) and kind == EXPERT:
                assert (err <= dequantize(torch.full_like(got, 0x22), scale, block)).all(), piece  # 0x22: 1.0, 1.0
            assert err.max() > 0, f"{piece}: no rounding at all, nothing was quantized"
    return counts


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_released_tiny_checkpoint_is_the_float_model_quantized(preset: str, tmp_path: Path) -> None:
    # the released layout carries no drafter yet (tiny-v41's float checkpoint has DSpark, tiny-v4's an MTP layer):
    # compare without it
    float_dir = make_model(preset, str(tmp_path / "float"), seed=3, drafter=False)
    rel_dir = make_model(preset, str(tmp_path / "released"), seed=3, quant="released")
    cfg = load_model_config(rel_dir)
    with open(os.path.join(rel_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    qcfg = parse_quant_config(raw)
    assert qcfg == _qcfg(preset)
    if cfg.v41 is None:
        assert raw["expert_dtype"] == "fp4" and raw["quantization_config"]["weight_block_size"] == [128, 128]
    else:
        assert raw["text_config"]["quantization_config"] == raw["quantization_config"]
        assert raw["quantization_config"]["weight_block_size"] == [32, 32] and "expert_dtype" not in raw
    assert raw.get("text_config", raw)["dtype"] == "bfloat16"
    assert sorted(os.listdir(rel_dir)) == sorted(os.listdir(float_dir))
    with safe_open(os.path.join(rel_dir, "model.safetensors"), framework="pt") as st:  # safetensors dtype strings
        dtypes = {k: st.get_slice(k).get_dtype() for k in st.keys()}
    expert = "layers.2.ffn.experts.5.w1"
    assert (dtypes[expert + ".weight"], dtypes[expert + ".scale"]) == ("I8", "F8_E8M0")
    assert (dtypes["layers.2.attn.wq_b.weight"], dtypes["layers.2.attn.wq_b.scale"]) == ("F8_E4M3", "F8_E8M0")
    assert (dtypes["embed.weight"], dtypes["layers.2.hc_attn_fn"]) == ("BF16", "F32")
    counts = check_release(_read_dir(rel_dir), _read_dir(float_dir), cfg, qcfg)
    n = cfg.num_hidden_layers
    assert counts[EXPERT] == n * 3 * cfg.n_routed_experts
    if cfg.v41 is not None:
        assert counts[ENGRAM_TABLE] == 1 and dtypes["layers.1.engram.embed.scale"] == "F8_E8M0"
    else:
        assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64"


def _module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state dict is `tensors` (dotted names -> nested submodules with persistent buffers)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_buffer(leaf, t.clone())
    return root


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_loader_reads_the_released_checkpoint(preset: str, tmp_path: Path) -> None:
    """The engine's loader dequantizes every released tensor onto the float model's names and shapes (V4.1's per-expert
    tensors packed, its engram tables left to the host table)."""
    # the released layout carries no drafter yet: the float reference is written without it
    float_dir = make_model(preset, str(tmp_path / "float"), seed=1, drafter=False)
    rel_dir = make_model(preset, str(tmp_path / "released"), seed=1, quant="released")
    cfg = load_model_config(float_dir)
    floats = _read_dir(float_dir)
    want: dict[str, torch.Tensor] = {}
    for name, t in floats.items():
        if ".engram.embed." in name:
            continue
        if cfg.v41 is not None and ".ffn.experts." in name:  # packed as the V4.1 module holds them
            prefix, e, w = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            packed = f"{prefix}.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
            if packed not in want:
                I, D = cfg.moe_intermediate_size, cfg.hidden_size
                want[packed] = torch.zeros((cfg.n_routed_experts, D, I) if w == "w2" else
                                           (cfg.n_routed_experts, 2 * I, D))
            rows = slice(None) if w == "w2" else slice(0, cfg.moe_intermediate_size) if w == "w1" else \
                slice(cfg.moe_intermediate_size, None)
            want[packed][e, rows] = t
            continue
        want[name] = t
    module = _module_of({n: torch.zeros(t.shape, dtype=torch.int64 if n.endswith("tid2eid") else torch.float32)
                         for n, t in want.items()})
    load_into_module(module, rel_dir, route_v41 if cfg.v41 is not None else _route_v4())
    loaded = module.state_dict()
    assert set(loaded) == set(want)
    release_dtypes = tensor_shapes(cfg, "bfloat16")
    for name, t in want.items():
        kind = quant_kind(name) or (EXPERT if name.endswith(("gate_up_proj", "down_proj")) else None)
        if kind is None:  # stored in the release dtype (bf16 / fp32 kept / int64), read back exactly
            assert torch.equal(loaded[name], t.to(release_dtypes[name][1]).to(loaded[name].dtype)), name
        else:
            err = (loaded[name] - t.float()).abs().max()
            assert 0 < err <= (2.0 ** -2 if kind == EXPERT else 2.0 ** -4) * t.abs().max(), name


SMALL_V4 = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "partial_rotary_factor": 0.25,
            "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32, "index_n_heads": 2,
            "index_head_dim": 16, "index_topk": 4, "sliding_window": 8,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}}
SMALL_V41 = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32,
             "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32, "index_n_heads": 2, "index_head_dim": 32,
             "index_topk": 4, "sliding_window": 8, "candidate_topk_blocks": 2, "candidate_block_size": 2,
             "engram_vocab_size": 1009, "engram_head_dim": 32}


@pytest.mark.parametrize("preset", ["v4-flash-4l", "v41-flash-8l"])
def test_streamed_release_equals_the_in_memory_one(preset: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A scaled-down large preset: the streamed, sharded writer (quantizing in small row chunks) gives the same
    tensors, byte for byte, as quantizing the same draws in memory; and it is the float checkpoint quantized."""
    import dsv4.make_model as mm

    monkeypatch.setattr(mm, "_CHUNK_ELEMENTS", 100_000)  # several draw chunks per large tensor
    small = SMALL_V4 if preset == "v4-flash-4l" else SMALL_V41
    config = preset_config(preset, small)
    cfg = parse_config_dict(config)
    qcfg = release_quant("released", cfg)
    in_memory = dict(rel.iter_released(config, qcfg, seed=5, dtype="bfloat16", device="cpu", chunked=True))
    monkeypatch.setattr(rel, "_Q_CHUNK", 4096)  # the streamed writer also quantizes in row chunks
    d = make_model(preset, str(tmp_path / "rel"), seed=5, overrides=small, max_shard_bytes=5_000_000,
                   quant="released")
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) >= 3 and "model.safetensors.index.json" in os.listdir(d)
    with open(os.path.join(d, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    streamed = _read_dir(d)
    assert set(index["weight_map"]) == set(streamed) == set(in_memory)
    assert index["metadata"]["total_size"] == _nbytes(released_layout(cfg, qcfg))
    for name, t in in_memory.items():
        s = streamed[name]
        assert s.dtype == t.dtype and s.shape == t.shape, name
        assert torch.equal(s.view(torch.uint8), t.view(torch.uint8)), name
    float_dir = make_model(preset, str(tmp_path / "float"), seed=5, overrides=small, max_shard_bytes=5_000_000)
    counts = check_release(streamed, _read_dir(float_dir), cfg, qcfg)
    assert counts[DENSE] > 0 and counts[EXPERT] == cfg.num_hidden_layers * 3 * cfg.n_routed_experts


def test_base_format_fp8_experts(tmp_path: Path) -> None:
    float_dir = make_model("tiny-v4", str(tmp_path / "float"), seed=2, drafter=False)  # (the release: no MTP yet)
    d = make_model("tiny-v4", str(tmp_path / "base"), seed=2, quant="released-fp8-experts")
    with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert parse_quant_config(raw) == V4_BASE_RELEASE and raw["expert_dtype"] == "fp8"
    t = _read_dir(d)
    assert t["layers.2.ffn.experts.1.w2.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.2.ffn.experts.1.w2.scale"].dtype == torch.float32
    assert t["layers.2.attn.wq_a.scale"].dtype == torch.float32
    check_release(t, _read_dir(float_dir), load_model_config(d), V4_BASE_RELEASE)
    with pytest.raises(ValueError, match="V4.1-Flash ships MXFP4 experts"):
        make_model("tiny-v41", str(tmp_path / "x"), quant="released-fp8-experts")


# ---- config-only presets and the command ---------------------------------------------------------------------------
def test_config_only_presets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert CONFIG_ONLY_PRESETS == {"v4-flash", "v41-flash"}
    v4, v41 = _cfg("v4-flash"), _cfg("v41-flash")
    assert (v4.num_hidden_layers, v4.hidden_size, v4.n_routed_experts, v4.num_experts_per_tok) == (43, 4096, 256, 6)
    assert v4.compress_ratios == (0, 0) + (4, 128) * 20 + (4,)
    assert v4.mlp_layer_types.count("hash_moe") == 3 and v4.vocab_size == 129280 and v4.index_topk == 512
    assert (v41.num_hidden_layers, v41.hidden_size, v41.n_routed_experts, v41.moe_intermediate_size) == \
        (40, 5120, 384, 2304)
    assert v41.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert v41.v41.kv_source_layer_ids == (2, 8, 14, 20)
    assert v41.v41.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert v41.v41.candidate_source_layer_id == 20 and v41.v41.engram.layer_ids == (1, 14)
    for preset in ("v4-flash", "v41-flash"):
        with pytest.raises(ValueError, match="--load-format dummy"):
            make_model(preset, str(tmp_path / preset))
        assert not os.path.exists(tmp_path / preset)  # refused before anything is written
    assert main(["make-model", "--preset", "v4-flash", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "--config-only" in err and "--load-format dummy" in err and err.count("\n") == 1
    assert main(["make-model", "--preset", "v41-flash", "--out", str(tmp_path / "c"), "--config-only",
                 "--quant", "released"]) == 0
    assert sorted(os.listdir(tmp_path / "c")) == ["config.json", "generation_config.json", "tokenizer.json",
                                                  "tokenizer_config.json"]
    raw = json.loads((tmp_path / "c" / "config.json").read_text())
    assert parse_quant_config(raw) == V41_RELEASE
    assert parse_config_dict(raw).num_hidden_layers == 40
    assert main(["make-model", "--preset", "v4-flash", "--out", str(tmp_path / "f"), "--config-only"]) == 0
    raw = json.loads((tmp_path / "f" / "config.json").read_text())
    assert "quantization_config" not in raw and load_model_config(str(tmp_path / "f")).n_routed_experts == 256


def test_cli_make_model_released(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--preset", "tiny-v4", "--out", str(tmp_path / "r"), "--quant", "released"]) == 0
    assert "released layout" in capsys.readouterr().out
    raw = json.loads((tmp_path / "r" / "config.json").read_text())
    assert parse_quant_config(raw) == V4_RELEASE
    with safe_open(str(tmp_path / "r" / "model.safetensors"), framework="pt") as st:
        assert "layers.0.ffn.experts.7.w3.scale" in st.keys() and "model.embed_tokens.weight" not in st.keys()
    assert main(["make-model", "--preset", "tiny-v41", "--out", str(tmp_path / "x"),
                 "--quant", "released-fp8-experts"]) == 2
