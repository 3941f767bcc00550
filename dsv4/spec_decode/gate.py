"""Speculate only while it pays: the adaptive switch (speculative config `"adaptive": true`).

Why. A speculative step costs more than a plain one (k + 1 rows through the target, the drafter, more host work):
on the H200 the 6-row verify step of V4.1-Flash-8l took 2.02x a plain step (benchmarks/results/
2026-12-02-h200-spec-decode-verify-rows), and its stored-bytes floor alone is 1.67x (results/
2026-12-04-cpu-spec-verify-floor). It pays while the tokens a step emits per request (1 + accepted drafts) exceed
that ratio. A drafter that guesses badly (prose instead of code, a random drafter) makes every step slower than plain
decoding, and the ratio grows with the batch, so the break-even batch size depends on the drafter's acceptance as
much as on the hardware. vLLM's `disable_by_batch_size` is one fixed number; this switch measures both sides instead.

What it measures, on the host clock, per batch-size bucket (request counts 1, 2-3, 4-7, ...: `bucket`):
- the seconds between the launches of consecutive steady steps (every request decoding: one token a plain step, or a
  uniform verify step) - under async scheduling that is the GPU's step time, synchronously it includes the host's
  work, which is what a user waits for either way;
- the tokens per request a verify step emitted (1 + accepted drafts), as a running mean over the last `WINDOW`
  requests' steps.
A trial turns speculation on when tokens / t_spec >= (1 + MARGIN) / t_plain for the batch's bucket, and it stays on
while tokens / t_spec >= (1 - MARGIN) / t_plain (a margin each way, so noise does not flip it; a tie goes to plain
decoding, the cheaper risk). A bucket without a plain time is first measured: `CALIBRATION_STEPS` plain steps; a
trial follows. When speculation loses, plain steps run for a backoff of `MIN_BACKOFF` steps (doubled after every
trial that loses, up to `MAX_BACKOFF`), then a trial of `TRIAL_STEPS` speculative steps measures again (the
acceptance mean restarts, so the trial judges the drafter as it is now). Plain steps keep the drafter's taps fresh
(`ModelRunner.launch_plain` writes them), so a trial's drafts are as good as if speculation had never stopped.

Cost of a drafter that never helps: the trials, one every backoff, each ended after EARLY_STEPS steps (a clear loss):
with the floor's 1.67x and the longest backoff (3 x 1.67 + 512) / 515 = 1.004x a plain step; the first trials cost
more (a backoff of 16: 1.11x).

Measured on the H200 (benchmarks/results/2026-12-05-h200-spec-pipelined, V4.1-Flash-8l, batch 1): the random drafter
went from 0.43x to 0.59x plain tokens/s, not the ~1.0x this arithmetic gives. Each trial's first speculative step
had no drafts yet and ran the eager token-row forward (tens of ms), and plain steps ran synchronously under
pipelining. Now a trial starts with the plain step (its graph) after which the drafter proposes
(speculator.py "Resuming"), and plain steps are pipelined like verify steps.

Greedy output does not depend on the switch (speculation never changes greedy tokens). Sampled requests with a seed
draw differently in speculative and plain steps, so with the switch their tokens depend on when speculation was on,
which depends on timing (as with vLLM's disable_by_batch_size, on the other requests running).
"""

from __future__ import annotations

import time
from collections.abc import Callable

WINDOW = 64  # requests' verify steps in the acceptance mean
MARGIN = 0.03  # hysteresis: a trial must win by this share of the plain rate, a running speculation lose by it
CALIBRATION_STEPS = 4  # plain steps that measure a bucket's plain step time
TRIAL_STEPS = 8  # speculative steps of a trial
# a trial that after EARLY_STEPS steps emits less than CLEAR_LOSS times plain's rate ends there: a drafter that never
# helps (0.4-0.5 on the H200) is not worth 5 more slow steps, while one near the break-even still gets the whole trial
EARLY_STEPS, CLEAR_LOSS = 3, 0.75
MIN_BACKOFF, MAX_BACKOFF = 16, 512  # plain steps before the next trial
EMA = 0.25  # weight of the newest step time in a bucket's mean


def bucket(num_reqs: int) -> int:
    """Batch sizes that share step times: 1, 2-3, 4-7, 8-15, ... (the bucket's number: num_reqs.bit_length())."""
    return num_reqs.bit_length()


class SpeculationGate:
    """Whether the next steps speculate (`allows`), from the step times (`step`) and accepted tokens (`accepted`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.plain_s: dict[int, float] = {}  # bucket -> seconds per steady plain step (EMA)
        self.spec_s: dict[int, float] = {}  # bucket -> seconds per steady speculative step (EMA)
        self.tokens = 0.0  # running mean of tokens per request per verify step (1 + accepted)
        self.samples = 0  # requests' verify steps in `tokens` (capped at WINDOW: a running mean)
        self.off_steps = 0  # plain steps left before speculation is tried again (backoff or calibration)
        self.trial = 0  # speculative steps left in the current trial (judged when it ends)
        self.backoff = MIN_BACKOFF
        self._last: tuple[float, bool, int] | None = None  # (launch time, speculative?, bucket) of a steady step
        self.num_trials = 0
        self.num_closes = 0  # times speculation was switched off by measurement

    def allows(self, num_reqs: int) -> bool:
        """Whether a step of `num_reqs` requests speculates (drafts for the next one). Stable between `step` calls."""
        return self.off_steps == 0 and bucket(num_reqs) in self.plain_s

    def accepted(self, tokens: int) -> None:
        """One request's verify step emitted `tokens` (1 + accepted drafts)."""
        self.samples = min(self.samples + 1, WINDOW)
        self.tokens += (tokens - self.tokens) / self.samples

    def step(self, now: float, speculative: bool, num_reqs: int, steady: bool) -> None:
        """A step was launched at `now` (`clock()` at the launch's start): the time since the previous launch is that
        step's cost when both were steady at the same batch size; then the switch's state advances (backoffs and
        trials count steps)."""
        b = bucket(num_reqs)
        last = self._last
        if last is not None and steady and last[2] == b:
            table = self.spec_s if last[1] else self.plain_s
            dt = now - last[0]
            table[b] = dt if b not in table else table[b] + EMA * (dt - table[b])
        self._last = (now, speculative, b) if steady else None
        if speculative:
            if self.trial > 0:
                self.trial -= 1
                if self.trial == 0:
                    self._judge(b, trial=True)
                elif TRIAL_STEPS - self.trial >= EARLY_STEPS and self.pays(b, CLEAR_LOSS) is False:
                    self.trial = 0
                    self._close(trial=True)
            else:
                self._judge(b, trial=False)
        elif self.off_steps > 0:
            self.off_steps -= 1
            if self.off_steps == 0 and b in self.plain_s:  # the backoff is over: a trial, judged afresh
                self.trial, self.samples, self.tokens = TRIAL_STEPS, 0, 0.0
                self.num_trials += 1
        if b not in self.plain_s and self.off_steps == 0:  # a bucket not yet measured: plain steps measure it
            self.off_steps = CALIBRATION_STEPS

    def pays(self, b: int, factor: float) -> bool | None:
        """Whether speculation emits at least `factor` times plain decoding's tokens per second in bucket b (None:
        not measured yet)."""
        if b not in self.plain_s or b not in self.spec_s or self.samples == 0:
            return None
        return self.tokens / self.spec_s[b] >= factor / self.plain_s[b]

    def _judge(self, b: int, trial: bool) -> None:
        pays = self.pays(b, 1.0 + MARGIN if trial else 1.0 - MARGIN)
        if pays is False:
            self._close(trial)
        elif pays and trial:
            self.backoff = MIN_BACKOFF

    def _close(self, trial: bool) -> None:
        self.off_steps = self.backoff
        self.num_closes += 1
        if trial:  # a trial lost: wait longer before the next
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)
