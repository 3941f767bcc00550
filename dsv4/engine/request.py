"""Request: the scheduler's view of one generation request (tokens, progress, status)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from dsv4.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life; the FINISHED_* members say why it ended."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        """Whether this is a FINISHED_* status."""
        return self in _FINISH_REASONS


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}
FINISHED_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}  # "stop" -> FINISHED_STOPPED


@dataclass
class Request:
    """One request: its prompt, what it has generated, and how much of it the KV cache holds.

    `num_computed_tokens` counts tokens whose KV is written (or scheduled to be: the scheduler advances it when
    it schedules a step). The last sampled token is never computed yet, so a running decode needs 1 token.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # The user request this sequence samples for (the engine fans `n > 1` out into one Request per sample); the
    # "fair" scheduling policy shares running slots between groups, not sequences. "" (default): its own group.
    group_id: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens that launched steps will sample but whose values the host does not know yet. The
    # scheduler plans with num_tokens + num_output_placeholders; update_from_output turns them into tokens.
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    images: list[Any] | None = None  # ImageInput per image span of the prompt
    # Prefix caching: the prompt tokens served from the cache at first admission (-1: not admitted yet), the
    # replayed range [replay_start, replay_end) of the current admission's hit (0, 0 without one), and the
    # chained keys of the request's units (grown as tokens become known; see dsv4.kv.prefix_cache)
    num_cached_tokens: int = -1
    replay_start: int = 0
    replay_end: int = 0
    prefix_keys: list[int] = field(default_factory=list)
    # Speculative decoding: the drafts the runner holds for this request's next step (0: none; reset on preemption)
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.req_id

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended (stopped, hit a length limit, or was aborted)."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" once finished, else None."""
        return _FINISH_REASONS.get(self.status)
