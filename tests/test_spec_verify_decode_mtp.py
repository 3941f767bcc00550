"""DeepSeek-V4's MTP speculation with the multi-row decode verify step (`"verify_decode": true`,
dsv4/spec_decode/verify_decode.py) and the graphed MTP drafter (`"drafter_cuda_graphs": true`,
dsv4/spec_decode/drafter_graphs.py). V4's compressor rings (CSA: overlapping windows over 2 * ratio rows; HCA: ratio
rows) are pooled from the step's own rows and the ring as it was (dsv4/models/verify_rows.py); with k + 1 rows of
slack a rejection needs no restore (kv.spec.ring_slack). Greedy output equals plain decoding (k = 1, 3, 7: windows of 4 and 8
positions close at every offset of a step; all drafts accepted, some rejected; batches of 1 and 3;
preemption; padded and "replayed" graphs); every verify step's logits, taps and caches equal the eager token-row
forward's for the same step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import DrafterSpec, parse_speculative_config
from dsv4.spec_decode.drafter_graphs import GraphedMTPProposer
from engine_runs import (RerunGraphs, against_plain, compare_verify_with_eager, oracle_sequences, pad_like_graphs, run_prompts,
                         run_to_completion, speculative_engine)

# lengths 5, 13, 2, 8: the first verify step starts at every offset of tiny-v4's CSA (4) and HCA (8) windows
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23], [0, 44],
           [0, 7, 70, 170, 270, 370, 3, 4]]
GREEDY = SamplingParams(max_tokens=26, temperature=0, ignore_eos=True)


def _spec(k: int, on: bool = True, graphs: bool = False) -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k, "verify_decode": on, "drafter_cuda_graphs": graphs}


def _run(model_dir: str, prompts: list[list[int]], spec: dict[str, Any] | None = None,
         oracle: dict[str, list[int]] | None = None, params: SamplingParams = GREEDY,
         **kw: Any) -> tuple[dict[str, list[int]], LLMEngine]:
    return run_prompts(model_dir, prompts, params, spec, oracle, 8, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_v4: str) -> dict[str, list[int]]:
    """Plain decoding of every prompt (greedy: batching does not change the tokens)."""
    return _run(tiny_v4, PROMPTS)[0]


def _oracle(baseline: dict[str, list[int]], ids: list[int], wrong_every: int = 0) -> dict[str, list[int]]:
    return oracle_sequences([PROMPTS[i] for i in ids], [baseline[str(i)] for i in ids], wrong_every)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("ids", [[0], [3, 1, 2]], ids=["b1", "b3"])
@pytest.mark.parametrize("wrong_every", [0, 3], ids=["accept", "reject"])
def test_greedy_equals_plain_decoding(tiny_v4: str, baseline: dict[str, list[int]], k: int, ids: list[int],
                                      wrong_every: int) -> None:
    """All drafts accepted, or a wrong draft every 3 positions (partial acceptance at every depth, the rings
    restored): every step with drafts is a uniform decode-row step (k drafts after the anchor)."""
    outs, e = _run(tiny_v4, [PROMPTS[i] for i in ids], _spec(k), _oracle(baseline, ids, wrong_every))
    assert outs == {str(r): baseline[str(i)] for r, i in enumerate(ids)}
    vd = e.runner.speculator.verify_decode
    assert vd is not None and vd.num_decode_steps > 0 and vd.num_eager_steps == 0
    st = e.spec_decode_stats
    if wrong_every:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    else:
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


@pytest.mark.parametrize(("mode", "drafter"), [("exact", "mtp"), ("exact", "wrong"), ("padded", "wrong"),
                                               ("graphs", "accept"), ("graphs", "mtp")])
def test_verify_logits_equal_the_eager_forward(tiny_v4: str, baseline: dict[str, list[int]], mode: str,
                                               drafter: str) -> None:
    """Every decode-row verify step also run by the eager token-row forward from the same caches: hidden states,
    the MTP layer's tap (the final streams, hc * D wide) and every cache after the step (window KV, entries,
    indexer keys, both compressors' rings) agree within fp32 round-off; unpadded, padded to the graph sizes, and
    through the graph path's capture and replay (`RerunGraphs`)."""
    ids = [0, 1, 2]
    # the oracle (no taps), all right or wrong every 4 positions, or the checkpoint's MTP layer
    oracle = None if drafter == "mtp" else _oracle(baseline, ids, wrong_every=4 if drafter == "wrong" else 0)
    e = speculative_engine(tiny_v4, _spec(3), oracle, 8, pad=mode != "exact", graphs=mode == "graphs")
    vd = e.runner.speculator.verify_decode
    compared = compare_verify_with_eager(e)
    outs = run_to_completion(e, {str(i): PROMPTS[i] for i in ids}, GREEDY)
    assert outs == {str(i): baseline[str(i)] for i in ids}
    assert len(compared) == vd.num_decode_steps > 0
    assert vd.num_graph_replays == (len(compared) if mode == "graphs" else 0)
    if drafter == "mtp":
        assert vd.tap_size == e.config.model.hc_mult * e.config.model.hidden_size


def test_graphed_drafter_and_verify_decode_as_plain(tiny_v4: str, baseline: dict[str, list[int]]) -> None:
    """The checkpoint's own (random) MTP layer, k = 3, with both graph paths replayed by the stand-in: plain
    decoding's tokens, every verify step and proposal replayed, and exactly the acceptance counts of the eager
    drafter with eager (token-row) verify steps."""
    ids = [3, 0, 2]
    prompts = [PROMPTS[i] for i in ids]
    want = {str(r): baseline[str(i)] for r, i in enumerate(ids)}
    eager_outs, eager = _run(tiny_v4, prompts, _spec(3, on=False))
    assert eager_outs == want
    e = LLMEngine.from_args(tiny_v4, speculative_config=_spec(3, graphs=True), max_num_seqs=4)
    sp = e.runner.speculator
    pad_like_graphs(sp.verify_decode, graphs=True)
    p = sp.proposer
    assert isinstance(p, GraphedMTPProposer)
    p.graphs = RerunGraphs([1, 2, 4], enabled=True)
    p.capture()
    assert run_to_completion(e, {str(i): q for i, q in enumerate(prompts)}, GREEDY) == want
    vd = sp.verify_decode
    assert vd.num_decode_steps > 0 and vd.num_graph_replays == vd.num_decode_steps and vd.num_eager_steps == 0
    assert p.num_graph_replays > 0 and p.num_eager_proposals == 0
    a, b = e.spec_decode_stats, eager.spec_decode_stats
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.num_accepted_tokens_per_pos) == (
        b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens, b.num_accepted_tokens_per_pos)


def test_greedy_equals_plain_with_preemption(tiny_v4: str) -> None:
    """Preemption (recomputed requests) with a partly rejected oracle. (DeepSeek-V4 has no prefix-cacheable KV
    group in dsv4: its compressor rings are not replayed, so prefix caching is off for it.)"""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[0] + [(7 * i + j) % 400 + 3 for j in range(10 + 3 * i)] for i in range(4)]
    kw: dict[str, Any] = dict(block_size=8, num_kv_blocks=14, enable_prefix_caching=False, max_num_seqs=4)
    base, outs, e = against_plain(tiny_v4, prompts, params, _spec(3), 8, **kw)
    assert outs == base
    st = e.spec_decode_stats
    assert e.runner.speculator.verify_decode.num_decode_steps > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert e.scheduler.num_preemptions > 0


def test_dummy_forward_for_the_memory_profile_writes_nothing_real(tiny_v4: str,
                                                                  baseline: dict[str, list[int]]) -> None:
    """The start-up memory profile's largest verify forward (padding rows; hidden states and the hc * D tap side by
    side) before any request leaves the outputs plain decoding's: it wrote only trash slots and the null block."""
    e = LLMEngine.from_args(tiny_v4, speculative_config=_spec(3), max_num_seqs=4)
    vd = e.runner.speculator.verify_decode
    out = vd.dummy_forward()
    m = e.config.model
    assert out.shape == (vd.graphs.capture_sizes[-1], m.hidden_size * (1 + m.hc_mult))
    assert bool(torch.isfinite(out).all())
    assert run_to_completion(e, {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY) == baseline
    assert vd.num_decode_steps > 0


def test_config_switch() -> None:
    mtp = DrafterSpec("deepseek_v4", "mtp", 1)
    spec = parse_speculative_config(_spec(3, graphs=True), mtp)
    assert spec.verify_decode and spec.drafter_cuda_graphs and spec.num_speculative_tokens == 3
