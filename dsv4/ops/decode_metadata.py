"""Decode-metadata build in Triton: one launch for every KV group instead of ~40 small torch ops per step.

A uniform-decode step needs, per batch row, the cache slots of its sliding window, the slot its token writes,
its compressor ring block, and for each compressed group the block table of its visible entries, their count and
the slot of the entry its token closes (dsv4/runtime/attn_metadata.py, `DecodeMetadata`). The torch build there is
the reference; on the GPU its ~40 launches cost about 1 ms of host time per step, more than the whole graph
replay of a small batch. The kernel reads the state-row block tables through `idx_mapping` directly (no
batch-order gather copy) and writes the persistent metadata buffers in place, so the decode graph reads them; one
program per batch row fills the window part and up to three compressed groups (a model with more gets one more
launch per three).

Rows b >= num_reqs are padding: position 0, no visible key, every write to TRASH_SLOT (0). A row's block table
is copied (to batch order) only up to the blocks of the entries it sees (ceil(n / block_size)): every reader
stops at n, and copying the whole row would cost O(max_model_len) per row per step. No [rows, entries] slot
matrix exists: the decode kernels map entry -> slot through the table themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


if triton is not None:

    @triton.jit
    def _compressed_row(b, valid, pos, row, table_ptr, table_stride, max_blocks, etab_ptr, etab_stride, n_ptr,
                        write_ptr, RATIO: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr):
        """One row of one compressed group: the table blocks of its visible entries (e < n), n, and the entry it
        closes. The output table has the input's width (both sized for max_model_len by the same formula)."""
        n = tl.where(valid, (pos + 1) // RATIO, 0)
        tl.store(n_ptr + b, n)
        base = table_ptr + row * table_stride
        nblk = tl.minimum((n + BS - 1) // BS, max_blocks)
        for j0 in range(0, nblk, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            jm = j < nblk
            tl.store(etab_ptr + b * etab_stride + j, tl.load(base + j, mask=jm, other=0), mask=jm)
        last = tl.maximum(n - 1, 0)
        closes = valid & ((pos + 1) % RATIO == 0)
        lid = tl.load(base + tl.minimum(last // BS, max_blocks - 1)).to(tl.int64)
        tl.store(write_ptr + b, tl.where(closes, lid * BS + last % BS, 0))

    @triton.jit
    def _decode_md_kernel(pos_in_ptr, idx_ptr, num_reqs, pos_out_ptr,
                          table_ptr, table_stride, max_blocks, state_ptr, state_stride,
                          wslots_ptr, wmask_ptr, write_ptr, state_out_ptr,
                          t0, ts0, mb0, es0, ess0, n0, w0, t1, ts1, mb1, es1, ess1, n1, w1,
                          t2, ts2, mb2, es2, ess2, n2, w2,
                          R0: tl.constexpr, BS0: tl.constexpr, R1: tl.constexpr, BS1: tl.constexpr,
                          R2: tl.constexpr, BS2: tl.constexpr, NUM_COMP: tl.constexpr, WINDOW: tl.constexpr,
                          W: tl.constexpr, BLOCK_W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr,
                          BLOCK: tl.constexpr):
        b = tl.program_id(0)
        valid = b < num_reqs
        # padding rows read the last real row (num_reqs >= 1) and discard it: no scalar masked loads
        src = tl.minimum(b, num_reqs - 1)
        row = tl.load(idx_ptr + src)
        if WINDOW:
            pos = tl.where(valid, tl.load(pos_in_ptr + src), 0)
            tl.store(pos_out_ptr + b, pos)
            j = tl.arange(0, BLOCK_W)
            jm = j < W
            wp = pos - (W - 1) + j  # key positions pos-W+1 .. pos
            ok = (wp >= 0) & valid & jm
            wpc = tl.maximum(wp, 0)
            blk = tl.minimum(wpc // BS, max_blocks - 1)
            ids = tl.load(table_ptr + row * table_stride + blk).to(tl.int64)  # clamped: always inside the row
            slots = tl.where(ok, ids * BS + wpc % BS, 0)
            tl.store(wslots_ptr + b * W + j, slots, mask=jm)
            tl.store(wmask_ptr + b * W + j, ok, mask=jm)
            # the row's own token: key position pos (always inside the table for a real row)
            own = tl.load(table_ptr + row * table_stride + tl.minimum(pos // BS, max_blocks - 1))
            tl.store(write_ptr + b, tl.where(valid, own.to(tl.int64) * BS + pos % BS, 0))
            if HAS_STATE:
                st = tl.load(state_ptr + row * state_stride).to(tl.int64)
                tl.store(state_out_ptr + b, tl.where(valid, st, 0))
            else:
                tl.store(state_out_ptr + b, 0)
        else:  # a launch of compressed groups only: the positions again, so it depends on no other launch
            pos = tl.where(valid, tl.load(pos_in_ptr + src), 0)
        if NUM_COMP > 0:
            _compressed_row(b, valid, pos, row, t0, ts0, mb0, es0, ess0, n0, w0, R0, BS0, BLOCK)
        if NUM_COMP > 1:
            _compressed_row(b, valid, pos, row, t1, ts1, mb1, es1, ess1, n1, w1, R1, BS1, BLOCK)
        if NUM_COMP > 2:
            _compressed_row(b, valid, pos, row, t2, ts2, mb2, es2, ess2, n2, w2, R2, BS2, BLOCK)


@dataclass(frozen=True)
class CompressedTarget:
    """One compressed group's inputs and outputs: its state-row block table and entry geometry, and the metadata
    buffers the build fills."""

    table: torch.Tensor  # [max_num_reqs, max_blocks] int32
    block_size: int
    ratio: int
    entry_table: torch.Tensor  # [max_rows, max_blocks] int32 (batch order)
    n_entries: torch.Tensor  # [max_rows] int64
    entry_write: torch.Tensor  # [max_rows] int64


GROUPS_PER_LAUNCH = 3  # compressed groups one launch fills (DeepSeek-V4 and V4.1 have two: a single launch)


def build_decode_metadata_triton(num_reqs: int, num_padded: int, positions: torch.Tensor, idx_mapping: torch.Tensor,
                                 table: torch.Tensor, block_size: int, state_table: torch.Tensor | None,
                                 pos_out: torch.Tensor, wslots: torch.Tensor, wmask: torch.Tensor,
                                 write_slots: torch.Tensor, state_blocks: torch.Tensor,
                                 compressed: list[CompressedTarget], window: bool = True) -> None:
    """Fill rows [0, num_padded) of the window outputs (unless `window` is False) and of every compressed group's
    outputs from the first num_reqs rows' positions and state rows, in one launch (host time, not GPU time, is what
    a step pays here). Every launch reads only the inputs, so builds of disjoint groups may run concurrently."""
    assert triton is not None, "triton is not installed"
    W = wslots.shape[1]
    state = state_table if state_table is not None else table
    chunks = [compressed[i: i + GROUPS_PER_LAUNCH] for i in range(0, len(compressed), GROUPS_PER_LAUNCH)]
    if window and not chunks:
        chunks = [[]]
    for k, chunk in enumerate(chunks):
        groups, consts = [], {}
        for i in range(GROUPS_PER_LAUNCH):
            c = chunk[i] if i < len(chunk) else None
            if c is None:  # unused slot: any valid tensors, never touched (NUM_COMP excludes it)
                groups += [table, 0, 1, pos_out, 0, pos_out, pos_out]
                consts.update({f"R{i}": 1, f"BS{i}": 1})
            else:
                assert c.entry_table.shape[1] == c.table.shape[1], (c.entry_table.shape, c.table.shape)
                groups += [c.table, c.table.stride(0), c.table.shape[1], c.entry_table, c.entry_table.stride(0),
                           c.n_entries, c.entry_write]
                consts.update({f"R{i}": c.ratio, f"BS{i}": c.block_size})
        _decode_md_kernel[(num_padded,)](
            positions, idx_mapping, num_reqs, pos_out, table, table.stride(0), table.shape[1], state, state.stride(0),
            wslots, wmask, write_slots, state_blocks, *groups, **consts, NUM_COMP=len(chunk),
            WINDOW=window and k == 0, W=W, BLOCK_W=triton.next_power_of_2(W), BS=block_size,
            HAS_STATE=state_table is not None,
            BLOCK=256)
