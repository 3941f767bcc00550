"""The specialized decode's CPU-checkable parts (runtime.md 5.6; tests/gpu/test_metadata_graphs_gpu.py records and
replays the builds on a GPU): graph keys and capture keys against worked examples, the eager fallback of an
unrecorded key, forked-build grouping by block-table storage, replay-start uploads only when a row replays, and the
engine with `decode_backend="latency_specialized"` on the CPU (no graphs: every step falls back) giving the default
backend's tokens."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.models.config import ConfigError
from dsv4.runtime.attn_metadata import DecodeMetadataBuffers
from dsv4.runtime.metadata_graphs import AttnMetadataGraphs, GroupBuild, branches_by_storage, capture_keys, step_key
from dsv4.runtime.model_state import DeepseekV41ModelState, DeepseekV41SpecializedDecodeModelState
from dsv4.sampling_params import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


def test_capture_keys_worked_examples() -> None:
    # q = 1: graphs of 1, 2, 4, 8 requests; a step of 3 requests pads to 4, of 5-8 to 8
    assert capture_keys([1, 2, 4, 8], 1, 8) == [
        (8, 8, 8, 8), (7, 8, 7, 8), (6, 8, 6, 8), (5, 8, 5, 8), (4, 4, 4, 4), (3, 4, 3, 4), (2, 2, 2, 2),
        (1, 1, 1, 1)]
    # max_num_seqs drops the graphs past it; unsorted, repeated sizes are fine
    assert capture_keys([8, 4, 1, 4, 2], 1, 5) == [(4, 4, 4, 4), (3, 4, 3, 4), (2, 2, 2, 2), (1, 1, 1, 1)]
    # q = 2 (one draft token): token sizes round up to whole requests (1 and 2 tokens -> 1 request, 5 -> 3, 8 -> 4),
    # so 2 requests pad to the 3-request graph; 16 tokens (8 requests) exceed max_num_seqs = 6
    want = [(4, 4, 8, 8), (3, 3, 6, 6), (2, 3, 4, 6), (1, 1, 2, 2)]
    assert capture_keys([1, 2, 5, 8], 2, 8) == want
    assert capture_keys([1, 2, 5, 8, 16], 2, 6) == want
    # a single large graph serves every request count up to it
    assert [k[0] for k in capture_keys([6], 1, 16)] == [6, 5, 4, 3, 2, 1]


def test_step_key_only_for_full_uniform_decodes() -> None:
    one = np.ones(3, dtype=np.int64)
    assert step_key(one, 4, 1, has_prefill=False) == (3, 4, 3, 4)
    assert step_key(np.full(3, 2), 4, 2, has_prefill=False) == (3, 4, 6, 8)
    assert step_key(one, None, 1, has_prefill=False) is None  # no FULL graph for this size (eager forward)
    assert step_key(one, 4, 1, has_prefill=True) is None  # a prefill (or replaying) row
    assert step_key(np.array([1, 2, 1]), 4, 1, has_prefill=False) is None  # not uniform
    assert step_key(np.full(3, 2), 4, 1, has_prefill=False) is None  # uniform but not the decode query length
    assert step_key(one, 4, 1, has_prefill=False, adaptive=True) is None  # the device splits the drafts
    assert step_key(np.zeros(0, dtype=np.int64), 1, 1, has_prefill=False) is None
    # every key capture_keys lists is the key of the step it serves
    for key in capture_keys([1, 2, 4, 8, 16], 1, 16):
        assert step_key(np.ones(key[0], dtype=np.int64), key[1], 1, has_prefill=False) == key


def test_unrecorded_key_falls_back_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    graphs = AttnMetadataGraphs([1, 2, 4], 1, 4)
    with caplog.at_level(logging.WARNING):
        assert graphs.replay((3, 4, 3, 4)) is None
        assert graphs.replay((1, 1, 1, 1)) is None
    assert graphs.num_misses == 2 and graphs.num_replays == 0
    assert sum("no recorded metadata build" in r.message for r in caplog.records) == 1


def test_forked_builds_are_grouped_by_table_storage() -> None:
    base = torch.zeros(4, 8, dtype=torch.int32)
    other = torch.zeros(4, 8, dtype=torch.int32)
    views = (base[:, :4], base[:, 4:])  # one storage (a packed table), two groups
    order: list[str] = []

    def build(name: str, table: torch.Tensor) -> GroupBuild:
        return GroupBuild(name, table, lambda key, name=name: order.append(name))

    builds = [build("a", views[0]), build("b", other), build("c", views[1]), build("d", torch.zeros(2))]
    branches = branches_by_storage(builds)
    assert [[b.name for b in br] for br in branches] == [["a", "c"], ["b"], ["d"]]
    # on the CPU a build runs serially, in the builds' order, and returns the finished metadata
    graphs = AttnMetadataGraphs([1], 1, 1)
    assert graphs.build((1, 1, 1, 1), builds, lambda key: ("md", key)) == ("md", (1, 1, 1, 1))
    assert order == ["a", "b", "c", "d"]
    assert not AttnMetadataGraphs.can_record(builds + [GroupBuild("x", other, lambda key: None, can_record=False)])
    assert AttnMetadataGraphs.can_record(builds)


def _greedy(backend: str, **kw: object) -> tuple[dict[str, list[int]], LLMEngine]:
    eng = LLMEngine.from_args(GOLDEN, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                              load_tokenizer=False, decode_backend=backend, **kw)
    prompts = {"a": list(range(3, 43)), "b": list(range(3, 43)) + [7, 8], "c": list(range(50, 61))}
    for rid, p in prompts.items():
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), request_id=rid)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out, eng


def test_specialized_backend_on_the_cpu_gives_the_default_tokens() -> None:
    want, _ = _greedy("default")
    got, eng = _greedy("latency_specialized")
    assert got == want
    state = eng.runner.model_state
    assert isinstance(state, DeepseekV41SpecializedDecodeModelState)
    assert state.graphs.num_replays == 0 and not state.graphs.recorded()  # no CUDA graphs on the CPU


def test_replay_bounds_are_uploaded_only_by_steps_with_a_replaying_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """"b" hits "a"'s cached prefix and replays; every other step (prefills without a hit, decodes) uploads
    nothing, and a decode after the replaying steps builds metadata without any replay."""
    steps: list[tuple[bool, int, object]] = []
    orig = DeepseekV41ModelState.prepare_attn

    def record(state, batch, block_tables, for_dummy: bool = False):  # noqa: ANN001, ANN202
        before = state.num_replay_uploads
        md = orig(state, batch, block_tables, for_dummy)
        steps.append((state.replaying(batch), state.num_replay_uploads - before, md.window_floor))
        return md

    monkeypatch.setattr(DeepseekV41ModelState, "prepare_attn", record)
    _, eng = _greedy("latency_specialized")
    assert any(r for r, _, _ in steps) and not all(r for r, _, _ in steps)
    for replaying, uploads, floor in steps:
        assert uploads == (1 if replaying else 0)
        assert (floor is not None) == replaying
    assert eng.runner.model_state.num_replay_uploads == sum(r for r, _, _ in steps)


def test_specialized_backend_is_for_v41_only(tmp_path: object) -> None:
    from dsv4.make_model import make_model

    v4 = make_model("tiny-v4", str(tmp_path) + "/v4", seed=0)
    with pytest.raises(ConfigError, match="latency_specialized.*DeepSeek-V4.1"):
        LLMEngine.from_args(v4, max_model_len=64, load_tokenizer=False, decode_backend="latency_specialized")
    with pytest.raises(ConfigError, match="decode_backend must be one of"):
        LLMEngine.from_args(GOLDEN, max_model_len=64, load_tokenizer=False, decode_backend="fast")


def test_a_full_step_without_a_recording_builds_eagerly() -> None:
    """The model state's fallback: a FULL decode step whose key was never recorded builds its metadata eagerly,
    exactly as the default backend does, and counts the miss."""
    from dsv4.runtime.input_batch import InputBatch

    eng = LLMEngine.from_args(GOLDEN, max_model_len=128, max_num_seqs=4, block_size=4, load_tokenizer=False,
                              decode_backend="latency_specialized")
    runner = eng.runner
    state = runner.model_state
    g = torch.Generator().manual_seed(0)
    for name, t in runner.block_tables.tables.items():
        t.copy_(torch.randint(1, 30, t.shape, generator=g, dtype=torch.int32))
    rows, computed, ones = np.array([2, 0, 3]), np.array([100, 5, 63]), np.ones(3, dtype=np.int64)
    batch = InputBatch.prepare(runner.buffers, runner.req_state.token_history, ["x", "y", "z"], rows, computed,
                               ones, np.arange(3))
    for t in (state.decode.window_slots, state.decode.write_slots, state.decode.positions):
        t.fill_(-7)  # poison: the fallback must write every row
    md = state.prepare_decode_attn(batch, runner.block_tables, 4, full_graph=True)
    assert state.graphs.num_misses == 1 and state.graphs.num_replays == 0
    ref = DecodeMetadataBuffers(runner.groups, 4, 128, state.decode.window, torch.device("cpu"))
    want = ref.build_torch(3, 4, batch.positions, {k: v[batch.idx_mapping] for k, v in
                                                   runner.block_tables.tables.items()})
    assert md.num_reqs == 3 and md.num_padded == 4 and md.window_slots.data_ptr() != want.window_slots.data_ptr()
    for f in ("positions", "window_slots", "window_mask", "write_slots", "state_blocks"):
        assert torch.equal(getattr(md, f), getattr(want, f)), f
    for name in want.n_entries:
        assert torch.equal(md.n_entries[name], want.n_entries[name])
        assert torch.equal(md.entry_write[name], want.entry_write[name])
