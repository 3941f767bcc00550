"""The specialized decode on CUDA: recorded decode-metadata builds replay to what an eager build writes, for every
key and random batches; forked and serial recordings agree; greedy tokens are the same with the specialized decode
on and off; a recapture releases and records the builds again."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.ops.lookback import gather_lookback_torch
from dsv4.runtime.input_batch import InputBatch
from dsv4.runtime.model_state import DeepseekV41SpecializedDecodeModelState
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "deepseek-v41-tiny")
MAX_LEN = 512


def _engine(backend: str, **kw: object) -> LLMEngine:
    return LLMEngine.from_args(GOLDEN, device="cuda", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=8,
                               block_size=16, cudagraph_capture_sizes=(1, 2, 4, 8), load_tokenizer=False,
                               decode_backend=backend, **kw)


def _fields(md) -> dict[str, torch.Tensor]:  # noqa: ANN001
    R = md.num_reqs
    out = {f: getattr(md, f).clone() for f in ("positions", "window_slots", "window_mask", "write_slots",
                                               "state_blocks")}
    for name in md.n_entries:
        out[f"n_{name}"] = md.n_entries[name].clone()
        out[f"w_{name}"] = md.entry_write[name].clone()
        n = md.n_entries[name][:R].tolist()
        bs = md.entry_geometry[name][0]
        out[f"e_{name}"] = torch.cat([md.entry_tables[name][r, : -(-n[r] // bs)] for r in range(R)]
                                     or [md.entry_tables[name][0, :0]])
    return out


def _random_step(runner, R: int, gen: torch.Generator) -> InputBatch:  # noqa: ANN001
    """Random state rows and positions (up to max_model_len - 1), random block tables for those rows."""
    rows = torch.randperm(8, generator=gen)[:R].numpy()
    computed = torch.randint(0, MAX_LEN - 1, (R,), generator=gen).numpy()
    computed[0] = MAX_LEN - 2  # the worst case: a full-length row
    for name, t in runner.block_tables.tables.items():
        t[rows] = torch.randint(1, 50, (R, t.shape[1]), generator=gen, dtype=torch.int32).to(t.device)
    ones = torch.ones(R, dtype=torch.int64).numpy()
    return InputBatch.prepare(runner.buffers, runner.req_state.token_history, [f"r{i}" for i in range(R)], rows,
                              computed, ones, ones.nonzero()[0])


@pytest.mark.parametrize("fork", [True, False])
def test_replayed_builds_equal_eager_builds_for_every_key(fork: bool) -> None:
    eng = _engine("latency_specialized")
    runner = eng.runner
    state = runner.model_state
    assert isinstance(state, DeepseekV41SpecializedDecodeModelState)
    state.graphs.fork = fork
    runner.capture_graphs()  # records again with this forking choice
    keys = state.graphs.capture_keys()
    assert state.graphs.recorded() == sorted(keys) and len(keys) == 8
    gen = torch.Generator().manual_seed(int(fork))
    hist = runner.req_state.token_history
    hist.copy_(torch.randint(0, 1000, hist.shape, generator=gen, dtype=hist.dtype))
    state._req_state = runner.req_state  # (set by the first real step) the staged lookback gather reads it
    for key in keys:
        R, P = key[0], key[1]
        for _ in range(3):
            batch = _random_step(runner, R, gen)
            replayed = state.prepare_decode_attn(batch, runner.block_tables, P, full_graph=True)
            got = _fields(replayed)
            captured = state.graphs._graphs[key][1]
            assert replayed is captured  # the object recorded with the key, no new metadata
            eager = state.decode.build(R, P, batch.positions, batch.idx_mapping, runner.block_tables.tables)
            want = _fields(eager)
            for f in want:
                assert torch.equal(got[f], want[f]), (key, f)
            # the lookback gather staged beside the replay, joined by prepare_inputs, equals the reference gather
            staged = state._staged
            assert staged is not None and staged[0] is batch
            window = state.prepare_inputs(batch, runner.req_state)["lookback_token_ids"].clone()
            ref = gather_lookback_torch(torch.empty_like(window), batch.idx_mapping,
                                        batch.positions[batch.query_start_loc[:R].long()], hist, R)
            assert torch.equal(window, ref), key
    assert state.graphs.num_replays == 3 * len(keys) and state.graphs.num_misses == 0


def _greedy(eng: LLMEngine) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    for i in range(7):
        prompt = torch.randint(3, 280, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen).tolist()
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True),
                        request_id=str(i))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_tokens_equal_with_and_without_the_specialized_decode_and_after_a_recapture() -> None:
    want = _greedy(_engine("default"))
    eng = _engine("latency_specialized")
    assert _greedy(eng) == want
    state = eng.runner.model_state
    assert state.graphs.num_replays > 0  # the decode steps went through recorded builds
    first = dict(state.graphs._graphs)
    eng.runner.capture_graphs()  # as after a KV-cache re-initialization: everything released, recorded again
    assert state.graphs.recorded() == sorted(first) and all(state.graphs._graphs[k] is not first[k] for k in first)
    n = state.graphs.num_replays
    assert _greedy(eng) == want and state.graphs.num_replays > n
