"""The prefill FLOP model (dsv4.bench.flops) against independent counts, and the prefill fields of `bench latency` /
`bench throughput`.

Independent counts: torch's FlopCounterMode over a real prefill of the tiny presets on the CPU, per module, for what
it counts (matmuls: the dense projections, the experts, the compressor and engram projections, the mHC mixes, the
heads); by hand, one query position at a time, for the rest (attention and indexer keys, pooling, elementwise mHC
terms). Intentional differences, checked exactly: the model counts some elementwise multiply-adds torch does not
see as matmuls (mHC collapse and post * y, compressor pooling, the engram gate), and the engine's torch path attends
and scores padded key rows (every window slot, every entry slot of the step) where the model counts visible keys
only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from dsv4 import LLM, SamplingParams
from dsv4.bench.flops import (H200_BF16_DENSE_FLOPS, H200_FP8_DENSE_FLOPS, H200_FP32_FLOPS, PrefillFlops,
                              flop_rate_report, peak_flops, prefill_flops)
from dsv4.bench.throughput import prefill_work
from dsv4.cli import main
from dsv4.models.config import CSA, HCA, ModelConfig, load_model_config, parse_config_dict
from dsv4.models.layers.merged import V4_COMPRESSOR_CSA, V4_COMPRESSOR_HCA, merged_name
from dsv4.models.presets import preset_config
from dsv4.step import CachedRequestData, NewRequestData, SchedulerOutput

COMPONENTS = ("dense", "attention", "indexer", "compressor", "moe", "engram", "mhc", "lm_head")


def _cfg(preset: str, **overrides: object) -> ModelConfig:
    return parse_config_dict(preset_config(preset, overrides or None))


# ---- by hand, one query position at a time -------------------------------------------------------------------------
def _restricted(cfg: ModelConfig, layer: int) -> bool:
    """V4.1: the layer's index source searches inside the candidate source's pool."""
    v41 = cfg.v41
    src = v41.index_source_of(layer)
    return src is not None and 0 <= v41.candidate_source_layer_id < src


def _has_indexer(cfg: ModelConfig, layer: int) -> bool:
    if cfg.v41 is None:
        return cfg.layer_types[layer] == CSA
    return cfg.compress_ratios[layer] > 0 and layer in cfg.v41.index_source_layer_ids


def by_hand(cfg: ModelConfig, S: int, B: int) -> dict[str, int]:
    """The module doc's counts, written as loops over layers and query positions (not the closed forms)."""
    D, N, V, H, d = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    ql, G, ol, E, I, k = (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts,
                          cfg.moe_intermediate_size, cfg.num_experts_per_tok)
    IH, di, W, K = cfg.index_n_heads, cfg.index_head_dim, cfg.sliding_window, cfg.index_topk
    v41 = cfg.v41
    out = dict.fromkeys(COMPONENTS, 0)
    for layer in range(cfg.num_hidden_layers):
        m = cfg.compress_ratios[layer]
        out["dense"] += S * (2 * D * ql + 2 * ql * H * d + 2 * D * d + G * 2 * (H * d // G) * ol + 2 * G * ol * D)
        if _has_indexer(cfg, layer):
            out["dense"] += S * (2 * ql * IH * di + 2 * D * IH)
        pool = None
        if v41 is not None and m > 0 and _restricted(cfg, layer):
            pool = v41.candidate_topk_blocks * v41.candidate_block_size
        for t in range(S):
            keys = min(W, t + 1)  # the window, the query's own token included
            if m > 0:
                visible = (t + 1) // m
                if v41 is None:
                    keys += visible if cfg.layer_types[layer] == HCA else min(K, visible)
                else:
                    keys += min(K, visible, pool) if pool is not None else min(K, visible)
                if _has_indexer(cfg, layer):
                    out["indexer"] += 2 * IH * di * (min(visible, pool) if pool is not None else visible)
            out["attention"] += 2 * H * d * keys * 2  # QK^T, then PV
        entries = S // m if m else 0
        if v41 is None and m > 0:
            csa = cfg.layer_types[layer] == CSA
            series = 2 if csa else 1
            out["compressor"] += S * 2 * (2 * D * series * d)  # kv_proj, gate_proj
            out["compressor"] += entries * 2 * (series * m) * d  # pooling series * m rows
            if csa:
                out["compressor"] += S * 2 * (2 * D * 2 * di) + entries * 2 * (2 * m) * di  # the indexer's compressor
        elif v41 is not None and layer in v41.kv_source_layer_ids:
            out["compressor"] += S * 2 * D * d * (2 if m == 2 else 1) + entries * 2 * d * di
            out["compressor"] += entries * 2 * m * d if m > 1 else 0
        out["moe"] += S * (2 * D * E + (k + 1) * (2 * D * 2 * I + 2 * I * D))
        out["mhc"] += S * 2 * (2 * N * D * (2 + N) * N + 2 * N * D + 2 * N * D + 2 * N * N * D)
        if v41 is not None and v41.engram is not None and layer in v41.engram.layer_ids:
            e = v41.engram
            out["engram"] += S * (2 * (e.max_ngram_size - 1) * e.n_heads * e.head_dim * (N + 1) * D + 4 * N * D)
    out["mhc"] += S * (2 * N * D + (2 * N * N * D if v41 is None else 0))
    out["lm_head"] = 2 * D * V
    return {name: value * B for name, value in out.items()}


@pytest.mark.parametrize("preset, overrides, S", [
    ("tiny-v4", {}, 57), ("tiny-v41", {}, 57), ("v4-flash-4l", {}, 300), ("v41-flash-8l", {}, 300),
    # a candidate pool (1 block of 2 entries) smaller than index_topk (4): the re-index source and its consumers
    ("tiny-v41", {"candidate_topk_blocks": 1}, 33),
    # the released schedule past the window and past one candidate pool of 2048 x 8 entries (ratio 1 layers)
    ("v41-flash", {"candidate_topk_blocks": 4}, 77),
])
def test_flops_by_hand(preset: str, overrides: dict, S: int) -> None:
    cfg = _cfg(preset, **overrides)
    f = prefill_flops(cfg, S, 3)
    assert f.to_json() == {**by_hand(cfg, S, 3), "total": f.total}


def test_v4_flash_figure_and_peaks() -> None:
    """The released V4-Flash at 4096 tokens: about 2 x 13B active parameters x tokens, plus attention."""
    f = prefill_flops(_cfg("v4-flash"), 4096, 1)
    assert 100e12 < f.total < 125e12 and f.moe > f.dense > f.attention > f.indexer > 0 and f.engram == 0
    assert H200_BF16_DENSE_FLOPS == 989.5e12 and H200_FP8_DENSE_FLOPS == 1979e12 and H200_FP32_FLOPS == 67e12
    assert peak_flops("bfloat16")[0] == peak_flops("float16")[0] == H200_BF16_DENSE_FLOPS
    assert peak_flops("float32")[0] == H200_FP32_FLOPS
    r = flop_rate_report(f, 0.5, "bfloat16", world=2)
    assert r["prefill_tflops_per_s"] == pytest.approx(f.total / 0.5 / 1e12)
    assert r["peak_tflops_per_s"] == pytest.approx(2 * 989.5)
    assert r["prefill_fraction_of_peak"] == pytest.approx(f.total / 0.5 / (2 * 989.5e12))
    assert flop_rate_report(f, 1.0, "bfloat16", peak_tflops=100.0)["prefill_fraction_of_peak"] == \
        pytest.approx(f.total / 100e12)


# ---- scaling ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["v4-flash", "v41-flash"])
def test_scaling_in_tokens_and_batch(preset: str) -> None:
    cfg = _cfg(preset)
    S = 8192
    one, two = prefill_flops(cfg, S, 1), prefill_flops(cfg, 2 * S, 1)
    for name in ("dense", "moe", "mhc", "engram"):  # per token: exactly linear
        assert getattr(two, name) == 2 * getattr(one, name)
    assert two.lm_head == one.lm_head == 2 * cfg.hidden_size * cfg.vocab_size  # one sampled token per request
    assert 1.99 < two.compressor / one.compressor <= 2.0  # per token and per entry (floor(S / m) entries)
    assert 3.95 < two.indexer / one.indexer < 4.05  # tokens x visible entries: quadratic
    assert 2.0 < two.attention / one.attention < 4.0  # window and top-k linear, V4 HCA's all entries quadratic
    # strictly increasing, token by token, in every component that grows with the prompt
    prev = prefill_flops(cfg, 2000, 1)
    for s in range(2001, 2010):
        cur = prefill_flops(cfg, s, 1)
        assert cur.total > prev.total and cur.attention > prev.attention and cur.indexer >= prev.indexer
        prev = cur
    # batch: exactly linear, component by component
    assert prefill_flops(cfg, 1000, 5).to_json() == prefill_flops(cfg, 1000, 1).scaled(5).to_json()
    assert prefill_flops(cfg, 0, 3).total == 0 and prefill_flops(cfg, 1000, 0).total == 0


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41", "v41-flash"])
def test_chunks_add_up_to_the_one_shot_prefill(preset: str) -> None:
    """Chunked prefill and prefix hits: positions [a, b) over a cached prefix of a tokens, lm_head at the end only."""
    cfg = _cfg(preset)
    S, cuts = 301, [0, 7, 8, 64, 129, 250, 301]
    parts = [prefill_flops(cfg, b, 2, context_len=a, sample=b == S) for a, b in zip(cuts, cuts[1:])]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    assert total == prefill_flops(cfg, S, 2)
    with pytest.raises(ValueError):
        prefill_flops(cfg, 10, 1, context_len=11)


# ---- FlopCounterMode over a real prefill --------------------------------------------------------------------------
def _measured(counts: dict[str, dict], pattern: str) -> int:
    """Sum of the FLOPs torch counted in the modules whose path (root class stripped) matches `pattern`."""
    rx = re.compile(pattern)
    return sum(sum(v.values()) for k, v in counts.items() if "." in k and rx.fullmatch(k.split(".", 1)[1]))


@pytest.mark.parametrize("which", ["tiny-v4", "tiny-v41"])
def test_flops_against_flop_counter(which: str, tiny_v4: str, tiny_v41: str) -> None:
    model = tiny_v4 if which == "tiny-v4" else tiny_v41
    cfg = load_model_config(model)
    B, S = 2, 40
    llm = LLM(model, device="cpu", dtype="float32", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [10 + (7 * i + j) % 400 for j in range(S)]} for i in range(B)]
    with FlopCounterMode(display=False) as fc:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))  # one prefill step, one sample each
    counts = fc.get_flop_counts()
    f = prefill_flops(cfg, S, B)
    L, R = cfg.num_hidden_layers, B * S
    D, N, H, d, ol = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim, cfg.o_lora_rank
    v41 = cfg.v41
    if v41 is None:
        attn, ffn = r"model\.layers\.\d+\.self_attn", r"model\.layers\.\d+\.mlp"
        # q_a_proj_kv_proj: the two merged into one module (dsv4.models.layers.merged); so are a compressor's kv /
        # gate (HCA) or those with its indexer's kv / gate and head weights (CSA), whose head weights are dense
        dense = attn + r"\.(q_a_proj|q_b_proj|kv_proj|q_a_proj_kv_proj|o_b_proj|compressor\.indexer\.q_b_proj" \
                       r"|compressor\.indexer\.scorer\.weights_proj)"
        merged_csa = merged_name(V4_COMPRESSOR_CSA)
        comp = attn + rf"\.compressor\.(kv_proj|gate_proj|indexer\.kv_proj|indexer\.gate_proj" \
                      rf"|{merged_name(V4_COMPRESSOR_HCA)}|{merged_csa})"
    else:
        attn, ffn = r"model\.layers\.\d+\.attn", r"model\.layers\.\d+\.ffn"
        dense = attn + r"\.(wq_a|wq_b|wkv|wq_a_wkv|wo_b|indexer\.wq_b|indexer\.weights_proj)"
        comp = attn + r"\.(compressor|indexer\.wk)"  # ratio 2: F.linear in the compressor; ratio 1: its wkv
    dense_m, comp_m = _measured(counts, dense), _measured(counts, comp)
    if v41 is None and _measured(counts, attn + rf"\.compressor\.{merged_csa}"):
        # the head weights' share of each merged CSA compressor product is dense work
        heads = sum(cfg.layer_types[i] == CSA for i in range(L)) * 2 * R * D * cfg.index_n_heads
        dense_m, comp_m = dense_m + heads, comp_m - heads
    attn_m, ffn_m = _measured(counts, attn), _measured(counts, ffn)
    layer_m = _measured(counts, r"model\.layers\.\d+")
    head_m = _measured(counts, r"model\.hc_head")
    engram_m = _measured(counts, r"model\.layers\.\d+\.engram")
    assert _measured(counts, r"lm_head") == f.lm_head == B * 2 * D * cfg.vocab_size  # the last row of each prompt
    assert ffn_m == f.moe  # router, the routed rows' experts (the CPU path runs exactly those), the shared expert
    o_a = L * 2 * R * H * d * ol  # the grouped o_a is a bmm inside the attention module
    assert dense_m + o_a == f.dense
    # pooling is elementwise in torch (a weighted sum after a softmax)
    pooling = 0
    for layer in range(L):
        m = cfg.compress_ratios[layer]
        if v41 is None and m:
            csa = cfg.layer_types[layer] == CSA
            pooling += B * (S // m) * 2 * ((2 * m) * (d + cfg.index_head_dim) if csa else m * d)
        elif v41 is not None and layer in v41.kv_source_layer_ids and m > 1:
            pooling += B * (S // m) * 2 * m * d
    assert comp_m == f.compressor - pooling
    n_engram = 0 if v41 is None or v41.engram is None else len(v41.engram.layer_ids)
    assert engram_m == f.engram - n_engram * R * 4 * N * D and (n_engram == 0) == (f.engram == 0)
    # mHC: torch sees the mixes and comb^T h as matmuls, not the collapse or post * y (2 x 2ND each a layer), nor
    # the final collapse (2ND); the engram module is called outside its layer's forward
    assert (layer_m - attn_m - ffn_m) + head_m == f.mhc - R * (L * 8 * N * D + 2 * N * D)
    # attention: the engine's torch path attends every window slot (masked before the sequence start) and, on a
    # compressed layer, K = min(index_topk, M) picked slots (V4 HCA: all M), M = the step's widest entry count; it
    # scores all M entries on an index layer. The model counts visible keys only. (As written, the torch path
    # computes exactly these padded rows; a path that skips masked work lies between the two bounds below.)
    padded_attn = padded_index = 0
    for layer in range(L):
        m = cfg.compress_ratios[layer]
        M = S // m if m else 0
        K = 0 if not m else (M if v41 is None and cfg.layer_types[layer] == HCA else min(cfg.index_topk, M))
        padded_attn += R * (cfg.sliding_window + K) * 4 * H * d
        if _has_indexer(cfg, layer):
            padded_index += R * M * 2 * cfg.index_n_heads * cfg.index_head_dim
    attn_own = attn_m - dense_m - comp_m  # the attention module's own matmuls: o_a, QK^T and PV, indexer scores
    assert padded_attn > f.attention > 0 and padded_index > f.indexer > 0
    assert o_a + f.attention + f.indexer < attn_own <= o_a + padded_attn + padded_index
    # and nothing else: every FLOP torch counted is in one of the above
    elementwise = pooling + n_engram * R * 4 * N * D + R * (L * 8 * N * D + 2 * N * D)
    assert fc.get_total_flops() == f.total - elementwise + attn_own - (o_a + f.attention + f.indexer)


# ---- bench throughput's accounting of scheduled prompt tokens ---------------------------------------------------
def _new(rid: str, prompt_len: int, start: int = 0) -> NewRequestData:
    return NewRequestData(rid, list(range(prompt_len)), [], SamplingParams(), ([],), start)


def test_prefill_work_counts_prompt_chunks_and_times_them() -> None:
    cfg = _cfg("tiny-v41")
    steps = [
        # r0: 30-token prompt in chunks of 20 + 10; r1: 12-token prompt after a 8-token prefix hit (start 4: replay)
        SchedulerOutput([_new("r0", 30), _new("r1", 12, start=4)], CachedRequestData(), {"r0": 20, "r1": 8}, 28),
        SchedulerOutput([], CachedRequestData(["r0", "r1"], [None, None], [20, 12]), {"r0": 10, "r1": 1}, 11),
        SchedulerOutput([], CachedRequestData(["r0", "r1"], [None, None], [30, 13]), {"r0": 1, "r1": 1}, 2),
        None,  # a call that scheduled nothing (async: the last call lands the last step)
    ]
    calls = [[so, s] for so, s in zip(steps, [0.5, 0.25, 0.125, 0.0625])]
    tokens, n, seconds, flops = prefill_work(cfg, calls, async_scheduling=False)
    assert (tokens, n, seconds) == (20 + 8 + 10, 2, 0.75)
    expect = (prefill_flops(cfg, 20, 1, sample=False) + prefill_flops(cfg, 12, 1, context_len=4)
              + prefill_flops(cfg, 30, 1, context_len=20))
    assert flops == expect
    # async scheduling: a step's time is the next call's (the one that waits for its tokens)
    assert prefill_work(cfg, calls, async_scheduling=True)[2] == 0.25 + 0.125


# ---- the commands ----------------------------------------------------------------------------------------------------
def test_bench_latency_reports_the_prefill(tiny_v4: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lat.json"
    b, i = 2, 24
    assert main(["bench", "latency", "--model", tiny_v4, "--batch-size", str(b), "--input-len", str(i),
                 "--output-len", "3", "--num-iters", "2", "--num-iters-warmup", "0", "--device", "cpu",
                 "--copy-bytes", str(1 << 20), "--peak-tflops", "0.5", "--output-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "prefill tokens/s" in table and "prefill TFLOP/s" in table and "prefill FLOPs" in table
    res = json.loads(out.read_text())
    cfg = load_model_config(tiny_v4)
    f = prefill_flops(cfg, i, b)
    p = res["prefill_time_s"]
    # one prefill step per batch (B x I tokens fit the step), and it is the step that is not a decode step
    assert 0 < p["min"] <= p["median"] <= p["max"] and p == res["prefill_s"]
    assert p["median"] < res["e2e_s"]["median"]
    assert res["prefill_cached_tokens"] == 0  # each timed batch prefills prompts of its own
    assert res["prefill_tokens"] == b * i
    assert res["prefill_tokens_per_s"] == pytest.approx(b * i / p["median"])
    assert res["prefill_flops"] == f.total and res["prefill_flops_by_component"] == f.to_json()
    assert res["prefill_tflops_per_s"] == pytest.approx(f.total / p["median"] / 1e12)
    assert res["peak_tflops_per_s"] == 0.5 and res["peak_source"] == "--peak-tflops"
    assert res["prefill_fraction_of_peak"] == pytest.approx(res["prefill_tflops_per_s"] / 0.5)
    assert 0 < res["prefill_fraction_of_peak"] < 1


def test_bench_throughput_reports_the_prefill(tiny_v41: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "thr.json"
    n, i, o = 3, 16, 2
    # 20 tokens a step: prompts are chunked and share steps with other requests' decodes
    assert main(["bench", "throughput", "--model", tiny_v41, "--num-prompts", str(n), "--input-len", str(i),
                 "--output-len", str(o), "--max-num-seqs", "4", "--max-num-batched-tokens", "20", "--device", "cpu",
                 "--output-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "input tokens/s" in table and "prefill tokens/s" in table
    res = json.loads(out.read_text())
    cfg = load_model_config(tiny_v41)
    assert res["cached_prompt_tokens"] == 0 and res["prefill_tokens_computed"] == n * i
    assert res["input_tokens_per_s"] == pytest.approx(n * i / res["elapsed_s"])
    assert -(-n * i // 20) <= res["prefill_steps"] < res["steps"]
    assert 0 < res["prefill_step_time_s"] < res["elapsed_s"]
    assert res["prefill_tokens_per_s"] == pytest.approx(n * i / res["prefill_step_time_s"])
    # the chunks' FLOPs add up to whole prompts' (lm_head once a prompt)
    assert res["prefill_flops"] == prefill_flops(cfg, i, n).total
    assert res["peak_tflops_per_s"] == H200_FP32_FLOPS / 1e12 and "H200" in res["peak_source"]
    assert res["prefill_fraction_of_peak"] == pytest.approx(res["prefill_tflops_per_s"] * 1e12 / H200_FP32_FLOPS)
    parts = {k: v for k, v in res["prefill_flops_by_component"].items() if k != "total"}
    assert PrefillFlops(**parts).total == res["prefill_flops"] == res["prefill_flops_by_component"]["total"]


def test_bench_throughput_takes_the_mixed_load_options(tiny_v41: str, tmp_path: Path) -> None:
    """--long-prefill-token-threshold reaches the engine: each 16-token prompt's prefill is cut into chunks of 4, so
    the prefill takes at least n * i / 4 steps' worth of chunks although the step budget holds whole prompts."""
    out = tmp_path / "thr.json"
    n, i, o = 2, 16, 2
    assert main(["bench", "throughput", "--model", tiny_v41, "--num-prompts", str(n), "--input-len", str(i),
                 "--output-len", str(o), "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--device", "cpu",
                 "--long-prefill-token-threshold", "4", "--max-num-partial-prefills", "2",
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["engine_kwargs"]["long_prefill_token_threshold"] == 4
    assert res["engine_kwargs"]["max_num_partial_prefills"] == 2
    assert res["prefill_tokens_computed"] == n * i and res["prefill_steps"] >= i // 4
