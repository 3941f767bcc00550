"""Decode-metadata build in Triton: one launch per KV group instead of ~40 small torch ops per step.

A uniform-decode step needs, per batch row, the cache slots of its sliding window, the slot its token writes,
its compressor ring block, and for each compressed group the slots of its visible entries, their count and the
slot of the entry its token closes (dsv4/runtime/attn_metadata.py, `DecodeMetadata`). The torch build there is
the reference; on the GPU its ~40 launches cost about 1 ms of host time per step, more than the whole graph
replay of a small batch. These kernels read the state-row block tables through `idx_mapping` directly (no
batch-order gather copy) and write the persistent metadata buffers in place, so the decode graph reads them.

Rows b >= num_reqs are padding: position 0, no visible key, every write to TRASH_SLOT (0). Entry slots are
written only for the entries a row sees (e < n): everything past n is masked by every reader, and writing
ceil(max_model_len / ratio) entries per row per step would cost O(max_model_len) at long contexts.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use the torch reference
    triton = None


if triton is not None:

    @triton.jit
    def _window_md_kernel(pos_in_ptr, idx_ptr, table_ptr, table_stride, max_blocks, state_ptr, state_stride,
                          num_reqs, pos_out_ptr, wslots_ptr, wmask_ptr, write_ptr, state_out_ptr,
                          W: tl.constexpr, BLOCK_W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr):
        b = tl.program_id(0)
        valid = b < num_reqs
        # padding rows read the last real row (num_reqs >= 1) and discard it: no scalar masked loads
        src = tl.minimum(b, num_reqs - 1)
        pos = tl.where(valid, tl.load(pos_in_ptr + src), 0)
        row = tl.load(idx_ptr + src)
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
        tl.store(wmask_ptr + b * W + j, ok.to(tl.uint8), mask=jm)
        # the row's own token: key position pos (always inside the table for a real row)
        own = tl.load(table_ptr + row * table_stride + tl.minimum(pos // BS, max_blocks - 1))
        tl.store(write_ptr + b, tl.where(valid, own.to(tl.int64) * BS + pos % BS, 0))
        if HAS_STATE:
            st = tl.load(state_ptr + row * state_stride).to(tl.int64)
            tl.store(state_out_ptr + b, tl.where(valid, st, 0))
        else:
            tl.store(state_out_ptr + b, 0)

    @triton.jit
    def _compressed_md_kernel(pos_ptr, idx_ptr, table_ptr, table_stride, max_blocks, num_reqs, eslots_ptr,
                              eslots_stride, n_ptr, write_ptr, RATIO: tl.constexpr, BS: tl.constexpr,
                              BLOCK: tl.constexpr):
        b = tl.program_id(0)
        valid = b < num_reqs
        pos = tl.load(pos_ptr + b)  # the decode positions written by the window kernel: 0 on padding rows
        row = tl.load(idx_ptr + tl.minimum(b, num_reqs - 1))
        n = tl.where(valid, (pos + 1) // RATIO, 0)
        tl.store(n_ptr + b, n)
        base = table_ptr + row * table_stride
        for e0 in range(0, n, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            em = e < n
            ids = tl.load(base + tl.minimum(e // BS, max_blocks - 1), mask=em, other=0).to(tl.int64)
            tl.store(eslots_ptr + b * eslots_stride + e, ids * BS + e % BS, mask=em)
        last = tl.maximum(n - 1, 0)
        closes = valid & ((pos + 1) % RATIO == 0)
        lid = tl.load(base + tl.minimum(last // BS, max_blocks - 1)).to(tl.int64)
        tl.store(write_ptr + b, tl.where(closes, lid * BS + last % BS, 0))


def build_window_metadata_triton(num_reqs: int, num_padded: int, positions: torch.Tensor, idx_mapping: torch.Tensor,
                                 table: torch.Tensor, block_size: int, state_table: torch.Tensor | None,
                                 pos_out: torch.Tensor, wslots: torch.Tensor, wmask: torch.Tensor,
                                 write_slots: torch.Tensor, state_blocks: torch.Tensor) -> None:
    """Fill rows [0, num_padded) of the window outputs from the first num_reqs rows' positions and state rows."""
    assert triton is not None, "triton is not installed"
    W = wslots.shape[1]
    state = state_table if state_table is not None else table
    _window_md_kernel[(num_padded,)](
        positions, idx_mapping, table, table.stride(0), table.shape[1], state, state.stride(0), num_reqs,
        pos_out, wslots, wmask.view(torch.uint8), write_slots, state_blocks,
        W=W, BLOCK_W=triton.next_power_of_2(W), BS=block_size, HAS_STATE=state_table is not None)


def build_compressed_metadata_triton(num_reqs: int, num_padded: int, positions: torch.Tensor,
                                     idx_mapping: torch.Tensor, table: torch.Tensor, block_size: int, ratio: int,
                                     entry_slots: torch.Tensor, n_entries: torch.Tensor,
                                     entry_write: torch.Tensor) -> None:
    """Fill one compressed group's rows [0, num_padded): `positions` are the already-written decode positions."""
    assert triton is not None, "triton is not installed"
    _compressed_md_kernel[(num_padded,)](
        positions, idx_mapping, table, table.stride(0), table.shape[1], num_reqs, entry_slots, entry_slots.stride(0),
        n_entries, entry_write, RATIO=ratio, BS=block_size, BLOCK=256)
