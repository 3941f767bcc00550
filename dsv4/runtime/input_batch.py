"""Persistent input buffers (same addresses every step, so CUDA graphs can read them) and the per-step
InputBatch view over them.

All the small per-step integer arrays (state rows, query start offsets, sequence lengths, logits indices, token
rows and positions, and the flat token-history indices of the input ids and of the sampled tokens) are written on
the host into ONE staging buffer (pinned on CUDA, allocated once) and reach the device in one non-blocking copy
(two more only when a step uses a small part of a very large token budget); every device tensor is a fixed view of
one persistent device buffer (`InputStaging` is the host side). The staging buffer is reused every step, so a write
waits on an event recorded after the previous copy (normally long finished: the host syncs on the sampled tokens).

Invariant: every write to a staged region goes through the staging buffer and the copy covers whole regions or
their used prefix, so the device regions always equal the staging regions. Copying a region's stale tail
therefore writes the values the device already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Above this many unused bytes inside the copied range, the per-token regions are copied separately.
_MAX_GAP_BYTES = 256 * 1024


class InputStaging:
    """The host side of InputBuffers: the staging buffer (pinned on CUDA), numpy views of its regions (same names
    as the device views), and the copy to the device buffer."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        R, T = max_num_reqs, max_num_tokens
        self.max_num_tokens = T
        i32_slots = (2 * R + 1 + 1) // 2  # int64 slots holding the 2R+1 int32 values
        o_idx, o_logits, o_append, o_i32 = 0, R, 2 * R, 3 * R
        self.o_i32, self.i32_slots = o_i32, i32_slots
        self.o_input_index = o_i32 + i32_slots
        self.o_pos = self.o_input_index + T
        self.o_rows = self.o_pos + T
        self.staged = self.o_rows + T  # elements that travel host -> device
        self.offsets = {"idx_mapping": (o_idx, R), "logits_indices": (o_logits, R), "append_index": (o_append, R),
                        "input_index": (self.o_input_index, T), "positions": (self.o_pos, T),
                        "token_rows": (self.o_rows, T)}
        self.device_buf = torch.zeros(self.staged + T, dtype=torch.int64, device=device)  # + input_ids
        self.buf = torch.zeros(self.staged, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = device
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.event_pending = False
        st = self.buf.numpy()

        def region(name: str) -> np.ndarray:
            o, n = self.offsets[name]
            return st[o: o + n]

        self.idx_mapping, self.logits_indices = region("idx_mapping"), region("logits_indices")
        self.append_index, self.input_index = region("append_index"), region("input_index")
        self.positions, self.token_rows = region("positions"), region("token_rows")
        st32 = st[o_i32: o_i32 + i32_slots].view(np.int32)
        self.query_start_loc = st32[: R + 1]
        self.seq_lens = st32[R + 1: 2 * R + 1]

    def wait(self) -> None:
        """Block until the last copy out of the staging buffer is done (call before writing it)."""
        if self.event_pending:
            self.event.synchronize()
            self.event_pending = False

    def upload(self, num_tokens: int) -> None:
        """Copy the staged regions to the device: the per-request regions whole and the per-token ones up to
        `num_tokens` (one copy unless that would carry more than _MAX_GAP_BYTES of unused per-token slots)."""
        T = num_tokens
        if (self.max_num_tokens - T) * 16 > _MAX_GAP_BYTES:
            spans = [(0, self.o_input_index + T), (self.o_pos, self.o_pos + T), (self.o_rows, self.o_rows + T)]
        else:
            spans = [(0, self.o_rows + T)]
        for a, b in spans:
            self.device_buf[a:b].copy_(self.buf[a:b], non_blocking=True)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
            self.event_pending = True


class InputBuffers:
    """Device tensors written in place every step: fixed views of one int64 device buffer, filled from the host
    staging buffer of the same layout (`staging`) in one copy.

    Layout (int64 elements): idx_mapping [R] | logits_indices [R] | append_index [R] | query_start_loc [R+1] and
    seq_lens [R] as int32 | input_index [T] | positions [T] | token_rows [T] || input_ids [T] (device only).
    Only the device tensors live in the instance dict (`vars()`); the staging side is a slot.
    """

    __slots__ = ("__dict__", "staging")

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        device = torch.device(device)
        R, T = max_num_reqs, max_num_tokens
        self.staging = st = InputStaging(R, T, device)
        buf = st.device_buf

        def region(name: str) -> torch.Tensor:
            o, n = st.offsets[name]
            return buf[o: o + n]

        self.idx_mapping = region("idx_mapping")  # [R] state row per batch row
        self.logits_indices = region("logits_indices")  # [R] token index of each row that samples
        self.append_index = region("append_index")  # [R] flat token_history index of each sampled token
        i32 = buf[st.o_i32: st.o_i32 + st.i32_slots].view(torch.int32)
        self.query_start_loc = i32[: R + 1]
        self.seq_lens = i32[R + 1: 2 * R + 1]
        self.input_index = region("input_index")  # [T] flat token_history index of each input id
        self.positions = region("positions")
        self.token_rows = region("token_rows")  # [T] state row per token
        self.input_ids = buf[st.staged: st.staged + T]  # gathered on the device, never staged


@dataclass
class InputBatch:
    """One step, as slices of the persistent buffers plus host copies of the small per-request arrays.

    Batch row b runs state row `idx_mapping[b]` for `num_scheduled_tokens[b]` tokens starting at position
    `num_computed_np[b]`.
    """

    req_ids: list[str]
    num_reqs: int
    num_tokens: int
    idx_mapping: torch.Tensor  # [R] state row per batch row
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray  # [R]
    query_start_loc_np: np.ndarray  # [R+1]
    num_computed_np: np.ndarray  # [R]
    query_start_loc: torch.Tensor  # [R+1]
    seq_lens: torch.Tensor  # [R]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S] token index of each row that samples
    sample_batch_rows: np.ndarray  # [S] batch rows that sample this step
    # [S] flat index (state row * max_model_len + position) of the token each sampling row appends to the device
    # token history (RequestState.append_sampled); None for a dummy batch
    append_index: torch.Tensor | None = None

    @staticmethod
    def prepare(buffers: InputBuffers, token_history: torch.Tensor, req_ids: list[str], idx_mapping_np: np.ndarray,
                num_computed_np: np.ndarray, num_scheduled: np.ndarray, sample_batch_rows: np.ndarray) -> "InputBatch":
        """Fill the persistent buffers for a step (one host->device copy); the input ids are gathered from the
        device token history."""
        R = len(req_ids)
        T = int(num_scheduled.sum())
        S = len(sample_batch_rows)
        L = token_history.shape[1]
        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl[1:])
        seq_lens_np = num_computed_np + num_scheduled
        st = buffers.staging
        st.wait()
        token_rows, positions = st.token_rows[:T], st.positions[:T]
        if T == R and num_scheduled.min() == 1:  # one token per row (a uniform decode): nothing to repeat
            token_rows[:] = idx_mapping_np
            positions[:] = num_computed_np
        else:
            token_rows[:] = np.repeat(idx_mapping_np, num_scheduled)
            positions[:] = np.repeat(num_computed_np - qsl[:-1], num_scheduled)
            positions += np.arange(T)
        input_index = st.input_index[:T]
        np.multiply(token_rows, L, out=input_index)
        input_index += positions
        st.idx_mapping[:R] = idx_mapping_np
        st.query_start_loc[: R + 1] = qsl
        st.seq_lens[:R] = seq_lens_np
        if S:
            st.logits_indices[:S] = qsl[1:][sample_batch_rows] - 1
            # a sampling row appends at position seq_len (its known tokens are all computed after this step)
            append_pos = seq_lens_np[sample_batch_rows]
            if append_pos.max() >= L:
                raise IndexError(f"a sampled token would land past max_model_len={L}")
            append_index = st.append_index[:S]
            np.multiply(idx_mapping_np[sample_batch_rows], L, out=append_index)
            append_index += append_pos
        st.upload(T)
        torch.index_select(token_history.view(-1), 0, buffers.input_index[:T], out=buffers.input_ids[:T])
        return InputBatch(
            req_ids=req_ids, num_reqs=R, num_tokens=T, idx_mapping=buffers.idx_mapping[:R],
            idx_mapping_np=idx_mapping_np, num_scheduled_tokens=num_scheduled, query_start_loc_np=qsl,
            num_computed_np=num_computed_np, query_start_loc=buffers.query_start_loc[: R + 1],
            seq_lens=buffers.seq_lens[:R], input_ids=buffers.input_ids[:T], positions=buffers.positions[:T],
            token_rows=buffers.token_rows[:T], logits_indices=buffers.logits_indices[:S],
            sample_batch_rows=sample_batch_rows, append_index=buffers.append_index[:S],
        )

    @staticmethod
    def make_dummy(buffers: InputBuffers, num_reqs: int, num_tokens: int) -> "InputBatch":
        """A batch of `num_reqs` fresh requests splitting `num_tokens` evenly (for warm-up and profiling).

        Its token rows point at state row 0 but dummy block tables are all null blocks, so no real KV is hit.
        """
        base, extra = divmod(num_tokens, num_reqs)
        sched = np.full(num_reqs, base, dtype=np.int64)
        sched[num_reqs - extra:] += 1
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(sched, out=qsl[1:])
        positions_np = np.arange(num_tokens) - np.repeat(qsl[:-1], sched)
        st = buffers.staging
        st.wait()
        st.positions[:num_tokens] = positions_np
        st.token_rows[:num_tokens] = 0
        st.input_index[:num_tokens] = 0
        st.idx_mapping[:num_reqs] = np.arange(num_reqs)
        st.query_start_loc[: num_reqs + 1] = qsl
        st.seq_lens[:num_reqs] = sched
        st.logits_indices[:num_reqs] = qsl[1:] - 1
        st.upload(num_tokens)
        buffers.input_ids[:num_tokens].zero_()
        rows = np.arange(num_reqs)
        return InputBatch(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)], num_reqs=num_reqs, num_tokens=num_tokens,
            idx_mapping=buffers.idx_mapping[:num_reqs], idx_mapping_np=rows, num_scheduled_tokens=sched,
            query_start_loc_np=qsl, num_computed_np=np.zeros(num_reqs, dtype=np.int64),
            query_start_loc=buffers.query_start_loc[: num_reqs + 1], seq_lens=buffers.seq_lens[:num_reqs],
            input_ids=buffers.input_ids[:num_tokens], positions=buffers.positions[:num_tokens],
            token_rows=buffers.token_rows[:num_tokens], logits_indices=buffers.logits_indices[:num_reqs],
            sample_batch_rows=rows,
        )
