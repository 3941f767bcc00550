"""The drafters' proposals as CUDA graphs (`"drafter_cuda_graphs": true`, dsv4/spec_decode/drafter_graphs.py) on
the CPU, DSpark and MTP: the fixed-shape MoE path of the captured forward equals the eager reference's, the graph path (captured and
"replayed" by a stand-in that re-runs the captured closure on the persistent buffers) drafts exactly what the eager
proposer drafts, padding rows change nothing, and an engine with the switch decodes exactly as plain decoding, with
the same acceptance counts as the eager drafter. The real graphs: tests/gpu/test_dspark_graphs_gpu.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.make_model import default_model_dir
from dsv4.models.config import ConfigError
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import DrafterSpec, DSparkConfig, parse_speculative_config
from dsv4.spec_decode.drafter_graphs import GraphedDSparkProposer, GraphedMTPProposer, ProposalGraphs
from dsv4.spec_decode.proposer import DSparkProposer, MTPProposer
from engine_runs import RerunGraphs, demo_code_prompts, run_to_completion

def _spec(graphs: bool, method: str = "dspark") -> dict[str, Any]:
    """DSpark's whole block, or 3 MTP drafts (the layer re-applied)."""
    return {"method": method, "drafter_cuda_graphs": graphs, **({"num_speculative_tokens": 3} if method == "mtp" else {})}


def _standin(engine: LLMEngine, sizes: list[int]) -> ProposalGraphs:
    """The engine's graphed proposer with the re-running stand-in for the graphs of `sizes`, captured."""
    p = engine.runner.speculator.proposer
    assert isinstance(p, ProposalGraphs)
    assert not p.graphs.enabled  # CPU: the switch alone captures nothing here
    p.graphs = RerunGraphs(sizes, enabled=True)
    p.capture()
    return p


@pytest.mark.parametrize("B", [1, 3])
def test_fixed_moe_path_proposes_what_the_reference_does(tiny_v41: str, B: int) -> None:
    """B = 1: 4 block rows x top-2 = 8 routes <= 8 experts (the per-route gather); B = 3: more routes than experts
    (every expert on every row, masked by the routing weights). Tokens equal, logits and confidences within fp32
    round-off of a different summation order."""
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=4, speculative_config=_spec(False))
    prop = e.runner.speculator.proposer
    drafter = prop.drafter
    g = torch.Generator().manual_seed(B)
    W = drafter.cfg.sliding_window
    taps = torch.randn(B, W, prop.tap_width, generator=g)
    last = torch.tensor([3, 40, 11][:B])  # a window partly before position 0 (masked) and full ones
    anchor = torch.randint(5, 400, (B,), generator=g)
    ref = drafter.propose(taps, last, anchor, prop.embed, prop.lm_head)
    got = drafter.propose(taps, last, anchor, prop.embed, prop.lm_head, fixed=True)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.confidence, ref.confidence, rtol=1e-5, atol=1e-6)
    assert (ref.logits.std(dim=-1) > 1e-3).all()  # not a degenerate (constant) draft distribution


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_graph_path_drafts_what_the_eager_proposer_drafts(tiny_v41: str, tiny_v4: str, method: str) -> None:
    """Random tap rings (and for MTP a random token history: the token after each context position) and positions;
    proposals of 1, 2 and 3 requests (padded to 1, 2, 4), some rows more than once, in any order: the replayed
    drafts equal the eager proposer's (its grouped MoE path) on the same ring, and a proposal larger than every
    capture size runs eagerly."""
    e = LLMEngine.from_args(tiny_v41 if method == "dspark" else tiny_v4, max_num_seqs=4,
                            speculative_config=_spec(True, method))
    p = _standin(e, [1, 2, 4])
    assert isinstance(p, GraphedDSparkProposer if method == "dspark" else GraphedMTPProposer)
    eager = DSparkProposer.propose if method == "dspark" else MTPProposer.propose
    taps = e.runner.speculator.taps
    assert taps is not None and p.taps is taps
    g = torch.Generator().manual_seed(7)
    taps.values.copy_(torch.randn(taps.values.shape, generator=g))
    hist = e.runner.req_state.token_history
    hist.copy_(torch.randint(2, 400, hist.shape, generator=g))
    cases = [([2], [0]), ([0, 3], [17, 5]), ([3, 1, 2], [9, 30, 2]), ([1, 1, 0], [6, 6, 40])]
    drafted: set[int] = set()
    for rows, last in cases:
        rows_np, last_np = np.array(rows, dtype=np.int64), np.array(last, dtype=np.int64)
        anchors = hist[torch.from_numpy(rows_np), torch.from_numpy(last_np + 1)]
        want = eager(p, [], rows_np, last_np, anchors, taps)
        before = p.num_graph_replays
        got = p.propose([], rows_np, last_np, anchors, taps).clone()
        assert p.num_graph_replays == before + 1
        assert torch.equal(got, want), (rows, last)
        drafted.update(want.flatten().tolist())
    assert len(drafted) > 3  # not a degenerate (constant) drafter
    p.graphs = RerunGraphs([1, 2], enabled=True)
    p.capture()
    count = p.num_eager_proposals
    rows_np, last_np = np.array([0, 1, 2], dtype=np.int64), np.array([4, 5, 6], dtype=np.int64)
    anchors = hist[torch.from_numpy(rows_np), torch.from_numpy(last_np + 1)]
    got = p.propose([], rows_np, last_np, anchors, taps)
    assert p.num_eager_proposals == count + 1  # 3 requests, largest graph 2: the eager reference
    assert torch.equal(got, eager(p, [], rows_np, last_np, anchors, taps))


def test_padding_rows_do_not_change_real_rows(tiny_v41: str) -> None:
    """The same request drafted alone (graph of 1) and with padding (graph of 4, rows 1..3 padding) gets the same
    drafts: every drafter row is its own sequence."""
    e = LLMEngine.from_args(tiny_v41, max_num_seqs=4, speculative_config=_spec(True))
    p = _standin(e, [1, 4])
    taps = e.runner.speculator.taps
    taps.values.copy_(torch.randn(taps.values.shape, generator=torch.Generator().manual_seed(3)))
    rows_np, last_np, anchors = np.array([2], dtype=np.int64), np.array([21], dtype=np.int64), torch.tensor([99])
    alone = p.propose([], rows_np, last_np, anchors, taps).clone()
    p.graphs = RerunGraphs([4], enabled=True)
    p.capture()
    padded = p.propose([], rows_np, last_np, anchors, taps).clone()
    assert torch.equal(alone, padded)


def test_engine_with_drafter_graphs_decodes_as_plain() -> None:
    """The built-in trained model (its drafter gets about a third of its drafts accepted): greedy speculation with
    the graphed drafter (stand-in graphs of 1, 2 and 4 requests, so the 3-request steps are padded) emits plain
    decoding's tokens, with exactly the eager drafter's acceptance counts."""
    model = default_model_dir()
    prompts = demo_code_prompts(model)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = run_to_completion(LLMEngine.from_args(model, max_num_seqs=4), prompts, params)
    eager = LLMEngine.from_args(model, max_num_seqs=4, speculative_config=_spec(False))
    assert run_to_completion(eager, prompts, params) == plain
    e = LLMEngine.from_args(model, max_num_seqs=4, speculative_config=_spec(True))
    p = _standin(e, [1, 2, 4])
    assert run_to_completion(e, prompts, params) == plain
    assert p.num_graph_replays > 0 and p.num_eager_proposals == 0
    a, b = e.spec_decode_stats, eager.spec_decode_stats
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (b.num_drafts, b.num_draft_tokens,
                                                                          b.num_accepted_tokens)
    assert a.num_accepted_tokens_per_pos == b.num_accepted_tokens_per_pos
    assert 0 < a.num_accepted_tokens < a.num_draft_tokens  # a trained drafter: many drafts accepted, not all


def test_config_switch() -> None:
    ds = DSparkConfig(num_stages=3, block_size=4, noise_token_id=511, target_layer_ids=(2, 4, 5), markov_rank=16,
                      n_routed_experts=8, num_experts_per_tok=2)
    dspark = DrafterSpec(model_type="deepseek_v41", method="dspark", num_layers=3, dspark=ds)
    assert parse_speculative_config({"method": "dspark"}, dspark).drafter_cuda_graphs is True  # the default
    assert parse_speculative_config(_spec(False), dspark).drafter_cuda_graphs is False
    with pytest.raises(ConfigError, match="drafter_cuda_graphs.*true or false"):
        parse_speculative_config({"method": "dspark", "drafter_cuda_graphs": 1}, dspark)
    mtp = DrafterSpec(model_type="deepseek_v4", method="mtp", num_layers=1)
    assert parse_speculative_config({"method": "mtp", "drafter_cuda_graphs": True}, mtp).drafter_cuda_graphs
