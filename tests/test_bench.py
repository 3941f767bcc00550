"""`dsv4 bench latency` / `bench throughput` on the CPU, the decode floor against hand counts, and the GPU-sized
make-model presets (configs, layouts and sizes; their multi-GB weights are only written scaled down here)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors import safe_open

from dsv4 import LLM, SamplingParams
from dsv4.bench.latency import decode_floor, decode_floor_bytes, expected_distinct_experts, mean_decode_floor
from dsv4.cli import main
from dsv4.quant.config import load_quant_config
from dsv4.make_model import make_model, synthetic_tokenizer
from dsv4.models.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, load_model_config, parse_config_dict
from dsv4.models.engram import EngramLayout, build_compressed_token_map
from dsv4.quant.released import V4_BASE_RELEASE, V4_RELEASE, V41_RELEASE
from dsv4.models.presets import (LARGE_PRESETS, checkpoint_size, preset_config, preset_dtype, tensor_shapes,
                                 v4_tensor_shapes, v41_tensor_shapes)

F32 = 4  # bytes


def _preset_cfg(preset: str) -> ModelConfig:
    return parse_config_dict(preset_config(preset))


# ---- the floor -------------------------------------------------------------------------------------------------
def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(16, 6, 1) == pytest.approx(6)  # one token: exactly its top-k
    assert expected_distinct_experts(16, 6, 2) == pytest.approx(16 * (1 - (10 / 16) ** 2))  # 9.75
    assert expected_distinct_experts(16, 6, 64) == pytest.approx(16, abs=1e-9)  # a big batch hits them all
    assert expected_distinct_experts(8, 8, 3) == 8


def test_floor_tiny_v4_by_hand() -> None:
    # tiny-v4: V 512, D 64, hc 4 (mix 24), H 4 x hd 32, q_lora 32, o 2 x 16, 8 experts of 32 top-2, index 2 x 16
    # top-4, window 16; layers [sliding, CSA/4, HCA/8, CSA/4], MoE [hash, hash, moe, moe]; all fp32.
    cfg = _preset_cfg("tiny-v4")
    batch, ctx = 3, 40
    hc = 2 * (24 * 4 * 64 + 24 + 3)  # attn + ffn mHC: fn, base, scale
    # q_a, q_norm, q_b, kv, kv_norm, o_a, o_b, sinks
    attn = 32 * 64 + 32 + 128 * 32 + 32 * 64 + 32 + 32 * 64 + 64 * 32 + 4
    csa = (64 * 64) * 2 + 4 * 64 + 32 + (32 * 64) * 2 + 4 * 32 + 16 + 32 * 32 + 2 * 64  # compressor + indexer
    hca = (32 * 64) * 2 + 8 * 32 + 32
    mlp = 8 * 64 + 3 * 32 * 64  # router, shared expert
    layer = 2 * 64 + hc + attn + mlp
    top = 512 * 64 + 64 + (4 * 4 * 64 + 4 + 1)  # lm_head, norm, hc_head
    weights = (4 * layer + csa * 2 + hca + 2 * 8 + top) * F32  # + the two moe layers' router bias (8 each)
    weights += batch * 64 * F32 + 2 * batch * 2 * 8  # embedding rows; tid2eid rows (k=2 int64) of 2 hash layers
    experts = 4 * expected_distinct_experts(8, 2, batch) * 3 * 32 * 64 * F32
    rows = 4 * 16 + 2 * min(4, ctx // 4) + ctx // 8  # windows, CSA top-4 of 10 entries twice, HCA's 5 entries
    index_rows = 2 * (ctx // 4)  # each CSA indexer scans its 10 keys
    kv = batch * (rows * 32 + index_rows * 16) * F32
    floor = decode_floor(cfg, batch, ctx, "float32")
    assert floor.weight_bytes == pytest.approx(weights)
    assert floor.expert_bytes == pytest.approx(experts)
    assert floor.kv_bytes == kv == 33408
    assert decode_floor_bytes(cfg, batch, ctx, torch.float32) == pytest.approx(weights + experts + kv)


def test_floor_tiny_v41_by_hand() -> None:
    # tiny-v41: V 512, D 64, H 4 x hd 64, q_lora 32, o 2 x 16, 8 experts of 32 top-2, index 2 x 32 top-4, window 8,
    # ratios [0, 2, 2, 1, 1, 1], KV sources 1 (ratio 2) and 3 (ratio 1), index sources 1, 3, 5, candidate source 3
    # with 2 blocks of 2; engram on layer 1 (n-grams 2..3, 2 heads, rows of 32, 4062 rows); all fp32.
    cfg = _preset_cfg("tiny-v41")
    batch, ctx = 2, 40
    hc = 2 * (24 * 4 * 64 + 24 + 3)
    # wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sink
    attn = 32 * 64 + 32 + 256 * 32 + 64 * 64 + 64 + 32 * 128 + 64 * 32 + 4
    ffn = 8 * 64 + 8 + 8 + 3 * 32 * 64  # router, bias, bias_vl, shared expert
    layer = 2 * 64 + hc + attn + ffn
    compressors = (64 * 64 * 2 + 64) + (64 * 64 + 64)  # source 1 pools pairs (wkv, wgate, norm); source 3 no gate
    indexers = 3 * (64 * 32 + 2 * 64) + 2 * (32 * 64 + 32)  # wq_b, weights_proj at 1, 3, 5; wk, k_norm at 1 and 3
    engram = 5 * 64 * (2 * 2 * 32) + 2 * 4 * 64  # wkv [(hc+1) D, 4 columns of 32], q/k weights
    top = 512 * 64 + 64  # lm_head, norm (V4.1 has no hc_head)
    weights = (6 * layer + compressors + indexers + engram + top) * F32
    weights += batch * 64 * F32 + batch * 2 * 2 * 32 * F32  # embedding rows; engram rows (2 n-gram sizes x 2 heads)
    experts = 6 * expected_distinct_experts(8, 2, batch) * 3 * 32 * 64 * F32
    rows = 6 * 8 + 2 * min(4, ctx // 2) + 3 * min(4, ctx)  # windows; top-4 in the ratio-2 and ratio-1 groups
    index_rows = ctx // 2 + ctx + min(ctx, 2 * 2)  # source 1 scans 20, source 3 (the candidate) 40, layer 5 its 4
    kv = batch * (rows * 64 + index_rows * 32) * F32
    floor = decode_floor(cfg, batch, ctx, "float32")
    assert floor.weight_bytes == pytest.approx(weights)
    assert floor.expert_bytes == pytest.approx(experts)
    assert floor.kv_bytes == kv == 51200


def test_floor_halves_in_bf16_and_grows_with_context() -> None:
    cfg = _preset_cfg("tiny-v41")
    f32, bf16 = decode_floor(cfg, 4, 100, "float32"), decode_floor(cfg, 4, 100, "bfloat16")
    assert bf16.kv_bytes * 2 == f32.kv_bytes and bf16.expert_bytes * 2 == pytest.approx(f32.expert_bytes)
    assert f32.weight_bytes / 2 < bf16.weight_bytes < f32.weight_bytes  # mHC, sinks, router biases stay fp32
    assert decode_floor(cfg, 4, 200, "float32").kv_bytes > f32.kv_bytes
    mean = mean_decode_floor(cfg, 4, 100, 5, "float32")  # decode steps read contexts 101..104
    assert mean.kv_bytes == pytest.approx(sum(decode_floor(cfg, 4, 100 + j, "float32").kv_bytes
                                              for j in range(1, 5)) / 4)


def test_floor_v4_flash_batch1_is_the_issue_figure() -> None:
    # The issue: a V4-Flash-shaped model of 4 layers with 16 experts reads 3.35 GB per batch-1 decode step.
    cfg = _preset_cfg("v4-flash-4l")
    floor = mean_decode_floor(cfg, 1, 512, 128, "bfloat16")
    assert 3.3e9 < floor.total < 3.45e9
    assert floor.expert_bytes == pytest.approx(4 * 6 * 3 * 2048 * 4096 * 2)  # 6 experts in each of 4 layers


def test_floor_with_quant_tiny_by_hand() -> None:
    # The release layout (dsv4.quant.released): FP8 dense linears (1 B per value + one scale per block), MXFP4
    # experts (0.5 B per value + 1 B per 32), FP8 engram rows (+1 B per 32); everything else as in the bf16 floor.
    batch, ctx = 3, 40
    distinct = expected_distinct_experts(8, 2, batch)
    # tiny-v4, 128x128 UE8M0 blocks (every tiny matrix is one block): per layer q_a [32,64], q_b [128,32], kv [32,64],
    # o_a [32,64], o_b [64,32], shared gate/up [32,64] + down [64,32] = 18432 values, 8 blocks; CSA layers 1 and 3:
    # indexer q_b [32,32]. An expert: w1, w3 [32,64] and w2 [64,32] = 3 x (1024 + 64) bytes in MXFP4.
    cfg = _preset_cfg("tiny-v4")
    bf16 = decode_floor(cfg, batch, ctx, "bfloat16")
    q = decode_floor(cfg, batch, ctx, "bfloat16", quant=V4_RELEASE)
    assert q.weight_bytes == bf16.weight_bytes - 4 * (2 * 18432 - (18432 + 8)) - 2 * (2 * 1024 - (1024 + 1))
    assert q.expert_bytes == pytest.approx(4 * distinct * 3 * (1024 + 64))
    assert q.kv_bytes == bf16.kv_bytes
    # the Base format: float32 scales, FP8 experts (w1, w3 and w2 are one 4-byte-scaled block each)
    base = decode_floor(cfg, batch, ctx, "bfloat16", quant=V4_BASE_RELEASE)
    assert base.weight_bytes == bf16.weight_bytes - 4 * (2 * 18432 - (18432 + 8 * 4)) - 2 * (2 * 1024 - (1024 + 4))
    assert base.expert_bytes == pytest.approx(4 * distinct * 3 * (2048 + 4))
    # tiny-v41, 32x32 UE8M0 blocks: per layer wq_a [32,64] (2 blocks), wq_b [256,32] (8), wkv [64,64] (4),
    # wo_a [32,128] (4), wo_b [64,32] (2), shared w1/w3 [32,64] + w2 [64,32] (2 each) = 26624 values, 26 blocks;
    # index sources 1, 3, 5: indexer wq_b [64,32] (2); engram layer 1: wkv [320,128] (40), and the batch's
    # 3 x 2 n-gram sizes x 2 heads rows of the table at 32 + 1 bytes instead of 32 bf16 values.
    cfg = _preset_cfg("tiny-v41")
    bf16 = decode_floor(cfg, batch, ctx, "bfloat16")
    q = decode_floor(cfg, batch, ctx, "bfloat16", quant=V41_RELEASE)
    assert q.weight_bytes == (bf16.weight_bytes - 6 * (2 * 26624 - (26624 + 26)) - 3 * (2 * 2048 - (2048 + 2))
                              - (2 * 40960 - (40960 + 40)) - 12 * (2 * 32 - (32 + 1)))
    assert q.expert_bytes == pytest.approx(6 * distinct * 3 * (1024 + 64))
    assert mean_decode_floor(cfg, batch, 20, 4, "bfloat16", quant=V41_RELEASE) != \
        mean_decode_floor(cfg, batch, 20, 4, "bfloat16")


def test_floor_v4_flash_batch1_bf16_over_release() -> None:
    """V4-Flash at batch 1 (ctx 1024): the routed experts read 64/17 = 3.76x fewer bytes in MXFP4 (17/32 B per value
    vs 2), the dense linears 2 / (1 + 2^-14) fewer in FP8 (every dim a multiple of 128), the rest (lm_head 1.06 GB,
    compressors, indexer weights_proj, router, norms, mHC) and the KV are unchanged. By these counts the whole step
    reads 26.62 / 11.23 GB = 2.37x fewer bytes with the release's weights than with bf16 ones."""
    cfg = _preset_cfg("v4-flash")
    bf16 = decode_floor(cfg, 1, 1024, "bfloat16")
    q = decode_floor(cfg, 1, 1024, "bfloat16", quant=V4_RELEASE)
    experts = 43 * 6 * 3 * 2048 * 4096  # values read: 6 experts per layer
    assert bf16.expert_bytes == pytest.approx(2 * experts) and q.expert_bytes == pytest.approx(experts * 17 / 32)
    D, ql, H, hd, G, ol, I = 4096, 1024, 64, 512, 8, 1024, 2048
    per_layer = ql * D + H * hd * ql + hd * D + G * ol * (H * hd // G) + D * G * ol + 3 * I * D
    dense = 43 * per_layer + 21 * (64 * 128 * ql)  # + the indexer query projection of the 21 CSA layers
    assert q.weight_bytes == bf16.weight_bytes - 2 * dense + dense * (1 + 2 ** -14)
    assert q.kv_bytes == bf16.kv_bytes
    assert bf16.total / q.total == pytest.approx(2.3707, abs=1e-4)


@pytest.mark.parametrize("preset,world", [("v4-flash-4l", 2), ("v41-flash-8l", 2), ("v41-flash-8l", 4),
                                          ("tiny-v41", 2)])
def test_per_rank_floor_is_what_the_sharded_model_drops(preset: str, world: int) -> None:
    """One rank's floor under tensor/expert parallelism, against the module rank 0 actually builds (meta device, so
    free): the non-expert weights it reads shrink by exactly the elements its sharding removed (all fp32 here; the
    embedding is read as the batch's rows, so its part shrinks by half of those), the routed experts by 1/world,
    and the KV not at all (the single KV head is replicated)."""
    from dsv4.distributed import Parallel, shard_attention, shard_experts, shard_vocab
    from dsv4.models.deepseek_v4 import DeepseekV4ForCausalLM
    from dsv4.models.deepseek_v41 import DeepseekV41ForCausalLM

    cfg = _preset_cfg(preset)
    cls = DeepseekV41ForCausalLM if cfg.v41 is not None else DeepseekV4ForCausalLM
    with torch.device("meta"):
        full, rank0 = cls(cfg), cls(cfg)
    par = Parallel(0, world, None)
    shard_experts(rank0, par), shard_vocab(rank0, par), shard_attention(rank0, par)
    kept = dict(rank0.named_parameters())
    dropped = embed_rows_dropped = 0
    for name, p in full.named_parameters():
        if "experts" in name.split(".") or name.startswith("vision"):  # routed experts: counted apart; no encoder
            continue
        gone = p.numel() - kept[name].numel()
        if name in ("model.embed.weight", "model.embed_tokens.weight"):
            embed_rows_dropped = gone // p.shape[1]
            continue
        dropped += gone
    batch = 3
    one, mine = decode_floor(cfg, batch, 300, "float32"), decode_floor(cfg, batch, 300, "float32", world)
    assert dropped > 0 and embed_rows_dropped == cfg.vocab_size - cfg.vocab_size // world
    embed_row = cfg.hidden_size * F32
    assert one.weight_bytes - mine.weight_bytes == pytest.approx(
        dropped * F32 + batch * embed_row * (1 - 1 / world))
    assert mine.expert_bytes == pytest.approx(one.expert_bytes / world)
    assert mine.kv_bytes == one.kv_bytes
    assert decode_floor(cfg, batch, 300, "float32", 1) == one


# ---- the presets ----------------------------------------------------------------------------------------------
def test_v4_flash_config() -> None:
    cfg = _preset_cfg("v4-flash-4l")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (4096, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size) == (1024, 8, 1024, 2048)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (16, 6, 1)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (64, 128, 512, 128)
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA) and cfg.compress_ratios == (0, 0, 4, 128)
    assert cfg.mlp_layer_types == (HASH_MOE, HASH_MOE, HASH_MOE, MOE) and cfg.vocab_size == 129280
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.original_max_position_embeddings == 65536
    shapes = v4_tensor_shapes(cfg, "bfloat16")
    assert shapes["model.layers.3.mlp.experts.gate_up_proj"] == ((16, 4096, 4096), torch.bfloat16)
    assert shapes["model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"][0] == (64 * 128, 1024)
    assert shapes["model.layers.0.mlp.gate.tid2eid"] == ((129280, 6), torch.int64)
    # By hand: bf16 (2 bytes) except mHC, sinks, position biases, router bias (fp32) and tid2eid (int64).
    V, D, mix, H, hd, ql, G, ol, E, I, k, IH, ihd = 129280, 4096, 24, 64, 512, 1024, 8, 1024, 16, 2048, 6, 64, 128
    bf16 = 2 * V * D + D + 4 * (2 * D + ql * D + ql + H * hd * ql + hd * D + hd + G * ol * (H * hd // G)
                                + D * G * ol + E * D + (E + 1) * 3 * I * D)
    bf16 += 2 * (2 * hd * D) + hd + 2 * (2 * ihd * D) + ihd + IH * ihd * ql + IH * D  # CSA layer 2
    bf16 += 2 * (hd * D) + hd  # HCA layer 3
    fp32 = (4 * 4 * D + 4 + 1) + 4 * (2 * (mix * 4 * D + mix + 3) + H)  # hc_head; per layer mHC, sinks
    fp32 += 4 * 2 * hd + 4 * 2 * ihd + 128 * hd + E  # position biases (CSA kv + indexer, HCA); layer 3 router bias
    int64 = 3 * V * k
    assert checkpoint_size(shapes) == (bf16 + fp32 + int64, 2 * bf16 + 4 * fp32 + 8 * int64)
    assert 6.47e9 < checkpoint_size(shapes)[1] < 6.48e9
    assert preset_dtype("v4-flash-4l") == "bfloat16" and preset_dtype("tiny-v4") == "float32"


def test_v41_flash_config() -> None:
    cfg = _preset_cfg("v41-flash-8l")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (5120, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size) == (1280, 8, 1024, 2304)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.index_n_heads, cfg.index_topk) == (16, 6, 32, 512)
    assert cfg.compress_ratios == (0, 2, 2, 2, 1, 1, 1, 1) and cfg.rms_norm_eps == 1e-20
    v41 = cfg.v41
    assert v41.kv_source_layer_ids == (1, 4) and v41.index_source_layer_ids == (1, 4, 6)
    assert (v41.candidate_source_layer_id, v41.candidate_topk_blocks, v41.candidate_block_size) == (4, 2048, 8)
    eng = v41.engram
    assert eng.layer_ids == (1,) and (eng.max_ngram_size, eng.n_heads, eng.head_dim) == (4, 8, 256)
    # The engram sizes are the synthetic 129280-id tokenizer's, as the engine will recompute them.
    backend = synthetic_tokenizer(129280)
    assert backend.get_vocab_size(with_added_tokens=True) == 129280
    _, size = build_compressed_token_map(backend)
    assert eng.compressed_vocab_size == size
    assert eng.num_embeddings == (EngramLayout.from_config([1], 100003, 4, 8, size).rows[1],)
    shapes = v41_tensor_shapes(cfg, "bfloat16")
    assert shapes["model.layers.1.engram.embed.weight"] == ((eng.num_embeddings[0], 256), torch.bfloat16)
    assert shapes["model.layers.5.ffn.experts.15.w1.weight"] == ((2304, 5120), torch.bfloat16)
    assert "model.layers.5.attn.compressor.wkv.weight" not in shapes  # a consumer owns no compressor
    assert shapes["model.layers.4.attn.indexer.wk.weight"][0] == (128, 512)
    params, nbytes = checkpoint_size(shapes)
    assert 15.9e9 < nbytes < 16.1e9 and 7.9e9 < params < 8.0e9
    noengram = _preset_cfg("v41-flash-8l-noengram")
    assert noengram.v41.engram is None
    assert checkpoint_size(tensor_shapes(noengram, "bfloat16"))[1] < 14.5e9
    assert {"v4-flash-4l", "v41-flash-8l", "v41-flash-8l-noengram"} == LARGE_PRESETS


# Same schedules, kinds and vocabulary; widths of the tiny presets, so the streamed writer runs in seconds.
SMALL_V4 = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "partial_rotary_factor": 0.25,
            "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32, "index_n_heads": 2,
            "index_head_dim": 16, "index_topk": 4, "sliding_window": 8,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}}
SMALL_V41 = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32,
             "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32, "index_n_heads": 2, "index_head_dim": 32,
             "index_topk": 4, "sliding_window": 8, "candidate_topk_blocks": 2, "candidate_block_size": 2,
             "engram_vocab_size": 1009, "engram_head_dim": 32}


def _disk_shapes(model_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with open(os.path.join(model_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(model_dir, file), framework="pt") as st:
            for k in st.keys():
                assert index["weight_map"][k] == file
                out[k] = (tuple(st.get_slice(k).get_shape()), st.get_tensor(k).dtype)
    return out


def _read(model_dir: str, name: str) -> torch.Tensor:
    with open(os.path.join(model_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
        file = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(model_dir, file), framework="pt") as st:
        return st.get_tensor(name)


@pytest.mark.parametrize("preset", ["v4-flash-4l", "v41-flash-8l"])
def test_scaled_down_preset_writes_shards_and_loads(preset: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import dsv4.make_model as mm

    monkeypatch.setattr(mm, "_CHUNK_ELEMENTS", 100_000)  # several chunks per large tensor
    small = SMALL_V4 if preset == "v4-flash-4l" else SMALL_V41
    d = make_model(preset, str(tmp_path / "a"), seed=0, overrides=small, max_shard_bytes=10_000_000)
    cfg = load_model_config(d)
    assert cfg.vocab_size == 129280 and cfg.torch_dtype == "bfloat16"
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert _disk_shapes(d) == tensor_shapes(cfg, "bfloat16")
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    if preset == "v4-flash-4l":
        tid2eid = _read(d, "model.layers.0.mlp.gate.tid2eid")
        assert all(len(set(row.tolist())) == 6 for row in tid2eid[:100]) and tid2eid.max() < 16
        q_b = _read(d, "model.layers.1.self_attn.q_b_proj.weight")
        norm = _read(d, "model.layers.1.input_layernorm.weight")
    else:
        q_b, norm = _read(d, "model.layers.1.attn.wq_b.weight"), _read(d, "model.layers.1.attn_norm.weight")
        assert 0.9 < _read(d, "model.layers.1.engram.embed.weight").float().std() < 1.1
    assert 0.018 < q_b.float().std() < 0.022 and abs(q_b.float().mean()) < 1e-3
    assert torch.equal(norm, torch.ones_like(norm))
    # The engine loads it (bf16 on the CPU) and generates.
    out = LLM(model=d, device="cpu", dtype="bfloat16").generate(
        [list(range(100, 130))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # Deterministic given the seed; another seed draws other weights.
    again = make_model(preset, str(tmp_path / "b"), seed=0, overrides=small, max_shard_bytes=10_000_000)
    other = make_model(preset, str(tmp_path / "c"), seed=1, overrides=small, max_shard_bytes=10_000_000)
    for f in files:
        same = Path(d, f).read_bytes()
        assert same == Path(again, f).read_bytes()
        assert same != Path(other, f).read_bytes()


def test_scaled_down_v4_flash_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = make_model("v4-flash-4l", str(tmp_path), seed=0, overrides=SMALL_V4, max_shard_bytes=10_000_000)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_tiny_presets_keep_the_single_file_writer(tmp_path: Path) -> None:
    d = make_model("tiny-v4", str(tmp_path / "t"))
    assert "model.safetensors" in os.listdir(d) and "model.safetensors.index.json" not in os.listdir(d)
    assert synthetic_tokenizer().to_str() == tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json")).to_str()


# ---- the commands ---------------------------------------------------------------------------------------------
LATENCY_FIELDS = {"benchmark", "model", "model_type", "date", "device", "device_name", "torch", "triton", "cuda",
                  "python", "command", "switches", "dtype", "batch_size", "input_len", "output_len", "num_iters",
                  "num_iters_warmup", "enforce_eager", "engine_kwargs", "ignored_engine_kwargs", "decode_step_s",
                  "decode_steps", "decode_step_times_s", "decode_tokens_per_s", "prefill_s", "e2e_s", "floor_bytes",
                  "floor", "copy_bytes", "copy_bandwidth_Bps", "floor_time_s", "fraction_of_floor", "achieved_Bps",
                  "hf", "decode_host_launch_s", "decode_metadata_host_s", "decode_backend", "tensor_parallel_size",
                  "quantization", "load_format", "model_load_s", "weight_bytes_on_device", "max_memory_allocated",
                  "json_schema", "memory", "weight_plan", "spec_decode", "prefill_time_s", "prefill_cached_tokens",
                  "prefill_tokens", "prefill_tokens_per_s", "prefill_flops", "prefill_flops_by_component",
                  "prefill_tflops_per_s", "peak_tflops_per_s", "peak_source", "prefill_fraction_of_peak"}


def test_results_record_the_dsv4_switches_but_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A results file says which DSV4_* switches were set (they change what was measured), never the API key."""
    from dsv4.bench.latency import switches

    monkeypatch.setenv("DSV4_SORTED_EXPERTS", "1")
    monkeypatch.setenv("DSV4_API_KEY", "secret")
    monkeypatch.setenv("NOT_DSV4_SORTED", "1")
    got = switches()
    assert got.get("DSV4_SORTED_EXPERTS") == "1" and "DSV4_API_KEY" not in got and "NOT_DSV4_SORTED" not in got
    assert "secret" not in json.dumps(got)


@pytest.mark.parametrize("which", ["tiny-v4", "tiny-v41"])
def test_bench_latency_end_to_end(which: str, tiny_v4: str, tiny_v41: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_v4 if which == "tiny-v4" else tiny_v41
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", model, "--batch-size", "3", "--input-len", "20", "--output-len", "5",
            "--num-iters", "2", "--device", "cpu", "--copy-bytes", str(16 << 20), "--output-json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "decode step (ms)" in table and "fraction of floor" in table
    res = json.loads(out.read_text())
    assert set(res) == LATENCY_FIELDS
    assert res["decode_steps"] == 2 * (5 - 1) == len(res["decode_step_times_s"])  # one prefill step per batch
    assert set(res["decode_step_s"]) == {"median", "mean", "p90", "min", "max"}
    assert res["decode_step_s"]["min"] <= res["decode_step_s"]["median"] <= res["decode_step_s"]["max"]
    cfg = load_model_config(model)
    floor = mean_decode_floor(cfg, 3, 20, 5, "float32")
    assert res["floor_bytes"] == pytest.approx(floor.total) and res["floor"]["total"] == res["floor_bytes"]
    assert set(res["floor"]) == {"weight_bytes", "expert_bytes", "kv_bytes", "total"}
    assert res["copy_bandwidth_Bps"] > 0 and 0 < res["fraction_of_floor"]
    assert res["fraction_of_floor"] == pytest.approx(res["floor_time_s"] / res["decode_step_s"]["median"])
    assert res["engine_kwargs"]["max_num_seqs"] == 3 and res["hf"] is None
    assert res["command"].startswith("dsv4 bench latency --model")
    # host time to launch a decode step, and the metadata build inside it (on the CPU the whole step is host time)
    h, m = res["decode_host_launch_s"], res["decode_metadata_host_s"]
    assert 0 < m["median"] < h["median"] <= res["decode_step_s"]["max"] and res["decode_backend"] == "default"
    assert res["spec_decode"] is None


def test_bench_latency_with_speculative_decoding(tiny_v41: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative-config (tiny-v41's random DSpark drafter): acceptance counters of the timed batches, the
    acceptance length and output tokens per second per request; a decode step then emits 1..k+1 tokens a request."""
    out = tmp_path / "lat.json"
    b, o, iters, k = 2, 9, 2, 3
    argv = ["bench", "latency", "--model", tiny_v41, "--batch-size", str(b), "--input-len", "10", "--output-len",
            str(o), "--num-iters", str(iters), "--device", "cpu", "--copy-bytes", str(1 << 20), "--output-json",
            str(out), "--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": k})]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "acceptance length" in table and "tokens/s per request" in table
    res = json.loads(out.read_text())
    assert set(res) == LATENCY_FIELDS and res["engine_kwargs"]["async_scheduling"] is False
    sd = res["spec_decode"]
    assert sd["speculative_config"] == {"method": "dspark", "num_speculative_tokens": k, "disable_by_batch_size": 32,
                                        "verify_decode": True, "drafter_cuda_graphs": True,
                                        "adaptive": False}
    # the timed batches only (the warm-up batch drafted too): every request emits o - 1 tokens after its prefill,
    # each verify step its accepted drafts and one more
    emitted = iters * b * (o - 1)
    assert 0 < sd["num_drafts"] <= emitted and sd["num_drafts"] <= sd["num_draft_tokens"] <= k * sd["num_drafts"]
    assert sd["num_drafts"] + sd["num_accepted_tokens"] <= emitted
    assert len(sd["num_accepted_tokens_per_pos"]) == k and sum(sd["num_accepted_tokens_per_pos"]) == \
        sd["num_accepted_tokens"]
    assert sd["acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert sd["acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
    # decode steps: the whole batch decodes; their tokens over their time
    assert 0 < res["decode_steps"] <= iters * (o - 1) and b * res["decode_steps"] <= sd["decode_tokens"] <= emitted
    assert sd["output_tokens_per_s"] == pytest.approx(sd["decode_tokens"] / sum(res["decode_step_times_s"]))
    assert sd["output_tokens_per_s_per_request"] == pytest.approx(sd["output_tokens_per_s"] / b)
    assert res["decode_tokens_per_s"] == sd["output_tokens_per_s"]


def test_bench_throughput_with_speculative_decoding(tiny_v41: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_v41, "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "6", "--max-num-seqs", "4", "--device", "cpu", "--temperature", "0",
                 "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 2}',
                 "--output-json", str(out)]) == 0
    assert "acceptance length" in capsys.readouterr().out
    res = json.loads(out.read_text())
    sd = res["spec_decode"]
    assert res["output_tokens"] == 3 * 6 and 0 < sd["num_drafts"] <= 3 * 5
    assert sd["num_drafts"] <= sd["num_draft_tokens"] <= 2 * sd["num_drafts"]
    assert sd["acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])


def test_bench_latency_with_a_json_schema(tiny_v41: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # structured outputs: every request is constrained to the schema; the committed schema cannot close within the
    # output, so every step after the prefill is a full-batch decode step, as without a schema
    pytest.importorskip("xgrammar")
    import re

    from dsv4.bench.latency import run_batch

    schema_path = Path(__file__).parent.parent / "benchmarks" / "schemas" / "long_text.json"
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", tiny_v41, "--batch-size", "3", "--input-len", "12", "--output-len", "6",
            "--num-iters", "1", "--num-iters-warmup", "0", "--device", "cpu", "--copy-bytes", str(1 << 20),
            "--json-schema", str(schema_path), "--output-json", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["json_schema"] == json.loads(schema_path.read_text()) and res["decode_steps"] == 6 - 1
    # what the bench's requests produce does follow the schema (not what the random model would write unconstrained)
    llm = LLM(tiny_v41, device="cpu", dtype="float32", max_num_seqs=2)
    _, tokens = run_batch(llm.engine, [[5, 6, 7], [8, 9]], 12, torch.device("cpu"), "t", res["json_schema"])
    for t in tokens:
        assert len(t) == 12 and re.match(r'\{\s*"title"\s*:\s*"', llm.engine.tokenizer.decode(t)), t


def test_bench_latency_floor_follows_the_quantization(tiny_v4: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # the floor assumes the weight format the engine runs: the checkpoint's quantization_config unless overridden
    released = make_model("tiny-v4", str(tmp_path / "rel"), seed=0, quant="released")
    assert load_quant_config(released) == V4_RELEASE and load_quant_config(released, "none") is None
    assert load_quant_config(tiny_v4) is None
    out = tmp_path / "lat.json"
    argv = ["bench", "latency", "--model", released, "--batch-size", "2", "--input-len", "8", "--output-len", "3",
            "--num-iters", "1", "--num-iters-warmup", "0", "--device", "cpu", "--copy-bytes", str(1 << 20),
            "--quantization", "none", "--output-json", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    res = json.loads(out.read_text())
    cfg = load_model_config(released)
    assert res["quantization"] is None and res["engine_kwargs"]["quantization"] == "none"
    assert res["floor_bytes"] == pytest.approx(mean_decode_floor(cfg, 2, 8, 3, "float32").total)


def test_bench_latency_hf_baseline(tiny_v4: str, tiny_v41: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny_v4, "--batch-size", "2", "--input-len", "12", "--output-len",
                 "4", "--num-iters", "1", "--num-iters-warmup", "0", "--device", "cpu", "--baseline", "hf",
                 "--copy-bytes", str(16 << 20), "--output-json", str(out)]) == 0
    assert "speedup vs HF" in capsys.readouterr().out
    hf = json.loads(out.read_text())["hf"]
    assert set(hf) == {"decode_step_s", "decode_step_times_s", "fraction_of_floor", "speedup", "matching_sequences"}
    assert len(hf["decode_step_times_s"]) == 3 and hf["speedup"] > 0
    assert hf["matching_sequences"] == 2  # fp32: the engine's greedy tokens are transformers'
    assert main(["bench", "latency", "--model", tiny_v41, "--baseline", "hf", "--device", "cpu"]) == 2
    assert "DeepSeek-V4 checkpoint" in capsys.readouterr().err


def test_bench_throughput_end_to_end(tiny_v41: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", "--model", tiny_v41, "--num-prompts", "5", "--input-len", "16",
                 "--output-len", "4", "--max-num-seqs", "4", "--device", "cpu", "--output-json", str(out)]) == 0
    assert "output tokens/s" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert {"requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s", "prompt_tokens",
            "output_tokens", "num_prompts", "input_len", "output_len", "command", "torch", "device_name"} <= set(res)
    assert res["output_tokens"] == 5 * 4 and res["prompt_tokens"] == 5 * 16
    assert res["output_tokens_per_s"] == pytest.approx(20 / res["elapsed_s"])
    assert res["total_tokens_per_s"] == pytest.approx(100 / res["elapsed_s"])
    assert math.isclose(res["requests_per_s"] * res["elapsed_s"], 5)
    assert res["spec_decode"] is None


@pytest.mark.parametrize("mode", ["bounded", "exact", "off"])
def test_bench_chat_end_to_end(mode: str, tiny_v41: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A resent 4-turn chat: with prefix caching every later turn hits the earlier turns (whole units of the
    cache, at most the prompt minus one token); without it nothing is cached."""
    out = tmp_path / "chat.json"
    assert main(["bench", "chat", "--model", tiny_v41, "--turns", "4", "--turn-len", "20", "--output-len", "4",
                 "--prefix-caching", mode, "--block-size", "4", "--device", "cpu", "--output-json", str(out)]) == 0
    assert "TTFT median turns 2+" in capsys.readouterr().out
    res = json.loads(out.read_text())
    turns = res["per_turn"]
    assert [t["prompt_tokens"] for t in turns] == [20, 44, 68, 92]
    assert turns[0]["cached_tokens"] == 0
    for t in turns[1:]:
        if mode == "off":
            assert t["cached_tokens"] == 0
        else:  # the previous turn's prompt and reply, in units of lcm(4, 8) = 8 tokens
            assert t["prompt_tokens"] - 24 - 8 < t["cached_tokens"] <= t["prompt_tokens"] - 1
            assert t["cached_tokens"] % 8 == 0
    assert all(t["ttft_s"] > 0 for t in turns) and res["ttft_median_s"] > 0


def test_bench_rejects_bad_lengths(tiny_v4: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "latency", "--model", tiny_v4, "--output-len", "1", "--device", "cpu"]) == 2
    assert "--output-len >= 2" in capsys.readouterr().err


def test_command_line_reproduces_list_and_flag_options() -> None:
    """The recorded command parses back to the same options (lists as separate words, flags bare)."""
    import argparse

    from dsv4.bench.latency import add_cli_args, command_line

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    argv = ["--model", "/m", "--batch-size", "4", "--cudagraph-capture-sizes", "1", "4", "--compile-decode"]
    args = parser.parse_args(argv)
    line = command_line(args)
    assert "--cudagraph-capture-sizes 1 4" in line and "--compile-decode" in line and "[" not in line
    again = parser.parse_args(line.split()[1:])
    assert vars(again) == vars(args)
