"""Speculative steps pipelined with async scheduling: step s + 1 is scheduled and launched before step s's acceptance
reaches the host (speculative config with `"verify_decode": true` and `async_scheduling=True`).

Why. A synchronous speculative step exposes its host work: the host reads the step's acceptance before it can
build the next step, so the GPU waits while the host verifies, bookkeeps, schedules and prepares. On the H200
(benchmarks/results/2026-12-02-h200-spec-decode-verify-rows, V4.1-Flash-8l bf16, batch 1, k = 5) a verify step
took 7.39 ms against 3.65 ms for a plain (async) step, 2.02x, while the stored-bytes floor of 6 rows is 1.67x that
of one row: the difference is about what a step's host work costs. With the oracle drafter 6 tokens a step, the
issue's 3.5x needs a step of at most 1.71x a plain one.

What moves to the device. For a request the device holds `computed` (positions whose KV is written) and `tokens`
(tokens known: committed outputs), per state row (`PipelinedVerify.computed / .tokens`). Between them lie a = tokens
- computed known tokens (1, or 2 after a rewind to a compressor pair start, speculator.py), and past `tokens` the
token history holds the drafts. A steady step is q = k + 1 decode rows a request (verify_decode.py) at positions
computed .. computed + q - 1, so its shape is known on the host and only the positions are on the device:
1. drafts (proposed last step, `Speculator.drafts`) go into the token history after `tokens`; input ids are the
   history at the positions; the multi-row decode metadata is built from those device positions (the decode build
   takes device positions; a CUDA graph replays the forward);
2. greedy verification on the device (`accept_greedy`): row i's argmax must equal the token at row i + 1, from row
   a - 1 (the anchor) on; j accepted drafts, and the target's token at row a - 1 + j is the bonus, written into the
   history after them;
3. the counts advance as the synchronous path's (speculator.py `_verify`): tokens += j + 1; computed = tokens - 1
   when all d = q - a drafts were accepted, else the compressor pair start floor((n0 + j) / R) * R;
4. the drafter proposes the next drafts from the new counts (taps written from device positions; proposers take
   device positions, proposer.py);
5. one device tensor [R, q + 4] (j, a, new computed, new tokens, then the q tokens from the old `tokens`) is copied
   to pinned host memory with an event: `PipelinedOutput.result()` waits for that step alone, updates the host
   mirrors and the acceptance counters and returns the RunnerOutput the scheduler expects from a speculative step.

What stays on the host: the scheduler (dsv4/engine/scheduler.py "Pipelined speculation": q tokens a request, blocks
for the counted positions, which are never behind the device's), stop checks, detokenization. A step is pipelined
only while the batch is steady (`Scheduler.can_pipeline`, `Speculator.can_pipeline`): no admission, no prefill, every
request plain greedy (no penalties, logprobs, grammar or seed to resolve on the host), below disable_by_batch_size,
with room for two more steps. The engine lands every pipelined step before any other step (`LLMEngine.step`), which
then runs the synchronous speculative path with exact host counts. A request that stops while a step for it is in
flight loses that step's tokens (as async scheduling's one discarded token); its row goes at the next step.

Sampling rows (temperature > 0) are not pipelined yet: they need the rejection rule on the device with the
Sampler's per-position tensors, which are built on the host from the outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.runtime.input_batch import InputBatch
from dsv4.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from dsv4.spec_decode.speculator import Speculator


def accept_greedy(target: torch.Tensor, ids: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per request: target [R, q] the target's token after each row, ids [R, q] the rows' input
    tokens, known [R] how many of the rows are known tokens (the drafts are ids[:, known:]). Row i verifies the draft
    at row i + 1 for i >= known - 1; the count is the length of the leading run of matches from there."""
    R, q = ids.shape
    i = torch.arange(q - 1, device=ids.device)
    before = i[None, :] < (known - 1)[:, None]  # rows before the anchor: not verifying, counted as matches
    match = (target[:, :-1] == ids[:, 1:]) | before
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1) - (known - 1)


class PipelinedOutput:
    """A pipelined step's results on their way to the host (module docstring, step 5)."""

    def __init__(self, pipe: "PipelinedVerify", req_ids: list[str], rows: np.ndarray, packed: torch.Tensor) -> None:
        self._pipe, self._req_ids, self._rows = pipe, req_ids, rows
        self._event: torch.cuda.Event | None = None
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)  # pinned, ordered after the step
            self._event = torch.cuda.Event()
            self._event.record()
        self._packed = packed
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._pipe.land(self._req_ids, self._rows, self._packed.numpy())
            self._pipe.in_flight.remove(self)
        return self._result


class PipelinedVerify:
    """The device-side counts and the pipelined step of a Speculator whose steady steps are q decode rows."""

    def __init__(self, speculator: "Speculator") -> None:
        self.spec = speculator
        r = speculator.runner
        n, dev = r.config.scheduler.max_num_seqs, r.device
        self.q = speculator.k + 1
        self.computed = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        # the device counts are ahead of the host mirrors (a pipelined step ran since the last synchronous one)
        self.device_ahead = False
        self.in_flight: list[PipelinedOutput] = []
        self.num_steps = 0  # pipelined steps launched
        self._rows_key: tuple[int, ...] = ()
        self._rows_dev = torch.zeros(0, dtype=torch.int64, device=dev)

    def _device_rows(self, rows: np.ndarray) -> torch.Tensor:
        """The state rows as a device tensor, copied only when the batch changes (a copy from pageable memory
        would wait for the stream; from pinned memory it does not)."""
        key = tuple(rows.tolist())
        if key != self._rows_key:
            t = torch.from_numpy(rows.copy())
            dev = self._rows_dev.device
            if dev.type == "cuda":
                t = t.pin_memory()
            self._rows_dev, self._rows_key = t.to(dev, non_blocking=True), key
        return self._rows_dev

    def launch(self, so: SchedulerOutput) -> PipelinedOutput:
        """Launch one pipelined step (the module docstring's steps 1-5); nothing here reads a device value."""
        sp = self.spec
        r = sp.runner
        rs = r.req_state
        r._apply_deltas(so)  # rows of finished requests go; the counted num_computed it writes is not used here
        q, k, L = self.q, sp.k, rs.max_model_len
        req_ids = list(so.num_scheduled_tokens)
        assert all(so.num_scheduled_tokens[i] == q for i in req_ids), "a pipelined step is q tokens a request"
        R, T = len(req_ids), len(req_ids) * q
        rows_np = np.array([rs.req_id_to_row[i] for i in req_ids], dtype=np.int64)
        rows = self._device_rows(rows_np)
        if not self.device_ahead:  # the host mirrors are exact (everything landed): the device starts from them
            self.computed[rows] = torch.from_numpy(rs.num_computed[rows_np]).to(rows.device)
            self.tokens[rows] = torch.from_numpy(rs.num_tokens[rows_np]).to(rows.device)
            self.device_ahead = True
        dev = rows.device
        hist = rs.token_history.view(-1)
        p0, n0 = self.computed[rows], self.tokens[rows]
        known = n0 - p0
        # 1. the drafts after the known tokens; the rows' positions and input ids
        cols = torch.arange(q, device=dev)
        base = rows[:, None] * L
        hist[base + (n0[:, None] + cols[:k]).clamp(max=L - 1)] = sp.drafts[rows, :k]
        positions = (p0[:, None] + cols).reshape(-1)
        token_rows = rows.repeat_interleave(q)
        ids = hist[token_rows * L + positions]
        batch = InputBatch(
            req_ids=req_ids, num_reqs=R, num_tokens=T, idx_mapping=rows, idx_mapping_np=rows_np,
            num_scheduled_tokens=np.full(R, q, dtype=np.int64),
            query_start_loc_np=np.arange(R + 1, dtype=np.int64) * q,
            num_computed_np=np.full(R, -1, dtype=np.int64),  # on the device only: nothing may read it
            query_start_loc=(torch.arange(R + 1, device=dev) * q).to(torch.int32),
            seq_lens=(p0 + q).to(torch.int32), input_ids=ids, positions=positions, token_rows=token_rows,
            logits_indices=torch.arange(T, device=dev), sample_batch_rows=np.arange(R))
        proposer = sp.proposer
        taps = dict.fromkeys(proposer.tap_layer_ids) if proposer.tap_layer_ids else None
        assert sp.verify_decode is not None
        hidden = sp.verify_decode.forward(batch, taps)
        if taps is not None and sp.taps is not None:
            sp.taps.write_chunks(torch.cat([taps[i] for i in proposer.tap_layer_ids], dim=-1), rows, p0, q)
        # 2. greedy verification and the bonus token
        target = r.model.compute_logits(hidden).argmax(dim=-1).view(R, q)
        j = accept_greedy(target, ids.view(R, q), known)
        bonus = target.gather(1, (known - 1 + j)[:, None])[:, 0]
        hist[rows * L + (n0 + j).clamp(max=L - 1)] = bonus
        # 3. the counts, as the synchronous path's
        new_tokens = n0 + j + 1
        ratio = sp.ratio
        new_computed = torch.where(j < q - known, torch.div(n0 + j, ratio, rounding_mode="floor") * ratio, n0 + j)
        self.tokens[rows] = new_tokens
        self.computed[rows] = new_computed
        # 5. (before 4: the proposal may replay a graph whose output the next replay overwrites) the packed results
        emitted = hist[base + (n0[:, None] + cols).clamp(max=L - 1)]
        packed = torch.cat([torch.stack([j, known, new_computed, new_tokens], dim=1), emitted], dim=1)
        # 4. the next drafts (batches this large propose none: can_pipeline keeps them synchronous)
        proposed = proposer.propose(req_ids, rows, new_tokens - 2, bonus, sp.taps)
        sp.drafts[rows, : proposer.block_size] = proposed.to(torch.int64)
        self.num_steps += 1
        out = PipelinedOutput(self, req_ids, rows_np, packed)
        self.in_flight.append(out)
        return out

    def land(self, req_ids: list[str], rows: np.ndarray, packed: np.ndarray) -> RunnerOutput:
        """A landed step's results into the host mirrors (rows still held by their request), the acceptance
        counters and the RunnerOutput of a speculative step (`num_uncomputed_tokens` relative to the step's own
        q tokens, `num_draft_tokens` what the next step verifies)."""
        sp = self.spec
        rs = sp.runner.req_state
        q = self.q
        sampled: list[list[int]] = []
        uncomputed: list[int] = []
        drafts: list[int] = []
        for b, (req_id, row) in enumerate(zip(req_ids, rows.tolist())):
            j, a, c, t = (int(v) for v in packed[b, :4])
            toks = packed[b, 4: 4 + j + 1].tolist()
            sampled.append(toks)
            uncomputed.append(t - j - 1 - a + q - c)  # the step's end (its start + q) minus what stays computed
            drafts.append(max(q - (t - c), 0))
            if rs.req_id_to_row.get(req_id) == row:  # not finished (its row dropped) since
                rs.num_tokens[row], rs.num_computed[row] = t, c
                rs.output_ids[row].extend(toks)
                sp.count_acceptance(row, q - a, j, t - j - 1)
        return RunnerOutput(req_ids, sampled, [None] * len(req_ids), num_uncomputed_tokens=uncomputed,
                            num_draft_tokens=drafts)
