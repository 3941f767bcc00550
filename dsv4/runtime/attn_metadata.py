"""Attention metadata: what every attention layer needs to know about one step's batch.

Built once per step by the model state (`prepare_attn`) from the persistent input buffers and block tables,
then passed to the model's forward (never imported by it as global state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.kv.spec import KVGroupSpec


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
) -> AttnMetadata:
    """Bundle a step's batch description for the model."""
    return AttnMetadata(
        num_reqs=num_reqs,
        num_tokens=int(positions.shape[0]),
        query_start_loc_cpu=query_start_loc_cpu,
        context_lens_cpu=context_lens_cpu,
        positions=positions,
        groups={g.name: g for g in groups},
        block_tables=block_tables,
        window_slot_mapping=window_slot_mapping,
    )
