"""ModelState: the model-specific hooks the runner calls every step.

The runner owns the generic machinery (rows, buffers, block tables, sampling); a ModelState adds what one
model family needs on top (DeepSeek-V4.1's engram lookback window and prefix-cache replay). Hook order within a
step: add/remove_request, then prepare_attn, then prepare_inputs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from dsv4.kv.spec import COMPRESSED, PAD_SLOT, KVGroupSpec
from dsv4.ops.lookback import gather_lookback
from dsv4.runtime.attn_metadata import (AttnMetadata, DecodeMetadata, DecodeMetadataBuffers, build_attn_metadata,
                                        entry_slot_mappings_of)
from dsv4.runtime.block_tables import BlockTables
from dsv4.runtime.input_batch import InputBatch, InputBuffers
from dsv4.runtime.metadata_graphs import AttnMetadataGraphs, GraphKey, GroupBuild
from dsv4.runtime.request_state import RequestState
from dsv4.step import NewRequestData

logger = logging.getLogger(__name__)


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
            entry_slots = {g.name: slots for g in self.groups if g.kind == COMPRESSED}
        else:
            tables = block_tables.gather(batch.idx_mapping)
            slots = block_tables.window_slot_mapping(batch.token_rows, batch.positions)
            entry_slots = entry_slot_mappings_of(self.groups, block_tables.tables, batch.token_rows, batch.positions)
        return build_attn_metadata(
            num_reqs=batch.num_reqs,
            query_start_loc_cpu=batch.query_start_loc_np.tolist(),
            context_lens_cpu=batch.num_computed_np.tolist(),
            positions=batch.positions,
            groups=self.groups,
            block_tables=tables,
            window_slot_mapping=slots,
            entry_slot_mappings=entry_slots,
        )

    def replaying(self, batch: InputBatch) -> bool:
        """Whether some row of the step replays a prefix-cache hit (it needs the token-row path, which clamps
        windows and skips cached writes, even for a one-token chunk)."""
        return False

    def prepare_decode_attn(self, batch: InputBatch, block_tables: BlockTables, num_padded: int,
                            full_graph: bool = False) -> DecodeMetadata:
        """Fixed-shape metadata of a uniform-decode step padded to `num_padded` rows (a graph size; `full_graph`:
        the forward replays that size's FULL graph)."""
        return self.decode.build(batch.num_reqs, num_padded, batch.positions, batch.idx_mapping, block_tables.tables)

    def capture_metadata_graphs(self, buffers: InputBuffers, block_tables: BlockTables, pool: object) -> None:
        """Record the decode-metadata builds the FULL graphs serve (only the specialized decode does)."""

    def release_graphs(self) -> None:
        """Drop recorded builds (before graphs are captured again)."""

    def warm_up(self, batch: InputBatch, block_tables: BlockTables, req_state: RequestState) -> None:
        """Launch once, on a dummy decode batch, the kernels a step launches outside the model's forward (here the
        decode-metadata build), so their JIT compilation happens at start-up, before memory profiling and graph
        capture, not in the first request's step. Writes only buffers every step rewrites before reading."""
        self.decode.build(batch.num_reqs, batch.num_reqs, batch.positions, batch.idx_mapping, block_tables.tables)

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
    """DefaultModelState plus the engram lookback window and prefix-cache replay (the seed's
    `DeepseekV41ModelState`).

    Lookback: the engram n-gram hash needs the ids of the `depth` tokens before each request's chunk. The runner
    keeps every request's token history on the device, so the window is gathered there each step, in one op:
    exact for prompt and generated tokens alike, whoever computed their KV. The buffer is persistent so a
    captured graph reads the same address on every replay.

    Replay (runtime.md 2.3): a request admitted with a prefix hit computes [replay_start, replay_end) again. Its
    per-row bounds are kept on the host from add_request; a step whose rows are still inside their replayed range
    uploads them (pinned staging, persistent device buffer indexed by state row), then (1) sets the entry slots of
    the replayed tokens to PAD_SLOT in every prefix-cacheable group, before the model reads the slot mappings, so
    the shared cached blocks are never written, and (2) gives every token a window floor, its row's replay start,
    below which its window reads nothing (no window KV was rebuilt there). Rows past their replayed range (decodes
    included) get floor 0 and no padding: their windows start above replay_start anyway. Unlike vLLM, a hit shorter
    than the replay (replay_start 0, replay_end > 0) is padded too: recomputing it would rewrite the shared blocks
    with values that may differ in the last bits (another batch shape), and nothing may modify a cached block.
    """

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_num_reqs: int, max_model_len: int, window: int,
                 device: torch.device, depth: int) -> None:
        super().__init__(groups, max_num_reqs, max_model_len, window, device)
        self.lookback_token_ids: torch.Tensor | None = None
        if depth > 0:
            self.lookback_token_ids = torch.full((max_num_reqs, depth), -1, dtype=torch.int32, device=device)
        self.replay_np = np.zeros((max_num_reqs, 2), dtype=np.int64)  # per state row: (replay_start, replay_end)
        self._replay_dev = torch.zeros(max_num_reqs, 2, dtype=torch.int64, device=device)
        self._replay_staging = torch.zeros(max_num_reqs, 2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._replay_event = torch.cuda.Event() if device.type == "cuda" else None
        self.cacheable = tuple(g.name for g in groups if g.prefix_cacheable)
        # steps that uploaded replay bounds: only those with a row inside its replayed range do (nothing else reads
        # the device bounds, so a decode step never needs them zeroed: runtime.md invariant 10 holds by design)
        self.num_replay_uploads = 0

    def add_request(self, row: int, new_req: NewRequestData) -> None:
        self.replay_np[row] = (new_req.replay_start, new_req.replay_end)

    def _active_replay(self, batch: InputBatch) -> np.ndarray | None:
        """[R, 2] bounds of the batch rows still inside their replayed range ((0, 0) for the others), or None."""
        rows = batch.idx_mapping_np[: batch.num_reqs]
        bounds = self.replay_np[rows]
        active = batch.num_computed_np[: batch.num_reqs] < bounds[:, 1]
        if not active.any():
            return None
        return np.where(active[:, None], bounds, 0)

    def replaying(self, batch: InputBatch) -> bool:
        return self._active_replay(batch) is not None

    def prepare_attn(self, batch: InputBatch, block_tables: BlockTables, for_dummy: bool = False) -> AttnMetadata:
        md = super().prepare_attn(batch, block_tables, for_dummy)
        bounds = None if for_dummy else self._active_replay(batch)
        if bounds is None:
            return md
        self.num_replay_uploads += 1
        if self._replay_event is not None:
            self._replay_event.synchronize()  # the previous upload has left the staging buffer
        # by state row (the batch's rows; the others are never read this step)
        self._replay_staging.numpy()[batch.idx_mapping_np[: batch.num_reqs]] = bounds
        self._replay_dev.copy_(self._replay_staging, non_blocking=True)
        if self._replay_event is not None:
            self._replay_event.record()
        md.entry_slot_mappings, md.window_floor = pad_replayed_slots(
            md.entry_slot_mappings, self.cacheable, batch.token_rows, batch.positions, self._replay_dev)
        return md

    def prepare_inputs(self, batch: InputBatch, req_state: RequestState) -> dict[str, torch.Tensor]:
        inputs = super().prepare_inputs(batch, req_state)
        if self.lookback_token_ids is None:
            return inputs
        self._gather_lookback(batch, req_state)
        inputs["lookback_token_ids"] = self.lookback_token_ids
        return inputs

    def _gather_lookback(self, batch: InputBatch, req_state: RequestState) -> None:
        assert self.lookback_token_ids is not None
        # chunk start of each row = the position of its first query token (a device gather, no host sync)
        starts = batch.positions[batch.query_start_loc[: batch.num_reqs].long()]
        gather_lookback(self.lookback_token_ids, batch.idx_mapping, starts, req_state.token_history, batch.num_reqs)

    def warm_up(self, batch: InputBatch, block_tables: BlockTables, req_state: RequestState) -> None:
        super().warm_up(batch, block_tables, req_state)
        if self.lookback_token_ids is not None:  # the lookback gather too; the window is refilled before any read
            self._gather_lookback(batch, req_state)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, torch.Tensor]:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        if self.lookback_token_ids is not None:
            self.lookback_token_ids.fill_(-1)  # replays refill it in place
            inputs["lookback_token_ids"] = self.lookback_token_ids
        return inputs


class DeepseekV41SpecializedDecodeModelState(DeepseekV41ModelState):
    """DeepseekV41ModelState plus the specialized decode (runtime.md 5.6; `decode_backend="latency_specialized"`).

    - The decode-metadata build of every uniform-decode step a FULL forward graph serves is recorded as a CUDA
      graph at capture time (`AttnMetadataGraphs`, in the forward graphs' pool, one per key) and replayed in place
      of the eager build; a key without a recording builds eagerly (warning once).
    - A step that replays a recorded build gathers its engram lookback window on a side stream beside it, joined
      before the forward: between the metadata graph and the forward graph no eager kernel runs. A staged gather is
      always joined before another one writes the window.
    - Decode steps upload no replay bounds (the base class uploads only for rows inside a replayed range).
    """

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_num_reqs: int, max_model_len: int, window: int,
                 device: torch.device, depth: int, capture_sizes: list[int], decode_query_len: int = 1,
                 fork_builds: bool = True) -> None:
        super().__init__(groups, max_num_reqs, max_model_len, window, device, depth)
        self.graphs = AttnMetadataGraphs(capture_sizes, decode_query_len, max_num_reqs, fork_builds)
        self._req_state: RequestState | None = None  # from the first prepare_inputs: the side-stream gather reads it
        # the gather's stream, the event it waits for on the main stream, the event it records when done
        self._side: tuple[torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event] | None = None
        self._staged: tuple[InputBatch, torch.cuda.Event] | None = None  # a gather issued beside a metadata replay

    def metadata_builds(self, buffers: InputBuffers, block_tables: BlockTables) -> list[GroupBuild]:
        """The decode build split by KV group, reading the persistent input buffers (what a recording needs)."""
        builds = []
        for name in self.decode.group_names:
            def run(key: GraphKey, name: str = name) -> None:
                R, P = key[0], key[1]
                self.decode.build_groups([name], R, P, buffers.positions[:R], buffers.idx_mapping[:R],
                                         block_tables.tables)
            builds.append(GroupBuild(name, block_tables.tables[name], run))
        return builds

    def capture_metadata_graphs(self, buffers: InputBuffers, block_tables: BlockTables, pool: object) -> None:
        self.graphs.release()
        builds = self.metadata_builds(buffers, block_tables)
        if not self.graphs.can_record(builds):
            logger.warning("decode metadata builds cannot be recorded: every decode step builds eagerly")
            return
        for key in self.graphs.capture_keys():
            padded_decode_batch(key, buffers)
            self.graphs.capture(key, builds, lambda k: self.decode.views(k[0], k[1]), pool)
        logger.info("recorded %d decode-metadata builds", len(self.graphs.recorded()))

    def release_graphs(self) -> None:
        self.graphs.release()

    def prepare_decode_attn(self, batch: InputBatch, block_tables: BlockTables, num_padded: int,
                            full_graph: bool = False) -> DecodeMetadata:
        key = self.graphs.key(batch.num_scheduled_tokens[: batch.num_reqs], num_padded if full_graph else None,
                              has_prefill=False)
        if key is not None:
            self._stage_lookback(batch)
            md = self.graphs.replay(key)
            if md is not None:
                return md
        return super().prepare_decode_attn(batch, block_tables, num_padded, full_graph)

    def prepare_inputs(self, batch: InputBatch, req_state: RequestState) -> dict[str, torch.Tensor]:
        self._req_state = req_state
        if self.lookback_token_ids is None:
            return {}
        if self._join_staged() is not batch:  # (a stale gather is joined too: never two writers of the window)
            self._gather_lookback(batch, req_state)
        return {"lookback_token_ids": self.lookback_token_ids}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, torch.Tensor]:
        self._join_staged()
        return super().prepare_dummy_inputs(num_reqs, num_tokens)

    def _stage_lookback(self, batch: InputBatch) -> None:
        """Issue the batch's lookback gather on the side stream, beside the metadata graph about to replay (it
        reads the batch's state rows, positions and the token history, all written by now).

        This runs on the host between two graph launches, so it is kept to one kernel and a few stream calls
        (measured: the generic gather with `torch.cuda.stream(...)` and an index op cost more host time than the
        metadata graph saved): a uniform decode's chunk starts are every q-th position, a strided view of the
        positions buffer the kernel reads directly; the stream is switched with set_stream, not the context."""
        if self.lookback_token_ids is None or self._req_state is None or not batch.positions.is_cuda:
            return
        if self._side is None:
            self._side = (torch.cuda.Stream(device=batch.positions.device), torch.cuda.Event(), torch.cuda.Event())
        self._join_staged()
        stream, ready, done = self._side
        main = torch.cuda.current_stream()
        ready.record(main)
        stream.wait_event(ready)
        R, q = batch.num_reqs, self.graphs.decode_query_len
        torch.cuda.set_stream(stream)
        try:  # no allocation on the side stream: every tensor here is a persistent buffer or a view of one
            gather_lookback(self.lookback_token_ids, batch.idx_mapping, batch.positions[: R * q: q],
                            self._req_state.token_history, R)
        finally:
            torch.cuda.set_stream(main)
        done.record(stream)
        self._staged = (batch, done)

    def _join_staged(self) -> InputBatch | None:
        """Make the current stream wait for a staged gather, if any; returns the batch it gathered."""
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        torch.cuda.current_stream().wait_event(staged[1])
        return staged[0]


def padded_decode_batch(key: GraphKey, buffers: InputBuffers) -> InputBatch:
    """A dummy uniform-decode batch of the key's real rows (state rows 0.., position 0), for recording its build:
    the recorded kernels take every per-row value from the buffers at replay, so the values do not matter."""
    return InputBatch.make_dummy(buffers, key[0], key[2])


def pad_replayed_slots(slot_mappings: dict[str, torch.Tensor], cacheable: tuple[str, ...], token_rows: torch.Tensor,
                       positions: torch.Tensor, bounds: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Replay on device: token t of state row token_rows[t] at positions[t] is replayed when bounds[row, 0] <=
    position < bounds[row, 1]. Returns the slot mappings with PAD_SLOT at replayed tokens in the groups named in
    `cacheable` (the others unchanged) and the per-token window floor (bounds[row, 0], 0 for rows without replay).
    A few elementwise ops, no host sync: prefill and mixed steps run eagerly, so no kernel of its own is needed."""
    lo, hi = bounds[token_rows, 0], bounds[token_rows, 1]
    replayed = (positions >= lo) & (positions < hi)
    out = {name: (m.masked_fill(replayed, PAD_SLOT) if name in cacheable else m) for name, m in slot_mappings.items()}
    return out, lo
