"""Split a DeepSeek-V4 / V4.1 reply into its reasoning (the thinking text) and its content.

In thinking mode the prompt ends with `<think>`, so the reply starts inside the reasoning, which ends at `</think>`;
in chat mode the prompt ends with `</think>` and the whole reply is content. Two leniencies, both seen from real
models: a reply that itself starts with `<think>` is thinking whatever the mode said, and a reasoning that runs
straight into a tool-call block without `</think>` ends there (the block goes to the content, for the tool-call
parser, as vLLM's deepseek_v4 reasoning parser does). A reply cut inside the reasoning (max_tokens) is all reasoning.

`ReasoningStream` does the same on a stream of text deltas and never emits part of a marker: an end of the text
that could still become `</think>` (or a block start) is held back until the next delta decides it.
"""
from dataclasses import dataclass
from enum import Enum

from dsv4.chat.tokens import Family, special_tokens
from dsv4.serve.parsers._text import cut_marker_start, find_first, partial_marker_len
from dsv4.serve.parsers.tool_calls import BLOCK_SEPARATOR


@dataclass(frozen=True)
class ReasoningDelta:
    """What one delta of the reply added to the reasoning and to the content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class _Phase(Enum):
    START = "start"  # nothing decided yet: the reply may open with <think>
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """Per-request splitter of a streamed reply: feed() each text delta, then finish() once at the end."""

    def __init__(self, family: Family, thinking: bool) -> None:
        """`thinking`: the prompt ended with `<think>`, so the reply starts inside the reasoning."""
        tokens = special_tokens(family)
        self._think_start, self._think_end = tokens.think_start, tokens.think_end
        # The separator form comes first in the text, so it is found first and its blank line leaves the reasoning.
        block = tokens.tool_calls_start
        self._end_markers = (tokens.think_end, BLOCK_SEPARATOR + block, block)
        self._thinking = thinking
        self._phase = _Phase.START
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        reasoning = ""
        while True:
            if self._phase is _Phase.START:
                if self._buf.startswith(self._think_start):
                    self._buf = self._buf[len(self._think_start):]
                    self._phase = _Phase.REASONING
                elif self._think_start.startswith(self._buf):
                    return ReasoningDelta()  # too short to tell yet
                else:
                    self._phase = _Phase.REASONING if self._thinking else _Phase.CONTENT
            elif self._phase is _Phase.CONTENT:
                content, self._buf = self._buf, ""
                return ReasoningDelta(reasoning, content)
            else:
                hit = find_first(self._buf, self._end_markers)
                if hit is None:
                    safe = len(self._buf) - partial_marker_len(self._buf, self._end_markers)
                    reasoning += self._buf[:safe]
                    self._buf = self._buf[safe:]
                    return ReasoningDelta(reasoning)
                pos, marker = hit
                reasoning += self._buf[:pos]
                # </think> is dropped; a tool-call block start stays in the text, now content.
                self._buf = self._buf[pos + len(marker):] if marker == self._think_end else self._buf[pos:]
                self._phase = _Phase.CONTENT

    def finish(self) -> ReasoningDelta:
        """The end of the reply: what was held back, less a marker the stream was cut inside."""
        tail = self._buf[:cut_marker_start(self._buf)]
        self._buf = ""
        if self._phase is _Phase.START:
            self._phase = _Phase.REASONING if self._thinking else _Phase.CONTENT
        return ReasoningDelta(reasoning=tail) if self._phase is _Phase.REASONING else ReasoningDelta(content=tail)


def split_reasoning(text: str, family: Family, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply, each None when empty; the same split as streaming it."""
    stream = ReasoningStream(family, thinking)
    parts = [stream.feed(text), stream.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    return reasoning or None, content or None
