"""Draft proposers: what fills a request's next drafts after each step that sampled for it.

- `DSparkProposer`: the checkpoint's DSpark drafter (docs/dspark.md) on the target taps of the request's last
  `sliding_window` committed positions, kept per state row in a `TapBuffer`.
- `MTPProposer`: DeepSeek-V4's MTP layer (dsv4.spec_decode.mtp) on the target's final streams of the same positions
  (also a `TapBuffer`) and the tokens after them.
- `OracleProposer`: a test hook that replays known continuations (e.g. the target's own greedy output, computed by a
  run without speculation), so every draft is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from dsv4.ops.host_copy import to_device, to_device_all
from dsv4.spec_decode.dspark import DSparkDrafter
from dsv4.spec_decode.mtp import MTPDrafter


class TapBuffer:
    """Per state row, the target taps (docs/dspark.md 2.1: the mean over hc of the streams entering each target
    layer, concatenated) of its recent positions, in a ring indexed by position % capacity.

    A position's taps are written whenever the target computes it, so they are exact for committed positions,
    whoever computed them. The ring holds `window + extra` positions: a verify step also writes taps of drafts that
    get rejected (at most `extra` - 1 positions past the last committed one), and those must not overwrite the
    `window` committed positions the drafter reads."""

    def __init__(self, max_num_reqs: int, window: int, extra: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.window, self.capacity = window, window + extra
        self.values = torch.zeros(max_num_reqs, self.capacity, width, dtype=dtype, device=device)

    def write(self, taps: torch.Tensor, token_rows: np.ndarray, positions: np.ndarray, chunk_ends: np.ndarray
              ) -> None:
        """taps [T, width] of a step's tokens (state row, position; `chunk_ends` = each token's request's last
        position + 1): only each request's last `capacity` tokens are written, so no slot is written twice."""
        keep = np.flatnonzero(positions >= chunk_ends - self.capacity)
        if len(keep) == 0:
            return
        dev = self.values.device
        # (one pinned copy: a plain decode step writes its taps here, and a pageable copy would make the host wait for
        # the step's forward)
        rows, slots, keep_d = to_device_all([token_rows[keep], positions[keep] % self.capacity, keep], dev)
        self.values[rows, slots] = taps[keep_d].to(self.values.dtype)

    def write_chunks(self, taps: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, q: int) -> None:
        """taps [R * q, width] of a step in which state row rows[i] computed positions first[i] .. + q - 1 (request
        by request; device tensors, no host sync: pipelined speculation). q <= capacity, so no slot is written twice."""
        pos = first[:, None] + torch.arange(q, device=first.device)
        self.values[rows[:, None].expand(-1, q), torch.remainder(pos, self.capacity)] = (
            taps.view(len(rows), q, -1).to(self.values.dtype))

    def gather(self, rows: np.ndarray | torch.Tensor, last_positions: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[S, window, width]: the taps of positions last - window + 1 .. last of each row (slots of negative
        positions hold stale values; the drafter masks them). Host arrays or device tensors (no host sync)."""
        dev = self.values.device
        last = as_device(last_positions, dev)
        pos = last[:, None] - self.window + 1 + torch.arange(self.window, device=dev)
        return self.values[as_device(rows, dev)[:, None], torch.remainder(pos, self.capacity)]


def as_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int array of positions or rows as a device tensor: host arrays are copied, device tensors (pipelined
    speculation computes positions on the device) are used as they are."""
    return x if isinstance(x, torch.Tensor) else to_device(x, device)


class Proposer(Protocol):
    """Proposes `block_size` drafts per request; `tap_layer_ids` names the target layers it reads (empty: none),
    `tap_width` the width of their taps concatenated (a TapBuffer row)."""

    block_size: int
    tap_layer_ids: tuple[int, ...]
    tap_width: int

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        """Drafts [S, block_size] (int64, on the device) for the tokens after each anchor: request i (state row
        rows[i]) has committed positions 0 .. last_positions[i] and its newest token `anchors[i]` at
        last_positions[i] + 1. Rows and positions come as host arrays, or as device tensors under pipelined
        speculation (dsv4/spec_decode/pipelined.py), where a proposer must not read them on the host."""
        ...


class DSparkProposer:
    """DeepSeek-V4.1's DSpark drafter, eager (its reference `propose`: the stages' context KV is recomputed from the
    taps each call); drafts are its greedy picks, so the verifier's draft distribution is one-hot."""

    def __init__(self, drafter: DSparkDrafter, embed: nn.Module, lm_head: nn.Module) -> None:
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.block_size = drafter.dspark.block_size
        self.tap_layer_ids = drafter.dspark.target_layer_ids
        self.tap_width = drafter.cfg.hidden_size * len(self.tap_layer_ids)  # hc-means, concatenated

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        assert taps is not None
        last = as_device(last_positions, anchors.device)
        ctx = taps.gather(rows, last)
        # device positions (a pipelined step): the MoE's fixed-shape path, which reads nothing on the host (the
        # grouped path sizes its groups there); the same function (tests/test_drafter_graphs.py)
        fixed = isinstance(last_positions, torch.Tensor)
        return self.drafter.propose(ctx, last, anchors, self.embed, self.lm_head, fixed=fixed).tokens


class MTPProposer:
    """DeepSeek-V4's MTP layer (its reference `propose`: the layer's context keys are recomputed from the taps each
    call; `propose_on_device` is what drafter_graphs.py captures), k greedy drafts per request (the layer
    re-applied), so the verifier's draft distribution is one-hot. Its tap is the target's final streams
    (`DeepseekV4ForCausalLM.forward`'s tap n = num_hidden_layers); the token after each tapped position comes from
    the device token history."""

    def __init__(self, drafter: MTPDrafter, k: int, embed: nn.Module, lm_head: nn.Module,
                 token_history: torch.Tensor) -> None:
        self.drafter, self.embed, self.lm_head, self.token_history = drafter, embed, lm_head, token_history
        cfg = drafter.cfg
        self.block_size = k
        self.tap_layer_ids = (cfg.num_hidden_layers,)
        self.tap_width = cfg.hc_mult * cfg.hidden_size

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        assert taps is not None
        # device positions (a pipelined step): the MoE's fixed-shape path, which reads nothing on the host
        return self.propose_on_device(as_device(rows, anchors.device), as_device(last_positions, anchors.device),
                                      taps, fixed=isinstance(last_positions, torch.Tensor))

    def propose_on_device(self, rows: torch.Tensor, last: torch.Tensor, taps: TapBuffer, fixed: bool
                          ) -> torch.Tensor:
        """Drafts [S, k] of state rows `rows` with last committed positions `last` (device tensors): the streams
        of positions last - W + 1 .. last from the tap ring, and the token after each of them from the device
        token history (the last: the anchor); a position before the sequence start reads token 0 and its row is
        masked by the drafter. No host read (capturable with `fixed`)."""
        W = taps.window
        pos = (last[:, None] - W + 2 + torch.arange(W, device=last.device)).clamp(min=0)
        tokens = self.token_history[rows[:, None], pos]
        return self.drafter.propose(taps.gather(rows, last), last, tokens, self.block_size, self.embed,
                                    self.lm_head, fixed=fixed)


class OracleProposer:
    """Test hook: request `req_id` drafts the tokens that follow its anchor in `sequences[req_id]` (prompt and the
    expected output), i.e. the positions last + 2 ..; `fill` past the end of a sequence or for unknown ids. With
    device positions (pipelined speculation) it reads the sequences from a device table, with no host sync."""

    tap_layer_ids: tuple[int, ...] = ()
    tap_width = 0

    def __init__(self, sequences: Mapping[str, Sequence[int]], block_size: int, fill: int = 0) -> None:
        self.sequences, self.block_size, self.fill = sequences, block_size, fill
        self._table: torch.Tensor | None = None  # [ids + 1, longest + block_size]: each sequence, then fill
        self._index: dict[str, int] = {}
        self._batch_key: tuple[str, ...] = ()
        self._batch_idx = torch.zeros(0, dtype=torch.int64)

    def _device_table(self, device: torch.device) -> torch.Tensor:
        if self._table is None or self._table.device != device:
            width = max((len(s) for s in self.sequences.values()), default=0) + self.block_size + 2
            table = np.full((len(self.sequences) + 1, width), self.fill, dtype=np.int64)  # last row: unknown ids
            for i, (req_id, seq) in enumerate(self.sequences.items()):
                table[i, : len(seq)] = list(seq)
                self._index[req_id] = i
            self._table = to_device(table, device)
        return self._table

    def propose(self, req_ids: Sequence[str], rows: np.ndarray | torch.Tensor,
                last_positions: np.ndarray | torch.Tensor, anchors: torch.Tensor,
                taps: TapBuffer | None) -> torch.Tensor:
        K = self.block_size
        if isinstance(last_positions, torch.Tensor):
            table = self._device_table(anchors.device)
            key = tuple(req_ids)
            if key != self._batch_key:  # copied once per batch: a copy from a list waits for the stream
                idx = [self._index.get(r, table.shape[0] - 1) for r in req_ids]
                self._batch_key, self._batch_idx = key, to_device(idx, anchors.device, torch.int64)
            cols = (last_positions[:, None] + 2 + torch.arange(K, device=anchors.device)).clamp(max=table.shape[1] - 1)
            return table[self._batch_idx[:, None], cols]
        out = np.full((len(req_ids), K), self.fill, dtype=np.int64)
        for i, (req_id, last) in enumerate(zip(req_ids, last_positions.tolist())):
            seq = self.sequences.get(req_id, ())
            part = list(seq[last + 2: last + 2 + K])
            out[i, : len(part)] = part
        return to_device(out, anchors.device)
