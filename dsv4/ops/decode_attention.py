"""Sink attention of the decode step (one query per row) as flash-decoding: torch reference and Triton.

q [R, H, D] attends, in one softmax with a per-head sink logit that has no value row, over the keys of 1 or 2
sources (the sliding window and the compressed entries), each a (cache [N, D], slots [R, L] int64, mask [R, L]
bool) triple: row r sees cache[slots[r, j]] where mask[r, j]. K = V (MQA: one latent per key, shared by every
head). The result equals `sink_attention_rows` on the concatenated gathered keys: logits and sums in fp32,
output in q's dtype; a row with no visible key puts all weight on the sink, i.e. outputs 0.
The second source may instead be a `TableSource` (cache, table [R, max_blocks], n [R], block_size, width): row r sees
entries e < n[r], entry e in slot table[r, e // block_size] * block_size + e % block_size (a compressed group read
through its block table, as every entry of DeepSeek-V4's HCA layers): the kernel loops to each row's n, so its work
and memory do not grow with `width` (ceil(max_model_len / ratio)), which only sizes the splits.

The Triton path reads the keys in place through the slots (the reference gathers them into a temporary, casts it
to fp32 and needs a cat, two einsums and a softmax: several launches and three copies of the keys). A first
kernel runs over (row, head block, split of one source's key range): batch 1 must still fill the GPU, so the key
range is split and each split leaves its partial max / sum / weighted values in an fp32 workspace; a second small
kernel merges the splits with the sink. Split counts come from tensor shapes only (no host sync: the decode step
is captured in a CUDA graph). From ~50 rows on (prefill token rows, large decode batches: `use_rows_kernel`) the
rows kernel runs instead: one program per (row, 64 heads, half of the value columns) over both sources, the sink
applied in place, one launch and no workspace (H100: 0.30-0.67x the split kernel's time from 64 rows on).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from dsv4.models.layers.attention import sink_attention_rows
from dsv4.ops.indexer import table_entry_slots
from dsv4.ops.rope import apply_rope_, apply_rope_triton_, rope_tables

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None

Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (cache [N, D], slots [R, L] int64, mask [R, L] bool)


@dataclass(frozen=True)
class TableSource:
    """Every visible entry of a row, read through its block table: entries e < n[r] in slot table[r, e //
    block_size] * block_size + e % block_size. `width` bounds n (the torch reference materialises [R, width])."""

    cache: torch.Tensor  # [N, D]
    table: torch.Tensor  # [R, max_blocks] int32
    n: torch.Tensor  # [R] int64
    block_size: int
    width: int

    def as_slots(self) -> Source:
        """The (cache, slots, mask) triple of the same keys: O(width) per row (references, the CPU)."""
        slots = table_entry_slots(self.table, self.block_size, self.width)
        visible = torch.arange(self.width, device=self.table.device)[None, :] < self.n[:, None]
        return self.cache, slots, visible


AnySource = Union[Source, TableSource]

BLOCK_H = 16  # heads per program: they share every key tile it loads (MQA); 16 is the smallest tl.dot M
BLOCK_N = 32  # keys per tile
# a split covers at least this many tiles. H200, graph replays at V4-Flash's shapes (H 64, D 512;
# benchmarks/decode_attention_splits.py, results/2026-12-04-h200-decode-launches): 1 tile a split against 2 takes a
# 128-key window from 12.3 to 8.8 us at batch 1 and 12.7 to 9.1 at batch 4 (window + 136 entries: 13.1 -> 9.8,
# 13.3 -> 12.0); from batch 32 on the rule below gives 2-3 tiles a split anyway, where 1 would be slower
MIN_SPLIT_TILES = 1
PROGRAMS_PER_SM = 2  # splits are added until (rows x head blocks x splits) reaches this many programs per SM
# Measured on an H200 (graph replay, H 64, D 512, W 128, top-k 512): BLOCK_H 16 x BLOCK_N 32 with 8 warps was
# within ~10% of the best of a 16/32/64 x 16/32/64 x 4/8-warp sweep at every batch (1, 32, 128); stages made no
# difference (the slot-indexed loads are not pipelined). BLOCK_H 64 spills: its fp32 accumulator is 128 KB.
SPLIT_WARPS = 8
SPLIT_STAGES = 2
# The rows kernel (many rows: prefill): 64 heads of a row in one program (a warp group's MMA height), so a key
# tile is loaded twice per row (once per half of the value columns), not four times (once per 16 heads). Warps:
# Triton lays the warps of chained dots (logits -> probabilities -> values) along the heads only, so more than one
# warp group for 64 heads would each compute the same logits; one warp group holds a [64, 256] fp32 half of the
# accumulator in 128 registers a thread
ROWS_BLOCK_H = 64
ROWS_BLOCK_N = 16  # H100: 0.64-0.76x the time of 32 from 128 rows on (2 programs an SM fit in shared memory, not 1)
ROWS_WARPS = 4
ROWS_STAGES = 2  # key-tile loads in flight (cp.async); 3 fits 2 programs an SM too (not yet measured)
ROWS_MIN_HALF_D = 32  # value columns are halved from D 64 on (a dot's K is at least 16; tests use small D)
# The rows kernel runs from rows x head blocks >= 0.12 of the SMs (16 rows of 64 heads on 132 SMs). H100, graph
# replays, H 64, D 512 (benchmarks/rows_attention_bench.py): without key splits it took 0.47-0.67x the split
# kernel's time at 64 rows and 0.83-1.28x at 32 (results/2026-12-05-h100-rows-attention), so it started at 50 rows;
# with the splits (`rows_splits`, 12-06) it is faster from 16 rows on (results/2026-12-06-h100-decode-optins,
# rows_splits.log): window + 512 keys 66.0 -> 36.1 us at 32 rows and 46.4 -> 29.0 at 16; window alone 23.6 -> 17.8
# and 16.0 -> 14.0 (within 0.4 us at 16 with 2 splits); window + 128 table entries 38.8 -> 22.7 and 21.5 -> 17.2.
# A batch-32 V4.1-Flash-8l replay spent 85-101 us a layer in the split kernel (2026-12-07, 7 of its 8 layers).
# DSV4_ROWS_MIN_ROWS_PER_SM sets the threshold (0.375: the old 50 rows), for A/B runs.
ROWS_MIN_ROWS_PER_SM = float(os.environ.get("DSV4_ROWS_MIN_ROWS_PER_SM", "0.12"))
ROWS_KERNEL = os.environ.get("DSV4_ROWS_ATTENTION", "1") == "1"  # 0: the split kernel at every size (comparisons)
# Key splits of the rows kernel for decode batches (default; DSV4_ROWS_SPLITS=0: one walk). A program's time is
# its walk over the row's keys, one tile after another: 86 us for window + 512 keys at 16, 32 and 64 rows alike on
# an H100 (results/2026-12-05-h100-rows-attention), and 96-124 us a layer in a batch-64 decode step of
# V4.1-Flash-8l (0.81 of a 7.3 ms replay, results/2026-12-06-h100-decode-b64-splits), where 64 rows x 2 value
# halves are 128 programs for 132 SMs with room for 2 each. Splitting the keys gives each program a share of the
# walk; the partials (max, sum, unnormalised values: fp32) go through the split kernel's workspace and merge.
# Splits are added while the programs stay under ROWS_SPLIT_PROGRAMS_PER_SM per SM, one per ROWS_MIN_SPLIT_KEYS
# keys at most; each split takes an equal share of each source's keys. Timed (2026-12-06-h100-decode-optins):
# the batch-64 replay 7.19 -> 6.97 ms on an H100.
ROWS_SPLITS = os.environ.get("DSV4_ROWS_SPLITS", "1") == "1"
ROWS_SPLIT_PROGRAMS_PER_SM = 2
ROWS_MIN_SPLIT_KEYS = 64


def decode_sink_attention_torch(q: torch.Tensor, sources: Sequence[AnySource], sinks: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Reference: gather every source's keys, concatenate, `sink_attention_rows`."""
    sources = [s.as_slots() if isinstance(s, TableSource) else s for s in sources]
    keys = [cache[slots] for cache, slots, _ in sources]
    masks = [mask for _, _, mask in sources]
    if len(sources) > 1:
        k, m = torch.cat(keys, dim=1), torch.cat(masks, dim=1)
    else:
        k, m = keys[0], masks[0]
    return sink_attention_rows(q, k, m, sinks, scale)


if triton is not None:
    from dsv4.ops.rmsnorm import bf16_dot
    from dsv4.ops.rope import rope_tile

    @triton.jit
    def _source_partial(q, q_other, m_i, l_i, acc, cache_ptr, c_stride, slots_ptr, vis_ptr, L, start, chunk, scale,
                        d, dm, d_other, dm_other, BS, BLOCK_N: tl.constexpr, TC: tl.constexpr, UPCAST: tl.constexpr,
                        TABLE: tl.constexpr, OTHER: tl.constexpr):
        """Online softmax over keys [start, min(start + chunk, L)) of one row of one source, continuing a running
        max m, sum l and unnormalised values acc of the program's heads (from -inf, 0, 0 for a fresh split).
        Masked keys are never loaded (their slots may be anything) and get logit -inf, like the reference's
        masked_fill. TABLE: `slots_ptr` is the row's block table and `vis_ptr` its visible count n: keys e < n, in
        slot table[e // BS] * BS + e % BS, and the loop stops at n.
        acc holds the value columns d; the logits take q's columns d and, when OTHER, q_other's columns d_other
        too (a program that accumulates half the columns still needs every column's product)."""
        end = tl.minimum(start + chunk, L)
        if TABLE:
            end = tl.minimum(end, tl.load(vis_ptr).to(tl.int32))
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            if TABLE:
                vis = n < end
                slot = tl.load(slots_ptr + n // BS, mask=vis, other=0).to(tl.int64) * BS + n % BS
            else:
                vis = tl.load(vis_ptr + n, mask=n < end, other=0) != 0
                slot = tl.load(slots_ptr + n, mask=vis, other=0).to(tl.int64)
            row = cache_ptr + slot[:, None] * c_stride
            k = tl.load(row + d[None, :], mask=vis[:, None] & dm[None, :], other=0.0)
            s = tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32)
            if OTHER:
                k_other = tl.load(row + d_other[None, :], mask=vis[:, None] & dm_other[None, :], other=0.0)
                if TC:
                    s = bf16_dot(q_other, tl.trans(k_other), s, UPCAST)
                else:
                    s = tl.dot(q_other, tl.trans(k_other.to(tl.float32)), s, input_precision="ieee")
            if TC:
                # bf16 x bf16 products are exact in fp32 and accumulate in fp32: the reference's fp32 logits
                s = bf16_dot(q, tl.trans(k), s, UPCAST)
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), s, input_precision="ieee")
            s = tl.where(vis[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # nothing visible yet: subtract 0, not -inf (-inf - -inf is nan); every p is then exp(-inf) = 0
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if TC:
                # p in two bf16 halves (hi + residual): ~16 mantissa bits, near the reference's fp32 probabilities
                # at tensor-core speed; one bf16 p alone would round every weight to 8 significant bits. Both
                # products accumulate into acc itself (no third register tile and no layout conversion)
                p_hi = p.to(tl.bfloat16)
                p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
                acc = bf16_dot(p_lo, k, bf16_dot(p_hi, k, acc * alpha[:, None], UPCAST), UPCAST)
            else:
                acc = tl.dot(p, k.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _split_kernel(q_ptr, sq_r, sq_h, c1_ptr, c1_stride, s1_ptr, s1_stride, v1_ptr, v1_stride, L1,
                      c2_ptr, c2_stride, s2_ptr, s2_stride, v2_ptr, v2_stride, L2, BS2, S1, S, chunk, H, scale,
                      ws_m, ws_l, ws_acc, cos_ptr, sin_ptr, cos_stride, sin_stride, D: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TC: tl.constexpr,
                      UPCAST: tl.constexpr, TABLE2: tl.constexpr, ROPE: tl.constexpr, INTERPRET: tl.constexpr):
        r = tl.program_id(0)
        # torch.compile hands float arguments to user kernels as fp64: keep the math (and loop-carried values) fp32
        scale = tl.cast(scale, tl.float32)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)  # splits [0, S1) cover source 1, [S1, S) source 2
        hm = heads < H
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + r * sq_r + heads[:, None] * sq_h + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        if ROPE > 0:  # the queries' rope (ROPE pairs) on load: every program of the row rotates the same bits
            q = rope_tile(q, cos_ptr + r * cos_stride, sin_ptr + r * sin_stride, 1.0, D, ROPE, BLOCK_D,
                          q_ptr.dtype.element_ty, INTERPRET, 0)
        if TC:
            q = q.to(tl.bfloat16)
        else:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        # one call per branch (not a pointer picked per branch): the two caches may differ in dtype
        if split < S1:
            m_i, l_i, acc = _source_partial(q, q, m_i, l_i, acc, c1_ptr, c1_stride, s1_ptr + r * s1_stride,
                                            v1_ptr + r * v1_stride, L1, split * chunk, chunk, scale, d, dm, d, dm, 1,
                                            BLOCK_N, TC, UPCAST, False, False)
        else:
            m_i, l_i, acc = _source_partial(q, q, m_i, l_i, acc, c2_ptr, c2_stride, s2_ptr + r * s2_stride,
                                            v2_ptr + r * v2_stride, L2, (split - S1) * chunk, chunk, scale, d, dm, d,
                                            dm, BS2, BLOCK_N, TC, UPCAST, TABLE2, False)
        base = (r * S + split) * H + heads
        tl.store(ws_m + base, m_i, mask=hm)
        tl.store(ws_l + base, l_i, mask=hm)
        tl.store(ws_acc + base[:, None] * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])

    @triton.jit
    def _combine_four(acc, ws_m, ws_acc, r, h, s0, S, H, big, d, dm, D: tl.constexpr):
        """acc plus splits s0 .. s0 + 3's weighted rows (channels d), added in split order, one product at a time;
        a split past S adds 0 * 0."""
        j = tl.arange(0, 4)
        # the four weights exp(m - big) (0 for a split with no visible key, and past S), each taken out of the
        # vector by a sum with zeros (exact)
        wj = tl.exp(tl.load(ws_m + (r * S + s0 + j) * H + h, mask=s0 + j < S, other=float("-inf")) - big)
        row = ws_acc + ((r * S + s0) * H + h) * D + d
        a0 = tl.load(row, mask=dm & (s0 + 0 * d < S), other=0.0)
        a1 = tl.load(row + H * D, mask=dm & (s0 + 1 + 0 * d < S), other=0.0)
        a2 = tl.load(row + 2 * H * D, mask=dm & (s0 + 2 + 0 * d < S), other=0.0)
        a3 = tl.load(row + 3 * H * D, mask=dm & (s0 + 3 + 0 * d < S), other=0.0)
        acc += tl.sum(tl.where(j == 0, wj, 0.0), axis=0) * a0
        acc += tl.sum(tl.where(j == 1, wj, 0.0), axis=0) * a1
        acc += tl.sum(tl.where(j == 2, wj, 0.0), axis=0) * a2
        acc += tl.sum(tl.where(j == 3, wj, 0.0), axis=0) * a3
        return acc

    @triton.jit
    def _combine_kernel(ws_m, ws_l, ws_acc, sinks_ptr, out_ptr, so_r, so_h, S, H, cos_ptr, sin_ptr, cos_stride,
                        sin_stride, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        ROPE: tl.constexpr, UNROLL: tl.constexpr, INTERPRET: tl.constexpr):
        """Program (row r, head h, channels [c * BLOCK_D, (c + 1) * BLOCK_D) of D)."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        col0 = tl.program_id(2) * BLOCK_D
        s_idx = tl.arange(0, BLOCK_S)
        sm = s_idx < S
        m = tl.load(ws_m + (r * S + s_idx) * H + h, mask=sm, other=float("-inf"))
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        big = tl.maximum(tl.max(m, axis=0), sink)  # the reference's max over keys and sink
        l = tl.load(ws_l + (r * S + s_idx) * H + h, mask=sm, other=0.0)
        denom = tl.sum(tl.exp(m - big) * l, axis=0) + tl.exp(sink - big)
        d = col0 + tl.arange(0, BLOCK_D)
        dm = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # The splits' rows four at a time: their loads are independent, so all four are in flight together (one
        # split at a time, a batch-1 combine of 20 splits took 4.7 us on an H100, 2026-12-06-h100-decode-optins);
        # still added in split order, one product at a time, as before. A place past S adds 0 * 0 (acc, a sum from
        # +0, is never -0: the bits stay). UNROLL: the loop unrolled to BLOCK_S, so every split's loads can be in
        # flight at once, not four at a time (each round a wait on memory at batch 1).
        if UNROLL:
            for s0 in tl.static_range(0, BLOCK_S, 4):
                acc = _combine_four(acc, ws_m, ws_acc, r, h, s0, S, H, big, d, dm, D)
        else:
            for s0 in range(0, S, 4):
                acc = _combine_four(acc, ws_m, ws_acc, r, h, s0, S, H, big, d, dm, D)
        o = (acc / denom).to(out_ptr.dtype.element_ty)
        if ROPE > 0:  # the inverse rope of the rounded output, as a rope launch after this one would apply it
            o = tl.reshape(rope_tile(o[None, :], cos_ptr + r * cos_stride, sin_ptr + r * sin_stride, -1.0, D, ROPE,
                                     BLOCK_D, out_ptr.dtype.element_ty, INTERPRET, col0), [BLOCK_D])
        tl.store(out_ptr + r * so_r + h * so_h + d, o, mask=dm)

    # The sources' widths and row strides change from one prefill step to the next (and the row stride of q with
    # the projection it is a view of): kept out of Triton's specialization (== 1, divisible by 16), so a serving
    # step reuses the variants start-up compiled instead of compiling one mid-request.
    @triton.jit(do_not_specialize=["sq_r", "s1_stride", "v1_stride", "L1", "s2_stride", "v2_stride", "L2", "S",
                                   "chunk1", "chunk2"])
    def _rows_kernel(q_ptr, sq_r, sq_h, c1_ptr, c1_stride, s1_ptr, s1_stride, v1_ptr, v1_stride, L1,
                     c2_ptr, c2_stride, s2_ptr, s2_stride, v2_ptr, v2_stride, L2, BS2, H, scale, sinks_ptr,
                     out_ptr, so_r, so_h, S, chunk1, chunk2, ws_m, ws_l, ws_acc, D: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, TC: tl.constexpr, UPCAST: tl.constexpr,
                     TABLE2: tl.constexpr, HALVES: tl.constexpr, SPLIT: tl.constexpr):
        """One program per (row, block of heads, half of the value columns when HALVES) over both sources' whole
        key ranges, finished with the sink in place: no split, no workspace, no merge launch. For many rows
        (prefill), where the rows alone fill the GPU and every key tile loaded serves all the heads of a program.
        A half of the columns keeps the [heads, columns] fp32 accumulator in a warp group's registers; the
        logits need every column, so each half loads the other half's key columns too and recomputes them.
        SPLIT (decode batches, `rows_splits`): the third axis is (split, half); split s walks keys
        [s * chunk1, (s + 1) * chunk1) of source 1, then [s * chunk2, (s + 1) * chunk2) of source 2 (one call
        site a source, as unsplit: a branch a source would keep both loops' shared buffers, 160 KB against 96, one
        program an SM), and writes its partial to the split kernel's workspace ([R, S, H] max and sum from the
        first half, [R, S, H, D] values), which `_combine_kernel` merges with the sink. Unsplit: S 1, chunk1 L1,
        chunk2 L2."""
        r = tl.program_id(0)
        scale = tl.cast(scale, tl.float32)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = heads < H
        if HALVES:
            half = tl.program_id(2) % 2
            split = tl.program_id(2) // 2
        else:
            half = tl.program_id(2) * 0
            split = tl.program_id(2)
        d = half * BLOCK_DV + tl.arange(0, BLOCK_DV)
        d_other = (1 - half) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # unused unless HALVES
        dm, dm_other = d < D, d_other < D
        q_row = q_ptr + r * sq_r + heads[:, None] * sq_h
        q = tl.load(q_row + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        if HALVES:
            q_other = tl.load(q_row + d_other[None, :], mask=hm[:, None] & dm_other[None, :], other=0.0)
        else:
            q_other = q
        if TC:
            q, q_other = q.to(tl.bfloat16), q_other.to(tl.bfloat16)
        else:
            q, q_other = q.to(tl.float32), q_other.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        m_i, l_i, acc = _source_partial(q, q_other, m_i, l_i, acc, c1_ptr, c1_stride, s1_ptr + r * s1_stride,
                                        v1_ptr + r * v1_stride, L1, split * chunk1, chunk1, scale, d, dm, d_other,
                                        dm_other, 1, BLOCK_N, TC, UPCAST, False, HALVES)
        m_i, l_i, acc = _source_partial(q, q_other, m_i, l_i, acc, c2_ptr, c2_stride, s2_ptr + r * s2_stride,
                                        v2_ptr + r * v2_stride, L2, split * chunk2, chunk2, scale, d, dm, d_other,
                                        dm_other, BS2, BLOCK_N, TC, UPCAST, TABLE2, HALVES)
        if SPLIT:
            base = (r * S + split) * H + heads
            first = hm & (heads * 0 + half == 0)  # both halves computed the same max and sum: one writes them
            tl.store(ws_m + base, m_i, mask=first)
            tl.store(ws_l + base, l_i, mask=first)
            tl.store(ws_acc + base[:, None] * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])
        else:
            sink = tl.load(sinks_ptr + heads, mask=hm, other=0.0).to(tl.float32)
            big = tl.maximum(m_i, sink)  # finite: the sink's logit; no visible key (m -inf) gives alpha 0, output 0
            alpha = tl.exp(m_i - big)
            w = alpha / (l_i * alpha + tl.exp(sink - big))
            tl.store(out_ptr + r * so_r + heads[:, None] * so_h + d[None, :],
                     (acc * w[:, None]).to(out_ptr.dtype.element_ty), mask=hm[:, None] & dm[None, :])


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read when kernels are defined, as triton does
# `rope`'s two rotations inside the split kernel (queries, on load) and the merge (output, before the store), not
# two launches of dsv4.ops.rope around the attention (DSV4_ATTN_ROPE_FUSED=0: those, for comparisons). The same
# bits either way; at batch 1 each rope launch sits on the layer's critical chain (~2 us with its gap, H100).
ROPE_FUSED = os.environ.get("DSV4_ATTN_ROPE_FUSED", "1") == "1"
# The merge's channels a program (a power of two; DSV4_COMBINE_CHANNELS=0: a whole row a program with the split loop
# not unrolled, the form timed on 2026-12-07). At batch 1 the merge was 53 us of exposed time over 8 layers on an
# H100 (results/2026-12-07-h100-decode-fusions): 64 programs, each walking ~20 splits of 512 channels four at a time,
# a wait on memory per round. Blocks of 128 channels give 4x the programs and, with the loop unrolled (up to
# COMBINE_MAX_UNROLL splits), every split's loads in flight at once. The same bits: each channel's sum is unchanged.
COMBINE_CHANNELS = int(os.environ.get("DSV4_COMBINE_CHANNELS", "128"))
COMBINE_MAX_UNROLL = 128


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(R: int, H: int, lengths: Sequence[int], sm_count: int,
                  chunk: int | None = None) -> tuple[int, list[int]]:
    """(keys per split, splits per source) from shapes only. Enough splits that rows x head blocks x splits
    reaches PROGRAMS_PER_SM per SM, but each split at least MIN_SPLIT_TILES tiles. `chunk` (a multiple of BLOCK_N)
    overrides, for tests."""
    if chunk is None:
        tiles = sum(triton.cdiv(L, BLOCK_N) for L in lengths)
        want = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(1, R * triton.cdiv(H, BLOCK_H)))
        chunk = max(MIN_SPLIT_TILES, triton.cdiv(tiles, want)) * BLOCK_N
    assert chunk > 0 and chunk % BLOCK_N == 0, chunk
    splits = [triton.cdiv(L, chunk) for L in lengths]
    if sum(splits) == 0:  # no key at all: one empty split (max -inf, sum 0), so the merge sees only the sink
        splits[0] = 1
    return chunk, splits


def use_rows_kernel(R: int, H: int, sm_count: int) -> bool:
    """Whether R rows alone fill the GPU with one program per (row, head block): the rows kernel then needs no
    split and no merge (a shape-only rule: the decode step is captured in a CUDA graph)."""
    return ROWS_KERNEL and R * triton.cdiv(H, ROWS_BLOCK_H) >= ROWS_MIN_ROWS_PER_SM * sm_count


def rows_splits(R: int, H: int, lengths: Sequence[int], sm_count: int, halves: bool,
                splits: int | None = None) -> tuple[int, list[int]]:
    """(splits, keys a split of each source) of the rows kernel from shapes only; (1, lengths) for no split
    (ROWS_SPLITS off, the programs filling the SMs already, or too few keys). Splits: the programs that fit
    ROWS_SPLIT_PROGRAMS_PER_SM per SM over the unsplit ones, at most one per ROWS_MIN_SPLIT_KEYS keys; each split
    takes an equal share of each source, in ROWS_BLOCK_N multiples. `splits` forces the wanted count (tests,
    benchmarks) past ROWS_SPLITS and the rule."""
    total = sum(lengths)
    if splits is None:
        if not ROWS_SPLITS:
            return 1, list(lengths)
        programs = R * triton.cdiv(H, ROWS_BLOCK_H) * (2 if halves else 1)
        splits = min(ROWS_SPLIT_PROGRAMS_PER_SM * sm_count // max(1, programs), total // ROWS_MIN_SPLIT_KEYS)
    if splits < 2:
        return 1, list(lengths)
    chunks = [triton.cdiv(triton.cdiv(L, splits), ROWS_BLOCK_N) * ROWS_BLOCK_N for L in lengths]
    return splits, chunks


def decode_sink_attention_triton(q: torch.Tensor, sources: Sequence[AnySource], sinks: torch.Tensor, scale: float,
                                 chunk: int | None = None, rows: bool | None = None,
                                 row_splits: int | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                                 rope_queries: bool = True) -> torch.Tensor:
    """The same on the GPU. Few rows (decode): split partials into an fp32 workspace, then the merge with the sink
    (two launches). Many rows (prefill; `use_rows_kernel`): one launch of the rows kernel, or with key splits for
    decode batches (`rows_splits`, opt-in): its partials merged by the split kernel's merge. `rows` / `chunk` /
    `row_splits` force the kernel / the split size / the rows kernel's wanted splits (tests, benchmarks). `rope`,
    `rope_queries`: as `decode_sink_attention`'s; the split kernel ropes the queries on load and the merge un-ropes
    the output (ROPE_FUSED), the rows kernel takes the queries roped in place first."""
    assert triton is not None, "triton is not installed"
    assert 1 <= len(sources) <= 2, len(sources)
    assert not isinstance(sources[0], TableSource), "a TableSource is the second source"
    R, H, D = q.shape
    out = torch.empty_like(q)
    if R == 0 or H == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    half = 0
    if rope is not None:
        half = rope[0].shape[-1]
        cos, sin = rope_tables(rope[0], rope[1], half)
        assert cos.shape[0] == R and D % 2 == 0 and 2 * half <= D, (cos.shape, q.shape)
    else:
        cos = sin = q  # (not read)
    srcs, lengths, table2, bs2 = [], [], False, 1
    for src in sources:
        if isinstance(src, TableSource):  # (cache, table, n): the kernel loops to each row's n
            cache, slots, mask, L = src.cache, src.table, src.n.contiguous(), src.width
            slots = slots if slots.stride(-1) == 1 else slots.contiguous()
            table2, bs2 = True, src.block_size
        else:
            cache, slots, mask = src
            # slots/mask are small (R x L): a copy is cheap; the cache is read in place
            slots = slots if slots.stride(-1) == 1 else slots.contiguous()
            mask = mask if mask.stride(-1) == 1 else mask.contiguous()
            L = slots.shape[1]
        assert cache.dim() == 2 and cache.shape[1] == D and cache.stride(1) == 1, (cache.shape, cache.stride())
        srcs.append((cache, slots, mask))
        lengths.append(L)
    if len(srcs) == 1:  # the second source: the first again, with no keys and no splits
        srcs.append(srcs[0])
        lengths.append(0)
    (c1, s1, v1), (c2, s2, v2) = srcs
    tc = q.dtype == torch.bfloat16 and c1.dtype == torch.bfloat16 and c2.dtype == torch.bfloat16
    block_d = max(16, triton.next_power_of_2(D))
    sm = _sm_count(q.device) if q.is_cuda else 4
    if rows is None:
        rows = chunk is None and use_rows_kernel(R, H, sm)
    if half and rope_queries and (rows or not ROPE_FUSED):
        q = apply_rope_triton_(q, cos, sin)
    rope_in = half if rope_queries and ROPE_FUSED and not rows else 0  # queries roped by the split kernel
    if rows:
        block_h = max(16, min(ROWS_BLOCK_H, triton.next_power_of_2(H)))
        halves = block_d >= 2 * ROWS_MIN_HALF_D
        S, (chunk1, chunk2) = rows_splits(R, H, lengths, sm, halves, row_splits)
        if S > 1:
            ws_m = torch.empty(R, S, H, dtype=torch.float32, device=q.device)
            ws_l = torch.empty_like(ws_m)
            ws_acc = torch.empty(R, S, H, D, dtype=torch.float32, device=q.device)
        else:  # (unused: the kernel finishes each row itself)
            ws_m = ws_l = ws_acc = out
        _rows_kernel[(R, triton.cdiv(H, block_h), (2 if halves else 1) * S)](
            q, q.stride(0), q.stride(1), c1, c1.stride(0), s1, s1.stride(0), v1, v1.stride(0), lengths[0],
            c2, c2.stride(0), s2, s2.stride(0), v2, v2.stride(0) if v2.dim() > 1 else 1, lengths[1], bs2, H,
            float(scale), sinks.contiguous(), out, out.stride(0), out.stride(1), S, chunk1, chunk2, ws_m, ws_l,
            ws_acc, D=D, BLOCK_H=block_h, BLOCK_DV=block_d // 2 if halves else block_d, BLOCK_N=ROWS_BLOCK_N, TC=tc,
            UPCAST=_INTERPRET, TABLE2=table2, HALVES=halves, SPLIT=S > 1, num_warps=ROWS_WARPS,
            num_stages=ROWS_STAGES)
        if S > 1:
            _combine(ws_m, ws_l, ws_acc, sinks, out, S, cos, sin, half)
        elif half:
            apply_rope_triton_(out, cos, sin, inverse=True)
        return out
    chunk, (S1, S2) = decode_splits(R, H, lengths, sm, chunk)
    S = S1 + S2
    ws_m = torch.empty(R, S, H, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(R, S, H, D, dtype=torch.float32, device=q.device)
    warps = SPLIT_WARPS if block_d >= 256 else 4  # the [BLOCK_H, BLOCK_D] fp32 accumulator lives in registers
    _split_kernel[(R, triton.cdiv(H, BLOCK_H), S)](
        q, q.stride(0), q.stride(1), c1, c1.stride(0), s1, s1.stride(0), v1, v1.stride(0), lengths[0],
        c2, c2.stride(0), s2, s2.stride(0), v2, v2.stride(0) if v2.dim() > 1 else 1, lengths[1], bs2, S1, S, chunk,
        H, float(scale), ws_m, ws_l, ws_acc, cos, sin, cos.stride(0), sin.stride(0), D=D, BLOCK_H=BLOCK_H,
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, TC=tc, UPCAST=_INTERPRET, TABLE2=table2, ROPE=rope_in, INTERPRET=_INTERPRET,
        num_warps=warps, num_stages=SPLIT_STAGES)
    _combine(ws_m, ws_l, ws_acc, sinks, out, S, cos, sin, half)
    return out


def _combine(ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor, sinks: torch.Tensor, out: torch.Tensor,
             S: int, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    """The merge of S splits' partials with the sink into out [R, H, D]; `half` > 0: the output's inverse rope
    (its last 2 * half channels, at the rows' cos / sin) before the store, with ROPE_FUSED; else in a launch after
    it (no rope at all for half 0)."""
    R, H, D = out.shape
    fused = half if ROPE_FUSED else 0
    block_d = max(16, triton.next_power_of_2(D))
    if COMBINE_CHANNELS and block_d > COMBINE_CHANNELS:  # channel blocks: programs and loads in flight x D / C
        block_d = COMBINE_CHANNELS
    block_s = max(4, triton.next_power_of_2(S))
    _combine_kernel[(R, H, triton.cdiv(D, block_d))](
        ws_m, ws_l, ws_acc, sinks.contiguous(), out, out.stride(0), out.stride(1), S, H, cos, sin, cos.stride(0),
        sin.stride(0), D=D, BLOCK_D=block_d, BLOCK_S=block_s, ROPE=fused,
        UNROLL=bool(COMBINE_CHANNELS) and block_s <= COMBINE_MAX_UNROLL, INTERPRET=_INTERPRET)
    if half and not fused:
        apply_rope_triton_(out, cos, sin, inverse=True)


def decode_sink_attention(q: torch.Tensor, sources: Sequence[AnySource], sinks: torch.Tensor, scale: float,
                          rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                          rope_queries: bool = True) -> torch.Tensor:
    """Triton on CUDA, torch elsewhere (and for caches whose rows are not contiguous). `rope` (cos, sin) [R, half]:
    the output is wanted after the inverse rope (values carry the keys' rope) and, with `rope_queries`, q holds the
    queries before their rope, i.e. `apply_rope_(attention(apply_rope_(q, cos, sin)), cos, sin, inverse=True)`, q
    possibly rotated in place; on CUDA both ropes ride in the attention's own launches (no launch of their own)."""
    caches = [s.cache if isinstance(s, TableSource) else s[0] for s in sources]
    if q.is_cuda and triton is not None and all(c.stride(-1) == 1 for c in caches):
        return decode_sink_attention_triton(q, sources, sinks, scale, rope=rope, rope_queries=rope_queries)
    if rope is None:
        return decode_sink_attention_torch(q, sources, sinks, scale)
    out = decode_sink_attention_torch(apply_rope_(q, *rope) if rope_queries else q, sources, sinks, scale)
    return apply_rope_(out, *rope, inverse=True)
