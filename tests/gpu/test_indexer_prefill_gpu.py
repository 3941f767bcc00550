"""The fused prefill indexer selection (dsv4/ops/indexer_prefill.py `prefill_select_triton`, issue 23 item 1) against
its torch reference on the GPU at V4.1-Flash-8l shapes (32 index heads of 128, top-512, candidate blocks of 8
entries, keep 2048; layer 1 ratio 2 plain, layer 4 ratio 1 the candidate source, layer 6 ratio 1 pooled by it), and
its time at 16,384 and 32,768 prompt tokens, printed (run with -s); with DSV4_INDEXER_BASELINE=1 next to the torch
path it replaced (the model's `_select` + `pick_sources` over its row chunks) and a tiling sweep, which take minutes.

Inputs sit on exact grids (queries and keys on halves, head weights on quarters, the scale a power of two: every
score exact in fp32 whatever the order, and the queries and keys exact in bf16), so picks, their order, slots, mask
and candidate blocks must be equal, ties included. The reference runs on row chunks (it is row by row) to bound its
[rows, entries, 128] key gather."""

from __future__ import annotations

import os
import time

import pytest
import torch

from dsv4.ops.indexer import candidate_blocks_of, candidate_pool, indexer_scores, pick_sources
from dsv4.ops.indexer_prefill import prefill_select_torch, prefill_select_triton
from dsv4.ops.topk import stable_topk
from dsv4.runtime.attn_metadata import row_chunks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

H, D, K, CB, KEEP = 32, 128, 512, 8, 2048
WINDOW, HEAD_DIM = 128, 512  # the attention's, for the current path's row chunks
SCALE = 2.0 ** -3  # a power of two near 128^-0.5: exact scores
BASELINE = os.environ.get("DSV4_INDEXER_BASELINE") == "1"  # also time the replaced torch path (and sweep tilings)


def _step(reqs: list[tuple[int, int]], ratio: int, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill / mixed step's rows as TokenKeySlots has them: per request (context, new tokens), rows at positions
    context.. seeing entries e < (pos + 1) // ratio of the request's own entry slots (zeroed past n)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E = [(c + l) // ratio for c, l in reqs]
    M, N = max(E), sum(E) + 64
    perm = torch.randperm(N - 1, device="cuda", generator=g) + 1
    es, ns, at = [], [], 0
    e_ids = torch.arange(M, device="cuda")
    for (c, l), e in zip(reqs, E):
        n = (torch.arange(c, c + l, device="cuda") + 1) // ratio
        row = torch.zeros(M, dtype=torch.int64, device="cuda")
        row[:e] = perm[at:at + e]
        at += e
        es.append(row.expand(l, M).masked_fill(e_ids[None, :] >= n[:, None], 0))
        ns.append(n)
    eslots, n = torch.cat(es), torch.cat(ns)
    R = eslots.shape[0]
    grid = lambda x: (x * 2).round() / 2  # noqa: E731
    q = grid(torch.randn(R, H, D, device="cuda", generator=g))
    w = (torch.randn(R, H, device="cuda", generator=g) * 4).round() / 4
    keys = grid(torch.randn(N, D, device="cuda", generator=g)).to(torch.bfloat16)
    return q, w, keys, eslots, n


def _by_request(reqs: list[tuple[int, int]], eslots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step's slots one row per request (TokenKeySlots' form: a request's last token sees all its
    entries) and each token row's request."""
    lens = torch.tensor([l for _, l in reqs], device="cuda")
    last = torch.cumsum(lens, 0) - 1
    return eslots[last], torch.repeat_interleave(torch.arange(len(reqs), device="cuda"), lens)


def _reference(q, w, keys, eslots, n, pool=None, keep=0, rows: torch.Tensor | None = None, chunk: int = 32):
    """prefill_select_torch on row chunks (of the given rows only, when given)."""
    idx = torch.arange(q.shape[0], device="cuda") if rows is None else rows
    parts = []
    for a in range(0, idx.numel(), chunk):
        r = idx[a:a + chunk]
        parts.append(prefill_select_torch(q[r], w[r], keys, eslots[r], n[r], SCALE, K,
                                          None if pool is None else pool[r], CB, keep))
    return tuple(None if parts[0][i] is None else torch.cat([p[i] for p in parts]) for i in range(4))


def _assert_equal(ref, got, rows: torch.Tensor | None = None) -> None:
    sub = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
    for a, b in zip(ref[:3], got[:3]):
        b = sub(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.shape, b.shape)
        bad = (a != b).any(dim=1).nonzero().flatten()
        assert bad.numel() == 0, f"{bad.numel()} rows differ, first {bad[:5].tolist()}"
    assert (ref[3] is None) == (got[3] is None)
    if ref[3] is not None:
        assert torch.equal(ref[3], sub(got[3]))


@pytest.mark.parametrize("name,reqs,ratio", [
    ("one request 4096 tokens, ratio 1", [(0, 4096)], 1),
    ("a 2048-token chunk at context 6144, ratio 2 (splits)", [(6144, 2048)], 2),
    ("mixed step: three prefills and 8 decode rows, ratio 1",
     [(0, 1000), (3000, 500), (0, 700)] + [(5000 + 97 * i, 1) for i in range(8)], 1),
], ids=["one-request", "chunk-splits", "mixed-step"])
def test_prefill_select_equals_reference(name: str, reqs: list, ratio: int) -> None:
    """Plain, the candidate source (keep 2048 blocks of 8) and the pooled index source (pooled by the candidate
    source's blocks), against the reference; the same with the slots one row per request (`rows_of`, as the model
    passes them)."""
    q, w, keys, eslots, n = _step(reqs, ratio, seed=len(reqs) + ratio)
    req_slots, rows_of = _by_request(reqs, eslots)
    for pool, keep in ((None, 0), (None, KEEP), ("cands", 0)):
        if pool == "cands":
            pool = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, None, CB, KEEP)[3]
        got = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep)
        _assert_equal(_reference(q, w, keys, eslots, n, pool, keep), got)
        _assert_equal(got, prefill_select_triton(q, w, keys, req_slots, n, SCALE, K, pool, CB, keep, rows_of=rows_of))


def test_prefill_select_long_context_chunk() -> None:
    """A 512-token chunk at context 20,000, ratio 1: more candidate blocks (2,564) than kept (their buffers are
    cut), a pool that leaves most tiles out; every 7th row and the last rows checked."""
    q, w, keys, eslots, n = _step([(20000, 512)], 1, seed=5)
    rows = torch.cat([torch.arange(0, 512, 7, device="cuda"), torch.arange(500, 512, device="cuda")])
    cands = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, None, CB, KEEP)
    _assert_equal(_reference(q, w, keys, eslots, n, None, KEEP, rows), cands, rows)
    got = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, cands[3], CB, 0)
    _assert_equal(_reference(q, w, keys, eslots, n, cands[3], 0, rows), got, rows)


def _current_path(q, w, keys, eslots, n, pool, keep) -> None:
    """What AttentionV41 runs today on CUDA: per row chunk (row_chunks, as `forward` sizes them) the scores
    [rows, M] (Triton), candidate blocks / pool mask, stable_topk, pick_sources (Triton)."""
    M = eslots.shape[1]
    for a, b in row_chunks(q.shape[0], 256, (WINDOW + K) * HEAD_DIM + M * D):
        s = indexer_scores(q[a:b], w[a:b], keys, eslots[a:b], n[a:b], SCALE)
        if keep:
            candidate_blocks_of(s, n[a:b] - 1, CB, keep)
        if pool is not None:
            s = s.masked_fill(~candidate_pool(pool[a:b], M, CB), float("-inf"))
        pick_sources(stable_topk(s, min(K, M)), eslots[a:b], s)


def _time(fn, reps: int = 1) -> float:
    fn()  # compile / warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def _layer(T: int, ratio: int, mode: str) -> tuple[float, float]:
    """One index layer over a T-token prompt in one step: (fused, current) seconds, printed; every 61st row and
    the last rows of the fused result against the reference."""
    q, w, keys, eslots, n = _step([(0, T)], ratio, seed=ratio)
    keep = KEEP if mode == "candidate" else 0
    pool = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, None, CB, KEEP)[3] if mode == "pooled" else None
    fused = _time(lambda: prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep), reps=3)
    got = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep)
    rows = torch.cat([torch.arange(0, T, 61, device="cuda"), torch.arange(T - 8, T, device="cuda")])
    _assert_equal(_reference(q, w, keys, eslots, n, pool, keep, rows), got, rows)
    # the torch composition the fused kernel replaced takes seconds a layer at these lengths (and the tiling sweep
    # half a minute): timed only when asked (run_prefill_indexer.sh tests), so tests/gpu fits one device call
    current = _time(lambda: _current_path(q, w, keys, eslots, n, pool, keep)) if BASELINE else float("nan")
    flops = 2 * H * D * n.double().sum().item()
    print(f"\nT={T} ratio {ratio} {mode}: fused {fused * 1e3:.1f} ms ({flops / fused / 1e12:.0f} TFLOP/s of "
          f"visible-entry products), current {current * 1e3:.1f} ms")
    if BASELINE and mode == "candidate" and T == 16384:  # tiling sweep for the tuning session
        for bm, bn, nw in ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8)):
            t = _time(lambda: prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep, block_m=bm,
                                                    block_n=bn, num_warps=nw), reps=2)
            print(f"  block_m {bm} block_n {bn} warps {nw}: {t * 1e3:.1f} ms")
    return fused, current


@pytest.mark.parametrize("T", [16384, 32768])
def test_prefill_select_timing(T: int) -> None:
    """The three index layers of V4.1-Flash-8l over a T-token prompt in one step (layer 1 ratio 2 plain, layer 4
    ratio 1 candidate source, layer 6 ratio 1 pooled): fused vs the current path, printed."""
    layers = []
    for ratio, mode in ((2, "plain"), (1, "candidate"), (1, "pooled")):
        layers.append(_layer(T, ratio, mode))
        torch.cuda.empty_cache()
    print(f"T={T} all index layers: fused {sum(f for f, _ in layers) * 1e3:.1f} ms, "
          f"current {sum(c for _, c in layers) * 1e3:.1f} ms")


@pytest.mark.parametrize("ratio,mode", [(2, "plain"), (1, "candidate"), (1, "pooled")])
def test_prefill_select_mixed_step_merge_warps(ratio: int, mode: str) -> None:
    """A mixed step of the 1024-in / 128-out load (64 decode rows at ~1,100 tokens of context beside a 512-token
    chunk, benchmarks/results/2026-12-06-h100-mixed-step-host): the merge at 4 and 8 warps gives the same
    selection; both times printed (which MERGE_WARPS to keep)."""
    reqs = [(1024 + 7 * i, 1) for i in range(64)] + [(512, 512)]
    q, w, keys, eslots, n = _step(reqs, ratio, seed=11)
    keep = KEEP if mode == "candidate" else 0
    pool = prefill_select_triton(q, w, keys, eslots, n, SCALE, K, None, CB, KEEP)[3] if mode == "pooled" else None
    got = {mw: prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep, merge_warps=mw) for mw in (4, 8)}
    for a, b in zip(got[4], got[8]):
        assert (a is None and b is None) or torch.equal(a, b)
    times = {mw: _time(lambda mw=mw: prefill_select_triton(q, w, keys, eslots, n, SCALE, K, pool, CB, keep,
                                                           merge_warps=mw), reps=20) for mw in (4, 8)}
    print(f"\nmixed step, {mode} (ratio {ratio}), {q.shape[0]} rows: whole selection {times[4] * 1e6:.0f} us "
          f"(merge 4 warps), {times[8] * 1e6:.0f} us (8 warps)")
