"""Runner invariants (runtime.md section 1 and (ii)): stable rows, persistent buffers, the device token history,
the ModelState hook order, and dummy batches that never touch a real request's KV."""

from __future__ import annotations

import os

import pytest
import torch
from hf_reference import build_hf_model, make_prompt, save_hf_model

from dsv4.engine.engine import LLMEngine
from dsv4.runtime.model_state import DefaultModelState
from dsv4.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model(), str(tmp_path_factory.mktemp("tiny")))


class RecordingState(DefaultModelState):
    """Records the hook calls of every step."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[str] = []

    def add_request(self, row, new_req) -> None:
        self.calls.append(f"add:{new_req.req_id}:{row}")

    def remove_request(self, req_id) -> None:
        self.calls.append(f"remove:{req_id}")

    def prepare_attn(self, batch, block_tables, for_dummy=False):
        self.calls.append("attn")
        return super().prepare_attn(batch, block_tables, for_dummy)

    def prepare_decode_attn(self, batch, block_tables, num_padded, full_graph=False):
        self.calls.append("attn")
        return super().prepare_decode_attn(batch, block_tables, num_padded, full_graph)

    def prepare_inputs(self, batch, req_state):
        self.calls.append("inputs")
        return super().prepare_inputs(batch, req_state)


def _engine(path: str) -> LLMEngine:
    return LLMEngine.from_args(path, max_model_len=64, max_num_seqs=3, max_num_batched_tokens=8, block_size=8,
                               load_tokenizer=False)


def test_rows_buffers_history_and_hook_order(ckpt: str) -> None:
    eng = _engine(ckpt)
    runner = eng.runner
    sc = eng.config.scheduler
    runner.model_state = state = RecordingState(eng.groups, sc.max_num_seqs, sc.max_model_len,
                                                eng.config.model.sliding_window, runner.device)
    ptrs = {name: t.data_ptr() for name, t in vars(runner.buffers).items()}
    table_ptrs = {n: t.data_ptr() for n, t in runner.block_tables.tables.items()}
    prompts = {str(i): make_prompt(n, seed=20 + i)[0].tolist() for i, n in enumerate((11, 4, 7))}
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for rid, p in prompts.items():
        eng.add_request(p, greedy, request_id=rid)
    rows_seen: dict[str, set[int]] = {}
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for rid, row in runner.req_state.req_id_to_row.items():
            rows_seen.setdefault(rid, set()).add(row)
            # the device history holds the prompt and every sampled token, in order
            n = int(runner.req_state.num_tokens[row])
            hist = runner.req_state.token_history[row, :n].tolist()
            assert hist[: len(prompts[rid])] == prompts[rid]
        # persistent buffers and tables keep their addresses every step (graphs rely on it)
        assert {name: t.data_ptr() for name, t in vars(runner.buffers).items()} == ptrs
        assert {n: t.data_ptr() for n, t in runner.block_tables.tables.items()} == table_ptrs
    assert all(len(rows) == 1 for rows in rows_seen.values())  # a request keeps its row
    # hook order within a step: add/remove first, then prepare_attn, then prepare_inputs
    steps, cur = [], []
    for c in state.calls:
        cur.append(c.split(":")[0])
        if c == "inputs":
            steps.append(cur)
            cur = []
    for s in steps:
        assert s[-2:] == ["attn", "inputs"] and "attn" not in s[:-2] and "inputs" not in s[:-2]
    # finished rows are given back and reused
    eng.step()
    assert runner.req_state.num_active == 0 and len(runner.req_state.free_rows) == 3
    eng.add_request(prompts["1"], greedy, request_id="again")
    eng.step()
    assert runner.req_state.req_id_to_row["again"] in range(3)
    assert len(done) == 3


def test_dummy_run_leaves_real_kv_untouched(ckpt: str) -> None:
    eng = _engine(ckpt)
    eng.add_request(make_prompt(12, seed=3)[0].tolist(), SamplingParams(temperature=0, max_tokens=20), "r")
    for _ in range(3):
        eng.step()
    before = [c.window.clone() for c in eng.runner.kv_caches]
    bs = eng.groups[0].block_size
    logits = eng.runner.dummy_run(num_reqs=2, num_tokens=7)
    assert logits.shape == (2, eng.config.model.vocab_size) and torch.isfinite(logits).all()
    for c, b in zip(eng.runner.kv_caches, before):
        # only the null block (slots [0, bs)) may change
        assert torch.equal(c.window[bs:], b[bs:])


GOLDEN_V41 = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


def _greedy_tokens(eng: LLMEngine) -> list[list[int]]:
    for i, n in enumerate((9, 30)):
        eng.add_request([5 + (3 * i + j) % 200 for j in range(n)], SamplingParams(temperature=0, max_tokens=6,
                                                                                ignore_eos=True), request_id=str(i))
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(2)]


def test_start_up_warms_the_step_kernels_outside_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine construction launches the decode-metadata build and the engram lookback gather (their JIT
    compilation then happens at start-up, not in the first request's step), and the warm-up changes no token."""
    import dsv4.runtime.model_state as ms
    from dsv4.runtime.attn_metadata import DecodeMetadataBuffers

    want = _greedy_tokens(LLMEngine.from_args(GOLDEN_V41, load_tokenizer=False, max_model_len=64))
    calls: list[str] = []
    build, gather = DecodeMetadataBuffers.build, ms.gather_lookback
    monkeypatch.setattr(DecodeMetadataBuffers, "build", lambda self, *a: calls.append("build") or build(self, *a))
    monkeypatch.setattr(ms, "gather_lookback", lambda *a: calls.append("gather") or gather(*a))
    eng = LLMEngine.from_args(GOLDEN_V41, load_tokenizer=False, max_model_len=64)
    # before any request, at 1, 2 and 16 requests (the Triton integer classes of the request count)
    assert eng.runner.num_warm_ups == 1 and calls == ["build", "gather"] * 3
    # poison what the warm-up wrote: every step must rewrite it before reading it
    eng.runner.model_state.lookback_token_ids.fill_(7)
    eng.runner.model_state.decode.window_slots.fill_(3)
    assert _greedy_tokens(eng) == want
