"""ModelState: the model-specific hooks the runner calls every step.

The runner owns the generic machinery (rows, buffers, block tables, sampling); a ModelState adds what one
model family needs on top (DeepSeek-V4.1's engram lookback window and bounded replay plug in here in later
issues). Hook order within a step: add/remove_request, then prepare_attn, then prepare_inputs.
"""

from __future__ import annotations

import torch

from dsv4.kv.spec import PAD_SLOT, KVGroupSpec
from dsv4.ops.lookback import gather_lookback
from dsv4.runtime.attn_metadata import AttnMetadata, DecodeMetadata, DecodeMetadataBuffers, build_attn_metadata
from dsv4.runtime.block_tables import BlockTables
from dsv4.runtime.input_batch import InputBatch
from dsv4.runtime.request_state import RequestState
from dsv4.step import NewRequestData


class DefaultModelState:
    """Hooks for a model that needs nothing beyond tokens, positions and per-group attention metadata."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_num_reqs: int, max_model_len: int, window: int,
                 device: torch.device) -> None:
        self.groups = groups
        self.decode = DecodeMetadataBuffers(groups, max_num_reqs, max_model_len, window, device)

    def add_request(self, row: int, new_req: NewRequestData) -> None:
        """A request took state row `row` (keyed by row, as every device-side per-request state is)."""

    def remove_request(self, req_id: str) -> None:
        """A request is about to give its row back."""

    def prepare_attn(self, batch: InputBatch, block_tables: BlockTables, for_dummy: bool = False) -> AttnMetadata:
        """Attention metadata of the step. Dummy batches get null-block tables and PAD slots: they write no KV
        that a real request could read."""
        if for_dummy:
            tables = {name: torch.zeros_like(t[: batch.num_reqs]) for name, t in block_tables.tables.items()}
            slots = torch.full((batch.num_tokens,), PAD_SLOT, dtype=torch.int64, device=batch.positions.device)
        else:
            tables = block_tables.gather(batch.idx_mapping)
            slots = block_tables.window_slot_mapping(batch.token_rows, batch.positions)
        return build_attn_metadata(
            num_reqs=batch.num_reqs,
            query_start_loc_cpu=batch.query_start_loc_np.tolist(),
            context_lens_cpu=batch.num_computed_np.tolist(),
            positions=batch.positions,
            groups=self.groups,
            block_tables=tables,
            window_slot_mapping=slots,
        )

    def prepare_decode_attn(self, batch: InputBatch, block_tables: BlockTables, num_padded: int) -> DecodeMetadata:
        """Fixed-shape metadata of a uniform-decode step padded to `num_padded` rows (a graph size)."""
        return self.decode.build(batch.num_reqs, num_padded, batch.positions, batch.idx_mapping, block_tables.tables)

    def prepare_dummy_decode_attn(self, num_padded: int) -> DecodeMetadata:
        """All-padding decode metadata of `num_padded` rows (graph capture, warm-up)."""
        return self.decode.build_torch(0, num_padded, self.decode.positions[:0], {})

    def prepare_inputs(self, batch: InputBatch, req_state: RequestState) -> dict[str, torch.Tensor]:
        """Extra model inputs beyond input_ids/positions (none for V4)."""
        return {}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, torch.Tensor]:
        """The same keys as prepare_inputs, for warm-up, profiling and graph capture."""
        return {}


class DeepseekV41ModelState(DefaultModelState):
    """DefaultModelState plus the engram lookback window (the seed's `DeepseekV41ModelState`, first half).

    The engram n-gram hash needs the ids of the `depth` tokens before each request's chunk. The runner keeps
    every request's token history on the device, so the window is gathered there each step, in one op: exact
    for prompt and generated tokens alike, whoever computed their KV. The buffer is persistent so a captured
    graph reads the same address on every replay.
    """

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_num_reqs: int, max_model_len: int, window: int,
                 device: torch.device, depth: int) -> None:
        super().__init__(groups, max_num_reqs, max_model_len, window, device)
        self.lookback_token_ids: torch.Tensor | None = None
        if depth > 0:
            self.lookback_token_ids = torch.full((max_num_reqs, depth), -1, dtype=torch.int32, device=device)

    def prepare_inputs(self, batch: InputBatch, req_state: RequestState) -> dict[str, torch.Tensor]:
        inputs = super().prepare_inputs(batch, req_state)
        if self.lookback_token_ids is None:
            return inputs
        # chunk start of each row = the position of its first query token (a device gather, no host sync)
        starts = batch.positions[batch.query_start_loc[: batch.num_reqs].long()]
        gather_lookback(self.lookback_token_ids, batch.idx_mapping, starts, req_state.token_history, batch.num_reqs)
        inputs["lookback_token_ids"] = self.lookback_token_ids
        return inputs

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, torch.Tensor]:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        if self.lookback_token_ids is not None:
            self.lookback_token_ids.fill_(-1)  # replays refill it in place
            inputs["lookback_token_ids"] = self.lookback_token_ids
        return inputs
