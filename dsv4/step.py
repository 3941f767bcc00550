"""The contract between the scheduler and the runner: plain data, imported by both sides.

The scheduler decides; the runner executes. Neither imports the other: a `SchedulerOutput` goes one way, a
`RunnerOutput` comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption).

    `prompt_token_ids` + `output_token_ids` are all tokens known so far; the request computes from
    `num_computed_tokens`: 0, or `replay_start` after a prefix-cache hit of `replay_end` tokens. The tokens
    [replay_start, replay_end) are replayed: they rebuild the window KV, see windows that start no lower than
    replay_start, and write nothing to the prefix-cacheable groups (their cached KV is shared). (0, 0): no hit.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV group
    num_computed_tokens: int
    replay_start: int = 0
    replay_end: int = 0
    images: list[Any] | None = None  # ImageInput per image span of the prompt (dsv4.engine.multimodal)


@dataclass
class CachedRequestData:
    """Requests the runner already holds: their new blocks per KV group (None = none this step)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step: which requests run and how many tokens each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget before this step (finished, aborted or preempted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # A pipelined speculative step (Scheduler.schedule_pipelined, dsv4/spec_decode/pipelined.py): every request
    # verifies q tokens from where the device has it, which the host learns only when the step lands.
    pipelined: bool = False


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token: its own, and the top-k of the distribution it was drawn from."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RunnerOutput:
    """Per scheduled request (in `req_ids` order): the tokens sampled this step (empty for a partial prefill;
    several under speculative decoding: the accepted drafts and one token sampled by the target).

    Speculative steps only (None otherwise): `num_uncomputed_tokens`, how many of the request's scheduled tokens are
    not computed after all (rejected drafts, and a rolled-back open compressor window: the scheduler subtracts them
    from num_computed_tokens); `num_draft_tokens`, the drafts the runner now holds for the request's next step."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    num_uncomputed_tokens: list[int] | None = None
    num_draft_tokens: list[int] | None = None
