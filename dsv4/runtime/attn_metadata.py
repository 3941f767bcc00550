"""Attention metadata: what every attention layer needs to know about one step's batch.

Built once per step by the model state (`prepare_attn`) from the persistent input buffers and block tables,
then passed to the model's forward (never imported by it as global state).

What grows with max_model_len (issue 23, item 3), at max_model_len 1,048,576, 64 decode rows (max_num_seqs 64),
V4.1-Flash shapes (groups compressed_2 / compressed_1: 524,288 / 1,048,576 entries per request, 64-entry blocks,
index sources 1, 4 (the candidate source) and 6 of the 8-layer preset, 32 index heads, top-512, candidates
2048 blocks of 8):

| buffer / per-step work                              | before                         | now                        |
|-----------------------------------------------------|--------------------------------|----------------------------|
| DecodeMetadata entry slots [64, M] int64 (2 groups)  | 256 + 512 MiB                  | gone                       |
| DecodeMetadata entry tables [64, blocks] int32       | -                              | 2 + 4 MiB (block tables)   |
| indexer scores [64, M] fp32 per index source         | 128 / 256 / 256 MiB, grid      | gone: splits x 512 keys    |
|   and its kernel grid                                |   64 x M/32 programs           |   per row (n-bounded work) |
| stable_topk (torch.sort over M) per index source     | O(M log M) per row             | running top-512 over n     |
| candidate_blocks (layer 4): amax + sort over M/8     | [64, 131072] sort              | running top-2048 blocks    |
| candidate_pool (layer 6): [64, M] bool + masked_fill | 64 MiB + 256 MiB               | scores only pooled blocks  |
| KV block tables (BlockTables) [64, blocks] int32     | 8 + 16 (+ window 16) MiB       | unchanged (as vLLM)        |
| token history (RequestState) [64, max_len] int64     | 512 MiB                        | unchanged (not per step)   |
| rope tables [max_len, rope dim] fp32, per config     | 256 MiB each, not per row      | unchanged                  |
| V4 only: HCA attends [R, M/128] slots + mask          | O(M) per row (8192 at 1M)      | unchanged (see below)      |

The decode path reads entries through `EntryTable` (the batch-order block table and each row's n): the metadata
build copies only the blocks of visible entries, `decode_select` (ops/indexer.py) scores each row's visible
entries (or its candidate blocks' entries) and keeps a running top-k in scratch sized by splits x top-k, and the
published picks map to slots through the same table (`pick_table_sources`). Still O(max_model_len): the torch
references (CPU), which materialise [R, max_entries] as before, and V4's HCA layers, whose attention over every
visible entry still takes a materialised [R, ceil(max_len / 128)] slot matrix (8192 entries per row at 1M; a
table source for `decode_sink_attention` would remove it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.kv.spec import PAD_SLOT, TRASH_SLOT, KVGroupSpec
from dsv4.ops import decode_metadata
from dsv4.ops.host_copy import to_device
from dsv4.ops.indexer import per_row_slots


@dataclass
class AttnMetadata:
    """One step's batch as the attention layers see it.

    Requests are in batch order; request r owns tokens [query_start_loc[r], query_start_loc[r+1]) whose
    positions start at context_lens[r] (the tokens already computed). Host copies of the small per-request
    counts are kept because the reference attention path loops over requests.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc_cpu: list[int]  # [R+1]
    context_lens_cpu: list[int]  # [R] tokens computed before this step
    positions: torch.Tensor  # [T] int64
    groups: dict[str, KVGroupSpec]
    block_tables: dict[str, torch.Tensor]  # group name -> [R, max_blocks] int32, batch order
    window_slot_mapping: torch.Tensor  # [T] int64, PAD_SLOT for tokens that write nothing
    # per compressed group: [T] int64 slot of the entry each token completes, PAD_SLOT for none (and for tokens a
    # prefix-cache replay recomputes: their cached entries stay as they are)
    entry_slot_mappings: dict[str, torch.Tensor] = field(default_factory=dict)
    # [T] int64 lowest position each token's window may reach (a replay start, see step.NewRequestData), or None:
    # window KV below it was never rebuilt
    window_floor: torch.Tensor | None = None
    # token_key_slots of this step by window, built by the first layer that asks (the same for every layer)
    key_slots: dict[int, "TokenKeySlots"] = field(default_factory=dict)

    def seq_len(self, r: int) -> int:
        return self.context_lens_cpu[r] + self.query_start_loc_cpu[r + 1] - self.query_start_loc_cpu[r]


def slots_of(block_table_row: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of logical rows (token positions or entry indices) through one request's block table."""
    return block_table_row[rows // block_size].long() * block_size + rows % block_size


def build_attn_metadata(
    num_reqs: int,
    query_start_loc_cpu: list[int],
    context_lens_cpu: list[int],
    positions: torch.Tensor,
    groups: tuple[KVGroupSpec, ...],
    block_tables: dict[str, torch.Tensor],
    window_slot_mapping: torch.Tensor,
    entry_slot_mappings: dict[str, torch.Tensor] | None = None,
) -> AttnMetadata:
    """Bundle a step's batch description for the model (the entry slot mappings derived from the batch-order
    tables when not given)."""
    if entry_slot_mappings is None:
        counts = to_device([query_start_loc_cpu[r + 1] - query_start_loc_cpu[r] for r in range(num_reqs)],
                           positions.device, torch.int64)
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=positions.device), counts,
                                            output_size=int(positions.shape[0]))
        entry_slot_mappings = entry_slot_mappings_of(groups, block_tables, token_req, positions)
    return AttnMetadata(
        num_reqs=num_reqs,
        num_tokens=int(positions.shape[0]),
        query_start_loc_cpu=query_start_loc_cpu,
        context_lens_cpu=context_lens_cpu,
        positions=positions,
        groups={g.name: g for g in groups},
        block_tables=block_tables,
        window_slot_mapping=window_slot_mapping,
        entry_slot_mappings=entry_slot_mappings,
    )


def entry_slot_mappings_of(groups: tuple[KVGroupSpec, ...], tables: dict[str, torch.Tensor], token_rows: torch.Tensor,
                           positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per compressed group (ratio r): the slot of the entry each token completes (position p completes entry
    (p + 1) / r - 1 when r divides p + 1) through row token_rows[t] of the group's table, PAD_SLOT for tokens that
    complete none."""
    out = {}
    for g in groups:
        if g.kind != "compressed":
            continue
        r, bs = g.tokens_per_row, g.block_size
        e = (torch.div(positions + 1, r, rounding_mode="floor") - 1).clamp(min=0)
        slots = tables[g.name][token_rows, e // bs].long() * bs + e % bs
        out[g.name] = slots if r == 1 else torch.where((positions + 1) % r == 0, slots, PAD_SLOT)
    return out


@dataclass(frozen=True)
class EntryTable:
    """One compressed group's entries as a decode row sees them, read through its block table: row b sees entries
    e < n[b], entry e in cache slot table[b, e // block_size] * block_size + e % block_size. Only the blocks that
    hold visible entries (< ceil(n / block_size)) are guaranteed to be filled: every reader stops at n, so a step
    costs each row its visible entries, never max_model_len. `max_entries` = ceil(max_model_len / ratio) is the
    width the torch references use (they may materialise [R, max_entries]; the Triton paths never do) and bounds
    the top-k width, min(index_topk, max_entries), so the picks have the shapes they always had."""

    table: torch.Tensor  # [R, max_blocks] int32 (batch order)
    n: torch.Tensor  # [R] int64
    block_size: int
    max_entries: int


@dataclass
class DecodeMetadata:
    """A uniform-decode step (one query token per row) as fixed-shape device tensors, so the forward can be
    captured in a CUDA graph: every tensor here lives in a persistent buffer sized for the largest padded batch,
    and rows past `num_reqs` are padding (no valid keys, writes to TRASH_SLOT).

    For each compressed group g (ratio r): `entry_tables[g]` [R, max_blocks_g] int32 is the batch-order copy of the
    rows' block tables (filled up to the blocks of their visible entries: see `EntryTable`), `n_entries[g]` [R] is
    how many entries the row's query sees ((pos+1) div r), and `entry_write[g]` [R] is the slot of the entry this
    token completes (TRASH_SLOT if it completes none). No per-step buffer is sized by max_model_len beyond the
    block tables themselves (as vLLM's decode reads its block table).
    """

    num_reqs: int
    num_padded: int
    positions: torch.Tensor  # [R] int64
    query_start_loc: torch.Tensor  # [R+1] int64 = arange (one token per row)
    window_slots: torch.Tensor  # [R, W] int64 (TRASH_SLOT where masked)
    window_mask: torch.Tensor  # [R, W] bool: key position in (pos - W, pos] and >= 0
    write_slots: torch.Tensor  # [R] int64 window slot of the row's token
    state_blocks: torch.Tensor  # [R] int64 compressor ring block (null block for padding)
    entry_tables: dict[str, torch.Tensor]
    n_entries: dict[str, torch.Tensor]
    entry_write: dict[str, torch.Tensor]
    entry_geometry: dict[str, tuple[int, int]]  # group -> (block_size, max_entries)
    # rows per request: 1 for a plain decode; q > 1 for a speculative verify step run as decode rows (every request
    # has q consecutive rows at consecutive positions; dsv4/spec_decode/verify_decode.py), and then
    # `query_start_loc` [P/q + 1] holds the requests' row offsets (0, q, 2q, ..): the engram n-grams and lookback
    # are per request, as on the token-row path
    query_len: int = 1

    def entries(self, group: str) -> EntryTable:
        """The group's entries of every row, as the decode kernels read them."""
        bs, max_entries = self.entry_geometry[group]
        return EntryTable(self.entry_tables[group], self.n_entries[group], bs, max_entries)


class DecodeMetadataBuffers:
    """Persistent storage of DecodeMetadata for up to `max_rows` rows, and its builder (device ops only)."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_rows: int, max_model_len: int, window: int,
                 device: torch.device) -> None:
        self.groups, self.window, self.max_rows = groups, window, max_rows
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.positions = z(max_rows)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int64, device=device)
        self.window_slots, self.window_mask = z(max_rows, window), z(max_rows, window, dtype=torch.bool)
        self.write_slots, self.state_blocks = z(max_rows), z(max_rows)
        self.compressed = [g for g in groups if g.kind == "compressed"]
        # the blocks of a request of max_model_len, as BlockTables sizes the state-row tables (the one buffer per
        # group whose width grows with max_model_len: int32 block ids, block_size entries per id)
        self.entry_tables = {g.name: z(max_rows, max(1, g.num_blocks_for(max_model_len + g.tokens_per_row)),
                                       dtype=torch.int32) for g in self.compressed}
        self.entry_geometry = {g.name: (g.block_size, -(-max_model_len // g.tokens_per_row)) for g in self.compressed}
        self.n_entries = {g.name: z(max_rows) for g in self.compressed}
        self.entry_write = {g.name: z(max_rows) for g in self.compressed}
        self._wrange = torch.arange(window - 1, -1, -1, device=device)  # offsets pos-W+1 .. pos

    def views(self, num_reqs: int, num_padded: int, query_len: int = 1) -> DecodeMetadata:
        """The first `num_padded` rows of every buffer (no writes): what a graph of that size reads. `query_len` q:
        rows per request (a multi-row verify step; num_padded is a multiple of q), the request offsets a strided
        view of the same arange (0, q, .., num_padded)."""
        P, q = num_padded, query_len
        assert P % q == 0, "a multi-row decode pads to whole requests"
        return DecodeMetadata(
            num_reqs=num_reqs, num_padded=P, positions=self.positions[:P],
            query_start_loc=self.query_start_loc[: P + 1: q], window_slots=self.window_slots[:P],
            window_mask=self.window_mask[:P], write_slots=self.write_slots[:P], state_blocks=self.state_blocks[:P],
            entry_tables={k: v[:P] for k, v in self.entry_tables.items()},
            n_entries={k: v[:P] for k, v in self.n_entries.items()},
            entry_write={k: v[:P] for k, v in self.entry_write.items()},
            entry_geometry=self.entry_geometry, query_len=q,
        )

    @property
    def group_names(self) -> list[str]:
        """The builds a decode step needs, one per KV group that has decode metadata: "window" (positions, window
        slots and mask, write slots, and the compressor ring blocks) and every compressed group."""
        return ["window"] + [g.name for g in self.compressed]

    def build(self, num_reqs: int, num_padded: int, positions: torch.Tensor, idx_mapping: torch.Tensor,
              tables: dict[str, torch.Tensor]) -> DecodeMetadata:
        """Fill rows [0, num_padded) from the real rows' positions [num_reqs], their state rows `idx_mapping`
        [num_reqs] and the state-row block tables (BlockTables.tables). Triton on CUDA (one launch), the torch
        reference elsewhere and for all-padding builds (capture, warm-up)."""
        self.build_groups(self.group_names, num_reqs, num_padded, positions, idx_mapping, tables)
        return self.views(num_reqs, num_padded)

    def build_groups(self, names: list[str], num_reqs: int, num_padded: int, positions: torch.Tensor,
                     idx_mapping: torch.Tensor, tables: dict[str, torch.Tensor]) -> None:
        """Fill the outputs of the builds `names` (of `group_names`) only. Each build reads only the inputs and
        writes only its own buffers, so builds of different groups may run on different streams."""
        R, P = num_reqs, num_padded
        if positions.is_cuda and decode_metadata.triton is not None and R > 0:
            self._build_groups_triton(names, R, P, positions, idx_mapping, tables)
            return
        comp = [g for g in self.compressed if g.name in names]
        batch_tables = {name: t[idx_mapping[:R]] for name, t in tables.items()} if R else {}
        pos = positions[:R]
        if "window" in names:
            self._torch_window(R, P, pos, batch_tables)
        for g in comp:
            self._torch_compressed(g, R, P, pos, batch_tables)

    def _build_groups_triton(self, names: list[str], R: int, P: int, positions: torch.Tensor,
                             idx_mapping: torch.Tensor, tables: dict[str, torch.Tensor]) -> None:
        win = next(g for g in self.groups if g.kind == "window")
        targets = [decode_metadata.CompressedTarget(tables[g.name], g.block_size, g.tokens_per_row,
                                                    self.entry_tables[g.name], self.n_entries[g.name],
                                                    self.entry_write[g.name])
                   for g in self.compressed if g.name in names]
        decode_metadata.build_decode_metadata_triton(
            R, P, positions, idx_mapping, tables[win.name], win.block_size, tables.get("compressor_state"),
            self.positions, self.window_slots, self.window_mask, self.write_slots, self.state_blocks, targets,
            window="window" in names)

    def build_torch(self, num_reqs: int, num_padded: int, positions: torch.Tensor,
                    block_tables: dict[str, torch.Tensor]) -> DecodeMetadata:
        """The reference build from batch-order block tables [num_reqs, max_blocks] (device ops only)."""
        pos = positions[:num_reqs]
        self._torch_window(num_reqs, num_padded, pos, block_tables)
        for g in self.compressed:
            self._torch_compressed(g, num_reqs, num_padded, pos, block_tables)
        return self.views(num_reqs, num_padded)

    def _torch_window(self, R: int, P: int, pos: torch.Tensor, block_tables: dict[str, torch.Tensor]) -> None:
        # padding rows first: no position, no visible key, every write to the trash slot
        for t in (self.positions, self.window_slots, self.write_slots, self.state_blocks):
            t[:P].zero_()
        self.window_mask[:P] = False
        if R == 0:
            return
        self.positions[:R] = pos
        win = next(g for g in self.groups if g.kind == "window")
        wpos = pos[:, None] - self._wrange  # [R, W]
        ok = wpos >= 0
        wslots = _table_slots(block_tables[win.name][:R], wpos.clamp(min=0), win.block_size)
        self.window_mask[:R] = ok
        self.window_slots[:R] = torch.where(ok, wslots, torch.full_like(wslots, TRASH_SLOT))
        self.write_slots[:R] = wslots[:, -1]
        if "compressor_state" in block_tables:
            self.state_blocks[:R] = block_tables["compressor_state"][:R, 0].long()

    def _torch_compressed(self, g: KVGroupSpec, R: int, P: int, pos: torch.Tensor,
                          block_tables: dict[str, torch.Tensor]) -> None:
        for t in (self.entry_tables[g.name], self.n_entries[g.name], self.entry_write[g.name]):
            t[:P].zero_()
        if R == 0:
            return
        r, out = g.tokens_per_row, self.entry_tables[g.name]
        table = block_tables[g.name][:R]
        width = min(out.shape[1], table.shape[1])
        out[:R, :width] = table[:, :width]  # the reference copies whole rows; the kernel only the visible blocks
        self.n_entries[g.name][:R] = (pos + 1) // r
        new = _table_slots(table, ((pos + 1) // r - 1).clamp(min=0)[:, None], g.block_size)[:, 0]
        closes = (pos + 1) % r == 0
        self.entry_write[g.name][:R] = torch.where(closes, new, torch.full_like(new, TRASH_SLOT))


def _table_slots(tables: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per batch row b: slot of logical row rows[b, j] through tables[b] ([R, max_blocks]); rows beyond the table
    map to the null block (masked by the caller)."""
    blk = (rows // block_size).clamp(max=tables.shape[1] - 1)
    return tables.gather(1, blk).long() * block_size + rows % block_size


@dataclass
class TokenKeySlots:
    """The keys each query token of a prefill or mixed step may see, as cache slots (one row per token): the
    decode metadata's layout, so those steps attend with the same fixed-width ops as a decode step instead of a
    loop over requests and query blocks.

    Token t at position p sees window keys (p - W, p] (`window_slots` [T, W], masked where the position is < 0)
    and, per compressed group g, entries e < n_g[t] = (p + 1) div ratio. The entries' slots are kept per request
    (`request_entry_slots[g]` [R, M_g], M_g the largest n_g of the step; `token_request` [T] maps a token to its
    request's row), because the tokens of one request see prefixes of the same entries: a [T, M_g] matrix would
    grow as tokens x context (2 GB of int64 for a 2,048-token chunk at 131,072 entries), the per-request one as
    requests x context. `entry_slots(g)` gives the per-token matrix (masked beyond each token's n_g) for a chunk of
    rows, where a torch path or a per-row kernel wants it. Keys written by this step at later positions are in the
    cache already but never visible to earlier tokens.
    """

    positions: torch.Tensor  # [T] int64
    window_slots: torch.Tensor  # [T, W] int64 (TRASH_SLOT where masked)
    window_mask: torch.Tensor  # [T, W] bool
    token_request: torch.Tensor  # [T] int64: the token's row of request_entry_slots
    request_entry_slots: dict[str, torch.Tensor]  # [R, M_g] int64 (beyond a request's own entries: masked by n)
    n_entries: dict[str, torch.Tensor]  # [T] int64

    def rows(self, a: int, b: int) -> "TokenKeySlots":
        """Tokens [a, b): row chunks bound the memory of the keys gathered per token."""
        return TokenKeySlots(self.positions[a:b], self.window_slots[a:b], self.window_mask[a:b],
                             self.token_request[a:b], self.request_entry_slots,
                             {k: v[a:b] for k, v in self.n_entries.items()})

    def width(self, group: str) -> int:
        """M_g: the most entries of `group` a token of the step sees."""
        return self.request_entry_slots[group].shape[1]

    def entry_slots(self, group: str) -> torch.Tensor:
        """[T, M_g] int64: the slot of token t's entry e, 0 (a valid slot) for e >= n_g[t]."""
        return per_row_slots(self.request_entry_slots[group], self.token_request, self.n_entries[group])


# What the keys gathered for one chunk of token rows may take, in elements (256 MB in fp32): the torch path gathers
# [rows, W + M, head_dim] keys and an index source [rows, M, index_head_dim] indexer keys, M growing with the
# context (at 128K tokens and ratio 4, M = 32K: 16 rows per chunk instead of a 2 GB gather at 256 rows).
ROW_CHUNK_ELEMS = 1 << 26
# Rows a prefill attention chunk may take on CUDA, where the kernels read the keys in place and a row holds only its
# slots, masks and selection (the element bound above then allows thousands of rows). The 256 of the torch path
# made a 16,384-token prefill ~80 attention launches a layer of ~200 rows each, too few rows for the rows kernel
# (dsv4/ops/decode_attention.py) to fill the GPU.
CUDA_ROW_CHUNK = 1 << 14


def row_chunks(num_rows: int, max_rows: int, elems_per_row: int) -> list[tuple[int, int]]:
    """[a, b) ranges covering num_rows rows, each at most max_rows rows and ROW_CHUNK_ELEMS / elems_per_row."""
    step = max(1, min(max_rows, ROW_CHUNK_ELEMS // max(1, elems_per_row)))
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def token_key_slots(md: AttnMetadata, window: int) -> TokenKeySlots:
    """Per-token key slots of a step from its batch-order block tables (device ops; the sizes come from the host
    copies of the per-request counts, as everything on this eager path may). Built once per step and window."""
    cached = md.key_slots.get(window)
    if cached is None:
        cached = md.key_slots[window] = _build_token_key_slots(md, window)
    return cached


def _build_token_key_slots(md: AttnMetadata, window: int) -> TokenKeySlots:
    qsl, ctx = md.query_start_loc_cpu, md.context_lens_cpu
    dev = md.positions.device
    counts = to_device([qsl[r + 1] - qsl[r] for r in range(md.num_reqs)], dev, torch.int64)
    req = torch.repeat_interleave(torch.arange(md.num_reqs, device=dev), counts, output_size=md.num_tokens)
    pos = md.positions
    win = md.groups["window"]
    wpos = pos[:, None] - torch.arange(window - 1, -1, -1, device=dev)  # pos-W+1 .. pos
    ok = wpos >= 0 if md.window_floor is None else wpos >= md.window_floor[:, None]  # (floors are >= 0)
    wslots = _token_table_slots(md.block_tables[win.name], req, wpos.clamp(min=0), win.block_size)
    request_slots, n_entries = {}, {}
    for g in md.groups.values():
        if g.kind != "compressed":
            continue
        r = g.tokens_per_row
        width = max([(ctx[i] + qsl[i + 1] - qsl[i]) // r for i in range(md.num_reqs)], default=0)
        e = torch.arange(width, device=dev).expand(md.num_reqs, -1)
        request_slots[g.name] = _table_slots(md.block_tables[g.name], e, g.block_size)
        n_entries[g.name] = (pos + 1) // r
    return TokenKeySlots(pos, wslots.masked_fill(~ok, TRASH_SLOT), ok, req, request_slots, n_entries)


def _token_table_slots(tables: torch.Tensor, req: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of logical row rows[t, j] through the table of token t's request (tables [R, max_blocks] in batch
    order, req [T]); indexes the table in place (no [T, max_blocks] copy). Rows beyond the table map to its last
    column (masked by the caller)."""
    blk = (rows // block_size).clamp(max=tables.shape[1] - 1)
    return tables[req[:, None], blk].long() * block_size + rows % block_size
