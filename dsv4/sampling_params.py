"""SamplingParams, shaped like vLLM's: users bring their habits, so field names and meanings match."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_GREEDY_EPS = 1e-5
_OPTIONAL_INTS = ("max_tokens", "logprobs", "seed")  # None allowed


def is_valid_unicode(text: str) -> bool:
    """Whether `text` encodes to UTF-8: a lone surrogate (which JSON's \\u escapes and Python strings can carry)
    cannot be tokenized or echoed back, so every entry point refuses it, without quoting it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestOutputKind(IntEnum):
    """What `LLMEngine.step()` returns for a request (vLLM's names and values): CUMULATIVE, every step, all tokens
    and text so far; DELTA, every step, only what is new since the last output; FINAL_ONLY, nothing until it has
    finished, then everything (what `LLM.generate` uses: no per-step copy of growing outputs)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamsError(ValueError):
    """An invalid sampling field; the message names it."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a structure (vLLM's names): exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object=True`), a regular expression (`regex`), one of a list of strings
    (`choice`), an EBNF grammar in xgrammar's dialect (`grammar`) or an xgrammar structural tag (`structural_tag`,
    its JSON text: what the server builds for tool_choice "required" / a named function, dsv4.structured.tool_calls).
    `disable_any_whitespace`: compact JSON, no optional whitespace (`{"a":1,"b":[2]}`); by default, as in vLLM, any
    whitespace is allowed between tokens, which a model that rambles whitespace can run away in. Checked here for
    shape; the schema, regex or grammar itself is compiled, and refused if invalid, before the engine admits the
    request (dsv4.structured)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        return next(name for name in _CONSTRAINTS if _is_set(self, name))

    def validate(self) -> None:
        """Raise SamplingParamsError unless exactly one constraint is set and it has the right type."""
        given = [name for name in _CONSTRAINTS if _is_set(self, name)]
        if len(given) != 1:
            raise SamplingParamsError("structured outputs take exactly one of json, json_object, regex, choice, "
                                      f"grammar or structural_tag; got {', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError(f"structured outputs `json` must be a JSON schema (a dict or its JSON text), "
                                      f"got {type(self.json).__name__}")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured outputs `{name}` must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise SamplingParamsError("structured outputs `choice` must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c or not is_valid_unicode(c) for c in self.choice):
                raise SamplingParamsError("structured outputs `choice` entries must be non-empty, valid Unicode "
                                          "strings")


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _is_set(params: StructuredOutputsParams, name: str) -> bool:
    # json_object=False asks for nothing (vLLM counts it as set; a request saying "no" should not constrain)
    value = getattr(params, name)
    return bool(value) if name == "json_object" else value is not None


@dataclass
class SamplingParams:
    """How to sample one request. Temperature 0 (or below 1e-5) means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the output follows a JSON schema, regex, choice or grammar (dsv4.structured; needs `pip install
    # 'dsv4[structured]'`). It stops at EOS, which the grammar allows only where the structure is complete, even
    # with ignore_eos; min_tokens holds EOS back only while the grammar allows another token.
    structured_outputs: StructuredOutputsParams | None = None
    # filled in by the engine
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):  # lists (or tuples, or None); anything else is named, not iterated
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise SamplingParamsError(f"sampling parameter `{name}` must be a list, got {type(value).__name__}")
            setattr(self, name, list(value or []))
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first invalid field."""

        def bad(name: str, why: str) -> SamplingParamsError:
            value = getattr(self, name)
            shown = repr(value) if isinstance(value, (int, float, type(None))) else type(value).__name__
            return SamplingParamsError(f"sampling parameter `{name}` {why}, got {shown}")

        # the types first, so that a None or a string is named rather than failing a comparison (a TypeError)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) or value is None and name in _OPTIONAL_INTS):
                raise bad(name, "must be an integer")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("sampling parameter `stop` must be non-empty strings")
        if any(not is_valid_unicode(s) for s in self.stop):
            raise SamplingParamsError("sampling parameter `stop` must be valid Unicode text (a lone surrogate)")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("sampling parameter `stop_token_ids` must be non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if not isinstance(k, int) or k < 0 or not -100.0 <= float(v) <= 100.0:
                    raise bad("logit_bias", "must map token ids to values in [-100, 100]")
