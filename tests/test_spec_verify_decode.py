"""The multi-row decode verify step (`"verify_decode": true`, dsv4/spec_decode/verify_decode.py): a speculative step
in which every request verifies exactly k drafts runs as k + 1 decode rows per request through the fixed-shape
decode forward. Greedy output equals plain decoding (all drafts accepted, some rejected; pair boundaries at
even and odd positions; batches of 1-3); its logits and taps equal the eager token-row forward's for the same step;
uniform steps take the new path and all others the eager one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.kv.spec import NULL_BLOCK
from dsv4.models.config import ConfigError
from dsv4.models.deepseek_v41 import Compressor
from dsv4.models.verify_rows import pool_verify_rows
from dsv4.runtime.input_batch import InputBatch
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import DrafterSpec, DSparkConfig, SpeculativeConfig, parse_speculative_config
from dsv4.spec_decode.proposer import OracleProposer
from dsv4.spec_decode.verify_decode import VerifyDecode, verify_capture_sizes
from engine_runs import (against_plain, compare_verify_with_eager, oracle_sequences, prefix_or_preemption_case,
                         run_prompts, run_to_completion, speculative_engine)

# lengths 5, 13, 2, 8: the first verify step's anchor at odd and even positions (closing a ratio-2 pair with the
# ring's row, or opening one)
PROMPTS = [[0, 5, 9, 33, 77], [0, 8, 100, 200, 300, 400, 17, 18, 19, 20, 21, 22, 23], [0, 44],
           [0, 7, 70, 170, 270, 370, 3, 4]]
GREEDY = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def _spec(k: int, on: bool = True) -> dict[str, Any]:
    return {"method": "dspark", "num_speculative_tokens": k, "verify_decode": on}


def _run(model_dir: str, prompts: list[list[int]], spec: dict[str, Any] | None = None,
         oracle: dict[str, list[int]] | None = None, pad: bool = False, graphs: bool = False,
         params: SamplingParams = GREEDY, **kw: Any) -> tuple[dict[str, list[int]], LLMEngine]:
    """Outputs by request id ("0", "1", ..) of one engine run (`run_prompts`)."""
    return run_prompts(model_dir, prompts, params, spec, oracle, 4, pad, graphs, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_v41: str) -> dict[str, list[int]]:
    """Plain decoding of every prompt (greedy: batching does not change the tokens)."""
    return _run(tiny_v41, PROMPTS)[0]


def _oracle(baseline: dict[str, list[int]], ids: list[int], wrong_every: int = 0) -> dict[str, list[int]]:
    """The oracle's sequences of prompts `ids` (request ids "0", ".." in that order; `oracle_sequences`)."""
    return oracle_sequences([PROMPTS[i] for i in ids], [baseline[str(i)] for i in ids], wrong_every)


def _record_uniform(vd: VerifyDecode) -> list[tuple[bool, list[int], list[int]]]:
    """Every `uniform` decision of the run: (decision, scheduled tokens, drafts) per step with a forward."""
    seen: list[tuple[bool, list[int], list[int]]] = []
    orig = vd.uniform

    def spy(batch: InputBatch, drafts: np.ndarray, sample: np.ndarray, image_rows: Any) -> bool:
        ok = orig(batch, drafts, sample, image_rows)
        seen.append((ok, batch.num_scheduled_tokens.tolist(), drafts.tolist()))
        return ok

    vd.uniform = spy  # type: ignore[method-assign]
    return seen


# ---- greedy: identical to plain decoding ----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("ids", [[0], [2, 1], [3, 0, 2]], ids=["b1", "b2", "b3"])
@pytest.mark.parametrize("wrong_every", [0, 3], ids=["accept", "reject"])
def test_greedy_equals_plain_decoding(tiny_v41: str, baseline: dict[str, list[int]], k: int, ids: list[int],
                                      wrong_every: int) -> None:
    """All drafts accepted, or a wrong draft every 3 positions (partial acceptance at every depth: rejected rows
    overwrite ring slots the next steps do not read), k + 1 = 3 (the pair boundary moves every step) and 4 rows per
    request. Every step with drafts is uniform, and the last steps verify drafts past max_tokens
    (SchedulerConfig.drafts_past_max_tokens), which the counters leave out (all accepted stays all accepted)."""
    prompts = [PROMPTS[i] for i in ids]
    outs, e = _run(tiny_v41, prompts, _spec(k), _oracle(baseline, ids, wrong_every))
    assert outs == {str(r): baseline[str(i)] for r, i in enumerate(ids)}
    vd = e.runner.speculator.verify_decode
    assert vd is not None and vd.num_decode_steps > 0
    st = e.spec_decode_stats
    assert vd.num_eager_steps == 0
    if wrong_every:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    else:
        assert st.num_accepted_tokens == st.num_draft_tokens > 0


def test_random_drafter_equals_plain_decoding(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """The checkpoint's own (random) DSpark drafter: drafts almost always rejected at the first position; every
    step with drafts is still a uniform decode-row step."""
    outs, e = _run(tiny_v41, PROMPTS[:3], _spec(3))
    assert outs == {str(i): baseline[str(i)] for i in range(3)}
    vd = e.runner.speculator.verify_decode
    assert vd.num_decode_steps > 0 and vd.num_eager_steps == 0


@pytest.mark.parametrize("k", [2, 3])
def test_greedy_equals_plain_decoding_through_the_graph_path(tiny_v41: str, baseline: dict[str, list[int]],
                                                              k: int) -> None:
    """Rows padded to the graph sizes (3 requests pad to 4, then 2 or 1) and every decode-row step replayed
    (`RerunGraphs`); the padded eager path is in test_verify_logits_equal_the_eager_forward."""
    ids = [3, 0, 2]
    outs, e = _run(tiny_v41, [PROMPTS[i] for i in ids], _spec(k), _oracle(baseline, ids, 3), pad=True, graphs=True)
    assert outs == {str(r): baseline[str(i)] for r, i in enumerate(ids)}
    vd = e.runner.speculator.verify_decode
    assert vd.num_decode_steps > 0 and vd.num_graph_replays == vd.num_decode_steps


@pytest.mark.parametrize("case", ["prefix_cache", "preemption"])
def test_greedy_equals_plain_with_prefix_caching_and_preemption(tiny_v41: str, case: str) -> None:
    """Prefix-cache hits (their replayed rows stay eager; verify rows after them) and preemption (recomputed
    requests): the plain output with a partly rejected oracle (accepted runs and rejections)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts, kw = prefix_or_preemption_case(case)
    base, outs, e = against_plain(tiny_v41, prompts, params, _spec(3), 4, **kw)
    assert outs == base
    st = e.spec_decode_stats
    assert e.runner.speculator.verify_decode.num_decode_steps > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    if case == "prefix_cache":
        assert e.kv_manager.prefix is not None and e.kv_manager.prefix.hits > 0
    else:
        assert e.scheduler.num_preemptions > 0


# ---- the ratio-2 compressor ring of several rows per request -----------------------------------------------------
class _RecordingRing:
    """A ring tensor that records the (block, slot) pairs of every scatter into it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, t.shape, t.dtype
        self.writes: list[list[tuple[int, int]]] = []

    def __getitem__(self, idx: Any) -> torch.Tensor:
        return self.t[idx]

    def __setitem__(self, idx: tuple[torch.Tensor, torch.Tensor], value: torch.Tensor) -> None:
        self.writes.append(list(zip(idx[0].tolist(), idx[1].tolist())))
        self.t[idx] = value


def test_ring_rows_pair_within_the_step_and_scatter_once() -> None:
    """Two requests of q = 4 rows (starting at an odd and an even position): a row closing a pair pools its
    partner from the step (j > 0) or from the ring the previous step left (j = 0); the ring ends holding each
    request's newest position of each slot; no two rows scatter into the same ring row of a request's block (a
    duplicate index has an undefined winner on the GPU; the CPU would hide it)."""
    torch.manual_seed(0)
    D, q = 4, 4
    comp = Compressor(8, D, 2, 1e-6)
    x = torch.randn(2 * q, 8)
    starts, blocks = [5, 8], [3, 7]
    pos = torch.tensor([p + j for p in starts for j in range(q)])
    blk = torch.tensor([b for b in blocks for _ in range(q)])
    ring_kv, ring_gate = torch.randn(9, 2, D), torch.randn(9, 2, D)
    old_kv, old_gate = ring_kv.clone(), ring_gate.clone()
    cache = SimpleNamespace(ring_kv=_RecordingRing(ring_kv), ring_gate=_RecordingRing(ring_gate))
    dmd = SimpleNamespace(positions=pos, state_blocks=blk, query_len=q)
    latent, ent = pool_verify_rows(comp, x, dmd, cache)
    kv, gate = comp.project(x)
    for b in range(2 * q):
        p, r = int(pos[b]), b // q
        if p % 2 == 0:
            continue  # an open pair: its entry write goes to the trash slot
        if b % q == 0:  # the partner (p - 1) is from before the step
            wkv = torch.stack([old_kv[blocks[r], (p - 1) % 2], kv[b]])
            wgate = torch.stack([old_gate[blocks[r], (p - 1) % 2], gate[b]])
        else:
            wkv, wgate = kv[b - 1: b + 1], gate[b - 1: b + 1]
        torch.testing.assert_close(latent[b], comp.pool(wkv[None], wgate[None], x.dtype)[0])
        assert int(ent[b]) == (p + 1) // 2 - 1
    for r, (p, blk_id) in enumerate(zip(starts, blocks)):
        for b in range(r * q + q - 2, r * q + q):  # the request's last two rows
            torch.testing.assert_close(ring_kv[blk_id, int(pos[b]) % 2], kv[b])
            torch.testing.assert_close(ring_gate[blk_id, int(pos[b]) % 2], gate[b])
    for rec in (cache.ring_kv, cache.ring_gate):
        real = [w for w in rec.writes[0] if w[0] != NULL_BLOCK]
        assert len(real) == len(set(real)) == 4


# ---- the same step both ways ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "drafter"), [("exact", "dspark"), ("exact", "wrong"), ("padded", "wrong"),
                                               ("graphs", "accept"), ("graphs", "dspark")])
def test_verify_logits_equal_the_eager_forward(tiny_v41: str, baseline: dict[str, list[int]], drafter: str,
                                               mode: str) -> None:
    """Every decode-row verify step is also run by the eager token-row forward from the same caches (cloned before,
    restored after): hidden states (so the logits rejection.verify gets), the drafter's taps and every cache after
    the step (window KV, entries, indexer keys, compressor rings) agree within fp32 round-off; also with the rows
    padded to the graph sizes, and through the graph path's capture and replay (`RerunGraphs`)."""
    ids = [0, 1, 2]
    # the oracle (no taps), all right or wrong every 4 positions, or the checkpoint's drafter
    oracle = None if drafter == "dspark" else _oracle(baseline, ids, wrong_every=4 if drafter == "wrong" else 0)
    e = speculative_engine(tiny_v41, _spec(3), oracle, 4, pad=mode != "exact", graphs=mode == "graphs")
    vd = e.runner.speculator.verify_decode
    pads: list[int] = []
    build = vd.decode.build_groups
    vd.decode.build_groups = lambda names, R, P, *a: (pads.append(P - R), build(names, R, P, *a))[1]
    compared = compare_verify_with_eager(e)
    outs = run_to_completion(e, {str(i): PROMPTS[i] for i in ids}, GREEDY)
    assert outs == {str(i): baseline[str(i)] for i in ids}
    assert len(compared) == vd.num_decode_steps > 0
    assert vd.num_graph_replays == (len(compared) if mode == "graphs" else 0)
    assert any(pads) == (mode != "exact")  # 3 requests pad to the graph of 4


# ---- which steps take the path --------------------------------------------------------------------------------------
def test_uniform_steps_take_the_decode_path_others_stay_eager(tiny_v41: str, baseline: dict[str, list[int]]) -> None:
    """Decisions per step: uniform exactly when every request computes k + 1 tokens with at least one draft: its
    anchor and k drafts (a rejection rewinds nothing: the compressor rings keep slack, kv.spec.ring_slack, so every
    request has its anchor alone pending after a step, rejecting or not); fewer drafts near max_model_len and the
    prefill stay eager (max_model_len 20: the requests end by length, their last steps with room for fewer drafts).
    The counters match the decisions; with the switch off (no VerifyDecode) the drafts are the same."""
    k, ids = 3, [0, 3]
    e = LLMEngine.from_args(tiny_v41, speculative_config=_spec(k), max_num_seqs=4, max_model_len=20)
    e.runner.speculator.set_proposer(OracleProposer(_oracle(baseline, ids, wrong_every=3), 4))
    vd = e.runner.speculator.verify_decode
    seen = _record_uniform(vd)
    run_to_completion(e, {str(r): PROMPTS[i] for r, i in enumerate(ids)}, GREEDY)
    for ok, sched, drafts in seen:
        assert ok == (all(s == k + 1 for s in sched) and all(d >= 1 for d in drafts)), (sched, drafts)
    assert vd.num_decode_steps == sum(ok for ok, _, _ in seen) > 0
    assert vd.num_eager_steps == sum(not ok and any(d) for ok, _, d in seen) > 0
    # no request computes a token before its anchor again (k + 2 tokens with k drafts)
    assert not any((s, d) == (k + 2, k) for _, sched, drafts in seen for s, d in zip(sched, drafts))
    assert all(set(d) == {k} for ok, _, d in seen if ok)  # uniform steps verify k drafts a request
    assert any(0 < max(d) < k for ok, _, d in seen if not ok)  # fewer drafts: max_model_len leaves no room
    off = LLMEngine.from_args(tiny_v41, speculative_config=_spec(k, on=False), max_num_seqs=4)
    assert off.runner.speculator.verify_decode is None
    drafted: dict[str, list[tuple[int, int]]] = {"on": [], "off": []}  # (drafts next step, pending tokens) by mode
    for mode, eng in (("on", e), ("off", off)):
        sp = eng.runner.speculator
        sp.set_proposer(OracleProposer(_oracle(baseline, ids, wrong_every=3), 4))
        orig = sp.launch

        def spy(so: Any, sp: Any = sp, orig: Any = orig, mode: str = mode) -> Any:
            res = orig(so)
            out, rs = res.result(), sp.runner.req_state
            for rid, n in zip(out.req_ids, out.num_draft_tokens or []):
                row = rs.req_id_to_row[rid]
                drafted[mode].append((n, int(rs.num_tokens[row] - rs.num_computed[row])))
            return res

        sp.launch = spy  # type: ignore[method-assign]
    for eng in (e, off):  # the oracle's request ids (the first run's requests are done)
        run_to_completion(eng, {str(r): PROMPTS[i] for r, i in enumerate(ids)}, GREEDY)
    # after every step (rejecting ones included) a drafting request has only its anchor pending and drafts k
    for mode in ("on", "off"):
        assert set(drafted[mode]) == {(k, 1)}, (mode, set(drafted[mode]))


def test_dummy_forward_for_the_memory_profile_writes_nothing_real(tiny_v41: str,
                                                                  baseline: dict[str, list[int]]) -> None:
    # the start-up memory profile's largest verify forward (padding rows) before any request: the outputs after it
    # are plain decoding's, so it wrote only trash slots and the null ring block
    e = LLMEngine.from_args(tiny_v41, speculative_config=_spec(3), max_num_seqs=4)
    vd = e.runner.speculator.verify_decode
    out = vd.dummy_forward()
    D = e.config.model.hidden_size
    assert out.shape == (vd.graphs.capture_sizes[-1], D * (1 + len(vd.tap_layer_ids)))
    assert bool(torch.isfinite(out).all())
    assert run_to_completion(e, {str(i): p for i, p in enumerate(PROMPTS)}, GREEDY) == baseline
    assert vd.num_decode_steps > 0


def test_verify_capture_sizes() -> None:
    """q rows per plain-decode request count, rounded and bounded as the plain sizes; with disable_by_batch_size B
    only up to the first size that holds B - 1 requests."""
    assert verify_capture_sizes([1, 2, 4, 8], 4, 8, None) == [4, 8, 16, 32]
    assert verify_capture_sizes([1, 2, 4, 8], 3, 8, 4) == [3, 6, 12]
    assert verify_capture_sizes([1, 2, 4, 8], 3, 8, 1) == [3]
    assert verify_capture_sizes([1, 2, 4, 8], 4, 8, None, 12) == [4, 8, 16]  # at most 3 requests of 4 tokens


def test_config_switch() -> None:
    dspark = DrafterSpec("deepseek_v41", "dspark", 3, DSparkConfig(3, 4, 1, (2, 4, 5), 8, 8, 2))
    mtp = DrafterSpec("deepseek_v4", "mtp", 1)
    # on by default (with the measured break-even batch for DSpark, none for MTP); false turns it off
    assert parse_speculative_config({"method": "dspark"}, dspark) == SpeculativeConfig("dspark", 4, 32, True)
    assert not parse_speculative_config({"method": "dspark", "verify_decode": False}, dspark).verify_decode
    assert parse_speculative_config({"method": "mtp"}, mtp) == SpeculativeConfig("mtp", 1, None, True)
    assert not parse_speculative_config({"method": "mtp", "verify_decode": False}, mtp).verify_decode  # MTP too
    with pytest.raises(ConfigError, match="true or false"):
        parse_speculative_config({"method": "mtp", "verify_decode": 1}, mtp)
