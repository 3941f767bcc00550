"""The engine on CUDA: the Triton lookback gather, the golden V4.1 checkpoint, and V4 in bf16."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dsv4.engine.engine import LLMEngine
from dsv4.ops.lookback import gather_lookback_torch, gather_lookback_triton
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")


def test_triton_lookback_matches_torch_on_gpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for depth in (1, 3, 7):
        hist = torch.randint(0, 2**31 - 1, (64, 1000), device="cuda", generator=g)
        for R in (0, 1, 17, 64):
            idx = torch.randperm(64, device="cuda", generator=g)[:R]
            for q in (1, 2):  # q 2: a strided view of starts, as a decode of query length 2 passes
                starts = torch.randint(0, 1000, (R * q,), device="cuda", generator=g)[::q]
                a = torch.full((64, depth), 7, dtype=torch.int32, device="cuda")
                b = a.clone()
                gather_lookback_torch(a, idx, starts, hist, R)
                gather_lookback_triton(b, idx, starts, hist, R)
                assert torch.equal(a, b)


def _drain(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


@pytest.mark.parametrize("budget", [3, 1000])
def test_golden_v41_greedy_on_cuda(budget: int) -> None:
    """fp32 on the GPU reproduces the reference's 16 greedy tokens, batched with another request."""
    with open(os.path.join(GOLDEN, "expected.json")) as f:
        exp = json.load(f)
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=96, max_num_seqs=4,
                              max_num_batched_tokens=budget)
    ids = exp["prompt_token_ids"]
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), request_id="golden")
    eng.add_request(ids[:9], SamplingParams(temperature=0.7, seed=3, max_tokens=10), request_id="other")
    done = _drain(eng)
    assert done["golden"].token_ids == exp["greedy_token_ids"]
    assert eng.runner.kv_caches[0].window.is_cuda


def test_golden_v41_prefill_logits_on_cuda() -> None:
    from dsv4.kv.spec import make_kv_groups
    from dsv4.models.build import build_model
    from dsv4.models.config import load_model_config
    from dsv4.runtime.attn_metadata import build_attn_metadata
    from dsv4.runtime.kv_cache import allocate_kv_caches

    with open(os.path.join(GOLDEN, "expected.json")) as f:
        ids = json.load(f)["prompt_token_ids"]
    ref = load_file(os.path.join(GOLDEN, "expected.safetensors"))["prefill_logits"]
    cfg = load_model_config(GOLDEN)
    model = build_model(cfg, GOLDEN, torch.float32, "cuda")
    groups = make_kv_groups(cfg, 16, 16, 1)
    caches = allocate_kv_caches(cfg, groups, torch.float32, "cuda")
    tables = {g.name: torch.arange(1, 9, dtype=torch.int32, device="cuda")[None] for g in groups}
    pos = torch.arange(len(ids), device="cuda")
    slots = tables["window"][0][pos // 16].long() * 16 + pos % 16
    md = build_attn_metadata(1, [0, len(ids)], [0], pos, groups, tables, slots)
    lookback = torch.full((1, 2), -1, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids, device="cuda"), md, caches, lookback_token_ids=lookback))
    assert (logits.cpu() - ref).abs().max().item() < 1e-4


def test_v4_bf16_on_cuda_close_to_fp32_cpu(tmp_path) -> None:
    from dsv4.make_model import make_model

    path = make_model("tiny-v4", str(tmp_path / "m"), seed=0)
    prompt = list(range(5, 45))
    outs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        eng = LLMEngine.from_args(path, device=device, dtype=dtype, max_model_len=96, max_num_batched_tokens=16)
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5), request_id="r")
        outs[device] = _drain(eng)["r"]
    lp_cpu = outs["cpu"].logprobs[0]
    lp_gpu = outs["cuda"].logprobs[0]
    common = set(lp_cpu) & set(lp_gpu)
    assert common, "bf16 top-5 shares nothing with fp32"
    for t in common:
        assert abs(lp_cpu[t].logprob - lp_gpu[t].logprob) < 0.15


def test_start_up_compiles_the_triton_step_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the start-up warm-up runs the Triton decode-metadata build and lookback gather (so they compile
    before memory profiling and capture, not in the first request's step): both launched before any request."""
    import dsv4.ops.decode_metadata as dm
    import dsv4.ops.lookback as lb

    calls: list[str] = []
    build, gather = dm.build_decode_metadata_triton, lb.gather_lookback_triton
    monkeypatch.setattr(dm, "build_decode_metadata_triton", lambda *a, **k: calls.append("build") or build(*a, **k))
    monkeypatch.setattr(lb, "gather_lookback_triton", lambda *a, **k: calls.append("gather") or gather(*a, **k))
    eng = LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=128, load_tokenizer=False)
    assert "build" in calls and "gather" in calls and eng.runner.num_warm_ups >= 1
