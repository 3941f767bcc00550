"""The fused prefill indexer selection (dsv4/ops/indexer_prefill.py, issue 23 item 1) against its torch reference
(`prefill_select_torch`: `AttentionV41._select` + `pick_sources` op by op) under TRITON_INTERPRET=1 (the CPU
interpreter; each check runs in a subprocess because the flag is read when kernels are defined), and the model's
wiring of it (the step's rows selected in one call, sliced per row chunk).

Inputs sit on exact grids: queries and keys on halves, head weights on quarters, the scale a power of two, so every
score is exact in fp32 whatever the summation order; then the picks, their order (ties to the lowest entry id),
slots, mask and candidate blocks must be equal. Steps are built as TokenKeySlots builds them: several requests, each
row seeing a prefix of its request's entries (eslots zeroed past n), rows with no entry and with fewer than k."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from test_kernels_interpret import _interpret

from dsv4.engine.engine import LLMEngine
from dsv4.models import deepseek_v41
from dsv4.ops import indexer_prefill
from dsv4.sampling_params import SamplingParams

_GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")

# shared by the interpreted checks: a prefill step's rows and the comparison
_COMMON = """
import torch
from dsv4.ops.indexer_prefill import prefill_select_torch, prefill_select_triton
SCALE = 0.25
grid = lambda x: (x * 2).round() / 2

def step(seed, reqs, ratio, H, D, share=0, tie_keys=False, zero_q=0, neg_rows=0, by_request=False):
    # reqs: (context, new tokens) per request; the rows of a prefill / mixed step, eslots one row per token (masked
    # past its n), or with `by_request` as TokenKeySlots keeps them: one row per request and rows_of (a 6th item)
    g = torch.Generator().manual_seed(seed)
    E = [(c + l) // ratio for c, l in reqs]
    M, N = max(E), sum(E) + 9
    perm = torch.randperm(N - 1, generator=g) + 1
    es, ns, at, by_req = [], [], 0, []
    for i, ((c, l), e) in enumerate(zip(reqs, E)):
        sl = perm[at:at + e].clone()
        at += e
        if i == 1 and share:  # a prefix-cache hit: request 1's first entries in request 0's slots
            sl[:share] = es[0][-1, :share]
        pos = torch.arange(c, c + l)
        n = (pos + 1) // ratio
        rows = torch.zeros(l, M, dtype=torch.int64)
        rows[:, :e] = sl
        by_req.append(torch.cat([sl, perm[:M - e]]))  # past its entries, another request's slots (masked by n)
        es.append(rows.masked_fill(torch.arange(M)[None, :] >= n[:, None], 0))
        ns.append(n)
    eslots, n = torch.cat(es), torch.cat(ns)
    R = eslots.shape[0]
    q = grid(torch.randn(R, H, D, generator=g))
    w = (torch.randn(R, H, generator=g) * 4).round() / 4
    keys = grid(torch.randn(N, D, generator=g))
    if tie_keys:  # three distinct keys: scores tie everywhere
        keys = grid(torch.randn(3, D, generator=g))[torch.randint(0, 3, (N,), generator=g)]
    q[:zero_q] = 0  # every score 0: the first k visible entries, in id order
    if neg_rows:  # keys >= 0, queries <= 0: every dot <= 0, scores -0.0 / 0.0 (one key)
        keys = keys.abs()
        q[-neg_rows:] = -q[-neg_rows:].abs()
    if by_request:
        rows_of = torch.cat([torch.full((l,), i) for i, (_, l) in enumerate(reqs)])
        return q, w, keys, torch.stack(by_req), n, rows_of
    return q, w, keys, eslots, n

def pool_of(seed, n_rows, M, CB, C):
    # candidate lists as a candidate source publishes them, with -1s and ids past the last block
    g = torch.Generator().manual_seed(seed)
    nb = -(-M // CB)
    pool = torch.stack([torch.randperm(nb + 2, generator=g)[:C] for _ in range(n_rows)])
    pool[:, C - 1] = -1
    return pool

def check(inp, k, pool=None, CB=1, keep=0, **kw):
    # inp: step()'s 5 items, or with by_request its 6 (then also equal to the per-token form of the same step)
    rows_of = inp[5] if len(inp) == 6 else None
    ref = prefill_select_torch(*inp[:5], SCALE, k, pool, CB, keep, rows_of=rows_of)
    got = prefill_select_triton(*inp[:5], SCALE, k, pool, CB, keep, rows_of=rows_of, **kw)
    for a, b in zip(ref[:3], got[:3]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, CB, keep, kw, a, b)
    assert (ref[3] is None) == (keep == 0) == (got[3] is None)
    assert keep == 0 or torch.equal(ref[3], got[3]), (ref[3], got[3])
    return ref
"""


def _run(body: str) -> None:
    _interpret(_COMMON + textwrap.dedent(body))


@pytest.mark.slow  # 11 s under the interpreter: the slow tier (CI runs it too) keeps the main tier under 10 minutes
def test_prefill_select_plain_candidate_pooled() -> None:
    """Three requests in one step, ratio 2, k = 4, row blocks of 16 that straddle them (rows scored with their own
    keys, not their block leader's; the first two requests share their first two entry slots, a prefix-cache hit;
    the later ones continue a context: chunked prefills): rows with no entry, with fewer than k, and with enough
    to cut their buffers (2L = 32 keys); rows with zero queries (every
    score 0: the first k entries) and rows whose scores are all -0.0 / 0.0 (ties). Plain selection (one split per
    row block), the candidate source (block top-3 of blocks of 2, the newest block pinned, more blocks than kept,
    block buffers cut; three splits), a pooled index source (two splits)."""
    _run("""
        inp = step(1, [(0, 11), (30, 9), (70, 4)], 2, 2, 16, share=2, zero_q=2, neg_rows=2)
        n = inp[4]
        assert (n == 0).any() and ((n > 0) & (n < 4)).any() and (n > 32).any()
        ref = check(inp, 4, block_m=16, block_n=16, splits=1)
        assert (ref[0] == -1).any() and (ref[0] >= 0).all(dim=1).any()
        check(inp, 4, None, 2, 3, block_m=16, block_n=32, sub_n=16, splits=3)
        check(inp, 4, pool_of(2, n.shape[0], inp[3].shape[1], 2, 6), 2, 0, block_m=16, block_n=16, splits=2)
        # one eslots row per request (TokenKeySlots' form) read through rows_of: the per-token form's results
        byr = step(1, [(0, 11), (30, 9), (70, 4)], 2, 2, 16, share=2, zero_q=2, neg_rows=2, by_request=True)
        assert byr[3].shape[0] == 3 and torch.equal(byr[4], n)
        for args, kw in (((4,), dict(block_m=16, block_n=16, splits=1)),
                         ((4, None, 2, 3), dict(block_m=16, block_n=32, sub_n=16, splits=3))):
            a, b = check(inp, *args, **kw), check(byr, *args, **kw)
            assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and (a[3] is None or torch.equal(a[3], b[3]))
        print("ok")
    """)


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_prefill_select_ties_shared_prefix_and_foreign_rows() -> None:
    """More rows and modes: three requests with one and three splits; ties everywhere (three distinct keys), zero
    and -0.0 rows, a shared prefix of six entries, with the candidate source on 32-entry tiles; and rows that share
    no slots at all (every row its own entries: each is scored with its own keys, not its block leader's)."""
    _run("""
        inp = step(1, [(0, 13), (4, 21), (60, 7)], 2, 2, 16)
        check(inp, 8, block_m=16, block_n=16, splits=3)
        inp = step(3, [(0, 20), (2, 18)], 1, 2, 16, share=6, tie_keys=True, zero_q=3, neg_rows=4)
        check(inp, 8, block_m=16, block_n=16, splits=1)
        check(inp, 8, None, 4, 2, block_m=16, block_n=32, splits=2)
        q, w, keys, eslots, n = step(4, [(0, 24)], 1, 2, 16)
        g = torch.Generator().manual_seed(5)
        own = torch.stack([torch.randperm(keys.shape[0], generator=g)[:eslots.shape[1]] for _ in range(24)])
        own = own.masked_fill(torch.arange(eslots.shape[1])[None, :] >= n[:, None], 0)
        check((q, w, keys, own, n), 5, None, 2, 3, block_m=16, block_n=16, splits=1)
        print("ok")
    """)


@pytest.mark.slow  # (main tier under 10 minutes on two cores; CI runs the slow tier too)
def test_prefill_select_larger_shapes() -> None:
    """The demo sizes' top-64 and larger tiles: 4 heads of 32, k = 64 (L = 64) over ~120 entries, candidate
    blocks of 8 kept 5 (and pooled by them); the default tiling (64 rows x 128 entries keyed 32 at a time) with
    one and four splits, 32 x 64 tiles; pooled and candidate source at once (the kernel allows both: kept blocks
    of the unrestricted scores)."""
    _run("""
        inp = step(6, [(0, 40), (100, 20), (20, 5)], 1, 4, 32)
        check(inp, 64, splits=1)
        check(inp, 64, None, 8, 5, splits=1)
        check(inp, 64, None, 8, 5, splits=4)
        check(inp, 64, block_m=32, block_n=64, sub_n=16, splits=1)
        pool = pool_of(7, inp[4].shape[0], inp[3].shape[1], 8, 5)
        check(inp, 64, pool, 8, 0, splits=3)
        check(inp, 6, pool, 8, 5, block_m=16, block_n=16, splits=1)
        print("ok")
    """)


# ---- the model's wiring ---------------------------------------------------------------------------------------------
def _greedy_golden() -> list[list[int]]:
    """The golden V4.1 checkpoint, its prompt and a 9-token prefix served together under a 12-token step budget:
    chunked prefills and mixed steps take the token-row path."""
    ids = json.load(open(os.path.join(_GOLDEN, "expected.json")))["prompt_token_ids"]
    eng = LLMEngine.from_args(_GOLDEN, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=12,
                              load_tokenizer=False)
    for i, (p, m) in enumerate(((ids, 16), (ids[:9], 10))):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), request_id=str(i))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done["0"], done["1"]]


def test_model_selects_step_rows_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA wiring run on the CPU (the gate forced open, the selection by the torch reference): each index
    source selects all of a step's rows in one call (including the candidate source's blocks and the pooled
    layer's), and the greedy tokens are the golden ones."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        # one eslots row per request, read through rows_of (no [rows, entries] slot matrix)
        assert kwargs["rows_of"].shape[0] == args[0].shape[0] and args[3].shape[0] == int(kwargs["rows_of"].max()) + 1
        return indexer_prefill.prefill_select_torch(*args, **kwargs)

    monkeypatch.setattr(deepseek_v41, "use_prefill_select", lambda q, cb: True)
    monkeypatch.setattr(deepseek_v41, "prefill_select", spy)
    got = _greedy_golden()
    assert got[0] == json.load(open(os.path.join(_GOLDEN, "expected.json")))["greedy_token_ids"], got
    assert calls and max(calls) > 1  # token-row steps, all their rows at once


@pytest.mark.slow  # a minute of interpreted kernels (every index layer of every token-row step)
def test_model_on_the_fused_kernel_interpreted() -> None:
    """The same with the interpreted kernel: the golden greedy tokens."""
    _interpret("""
        import json, os, sys
        sys.path.insert(0, "tests")
        from dsv4.models import deepseek_v41
        from dsv4.ops.indexer_prefill import prefill_select_triton
        from test_indexer_prefill import _greedy_golden
        calls = []
        def fused(*args, **kwargs):
            calls.append(1)
            return prefill_select_triton(*args, **kwargs)
        deepseek_v41.use_prefill_select = lambda q, cb: True
        deepseek_v41.prefill_select = fused
        got = _greedy_golden()
        exp = json.load(open(os.path.join("tests", "data", "deepseek-v41-tiny", "expected.json")))
        assert got[0] == exp["greedy_token_ids"], got
        assert calls
        print("ok")
    """)


def test_dispatch_on_cpu_is_the_reference() -> None:
    """Without CUDA the dispatcher is the torch reference, and the model's gate stays closed."""
    g = torch.Generator().manual_seed(0)
    q, w = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, generator=g)
    keys, eslots = torch.randn(10, 16, generator=g), torch.randint(0, 10, (3, 6), generator=g)
    n = torch.tensor([0, 3, 6])
    assert not indexer_prefill.use_prefill_select(q, 8)
    a = indexer_prefill.prefill_select(q, w, keys, eslots, n, 0.25, 4, None, 2, 2)
    b = indexer_prefill.prefill_select_torch(q, w, keys, eslots, n, 0.25, 4, None, 2, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].shape == (3, 4) and (a[0][0] == -1).all() and a[3].shape == (3, 2)
