"""The speculative step: verify each running request's drafts, commit what was accepted, roll back the rest, and
propose the next drafts. `ModelRunner` hands every step to `Speculator.launch` when speculation is on.

A request with d drafts runs its known-but-uncomputed tokens (the anchor, normally alone) plus the d drafts, like a
small prefill chunk; the target's logits at the last d + 1 positions verify them (dsv4.spec_decode.rejection).

Rollback, and why it needs (almost) no work. The verify step writes state for every position of its chunk, rejected
drafts included; each kind is position-addressed or recomputed:
- window KV, compressed entries and indexer keys are written at slots of their position (entry id), and a query at
  position t reads only positions <= t (entries closed at or before t): a rejected position's KV is never read
  before the next step recomputes that position and overwrites it;
- the engram lookback window and the device token history: the history holds the drafts past the request's known
  tokens, and the lookback reads only positions before a chunk, all committed; emitted tokens overwrite them;
- taps for the drafter: a ring of `window + block + 2` positions per row (`TapBuffer`), so rejected positions never
  overwrite the committed window the drafter reads;
- the compressor rings hold the raw rows of the open windows (V4.1: its ratio-2 pairs; V4: CSA windows of 2 * ratio
  positions, HCA ratio; slot = position % rows), and a rejected position's row could overwrite an accepted one's.
  Instead of snapshotting the rings, under speculation each ring keeps k + 1 rows more than its window
  (dsv4/kv/spec.py `ring_slack`): a step's k + 1 positions then overwrite only the rows of positions more than a
  window before the step, which no later window reads, and the rejected positions' own rows are recomputed (in the
  next step's chunk, which reads them from the step, not the ring) before anything reads them. Nothing is restored,
  and the request's computed count is simply its committed tokens (up to the last accepted draft).
- scheduler state (num_computed_tokens, KV blocks, prefix units, stop strings and max_tokens): the runner returns
  how many of the step's tokens are not computed after all (`RunnerOutput.num_uncomputed_tokens`); blocks allocated
  for rejected drafts stay with the request for its next drafts; units are cached only over known tokens; tokens are
  appended one at a time, so nothing past a stop or past max_tokens is kept, and drafts are scheduled only where
  max_tokens and max_model_len leave room for them and a bonus token (with `verify_decode`, max_model_len only:
  SchedulerConfig.drafts_past_max_tokens keeps a request's last steps uniform; their tokens past max_tokens are
  dropped like those past a stop, and the acceptance counters leave those drafts out).

This step is eager (the token-row forward, no CUDA graph), sync (no async scheduling), and drafts are greedy.
Under async scheduling with `verify_decode`, steady steps are pipelined instead (pipelined.py: the same step with
its counts and acceptance on the device); this path then runs only after all of them have landed.
With `verify_decode` on, a step in which every request verifies exactly k drafts after its anchor runs as k + 1
decode rows per request through the model's fixed-shape decode forward instead (verify_decode.py); the rollback
above holds unchanged (dsv4/models/verify_rows.py: the rings after such a step are the token-row path's). With
`drafter_cuda_graphs` on, the drafter's proposals replay CUDA graphs (drafter_graphs.py). `phases` (PhaseTimes,
opt-in) times the step's parts for spec_decode_speed --phase-profile.

`disable_by_batch_size` B (vLLM's): while B or more requests hold a row, no drafts are proposed, and a step with no
drafts to verify is the runner's plain step (`ModelRunner.launch_plain`: decode CUDA graphs of sizes >= B). Drafts
proposed before the batch grew are still verified (one eager step). A plain step computes the drafter's taps of its
positions too (`ModelRunner.plain_tap_ids`, beside the hidden states in its graphs' output; not under
compile_decode), so when speculation resumes the drafter reads fresh ones. `"adaptive": true` (gate.py) also turns
speculation off and on as it measures whether it pays; its plain steps run at any batch size (graphs of all sizes).

Resuming. When speculation is on again for a batch of decodes that holds no drafts (a trial of the adaptive switch,
a batch shrunk below disable_by_batch_size), its first step is the plain step (graphs), after which the drafter
proposes from the taps that step wrote and the token it sampled (on the device, as a verify step's proposal): the
step after it verifies them. Without fresh taps (compile_decode) the step is the speculative path's token-row
forward instead. Under async scheduling plain steps are pipelined like verify steps (one token a request:
`pipeline_tokens`), so speculation being off costs nothing over plain decoding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsv4.ops.host_copy import to_device, to_device_all
from dsv4.runtime.cudagraphs import default_capture_sizes
from dsv4.runtime.input_batch import InputBatch
from dsv4.runtime.sampler import SamplingTensors, needs_output_values
from dsv4.sampling_params import SamplingParams
from dsv4.spec_decode.config import SpeculativeConfig
from dsv4.spec_decode.drafter_graphs import GraphedDSparkProposer, GraphedMTPProposer, ProposalGraphs
from dsv4.spec_decode.gate import SpeculationGate
from dsv4.spec_decode.pipelined import PipelinedOutput, PipelinedVerify
from dsv4.spec_decode.proposer import DSparkProposer, MTPProposer, Proposer, TapBuffer
from dsv4.spec_decode.rejection import verify
from dsv4.spec_decode.verify_decode import VerifyDecode, verify_capture_sizes
from dsv4.step import RunnerOutput, SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    from dsv4.runtime.runner import ModelRunner, PendingOutput

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    """Acceptance counters since start (vLLM's spec_decode metrics): verify steps with at least one draft, drafts
    verified, drafts accepted, and accepted drafts per position in the block."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class PhaseTimes:
    """Opt-in wall time of the speculative step's phases (`Speculator.phases`; spec_decode_speed --phase-profile):
    prepare (request deltas, drafts into the token history, the input batch), forward (the target, taps written),
    verify (logits, acceptance, bookkeeping), propose (the drafter). Only steps that verified drafts count
    (`steps`): a prefill step's times are dropped at the next start. The device is synced at every phase end, so a
    phase holds the GPU work it launched; the syncs remove the overlap a real step has, so read the split, not the
    sum."""

    PHASES = ("prepare", "forward", "verify", "propose")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0
        self._t = 0.0
        self._step: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._t = time.perf_counter()
        self._step = {}

    def mark(self, phase: str) -> None:
        """The phase that ran since the last mark (or start) ends here; the last phase commits the step."""
        self._sync()
        now = time.perf_counter()
        self._step[phase] = now - self._t
        self._t = now
        if phase == self.PHASES[-1]:
            for p, sec in self._step.items():
                self.seconds[p] += sec
            self.steps += 1

    def per_step_ms(self) -> dict[str, float]:
        return {p: 1e3 * s / self.steps for p, s in self.seconds.items()} if self.steps else {}


class SpecOutput:
    """A step's output, already on the host (the speculative step is sync)."""

    def __init__(self, out: RunnerOutput) -> None:
        self._out = out

    def result(self) -> RunnerOutput:
        return self._out


class PlainSpecOutput:
    """A plain step's output (`ModelRunner.launch_plain`), reported as a speculative step that computed everything
    and left `num_drafts` per request (None: none; the scheduler then drops the draft counts its requests held,
    drafts proposed for positions this step decoded past)."""

    def __init__(self, pending: "PendingOutput", num_drafts: list[int] | None = None) -> None:
        self._pending, self._num_drafts = pending, num_drafts

    def result(self) -> RunnerOutput:
        out = self._pending.result()
        if out.num_draft_tokens is None:
            out.num_uncomputed_tokens = [0] * len(out.req_ids)
            out.num_draft_tokens = self._num_drafts or [0] * len(out.req_ids)
        return out


def _static_sampling(sp: SamplingParams, num_outputs: int) -> bool:
    """Sampling params whose tensors stay the same for every later token of a request with `num_outputs` outputs
    (a seed's output count is set on the device, pipelined.py): no penalty, logit bias, logprobs, grammar, or
    min_tokens ban still to lift."""
    return (sp.logprobs is None and sp.structured_outputs is None and not sp.logit_bias
            and not needs_output_values(sp) and num_outputs >= sp.min_tokens)


class Speculator:
    """Drafts per state row, the proposer and its taps, and the speculative step."""

    def __init__(self, runner: "ModelRunner", proposer: Proposer, spec: SpeculativeConfig) -> None:
        self.runner, self.proposer, self.spec = runner, proposer, spec
        self.k = spec.num_speculative_tokens
        assert 1 <= self.k <= proposer.block_size
        n = runner.config.scheduler.max_num_seqs
        self.drafts = torch.zeros(n, proposer.block_size, dtype=torch.int64, device=runner.device)
        self.taps: TapBuffer | None = None
        self.tap_layer_ids = proposer.tap_layer_ids  # the tap ring's layers, in its row layout
        if proposer.tap_layer_ids:
            dtype = runner.model.lm_head.weight.dtype
            self.taps = TapBuffer(n, runner.config.model.sliding_window, proposer.block_size + 2,
                                  proposer.tap_width, dtype, runner.device)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)
        # uniform verify steps as decode rows (spec.verify_decode)
        self.verify_decode = (VerifyDecode(runner, self.k, proposer.tap_layer_ids, proposer.tap_width)
                              if spec.verify_decode else None)
        self.num_plain_steps = 0  # steps run by ModelRunner.launch_plain (speculation disabled for the batch)
        self.num_plain_proposals = 0  # plain steps after which the drafter proposed (speculation resuming)
        # tokens a request the next step computes if the batch stays steady: k + 1 after a step that proposed
        # drafts, 1 after one that did not (`pipeline_tokens`)
        self.next_tokens = 0
        # per state row: its drafts are placeholders (a constrained request under verify_decode, `_propose`)
        self.placeholder = np.zeros(n, dtype=bool)
        self.phases: PhaseTimes | None = None  # set to measure the speculative steps' phases (PhaseTimes)
        # steady verify steps pipelined under async scheduling (pipelined.py; the scheduler's spec_pipeline_tokens)
        self.pipeline = (PipelinedVerify(self) if runner.config.scheduler.spec_pipeline_tokens
                         and self.verify_decode is not None else None)
        # speculate only while it pays (spec.adaptive, gate.py): measured step times and acceptance
        self.gate = SpeculationGate() if spec.adaptive else None

    def set_proposer(self, proposer: Proposer) -> None:
        """Swap the proposer (the oracle test hook); it must read no taps the current one does not provide."""
        assert not proposer.tap_layer_ids or self.taps is not None
        assert proposer.block_size >= self.k
        self.proposer = proposer
        if self.drafts.shape[1] < proposer.block_size:
            self.drafts = torch.zeros(self.drafts.shape[0], proposer.block_size, dtype=torch.int64,
                                      device=self.drafts.device)

    def capture_graphs(self) -> None:
        """The speculative step's CUDA graphs, each where its switch is on (no-op otherwise, and off CUDA): the
        multi-row verify forward (verify_decode.py) and the drafter's proposal (drafter_graphs.py)."""
        if self.verify_decode is not None:
            self.verify_decode.capture()
        if isinstance(self.proposer, ProposalGraphs):
            self.proposer.capture()

    def profile_forwards(self) -> None:
        """The start-up memory profile's speculative forwards: the largest multi-row verify (k + 1 rows a request
        can outgrow the plain decode) and the largest captured proposal."""
        if self.verify_decode is not None:
            self.verify_decode.dummy_forward()
        if isinstance(self.proposer, ProposalGraphs):
            self.proposer.dummy_forward()

    def pipeline_tokens(self) -> int:
        """Tokens a request of the next step if it may be pipelined (the scheduler decides the rest), else 0.
        Pipelining needs every active request's tokens decidable on the device (pipelined.py): plain greedy, or
        sampled with params that read neither the outputs nor their count. While speculation is on, the step
        computes what the last one left (k + 1 after proposals, else 1: a plain step that proposes); while it is
        off, a plain step (1), except after a pipelined verify step, whose proposals are verified synchronously
        (its counts are known on the device only)."""
        if self.pipeline is None:
            return 0
        rs = self.runner.req_state
        rows = np.array(sorted(rs.req_id_to_row.values()), dtype=np.int64)
        if not len(rows):
            return 0
        if rs.all_plain_greedy(rows):
            static = all(rs.sampling_params[row].structured_outputs is None for row in rows.tolist())
        else:
            static = all(_static_sampling(rs.sampling_params[row], int(rs.num_tokens[row] - rs.prompt_len[row]))
                         for row in rows.tolist())
        if not static:
            return 0
        if self.disabled():
            return 0 if self.pipeline.device_ahead else 1
        return self.next_tokens

    def disabled(self) -> bool:
        """Speculation is off for the current batch: disable_by_batch_size or more requests hold a row, or the
        adaptive switch (gate.py) measured that it does not pay at this batch size (or has not measured yet)."""
        limit = self.spec.disable_by_batch_size
        n = self.runner.req_state.num_active
        return (limit is not None and n >= limit) or (self.gate is not None and not self.gate.allows(n))

    # ---- one step ----------------------------------------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        if self.phases is not None:
            self.phases.mark(phase)

    def launch(self, so: SchedulerOutput) -> SpecOutput | PlainSpecOutput | PipelinedOutput:
        now = self.gate.clock() if self.gate is not None else 0.0
        if self.pipeline is not None:
            if so.pipelined and so.total_num_scheduled_tokens > len(so.num_scheduled_tokens):  # q = k + 1 a request
                if self.gate is not None:
                    self.gate.step(now, True, len(so.num_scheduled_tokens), steady=True)
                self.next_tokens = self.pipeline.q
                return self.pipeline.launch(so)
            if so.pipelined:  # a plain step pipelined: the host counts are exact (no verify step in flight)
                assert not self.pipeline.device_ahead, "a plain step pipelined after a pipelined verify step"
            else:  # a synchronous step starts from exact host counts: every pipelined step has landed
                assert not self.pipeline.in_flight, "a synchronous speculative step while a pipelined one is in flight"
                self.pipeline.device_ahead = False
        r = self.runner
        if self.phases is not None:
            self.phases.start()
        r._apply_deltas(so)
        rs = r.req_state
        decode = all(n == 1 for n in so.num_scheduled_tokens.values())
        if not any(rs.num_computed[rs.req_id_to_row[q]] + n > rs.num_tokens[rs.req_id_to_row[q]]
                   for q, n in so.num_scheduled_tokens.items()):  # no drafts to verify
            if self.disabled():
                # speculation off for the batch: the plain step (its decode CUDA graphs; it writes the drafter's
                # taps, ModelRunner.launch_plain), no drafts
                self.num_plain_steps += 1
                self.next_tokens = 1
                if self.gate is not None:
                    self.gate.step(now, False, len(so.num_scheduled_tokens), steady=decode)
                return PlainSpecOutput(r.launch_plain(so))
            if so.num_scheduled_tokens and decode and (self.taps is None or r.plain_tap_ids):
                return self._resume(so, now)
        req_ids = sorted(so.num_scheduled_tokens, key=lambda q: (so.num_scheduled_tokens[q] != 1,
                                                                   so.num_scheduled_tokens[q]))
        if not req_ids:
            return SpecOutput(RunnerOutput([], [], []))
        rows = np.array([rs.req_id_to_row[q] for q in req_ids], dtype=np.int64)
        sched = np.array([so.num_scheduled_tokens[q] for q in req_ids], dtype=np.int64)
        computed = rs.num_computed[rows].copy()
        known = rs.num_tokens[rows].copy()
        ends = computed + sched
        drafts = np.maximum(ends - known, 0)  # the scheduler's drafts: positions past the known tokens
        sample = np.nonzero(ends >= known)[0]
        assert drafts.max(initial=0) <= self.k, "more drafts scheduled than proposed"
        if self.gate is not None:  # steady: every request verifies drafts after its anchor (and a rewound token)
            self.gate.step(now, True, len(req_ids), steady=bool((drafts > 0).all() and (sched - drafts <= 2).all()))
        if drafts.any():  # the drafts become the chunks' input ids: one gather and one write for the batch
            src_rows = np.repeat(rows, drafts)
            cols = np.arange(len(src_rows)) - np.repeat(np.cumsum(drafts) - drafts, drafts)  # 0 .. d-1 per request
            dst = src_rows * rs.max_model_len + np.repeat(known, drafts) + cols
            dev = rs.token_history.device
            dst_d, src_d, cols_d = to_device_all([dst, src_rows, cols], dev)
            rs.token_history.view(-1)[dst_d] = self.drafts[src_d, cols_d]

        batch = InputBatch.prepare(r.buffers, rs.token_history, req_ids, rows, computed, sched, sample)
        image_rows = r._image_rows(batch)
        taps = dict.fromkeys(self.proposer.tap_layer_ids) if self.proposer.tap_layer_ids else None
        self._mark("prepare")
        vd = self.verify_decode
        if vd is not None and vd.uniform(batch, drafts, sample, image_rows):
            hidden = vd.forward(batch, taps)  # k + 1 decode rows per request (verify_decode.py)
        else:
            if vd is not None and drafts.any():
                vd.num_eager_steps += 1
            md = r.model_state.prepare_attn(batch, r.block_tables)
            extra = r.model_state.prepare_inputs(batch, rs)
            if image_rows is not None:
                extra["image_embeds"] = image_rows
            if taps is not None:
                extra["taps"] = taps
            hidden = r.model(batch.input_ids, md, r.kv_caches, **extra)
        if taps is not None:
            self.write_taps(torch.cat([taps[i] for i in self.proposer.tap_layer_ids], dim=-1), rows, computed, sched)
        self._mark("forward")

        uncomputed = [0] * len(req_ids)
        rs.num_computed[rows] = ends
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(req_ids)
        num_drafts = [0] * len(req_ids)
        if len(sample):
            self._verify(batch, hidden, rows, sample, drafts, known, computed, ends, sampled, logprobs, uncomputed,
                         num_drafts, req_ids)
        self.next_tokens = self.k + 1 if any(num_drafts) else 1
        return SpecOutput(RunnerOutput(req_ids, sampled, logprobs, num_uncomputed_tokens=uncomputed,
                                  num_draft_tokens=num_drafts))

    def _resume(self, so: SchedulerOutput, now: float) -> PlainSpecOutput:
        """Speculation on for a batch of decodes that holds no drafts (module docstring, "Resuming"): the plain step,
        then the drafter's proposals from its taps and sampled tokens (on the device: nothing waits for them)."""
        r = self.runner
        rs = r.req_state
        if self.gate is not None:  # counted as the trial's first step; its time is neither a plain nor a verify one
            self.gate.step(now, True, len(so.num_scheduled_tokens), steady=False)
        pending = r.launch_plain(so)
        req_ids, sample = pending.req_ids, pending.sample_rows
        srows = np.array([rs.req_id_to_row[q] for q in req_ids], dtype=np.int64)[sample]
        num_drafts = [0] * len(req_ids)
        self._propose(sample, srows, rs.num_tokens[srows] - 2, req_ids, num_drafts)
        self.num_plain_proposals += 1
        self.next_tokens = self.k + 1 if any(num_drafts) else 1
        return PlainSpecOutput(pending, num_drafts)

    def _verify(self, batch: InputBatch, hidden: torch.Tensor, rows: np.ndarray, sample: np.ndarray,
                drafts: np.ndarray, known: np.ndarray, computed: np.ndarray, ends: np.ndarray,
                sampled: list[list[int]], logprobs: list[list[TokenLogprobs] | None], uncomputed: list[int],
                num_drafts: list[int], req_ids: list[str]) -> None:
        r = self.runner
        rs = r.req_state
        qsl = batch.query_start_loc_np
        srows = rows[sample]
        ds = drafts[sample]
        # the drafts verified: a placeholder row's none (its anchor position alone decides, `_propose`)
        dv = np.where(self.placeholder[srows], 0, ds)
        # each sampling row's last d + 1 tokens: the positions that verify its drafts, then the bonus position (the
        # first dv + 1 of them)
        idx = np.concatenate([np.arange(qsl[b + 1] - d - 1, qsl[b + 1] - d + v)
                              for b, d, v in zip(sample.tolist(), ds.tolist(), dv.tolist())])
        logits = r.model.compute_logits(hidden[to_device(idx, hidden.device)])
        cu = np.zeros(len(sample) + 1, dtype=np.int64)
        np.cumsum(dv + 1, out=cu[1:])
        held = self.drafts[to_device(srows, self.drafts.device)].cpu().numpy()  # one copy, one sync
        draft_lists = [held[i, :v].tolist() for i, v in enumerate(dv.tolist())]
        if r.grammars.constrains(srows):  # constrained rows never draft: their one row is the bonus position
            last = to_device(cu[1:] - 1, logits.device)
            sub = logits[last]
            r.grammars.apply(sub, srows)
            logits[last] = sub
        st = None
        if not rs.all_plain_greedy(srows):
            st = self._sampling_tensors(srows, draft_lists)
        res = verify(logits, draft_lists, st, r.sampler.generator)

        L = rs.max_model_len
        dst: list[int] = []  # the emitted tokens' places in the token history, written at once after the loop
        emitted: list[int] = []
        for i, b in enumerate(sample.tolist()):
            row, d, j, toks = int(srows[i]), int(ds[i]), res.num_accepted[i], res.tokens[i]
            n0 = int(known[b])
            dst.extend(range(row * L + n0, row * L + n0 + len(toks)))
            emitted.extend(toks)
            rs.num_tokens[row] = n0 + len(toks)
            rs.output_ids[row].extend(toks)
            for t in toks:
                r.grammars.accept(row, t)
            if j < d:  # a rejection: the positions after the last accepted draft are computed again (docstring)
                rs.num_computed[row] = n0 + j
                uncomputed[b] = int(ends[b]) - (n0 + j)
            sampled[b] = toks
            logprobs[b] = res.logprobs[i]
            self.count_acceptance(row, int(dv[i]), j, n0)
        hist = rs.token_history
        hist.view(-1)[to_device(dst, hist.device, torch.int64)] = to_device(emitted, hist.device, torch.int64)
        self._mark("verify")
        self._propose(sample, srows, rs.num_tokens[srows] - 2, req_ids, num_drafts)
        if ds.any():  # a step that verified drafts: its phases count (a prefill's first token does not)
            self._mark("propose")

    def write_taps(self, values: torch.Tensor, rows: np.ndarray, computed: np.ndarray, sched: np.ndarray) -> None:
        """The taps [T, width] of a step's T tokens (request by request: state row rows[b] computed sched[b] positions
        from computed[b]) into the tap ring (speculative steps, and plain steps while speculation is off)."""
        if self.taps is None:
            return
        starts = np.cumsum(sched) - sched
        positions = np.repeat(computed - starts, sched) + np.arange(int(sched.sum()))
        self.taps.write(values, np.repeat(rows, sched), positions, np.repeat(computed + sched, sched))

    def count_acceptance(self, row: int, d: int, j: int, n0: int) -> None:
        """The counters of one request's verify step: d drafts verified, j accepted, n0 tokens known before it.
        They count drafts that could be emitted: not placeholders (the caller's d), and with
        SchedulerConfig.drafts_past_max_tokens a request's last step verifies drafts past its max_tokens, whose
        tokens are dropped."""
        rs = self.runner.req_state
        max_tokens = rs.sampling_params[row].max_tokens
        if max_tokens is not None:
            d = min(d, max(max_tokens - int(n0 - rs.prompt_len[row]) - 1, 0))
            j = min(j, d)
        if d and self.gate is not None:
            self.gate.accepted(j + 1)
        if d:
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += d
            stats.num_accepted_tokens += j
            for p in range(j):
                stats.num_accepted_tokens_per_pos[p] += 1

    def _propose(self, sample: np.ndarray, srows: np.ndarray, last_positions: np.ndarray, req_ids: list[str],
                 num_drafts: list[int]) -> None:
        """The next drafts of the rows that just sampled: each has committed positions .. last, its newest token at
        last + 1 (the anchor). Batches of `disable_by_batch_size` or more requests get none. Constrained rows get
        none, or with verify_decode k placeholders (`placeholder`): copies of the anchor that `_verify` never
        accepts (it verifies the row's anchor position alone), so its steps stay k + 1 tokens like its
        neighbours' and the batch a uniform multi-row decode."""
        r = self.runner
        if self.disabled():
            return
        rs = r.req_state
        free = np.array([rs.sampling_params[row].structured_outputs is None for row in srows.tolist()], dtype=bool)
        self.placeholder[srows] = ~free if self.verify_decode is not None else False
        drafting = np.ones_like(free) if self.verify_decode is not None else free
        if not drafting.any():
            return
        dev = rs.token_history.device
        # (pinned copies, device indices: after a plain step (`_resume`) nothing here waits for the device)
        rows_d, next_d, free_d, held_d = to_device_all([srows, last_positions + 1, np.flatnonzero(free),
                                                        np.flatnonzero(~free)], dev)
        anchors = rs.token_history[rows_d, next_d]
        K = self.proposer.block_size
        if free.any():
            ids = [req_ids[b] for b in sample[free].tolist()]
            rows_f, anchors_f = (rows_d, anchors) if free.all() else (rows_d[free_d], anchors[free_d])
            proposed = self.proposer.propose(ids, srows[free], last_positions[free], anchors_f, self.taps)
            self.drafts[rows_f, :K] = proposed.to(torch.int64)
        if not free.all() and self.verify_decode is not None:  # placeholders: any valid id, never accepted
            self.drafts[rows_d[held_d], :K] = anchors[held_d][:, None].to(torch.int64)
        for b in sample[drafting].tolist():
            num_drafts[b] = self.k

    def _sampling_tensors(self, srows: np.ndarray, draft_lists: list[list[int]]) -> SamplingTensors:
        """One Sampler row per verified position: position i of a request samples after its outputs and the drafts
        before i (penalties, min_tokens and seeds see them as outputs)."""
        r = self.runner
        rs = r.req_state
        params, prompts, outputs, counts = [], [], [], []
        for row, d in zip(srows.tolist(), draft_lists):
            n_out = int(rs.num_tokens[row] - rs.prompt_len[row])
            for i in range(len(d) + 1):
                params.append(rs.sampling_params[row])
                prompts.append(rs.prompt_ids[row])
                outputs.append(rs.output_ids[row] + d[:i])
                counts.append(n_out + i)
        return SamplingTensors.build(params, prompts, outputs, r.vocab_size, r.device, r.eos_token_ids,
                                     num_output_tokens=counts)


def make_speculator(runner: "ModelRunner", spec: SpeculativeConfig) -> Speculator:
    """The speculator of the checkpoint's drafter, its weights (`mtp.*`) loaded from the model directory: DSpark
    (DeepSeek-V4.1) or the MTP layer (DeepSeek-V4)."""
    from dsv4.spec_decode.dspark import load_dspark_drafter
    from dsv4.spec_decode.mtp import load_mtp_drafter

    cfg = runner.config
    model = runner.model
    sc = cfg.scheduler
    # proposals are made for at most disable_by_batch_size - 1 requests: sizes as the verify graphs' (q = 1)
    sizes = verify_capture_sizes(list(cfg.cudagraph_capture_sizes or default_capture_sizes(sc.max_num_seqs)), 1,
                                 sc.max_num_seqs, spec.disable_by_batch_size)
    enabled = runner.device.type == "cuda" and not cfg.enforce_eager and runner._graph_safe()
    paths = ("uniform steps as decode rows: verify_decode" if spec.verify_decode else "eager, no CUDA graphs",
             "as CUDA graphs: drafter_cuda_graphs" if spec.drafter_cuda_graphs else "eager")
    if spec.method == "mtp":
        k = spec.num_speculative_tokens
        mtp = load_mtp_drafter(cfg.model_dir, cfg.model, model.lm_head.weight.dtype, runner.device,
                               sc.max_model_len, k)
        logger.info("speculative decoding: MTP, %d draft(s) per step (%s; drafter %s)", k, *paths)
        args = (mtp, k, model.model.embed_tokens, model.lm_head, runner.req_state.token_history)
        speculator = Speculator(runner, MTPProposer(*args), spec)
        if spec.drafter_cuda_graphs:
            assert speculator.taps is not None
            speculator.set_proposer(GraphedMTPProposer(*args, speculator.taps, sizes, enabled))
        return speculator
    drafter = load_dspark_drafter(cfg.model_dir, cfg.model, model.lm_head.weight.dtype, runner.device,
                                  sc.max_model_len)
    logger.info("speculative decoding: DSpark, %d of %d block tokens verified per step (%s; drafter %s)",
                spec.num_speculative_tokens, drafter.dspark.block_size, *paths)
    speculator = Speculator(runner, DSparkProposer(drafter, model.model.embed, model.lm_head), spec)
    if spec.drafter_cuda_graphs:
        assert speculator.taps is not None
        speculator.set_proposer(GraphedDSparkProposer(drafter, model.model.embed, model.lm_head, speculator.taps,
                                                      sizes, enabled))
    return speculator
