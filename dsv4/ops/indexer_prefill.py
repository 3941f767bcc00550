"""The prefill / mixed step's indexer selection, fused (issue 23, item 1): the top-k entries of every token row, their
slots and mask, and (the V4.1 candidate source) the row's kept candidate blocks, without a [rows, entries] score
matrix: what `AttentionV41._select` + `pick_sources` compute on the torch path (`prefill_select_torch` composes
exactly those functions), in two launches.

Inputs (a step's token rows, dsv4.runtime.attn_metadata.TokenKeySlots): indexer queries q [R, H, d] (roped, FP4),
head weights w [R, H], the index-key cache keys [N, d], the entry slots eslots [Rq, M] with each row's eslots row
rows_of[r] (its request's: TokenKeySlots keeps one row per request, so no [R, M] matrix grows as tokens x context;
rows_of None: one eslots row per query row), of which row r sees entries e < n[r];
score[r, e] = sum_h w[r, h] * relu(q[r, h] . keys[eslots[rows_of[r], e]]) * scale (model.md 5).

Design (`_prefill_split_kernel`, then `_prefill_merge_kernel`):
  * A program takes BLOCK_M consecutive rows and a range of entry tiles of BLOCK_N entries, up to the block's
    largest n (a causal prefill: row blocks of later tokens see more entries; never max_model_len-sized work).
    Per tile, the scores [BLOCK_M, BLOCK_N] are H tensor-core products q_h [BLOCK_M, d] @ k^T [d, BLOCK_N] (bf16
    inputs, fp32 accumulation: the FP4-quantized queries and keys are exact in bf16) folded as
    acc = fma(relu(dot), w[:, h] * scale, acc). Under the CPU interpreter the tiles go through fp32 (it multiplies
    bf16 tiles as raw bits), the same numbers. q (in bf16) and w are padded to whole row blocks, so the head loop's
    loads take no mask (cp.async-pipelined). The tile then goes through the program's [BLOCK_M, BLOCK_N] scratch
    tile (L2), from which the keys are made SUB_N entries at a time: the key work's registers stay small.
  * Key sharing: the tile's keys are read once, through the slots of the block's row with the most visible
    entries (its "leader"). Rows of one request see a prefix of the same entries (their eslots rows agree on every
    visible entry), so for them the leader's keys are theirs. Rows of
    another request in the same block (a block straddling two requests, or a mixed step's decode rows) are found by
    comparing each row's own visible slots with the leader's (one [BLOCK_M, BLOCK_N] slot load per tile: eslots is
    read once in all), and only those rows are re-scored with their own keys (one k [BLOCK_N, d] @ q_r^T [d, H]
    product per row). So any eslots is handled exactly (two requests that share prefix-cached blocks share those
    slots and keys too); the common case (blocks inside one request) pays the slot comparison only.
  * Per row, a running top-k in global scratch: the packed int64 keys of `dsv4.ops.indexer._order_keys` (score
    order, ties to the lowest entry id: `stable_topk`'s order) of the entries that beat the row's threshold (the
    L-th best key kept so far, -1 before L are held) are appended to a 2L-key buffer (a cumsum compaction); a
    buffer that would overflow is cut: sorted, its top L kept, the threshold raised. A sub-tile no row's fp32
    scores reach its threshold's score in makes no keys at all (after the first L entries few keys pass: about
    L ln(n / L) of n for unordered scores). Tiles run newest first, where attention scores tend to be high, so
    thresholds rise early.
  * The candidate source (keep_blocks > 0): block scores = max over cand_block entries of the tile (the newest
    visible entry's block pinned to +inf), their keys kept the same way in 2 * next_pow2(keep) buffers.
  * Pooled (a later index source): only entries of the row's candidate blocks may be picked, read from a per-row
    block map [R, blocks] (int8; R x (C + blocks) work, as `candidate_pool`); a tile no row of the block may pick
    from is skipped before its products.
  * Splits: a long prefill step has many row blocks (16,384 rows / 64 = 256 blocks for 132 SMs), so one program
    per block fills the GPU; the blocks run heaviest (latest rows, most entries) first so the causal triangle's
    short blocks fill the tail. A step with fewer blocks than SMs (a 2,048-token chunk of a long prompt: 32 blocks)
    splits each block's entry range over up to MAX_SPLITS programs (about two programs per SM in all); the merge
    kernel then joins the splits' buffers per row with the same threshold-and-cut scheme.
  * The merge kernel (one program per row) sorts the row's kept keys once and writes picks [R, K] (K = min(k, M);
    -1 = none), slots (the row's slot of the pick; for none its entry 0's, or 0 when it sees no entry, as
    `pick_sources` on a per-row eslots), mask, and the kept blocks.
Scratch: rows x splits x min(2L, entries per split) keys (L = next_pow2(k) >= SUB_N), and for the candidate
source rows x splits x min(2 next_pow2(keep), blocks per split): about 8 KB + 16 KB per row at 16K tokens.
The model (`AttentionV41.forward` on CUDA) selects all of a step's rows in one call, so long prompts give many row
blocks; its attention then runs over row chunks with these picks sliced.

Exactness: the picks are the reference's exactly when the scores are (then the keys, their order and every tie
are the same); the kernel adds the head terms in another order than torch (and folds w * scale first), so on
general inputs two scores an fp32 ulp apart may swap, as with `indexer_scores_triton`. The tests use exact grids.
"""

from __future__ import annotations

import torch

from dsv4.ops.indexer import (_INTERPRET, candidate_blocks_of, candidate_pool, indexer_scores_torch,
                              per_row_slots, pick_sources_torch, triton)
from dsv4.ops.topk import stable_topk

if triton is not None:
    import triton.language as tl

    from dsv4.ops.indexer import _cut, _order_keys, _score_dot, _sm_count, _take

MAX_SPLITS = 16  # programs per row block when there are few row blocks (see `prefill_splits`)
# Warps of a merge program (one a row). The decode merge gained 8-34% from 4 to 8 on an H100
# (2026-12-06-h100-decode-select-merge-warps); here 4 until tests/gpu/test_indexer_prefill_gpu.py's mixed-step
# timing says otherwise (a 576-row mixed step's merge took 244 us a call, 2026-12-06-h100-mixed-step-host).
MERGE_WARPS = 4

Selection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def prefill_select_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, eslots: torch.Tensor,
                         n: torch.Tensor, scale: float, k: int, pool: torch.Tensor | None = None,
                         cand_block: int = 1, keep_blocks: int = 0, *, rows_of: torch.Tensor | None = None
                         ) -> Selection:
    """Reference: `AttentionV41._select` + `pick_sources` of token rows, op by op. Picks [R, min(k, M)] (entry ids,
    -1 = none), their slots and mask, and (keep_blocks > 0, the candidate source) the kept candidate blocks
    [R, keep_blocks] of the unrestricted scores (-1 = none); `pool` [R, C] (a later index source's candidate
    blocks): only entries of those blocks of cand_block entries may be picked. `rows_of` [R]: row r's entries are
    eslots[rows_of[r]] (one eslots row per request); None: eslots has a row per query row."""
    if rows_of is not None:
        eslots = per_row_slots(eslots, rows_of, n)
    s = indexer_scores_torch(q, w, keys, eslots, n, scale)
    cands = candidate_blocks_of(s, n - 1, cand_block, keep_blocks) if keep_blocks > 0 else None
    if pool is not None:
        s = s.masked_fill(~candidate_pool(pool, s.shape[1], cand_block), float("-inf"))
    picks, slots, mask = pick_sources_torch(stable_topk(s, min(k, s.shape[1])), eslots, s)
    return picks, slots, mask, cands


if triton is not None:

    @triton.jit
    def _key_score(key):
        """The fp32 score of `_order_keys` keys (-inf for -1): key > k' implies score(key) >= score(k')."""
        ob = ((key >> 31) - 2147483648).to(tl.int32)
        bits = tl.where(ob >= 0, ob, ob ^ 0x7FFFFFFF)
        return tl.where(key >= 0, bits.to(tl.float32, bitcast=True), float("-inf"))

    @triton.jit
    def _push(buf_ptr, off, cnt, thr, keys, ar, L: tl.constexpr, BLOCK_M: tl.constexpr):
        """Append each row's keys [BLOCK_M, W] (W <= L; -1 = none) above its threshold thr [BLOCK_M] to its buffer
        at buf_ptr + off [BLOCK_M] (cnt [BLOCK_M] keys held), cutting first the buffers that would pass 2L.
        Returns the new (cnt, thr)."""
        ok = keys > thr[:, None]
        over = cnt + tl.sum(ok.to(tl.int32), axis=1) > 2 * L
        i = tl.min(tl.where(over, ar, BLOCK_M), axis=0)
        while i < BLOCK_M:  # rows to cut, one at a time (a cut keeps L keys: then W more fit)
            sel = ar == i
            t = _cut(buf_ptr + tl.sum(tl.where(sel, off, 0), axis=0), tl.sum(tl.where(sel, cnt, 0), axis=0), L, L)
            thr = tl.where(sel, t, thr)
            cnt = tl.where(sel, L, cnt)
            over = over & (ar != i)
            i = tl.min(tl.where(over, ar, BLOCK_M), axis=0)
        ok = keys > thr[:, None]
        oki = ok.to(tl.int32)
        pos = cnt[:, None] + tl.cumsum(oki, axis=1) - 1
        tl.store(buf_ptr + off[:, None] + pos, keys, mask=ok)
        return cnt + tl.sum(oki, axis=1), thr

    # Integer arguments that change from step to step (row and entry counts, buffer widths, the split count) stay
    # out of Triton's specialization (== 1, divisible by 16): each new pattern would be a new compile in the middle
    # of a serving step, and these kernels take tens of seconds to compile (the merge's 2L-key sorts most).
    @triton.jit(do_not_specialize=["es_stride", "mark_stride", "ESTR", "BSTR", "R", "M", "S"])
    def _prefill_split_kernel(q_ptr, w_ptr, k_ptr, es_ptr, es_stride, req_ptr, n_ptr, mark_ptr, mark_stride,
                              buf_ptr, cnt_ptr, ESTR, bbuf_ptr, bcnt_ptr, BSTR, tile_ptr, R, M, S, scale,
                              H: tl.constexpr, D: tl.constexpr, L: tl.constexpr, LB: tl.constexpr,
                              CB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_N: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, POOL: tl.constexpr,
                              BLOCKS: tl.constexpr, BF16: tl.constexpr):
        """Program (row block, split): the rows' keys of the entry tiles [split * chunk, (split + 1) * chunk) of
        the block's visible range into their buffers (row * S + split), newest tile first; the key counts to cnt.
        A tile's scores go through this program's [BLOCK_M, BLOCK_N] scratch tile, so the rows re-scored with their
        own keys write their row there and the keys are made and kept SUB_N entries at a time (registers).
        BLOCKS: the same for candidate-block keys (SUB_N / CB blocks per step). q and w have whole row blocks
        (zero rows past R): the head loop's loads take no mask."""
        blk = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)  # the latest rows (most entries) first
        split = tl.program_id(1)
        scale = tl.cast(scale, tl.float32)  # torch.compile passes floats as fp64
        ar = tl.arange(0, BLOCK_M)
        rows = blk * BLOCK_M + ar
        rm = rows < R
        n = tl.minimum(tl.load(n_ptr + rows, mask=rm, other=0).to(tl.int64), M)
        req = tl.load(req_ptr + rows, mask=rm, other=0).to(tl.int64)  # each row's eslots row (its request's)
        nmax = tl.max(n, axis=0)
        lead = blk * BLOCK_M + tl.argmax(n, axis=0)  # the row that sees every entry any row of the block sees
        chunk = tl.cdiv(tl.cdiv(nmax, S), BLOCK_N) * BLOCK_N
        start = split * chunk
        ntiles = tl.cdiv(tl.minimum(start + chunk, nmax) - start, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        hh = tl.arange(0, BLOCK_H)
        hm = hh < H
        jn = tl.arange(0, BLOCK_N)
        jc = tl.arange(0, SUB_N)
        tile = tile_ptr + (tl.program_id(0) * S + split).to(tl.int64) * (BLOCK_M * BLOCK_N)
        off = (rows * S + split) * ESTR
        boff = (rows * S + split) * BSTR
        cnt = tl.zeros([BLOCK_M], tl.int32)
        thr = tl.full([BLOCK_M], -1, tl.int64)
        bcnt = tl.zeros([BLOCK_M], tl.int32)
        bthr = tl.full([BLOCK_M], -1, tl.int64)
        newest = tl.where(n > 0, (n - 1) // CB, -1)
        for t in range(0, ntiles):
            e0 = start + (ntiles - 1 - t) * BLOCK_N
            e = e0 + jn
            vis = e[None, :] < n[:, None]  # [BLOCK_M, BLOCK_N]; rows past R have n = 0
            if POOL and not BLOCKS:  # a tile no row may pick from is skipped
                marked = tl.load(mark_ptr + rows[:, None] * mark_stride + 1 + e[None, :] // CB, mask=vis, other=0)
                todo = tl.max((vis & (marked != 0)).to(tl.int32), axis=1)
            else:
                todo = tl.max(vis.to(tl.int32), axis=1)
            if tl.max(todo, axis=0) > 0:
                # the leader's keys, shared by every row of its request
                lv = e < nmax
                slot = tl.load(es_ptr + tl.load(req_ptr + lead) * es_stride + e, mask=lv, other=0).to(tl.int64)
                kt = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=lv[:, None] & dm[None, :], other=0.0)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for h in range(H):
                    if BLOCK_D == D:
                        qh = tl.load(q_ptr + rows[:, None] * (H * D) + h * D + d[None, :])
                    else:
                        qh = tl.load(q_ptr + rows[:, None] * (H * D) + h * D + d[None, :], mask=dm[None, :], other=0.0)
                    wh = tl.load(w_ptr + rows * H + h) * scale
                    acc = tl.fma(tl.maximum(_score_dot(qh, tl.trans(kt), BF16), 0.0), wh[:, None], acc)
                tl.store(tile + ar[:, None] * BLOCK_N + jn[None, :], acc)
                # rows whose own visible slots differ from the leader's (another request): their own keys
                own = tl.load(es_ptr + req[:, None] * es_stride + e[None, :], mask=vis, other=0).to(tl.int64)
                bad = (tl.max((vis & (own != slot[None, :])).to(tl.int32), axis=1) > 0) & (todo > 0)
                i = tl.min(tl.where(bad, ar, BLOCK_M), axis=0)
                tl.debug_barrier()  # the tile's stores land before a row's rewrite
                while i < BLOCK_M:
                    r = blk * BLOCK_M + i
                    vr = e < tl.minimum(tl.load(n_ptr + r).to(tl.int64), M)
                    sr = tl.load(es_ptr + tl.load(req_ptr + r) * es_stride + e, mask=vr, other=0).to(tl.int64)
                    kr = tl.load(k_ptr + sr[:, None] * D + d[None, :], mask=vr[:, None] & dm[None, :], other=0.0)
                    qr = tl.load(q_ptr + r * (H * D) + hh[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :],
                                 other=0.0)
                    wr = tl.load(w_ptr + r * H + hh, mask=hm, other=0.0) * scale
                    s_r = tl.sum(tl.maximum(_score_dot(kr, tl.trans(qr), BF16), 0.0) * wr[None, :], axis=1)  # [BLOCK_N]
                    tl.store(tile + i * BLOCK_N + jn, s_r)
                    bad = bad & (ar != i)
                    i = tl.min(tl.where(bad, ar, BLOCK_M), axis=0)
                tl.debug_barrier()  # the whole tile is visible to every thread
                for c0 in range(0, BLOCK_N, SUB_N):
                    ec = e0 + c0 + jc
                    visc = ec[None, :] < n[:, None]
                    sc = tl.where(visc, tl.load(tile + ar[:, None] * BLOCK_N + c0 + jc[None, :]), float("-inf"))
                    allowed = visc
                    if POOL:
                        mk = tl.load(mark_ptr + rows[:, None] * mark_stride + 1 + ec[None, :] // CB, mask=visc,
                                     other=0)
                        allowed = visc & (mk != 0)
                    # most sub-tiles beat no row's threshold once the rows hold L keys: an fp32 test first
                    hit = allowed & (sc >= _key_score(thr)[:, None])
                    if tl.max(tl.max(hit.to(tl.int32), axis=1), axis=0) > 0:
                        keys = tl.where(allowed, _order_keys(sc, ec[None, :]), -1)
                        cnt, thr = _push(buf_ptr, off, cnt, thr, keys, ar, L, BLOCK_M)
                    if BLOCKS:
                        bmax = tl.max(tl.reshape(sc, [BLOCK_M, SUB_N // CB, CB]), axis=2)
                        bid = (e0 + c0) // CB + tl.arange(0, SUB_N // CB)
                        bmax = tl.where(bid[None, :] == newest[:, None], float("inf"), bmax)
                        bkeys = tl.where(bid[None, :] * CB < n[:, None], _order_keys(bmax, bid[None, :]), -1)
                        bcnt, bthr = _push(bbuf_ptr, boff, bcnt, bthr, bkeys, ar, LB, BLOCK_M)
                tl.debug_barrier()  # every read of the tile is done before the next tile overwrites it
        tl.store(cnt_ptr + rows * S + split, cnt, mask=rm)
        if BLOCKS:
            tl.store(bcnt_ptr + rows * S + split, bcnt, mask=rm)

    @triton.jit
    def _row_top(buf_ptr, cnt_ptr, STR, acc_ptr, r, S, L: tl.constexpr):
        """The row's top L keys over its S split buffers (stride STR), sorted: in place in its buffer (S = 1), else
        joined in acc (2L keys per row) through `_take`; the pass after the last split (or the only pass, S = 1)
        appends nothing and makes the final cut. Without `_take`'s L-wide short-context sort (HEAD false): for the
        candidate source it would cost ~40 s more of compile, once per process, to save microseconds a step."""
        if S == 1:
            dst = buf_ptr + r * STR
            c = tl.load(cnt_ptr + r)
            cap = tl.minimum(tl.zeros([], tl.int32) + STR, L)
            splits = 0
        else:
            dst = acc_ptr + r * (2 * L)
            c = tl.zeros([], tl.int32)
            cap = tl.zeros([], tl.int32) + L
            splits = S
        thr = tl.zeros([], tl.int64) - 1
        j = tl.arange(0, L)
        for s in range(splits + 1):
            live = tl.zeros([], tl.int32) + s < splits  # a tensor (also under the interpreter, where s is an int)
            src = buf_ptr + (r * S + s) * STR
            cs = tl.load(cnt_ptr + r * S + s, mask=live, other=1)  # the last pass: one window of nothing
            lim = tl.where(live, cs, 0)
            for w0 in range(0, cs, L):
                x = tl.load(src + w0 + j, mask=w0 + j < lim, other=-1)
                c, thr = _take(dst, c, thr, x, live, cap, L, False)
        return dst, cap

    @triton.jit(do_not_specialize=["ESTR", "BSTR", "S", "es_stride", "M", "K", "KEEP"])
    def _prefill_merge_kernel(buf_ptr, cnt_ptr, ESTR, acc_ptr, bbuf_ptr, bcnt_ptr, BSTR, bacc_ptr, S,
                              es_ptr, es_stride, req_ptr, n_ptr, M, picks_ptr, slots_ptr, mask_ptr, K, cands_ptr,
                              KEEP,
                              L: tl.constexpr, LB: tl.constexpr, KP: tl.constexpr, KEEPP: tl.constexpr,
                              BLOCKS: tl.constexpr):
        """Per row: the top K keys of its splits -> picks, their slots (entry 0's for none, 0 when the row sees no
        entry: as a per-row eslots gives them), mask; BLOCKS: the top KEEP block keys -> the kept candidate
        blocks."""
        r = tl.program_id(0).to(tl.int64)
        top, cap = _row_top(buf_ptr, cnt_ptr, ESTR, acc_ptr, r, S, L)
        j = tl.arange(0, KP)
        jm = j < K
        key = tl.load(top + j, mask=jm & (j < cap), other=-1)
        ok = key >= 0
        e = tl.where(ok, 2147483647 - (key % 2147483648), 0)
        nr = tl.minimum(tl.load(n_ptr + r).to(tl.int64), M)
        slot = tl.load(es_ptr + tl.load(req_ptr + r).to(tl.int64) * es_stride + e, mask=jm & (e < nr), other=0)
        tl.store(picks_ptr + r * K + j, tl.where(ok, e, -1), mask=jm)
        tl.store(slots_ptr + r * K + j, slot, mask=jm)
        tl.store(mask_ptr + r * K + j, ok, mask=jm)
        if BLOCKS:
            btop, bcap = _row_top(bbuf_ptr, bcnt_ptr, BSTR, bacc_ptr, r, S, LB)
            jb = tl.arange(0, KEEPP)
            jbm = jb < KEEP
            bkey = tl.load(btop + jb, mask=jbm & (jb < bcap), other=-1)
            tl.store(cands_ptr + r * KEEP + jb, tl.where(bkey >= 0, 2147483647 - (bkey % 2147483648), -1), mask=jbm)


def prefill_splits(row_blocks: int, entry_tiles: int, device: torch.device) -> int:
    """Programs per row block, from shapes only: 1 once the row blocks fill the SMs, else about two programs per SM
    (at most MAX_SPLITS, and no more than the step's entry tiles)."""
    sms = _sm_count(device)
    if row_blocks >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(1, row_blocks)), entry_tiles))


def prefill_select_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, eslots: torch.Tensor,
                          n: torch.Tensor, scale: float, k: int, pool: torch.Tensor | None = None,
                          cand_block: int = 1, keep_blocks: int = 0, *, rows_of: torch.Tensor | None = None,
                          splits: int | None = None, block_m: int = 64, block_n: int = 128, sub_n: int = 32,
                          num_warps: int = 8, merge_warps: int | None = None) -> Selection:
    """`prefill_select_torch` in two launches (module docstring). q and keys must be exact in bf16 (the model's
    FP4-quantized ones are); cand_block a power of two. `rows_of` as the reference's: the kernels read eslots
    through it, so no [R, M] slot matrix is made. `splits` overrides the shape-derived split count and
    block_m / block_n / sub_n / num_warps the tiling, merge_warps the merge's warps (tests, tuning; powers of
    two)."""
    assert triton is not None, "triton is not installed"
    assert cand_block & (cand_block - 1) == 0, cand_block  # the block max reshapes a tile into [*, cand_block]
    R, H, D = q.shape
    M = eslots.shape[1]
    K = min(k, M)
    dev = q.device
    blocks = keep_blocks > 0
    if R == 0 or M == 0 or (K == 0 and not blocks):
        return (torch.full((R, K), -1, dtype=torch.int64, device=dev),
                torch.zeros(R, K, dtype=eslots.dtype, device=dev), torch.zeros(R, K, dtype=torch.bool, device=dev),
                torch.full((R, keep_blocks), -1, dtype=torch.int64, device=dev) if blocks else None)
    picks = torch.empty(R, K, dtype=torch.int64, device=dev)  # the merge kernel writes every place
    slots = torch.empty(R, K, dtype=eslots.dtype, device=dev)
    mask = torch.empty(R, K, dtype=torch.bool, device=dev)
    cands = torch.empty(R, keep_blocks, dtype=torch.int64, device=dev) if blocks else None
    BN = max(block_n, cand_block, 16)
    SUB = min(max(sub_n, cand_block), BN)  # keys made per step: whole candidate blocks, a divisor of the tile
    # sized by k, not by K = min(k, M): L and KP are constexprs, and a step's entry count must not pick a new
    # kernel variant (a first serving step of short prompts would wait for its compile)
    L = max(triton.next_power_of_2(max(k, 1)), SUB)
    LB = max(triton.next_power_of_2(keep_blocks), SUB // cand_block) if blocks else 1
    nblk = triton.cdiv(R, block_m)
    S = splits or prefill_splits(nblk, triton.cdiv(M, BN), dev)
    chunk = triton.cdiv(triton.cdiv(M, S), BN) * BN  # the most entries a split can see
    estr = min(2 * L, chunk)  # a split's buffer never holds more keys than its entries: then it is never cut
    bstr = min(2 * LB, chunk // cand_block) if blocks else 1
    buf = torch.empty(R * S * estr, dtype=torch.int64, device=dev)
    cnt = torch.empty(R * S, dtype=torch.int32, device=dev)
    bbuf = torch.empty(R * S * bstr, dtype=torch.int64, device=dev) if blocks else buf
    bcnt = torch.empty(R * S, dtype=torch.int32, device=dev) if blocks else cnt
    acc = torch.empty(R * 2 * L, dtype=torch.int64, device=dev) if S > 1 else buf
    bacc = torch.empty(R * 2 * LB, dtype=torch.int64, device=dev) if S > 1 and blocks else bbuf
    if pool is not None:  # per-row block map, column 0 for the ids that name no block (as candidate_pool)
        nb = triton.cdiv(M, cand_block)
        ids = torch.where((pool >= 0) & (pool < nb), pool + 1, 0)
        mark = torch.zeros(R, nb + 1, dtype=torch.int8, device=dev).scatter_(1, ids.long(), 1)
    else:
        mark = cnt
    es = eslots if eslots.stride(1) == 1 else eslots.contiguous()
    req = (torch.arange(R, device=dev) if rows_of is None else rows_of).to(torch.int64).contiguous()
    tiles = torch.empty(nblk * S * block_m * BN, dtype=torch.float32, device=dev)  # one score tile per program
    qb = torch.zeros(nblk * block_m, H, D, dtype=torch.bfloat16, device=dev)  # whole row blocks, bf16 (exact)
    qb[:R] = q
    wb = torch.zeros(nblk * block_m, H, dtype=torch.float32, device=dev)
    wb[:R] = w
    _prefill_split_kernel[(nblk, S)](
        qb, wb, keys.contiguous(), es, es.stride(0), req, n.contiguous(), mark,
        mark.stride(0) if pool is not None else 0, buf, cnt, estr, bbuf, bcnt, bstr, tiles, R, M, S, float(scale), H=H, D=D, L=L, LB=LB, CB=cand_block,
        BLOCK_M=block_m, BLOCK_N=BN, SUB_N=SUB, BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), POOL=pool is not None, BLOCKS=blocks, BF16=not _INTERPRET,
        num_warps=num_warps)
    _prefill_merge_kernel[(R,)](
        buf, cnt, estr, acc, bbuf, bcnt, bstr, bacc, S, es, es.stride(0), req, n.contiguous(), M, picks, slots, mask, K,
        cands if blocks else picks, keep_blocks, L=L, LB=LB, KP=triton.next_power_of_2(max(k, 1)),
        KEEPP=triton.next_power_of_2(max(keep_blocks, 1)), BLOCKS=blocks, num_warps=merge_warps or MERGE_WARPS)
    return picks, slots, mask, cands


def use_prefill_select(q: torch.Tensor, cand_block: int) -> bool:
    """Whether `prefill_select` takes the fused kernel (the model then selects a step's rows in one call): CUDA
    with Triton and a power-of-two candidate block."""
    return q.is_cuda and triton is not None and cand_block & (cand_block - 1) == 0


def prefill_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, eslots: torch.Tensor, n: torch.Tensor,
                   scale: float, k: int, pool: torch.Tensor | None = None, cand_block: int = 1,
                   keep_blocks: int = 0, *, rows_of: torch.Tensor | None = None) -> Selection:
    """Triton on CUDA (`use_prefill_select`), torch elsewhere."""
    if use_prefill_select(q, cand_block):
        return prefill_select_triton(q, w, keys, eslots, n, scale, k, pool, cand_block, keep_blocks, rows_of=rows_of)
    return prefill_select_torch(q, w, keys, eslots, n, scale, k, pool, cand_block, keep_blocks, rows_of=rows_of)
