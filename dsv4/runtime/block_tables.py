"""Per-group block tables indexed by stable row, and the slot mappings derived from them."""

from __future__ import annotations

import numpy as np
import torch

from dsv4.kv.spec import STATE, WINDOW, KVGroupSpec


class BlockTables:
    """One `[max_num_reqs, max_blocks]` int32 table per KV group (null block 0 where unused)."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_num_reqs: int, max_model_len: int,
                 device: torch.device) -> None:
        self.groups = groups
        self.tables: dict[str, torch.Tensor] = {}
        self.num_blocks: dict[str, np.ndarray] = {}
        for g in groups:
            max_blocks = 1 if g.kind == STATE else max(1, g.num_blocks_for(max_model_len + g.tokens_per_row))
            self.tables[g.name] = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32, device=device)
            self.num_blocks[g.name] = np.zeros(max_num_reqs, dtype=np.int64)
        self.window = next(g for g in groups if g.kind == WINDOW)

    def set_row(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Replace a row's blocks in every group (a new or resumed request)."""
        for g, ids in zip(self.groups, block_ids):
            self.tables[g.name][row].zero_()
            self.num_blocks[g.name][row] = 0
        self.append(row, block_ids)

    def append(self, row: int, new_block_ids: tuple[list[int], ...]) -> None:
        """Append newly allocated blocks to a row, group by group."""
        for g, ids in zip(self.groups, new_block_ids):
            if not ids:
                continue
            n = int(self.num_blocks[g.name][row])
            t = self.tables[g.name]
            new = torch.tensor(ids, dtype=torch.int32)
            if t.is_cuda:  # from pinned memory the copy does not wait for the stream (async scheduling)
                new = new.pin_memory()
            t[row, n : n + len(ids)] = new.to(t.device, non_blocking=True)
            self.num_blocks[g.name][row] = n + len(ids)

    def gather(self, idx_mapping: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tables in batch order: [R, max_blocks] per group."""
        return {name: t[idx_mapping] for name, t in self.tables.items()}

    def window_slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """slot = table[row, pos // bs] * bs + pos % bs for every token of the step."""
        bs = self.window.block_size
        t = self.tables[self.window.name]
        return t[token_rows, positions // bs].long() * bs + positions % bs
