"""Host fast paths of a decode step give exactly what the general code gave: the plain-greedy sampler path, the
packed input staging (one host->device copy), the O(1) KV-manager steps and the flat history append."""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hf_reference import build_hf_model, make_prompt, save_hf_model

from dsv4.engine.engine import LLMEngine
from dsv4.kv.block_pool import BlockPool
from dsv4.kv.manager import KVCacheManager
from dsv4.kv.spec import COMPRESSED, NULL_BLOCK, STATE, WINDOW, KVGroupSpec
from dsv4.runtime import sampler as sampler_mod
from dsv4.runtime.input_batch import InputBatch, InputBuffers
from dsv4.runtime.request_state import RequestState
from dsv4.runtime.sampler import Sampler, SamplingTensors, greedy_sample, plain_greedy_from
from dsv4.sampling_params import SamplingParams
from dsv4.step import NewRequestData

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def dev(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


# ---------------------------------------------------------------- greedy sampler fast path

PLAIN = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1e-6, top_k=3, top_p=0.2, min_p=0.5, seed=7),  # filters and seeds: not read
    SamplingParams(temperature=0.0, stop_token_ids=[3, 4], ignore_eos=True),
    SamplingParams(temperature=0.0, logit_bias={}),  # empty bias: nothing to add
]
NOT_PLAIN = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, logit_bias={5: 1.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.1),
    SamplingParams(temperature=0.0, frequency_penalty=0.1),
    SamplingParams(temperature=0.0, presence_penalty=-0.1),
]


def test_plain_greedy_classification() -> None:
    assert [plain_greedy_from(sp) for sp in PLAIN] == [0, 0, 0, 0]
    assert all(plain_greedy_from(sp) is None for sp in NOT_PLAIN)
    assert plain_greedy_from(SamplingParams(temperature=0.0, min_tokens=3, max_tokens=9)) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 5), (7, 33), (32, 1000)])
def test_greedy_sample_equals_sampler_with_ties(rows: int, vocab: int, dtype: torch.dtype, dev: torch.device) -> None:
    g = torch.Generator().manual_seed(rows * vocab)
    rng = random.Random(rows)
    for trial in range(5):
        logits = torch.randint(-3, 3, (rows, vocab), generator=g).to(dtype).to(dev)  # many ties at the max
        if trial == 4:
            logits = torch.randn(rows, vocab, generator=g).to(dtype).to(dev)
        params = [rng.choice(PLAIN) for _ in range(rows)]
        # min_tokens reached: plain greedy from then on, whatever stop/eos ids it would ban before
        mt = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[0, 1], max_tokens=5)
        params[0] = mt
        outputs = [[1, 2]] + [[] for _ in range(rows - 1)]
        st = SamplingTensors.build(params, [[] for _ in range(rows)], outputs, vocab, dev, eos_token_ids=(0, 2))
        full, lps = Sampler()(logits, st)
        fast = greedy_sample(logits)
        assert lps is None and fast.dtype == full.dtype == torch.int64
        assert torch.equal(fast, full)
        ref = [row.index(max(row)) for row in logits.float().tolist()]  # lowest index on ties
        assert fast.tolist() == ref


RS_ARGS = dict(max_num_reqs=6, max_model_len=32, device=torch.device("cpu"))


def _add(rs: RequestState, rid: str, sp: SamplingParams, prompt: list[int], out: list[int] | None = None) -> int:
    return rs.add_request(NewRequestData(rid, prompt, out or [], sp, ((),), len(prompt)))


def test_all_plain_greedy_per_row_and_min_tokens() -> None:
    rs = RequestState(**RS_ARGS)
    a = _add(rs, "a", PLAIN[0], [1, 2, 3])
    b = _add(rs, "b", PLAIN[1], [4])
    assert rs.all_plain_greedy(np.array([a, b]))
    for sp in NOT_PLAIN:
        c = _add(rs, "c", sp, [5, 6])
        assert not rs.all_plain_greedy(np.array([a, b, c]))
        assert rs.all_plain_greedy(np.array([a, b]))  # rows that do not sample this step do not matter
        rs.remove_request("c")
        assert rs.all_plain_greedy(np.array([a, b]))
    # min_tokens: the full path until that many outputs exist (it bans stop/eos ids before)
    m = _add(rs, "m", SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), [7], [9])
    assert not rs.all_plain_greedy(np.array([a, m]))
    rs.num_tokens[m] += 1  # a second output token
    rs.output_ids[m].append(9)
    assert rs.all_plain_greedy(np.array([a, m]))
    rs.remove_request("m")
    assert rs._num_never_greedy == 0 and rs._num_greedy_later == 0
    # re-adding an id replaces its row and its counts
    _add(rs, "a", NOT_PLAIN[0], [1])
    assert not rs.all_plain_greedy(np.array([rs.req_id_to_row["a"]]))
    _add(rs, "a", PLAIN[0], [1])
    assert rs._num_never_greedy == 0


def test_append_sampled_index_matches_row_col_write() -> None:
    rs = RequestState(**RS_ARGS)
    rows = np.array([_add(rs, str(i), PLAIN[0], list(range(1, 2 + 3 * i))) for i in range(4)])
    pick = rows[[2, 0, 3]]
    tokens = torch.tensor([11, 12, 13])
    want = rs.token_history.clone()
    want[torch.from_numpy(pick), torch.from_numpy(rs.num_tokens[pick])] = tokens
    nt = rs.num_tokens.copy()
    rs.append_sampled(pick, tokens)  # index built here
    assert torch.equal(rs.token_history, want)
    assert (rs.num_tokens[pick] == nt[pick] + 1).all()
    index = torch.from_numpy(pick * 32 + rs.num_tokens[pick])
    want[torch.from_numpy(pick), torch.from_numpy(rs.num_tokens[pick])] = tokens + 1
    rs.append_sampled(pick, tokens + 1, index)  # index given (InputBatch.append_index)
    assert torch.equal(rs.token_history, want)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model(), str(tmp_path_factory.mktemp("tiny")))


def _run(path: str, reqs: dict[str, tuple[list[int], SamplingParams]], monkeypatch: pytest.MonkeyPatch,
         fast: bool) -> tuple[dict[str, list[int]], int, int]:
    eng = LLMEngine.from_args(path, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                              load_tokenizer=False)
    calls = {"build": 0, "greedy": 0}
    real_build, real_greedy = SamplingTensors.build, sampler_mod.greedy_sample

    def build(*a, **k):
        calls["build"] += 1
        return real_build(*a, **k)

    def greedy(logits):
        calls["greedy"] += 1
        return real_greedy(logits)

    monkeypatch.setattr(SamplingTensors, "build", build)
    monkeypatch.setattr("dsv4.runtime.runner.greedy_sample", greedy)
    if not fast:
        monkeypatch.setattr(eng.runner.req_state, "all_plain_greedy", lambda rows: False)
    for rid, (prompt, sp) in reqs.items():
        eng.add_request(prompt, sp, request_id=rid)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    monkeypatch.undo()
    return done, calls["build"], calls["greedy"]


def test_engine_fast_path_same_tokens_and_taken_only_when_all_plain(ckpt: str, monkeypatch) -> None:
    prompts = [make_prompt(n, seed=s)[0].tolist() for n, s in ((9, 1), (5, 2), (13, 3))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reqs = {str(i): (p, greedy) for i, p in enumerate(prompts)}
    full, builds, _ = _run(ckpt, reqs, monkeypatch, fast=False)
    fast, builds_fast, greedy_calls = _run(ckpt, reqs, monkeypatch, fast=True)
    assert fast == full and builds > 0
    assert builds_fast == 0 and greedy_calls > 0  # every sampling step took the fast path
    # one non-greedy request: every step it samples in goes through SamplingTensors; the greedy ones still match
    for sp in NOT_PLAIN:
        sp = dataclasses.replace(sp, max_tokens=6, ignore_eos=True, seed=3)
        mixed = {**reqs, "x": (prompts[0], sp)}
        got, builds_mixed, _ = _run(ckpt, mixed, monkeypatch, fast=True)
        assert builds_mixed >= 6
        assert {k: got[k] for k in reqs} == full
    # min_tokens: the full path for the first 3 tokens of that request only
    mt = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3)
    got, builds_mt, greedy_mt = _run(ckpt, {"m": (prompts[1], mt)}, monkeypatch, fast=True)
    want, _, _ = _run(ckpt, {"m": (prompts[1], mt)}, monkeypatch, fast=False)
    assert got == want and builds_mt == 3 and greedy_mt == len(got["m"]) - 3


# ---------------------------------------------------------------- packed input staging


class OldInputBuffers:
    """The input buffers before packing: separate tensors, one host->device copy each."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.token_rows = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)


def old_prepare(buffers, token_history, idx_mapping_np, num_computed_np, num_scheduled, sample_batch_rows):
    R, T = len(idx_mapping_np), int(num_scheduled.sum())
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qsl[1:])
    token_rows_np = np.repeat(idx_mapping_np, num_scheduled)
    positions_np = np.repeat(num_computed_np - qsl[:-1], num_scheduled) + np.arange(T)
    buffers.token_rows[:T].copy_(torch.from_numpy(token_rows_np))
    buffers.positions[:T].copy_(torch.from_numpy(positions_np))
    buffers.input_ids[:T] = token_history[buffers.token_rows[:T], buffers.positions[:T]]
    buffers.idx_mapping[:R].copy_(torch.from_numpy(idx_mapping_np.astype(np.int64)))
    buffers.query_start_loc[: R + 1].copy_(torch.from_numpy(qsl.astype(np.int32)))
    buffers.seq_lens[:R].copy_(torch.from_numpy((num_computed_np + num_scheduled).astype(np.int32)))
    return qsl, torch.from_numpy(qsl[1:][sample_batch_rows] - 1).to(buffers.input_ids.device)


def old_make_dummy(buffers, num_reqs, num_tokens):
    # the pre-staging version, kept whole on purpose: its split of the tokens repeats InputBatch.make_dummy's,
    # and sharing that code would make the comparison check it against itself
    base, extra = divmod(num_tokens, num_reqs)
    sched = np.full(num_reqs, base, dtype=np.int64)
    sched[num_reqs - extra:] += 1
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(sched, out=qsl[1:])
    positions_np = np.arange(num_tokens) - np.repeat(qsl[:-1], sched)
    buffers.input_ids[:num_tokens].zero_()
    buffers.positions[:num_tokens].copy_(torch.from_numpy(positions_np))
    buffers.token_rows[:num_tokens].zero_()
    buffers.idx_mapping[:num_reqs].copy_(torch.arange(num_reqs))
    buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(qsl.astype(np.int32)))
    buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(sched.astype(np.int32)))
    return torch.from_numpy(qsl[1:] - 1).to(buffers.input_ids.device)


OLD_NAMES = ("input_ids", "positions", "token_rows", "query_start_loc", "seq_lens", "idx_mapping")


@pytest.mark.parametrize("seed", range(3))
def test_packed_staging_matches_separate_copies(seed: int, dev: torch.device) -> None:
    rng = random.Random(seed)
    R_MAX, T_MAX, L = 8, 40, 50
    hist = torch.randint(0, 1000, (R_MAX, L), generator=torch.Generator().manual_seed(seed)).to(dev)
    old, new = OldInputBuffers(R_MAX, T_MAX, dev), InputBuffers(R_MAX, T_MAX, dev)
    ptrs = {k: t.data_ptr() for k, t in vars(new).items()}
    assert set(OLD_NAMES) <= set(ptrs)
    for k in OLD_NAMES:
        assert getattr(new, k).dtype == getattr(old, k).dtype and getattr(new, k).shape == getattr(old, k).shape
    for step in range(60):
        if rng.random() < 0.15:  # a dummy batch in between (warm-up / profiling)
            R = rng.randint(1, R_MAX)
            T = rng.randint(R, T_MAX)
            want_li = old_make_dummy(old, R, T)
            b = InputBatch.make_dummy(new, R, T)
            assert torch.equal(b.logits_indices, want_li)
        else:
            R = rng.randint(1, R_MAX)
            rows = np.array(rng.sample(range(R_MAX), R), dtype=np.int64)
            decode = rng.random() < 0.5
            sched = np.ones(R, dtype=np.int64) if decode else np.array([rng.randint(1, 8) for _ in range(R)])
            while sched.sum() > T_MAX:
                sched[rng.randrange(R)] = 1
            computed = np.array([rng.randint(0, L - 1 - int(s)) for s in sched], dtype=np.int64)
            sample = np.nonzero(np.array([rng.random() < 0.7 for _ in range(R)]))[0]
            qsl, want_li = old_prepare(old, hist, rows, computed, sched, sample)
            b = InputBatch.prepare(new, hist, [str(r) for r in rows], rows, computed, sched, sample)
            T = int(sched.sum())
            assert b.num_tokens == T and b.num_reqs == R
            assert np.array_equal(b.query_start_loc_np, qsl)
            assert torch.equal(b.logits_indices, want_li)
            seq = computed + sched
            assert b.append_index.tolist() == (rows[sample] * L + seq[sample]).tolist()
            for k in ("idx_mapping", "query_start_loc", "seq_lens", "input_ids", "positions", "token_rows"):
                assert torch.equal(getattr(b, k), getattr(old, k)[: getattr(b, k).shape[0]]), (step, k)
            assert b.input_ids.tolist() == [int(hist[r, p]) for r, p in zip(b.token_rows.tolist(),
                                                                              b.positions.tolist())]
        # whole buffers, stale tails included, equal what the separate copies left
        for k in OLD_NAMES:
            assert torch.equal(getattr(new, k), getattr(old, k)), (step, k)
        assert {k: t.data_ptr() for k, t in vars(new).items()} == ptrs


def test_large_token_budget_copies_only_used_slots(monkeypatch) -> None:
    """A budget far above the step's tokens: the per-token regions travel separately (no huge gap copied);
    results are the same."""
    import dsv4.runtime.input_batch as ib

    monkeypatch.setattr(ib, "_MAX_GAP_BYTES", 64)
    hist = torch.arange(4 * 64).reshape(4, 64)
    old, new = OldInputBuffers(4, 64, torch.device("cpu")), InputBuffers(4, 64, torch.device("cpu"))
    for rows, computed, sched in (([2, 0], [3, 0], [1, 5]), ([1], [7], [40]), ([3, 1, 0], [4, 9, 2], [1, 1, 1])):
        rows, computed, sched = (np.array(x, dtype=np.int64) for x in (rows, computed, sched))
        old_prepare(old, hist, rows, computed, sched, np.arange(len(rows)))
        InputBatch.prepare(new, hist, [str(r) for r in rows], rows, computed, sched, np.arange(len(rows)))
        for k in OLD_NAMES:
            assert torch.equal(getattr(new, k), getattr(old, k)), k


# ---------------------------------------------------------------- KV manager: O(1) decode steps


class OldKVCacheManager(KVCacheManager):
    """allocate_slots / free as they were: every window block re-checked and every group re-measured each call."""

    def allocate_slots(self, req_id, num_tokens, num_computed=0):
        held = self._blocks.get(req_id)
        if held is not None:
            for g, pool, blocks in zip(self.groups, self.pools, held):
                for i in range(min(g.first_live_block(num_computed), len(blocks))):
                    if blocks[i] != NULL_BLOCK:
                        pool.free([blocks[i]])
                        blocks[i] = NULL_BLOCK
        have = [len(b) for b in held] if held is not None else [0] * len(self.groups)
        need = [max(g.num_blocks_for(num_tokens) - h, 0) for g, h in zip(self.groups, have)]
        if any(n > pool.num_free for n, pool in zip(need, self.pools)):
            return None
        new = tuple(pool.allocate(n) for n, pool in zip(need, self.pools))
        if held is None:
            held = self._blocks[req_id] = tuple([] for _ in self.groups)
        for blocks, add in zip(held, new):
            blocks.extend(add)
        return new

    def free(self, req_id):
        held = self._blocks.pop(req_id, None)
        if held is None:
            return
        for pool, blocks in zip(self.pools, held):
            pool.free([b for b in blocks[::-1] if b != NULL_BLOCK])


def _groups(rng: random.Random) -> tuple[KVGroupSpec, ...]:
    bs, ratio, window = rng.choice([1, 2, 4, 8]), rng.choice([2, 4, 8]), rng.choice([0, 3, 8, 16])
    return (
        KVGroupSpec("window", WINDOW, (0, 1), bs, 1, rng.randint(6, 60), sliding_window=window),
        KVGroupSpec(f"compressed_{ratio}", COMPRESSED, (1,), rng.choice([1, 2, 4]), ratio, rng.randint(4, 40)),
        KVGroupSpec("compressor_state", STATE, (1,), 8, 1, rng.randint(2, 6), prefix_cacheable=False),
    )


def _pool_state(p: BlockPool) -> tuple:
    return list(p.ref_cnt), list(OrderedDict(p._free))


@pytest.mark.parametrize("seed", range(12))
def test_kv_manager_matches_the_per_block_version(seed: int) -> None:
    rng = random.Random(seed)
    groups = _groups(rng)
    chunk = rng.choice([None, 4, 16])
    new, old = KVCacheManager(groups, chunk), OldKVCacheManager(groups, chunk)
    progress: dict[str, int] = {}
    for _ in range(600):
        op = rng.random()
        if op < 0.08 and progress:  # finish / preempt a request
            rid = rng.choice(sorted(progress))
            new.free(rid)
            old.free(rid)
            del progress[rid]
            continue
        rid = rng.choice(sorted(progress)) if progress and op < 0.9 else f"r{rng.randrange(10)}"
        computed = progress.get(rid, 0)
        n = 1 if rng.random() < 0.8 else rng.randint(0, 12)  # mostly decodes
        got, want = new.allocate_slots(rid, computed + n, computed), old.allocate_slots(rid, computed + n, computed)
        assert got == want
        if got is not None:
            progress[rid] = computed + n
        assert new.get_block_ids(rid) == old.get_block_ids(rid)
        assert [_pool_state(p) for p in new.pools] == [_pool_state(p) for p in old.pools]
