"""Persistent input buffers (same addresses every step, so CUDA graphs can read them) and the per-step
InputBatch view over them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class InputBuffers:
    """Device tensors written in place every step."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.token_rows = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)  # state row per token
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.idx_mapping = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)


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

    @staticmethod
    def prepare(buffers: InputBuffers, token_history: torch.Tensor, req_ids: list[str], idx_mapping_np: np.ndarray,
                num_computed_np: np.ndarray, num_scheduled: np.ndarray, sample_batch_rows: np.ndarray) -> "InputBatch":
        """Fill the persistent buffers for a step; the input ids come from the device token history."""
        R = len(req_ids)
        T = int(num_scheduled.sum())
        device = buffers.input_ids.device
        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=qsl[1:])
        # one host->device copy of the per-token (row, position) pairs; everything else is gathered on device
        token_rows_np = np.repeat(idx_mapping_np, num_scheduled)
        positions_np = np.repeat(num_computed_np - qsl[:-1], num_scheduled) + np.arange(T)
        buffers.token_rows[:T].copy_(torch.from_numpy(token_rows_np))
        buffers.positions[:T].copy_(torch.from_numpy(positions_np))
        buffers.input_ids[:T] = token_history[buffers.token_rows[:T], buffers.positions[:T]]
        buffers.idx_mapping[:R].copy_(torch.from_numpy(idx_mapping_np.astype(np.int64)))
        buffers.query_start_loc[: R + 1].copy_(torch.from_numpy(qsl.astype(np.int32)))
        buffers.seq_lens[:R].copy_(torch.from_numpy((num_computed_np + num_scheduled).astype(np.int32)))
        logits_indices = torch.from_numpy(qsl[1:][sample_batch_rows] - 1).to(device)
        return InputBatch(
            req_ids=req_ids, num_reqs=R, num_tokens=T, idx_mapping=buffers.idx_mapping[:R],
            idx_mapping_np=idx_mapping_np, num_scheduled_tokens=num_scheduled, query_start_loc_np=qsl,
            num_computed_np=num_computed_np, query_start_loc=buffers.query_start_loc[: R + 1],
            seq_lens=buffers.seq_lens[:R], input_ids=buffers.input_ids[:T], positions=buffers.positions[:T],
            token_rows=buffers.token_rows[:T], logits_indices=logits_indices, sample_batch_rows=sample_batch_rows,
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
        buffers.input_ids[:num_tokens].zero_()
        buffers.positions[:num_tokens].copy_(torch.from_numpy(positions_np))
        buffers.token_rows[:num_tokens].zero_()
        buffers.idx_mapping[:num_reqs].copy_(torch.arange(num_reqs))
        buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(qsl.astype(np.int32)))
        buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(sched.astype(np.int32)))
        rows = np.arange(num_reqs)
        return InputBatch(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)], num_reqs=num_reqs, num_tokens=num_tokens,
            idx_mapping=buffers.idx_mapping[:num_reqs], idx_mapping_np=rows, num_scheduled_tokens=sched,
            query_start_loc_np=qsl, num_computed_np=np.zeros(num_reqs, dtype=np.int64),
            query_start_loc=buffers.query_start_loc[: num_reqs + 1], seq_lens=buffers.seq_lens[:num_reqs],
            input_ids=buffers.input_ids[:num_tokens], positions=buffers.positions[:num_tokens],
            token_rows=buffers.token_rows[:num_tokens],
            logits_indices=torch.from_numpy(qsl[1:] - 1).to(buffers.input_ids.device), sample_batch_rows=rows,
        )
