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
- computed known tokens (the anchor alone, a = 1, since a rejection recomputes nothing; the functions below take any
a), and past `tokens` the token history holds the drafts. A steady step is q = k + 1 decode rows a request
(verify_decode.py) at positions computed .. computed + q - 1, so its shape is known on the host and only the
positions are on the device:
1. drafts (proposed last step, `Speculator.drafts`) go into the token history after `tokens`; input ids are the
   history at the positions; the multi-row decode metadata is built from those device positions (the decode build
   takes device positions; a CUDA graph replays the forward);
2. verification on the device (`verify_on_device`): for a greedy request row i's argmax must equal the token at
   row i + 1, from row a - 1 (the anchor) on; j accepted drafts, and the target's token at row a - 1 + j is the
   bonus, written into the history after them. A sampled request follows the rejection rule of rejection.py with
   its randomness drawn on the device;
3. the counts advance as the synchronous path's (speculator.py `_verify`): tokens += j + 1, computed = n0 + j
   (= tokens - 1: nothing is restored after a rejection, the compressor rings keep k + 1 rows of slack);
4. the drafter proposes the next drafts from the new counts (taps written from device positions; proposers take
   device positions, proposer.py);
5. one device tensor [R, q + 4] (j, a, new computed, new tokens, then the q tokens from the old `tokens`) is copied
   to pinned host memory with an event: `PipelinedOutput.result()` waits for that step alone, updates the host
   mirrors and the acceptance counters and returns the RunnerOutput the scheduler expects from a speculative step.

What stays on the host: the scheduler (dsv4/engine/scheduler.py "Pipelined speculation": q tokens a request, blocks
for the counted positions, which are never behind the device's), stop checks, detokenization. A step is pipelined
only while the batch is steady (`Scheduler.can_pipeline`, `Speculator.pipeline_tokens`): no admission, no prefill,
every request plain greedy or sampled with static params (temperature, top-k, top-p, min-p, seed; no penalty, logit
bias, logprobs, grammar or pending min_tokens ban, which need the host's outputs), with room for two more steps.
While speculation is off for the batch (disable_by_batch_size, the adaptive switch) the steady steps are plain ones
of one token a request, pipelined the same way (the runner's plain step: its host counts are exact). The engine
lands every pipelined step before any other step (`LLMEngine.step`), which then runs the synchronous speculative
path with exact host counts; so does a verify step's proposals when speculation turns off. A request that stops
while a step for it is in flight loses that step's tokens (as async scheduling's one discarded token); its row goes
at the next step.

A seeded request's randomness is a function of (seed, output count) computed on the device (dsv4/runtime/
seeded_noise.py): a pipelined step sets each row's count from the device counts, so it draws exactly what the
synchronous path draws for the same position, and the request's tokens do not depend on which path ran.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.ops.host_copy import to_device
from dsv4.runtime.input_batch import InputBatch
from dsv4.runtime.sampler import SamplingTensors, apply_filters
from dsv4.spec_decode.rejection import seeded_randomness
from dsv4.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from dsv4.spec_decode.speculator import Speculator


def leading_accepts(accept: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per request: accept [R, q - 1] whether row i accepts the token at row i + 1, known [R] how
    many of the q rows are known tokens (the drafts are rows known ..). Row i verifies for i >= known - 1; the count
    is the length of the leading run of acceptances from there."""
    i = torch.arange(accept.shape[1], device=accept.device)
    before = i[None, :] < (known - 1)[:, None]  # rows before the anchor: not verifying, counted as accepting
    return (accept | before).to(torch.int64).cumprod(dim=1).sum(dim=1) - (known - 1)


def accept_greedy(target: torch.Tensor, ids: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """Accepted drafts of greedy requests: target [R, q] the target's argmax after each row, ids [R, q] the rows'
    input tokens; a draft is accepted while it equals the target's token at the row before it."""
    return leading_accepts(target[:, :-1] == ids[:, 1:], known)


def verify_on_device(logits: torch.Tensor, ids: torch.Tensor, known: torch.Tensor, st: SamplingTensors | None,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [R], the token emitted after them [R]) of q rows a request: logits [R * q, V] raw, ids
    [R, q] the rows' input tokens, known [R] (as `leading_accepts`). `st` (None: every request plain greedy) has
    one row per logits row, static (no penalty, bias or ban: `Speculator.pipeline_tokens`; a seeded row's output count
    in `st.seed_counts`, that of the position the row verifies). Greedy requests
    follow `accept_greedy` and emit the target's argmax; sampled ones follow dsv4.spec_decode.rejection's rule for
    one-hot drafts (accept draft x at row i when u_i < p_i(x); at the first rejection draw from p_i without x,
    after all of them from p at the last row), with the randomness drawn on the device from `generator`."""
    R, q = ids.shape
    logits = logits.float()
    target = logits.argmax(dim=-1).view(R, q)
    if st is None or st.all_greedy:
        j = accept_greedy(target, ids, known)
        return j, target.gather(1, (known - 1 + j)[:, None])[:, 0]
    V = logits.shape[1]
    probs = apply_filters(logits, st).softmax(dim=-1).view(R, q, V)
    u = torch.rand(R * q, generator=generator, device=logits.device)
    noise = torch.empty(R * q, V, device=logits.device).exponential_(generator=generator)
    seeded_randomness(u, noise, st)  # seeded rows: functions of (seed, st.seed_counts)
    u, noise = u.view(R, q), noise.view(R, q, V)
    greedy = st.greedy.view(R, q)[:, 0]
    p_next = probs[:, :-1].gather(2, ids[:, 1:, None])[..., 0]  # row i's probability of the token at row i + 1
    j = leading_accepts(torch.where(greedy[:, None], target[:, :-1] == ids[:, 1:], u[:, :-1] < p_next), known)
    b = known - 1 + j
    r = torch.arange(R, device=logits.device)
    p = probs[r, b]
    rejected = ids[r, (b + 1).clamp(max=q - 1)]
    # norm(max(p - one_hot(rejected), 0)): p without the rejected draft (the race needs no normalisation)
    residual = p.scatter(1, rejected[:, None], 0.0)
    use = (j < q - known) & (residual.sum(dim=-1) > 0)
    dist = torch.where(use[:, None], residual, p)
    drawn = (dist / noise[r, b].clamp(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return j, torch.where(greedy, target[r, b], drawn)


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
        self._st_key: tuple[str, ...] | None = None
        self._st: SamplingTensors | None = None
        self._prompt_key: tuple[int, ...] | None = None
        self._prompt_len_dev = torch.zeros(0, dtype=torch.int64, device=dev)

    def _prompt_lens(self, rows: torch.Tensor, rows_np: np.ndarray) -> torch.Tensor:
        """The requests' prompt lengths [R] on the device, copied at a run's first pipelined step and when its rows
        change (a request joins only through a synchronous step, which starts a new run)."""
        if self._prompt_key != self._rows_key:
            t = torch.from_numpy(self.spec.runner.req_state.prompt_len[rows_np].astype(np.int64))
            if rows.device.type == "cuda":
                t = t.pin_memory()
            self._prompt_len_dev, self._prompt_key = t.to(rows.device, non_blocking=True), self._rows_key
        return self._prompt_len_dev

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

    def _sampling(self, rows: np.ndarray, req_ids: list[str], outputs: torch.Tensor,
                  known: torch.Tensor) -> SamplingTensors | None:
        """The Sampler's tensors of the step's R * q rows (None: all plain greedy), built once per batch while it
        is pipelined: pipelined requests' params read no outputs, so they do not change from step to step; only
        the seeded rows' output counts do, set here on the device from `outputs` [R] (each request's outputs before
        the step) and `known` [R]: row i verifies position i - (known - 1), whose draw follows that many more."""
        rs = self.spec.runner.req_state
        if rs.all_plain_greedy(rows):
            return None
        key = tuple(req_ids)
        if key != self._st_key:
            r = self.spec.runner
            params = [rs.sampling_params[row] for row in rows.tolist() for _ in range(self.q)]
            n = len(params)
            self._st = SamplingTensors.build(params, [[]] * n, [[]] * n, r.vocab_size, r.device, r.eos_token_ids,
                                             num_output_tokens=[p.min_tokens for p in params])
            self._st_key = key
        st = self._st
        if st is not None and st.seeded_rows is not None:
            counts = (outputs - known + 1)[:, None] + torch.arange(self.q, device=outputs.device)
            st = dataclasses.replace(st, seed_counts=counts.reshape(-1)[st.seeded_rows])
        return st

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
            self.computed[rows] = to_device(rs.num_computed[rows_np], rows.device)
            self.tokens[rows] = to_device(rs.num_tokens[rows_np], rows.device)
            self.device_ahead = True
            self._st_key, self._st, self._prompt_key = None, None, None  # a new run of pipelined steps: rebuilt
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
        # 2. verification and the token after the accepted drafts
        st = self._sampling(rows_np, req_ids, n0 - self._prompt_lens(rows, rows_np), known)
        j, bonus = verify_on_device(r.model.compute_logits(hidden), ids.view(R, q), known, st, r.sampler.generator)
        hist[rows * L + (n0 + j).clamp(max=L - 1)] = bonus
        # 3. the counts, as the synchronous path's
        new_tokens = n0 + j + 1
        new_computed = n0 + j  # (a rejection restores nothing: the rings keep slack, speculator.py)
        self.tokens[rows] = new_tokens
        self.computed[rows] = new_computed
        # 5. (before 4: the proposal may replay a graph whose output the next replay overwrites) the packed results
        emitted = hist[base + (n0[:, None] + cols).clamp(max=L - 1)]
        packed = torch.cat([torch.stack([j, known, new_computed, new_tokens], dim=1), emitted], dim=1)
        # 4. the next drafts (when speculation turns off for the next batch, they are verified synchronously)
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
