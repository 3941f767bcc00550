"""The V4.1 prefill / mixed-step attention on token rows (`AttentionV41.forward`: per-token key slots, chunks of
CHUNK rows, the decode path's selection and sink attention) against the loop over requests and query blocks it
replaced, transcribed below as the reference.

Every `AttentionV41.forward` of real engine runs on the golden tiny checkpoint (fp32) also runs the reference on a
copy of the caches taken before the call, with the same input and the reference's own per-request picks: the
layer outputs must agree to fp summation order, the cache writes exactly, and the published top-k picks and
candidate blocks exactly. The runs cover chunked prefill with tiny budgets (7 and 23 tokens: chunks that start
mid-prompt, prefills mixed with decodes, requests that arrive while others decode), steps longer than CHUNK rows
(one request split across two chunks, a chunk of more than CHUNK rows that starts mid-prompt), a step in which no
sequence has a whole ratio-2 entry yet, and a small CHUNK so that later layers read picks published by many chunks.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.models.deepseek_v41 import AttentionV41, StepState, candidate_blocks, candidate_pool
from dsv4.models.layers.attention import grouped_projection, write_slots
from dsv4.models.layers.merged import project
from dsv4.ops.fake_quant import fp8_fake_quant
from dsv4.ops.rope import apply_rope
from dsv4.ops.topk import stable_topk
from dsv4.runtime.attn_metadata import AttnMetadata, slots_of
from dsv4.runtime.kv_cache import LayerKVCache
from loop_reference import QUERY_BLOCK, run_waves, sink_attention, window_keys

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


# ---- the reference: the per-request, per-query-block loop (transcribed from the implementation it replaced) -------
class OldStep:
    """The reference's per-request step state: [T_r, K_r] picks and [T_r, C] candidate blocks per request."""

    def __init__(self) -> None:
        self.topk: list[torch.Tensor | None] = []
        self.candidates: list[torch.Tensor | None] = []


def old_scores(attn: AttentionV41, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, qpos: torch.Tensor
               ) -> torch.Tensor:
    """[Q, n] fp32 indexer scores over one request's entries; entries not visible yet are -inf."""
    s = torch.relu(torch.einsum("qhd,nd->qhn", q, keys.float())) * attn.indexer.head_dim ** -0.5
    s = (s * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] < ((qpos + 1) // attn.ratio)[:, None]
    return s.masked_fill(~visible, float("-inf"))


def old_picks_to_bias(picks: torch.Tensor, n: int) -> torch.Tensor:
    """[Q, K] entry ids (-1 = none) -> [Q, n] 0/-inf bias over the group's first n entries."""
    ok = (picks >= 0) & (picks < n)
    sel = torch.zeros(picks.shape[0], n + 1, dtype=torch.bool, device=picks.device)
    sel.scatter_(1, torch.where(ok, picks, torch.full_like(picks, n)), True)
    return torch.zeros(sel.shape, device=picks.device).masked_fill(~sel, float("-inf"))[:, :n]


def old_select(attn: AttentionV41, step: OldStep, r: int, a: int, b: int, qi: torch.Tensor, iw: torch.Tensor,
               ikeys: torch.Tensor, qpos: torch.Tensor) -> None:
    sched = attn.cfg.v41
    s = old_scores(attn, qi, iw, ikeys, qpos)
    if attn.is_candidate:
        step.candidates[r][a:b] = candidate_blocks(s, qpos, attn.ratio, sched.candidate_block_size,
                                                   sched.candidate_topk_blocks)
    elif attn.uses_candidates and step.candidates and step.candidates[r] is not None:
        blocks = step.candidates[r][a:b]
        entry_block = torch.arange(s.shape[1], device=s.device) // sched.candidate_block_size
        in_pool = (entry_block[None, None, :] == blocks[:, :, None]).any(dim=1)
        s = s.masked_fill(~in_pool, float("-inf"))
    k = step.topk[r].shape[1]
    picks = stable_topk(s, min(k, s.shape[1]))
    picks = torch.where(s.gather(1, picks) > float("-inf"), picks, torch.full_like(picks, -1))
    step.topk[r][a:b, : picks.shape[1]] = picks


def old_forward(attn: AttentionV41, x: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                step: OldStep) -> torch.Tensor:
    T = x.shape[0]
    cache = caches[attn.layer]
    cos, sin = attn.rope(md.positions)
    q_lat, kv_lat = project(attn, x, "wq_a", "wkv")  # the engine's model holds them merged
    qr = attn.q_norm(q_lat)
    q = apply_rope(attn.wq_b(qr).view(T, attn.n_heads, attn.head_dim), cos, sin)
    kv = fp8_fake_quant(apply_rope(attn.kv_norm(kv_lat), cos, sin))
    write_slots(cache.window, md.window_slot_mapping, kv)

    src = caches[attn.kv_source] if attn.kv_source is not None else None
    if attn.is_kv_source:
        attn._publish_entries(x, md, cache)
    if attn.is_index_source:
        qi, iw = attn.indexer.queries(x, qr, cos, sin)
        step.topk = [None] * md.num_reqs
        if attn.is_candidate:
            step.candidates = [None] * md.num_reqs
    comp_group = md.groups[f"compressed_{attn.ratio}"] if attn.ratio > 0 else None
    sched = attn.cfg.v41

    win_group = md.groups["window"]
    win_table = md.block_tables["window"]
    out = torch.empty_like(q)
    qsl = md.query_start_loc_cpu
    for r in range(md.num_reqs):
        t0, t1 = qsl[r], qsl[r + 1]
        if t0 == t1:
            continue
        ckeys = ikeys = None
        n_all = 0
        if comp_group is not None:
            n_all = md.seq_len(r) // attn.ratio
            if n_all > 0:
                ent = torch.arange(n_all, device=x.device)
                slots = slots_of(md.block_tables[comp_group.name][r], ent, comp_group.block_size)
                ckeys = src.compressed[slots]
                if attn.is_index_source:
                    ikeys = src.index_keys[slots]
            if attn.is_index_source:
                k = min(attn.indexer.topk, max(n_all, 1))
                step.topk[r] = torch.full((t1 - t0, k), -1, dtype=torch.long, device=x.device)
                if attn.is_candidate:
                    c = sched.candidate_topk_blocks
                    step.candidates[r] = torch.full((t1 - t0, c), -1, dtype=torch.long, device=x.device)
        for b0 in range(t0, t1, QUERY_BLOCK):
            b1 = min(b0 + QUERY_BLOCK, t1)
            qpos = md.positions[b0:b1]
            keys, bias = window_keys(cache.window, win_table[r], win_group.block_size, qpos, attn.window)
            if ckeys is not None:
                if attn.is_index_source:
                    old_select(attn, step, r, b0 - t0, b1 - t0, qi[b0:b1], iw[b0:b1], ikeys, qpos)
                picks = step.topk[r][b0 - t0:b1 - t0] if step.topk and step.topk[r] is not None else None
                cbias = (old_picks_to_bias(picks, n_all) if picks is not None else
                         torch.full((b1 - b0, n_all), float("-inf"), device=x.device))
                keys = torch.cat([keys, ckeys], dim=0)
                bias = torch.cat([bias, cbias], dim=1)
            out[b0:b1] = sink_attention(q[b0:b1], keys, bias, attn.attn_sink, attn.head_dim ** -0.5)

    out = apply_rope(out, cos, sin, inverse=True)
    return attn.wo_b(grouped_projection(out, attn.wo_a.weight, attn.o_groups))


# ---- the check -------------------------------------------------------------------------------------------------
def _snapshot(caches: list[LayerKVCache]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in vars(c).items() if isinstance(v, torch.Tensor)} for c in caches]


def _restore(caches: list[LayerKVCache], snap: list[dict[str, torch.Tensor]]) -> None:
    for c, s in zip(caches, snap):
        for k, v in s.items():
            getattr(c, k).copy_(v)


def _same_picks(new: torch.Tensor | None, old: list[torch.Tensor | None], qsl: list[int]) -> None:
    """The token rows' picks equal the reference's per-request picks (whose width may be smaller: -1 beyond)."""
    for r, want in enumerate(old):
        if want is None:
            continue
        if new is None:  # no entry anywhere in the step: the reference picked nothing either
            assert (want == -1).all(), r
            continue
        got, k = new[qsl[r]:qsl[r + 1]], want.shape[1]
        assert got.shape[1] >= k and torch.equal(got[:, :k], want), (r, got, want)
        assert (got[:, k:] == -1).all(), r


class Recorder:
    """Counts what the checked forwards covered."""

    def __init__(self) -> None:
        self.calls = 0
        self.max_diff = 0.0
        self.max_rows = 0
        self.mid_prompt_long = False  # a request's chunk of more than CHUNK rows starting past position 0
        self.no_entries = False  # a compressed layer with no entry in the whole step
        self.multi_chunk_picks = False  # a later layer read picks published by more than one chunk


def _install_check(monkeypatch: pytest.MonkeyPatch, rec: Recorder) -> None:
    new_forward = AttentionV41.forward

    def checked(self: AttentionV41, x: torch.Tensor, md: AttnMetadata, caches: list[LayerKVCache],
                step: StepState) -> torch.Tensor:
        old = step.__dict__.setdefault("_reference_step", OldStep())
        snap = _snapshot(caches)
        want = old_forward(self, x, md, caches, old)
        want_caches = _snapshot(caches)
        _restore(caches, snap)
        got = new_forward(self, x, md, caches, step)
        for c, w in zip(caches, want_caches):  # the same cache writes (shared code): exactly
            for name, t in w.items():
                assert torch.equal(getattr(c, name), t), (self.layer, name)
        d = (got - want).abs().max().item() if got.numel() else 0.0
        assert d < 1e-5, (self.layer, d)
        qsl = md.query_start_loc_cpu
        if self.is_index_source:
            _same_picks(step.topk, old.topk, qsl)
        if self.is_candidate:
            _same_picks(step.candidates, old.candidates, qsl)
        T = x.shape[0]
        rec.calls += 1
        rec.max_diff = max(rec.max_diff, d)
        rec.max_rows = max(rec.max_rows, T)
        rec.mid_prompt_long |= any(qsl[r + 1] - qsl[r] > AttentionV41.CHUNK and md.context_lens_cpu[r] > 0
                                   for r in range(md.num_reqs))
        if self.ratio > 0:
            rec.no_entries |= step.keys.width(f"compressed_{self.ratio}") == 0
            rec.multi_chunk_picks |= not self.is_index_source and T > AttentionV41.CHUNK
        return got

    monkeypatch.setattr(AttentionV41, "forward", checked)


def _engine(budget: int, max_model_len: int = 128) -> LLMEngine:
    return LLMEngine.from_args(GOLDEN, max_model_len=max_model_len, max_num_seqs=4, max_num_batched_tokens=budget,
                               block_size=8, load_tokenizer=False)


@pytest.mark.parametrize("budget", [7, 23])
def test_chunked_prefill_mixed_with_decodes(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    rec = Recorder()
    _install_check(monkeypatch, rec)
    run_waves(_engine(budget), [[1], [13, 30], [5, 40, 2]], max_tokens=5, seed=budget)
    assert rec.calls > 0 and rec.max_diff < 1e-5


def test_step_without_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only 1-token sequences (a warm-up batch; the engine runs such real steps on the decode path): no ratio-2
    entry anywhere in the step, so those layers attend over the window alone and publish no picks."""
    eng = _engine(7)
    rec = Recorder()
    _install_check(monkeypatch, rec)
    eng.runner.dummy_run(3, 3)
    assert rec.no_entries and rec.max_diff < 1e-5


def test_steps_longer_than_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    _install_check(monkeypatch, rec)
    # budget 300: step 1 = prompt 0's 0..299 (two chunks); step 2 = its 300..599 (mid-prompt, > CHUNK) + others
    run_waves(_engine(300, max_model_len=1024), [[700], [20, 3]], max_tokens=3, seed=1)
    assert rec.max_rows > AttentionV41.CHUNK and rec.mid_prompt_long and rec.multi_chunk_picks
    assert rec.max_diff < 1e-5


def test_many_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """CHUNK 5: chunk borders inside every request, picks and candidate blocks joined from many chunks."""
    monkeypatch.setattr(AttentionV41, "CHUNK", 5)
    rec = Recorder()
    _install_check(monkeypatch, rec)
    run_waves(_engine(23), [[17, 9], [30]], max_tokens=5, seed=2)
    assert rec.multi_chunk_picks and rec.max_diff < 1e-5


@pytest.mark.parametrize("R,C,n,block", [(1, 4, 37, 8), (5, 16, 64, 8), (3, 2048, 136, 8), (4, 6, 9, 4), (2, 3, 1, 8)])
def test_candidate_pool_is_the_entry_by_candidate_comparison(R: int, C: int, n: int, block: int) -> None:
    """The pool mask through a per-row block map equals comparing every entry's block with every candidate (the
    formula as written first), with -1 (none), repeated ids and ids past the last block among the candidates."""
    g = torch.Generator().manual_seed(R * 1000 + C + n)
    nb = -(-n // block)
    cands = torch.randint(-1, nb + 3, (R, C), generator=g)  # -1, every block, and ids beyond the entries
    cands[0, : min(C, 2)] = -1
    entry_block = torch.arange(n) // block
    want = (entry_block[None, None, :] == cands[:, :, None]).any(dim=1)
    got = candidate_pool(cands, n, block)
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert not candidate_pool(torch.full((R, C), -1), n, block).any()
