"""Stable request rows and the device token history.

A request owns one row from admission until it finishes or is preempted (a resumed request is re-added,
possibly to another row). Every per-request tensor on the device is indexed by this row, so a step only has
to tell the device which rows run (`idx_mapping`); tokens, positions and block tables are gathered from them.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv4.ops.host_copy import to_device
from dsv4.runtime.sampler import plain_greedy_from
from dsv4.sampling_params import SamplingParams
from dsv4.step import NewRequestData

_NEVER = np.iinfo(np.int64).max


class RequestState:
    """Per-row state: the token history on the device, and small host mirrors of the lengths."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.max_num_reqs, self.max_model_len, self.device = max_num_reqs, max_model_len, device
        self.req_id_to_row: dict[str, int] = {}
        self.row_to_req_id: list[str | None] = [None] * max_num_reqs
        self.free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out row 0 first
        # The host never needs a sampled token to build the next step's inputs: they come from here.
        self.token_history = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int64, device=device)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs known
        self.prompt_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.prompt_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        # Per row: the output count from which its params sample by a plain argmax of the raw logits
        # (sampler.plain_greedy_from; _NEVER if they never do), and how many active rows are not plain greedy
        # now, or only after min_tokens outputs: with both counts 0 a step needs no per-row check.
        self.greedy_from = np.full(max_num_reqs, _NEVER, dtype=np.int64)
        self._num_never_greedy = 0
        self._num_greedy_later = 0

    def add_request(self, new: NewRequestData) -> int:
        """Take a free row (re-adding an id replaces its old row entirely) and write its known tokens."""
        if new.req_id in self.req_id_to_row:
            self.remove_request(new.req_id)
        assert self.free_rows, "more running requests than max_num_seqs"
        row = self.free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        assert len(tokens) <= self.max_model_len
        self.req_id_to_row[new.req_id] = row
        self.row_to_req_id[row] = new.req_id
        self.token_history[row, : len(tokens)] = to_device(tokens, self.device, torch.int64)
        self.num_tokens[row] = len(tokens)
        self.prompt_len[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.sampling_params[row] = new.sampling_params
        self.prompt_ids[row] = list(new.prompt_token_ids)
        self.output_ids[row] = list(new.output_token_ids)
        start = plain_greedy_from(new.sampling_params)
        self.greedy_from[row] = _NEVER if start is None else start
        self._count_greedy(row, +1)
        return row

    def _count_greedy(self, row: int, delta: int) -> None:
        start = self.greedy_from[row]
        if start == _NEVER:
            self._num_never_greedy += delta
        elif start > 0:
            self._num_greedy_later += delta

    def remove_request(self, req_id: str) -> int | None:
        """Return the row to the free list; None if the id is unknown (e.g. finished before it ever ran)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.row_to_req_id[row] = None
        self._count_greedy(row, -1)
        self.greedy_from[row] = _NEVER
        self.sampling_params[row] = None
        self.prompt_ids[row], self.output_ids[row] = [], []
        self.free_rows.append(row)
        return row

    def all_plain_greedy(self, rows_np: np.ndarray) -> bool:
        """Whether every row of `rows_np` (active rows, about to sample) samples by a plain argmax of the raw
        logits this step (`sampler.greedy_sample` gives exactly the Sampler's tokens): O(1) when every active
        request is plain greedy from its first token."""
        if self._num_never_greedy == 0 and self._num_greedy_later == 0:
            return True
        num_out = self.num_tokens[rows_np] - self.prompt_len[rows_np]  # == len(self.output_ids[row])
        return bool((self.greedy_from[rows_np] <= num_out).all())

    def append_sampled(self, rows_np: np.ndarray, tokens: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Write sampled tokens into the device history at each row's next position (no host sync).

        `index`: the flat history indices `row * max_model_len + num_tokens[row]` of `rows_np`, already on the
        device (InputBatch.append_index); computed and copied here when None.
        """
        if index is None:
            index = to_device(rows_np * self.max_model_len + self.num_tokens[rows_np], self.device)
        self.token_history.view(-1).index_copy_(0, index, tokens)
        self.num_tokens[rows_np] += 1

    @property
    def num_active(self) -> int:
        return len(self.req_id_to_row)
