"""Scheduler: continuous batching with chunked prefill and preemption by recomputation (vLLM V1 style).

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, decodes before prefills: every
running decode (1 token, plus the drafts it verifies under speculative decoding) takes its tokens of the budget,
in admission order; then the running prefills (admitted, prefill not complete) take chunks of what is left, in
admission order; so prefills are chunked, share steps with decodes, and never take the budget a decode needs.
Blocks are then allocated in admission order. When the KV pool runs dry, the most recently admitted running
request is preempted (never one allocated already in the step: victims come from the tail): its blocks are freed
and it returns to the front of the waiting queue, to be recomputed from scratch (prompt + tokens generated so far)
when there is room again. Then waiting requests are admitted in FIFO order while budget, sequence slots and blocks
last, each with a prefill chunk of what the budget leaves.

Mixed load (`SchedulerConfig.long_prefill_token_threshold`, `max_num_partial_prefills`,
`max_long_partial_prefills`; vLLM's names). A threshold T > 0 (given, or derived as 4% of max_model_len when
max_num_partial_prefills > 1) caps each prefill's chunk at T tokens per step, for running prefills and new
admissions alike (decodes are not capped), so a long prompt is spread over short steps instead of filling whole
ones. A prefill computing more than T tokens is "long". At every step boundary at most max_num_partial_prefills
running requests are mid-prefill, at most max_long_partial_prefills of them long: a waiting request whose prefill
would not complete in its admission step is admitted only within these limits; otherwise its group is passed over
for this step and admission goes on with the next (so a short prompt is admitted, and finishes, next to a long one
that waits or prefills). A prefill that completes in its admission step is never mid-prefill and needs no room.
At the defaults (0, 1, 1) there is no cap, a running prefill always takes what the decodes leave, so a request is
left mid-prefill only when the budget runs out on it, and nothing is passed over: scheduling is the same, step for
step, as before these options. Chunking never changes a request's greedy tokens (chunked-prefill equivalence).

Fair share between requests (`SchedulerConfig.scheduling_policy = "fair"`, the default). The engine fans a request
with `n` samples out into n sequences of one group (`Request.group_id`); FIFO over sequences would let one
request with n = 64 take every running slot, and a later short request would wait for all 64 to finish. So slots
are shared between groups, max-min fair: admission serves the waiting group with the fewest running sequences
(FIFO order on a tie, so one request alone, or requests of one sequence each, are admitted exactly as FIFO), and
when every slot is taken, or the KV pool could not hold the sequence admission wanted last step, a group running
at least two sequences more than that waiting group gives one up: its newest sequence is preempted as above (at
most one per step; each move narrows the gap, so it never thrashes). A group never loses slots that nobody else
waits for. "fcfs" is plain FIFO over sequences: every sequence its own group.

Length limits. A request's total tokens never exceed `max_len = min(max_model_len, KV capacity)`, where KV
capacity is the most tokens ONE request can hold in the empty pools. A request reaching `max_len` finishes with
"length"; a prompt of `max_len` tokens or more is rejected by `add_request` (it would leave no room for a single
generated token). So every request alone always fits the pools, the head of the running queue can always grow
by preempting the others, and a small pool cannot deadlock.

Async scheduling (`SchedulerConfig.async_scheduling`). The engine schedules and launches step k+1 before step k's
sampled tokens reach the host. A step that will sample a token for a request adds a placeholder to it
(`Request.num_output_placeholders`); the next schedule treats placeholders as known tokens (the runner reads their
values from the device history), and update_from_output replaces them with the real tokens one step later. A
request whose placeholders already reach max_tokens or the length limit is not scheduled again (it finishes when
they land); one that stops on a token computes one more token, which is discarded with the request. A preempted
request is re-admitted only once its placeholders have landed, so its new row starts from the known tokens.

Pipelined speculation (`SchedulerConfig.spec_pipeline_tokens` > 0: async scheduling with speculative decoding,
dsv4/spec_decode/pipelined.py). While the batch is steady (`can_pipeline(q)`: nobody is mid-prefill, nobody
waits unless every slot is taken and fairness would not preempt for them, every running request computes q tokens
next and has room for two more such steps), the engine schedules with `schedule_pipelined(q)` before the previous
step's tokens are known: q tokens a request, counted as computed, and q placeholders a request (at most q
tokens a step can emit) that its landing takes back. q is k + 1 for a verify step, 1 for a plain step while
speculation is off for the batch (disable_by_batch_size, the adaptive switch): the speculator says which
(`Speculator.pipeline_tokens`). The runner
computes each request's real positions on the device. When the step lands, its rejected tokens are subtracted as
usual; so num_computed_tokens runs q tokens a step in flight ahead of the device, which is never behind it: blocks
allocated for the counted positions cover the real ones. Units are cached at a landing, up to what the device has
computed by then. Every other step runs after all pipelined steps have
landed (the engine drains), with exact counts and no placeholders: the plain async rule is off under speculation.

Prefix caching with replay (runtime.md 2.2; `KVCacheManager.prefix`). A request admitted (first time or after a
preemption) looks up its longest cached prefix, H tokens; it then starts computing at `replay_start = H -
min(replay, H)`, with `replay` the KV manager's replay length (the sliding window W under bounded replay): the
tokens [replay_start, H) are computed again to rebuild the window KV, which is never cached, while their cached
KV in the prefix-cacheable groups is shared as is (the runner writes none of it). A hit shorter than the replay
replays all of it (replay_start = 0). Every step caches the units its requests' computed tokens fill.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from dsv4.config import SchedulerConfig
from dsv4.engine.request import FINISHED_STATUS, Request, RequestStatus
from dsv4.kv.manager import KVCacheManager
from dsv4.step import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = scheduler_config
        self.kv_manager = kv_manager
        self.max_len = _largest_fitting(kv_manager, scheduler_config.max_model_len)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._fair = scheduler_config.scheduling_policy == "fair"
        # Waiting requests by group: each group's queue in admission order, and the groups in arrival order; a
        # preempted request goes first in its group and its group first among the groups (under "fcfs" each
        # group is one request, so this is one FIFO queue with preempted requests in front)
        self._waiting: OrderedDict[str, deque[Request]] = OrderedDict()
        self._num_waiting = 0
        self.running: list[Request] = []  # admission order: preemption takes from the tail
        self._num_running_of: dict[str, int] = {}  # running requests per group; a group with none is absent
        # "fair": the KV pool could not hold the sequence admission wanted last step (a reason to preempt)
        self._admission_blocked = False
        # Ids the runner must forget at the start of the next step (finished, aborted, preempted).
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0  # total since start (a metric; tests check preemption really happened)
        # Mixed load: the most tokens one prefill computes per step (0: no cap), and the running requests whose
        # prefill is not complete (mid-prefill), each with whether it is long (computes more than the cap)
        self._chunk_cap = scheduler_config.prefill_chunk_cap
        self._prefilling: dict[str, bool] = {}

    # ---- requests in and out -------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request; ValueError if it could never run (duplicate id, empty or too long prompt)."""
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {req.req_id!r} has an empty prompt")
        # Room for at least one generated token is required.
        if n >= self.config.max_model_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt of {n} tokens leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        if n >= self.max_len:
            raise ValueError(
                f"request {req.req_id!r}: prompt of {n} tokens does not fit the KV cache, which holds at most "
                f"{self.max_len} tokens for one request; increase num_blocks"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        self._enqueue(req, first=False)

    def finish_requests(
        self, req_ids: Iterable[str], reason: str, stop_reason: int | str | None = None
    ) -> list[Request]:
        """End unfinished requests with `reason` ("stop", "length" or "abort"); unknown ids are ignored.

        The engine calls this for stop strings (found after detokenizing) and client aborts.
        """
        status = FINISHED_STATUS[reason]
        finished = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                self._finish(req, status, stop_reason)
                finished.append(req)
        return finished

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Abort requests wherever they are (waiting or running), freeing their blocks."""
        return self.finish_requests(req_ids, "abort")

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.requests)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks and a runner row."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission, preempted ones included."""
        return self._num_waiting

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests, group after group in queue order (a snapshot, for inspection)."""
        return [req for queue in self._waiting.values() for req in queue]

    # ---- one step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV blocks."""
        cfg = self.config
        cap = self._chunk_cap
        budget = cfg.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted = False

        # Before anything is scheduled (a victim must not have been): give a waiting group its fair share
        if self._fair and self._waiting and (len(self.running) >= cfg.max_num_seqs or self._admission_blocked):
            self._preempt_for_fairness()
        self._admission_blocked = False

        # Running requests: they already hold blocks and a runner row. Their token counts are planned first,
        # decodes before prefills (so a prefill never takes the budget a decode needs), each kind in running order...
        prefilling = self._prefilling
        plan: dict[str, int] = {}
        for decodes in (True, False) if prefilling else (True,):  # (with no prefill running, one pass does)
            for req in self.running:
                if budget <= 0:
                    break
                if (req.req_id in prefilling) == decodes:
                    continue
                todo = self._num_planned(req) - req.num_computed_tokens
                n = min(todo, budget) if decodes or not cap else min(todo, cap, budget)
                if req.num_draft_tokens and n == todo:  # speculative decoding: verify drafts after the known tokens
                    n += self._num_drafts_to_verify(req, budget - n)
                # nothing to compute (the runner sampled nothing last step; never schedule 0 tokens), or in-flight
                # tokens will end the request by length: computing past them would be wasted (or past max_len)
                if n <= 0 or self._ends_by_length_in_flight(req):
                    continue
                plan[req.req_id] = n
                budget -= n
        # ... then their blocks are allocated in running order: a request that finds the pool dry preempts the most
        # recently admitted running request, which is never one allocated already in this step (victims come from
        # the tail; a victim's planned tokens go unused: a step that had to preempt admits nobody)
        num_scheduled: dict[str, int] = {}
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = plan.get(req.req_id, 0)
            if n == 0:
                i += 1
                continue
            while (new_blocks := self.kv_manager.allocate_slots(req.req_id, req.num_computed_tokens + n,
                                                                 req.num_computed_tokens)) is None:
                victim = self.running.pop()  # always at index >= i: not allocated yet this step
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                break  # req preempted itself; everything after it already was
            cached.req_ids.append(req.req_id)
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.req_id] = n
            # As vLLM: count the tokens as computed now, so the next schedule() sees where each request will be
            # (a request scheduled here is never preempted later in this step: victims come from the tail).
            req.num_computed_tokens += n
            self._cache_blocks(req)
            self._add_placeholder(req)
            self._note_prefill_progress(req)
            i += 1
        budget = cfg.max_num_batched_tokens - sum(num_scheduled.values())

        # Waiting requests, FIFO (by group under "fair"), without preempting anyone; not at all in a step that had
        # to preempt for blocks (as vLLM: the pool is short). A request whose prefill would stay partial after this
        # step is admitted only while fewer than max_num_partial_prefills requests are mid-prefill (and, if it is
        # long, fewer than max_long_partial_prefills long ones): otherwise its group is passed over in this step and
        # the next one is considered, so short prompts get past a long one that must wait.
        passed_over: set[str] = set()
        while (
            not preempted and self._waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            group = self._next_group(passed_over)
            if group is None:
                break
            req = self._waiting[group][0]
            if req.num_output_placeholders or req.req_id in self._finished_ids:
                # preempted while a step sampled for it: re-admit once that token has landed; or preempted by this
                # schedule (for fairness): the runner drops its row in this step, it comes back in the next
                break
            assert req.num_computed_tokens == 0, "a waiting request holds no KV"
            kv = self.kv_manager
            hit = kv.find_prefix(req.prefix_keys, req.all_token_ids, req.images) if kv.prefix is not None else []
            hit_tokens = len(hit) * kv.prefix.unit_tokens if hit else 0
            start = hit_tokens - min(kv.replay_tokens, hit_tokens)
            todo = req.num_tokens - start
            long = 0 < cap < todo
            n = min(todo, cap, budget) if cap else min(todo, budget)
            if n < todo and not self._partial_prefill_room(long):
                passed_over.add(group)
                continue
            if (kv.allocate_with_prefix(req.req_id, hit, start, start + n) if hit
                    else kv.allocate_slots(req.req_id, n, 0)) is None:
                self._admission_blocked = True
                break  # FIFO: later requests wait behind the head rather than overtake it
            self._dequeue(group)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._num_running_of[group] = self._num_running_of.get(group, 0) + 1
            req.num_computed_tokens, req.replay_start, req.replay_end = start, start, hit_tokens
            if req.num_cached_tokens < 0:  # reported once: the first admission's hit
                req.num_cached_tokens = hit_tokens
            if kv.prefix is not None:
                kv.prefix.queries += req.num_tokens
                kv.prefix.hits += hit_tokens
            new_reqs.append(NewRequestData(
                req_id=req.req_id,
                prompt_token_ids=list(req.prompt_token_ids),
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                block_ids=kv.get_block_ids(req.req_id),
                num_computed_tokens=start,
                replay_start=start,
                replay_end=hit_tokens,
                images=req.images,
            ))
            num_scheduled[req.req_id] = n
            req.num_computed_tokens += n
            self._cache_blocks(req)
            self._add_placeholder(req)
            if n < todo:
                self._prefilling[req.req_id] = long
            budget -= n

        finished, self._finished_ids = self._finished_ids, set()
        assert not (self.config.spec_pipeline_tokens and any(r.num_output_placeholders for r in self.running)), \
            "a speculative step scheduled while a pipelined one is in flight"
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=finished,
        )

    # ---- pipelined speculation -------------------------------------------------------------------------------

    def can_pipeline(self, q: int) -> bool:
        """Whether the next step may be a pipelined speculative one of q tokens a request (module docstring):
        something runs, nobody is mid-prefill or would be admitted, and every running request computes q tokens next
        (its known tokens and drafts, or a pipelined step is in flight for it, whose tokens the speculator knows the
        count of), has room for two more steps of q within max_len (the counted tokens include the steps in flight;
        a step writes its drafts and bonus token up to q positions past them, never past max_len) and its blocks for
        q more tokens are free without preempting anyone."""
        if not self.config.spec_pipeline_tokens or not self.running or self._prefilling:
            return False
        # a waiting request would be admitted now, or would take a slot by fairness: a synchronous step
        if self._num_waiting and (len(self.running) < self.config.max_num_seqs
                                  or (self._fair and self._fairness_victim() is not None)):
            return False
        for req in self.running:
            if not req.num_output_placeholders and req.num_tokens - req.num_computed_tokens + req.num_draft_tokens != q:
                return False
            if req.num_tokens + req.num_output_placeholders + 2 * q + 1 > self.max_len:
                return False
        return self.kv_manager.can_grow({r.req_id: r.num_computed_tokens + q for r in self.running})

    def schedule_pipelined(self, q: int) -> SchedulerOutput:
        """A pipelined speculative step (after `can_pipeline(q)`): q tokens for every running request, its blocks
        allocated, q placeholders added; no admission, no preemption, no prefix caching (that waits for the landing)."""
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for req in self.running:
            # the device may be up to the in-flight steps' q behind the counted positions: window blocks are freed
            # only behind what it has surely computed (num_computed_tokens - placeholders)
            new_blocks = self.kv_manager.allocate_slots(req.req_id, req.num_computed_tokens + q,
                                                        req.num_computed_tokens - req.num_output_placeholders)
            assert new_blocks is not None, "can_pipeline promised the blocks"
            cached.req_ids.append(req.req_id)
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_scheduled[req.req_id] = q
            req.num_computed_tokens += q
            req.num_output_placeholders += q
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens=num_scheduled,
                               total_num_scheduled_tokens=q * len(num_scheduled), finished_req_ids=finished,
                               pipelined=True)

    @property
    def num_partial_prefills(self) -> int:
        """Running requests whose prefill is not complete (after the last schedule(): mid-prefill)."""
        return len(self._prefilling)

    @property
    def num_long_partial_prefills(self) -> int:
        """Those of them whose prefill computes more than the chunk cap (long_prefill_token_threshold) tokens."""
        return sum(self._prefilling.values())

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Append sampled tokens, apply token-level stops and length limits; returns the requests that changed."""
        changed = []
        spec = runner_output.num_uncomputed_tokens is not None
        pipelined = scheduler_output.pipelined
        for i, (req_id, tokens) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            req = self.requests.get(req_id)
            if req is not None and spec:
                # rejected drafts (and a rolled-back compressor window) are computed again later; the drafts the
                # runner proposed are verified next step
                assert runner_output.num_draft_tokens is not None
                req.num_computed_tokens -= runner_output.num_uncomputed_tokens[i]
                req.num_draft_tokens = runner_output.num_draft_tokens[i]
                if pipelined:  # the step's placeholders go; what the device has computed is final: cache it
                    req.num_output_placeholders -= scheduler_output.num_scheduled_tokens[req_id]
                    assert req.num_output_placeholders >= 0, f"{req_id}: a pipelined step landed twice"
                    self._cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)
            if not tokens or req is None:  # a partial prefill, or aborted after it was scheduled
                continue
            assert req_id in scheduler_output.num_scheduled_tokens, f"{req_id} sampled but was not scheduled"
            if self.config.async_scheduling and not self.config.spec_pipeline_tokens:
                # later steps may already be scheduled past these tokens (or the request preempted since)
                req.num_output_placeholders -= len(tokens)
                assert req.num_output_placeholders >= 0, f"{req_id}: more tokens than placeholders"
            elif not pipelined:  # a speculative step also computed the drafts it accepted (all but the newest token)
                assert req.num_computed_tokens <= req.num_tokens + len(tokens) - 1 and (
                    spec or req.num_computed_tokens == req.num_tokens), f"{req_id} sampled before its prefill completed"
            for token in tokens:
                req.output_token_ids.append(token)
                stop = self._check_stop(req)
                if stop is not None:
                    self._finish(req, *stop)
                    break  # tokens past a stop are dropped
            changed.append(req)
        return changed

    # ---- internals -------------------------------------------------------------------------------------------

    def _group(self, req: Request) -> str:
        return req.group_id if self._fair else req.req_id

    def _enqueue(self, req: Request, first: bool) -> None:
        group = self._group(req)
        queue = self._waiting.get(group)
        if queue is None:
            queue = self._waiting[group] = deque()
        if first:
            queue.appendleft(req)
            self._waiting.move_to_end(group, last=False)
        else:
            queue.append(req)
        self._num_waiting += 1

    def _dequeue(self, group: str, req: Request | None = None) -> None:
        # the head of `group`'s queue, or `req` wherever it is in it
        queue = self._waiting[group]
        if req is None:
            queue.popleft()
        else:
            queue.remove(req)
        if not queue:
            del self._waiting[group]
        self._num_waiting -= 1

    def _next_group(self, passed_over: set[str] | None = None) -> str | None:
        """The waiting group admission serves next: the one with the fewest running requests, the first in queue
        order on a tie (under "fcfs", or with one waiting group, the first); groups in `passed_over` are left out
        (None: no other group waits). The groups scanned before one with none running all hold a slot (or were
        passed over), so this looks at max_num_seqs groups (plus those passed over) at most."""
        running = self._num_running_of
        best, fewest = None, -1
        for group in self._waiting:
            if passed_over and group in passed_over:
                continue
            n = running.get(group, 0)
            if n == 0:
                return group
            if fewest < 0 or n < fewest:
                best, fewest = group, n
        return best

    def _preempt_for_fairness(self) -> None:
        victim = self._fairness_victim()
        if victim is not None:
            self.running.remove(victim)
            self._preempt(victim)

    def _fairness_victim(self) -> Request | None:
        # A slot (or blocks) for the group admission serves next, taken from the group running the most if that
        # one would still run at least as many: its newest request (the least progress to recompute), or None.
        group = self._next_group()
        assert group is not None  # something waits
        head = self._waiting[group][0]
        if head.num_output_placeholders:
            return None  # not admissible this step anyway (a preempted request waiting for its in-flight token)
        long = 0 < self._chunk_cap < head.num_tokens  # (a prefix hit could make it short: then it waits a bit)
        if long and not self._partial_prefill_room(long):
            return None  # not admissible this step either: no room for another long partial prefill (no thrashing)
        running = self._num_running_of
        if not running:
            return None  # blocked last step, but every running request has finished since
        richest = max(running, key=running.__getitem__)  # <= max_num_seqs groups
        if running[richest] <= running.get(group, 0) + 1:
            return None
        return next(r for r in reversed(self.running) if r.group_id == richest)

    @staticmethod
    def _num_planned(req: Request) -> int:
        # tokens the next step may compute up to: the known ones plus those in-flight steps will sample
        return req.num_tokens + req.num_output_placeholders

    def _partial_prefill_room(self, long: bool) -> bool:
        # whether one more request may be left mid-prefill by this step (a long one counts against both limits)
        cfg = self.config
        return len(self._prefilling) < cfg.max_num_partial_prefills and (
            not long or self.num_long_partial_prefills < cfg.max_long_partial_prefills)

    def _note_prefill_progress(self, req: Request) -> None:
        # a running prefill whose last chunk was just scheduled is mid-prefill no more: from now on it decodes
        if req.req_id in self._prefilling and req.num_computed_tokens >= req.num_tokens:
            del self._prefilling[req.req_id]

    def _cache_blocks(self, req: Request, computed: int | None = None) -> None:
        # the units this step fills become hits for later requests: their KV is written by this step, which runs
        # before any step that reads it (a request admitted in this same step reads them after this step's
        # writes too: every layer writes its step's KV before it attends). `computed`: the tokens computed for
        # certain, when num_computed_tokens counts pipelined steps still in flight
        kv = self.kv_manager
        if kv.prefix is None:
            return
        computed = req.num_computed_tokens if computed is None else computed
        n = min(computed, req.num_tokens)  # placeholders' values are unknown: not hashable
        if n // kv.prefix.unit_tokens > kv.num_cached_units(req.req_id):
            kv.cache_blocks(req.req_id, req.prefix_keys, req.all_token_ids, req.images, n)

    def _add_placeholder(self, req: Request) -> None:
        # async: a chunk that reaches the request's last planned token makes the runner sample one more (not under
        # speculation: its non-pipelined steps run with nothing in flight)
        if (self.config.async_scheduling and not self.config.spec_pipeline_tokens
                and req.num_computed_tokens == self._num_planned(req)):
            req.num_output_placeholders += 1

    def _num_drafts_to_verify(self, req: Request, room: int) -> int:
        # the drafts the runner holds, as many as the token budget takes and as leave room for the token sampled
        # after them within max_tokens and the length limit (a draft past either could never be emitted)
        d = min(req.num_draft_tokens, room, self.max_len - req.num_tokens - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and not self.config.drafts_past_max_tokens:
            d = min(d, max_tokens - req.num_output_tokens - 1)
        return max(d, 0)

    def _ends_by_length_in_flight(self, req: Request) -> bool:
        # the tokens still in flight end the request with "length" whatever their values
        p = req.num_output_placeholders
        if p == 0:
            return False
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and req.num_output_tokens + p >= max_tokens)
                or req.num_tokens + p >= self.max_len)

    def _check_stop(self, req: Request) -> tuple[RequestStatus, int | None] | None:
        # Called after each appended token: (status, stop_reason) if the request must end now.
        sp = req.sampling_params
        out = req.output_token_ids
        num_out = len(out)  # req.num_output_tokens, without the property calls (this runs per token)
        token = out[-1]
        if sp.structured_outputs is not None and token in req.eos_token_ids:
            # a grammar allows EOS only where its structure is complete: its end is the end, whatever min_tokens
            # and ignore_eos say (past it the grammar allows nothing)
            return RequestStatus.FINISHED_STOPPED, None
        if num_out >= sp.min_tokens:
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
        if sp.max_tokens is not None and num_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if len(req.prompt_token_ids) + num_out >= self.max_len:  # req.num_tokens
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def _preempt(self, req: Request) -> None:
        # Recompute later from scratch: drop its KV, put it first in line, and tell the runner to drop its row.
        # (The caller has taken it out of self.running.)
        self._uncount_running(req)
        self.kv_manager.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = req.replay_start = req.replay_end = 0
        req.num_draft_tokens = 0  # the runner drops its row, drafts included
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, first=True)
        self._finished_ids.add(req.req_id)

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._uncount_running(req)
        else:
            self._dequeue(self._group(req), req)
        req.status = status
        req.stop_reason = stop_reason
        self.kv_manager.free(req.req_id)
        del self.requests[req.req_id]
        self._finished_ids.add(req.req_id)

    def _uncount_running(self, req: Request) -> None:
        self._prefilling.pop(req.req_id, None)
        group = self._group(req)
        n = self._num_running_of[group] - 1
        if n:
            self._num_running_of[group] = n
        else:
            del self._num_running_of[group]


def _largest_fitting(kv_manager: KVCacheManager, upper: int) -> int:
    """The largest token count <= `upper` that one request can hold in the empty pools (binary search)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_manager.can_fit(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
