"""The runner's grammar state: one xgrammar GrammarMatcher per constrained row, and the token bitmask that applies
them to a step's logits.

Per step, for the rows of the batch that sample and carry a grammar: each matcher fills its row of a host bitmask
(one bit per token id: allowed or not), the rows go to the logits' device in one copy, and xgrammar's kernel sets
the logits of disallowed tokens to -inf in place, on those rows only (free rows are not touched). The sampler then
runs as for any request: greedy and random sampling, top-k/p, and the logprobs (vLLM's raw logprobs, computed from
the logits the sampler gets, so after the mask) all see the masked distribution. When a step's tokens land on the
host, each matcher accepts its row's token.

The mask needs the matcher to have accepted the previous token, which under async scheduling is still on the
device when the next step launches: the runner lands it first (ModelRunner._launch), after the step's forward is
queued, so the GPU keeps running while the host waits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.structured.compiler import import_xgrammar

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class GrammarMatchers:
    """Grammar matchers by runner row (a request's stable row, dsv4.runtime.request_state)."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs, self.vocab_size, self.device = max_num_reqs, vocab_size, device
        self._matchers: dict[int, xgrammar.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # host [max_num_reqs, ceil(V / 32)] int32, allocated on first use
        self._copied: torch.cuda.Event | None = None  # the last copy of the host bitmask to the device
        self._batch: xgrammar.BatchGrammarMatcher | None = None  # fills many rows on threads, made on first use

    def add(self, row: int, grammar: "xgrammar.CompiledGrammar", output_ids: Sequence[int]) -> None:
        """A matcher for `row`, advanced over the tokens the request already produced (a request resumed after
        preemption re-enters with its outputs)."""
        xgr = import_xgrammar()
        matcher = xgr.GrammarMatcher(grammar)
        for token in output_ids:
            self._accept(row, matcher, token)
        self._matchers[row] = matcher

    def remove(self, row: int) -> None:
        self._matchers.pop(row, None)

    def constrains(self, rows: np.ndarray) -> bool:
        """Whether any of `rows` has a grammar (O(1) while no request has one)."""
        return bool(self._matchers) and any(r in self._matchers for r in rows.tolist())

    def accept(self, row: int, token: int) -> None:
        """Advance `row`'s matcher (if it has one) over a sampled token."""
        matcher = self._matchers.get(row)
        if matcher is not None:
            self._accept(row, matcher, token)

    @staticmethod
    def _accept(row: int, matcher: "xgrammar.GrammarMatcher", token: int) -> None:
        # A terminated matcher has accepted its stop token: the request ends there, and a token sampled past it (a
        # step launched before the stop landed, under async scheduling) is discarded with the request.
        if matcher.is_terminated():
            return
        if not matcher.accept_token(token):  # the mask allows only accepted tokens: a bug if it happens
            logger.error("row %d: the grammar rejected token %d, which its mask allowed", row, token)

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> None:
        """Mask `logits` [R, V] in place: row i (request row `rows[i]`) keeps only the tokens its grammar allows
        next. Rows without a grammar, or whose grammar has ended, are not touched."""
        xgr = import_xgrammar()
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.max_num_reqs, self.vocab_size)
            if self.device.type == "cuda":  # pinned: the copy to the device does not stage through pageable memory
                self._bitmask = self._bitmask.pin_memory()
        if self._copied is not None:  # the previous step's copy has read the host rows (done by now: its tokens landed)
            self._copied.synchronize()
        indices, matchers = [], []
        for i, row in enumerate(rows.tolist()):
            matcher = self._matchers.get(row)
            if matcher is not None and not matcher.is_terminated():
                matchers.append(matcher)
                indices.append(i)
        if not indices:
            return
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(self._bitmask, indices[0])
        else:
            # ~0.1 ms a row for a JSON schema: xgrammar's threads fill the rows of a large batch in parallel (the
            # host work runs while the step's forward is on the GPU, but must stay shorter than it to be hidden)
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
            self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices)
        bitmask = self._bitmask[: len(rows)]
        if logits.device != bitmask.device:
            # not blocking: the host must not wait for this step's forward, which the copy queues behind
            bitmask = bitmask.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)
