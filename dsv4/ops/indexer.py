"""The lightning indexer's scores (model.md sections 2 and 5): for each query row r and each of its compressed
entries m, sum over heads h of relu(q[r, h] . k[m]) * scale * w[r, h], -inf past the row's visible entries.

q [R, H, d] (roped, fake-quantized; in the model dtype, which the references widen to fp32), w [R, H] fp32, the
index-key cache [N, d] read through the rows' entry slots [R, M] (int64), n [R] visible entries per row -> scores
[R, M] fp32. The picks are the top-k of these scores, so both paths compute in fp32 (the kernels multiply a bf16
cache's keys on the tensor cores: exact products, fp32 sums, `dots_in_bf16`); the sums over d and over h may add in
another order (an fp32 ulp or so: a pick can change only where two scores are that close).
The torch reference gathers every row's keys into a temporary and runs ~10 kernels (gather, cast, batched matmul,
relu, two multiplies, sum, and the visibility mask); the Triton kernel reads the keys in place through the slots,
one program per (row, block of entries). That is the prefill path's (token rows, entry slots up to the step's
longest context).

Decode rows (`decode_select`) never build a [rows, entries] matrix: the scores of each row's visible entries, read
through its block table, go straight into a running top-k (and for the candidate source a running top of
candidate blocks) in scratch of splits x next_pow2(k) keys per row, then a merge per row writes the picks, their
slots and mask: work follows each row's n (or its candidate blocks), never max_model_len.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from dsv4.ops.topk import stable_topk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when kernels are defined, as triton does


def dots_in_bf16(keys: torch.Tensor) -> bool:
    """Whether the scoring kernels multiply on the tensor cores in bf16 (fp32 accumulation) instead of fp32 IEEE
    FMAs, which cost ~0.7 us an entry a program at 64 heads of 128 (benchmarks/decode_select_splits.py). Only for
    a bf16 key cache: the cache takes the model's dtype, and a bf16 model's queries are bf16 values (V4.1's
    FP4-quantized besides; a caller may pass them widened to fp32), so their bf16 cast is exact, every product is
    exact in fp32 and only the order of the fp32 sums differs from the reference, as it already did. Never under the CPU
    interpreter, which multiplies bf16 tiles as raw bits (its fp32 path computes the same numbers)."""
    return keys.dtype == torch.bfloat16 and not _INTERPRET


def indexer_scores_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, n: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Reference (the model.md formula, op by op)."""
    s = torch.relu(torch.einsum("rhd,rmd->rhm", q.float(), keys[slots].float())) * scale
    s = (s * w.unsqueeze(-1)).sum(dim=1)
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] < n[:, None]
    return s.masked_fill(~visible, float("-inf"))


if triton is not None:

    @triton.jit
    def _score_dot(a, b, BF16: tl.constexpr):
        """a @ b with fp32 accumulation: bf16 tensor-core inputs (`dots_in_bf16`), else fp32 IEEE."""
        if BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, n_ptr, out_ptr, M, H, D, scale, BLOCK_M: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mm = m < M
        vis = mm & (m < tl.load(n_ptr + r))
        slot = tl.load(slot_ptr + r * M + m, mask=vis, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        h = tl.arange(0, BLOCK_H)
        hm = h < H
        k = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
        q = tl.load(q_ptr + r * H * D + h[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        dots = _score_dot(k, tl.trans(q), BF16)  # [BLOCK_M, BLOCK_H]
        wv = tl.load(w_ptr + r * H + h, mask=hm, other=0.0).to(tl.float32)
        s = tl.maximum(dots, 0.0) * tl.cast(scale, tl.float32)  # torch.compile passes floats as fp64
        s = tl.sum(s * wv[None, :], axis=1)
        tl.store(out_ptr + r * M + m, tl.where(vis, s, float("-inf")), mask=mm)


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                          n: torch.Tensor, scale: float) -> torch.Tensor:
    """The same in one launch."""
    assert triton is not None, "triton is not installed"
    R, H, D = q.shape
    M = slots.shape[1]
    out = torch.empty(R, M, dtype=torch.float32, device=q.device)
    if R and M:
        block_m = 32
        bf16 = dots_in_bf16(keys)
        _indexer_scores_kernel[(R, triton.cdiv(M, block_m))](
            q.to(torch.bfloat16 if bf16 else torch.float32).contiguous(), w.float().contiguous(), keys.contiguous(),
            slots.contiguous(), n.contiguous(), out, M, H, D, float(scale), BLOCK_M=block_m,
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_D=max(16, triton.next_power_of_2(D)), BF16=bf16)
    return out


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, n: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere."""
    if q.is_cuda and triton is not None:
        return indexer_scores_triton(q, w, keys, slots, n, scale)
    return indexer_scores_torch(q, w, keys, slots, n, scale)


# ---- picks -> attention source ------------------------------------------------------------------------------------
def per_row_slots(eslots: torch.Tensor, rows_of: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[R, M] entry slots of each query row from one row per request (eslots[rows_of[r]], the form
    dsv4.runtime.attn_metadata.TokenKeySlots keeps), 0 (a valid slot) where e >= n[r]."""
    slots = eslots[rows_of]
    return slots.masked_fill(torch.arange(slots.shape[1], device=slots.device)[None, :] >= n[:, None], 0)


def pick_sources_torch(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None,
                       rows_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed-entry source of the sink attention from top-k picks [R, K] (entry ids; -1 = none) over the
    rows' entry slots [R, M]: (picks, slots [R, K], mask [R, K]). With the scores [R, M] the picks were taken from,
    a pick whose score is -inf (fewer visible entries than K) becomes -1 first. `rows_of` [R]: row r's slots are
    eslots[rows_of[r]] (one row per request, dsv4.runtime.attn_metadata.TokenKeySlots); a -1 pick then takes its
    request's entry 0's slot (masked either way)."""
    if scores is not None:
        picks = torch.where(scores.gather(1, picks) > float("-inf"), picks, torch.full_like(picks, -1))
    if rows_of is not None:
        return picks, eslots[rows_of[:, None], picks.clamp(min=0)], picks >= 0
    return picks, eslots.gather(1, picks.clamp(min=0)), picks >= 0


if triton is not None:

    @triton.jit
    def _pick_sources_kernel(picks_ptr, eslots_ptr, rows_ptr, scores_ptr, picks_out_ptr, slots_out_ptr,
                             mask_out_ptr, K, M, HAS_SCORES: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        er = tl.load(rows_ptr + r).to(tl.int64) if ROWS else r  # the row's eslots row
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        p = tl.load(picks_ptr + r * K + j, mask=jm, other=-1).to(tl.int64)
        safe = tl.maximum(p, 0)
        if HAS_SCORES:
            s = tl.load(scores_ptr + r * M + safe, mask=jm, other=float("-inf"))
            p = tl.where(s > float("-inf"), p, -1)
        slot = tl.load(eslots_ptr + er * M + tl.maximum(p, 0), mask=jm, other=0)
        tl.store(picks_out_ptr + r * K + j, p, mask=jm)
        tl.store(slots_out_ptr + r * K + j, slot, mask=jm)
        tl.store(mask_out_ptr + r * K + j, p >= 0, mask=jm)


def pick_sources_triton(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None,
                        rows_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in one launch (instead of 3, or 7 with the scores)."""
    assert triton is not None, "triton is not installed"
    R, K = picks.shape
    picks, eslots = picks.contiguous(), eslots.contiguous()
    picks_out, slots_out = torch.empty_like(picks), torch.empty(R, K, dtype=eslots.dtype, device=eslots.device)
    mask_out = torch.empty(R, K, dtype=torch.bool, device=picks.device)
    if R and K:
        sc = scores.contiguous() if scores is not None else picks
        rows = rows_of.contiguous() if rows_of is not None else picks
        _pick_sources_kernel[(R,)](picks, eslots, rows, sc, picks_out, slots_out, mask_out, K,
                                   eslots.shape[1], HAS_SCORES=scores is not None, ROWS=rows_of is not None,
                                   BLOCK_K=triton.next_power_of_2(K))
    return picks_out, slots_out, mask_out


def pick_sources(picks: torch.Tensor, eslots: torch.Tensor, scores: torch.Tensor | None = None,
                 rows_of: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA, torch elsewhere."""
    if picks.is_cuda and triton is not None:
        return pick_sources_triton(picks, eslots, scores, rows_of)
    return pick_sources_torch(picks, eslots, scores, rows_of)


# ---- decode: selection through the block table, looping to each row's visible entries ---------------------------
# A decode row r sees entries e < n[r] of its group, entry e in slot table[r, e // bs] * bs + e % bs (the runtime's
# `EntryTable`). The reference materialises every entry's slot up to max_entries (= ceil(max_model_len / ratio)),
# scores them all and sorts them; the Triton path scores only the visible entries (or, restricted to candidate
# blocks, only those blocks' entries) and keeps a running top-k, so its work and scratch never depend on
# max_model_len.

def table_entry_slots(table: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """[R, width] int64 slots of entries 0..width-1 through batch-order tables [R, max_blocks] (blocks past the
    table clamped to its last column, masked by every reader). The references' view: O(width) per row."""
    e = torch.arange(width, device=table.device).expand(table.shape[0], -1)
    blk = (e // block_size).clamp(max=table.shape[1] - 1)
    return table.gather(1, blk).long() * block_size + e % block_size


def candidate_blocks_of(scores: torch.Tensor, newest: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """The candidate source's per-query pre-selection over scores [Q, n] (-inf = invisible): block scores = max
    over `block` entries, the block of the newest visible entry `newest` [Q] (< 0: none) pinned to +inf, the top
    `keep` blocks with a finite score, ties to the lowest block. [Q, keep] ids, -1 = none."""
    Q, n = scores.shape
    nb = -(-n // block)
    padded = F.pad(scores, (0, nb * block - n), value=float("-inf"))
    bs = padded.view(Q, nb, block).amax(dim=-1)
    pin = (newest.clamp(min=0) // block)[:, None]  # the newest visible entry's block: always kept
    bs = bs.scatter(1, pin, torch.where((newest >= 0)[:, None], float("inf"), bs.gather(1, pin)))
    picks = stable_topk(bs, min(keep, nb))
    picks = torch.where(bs.gather(1, picks) > float("-inf"), picks, torch.full_like(picks, -1))
    return F.pad(picks, (0, keep - picks.shape[1]), value=-1)  # always `keep` columns


def candidate_pool(candidates: torch.Tensor, n_entries: int, block: int) -> torch.Tensor:
    """[R, n_entries] bool: whether each entry's block (entry // block) is among the row's candidate blocks
    `candidates` [R, C] (-1 = none). Marks the C blocks in a per-row block map, then reads it per entry: R x (C +
    n_entries) work, where comparing every entry with every candidate would be R x C x n_entries (C is 2048 for
    V4.1-Flash: ~9 M elements at 32 decode rows of a short context, ~10^11 for a prefill chunk of a long one)."""
    nb = -(-n_entries // block)
    # slot 0 takes the ids that name no block of these entries (-1, or past the last one): never read
    ids = torch.where((candidates >= 0) & (candidates < nb), candidates + 1, 0)
    marked = torch.zeros(candidates.shape[0], nb + 1, dtype=torch.bool, device=candidates.device)
    marked.scatter_(1, ids, True)
    entry_block = torch.arange(n_entries, device=candidates.device) // block
    return marked[:, 1:][:, entry_block]


Selection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def decode_select_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, block_size: int,
                        n: torch.Tensor, max_entries: int, scale: float, k: int, pool: torch.Tensor | None = None,
                        cand_block: int = 1, keep_blocks: int = 0) -> Selection:
    """Reference decode selection: the top-k picks [R, k] (entry ids, -1 = none: fewer than k visible / allowed),
    their slots [R, k] and mask [R, k], and (keep_blocks > 0, the candidate source) the kept candidate blocks
    [R, keep_blocks] of the unrestricted scores. `pool` [R, C] (a later index source): only entries of these
    candidate blocks of `cand_block` entries may be picked."""
    eslots = table_entry_slots(table, block_size, max_entries)
    s = indexer_scores_torch(q, w, keys, eslots, n, scale)
    cands = candidate_blocks_of(s, n - 1, cand_block, keep_blocks) if keep_blocks > 0 else None
    if pool is not None:
        s = s.masked_fill(~candidate_pool(pool, s.shape[1], cand_block), float("-inf"))
    picks, slots, mask = pick_sources_torch(stable_topk(s, k), eslots, s)
    return picks, slots, mask, cands


def pick_table_sources_torch(picks: torch.Tensor, table: torch.Tensor, block_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Picks [R, K] published by an earlier layer (-1 = none) -> (picks, slots, mask) through the rows' tables:
    what `pick_sources` computes from a materialised slot matrix (a -1 pick takes entry 0's slot, masked)."""
    p = picks.clamp(min=0)
    return picks, table.gather(1, p // block_size).long() * block_size + p % block_size, picks >= 0


# Keys of the running top-k: a score and its entry (or block) id packed in one int64 whose descending order is the
# reference's stable_topk order (score descending, ties to the lowest id): bits 62..31 = the fp32 score mapped to
# an unsigned order (+ 2^31), bits 30..0 = 2^31 - 1 - id. Every real key is >= 0; -1 marks an empty place.
EMPTY_KEY = -1
# Programs per row of the scoring kernel (from shapes only: the decode step is captured). 64: at batch 1 every
# split count measured gains up to 64 (a 32,768-entry candidate row 462 -> 273 us from 16 to 64 splits on an H100,
# 64 heads, benchmarks/results/2026-12-05-h100-decode-select-splits; V4.1's 131K rows are 65K-131K entries at 32
# heads, not yet measured); from batch 8 the 2x-SM rule below picks ~32.
MAX_SPLITS = 64
# Programs per row of the merge's first stage (`merge_groups`). The merge was one program a row: at batch 1 and 131K
# its 64 lists of 512 keys were walked in turn on one SM, 336 us a call on an H100 (2026-12-05-h100-decode-select-splits).
MAX_GROUPS = 8
# Warps of a merge program. 8 beat 4 in every case timed on an H100 (the three selection kinds, G 1-8, batch 1 and 8,
# 32K and 131K entries, same G: the whole selection 8-19% faster for candidate rows, 28-31% pooled, 9-34% plain;
# benchmarks/results/2026-12-06-h100-decode-select-merge-warps): the merge's sorts and cuts are wide tiles, and
# 8 warps keep more of one row's work in flight on its SM.
MERGE_WARPS = 8
# Warps of a scoring (split) program. At 4 its sm_90 build spills (255 registers and 192-240 bytes of stack for
# V4.1's shapes, Triton 3.9 here: benchmarks/select_kernels_sass.py); at 8 it does not (244, no stack), yet 8 lost
# 20-26% at batch 8 and gained only 1-13% at batch 1 on an H100 (2026-12-06-h100-decode-select-split-warps): the
# spill costs less than halving the programs an SM holds.
SPLIT_WARPS = 4
# Block lists of a split chunk of at most LB blocks kept unsorted (no 2LB-key sort a split): DSV4_RAW_BLOCK_LISTS=1
# (default) decides per row in the kernel; 2 compiles the LB-tile merge out where max_entries bounds every chunk to
# LB blocks (a quarter of the code, but max_model_len then picks the compiled variant); 0 keeps the sorted LB-tile
# merges. With the radix merge on an H100 a 131K candidate row took 370 us with 0, 245 with 1, 243 with 2
# (2026-12-06-h100-decode-select-radix): 1 stays the default, 2 gains nothing measurable.
RAW_BLOCK_LISTS = int(os.environ.get("DSV4_RAW_BLOCK_LISTS", "1"))
# The merge as a radix select (`_radix_*` below) instead of sorted cuts. Its 18 launches cost ~20 us more than the
# sort merge's 1-2 on short rows, and it gains from 4K entries on: timed on an H100, the whole selection at batch 1
# and 131K entries 664 -> 132 us (candidate rows), 242 -> 75 (plain), 89 -> 52 (pooled); at batch 32 and 1-4K
# entries it lost (plain 24 -> 55 us, candidate 69 -> 103); benchmarks/results/2026-12-06-h100-decode-select-radix.
# So by default (DSV4_SELECT_RADIX unset or "auto") it merges where the sort merge would take >= RADIX_MIN_SPLITS
# splits a row (batch <= 16 on 132 SMs: measured at 1 and 8, where it won from 4K entries); "1" / "0" force it.
_RADIX_ENV = os.environ.get("DSV4_SELECT_RADIX", "auto")
if _RADIX_ENV not in ("auto", "0", "1"):
    raise ValueError(f"DSV4_SELECT_RADIX must be auto, 0 or 1, not {_RADIX_ENV!r}")
RADIX_SELECT: bool | None = None if _RADIX_ENV == "auto" else _RADIX_ENV == "1"
RADIX_MIN_SPLITS = 16
# Split cap with the radix merge, whose cost grows with the keys (2L a split) rather than with sorted lists: at
# batch 1 and 131K entries 256 splits beat 64 (candidate 245 -> 132 us, plain 172 -> 75) and cost ~1 us at 1K
# entries; at batch 8 the 2x-SM rule's 33 beat 128 and 256
RADIX_MAX_SPLITS = 256
RADIX_ROUNDS = 8  # 8-bit digits of an int64 key
RADIX_TILE = 256  # keys a count / gather step
RADIX_WRITE_KEYS = 32  # keys a program of the final write ranks (and places)
RADIX_WRITE_TILE = 256  # keys it compares them with a step
# int64 places a row: [0, 4) the entries' state (prefix, need, done), [4, 8) the blocks', [8, 264) and [264, 520)
# their digit counts, 520 / 521 their gather counts
RADIX_STATE = 522

if triton is not None:

    @triton.jit
    def _order_keys(s, ids):
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0 in the reference's sort: one key for both
        bits = s.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648  # float order, >= 0
        return ordered * 2147483648 + (2147483647 - ids)

    @triton.jit
    def _cut(ptr, c, cap, L: tl.constexpr):
        """The first c (<= 2L) keys at ptr sorted descending, the top min(L, cap) kept in place (-1 past c: a
        buffer of cap < L places holds them all); returns the L-th (the new threshold: later keys must beat it;
        -1 when cap < L). The selection kernels sort through this (2L wide) and `_sort_head` (L wide), each called
        from one place per list kind: a 2L-key int64 sort is most of their compile time (tens of seconds for
        2L = 4096), paid once per inlined call site."""
        tl.debug_barrier()  # the buffer's stores (by other threads) are visible
        j = tl.arange(0, 2 * L)
        x = tl.sort(tl.load(ptr + j, mask=j < c, other=-1), descending=True)
        tl.store(ptr + j, x, mask=(j < L) & (j < cap))
        tl.debug_barrier()
        return tl.load(ptr + (L - 1), mask=tl.zeros([], tl.int32) + cap >= L, other=-1)  # cap may be a constexpr

    @triton.jit
    def _sort_head(ptr, c, cap, L: tl.constexpr):
        """The first c (<= L) keys at ptr sorted descending in place (min(L, cap) places stored, -1 past c): the
        final sort of a merge that never held more than L keys (every short context's), at half `_cut`'s width."""
        tl.debug_barrier()
        j = tl.arange(0, L)
        x = tl.sort(tl.load(ptr + j, mask=j < c, other=-1), descending=True)
        tl.store(ptr + j, x, mask=j < cap)
        tl.debug_barrier()

    @triton.jit
    def _merge_top(list_ptr, tile_ptr, L: tl.constexpr):
        """list[0:L) := the L largest keys of list[0:L) and tile[0:L), sorted descending; returns the new
        smallest kept key. Both live in global scratch (L2-resident), so the tile can be filled piecewise."""
        tl.debug_barrier()  # the tile's stores (by other threads) are visible
        i = tl.arange(0, 2 * L)
        x = tl.load(tl.where(i < L, list_ptr + i, tile_ptr + (i - L)))
        x = tl.sort(x, descending=True)
        tl.store(list_ptr + i, x, mask=i < L)
        tl.debug_barrier()
        return tl.load(list_ptr + (L - 1))

    @triton.jit
    def _select_split_kernel(q_ptr, w_ptr, k_ptr, table_ptr, t_stride, n_ptr, cand_ptr, c_stride, C,
                             row_ptr, tile_ptr, brow_ptr, btile_ptr, S, H, D, BS, scale,
                             L: tl.constexpr, LB: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, POOL: tl.constexpr,
                             BLOCKS: tl.constexpr, BF16: tl.constexpr, RAW_BLOCKS: tl.constexpr,
                             LW: tl.constexpr, APPEND: tl.constexpr):
        """Program (row r, split s): scores of units [s*chunk, (s+1)*chunk) of the row (a unit is an entry, or in
        POOL mode a place c*CB + j of candidate block c), chunk = ceil(U / S) in SUB multiples, U = n (POOL: C*CB).
        chunk <= L ("raw"): every key goes to row[u] (no sort here; the merge takes them in L-wide windows).
        Else each split keeps a running top-L list in row[s*LW:(s+1)*LW) (LW = L: merging a full tile of L keys
        when its best beats the list's worst; APPEND, LW = 2L, for the radix merge, which reads keys in any order:
        the keys above the running threshold appended, cut to the top L only when the 2L places would overflow,
        -1 past the last at the end: one sort where the merges of sorted tiles made one a tile). BLOCKS (the
        candidate source): the same for block keys (max over CB entries, the newest visible entry's block pinned to
        +inf) in brow, with LB-wide lists."""
        r = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        scale = tl.cast(scale, tl.float32)  # torch.compile passes floats as fp64
        n = tl.load(n_ptr + r)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        h = tl.arange(0, BLOCK_H)
        hm = h < H
        q = tl.load(q_ptr + r * H * D + h[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        wv = tl.load(w_ptr + r * H + h, mask=hm, other=0.0)
        if POOL:
            U = C * CB
        else:
            U = n
        chunk = tl.maximum(tl.cdiv(tl.cdiv(U, S), SUB), 1) * SUB
        start = split * chunk
        end = tl.minimum(start + chunk, U)
        row = row_ptr + r * S * LW
        brow = brow_ptr + r * S * LB
        lst = row + split * LW
        tile = tile_ptr + (r * S + split) * L
        blst = brow + split * LB
        btile = btile_ptr + (r * S + split) * LB
        jl = tl.arange(0, L)
        jb = tl.arange(0, LB)
        # a chunk of at most LB blocks keeps its block keys as they come, unsorted (the merge reads a list's keys in
        # any order): no LB-tile merge, whose 2LB-key sort (4,096 keys for V4.1's kept 2,048 blocks) each split
        # paid at the end of every long row
        # RAW_BLOCKS: 2 = every chunk of the launch fits (the host's bound from max_entries: the LB-tile merge is not
        # even compiled, and its 2LB-key sort's registers with it), 1 = where the chunk fits, 0 = never
        # (DSV4_RAW_BLOCK_LISTS=0, comparisons: every list of blocks through LB-tile merges)
        if RAW_BLOCKS == 2:
            blocks_raw = chunk >= 0
        elif RAW_BLOCKS == 1:
            blocks_raw = chunk // CB <= LB
        else:
            blocks_raw = chunk < 0
        if chunk > L:  # running lists (else raw keys)
            if not APPEND:
                tl.store(lst + jl, tl.full([L], -1, tl.int64))
            if BLOCKS:
                tl.store(blst + jb, tl.full([LB], -1, tl.int64))
                if RAW_BLOCKS != 2:
                    if blocks_raw == 0:
                        tl.store(btile + jb, tl.full([LB], -1, tl.int64))
        thr = tl.zeros([], tl.int64) - 1
        held = tl.zeros([], tl.int32)  # APPEND: keys in the list
        newest_blk = tl.where(n > 0, (n - 1) // CB, -1)
        for t0 in range(start, end, L):
            tmax = tl.zeros([], tl.int64) - 1
            for s0 in range(0, L, SUB):
                u = t0 + s0 + tl.arange(0, SUB)
                um = u < end
                if POOL:
                    c = tl.load(cand_ptr + r * c_stride + u // CB, mask=um, other=-1)
                    e = c * CB + u % CB
                    valid = um & (c >= 0) & (e < n)
                else:
                    e = u
                    valid = um
                e = tl.where(valid, e, 0)
                key = tl.full([SUB], -1, tl.int64)
                sc = tl.full([SUB], float("-inf"), tl.float32)
                if tl.max(valid.to(tl.int32), axis=0) > 0:  # a sub-tile with nothing to score costs its id loads
                    blk = tl.load(table_ptr + r * t_stride + e // BS, mask=valid, other=0).to(tl.int64)
                    slot = blk * BS + e % BS
                    kt = tl.load(k_ptr + slot[:, None] * D + d[None, :], mask=valid[:, None] & dm[None, :],
                                 other=0.0)
                    dots = _score_dot(kt, tl.trans(q), BF16)  # [SUB, BLOCK_H]
                    s = tl.sum(tl.maximum(dots, 0.0) * scale * wv[None, :], axis=1)
                    sc = tl.where(valid, s, float("-inf"))
                    key = tl.where(valid, _order_keys(s, e), -1)
                if chunk <= L:
                    tl.store(row + u, key, mask=um)
                else:
                    tl.store(tile + s0 + tl.arange(0, SUB), key)
                    tmax = tl.maximum(tmax, tl.max(key, axis=0))
                if BLOCKS:
                    bmax = tl.max(tl.reshape(sc, [SUB // CB, CB]), axis=1)
                    bid = (t0 + s0) // CB + tl.arange(0, SUB // CB)
                    bvalid = (bid * CB < n) & (bid * CB < end)
                    bmax = tl.where(bid == newest_blk, float("inf"), bmax)
                    bkey = tl.where(bvalid, _order_keys(bmax, bid), -1)
                    bpos = bid - start // CB
                    if chunk <= L:
                        tl.store(brow + bid, bkey, mask=bid * CB < end)
                    elif blocks_raw:
                        tl.store(blst + bpos, bkey, mask=bpos < LB)  # (always, unless n passes max_entries)
                    else:
                        tl.store(btile + bpos % LB, bkey)
            if chunk > L:
                if APPEND:
                    tl.debug_barrier()  # the tile's stores (by other threads) are visible
                    x = tl.load(tile + jl)
                    tl.debug_barrier()  # and every thread holds its share before the next tile's stores
                    held, thr = _take(lst, held, thr, x, t0 >= 0, L, L, False)
                elif tmax > thr:
                    thr = _merge_top(lst, tile, L)
                if BLOCKS and RAW_BLOCKS != 2:
                    done = (t0 + L - start) // CB  # blocks pending since the last merge fill the tile, or the end
                    if (blocks_raw == 0) & ((done % LB == 0) | (t0 + L >= end)):
                        _merge_top(blst, btile, LB)
                        tl.store(btile + jb, tl.full([LB], -1, tl.int64))
                        tl.debug_barrier()
        if APPEND:
            if chunk > L:  # places past the held keys may hold keys a cut dropped
                tl.debug_barrier()
                jw = tl.arange(0, LW)
                tl.store(lst + jw, tl.full([LW], -1, tl.int64), mask=jw >= held)

    @triton.jit
    def _take(dst, c, thr, x, live, cap, L: tl.constexpr, HEAD: tl.constexpr):
        """One window x [L] of keys (-1 = none) into a running top-L at dst (2L places, c held): the keys above the
        threshold thr (the L-th kept, -1 until L are held) are appended; a buffer that would pass 2L is cut first
        (sorted, top min(L, cap) kept). `live` false (the pass after the last window, x all -1) sorts what is held:
        the final cut, or with HEAD an L-wide sort when at most L keys are held. Returns (c, thr). Each merge calls
        this once per list kind, so each sort width is one call site (an inlined 2L = 4,096-key int64 sort is tens
        of seconds of compile)."""
        ok = x > thr
        head = False  # a constant unless HEAD: without it the L-wide sort is not even generated
        if HEAD:
            head = (not live) & (c <= L)
        if head:
            _sort_head(dst, c, cap, L)
        elif (not live) | (c + tl.sum(ok.to(tl.int32), axis=0) > 2 * L):
            thr = _cut(dst, c, cap, L)
            c = tl.minimum(c, cap)
            ok = x > thr
        oki = ok.to(tl.int32)
        tl.store(dst + c + tl.cumsum(oki, axis=0) - 1, x, mask=ok)
        return c + tl.sum(oki, axis=0), thr

    @triton.jit
    def _top_of(row, p0, p1, acc, L: tl.constexpr, W, V):
        """acc[0:L) := the top L of keys p0 <= p < p1 (-1 = none), sorted, -1 past the last; acc has 2L places;
        L-wide windows through `_take`, with its short-context sort (decode compiles once, and every step pays its
        sort). Key p is at row[(p // V) * W + p % V]: lists of W places of which only the first V can hold keys
        (the splits' sorted lists: a split's chunk has at most V blocks), or V = W for keys in a row. So the
        candidate source's block lists at 131K and 64 splits (256 blocks in 2,048 places each) are read 256 a
        list, not 2,048. Only keys that beat the threshold cost sort work: after the first L keys few others
        pass."""
        c = tl.zeros([], tl.int32)
        thr = tl.zeros([], tl.int64) - 1
        j = tl.arange(0, L)
        for w0 in range(p0, p1 + L, L):
            p = w0 + j
            x = tl.load(row + (p // V) * W + p % V, mask=p < p1, other=-1)
            c, thr = _take(acc, c, thr, x, w0 < p1, L, L, True)

    @triton.jit
    def _key_counts(n, C, S, L: tl.constexpr, LB: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr,
                    POOL: tl.constexpr, LW: tl.constexpr):
        """What the split kernel left for a row of n visible entries: (entry keys, block keys, block keys a split's
        list can hold). Raw (chunk <= L): the U unit keys in a row, and a block key per CB units; else S lists of LW
        places of entry keys (L sorted ones; the radix merge's 2L, -1 past the held), and S block lists of which
        the first min(LB, chunk / CB) places can hold keys."""
        if POOL:
            U = C * CB
        else:
            U = n
        chunk = tl.maximum(tl.cdiv(tl.cdiv(U, S), SUB), 1) * SUB
        raw = chunk <= L
        nk = tl.where(raw, U, S * LW)
        vb = tl.where(raw, LB, tl.minimum(LB, chunk // CB))
        nb = tl.where(raw, tl.cdiv(U, CB), S * vb)
        return nk, nb, vb

    @triton.jit
    def _merge_plan(row, part, acc, nk, V1, g, G, STAGE, L: tl.constexpr):
        """What a merge program reads and where its top list goes, for one list kind (entries: L-key lists, V1 = L;
        blocks: LB-key lists, V1 = vb) of a row with nk keys: (source, first key, end, W, V, destination) for
        `_top_of`. STAGE 1: the g-th of G equal shares of the split kernel's keys, to group list g (part + g 2L);
        STAGE 2: the G group lists (each holds at most its share), or with G = 1 the split kernel's keys, to acc."""
        nk = nk.to(tl.int64)  # int32 for a pooled row (C * CB), int64 for a loaded count: one type in every branch
        share = tl.cdiv(nk, G)
        if STAGE == 1:
            src = row
            p0 = tl.minimum(g * share, nk)  # a group past the last key still writes its (empty) list
            p1 = tl.minimum(nk, p0 + share)
            W = tl.zeros([], tl.int64) + L
            V = tl.zeros([], tl.int64) + V1
            dst = part + g * (2 * L)
        elif G > 1:
            src = part
            V = tl.maximum(tl.minimum(share, L), 1).to(tl.int64)  # >= 1: the address divides by it
            p0 = nk * 0
            p1 = G * V
            W = tl.zeros([], tl.int64) + 2 * L
            dst = acc
        else:
            src = row
            p0 = nk * 0
            p1 = nk + 0
            W = tl.zeros([], tl.int64) + L
            V = tl.zeros([], tl.int64) + V1
            dst = acc
        return src, p0, p1, W, V, dst

    @triton.jit(do_not_specialize=["S", "G", "STAGE"])
    def _select_merge_kernel(n_ptr, C, row_ptr, brow_ptr, part_ptr, bpart_ptr, acc_ptr, bacc_ptr, S, G, STAGE,
                             table_ptr, t_stride, BS, picks_ptr, slots_ptr, mask_ptr, K, cands_ptr, KEEP,
                             L: tl.constexpr, LB: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr,
                             KP: tl.constexpr, KEEPP: tl.constexpr, POOL: tl.constexpr, BLOCKS: tl.constexpr):
        """Per row: the top K of every split's keys (raw keys at row[u], or one list per split), then the picks,
        their slots through the table and the mask; BLOCKS: the kept candidate blocks. acc / bacc: 2L / 2LB places
        a row. With many splits a first stage cuts them down: STAGE 1 (grid (R, G)), program (r, g) writes the top
        list of the g-th share of the row's keys to part[r, g] (2L places; blocks bpart, 2LB) and stops; STAGE 2
        (grid (R,)) then merges G lists, not S lists or every raw key (one program a row walked 64 lists of 512
        keys in turn at batch 1 and 131K, on one SM). One kernel for both stages, its stage and counts not
        specialized: its sorts compile once (the candidate source's 4,096-key sort is tens of seconds)."""
        r = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        nk, nb, vb = _key_counts(tl.load(n_ptr + r), C, S, L, LB, CB, SUB, POOL, L)
        src, p0, p1, W, V, dst = _merge_plan(row_ptr + r * S * L, part_ptr + r * G * (2 * L), acc_ptr + r * (2 * L),
                                             nk, L, g, G, STAGE, L)
        _top_of(src, p0, p1, dst, L, W, V)
        if BLOCKS:
            src, p0, p1, W, V, dst = _merge_plan(brow_ptr + r * S * LB, bpart_ptr + r * G * (2 * LB),
                                                 bacc_ptr + r * (2 * LB), nb, vb, g, G, STAGE, LB)
            _top_of(src, p0, p1, dst, LB, W, V)
        if STAGE == 2:
            _write_selection(r, acc_ptr, bacc_ptr, table_ptr, t_stride, BS, picks_ptr, slots_ptr, mask_ptr, K,
                             cands_ptr, KEEP, L, LB, KP, KEEPP, BLOCKS)

    @triton.jit
    def _write_selection(r, acc_ptr, bacc_ptr, table_ptr, t_stride, BS, picks_ptr, slots_ptr, mask_ptr, K,
                         cands_ptr, KEEP, L: tl.constexpr, LB: tl.constexpr, KP: tl.constexpr,
                         KEEPP: tl.constexpr, BLOCKS: tl.constexpr):
        """Row r's outputs from its sorted top keys (acc, 2L places a row; BLOCKS: bacc, 2LB): the picks (entry
        ids), their slots through the block table and the mask; the kept candidate blocks."""
        j = tl.arange(0, KP)
        jm = j < K
        key = tl.load(acc_ptr + r * (2 * L) + j, mask=jm, other=-1)
        ok = key >= 0
        e = tl.where(ok, 2147483647 - (key % 2147483648), 0)
        blk = tl.load(table_ptr + r * t_stride + e // BS, mask=jm, other=0).to(tl.int64)
        tl.store(picks_ptr + r * K + j, tl.where(ok, e, -1), mask=jm)
        tl.store(slots_ptr + r * K + j, blk * BS + e % BS, mask=jm)
        tl.store(mask_ptr + r * K + j, ok, mask=jm)
        if BLOCKS:
            jb = tl.arange(0, KEEPP)
            jbm = jb < KEEP
            bkey = tl.load(bacc_ptr + r * (2 * LB) + jb, mask=jbm & (jb < LB), other=-1)
            bid = 2147483647 - (bkey % 2147483648)
            tl.store(cands_ptr + r * KEEP + jb, tl.where(bkey >= 0, bid, -1), mask=jbm)

    # ---- the merge as a radix select (`select_plan`) ------------------------------------------------------------
    # The sort-based merge above cuts 2L-key (candidate blocks: up to 4,096-key) tiles with bitonic sorts, a few
    # of them one after another in one program a row. Here the top K of a row's split keys are found digit by
    # digit instead: keys are unique int64 (score order, then id), so the K-th largest is fixed by its 8-bit
    # digits, most significant first. Each round, the row's P programs count their keys of the current bucket by
    # digit (a 256-bin histogram a row, added with atomics) and one program a row (`_radix_scan`, the next launch)
    # picks the digit the K-th key has; a row is done once its bucket's keys are all taken (for spread scores
    # expected within 2-4 of the 8 rounds, not yet measured: later launches return at once). Then every key >= the
    # threshold is gathered (any order) and placed by its rank among the row's gathered keys (the sort-based
    # merge's output, bit for bit).

    @triton.jit
    def _radix_count(src, nk, W, V, st, hist, ROUND, pid, P, TILE: tl.constexpr):
        """Program pid of P: the keys p < nk of one list kind (key p at src[(p // V) * W + p % V], -1 = none) in
        its share that lie in the row's bucket (the digits above this round's equal the state's prefix), counted
        by this round's digit into hist (256 places, int64)."""
        nk = nk.to(tl.int64)
        if tl.load(st + 2) == 0:  # not done
            prefix = tl.load(st)
            shift = 56 - 8 * ROUND
            share = tl.cdiv(nk, P)
            p0 = tl.minimum(pid * share, nk)
            p1 = tl.minimum(p0 + share, nk)
            bins = tl.arange(0, 512)
            counts = tl.zeros([512], tl.int32)
            for t0 in range(p0, p1, TILE):
                p = t0 + tl.arange(0, TILE)
                key = tl.load(src + (p // V) * W + p % V, mask=p < p1, other=-1)
                top = key >> shift  # (two shifts: >> 64 of an int64 is undefined)
                hit = (key >= 0) & ((top >> 8) == ((prefix >> shift) >> 8))
                # keys outside the bucket counted in bin 256, which is never added (every value in range: no
                # masked histogram needed)
                counts += tl.histogram(tl.where(hit, top & 255, 256).to(tl.int32), 512)
            tl.atomic_add(hist + bins, counts.to(tl.int64), mask=(bins < 256) & (counts > 0))

    @triton.jit
    def _radix_scan(st, hist, K, ROUND, LAST: tl.constexpr):
        """After a round's counts: the digit of the bucket's K-th largest key (K less the keys of higher buckets,
        kept in the state from round 1 on). The state (prefix, need, done) becomes that bucket; the row is done
        when the bucket holds exactly the keys still needed, or every key of the bucket is needed (fewer keys than
        K), or at the last digit. hist is zeroed for the next round."""
        if tl.load(st + 2) == 0:
            bins = tl.arange(0, 256)
            h = tl.load(hist + bins)
            tl.store(hist + bins, tl.zeros([256], tl.int64))
            prefix = tl.load(st)
            need = tl.load(st + 1)
            if ROUND == 0:
                need = need * 0 + K
            total = tl.sum(h, axis=0)
            if total <= need:  # every key of the bucket is taken: the threshold is the bucket's floor
                tl.store(st + 1, need - total)
                tl.store(st + 2, need * 0 + 1)
            else:
                ge = total - tl.cumsum(h, axis=0) + h  # keys with this digit or a larger one
                d = tl.max(tl.where(ge >= need, bins, -1), axis=0).to(tl.int64)
                above = tl.sum(tl.where(bins > d, h, 0), axis=0)
                need = need - above
                in_d = tl.sum(tl.where(bins == d, h, 0), axis=0)
                shift = 56 - 8 * ROUND
                tl.store(st, prefix | (d << shift))
                tl.store(st + 1, need)
                done = (in_d == need).to(tl.int64)
                if LAST:  # every digit fixed: the bucket is one key (keys are unique)
                    done = done * 0 + 1
                tl.store(st + 2, done)

    @triton.jit
    def _radix_gather(src, nk, W, V, st, cnt, out, cap, pid, P, TILE: tl.constexpr):
        """Program pid's keys >= the row's threshold (the state's prefix: its bucket and every higher one) appended
        to out (at most cap), in any order."""
        nk = nk.to(tl.int64)
        thr = tl.load(st)
        share = tl.cdiv(nk, P)
        p0 = tl.minimum(pid * share, nk)
        p1 = tl.minimum(p0 + share, nk)
        for t0 in range(p0, p1, TILE):
            p = t0 + tl.arange(0, TILE)
            key = tl.load(src + (p // V) * W + p % V, mask=p < p1, other=-1)
            ok = (key >= 0) & (key >= thr)
            oki = ok.to(tl.int32)
            c = tl.sum(oki, axis=0)
            if c > 0:
                at = tl.atomic_add(cnt, c.to(tl.int64)) + tl.cumsum(oki, axis=0) - 1
                tl.store(out + at, key, mask=ok & (at < cap))

    @triton.jit(do_not_specialize=["S", "ROUND", "P"])
    def _radix_count_kernel(n_ptr, C, S, row_ptr, brow_ptr, sel_ptr, ROUND, P, L: tl.constexpr,
                            LB: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr, POOL: tl.constexpr,
                            BLOCKS: tl.constexpr, TILE: tl.constexpr, ST: tl.constexpr, LW: tl.constexpr):
        """Grid (R, P): one round's counts of both list kinds. sel: a row's ST (RADIX_STATE) int64 places."""
        r = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        nk, nb, vb = _key_counts(tl.load(n_ptr + r), C, S, L, LB, CB, SUB, POOL, LW)
        sel = sel_ptr + r * ST
        _radix_count(row_ptr + r * S * LW, nk, LW, LW, sel, sel + 8, ROUND, pid, P, TILE)
        if BLOCKS:
            _radix_count(brow_ptr + r * S * LB, nb, LB, vb, sel + 4, sel + 264, ROUND, pid, P, TILE)

    @triton.jit(do_not_specialize=["ROUND"])
    def _radix_scan_kernel(sel_ptr, K, KEEP, ROUND, BLOCKS: tl.constexpr, LAST: tl.constexpr, ST: tl.constexpr):
        """Grid (R,): one round's scans of both list kinds."""
        sel = sel_ptr + tl.program_id(0).to(tl.int64) * ST
        _radix_scan(sel, sel + 8, K, ROUND, LAST)
        if BLOCKS:
            _radix_scan(sel + 4, sel + 264, KEEP, ROUND, LAST)

    @triton.jit(do_not_specialize=["S", "P"])
    def _radix_gather_kernel(n_ptr, C, S, row_ptr, brow_ptr, sel_ptr, acc_ptr, bacc_ptr, P, L: tl.constexpr,
                             LB: tl.constexpr, CB: tl.constexpr, SUB: tl.constexpr, POOL: tl.constexpr,
                             BLOCKS: tl.constexpr, TILE: tl.constexpr, ST: tl.constexpr, LW: tl.constexpr):
        """Grid (R, P): the keys at or above each row's thresholds into acc (entries, L places) / bacc (blocks)."""
        r = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        nk, nb, vb = _key_counts(tl.load(n_ptr + r), C, S, L, LB, CB, SUB, POOL, LW)
        sel = sel_ptr + r * ST
        _radix_gather(row_ptr + r * S * LW, nk, LW, LW, sel, sel + 520, acc_ptr + r * (2 * L), L, pid, P, TILE)
        if BLOCKS:
            _radix_gather(brow_ptr + r * S * LB, nb, LB, vb, sel + 4, sel + 521, bacc_ptr + r * (2 * LB), LB,
                          pid, P, TILE)

    @triton.jit
    def _rank_keys(src, c, i, TJ: tl.constexpr):
        """Keys src[i] of the first c (unique, >= 0; -1 where i >= c) and their places in a descending sort of
        those c: how many of them are larger."""
        ki = tl.load(src + i, mask=i < c, other=-1)
        rank = tl.zeros_like(i)
        for j0 in range(0, c, TJ):
            j = j0 + tl.arange(0, TJ)
            kj = tl.load(src + j, mask=j < c, other=-1)
            rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), axis=1)
        return ki, rank

    @triton.jit
    def _radix_write_kernel(sel_ptr, acc_ptr, bacc_ptr, table_ptr, t_stride, BS, picks_ptr, slots_ptr, mask_ptr,
                            K, cands_ptr, KEEP, L: tl.constexpr, LB: tl.constexpr, BLOCKS: tl.constexpr,
                            ST: tl.constexpr, TI: tl.constexpr, TJ: tl.constexpr):
        """Grid (R, P): program p places the gathered keys p TI .. (p+1) TI - 1 of row r at their ranks (a
        descending sort: the outputs `_write_selection` writes from sorted keys, place for place) and fills the
        places past the row's keys; the candidate blocks alike. A single program sorting 2,048 block keys took
        ~44 us at batch 1 (2026-12-06-h100-decode-optins, decode_b1-all-on-side.log); ranks spread over P
        programs compare each key with the row's others instead."""
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * TI + tl.arange(0, TI)
        sel = sel_ptr + r * ST
        c = tl.minimum(tl.load(sel + 520), L).to(tl.int32)
        key, rank = _rank_keys(acc_ptr + r * (2 * L), c, i, TJ)
        ok = i < c
        e = tl.where(ok, 2147483647 - (key % 2147483648), 0)
        # a place without a key reads the row's first table block, as `_write_selection` writes it
        blk = tl.load(table_ptr + r * t_stride + e // BS, mask=i < tl.maximum(c, K), other=0).to(tl.int64)
        at = tl.where(ok, rank, i)
        w = (ok | (i < K)) & (at < K)
        tl.store(picks_ptr + r * K + at, tl.where(ok, e, -1), mask=w)
        tl.store(slots_ptr + r * K + at, blk * BS + e % BS, mask=w)
        tl.store(mask_ptr + r * K + at, ok, mask=w)
        if BLOCKS:
            cb = tl.minimum(tl.load(sel + 521), LB).to(tl.int32)
            bkey, brank = _rank_keys(bacc_ptr + r * (2 * LB), cb, i, TJ)
            bok = i < cb
            bat = tl.where(bok, brank, i)
            tl.store(cands_ptr + r * KEEP + bat, tl.where(bok, 2147483647 - (bkey % 2147483648), -1),
                     mask=(bok | (i < KEEP)) & (bat < KEEP))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def select_splits(R: int, device: torch.device, cap: int = MAX_SPLITS) -> int:
    """Programs per row of the scoring kernel, from shapes only: enough that rows x splits fills the GPU twice, at
    most `cap`. Each split scores ceil(n / splits) entries (in 32-entry steps), so short rows use few of them."""
    return max(1, min(cap, -(-2 * _sm_count(device) // max(1, R))))


def select_plan(R: int, device: torch.device, radix: bool | None = None) -> tuple[int, bool]:
    """(splits a row, whether the merge is a radix select) for R rows, from shapes only (the decode step is
    captured): `radix` None picks by RADIX_SELECT, else by the sort merge's split count (RADIX_MIN_SPLITS)."""
    radix = RADIX_SELECT if radix is None else radix
    if radix is None:
        radix = select_splits(R, device) >= RADIX_MIN_SPLITS
    return select_splits(R, device, RADIX_MAX_SPLITS if radix else MAX_SPLITS), radix


def merge_groups(S: int) -> int:
    """Programs per row that first cut a row's S split lists (or raw keys) to G lists before the one-program merge:
    about 8 lists a group, at most MAX_GROUPS; 1 (no first stage) under 16 splits (batch 18 and up on 132 SMs)."""
    return max(1, min(MAX_GROUPS, S // 8))


def decode_select_triton(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                         block_size: int, n: torch.Tensor, max_entries: int, scale: float, k: int,
                         pool: torch.Tensor | None = None, cand_block: int = 1, keep_blocks: int = 0,
                         splits: int | None = None, groups: int | None = None,
                         merge_warps: int | None = None, radix: bool | None = None,
                         split_warps: int | None = None) -> Selection:
    """The same in two or three launches whose work follows each row's n (or its candidate blocks), never
    max_entries: scores of the visible entries into per-row scratch of splits x next_pow2(k) keys with running
    top-k lists, with many splits a first merge into `groups` lists a row, then a merge per row. `max_entries`
    only bounds k (as the reference's width does). `splits` / `groups` / `merge_warps` override the shape-derived
    counts and `split_warps` the scoring kernel's warps (tests, benchmarks); `radix` (default: `select_plan`)
    merges by radix select."""
    assert triton is not None, "triton is not installed"
    R, H, D = q.shape
    dev = q.device
    if R == 0 or k == 0:
        return (torch.full((R, k), -1, dtype=torch.int64, device=dev), torch.zeros(R, k, dtype=torch.int64, device=dev),
                torch.zeros(R, k, dtype=torch.bool, device=dev),
                torch.full((R, keep_blocks), -1, dtype=torch.int64, device=dev) if keep_blocks > 0 else None)
    # the merge kernel writes every place of these (no fill launches)
    picks = torch.empty(R, k, dtype=torch.int64, device=dev)
    slots = torch.empty(R, k, dtype=torch.int64, device=dev)
    mask = torch.empty(R, k, dtype=torch.bool, device=dev)
    cands = torch.empty(R, keep_blocks, dtype=torch.int64, device=dev) if keep_blocks > 0 else None
    blocks = keep_blocks > 0
    assert cand_block & (cand_block - 1) == 0, cand_block  # the block max reshapes a tile into [*, cand_block]
    SUB = max(32, cand_block)
    L = max(triton.next_power_of_2(k), SUB)
    LB = max(triton.next_power_of_2(keep_blocks), L // cand_block) if blocks else 1
    S, radix = select_plan(R, dev, radix)
    S = splits or S
    G = min(groups or merge_groups(S), max(1, S // 2))  # the group lists reuse the split kernel's tiles (S x L)
    LW = 2 * L if radix else L  # list places a split (the radix merge's lists are appended, not sorted)
    row = torch.empty(R, S * LW, dtype=torch.int64, device=dev)
    tile = torch.empty(R, S * L, dtype=torch.int64, device=dev)
    acc = torch.empty(R, 2 * L, dtype=torch.int64, device=dev)
    brow = torch.empty(R, S * LB, dtype=torch.int64, device=dev) if blocks else row
    btile = torch.empty(R, S * LB, dtype=torch.int64, device=dev) if blocks else tile
    bacc = torch.empty(R, 2 * LB, dtype=torch.int64, device=dev) if blocks else acc
    table = table if table.stride(1) == 1 else table.contiguous()
    cand = pool.contiguous() if pool is not None else picks
    C = pool.shape[1] if pool is not None else 0
    bf16 = dots_in_bf16(keys)
    n = n.contiguous()
    raw_blocks = min(RAW_BLOCK_LISTS, 1)
    if RAW_BLOCK_LISTS == 2:  # 2 when no row's chunk can pass LB blocks (n <= max_entries), else 1
        u_max = C * cand_block if pool is not None else max_entries
        chunk_max = max(1, triton.cdiv(triton.cdiv(u_max, S), SUB)) * SUB  # the kernel's chunk at n = max_entries
        raw_blocks = 2 if chunk_max // cand_block <= LB else 1
    _select_split_kernel[(R, S)](
        q.to(torch.bfloat16 if bf16 else torch.float32).contiguous(), w.float().contiguous(), keys.contiguous(),
        table, table.stride(0), n, cand, cand.stride(0), C, row, tile, brow, btile, S, H, D, block_size,
        float(scale), L=L, LB=LB, CB=cand_block, SUB=SUB, BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), POOL=pool is not None, BLOCKS=blocks, BF16=bf16,
        RAW_BLOCKS=raw_blocks, LW=LW, APPEND=radix, num_warps=split_warps or SPLIT_WARPS)
    args = (n, C, row, brow, tile, btile, acc, bacc, S, G)  # group lists [R, G, 2L] / [R, G, 2LB] in the tiles
    rest = (table, table.stride(0), block_size, picks, slots, mask, k, cands if cands is not None else picks,
            keep_blocks)
    meta = dict(L=L, LB=LB, CB=cand_block, SUB=SUB, KP=triton.next_power_of_2(k),
                KEEPP=triton.next_power_of_2(max(keep_blocks, 1)), POOL=pool is not None, BLOCKS=blocks,
                num_warps=merge_warps or MERGE_WARPS)
    if radix:
        _radix_merge(n, C, S, row, brow, acc, bacc, rest, meta)
        return picks, slots, mask, cands
    if G > 1:  # the tiles are free once the split kernel is done
        _select_merge_kernel[(R, G)](*args, 1, *rest, **meta)
    _select_merge_kernel[(R,)](*args, 2, *rest, **meta)
    return picks, slots, mask, cands


def _radix_merge(n: torch.Tensor, C: int, S: int, row: torch.Tensor, brow: torch.Tensor, acc: torch.Tensor,
                 bacc: torch.Tensor, rest: tuple, meta: dict) -> None:
    """The merge of `decode_select_triton` as a radix select: 2 launches a digit round (8 rounds, fixed for
    graph capture; a done row's programs return at once), a gather and the ranking write: 18 launches, plus the
    state's zero fill. P = S programs a row count and gather (each a share of the row's S lists of LW places: 2L,
    appended by the split kernel)."""
    R = row.shape[0]
    table, t_stride, block_size, picks, slots, mask, k, cands, keep = rest
    sel = torch.zeros(R, RADIX_STATE, dtype=torch.int64, device=row.device)
    lists = dict(L=meta["L"], LB=meta["LB"], CB=meta["CB"], SUB=meta["SUB"], POOL=meta["POOL"],
                 BLOCKS=meta["BLOCKS"], TILE=RADIX_TILE, ST=RADIX_STATE, LW=row.shape[1] // S)
    P = S
    for rnd in range(RADIX_ROUNDS):
        _radix_count_kernel[(R, P)](n, C, S, row, brow, sel, rnd, P, **lists, num_warps=4)
        _radix_scan_kernel[(R,)](sel, k, keep, rnd, BLOCKS=meta["BLOCKS"], LAST=rnd == RADIX_ROUNDS - 1,
                                 ST=RADIX_STATE, num_warps=1)
    _radix_gather_kernel[(R, P)](n, C, S, row, brow, sel, acc, bacc, P, **lists, num_warps=4)
    places = max(meta["L"], meta["LB"] if meta["BLOCKS"] else 0)  # keys and places a row (L >= k, LB >= keep)
    _radix_write_kernel[(R, triton.cdiv(places, RADIX_WRITE_KEYS))](
        sel, acc, bacc, table, t_stride, block_size, picks, slots, mask, k, cands, keep, L=meta["L"],
        LB=meta["LB"], BLOCKS=meta["BLOCKS"], ST=RADIX_STATE, TI=RADIX_WRITE_KEYS, TJ=RADIX_WRITE_TILE,
        num_warps=4)


def decode_select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, block_size: int,
                  n: torch.Tensor, max_entries: int, scale: float, k: int, pool: torch.Tensor | None = None,
                  cand_block: int = 1, keep_blocks: int = 0) -> Selection:
    """Triton on CUDA (when the candidate block is a power of two, as released), torch elsewhere."""
    if q.is_cuda and triton is not None and cand_block & (cand_block - 1) == 0:
        return decode_select_triton(q, w, keys, table, block_size, n, max_entries, scale, k, pool, cand_block,
                                    keep_blocks)
    return decode_select_torch(q, w, keys, table, block_size, n, max_entries, scale, k, pool, cand_block,
                               keep_blocks)


if triton is not None:

    @triton.jit
    def _table_picks_kernel(picks_ptr, table_ptr, t_stride, BS, slots_ptr, mask_ptr, K, BLOCK_K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        jm = j < K
        p = tl.load(picks_ptr + r * K + j, mask=jm, other=-1).to(tl.int64)
        e = tl.maximum(p, 0)
        blk = tl.load(table_ptr + r * t_stride + e // BS, mask=jm, other=0).to(tl.int64)
        tl.store(slots_ptr + r * K + j, blk * BS + e % BS, mask=jm)
        tl.store(mask_ptr + r * K + j, p >= 0, mask=jm)


def pick_table_sources_triton(picks: torch.Tensor, table: torch.Tensor, block_size: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in one launch."""
    assert triton is not None, "triton is not installed"
    R, K = picks.shape
    picks = picks.contiguous()
    table = table if table.stride(1) == 1 else table.contiguous()
    slots = torch.empty(R, K, dtype=torch.int64, device=picks.device)
    mask = torch.empty(R, K, dtype=torch.bool, device=picks.device)
    if R and K:
        _table_picks_kernel[(R,)](picks, table, table.stride(0), block_size, slots, mask, K,
                                  BLOCK_K=triton.next_power_of_2(K))
    return picks, slots, mask


def pick_table_sources(picks: torch.Tensor, table: torch.Tensor, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton on CUDA, torch elsewhere."""
    if picks.is_cuda and triton is not None:
        return pick_table_sources_triton(picks, table, block_size)
    return pick_table_sources_torch(picks, table, block_size)
