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

import pytest
import torch
from safetensors import safe_open

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import make_model
from dsv4.models.build import build_model
from dsv4.models.config import ConfigError, load_model_config
from dsv4.runtime.sampler import SamplingTensors
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.dspark import load_dspark_drafter
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.rejection import verify
from dsv4.tokenizer import Tokenizer

SPEC = {"method": "dspark", "num_speculative_tokens": 3}
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23], [0, 44]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("tiny-v41", str(tmp_path_factory.mktemp("tiny-v41-dspark")), seed=0)


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


def test_speculative_config_needs_a_drafter(tmp_path: Any, model_dir: str) -> None:
    plain = make_model("tiny-v41-noengram", str(tmp_path / "plain"), seed=0)
    with pytest.raises(ConfigError, match="ships none"):
        LLMEngine.from_args(plain, speculative_config=SPEC)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):  # tiny-v41's block is 4
        LLMEngine.from_args(model_dir, speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLMEngine.from_args(model_dir, speculative_config=SPEC, async_scheduling=True)
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
def test_greedy_random_drafter_identical_batched_chunked(model_dir: str, baseline: dict[str, list[int]]) -> None:
    outs, e = _run(model_dir, PROMPTS, GREEDY, SPEC, max_num_batched_tokens=8)
    assert _tokens(outs) == baseline
    st = e.spec_decode_stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= 2 * st.num_drafts
    assert st.num_accepted_tokens < st.num_draft_tokens  # a random drafter is (almost always) rejected


def test_greedy_oracle_drafter_accepts_everything(model_dir: str, baseline: dict[str, list[int]]) -> None:
    outs, e = _run(model_dir, PROMPTS, GREEDY, SPEC, oracle=_oracle(baseline), max_num_batched_tokens=8)
    assert _tokens(outs) == baseline
    st = e.spec_decode_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    assert st.num_accepted_tokens_per_pos[0] == st.num_drafts
    assert st.mean_acceptance_length > 3.0
    # every verify step emits its accepted drafts and a bonus token; steps that max_tokens leaves no room to draft
    # (a request's last token) emit one
    assert st.num_accepted_tokens + st.num_drafts + len(PROMPTS) <= 3 * 16


def test_wrong_oracle_drafts_are_rolled_back(model_dir: str, baseline: dict[str, list[int]]) -> None:
    """An oracle that is right for a while, then wrong: partial acceptance at every depth, odd and even committed
    lengths (the compressor pair rewind) - still the plain output."""
    oracle = _oracle(baseline)
    for i, seq in enumerate(oracle.values()):
        for j in range(len(PROMPTS[i]) + 2 + i, len(seq), 3):
            seq[j] = (seq[j] + 1) % 500
    outs, e = _run(model_dir, PROMPTS, GREEDY, SPEC, oracle=oracle)
    assert _tokens(outs) == baseline
    st = e.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert all(n > 0 for n in st.num_accepted_tokens_per_pos[:2])


@pytest.mark.parametrize("drafter", ["random", "oracle"])
def test_greedy_identical_under_preemption(model_dir: str, drafter: str) -> None:
    prompts = [[0] + [(7 * i + j) % 400 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=22, enable_prefix_caching=False)
    base_outs, base_e = _run(model_dir, prompts, params, **kw)
    base = _tokens(base_outs)
    outs, e = _run(model_dir, prompts, params, SPEC, oracle=_oracle(base, prompts) if drafter == "oracle" else None,
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


def test_stop_strings_stop_tokens_and_max_tokens(model_dir: str, baseline: dict[str, list[int]]) -> None:
    """The oracle emits up to 4 tokens per step: nothing past a stop string, a stop token or max_tokens is kept."""
    tok = Tokenizer.from_dir(model_dir)
    seq = baseline["0"]
    stop_text = tok.decode(seq[6:8])  # a stop string completed by the 8th token, mid-block
    cases = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_text]),
             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[seq[9]]),
             SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    prompts = [PROMPTS[0]] * len(cases)
    base, _ = _run(model_dir, prompts, cases)
    oracle = {str(i): PROMPTS[0] + seq for i in range(len(cases))}
    outs, e = _run(model_dir, prompts, cases, SPEC, oracle=oracle)
    for k in base:
        assert list(outs[k].token_ids) == list(base[k].token_ids), k
        assert (outs[k].text, outs[k].finish_reason, outs[k].stop_reason) == \
            (base[k].text, base[k].finish_reason, base[k].stop_reason)
    assert len(outs["0"].token_ids) < 8 + 1 and outs["1"].token_ids[-1] == seq[9] and len(outs["2"].token_ids) == 7
    assert e.spec_decode_stats.num_accepted_tokens == e.spec_decode_stats.num_draft_tokens > 0


# ---- sampling: the target's distribution ----------------------------------------------------------------------------
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
    outs, e = _run(model_dir, [prompt] * n, params, SPEC, oracle={str(i): prompt + baseline["0"] for i in range(n)},
                   max_num_seqs=64)
    pairs = Counter(tuple(o.token_ids[:2]) for o in outs.values())
    # the target's top-K distributions: after the prompt, and after the prompt and each first token
    firsts = sorted({t1 for t1, _ in pairs})
    lp_params = SamplingParams(max_tokens=1, temperature=0, logprobs=K)
    lp_outs, _ = _run(model_dir, [prompt] + [prompt + [t] for t in firsts], lp_params, max_num_seqs=8)

    def topk(o: Any) -> dict[int, float]:
        lps = o.logprobs[0]
        best = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:K]
        z = sum(math.exp(v.logprob) for _, v in best)
        return {t: math.exp(v.logprob) / z for t, v in best}

    p1 = topk(lp_outs["0"])
    assert set(firsts) <= set(p1)
    observed, expected = [], []
    for i, t1 in enumerate(firsts):
        p2 = topk(lp_outs[str(i + 1)])
        for t2, q in p2.items():
            observed.append(pairs.get((t1, t2), 0))
            expected.append(n * p1[t1] * q)
    assert sum(observed) == n
    assert _chi_square_p(observed, expected) > 1e-3
    st = e.spec_decode_stats
    assert st.num_draft_tokens == n and 0 < st.num_accepted_tokens < n  # the test exercised both branches
