"""Speculative decoding (dsv4.spec_decode): DSpark drafter weights in make-model and the loader, the target taps,
and the eager speculative step through the engine. Greedy output must equal plain decoding with a random drafter
(acceptance about 0) and with an oracle drafter (acceptance 100%), under batching, chunked prefill, preemption,
prefix caching, stop strings and max_tokens; sampled tokens must follow the target's distribution (chi-square).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dsv4 import LLM
from dsv4.cli import main as cli_main
from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.models.build import build_model
from dsv4.models.config import ConfigError, load_model_config
from dsv4.models.presets import mtp_tensor_shapes
from dsv4.runtime.sampler import SamplingTensors
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import SpeculativeConfig
from dsv4.spec_decode.dspark import load_dspark_drafter
from dsv4.spec_decode.mtp import MTPDrafter, load_mtp_drafter
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.rejection import verify
from dsv4.tokenizer import Tokenizer
from engine_runs import oracle_sequences, run_to_completion, top_k_probs

SPEC = {"method": "dspark", "num_speculative_tokens": 3}  # the defaults: uniform verify steps as decode rows
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 3}
EAGER = {"verify_decode": False}  # every verify step through the token-row forward (the reference path)
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23], [0, 44]]


@pytest.fixture(scope="module")
def model_dir(tiny_v41: str) -> str:
    """tiny-v41 (conftest): its DSpark drafter."""
    return tiny_v41


@pytest.fixture(scope="module")
def tiny_v4_dir(tiny_v4: str) -> str:
    """tiny-v4 (conftest): its MTP layer."""
    return tiny_v4


@pytest.fixture(scope="module", params=["dspark", "dspark-eager", "mtp", "mtp-eager"])
def family(request: pytest.FixtureRequest, model_dir: str, tiny_v4_dir: str) -> tuple[str, dict]:
    """(checkpoint, speculative config) of each drafter: tiny-v41's DSpark, tiny-v4's MTP layer; with the default
    verify steps (decode rows) and with eager ones."""
    method, _, eager = request.param.partition("-")
    ckpt, spec = (model_dir, SPEC) if method == "dspark" else (tiny_v4_dir, MTP_SPEC)
    return ckpt, {**spec, **EAGER} if eager else spec


def _run(model_dir: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
         spec: dict | None = None, oracle: dict[str, list[int]] | None = None, **kw: Any
         ) -> tuple[dict[str, Any], LLMEngine]:
    """Outputs by request id ("0", "1", ...) of one engine run; `oracle`: the oracle drafter's sequences."""
    kw.setdefault("max_num_seqs", 4)
    e = LLMEngine.from_args(model_dir, speculative_config=spec, **kw)
    if oracle is not None:
        e.runner.speculator.set_proposer(OracleProposer(oracle, 4))
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        e.add_request(p, sp, request_id=str(i))
    outs: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return outs, e


def _tokens(outs: dict[str, Any]) -> dict[str, list[int]]:
    return {k: list(v.token_ids) for k, v in outs.items()}


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> dict[str, list[int]]:
    return _tokens(_run(model_dir, PROMPTS, GREEDY)[0])


@pytest.fixture(scope="module")
def family_baseline(family: tuple[str, dict]) -> dict[str, list[int]]:
    return _tokens(_run(family[0], PROMPTS, GREEDY)[0])


def _oracle(baseline: dict[str, list[int]], prompts: list[list[int]] = PROMPTS) -> dict[str, list[int]]:
    return {str(i): prompts[i] + baseline[str(i)] for i in range(len(prompts))}


# ---- checkpoint, loader, taps ---------------------------------------------------------------------------------------
def test_tiny_v41_ships_a_dspark_drafter_the_loader_reads(model_dir: str) -> None:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        mtp = {k for k in keys if k.startswith("mtp.")}
        assert {k.split(".")[1] for k in mtp} == {"0", "1", "2"}
        assert "mtp.0.main_proj.weight" in mtp and "mtp.2.markov_head.embed.weight" in mtp
        assert "mtp.1.ffn.experts.7.w3.weight" in mtp and "mtp.0.norm.weight" not in mtp
        cfg = load_model_config(model_dir)
        drafter = load_dspark_drafter(model_dir, cfg, torch.float32, "cpu", 256)
        sd = drafter.state_dict()
        assert set(sd) == {k for k in mtp if ".experts." not in k} | {
            f"mtp.{s}.ffn.experts.{n}" for s in range(3) for n in ("gate_up_proj", "down_proj")}
        assert torch.equal(sd["mtp.0.main_proj.weight"], f.get_tensor("mtp.0.main_proj.weight"))
        I = cfg.moe_intermediate_size
        packed = sd["mtp.1.ffn.experts.gate_up_proj"]
        assert torch.equal(packed[5, :I], f.get_tensor("mtp.1.ffn.experts.5.w1.weight"))
        assert torch.equal(packed[5, I:], f.get_tensor("mtp.1.ffn.experts.5.w3.weight"))
    # the target ignores them (the engine without speculation loads the same directory)
    assert not any(n.startswith("mtp.") for n in build_model(cfg, model_dir, torch.float32, "cpu").state_dict())


def test_tiny_v4_ships_an_mtp_layer_the_loader_reads(tiny_v4_dir: str) -> None:
    """tiny-v4's MTP layer in the release's names (`mtp.0.attn.wq_a.weight`, per-expert w1/w2/w3, e_proj, h_proj,
    enorm, hnorm, norm, hc_head_fn/base/scale) and dtypes, loaded onto MTPDrafter's (target-style) names; the
    target ignores it."""
    cfg = load_model_config(tiny_v4_dir)
    assert cfg.num_nextn_predict_layers == 1
    with safe_open(os.path.join(tiny_v4_dir, "model.safetensors"), "pt") as f:
        mtp = {k for k in f.keys() if k.startswith("mtp.")}
        assert mtp == set(mtp_tensor_shapes(cfg))
        assert {"mtp.0.attn.wq_a.weight", "mtp.0.e_proj.weight", "mtp.0.hnorm.weight", "mtp.0.hc_head_fn",
                "mtp.0.ffn.experts.7.w2.weight", "mtp.0.ffn.gate.bias", "mtp.0.hc_attn_scale"} <= mtp
        drafter = load_mtp_drafter(tiny_v4_dir, cfg, torch.float32, "cpu", 256, 3)
        sd = drafter.state_dict()
        assert len(sd) == len([k for k in mtp if ".experts." not in k]) + 2
        assert torch.equal(sd["mtp.0.self_attn.q_a_proj.weight"], f.get_tensor("mtp.0.attn.wq_a.weight"))
        assert torch.equal(sd["mtp.0.hc_head.hc_fn"], f.get_tensor("mtp.0.hc_head_fn"))
        assert torch.equal(sd["mtp.0.mlp.gate.e_score_correction_bias"], f.get_tensor("mtp.0.ffn.gate.bias"))
        I = cfg.moe_intermediate_size
        packed = sd["mtp.0.mlp.experts.gate_up_proj"]
        assert torch.equal(packed[5, I:], f.get_tensor("mtp.0.ffn.experts.5.w3.weight"))
        assert f.get_tensor("mtp.0.hc_attn_scale").tolist() == [1.0, 1.0, 1.0]  # the init recipe: scales 1
        assert f.get_tensor("mtp.0.attn.attn_sink").abs().min() > 0
    assert not drafter.mtp[0].mlp.gate.is_hash and drafter.mtp[0].self_attn.compressor is None
    assert not any(n.startswith("mtp.") for n in build_model(cfg, tiny_v4_dir, torch.float32, "cpu").state_dict())
    # the released (quantized) layout and drafter=False write none, and say so
    for kw in ({"quant": "released"}, {"drafter": False}):
        assert load_model_config(make_model("tiny-v4", os.path.join(os.path.dirname(tiny_v4_dir), str(kw)),
                                            config_only=True, **kw)).num_nextn_predict_layers == 0


def test_mtp_taps_and_drafts(tiny_v4_dir: str) -> None:
    """The tap is the target's final streams (hc_head's input); a draft after the first, made by the layer's
    incremental step, equals a causal pass of the layer over the context extended by that step's inputs."""
    e = LLMEngine.from_args(tiny_v4_dir, speculative_config=MTP_SPEC, max_num_seqs=2)
    model = e.runner.model
    assert e.runner.speculator.proposer.tap_layer_ids == (4,)
    seen: list[torch.Tensor] = []
    hook = model.model.hc_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        e.add_request([0, 5, 9, 33, 77], SamplingParams(max_tokens=1, temperature=0))
        e.step()
    finally:
        hook.remove()
    taps = e.runner.speculator.taps
    stored = taps.gather(np.array([0]), np.array([4]))[0, -5:]
    assert torch.equal(stored, seen[0].flatten(1))

    drafter: MTPDrafter = e.runner.speculator.proposer.drafter
    g = torch.Generator().manual_seed(0)
    C, hcD = 6, model.cfg.hc_mult * model.cfg.hidden_size
    streams = torch.randn(1, C, hcD, generator=g)
    nxt = torch.randint(3, 400, (1, C), generator=g)
    last = torch.tensor([10])
    embed, head = model.model.embed_tokens, model.lm_head
    two = drafter.propose(streams, last, nxt, 2, embed, head)
    # the second draft again, by a causal pass over one more context row: the first step's inputs (the layer's
    # output streams at the last context position, the first draft) at position last + 1
    layer = drafter.mtp[0]
    with torch.no_grad():
        pos = torch.arange(last.item() - C + 1, last.item() + 1)
        h = layer.inputs(streams.view(C, model.cfg.hc_mult, -1), embed(nxt[0]))
        q, kv, cos, sin, mixes = layer.project(h, pos)
        out = layer.finish(h, q, kv.expand(C, -1, -1), torch.ones(C, C, dtype=torch.bool).tril(), cos, sin, mixes,
                           nxt[0])
    redo = drafter.propose(torch.cat([streams, out[-1].reshape(1, 1, -1)], dim=1), last + 1,
                           torch.cat([nxt, two[:, :1]], dim=1), 1, embed, head)
    assert redo[0, 0] == two[0, 1]
    # and its first draft is the causal pass's own pick at the last context position
    assert two[0, 0] == head(layer.head_hidden(out[-1:])).argmax(-1)[0]


def test_mtp_runs_only_the_last_context_row_through_the_layer(tiny_v4_dir: str) -> None:
    """`MTPDrafter.propose` takes the keys of every context row but runs attention and MoE for each sequence's last
    row only: its first draft's hidden state equals a full causal pass over the window (every row through the layer,
    the last row's output kept), for sequences whose windows start before position 0 (masked rows) and full ones."""
    e = LLMEngine.from_args(tiny_v4_dir, speculative_config=MTP_SPEC, max_num_seqs=2)
    model = e.runner.model
    drafter: MTPDrafter = e.runner.speculator.proposer.drafter
    layer = drafter.mtp[0]
    cfg = model.cfg
    W, hc, D = cfg.sliding_window, cfg.hc_mult, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    B = 3
    streams = torch.randn(B, W, hc * D, generator=g)
    nxt = torch.randint(3, 400, (B, W), generator=g)
    last = torch.tensor([3, 40, 11])  # the first window starts before position 0
    embed, head = model.model.embed_tokens, model.lm_head
    seen: list[torch.Tensor] = []
    hook = layer.hc_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        drafter.propose(streams, last, nxt, 1, embed, head)
    finally:
        hook.remove()
    with torch.no_grad():  # the full causal pass
        pos = last[:, None] - (W - 1) + torch.arange(W)
        valid = pos >= 0
        h = layer.inputs(streams.reshape(B * W, hc, D), embed(nxt.reshape(-1)))
        q, kv, cos, sin, mixes = layer.project(h, pos.clamp(min=0).reshape(-1))
        mask = (torch.ones(W, W, dtype=torch.bool).tril()[None] & valid[:, None, :]).reshape(B * W, W)
        keys = kv.view(B, W, -1)[torch.arange(B).repeat_interleave(W)]
        full = layer.finish(h, q, keys, mask, cos, sin, mixes, nxt.reshape(-1)).view(B, W, hc, D)[:, -1]
    assert len(seen) == 1 and seen[0].shape == full.shape
    torch.testing.assert_close(seen[0], full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [3, 8])
def test_v4_rings_keep_slack_for_the_drafts(tiny_v4_dir: str, k: int) -> None:
    """Under speculation V4's compressor rings keep k + 1 rows past their windows (kv.spec.ring_slack: tiny-v4's
    CSA and HCA windows are 8 positions), so a rejection restores nothing; k = 8, a verify chunk longer than a window,
    decodes as plainly as k = 3: greedy equal with a partly wrong oracle (every other step rejects somewhere)."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[0] + [(13 * j) % 400 + 3 for j in range(n)] for n in (11, 4)]
    plain_e = LLMEngine.from_args(tiny_v4_dir, max_num_seqs=2)
    plain = run_to_completion(plain_e, {str(i): p for i, p in enumerate(prompts)}, params)
    e = LLMEngine.from_args(tiny_v4_dir, max_num_seqs=2,
                            speculative_config={"method": "mtp", "num_speculative_tokens": k})
    e.runner.speculator.set_proposer(OracleProposer(oracle_sequences(prompts, [plain["0"], plain["1"]], 5), k))
    assert run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, params) == plain
    st = e.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    rows = {c.ring_kv.shape[1] for c in e.runner.kv_caches if c.ring_kv is not None}
    assert rows == {8 + k + 1} and {c.ring_kv.shape[1] for c in plain_e.runner.kv_caches
                                    if c.ring_kv is not None} == {8}


def test_speculative_config_needs_a_drafter(tmp_path: Any, model_dir: str) -> None:
    plain = make_model("tiny-v41-noengram", str(tmp_path / "plain"), seed=0)
    with pytest.raises(ConfigError, match="ships none"):
        LLMEngine.from_args(plain, speculative_config=SPEC)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # tiny-v41's block is 4
        LLMEngine.from_args(model_dir, speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    with pytest.raises(ConfigError, match="async_scheduling"):  # eager verify steps cannot be pipelined
        LLMEngine.from_args(model_dir, speculative_config={**SPEC, **EAGER}, async_scheduling=True)
    # big presets: the released drafter behind a flag; the released (quantized) layout has none yet
    big = make_model("v41-flash-8l", str(tmp_path / "big"), config_only=True, drafter=True)
    assert load_model_config(big).num_nextn_predict_layers == 3
    assert load_model_config(make_model("v41-flash-8l", str(tmp_path / "big0"), config_only=True)
                             ).num_nextn_predict_layers == 0


def test_taps_are_the_hc_mean_of_the_streams_entering_each_target_layer(model_dir: str) -> None:
    e = LLMEngine.from_args(model_dir, speculative_config=SPEC, max_num_seqs=2)
    model = e.runner.model
    layers = e.runner.speculator.proposer.tap_layer_ids
    assert layers == (2, 4, 5)
    seen: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0].mean(dim=1).clone())) for i in layers]
    captured: dict[int, torch.Tensor] = {}
    orig = model.forward

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        out = orig(*args, **kw)
        captured.update(kw["taps"])
        return out

    model.forward = spy
    try:
        e.add_request([0, 5, 9, 33, 77], SamplingParams(max_tokens=1, temperature=0))
        e.step()
    finally:
        model.forward = orig
        for h in hooks:
            h.remove()
    for i in layers:
        assert captured[i].shape == (5, model.cfg.hidden_size)
        assert torch.equal(captured[i], seen[i])


# ---- greedy: identical to plain decoding ----------------------------------------------------------------------------
def test_greedy_random_drafter_identical_batched_chunked(family: tuple[str, dict],
                                                        family_baseline: dict[str, list[int]]) -> None:
    outs, e = _run(family[0], PROMPTS, GREEDY, family[1], max_num_batched_tokens=8)
    assert _tokens(outs) == family_baseline
    st = e.spec_decode_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= 2 * st.num_drafts
    assert st.num_accepted_tokens < st.num_draft_tokens  # a random drafter is (almost always) rejected


def test_greedy_oracle_drafter_accepts_everything(family: tuple[str, dict],
                                                  family_baseline: dict[str, list[int]]) -> None:
    outs, e = _run(family[0], PROMPTS, GREEDY, family[1], oracle=_oracle(family_baseline),
                   max_num_batched_tokens=8)
    assert _tokens(outs) == family_baseline
    st = e.spec_decode_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.num_accepted_tokens_per_pos[0] == st.num_drafts
    assert st.mean_acceptance_length > 3.0
    # every verify step emits its accepted drafts and a bonus token; steps that max_tokens leaves no room to draft
    # (a request's last token) emit one
    assert st.num_accepted_tokens + st.num_drafts + len(PROMPTS) <= 3 * 16


@pytest.mark.parametrize("k", [2, 4])
def test_v41_rings_keep_slack_and_nothing_is_recomputed(model_dir: str, k: int) -> None:
    """V4.1's ratio-2 compressor rings keep k + 1 rows past their pair under speculation (kv.spec.ring_slack), none
    without; after every speculative step, rejecting ones included, a request's computed count is its known tokens
    but the newest (no token is computed twice), and the output is plain decoding's (a partly wrong oracle: rejections
    at odd and even positions)."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[0] + [(7 * j) % 300 + 3 for j in range(n)] for n in (9, 4)]
    plain_e = LLMEngine.from_args(model_dir, max_num_seqs=2)
    assert {c.ring_kv.shape[1] for c in plain_e.runner.kv_caches if c.ring_kv is not None} == {2}
    plain = run_to_completion(plain_e, {str(i): p for i, p in enumerate(prompts)}, params)
    e = LLMEngine.from_args(model_dir, max_num_seqs=2, speculative_config={"method": "dspark",
                                                                           "num_speculative_tokens": k})
    assert {c.ring_kv.shape[1] for c in e.runner.kv_caches if c.ring_kv is not None} == {2 + k + 1}
    sp = e.runner.speculator
    sp.set_proposer(OracleProposer(oracle_sequences(prompts, [plain["0"], plain["1"]], 3), sp.proposer.block_size))
    pending: list[int] = []
    orig = sp.launch

    def spy(so: Any) -> Any:
        res = orig(so)
        rs = sp.runner.req_state
        res.result()
        pending.extend(int(rs.num_tokens[r] - rs.num_computed[r]) for r in rs.req_id_to_row.values())
        return res

    sp.launch = spy  # type: ignore[method-assign]
    assert run_to_completion(e, {str(i): p for i, p in enumerate(prompts)}, params) == plain
    st = e.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and set(pending) == {1}


def test_wrong_oracle_drafts_are_rolled_back(family: tuple[str, dict],
                                             family_baseline: dict[str, list[int]]) -> None:
    """An oracle that is right for a while, then wrong: partial acceptance at every depth, odd and even committed
    lengths (the compressor rings' slack, without which this fails) - still the plain output."""
    baseline = family_baseline
    oracle = _oracle(baseline)
    for i, seq in enumerate(oracle.values()):
        for j in range(len(PROMPTS[i]) + 2 + i, len(seq), 3):
            seq[j] = (seq[j] + 1) % 500
    outs, e = _run(family[0], PROMPTS, GREEDY, family[1], oracle=oracle)
    assert _tokens(outs) == baseline
    st = e.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert all(n > 0 for n in st.num_accepted_tokens_per_pos[:2])


@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_greedy_identical_under_preemption(family: tuple[str, dict], drafter: str) -> None:
    model_dir, spec = family
    prompts = [[0] + [(7 * i + j) % 400 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=22, enable_prefix_caching=False)
    base_outs, base_e = _run(model_dir, prompts, params, **kw)
    base = _tokens(base_outs)
    outs, e = _run(model_dir, prompts, params, spec, oracle=_oracle(base, prompts) if drafter == "oracle" else None,
                   **kw)
    assert e.scheduler.num_preemptions > 0
    assert _tokens(outs) == base
    if drafter == "oracle":
        assert e.spec_decode_stats.num_accepted_tokens == e.spec_decode_stats.num_draft_tokens > 0


def test_greedy_identical_with_prefix_caching(model_dir: str) -> None:
    shared = [0] + [(11 * j) % 450 + 5 for j in range(37)]
    prompts = [shared + [9, 10], shared + [12, 13, 14], shared + [9, 10]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(block_size=4, max_num_seqs=1)  # one at a time: later prompts hit the earlier ones' units
    base = _tokens(_run(model_dir, prompts, params, enable_prefix_caching=False, **kw)[0])
    for oracle in (None, _oracle(base, prompts)):
        outs, e = _run(model_dir, prompts, params, SPEC, oracle=oracle, **kw)
        assert e.kv_manager.prefix is not None and e.kv_manager.prefix.hits > 0
        assert _tokens(outs) == base


def test_stop_strings_stop_tokens_and_max_tokens(family: tuple[str, dict],
                                                 family_baseline: dict[str, list[int]]) -> None:
    """The oracle emits up to 4 tokens per step: nothing past a stop string, a stop token or max_tokens is kept."""
    (model_dir, spec), baseline = family, family_baseline
    tok = Tokenizer.from_dir(model_dir)
    seq = baseline["0"]
    stop_text = tok.decode(seq[6:8])  # a stop string completed by the 8th token, mid-block
    cases = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_text]),
             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[seq[9]]),
             SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    prompts = [PROMPTS[0]] * len(cases)
    base, _ = _run(model_dir, prompts, cases)
    oracle = {str(i): PROMPTS[0] + seq for i in range(len(cases))}
    outs, e = _run(model_dir, prompts, cases, spec, oracle=oracle)
    for k in base:
        assert list(outs[k].token_ids) == list(base[k].token_ids), k
        assert (outs[k].text, outs[k].finish_reason, outs[k].stop_reason) == \
            (base[k].text, base[k].finish_reason, base[k].stop_reason)
    assert len(outs["0"].token_ids) < 8 + 1 and outs["1"].token_ids[-1] == seq[9] and len(outs["2"].token_ids) == 7
    assert e.spec_decode_stats.num_accepted_tokens == e.spec_decode_stats.num_draft_tokens > 0


# ---- sampling: the target's distribution ----------------------------------------------------------------------------
def pair_chi_square_p(pairs: Counter, p1: dict[int, float], p2: list[dict[int, float]]) -> float:
    """Chi-square p of sampled (first, second) token pairs against the target: first ~ p1, second ~ p2[i] after
    the i-th first token in sorted order (the pairs' first tokens must be in p1)."""
    firsts = sorted({t1 for t1, _ in pairs})
    assert set(firsts) <= set(p1) and len(p2) == len(firsts)
    n = sum(pairs.values())
    observed, expected = [], []
    for t1, dist in zip(firsts, p2):
        for t2, q in dist.items():
            observed.append(pairs.get((t1, t2), 0))
            expected.append(n * p1[t1] * q)
    assert sum(observed) == n
    return _chi_square_p(observed, expected)


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty normal approximation of the chi-square quantile); cells
    expected below 5 are pooled into one."""
    small = [i for i, e in enumerate(expected) if e < 5]
    if len(small) > 1:
        observed = [o for i, o in enumerate(observed) if i not in small] + [sum(observed[i] for i in small)]
        expected = [e for i, e in enumerate(expected) if i not in small] + [sum(expected[i] for i in small)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    k = len(observed) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """verify() on fixed logits over many seeds: every emitted position is distributed as the target's p (after
    temperature and top-k), whatever the (one-hot) draft. Fails for an off-by-one between drafts and positions."""
    V, d = 8, 2
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(d + 1, V, generator=gen) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argsort()[-2])]  # likely, then a second choice
    sp = [SamplingParams(temperature=0.8, top_k=6, seed=s) for s in range(3000)]
    rows = [p for p in sp for _ in range(d + 1)]
    n = len(sp)
    st = SamplingTensors.build(rows, [[0]] * len(rows), [[]] * len(rows), V, "cpu",
                               num_output_tokens=[i % (d + 1) for i in range(len(rows))])
    res = verify(logits.repeat(n, 1), [drafts] * n, st)
    p = torch.softmax(torch.where(logits >= logits.topk(6).values[:, -1:], logits, -torch.inf) / 0.8, dim=-1)
    first = Counter(t[0] for t in res.tokens)
    assert _chi_square_p([first[v] for v in range(V) if p[0, v] > 0], [n * float(p[0, v]) for v in range(V)
                                                                         if p[0, v] > 0]) > 1e-3
    # second position, conditional on the first draft accepted
    acc = [t for t in res.tokens if len(t) > 1]
    second = Counter(t[1] for t in acc)
    m = len(acc)
    assert m > 500
    assert _chi_square_p([second[v] for v in range(V) if p[1, v] > 0], [m * float(p[1, v]) for v in range(V)
                                                                          if p[1, v] > 0]) > 1e-3
    assert sum(res.num_accepted) > 0 and sum(len(t) == 1 for t in res.tokens) > 0


def test_speculative_sampling_follows_the_target_softmax(model_dir: str, baseline: dict[str, list[int]]) -> None:
    """Through the engine, with the oracle drafter (its drafts are the greedy continuation, so they are often
    accepted and often not): the second token, the first one a verify step emits, follows the target's
    distribution given the first (temperature 1, top-k 4, a seed per request)."""
    prompt = PROMPTS[0]
    K = 4
    n = 600
    # max_tokens 3: the prefill samples the first token, a verify step (one draft: the room max_tokens leaves)
    # the second
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=K, seed=s, ignore_eos=True) for s in range(n)]
    # every request drafts: no batch-size limit (the default, 32, would leave 64 running requests without drafts)
    outs, e = _run(model_dir, [prompt] * n, params, {**SPEC, "disable_by_batch_size": None},
                   oracle={str(i): prompt + baseline["0"] for i in range(n)}, max_num_seqs=64)
    pairs = Counter(tuple(o.token_ids[:2]) for o in outs.values())
    # the target's top-K distributions: after the prompt, and after the prompt and each first token
    firsts = sorted({t1 for t1, _ in pairs})
    lp_params = SamplingParams(max_tokens=1, temperature=0, logprobs=K)
    lp_outs, _ = _run(model_dir, [prompt] + [prompt + [t] for t in firsts], lp_params, max_num_seqs=8)

    p1 = top_k_probs(lp_outs["0"].logprobs[0], K)
    p2 = [top_k_probs(lp_outs[str(i + 1)].logprobs[0], K) for i in range(len(firsts))]
    assert pair_chi_square_p(pairs, p1, p2) > 1e-3
    st = e.spec_decode_stats
    assert st.num_draft_tokens == n and 0 < st.num_accepted_tokens < n  # the test exercised both branches


# ---- user surface: LLM(speculative_config=...), --speculative-config ------------------------------------------------
def test_llm_takes_a_speculative_config(model_dir: str, baseline: dict[str, list[int]]) -> None:
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=4,
              speculative_config='{"method": "dspark", "num_speculative_tokens": 2}')
    # the defaults: the measured break-even batch, verify rows and drafter graphs (async scheduling: off on the CPU)
    assert llm.engine.config.speculative == SpeculativeConfig("dspark", 2, 32, verify_decode=True,
                                                              drafter_cuda_graphs=True, adaptive=False)
    assert not llm.engine.config.scheduler.async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == [baseline[str(i)] for i in range(len(PROMPTS))]
    assert llm.engine.spec_decode_stats.num_drafts > 0


def test_cli_generate_with_a_speculative_config(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", model_dir, "--prompt", "The quick brown fox", "--max-tokens", "10",
            "--temperature", "0", "--device", "cpu", "--dtype", "float32"]
    assert cli_main(argv) == 0
    plain = capsys.readouterr().out
    assert cli_main(argv + ["--speculative-config", '{"method": "dspark"}']) == 0
    assert capsys.readouterr().out == plain  # greedy: the same completion


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "latency"], ["bench", "throughput"]])
def test_cli_speculative_config_errors_exit_2_before_loading(command: list[str], tmp_path: Any, model_dir: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """One line on stderr, exit 2, before the model is built (or tensor-parallel ranks spawned: each would say it)."""
    plain = make_model("tiny-v41-noengram", str(tmp_path / "plain"), seed=0, config_only=True)
    tp = ["--tensor-parallel-size", "2"] if command != ["bench", "throughput"] else []
    cases = [(model_dir, "{method: dspark}", "not valid JSON"),
             (model_dir, '["dspark"]', "must be a JSON object"),
             (model_dir, '{"method": "dspark", "num_speculative_tokens": 9}', "num_speculative_tokens"),
             (model_dir, '{"method": "dspark", "k": 2}', "unknown key `k`"),
             (model_dir, '{"method": "mtp"}', "DSpark drafter"),
             (plain, '{"method": "dspark"}', "ships none")]
    for model, value, message in cases:
        assert cli_main([*command, "--model", model, "--speculative-config", value, *tp]) == 2, value
        err = capsys.readouterr().err
        assert err.startswith("dsv4: error: speculative config") and message in err, err
        assert err.count("\n") == 1


# ---- disable_by_batch_size ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_disable_by_batch_size_decodes_plainly_at_or_above_it(model_dir: str, drafter: str) -> None:
    """disable_by_batch_size 3: while 3 or more requests run, no drafts are proposed and steps without drafts are
    the runner's plain steps (its decode path); below 3 the batch speculates again, from a plain step after which
    the drafter proposes (`_resume`). Requests join mid-run (drafts proposed for a batch of 2 are verified in the step
    the batch grows) and finish at different steps; the greedy output is plain decoding's."""
    prompts = [[0] + [(13 * i + 7 * j) % 400 + 3 for j in range(6 + 2 * i)] for i in range(5)]
    lengths = [18, 5, 9, 14, 7]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    joins = {0: [0, 1], 3: [2, 3], 12: [4]}  # step -> prompts added before it

    def run(spec: dict | None, oracle: dict[str, list[int]] | None) -> tuple[dict[str, list[int]], LLMEngine,
                                                                                 list[tuple[str, int]]]:
        e = LLMEngine.from_args(model_dir, speculative_config=spec, max_num_seqs=4)
        seen: list[tuple[str, int]] = []  # (what ran, requests holding a row)
        if spec is not None:
            sp, runner = e.runner.speculator, e.runner
            if oracle is not None:
                sp.set_proposer(OracleProposer(oracle, 4))
            propose, plain, decode, verify_ = sp.proposer.propose, runner.launch_plain, runner._decode, sp._verify
            resume = sp._resume
            sp._resume = lambda so, now: (seen.append(("resume", runner.req_state.num_active)), resume(so, now))[1]
            sp._verify = lambda *a: (seen.append(("verify", runner.req_state.num_active)), verify_(*a))[1]
            sp.proposer.propose = lambda *a: (seen.append(("propose", runner.req_state.num_active)), propose(*a))[1]
            runner.launch_plain = lambda so: (seen.append(("plain", runner.req_state.num_active)), plain(so))[1]
            runner._decode = lambda batch: (seen.append(("decode", batch.num_reqs)), decode(batch))[1]
        outs: dict[str, list[int]] = {}
        step = 0
        while step <= max(joins) or e.has_unfinished_requests():
            for i in joins.get(step, []):
                e.add_request(prompts[i], params[i], request_id=str(i))
            for o in e.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
            step += 1
        return outs, e, seen

    base, _, _ = run(None, None)
    assert [len(base[str(i)]) for i in range(5)] == lengths
    oracle = {str(i): prompts[i] + base[str(i)] for i in range(5)} if drafter == "oracle" else None
    outs, e, seen = run({"method": "dspark", "num_speculative_tokens": 3, "disable_by_batch_size": 3}, oracle)
    assert outs == base
    proposed = [n for what, n in seen if what == "propose"]
    resumed = [n for what, n in seen if what == "resume"]  # each followed by its plain step
    plain = [n for (what, n), before in zip(seen, [("", 0)] + seen) if what == "plain" and before[0] != "resume"]
    assert proposed and plain and e.runner.speculator.num_plain_steps == len(plain)
    assert resumed and e.runner.speculator.num_plain_proposals == len(resumed) and max(resumed) < 3
    assert max(proposed) < 3 <= min(plain)
    assert 3 in plain  # the boundary: exactly disable_by_batch_size requests decode plainly
    # step 3: drafts proposed while fewer ran are verified in the step the batch grows past the limit
    assert max(n for what, n in seen if what == "verify") >= 3
    assert any(what == "decode" for what, _ in seen)  # the plain uniform-decode path (CUDA graphs on a GPU)
    st = e.spec_decode_stats
    assert st.num_drafts > 0
    if drafter == "oracle":
        assert st.num_accepted_tokens == st.num_draft_tokens
