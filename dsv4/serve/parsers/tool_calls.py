"""Parse the DSML tool calls of a DeepSeek-V4 / V4.1 reply's content into OpenAI tool calls.

The encoder ends an assistant turn that calls tools with a blank line and a DSML block (DeepSeek's XML-like markup,
every tag starting with `<｜DSML｜` or `</｜DSML｜`); V4.1 names its tags ` calls` / ` invoke` / ` parameter`,
with the leading space, where V4 has `tool_calls` / `invoke` / `parameter`:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`ToolCallStream` is fed the content as text deltas and returns, in order, content text and `ToolCallDelta`s as the
OpenAI API streams them: a call's first delta carries its index, id and name with arguments "", later ones carry
pieces of its arguments. Arguments are streamed as soon as they are certain: a string parameter's text as it
arrives, a JSON parameter once its closing tag shows the whole value. The arguments of a complete call are a JSON
object, `string="true"` values as JSON strings and `string="false"` values as the JSON they hold, as DeepSeek's
reference decoder builds it. Decisions depend only on the text, never on where deltas split it, so the whole
reply fed at once (`parse_tool_calls`) gives what the deltas add up to.

No DSML text ever reaches the content, malformed or not; the blank line before a block is dropped too. Malformed
DSML never raises. What it becomes, like vLLM / SGLang's lenient paths and never as content:
- a DSML tag the parser does not know, or text between tags outside a parameter value: dropped;
- a call to a name not in `tool_names` (when given): dropped whole, with its parameters (SGLang refuses such calls;
  no call is better for a client than one it cannot run);
- a `string="false"` value that is not JSON: kept as a JSON string of its text (vLLM's fallback);
- a repeated parameter name: the first value is kept;
- a missing `</parameter>` or `</invoke>`: the next structural tag closes it; a missing block start before an
  invoke: implied; a missing block end: the block runs to the end of the reply;
- the reply ending inside a call (max_tokens): the call keeps exactly what was streamed, its arguments then
  incomplete JSON, as OpenAI does when max_tokens cuts a call (its finish_reason is then "length"); a tag the
  reply ends inside is dropped. Nothing is invented to complete it: a cut `write_file` must not look whole.
"""
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dsv4.chat.tokens import Family, SpecialTokens, special_tokens
from dsv4.serve.parsers._text import cut_marker_start, find_first, partial_marker_len

# The encoder separates the content from the tool-call block with a blank line; it belongs to neither.
BLOCK_SEPARATOR = "\n\n"

# A tag ends at its ">"; at a newline or "<" first, the ">" is missing and the tag ends there. An opener with none
# of the three within this many characters is no tag (tool and parameter names are far shorter).
MAX_TAG_LEN = 512
_TAG_ENDS = re.compile("[>\n<]")


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """A whole tool call; `arguments` is the JSON text of its arguments object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: its first (id and name set, arguments "") or more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """An entry of an OpenAI chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# ---- lexer: the content as text and DSML tags ----

@dataclass(frozen=True)
class _Tag:
    closing: bool
    body: str | None  # between `<｜DSML｜` and the tag's end; None: a cut or unterminated tag
    blank_line_before: bool  # the text before it ended with the block separator, taken out of that text


class _DsmlLexer:
    """Splits streamed text into text pieces and DSML tags, holding back what may still become a tag."""

    def __init__(self, dsml: str) -> None:
        self._openers = ("<" + dsml, "</" + dsml)
        self._held_markers = self._openers + tuple(BLOCK_SEPARATOR + opener for opener in self._openers)
        self._buf = ""

    def feed(self, text: str) -> list[str | _Tag]:
        self._buf += text
        out: list[str | _Tag] = []
        while True:
            hit = find_first(self._buf, self._openers)
            if hit is None:
                safe = len(self._buf) - partial_marker_len(self._buf, self._held_markers)
                self._emit_text(self._buf[:safe], out)
                self._buf = self._buf[safe:]
                return out
            pos, opener = hit
            blank = self._buf[:pos].endswith(BLOCK_SEPARATOR)
            before = pos - len(BLOCK_SEPARATOR) if blank else pos
            start = pos + len(opener)
            window = self._buf[start:start + MAX_TAG_LEN]
            end = _TAG_ENDS.search(window)
            if end is None and len(window) < MAX_TAG_LEN:
                self._emit_text(self._buf[:before], out)  # wait for the tag's end
                self._buf = self._buf[before:]
                return out
            self._emit_text(self._buf[:before], out)
            closing = opener.startswith("</")
            if end is None:  # no tag: the opener alone is dropped
                out.append(_Tag(closing, None, blank))
                self._buf = self._buf[start:]
            else:
                out.append(_Tag(closing, window[:end.start()], blank))
                self._buf = self._buf[start + end.start() + (end.group() == ">"):]

    def finish(self) -> list[str | _Tag]:
        """What was held back: text, then a tag the stream was cut inside, if any."""
        tail, self._buf = self._buf, ""
        cut = cut_marker_start(tail)
        if cut == len(tail):
            return [tail] if tail else []
        blank = tail[:cut].endswith(BLOCK_SEPARATOR)
        out: list[str | _Tag] = []
        self._emit_text(tail[:cut - len(BLOCK_SEPARATOR)] if blank else tail[:cut], out)
        out.append(_Tag(tail.startswith("</", cut), None, blank))
        return out

    @staticmethod
    def _emit_text(text: str, out: list[str | _Tag]) -> None:
        if text:
            out.append(text)


# ---- parser: tags and text to content and tool calls ----

class _Kind(Enum):
    UNKNOWN = "unknown"
    BLOCK_OPEN = "block_open"
    BLOCK_CLOSE = "block_close"
    INVOKE_OPEN = "invoke_open"
    INVOKE_CLOSE = "invoke_close"
    PARAM_OPEN = "param_open"
    PARAM_CLOSE = "param_close"


class _State(Enum):
    TEXT = "text"  # content, outside any block
    BLOCK = "block"  # in a tool-call block, between calls
    INVOKE = "invoke"  # in a call, between parameters
    PARAM = "param"  # in a parameter's value


@dataclass
class _Call:
    index: int | None  # None: a dropped call, parsed but not emitted
    n_params: int = 0
    names: set[str] = field(default_factory=set)


@dataclass
class _Param:
    name: str
    is_string: bool
    dropped: bool
    raw: list[str] = field(default_factory=list)  # a JSON value's text, emitted at its closing tag


class _TagClassifier:
    """Which DSML tag a tag body is, for one family's tag names."""

    def __init__(self, tokens: SpecialTokens) -> None:
        self._block = tokens.dsml_block
        self._invoke = re.compile(re.escape(tokens.dsml_invoke) + r'\s+name="([^"]+)"\s*')
        self._param = re.compile(re.escape(tokens.dsml_parameter) + r'\s+name="([^"]+)"\s+string="(true|false)"\s*')
        self._closers = {tokens.dsml_block: _Kind.BLOCK_CLOSE, tokens.dsml_invoke: _Kind.INVOKE_CLOSE,
                         tokens.dsml_parameter: _Kind.PARAM_CLOSE}

    def classify(self, tag: _Tag) -> tuple[_Kind, str, bool]:
        """(kind, name, is_string); name and is_string only for invoke / parameter openings."""
        if tag.body is None:
            return _Kind.UNKNOWN, "", False
        body = tag.body.rstrip()
        if tag.closing:
            return self._closers.get(body, _Kind.UNKNOWN), "", False
        if body == self._block:
            return _Kind.BLOCK_OPEN, "", False
        if m := self._invoke.fullmatch(body):
            return _Kind.INVOKE_OPEN, m.group(1), False
        if m := self._param.fullmatch(body):
            return _Kind.PARAM_OPEN, m.group(1), m.group(2) == "true"
        return _Kind.UNKNOWN, "", False


class ToolCallStream:
    """Per-request parser of a streamed reply content: feed() each content delta, then finish() once at the end.

    Both return the content text (str) and the tool-call deltas of the text in the order they appear.
    `tool_names`: the request's tool names, to drop calls to any other; None accepts every name.
    """

    def __init__(self, family: Family, tool_names: frozenset[str] | None = None,
                 make_call_id: Callable[[], str] = new_call_id) -> None:
        tokens = special_tokens(family)
        self._classifier = _TagClassifier(tokens)
        self._tool_names = tool_names
        self._make_call_id = make_call_id
        self._lexer = _DsmlLexer(tokens.dsml)
        self._state = _State.TEXT
        self._after_block = False  # whitespace right after a block is the block's, not content
        self._call: _Call | None = None
        self._param: _Param | None = None
        self.n_calls = 0  # calls emitted so far

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        return self._run(self._lexer.feed(text))

    def finish(self) -> list[str | ToolCallDelta]:
        return self._run(self._lexer.finish())

    def _run(self, pieces: list[str | _Tag]) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, str):
                self._on_text(piece, out)
            else:
                self._on_tag(piece, out)
        return _merged(out)

    def _on_text(self, text: str, out: list[str | ToolCallDelta]) -> None:
        if self._state is _State.TEXT:
            if self._after_block:
                text = text.lstrip()
                self._after_block = not text
            if text:
                out.append(text)
        elif self._state is _State.PARAM:
            param, call = self._param, self._call
            assert param is not None and call is not None
            if param.dropped or call.index is None:
                return
            if param.is_string:
                out.append(ToolCallDelta(call.index, json.dumps(text, ensure_ascii=False)[1:-1]))
            else:
                param.raw.append(text)
        # Text between tags in a block or a call is the markup's own whitespace, or stray text: never content.

    def _on_tag(self, tag: _Tag, out: list[str | ToolCallDelta]) -> None:
        if tag.blank_line_before and self._state is _State.PARAM:
            self._on_text(BLOCK_SEPARATOR, out)  # inside a value a blank line is the value's
        kind, name, is_string = self._classifier.classify(tag)
        if self._state is _State.PARAM:
            if kind is _Kind.UNKNOWN or kind is _Kind.BLOCK_OPEN:
                return
            self._close_param(out)  # any other tag ends the value, its closing tag missing or not
            if kind is _Kind.PARAM_CLOSE:
                return
        if self._state is _State.INVOKE:
            if kind is _Kind.PARAM_OPEN:
                self._open_param(name, is_string, out)
                return
            if kind not in (_Kind.INVOKE_CLOSE, _Kind.INVOKE_OPEN, _Kind.BLOCK_CLOSE):
                return
            self._close_call(out)  # an invoke or block tag ends the call, its closing tag missing or not
            if kind is _Kind.INVOKE_CLOSE:
                return
        if self._state is _State.BLOCK:
            if kind is _Kind.INVOKE_OPEN:
                self._open_call(name, out)
            elif kind is _Kind.BLOCK_CLOSE:
                self._state, self._after_block = _State.TEXT, True
            return
        if kind is _Kind.BLOCK_OPEN:
            self._state = _State.BLOCK
        elif kind is _Kind.INVOKE_OPEN:  # an invoke without its block start: the block is implied
            self._open_call(name, out)

    def _open_call(self, name: str, out: list[str | ToolCallDelta]) -> None:
        self._state = _State.INVOKE
        if self._tool_names is not None and name not in self._tool_names:
            self._call = _Call(index=None)
            return
        self._call = _Call(index=self.n_calls)
        self.n_calls += 1
        out.append(ToolCallDelta(self._call.index, "", id=self._make_call_id(), name=name))

    def _close_call(self, out: list[str | ToolCallDelta]) -> None:
        call, self._call, self._state = self._call, None, _State.BLOCK
        assert call is not None
        if call.index is not None:
            out.append(ToolCallDelta(call.index, "}" if call.n_params else "{}"))

    def _open_param(self, name: str, is_string: bool, out: list[str | ToolCallDelta]) -> None:
        call = self._call
        assert call is not None
        self._state = _State.PARAM
        self._param = _Param(name, is_string, dropped=call.index is None or name in call.names)
        call.names.add(name)
        if is_string and call.index is not None and not self._param.dropped:
            out.append(ToolCallDelta(call.index, self._key(call, name) + '"'))

    def _close_param(self, out: list[str | ToolCallDelta]) -> None:
        param, call = self._param, self._call
        assert param is not None and call is not None
        self._param, self._state = None, _State.INVOKE
        if param.dropped or call.index is None:
            return
        if param.is_string:
            out.append(ToolCallDelta(call.index, '"'))
        else:
            value = json.dumps(_json_value("".join(param.raw)), ensure_ascii=False)
            out.append(ToolCallDelta(call.index, self._key(call, param.name) + value))

    @staticmethod
    def _key(call: _Call, name: str) -> str:
        """The arguments text before a parameter's value: the object's opening or a comma, then the key."""
        call.n_params += 1
        return ("{" if call.n_params == 1 else ", ") + json.dumps(name, ensure_ascii=False) + ": "


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(raw: str) -> Any:
    """A `string="false"` value: the JSON it holds, or its text when it holds none (never NaN / Infinity)."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return raw


def _merged(out: list[str | ToolCallDelta]) -> list[str | ToolCallDelta]:
    """Runs of content, and of argument pieces of one call, joined; a call's first delta stays on its own."""
    merged: list[str | ToolCallDelta] = []
    for item in out:
        last = merged[-1] if merged else None
        if isinstance(item, str) and isinstance(last, str):
            merged[-1] = last + item
        elif (isinstance(item, ToolCallDelta) and isinstance(last, ToolCallDelta) and item.id is None
              and last.id is None and item.index == last.index):
            merged[-1] = ToolCallDelta(last.index, last.arguments + item.arguments)
        else:
            merged.append(item)
    return merged


def parse_tool_calls(content: str, family: Family, tool_names: frozenset[str] | None = None,
                     make_call_id: Callable[[], str] = new_call_id) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content without the DSML, None when empty; the tool calls) of a whole reply content."""
    stream = ToolCallStream(family, tool_names, make_call_id)
    text: list[str] = []
    calls: list[ToolCall] = []
    for item in stream.feed(content) + stream.finish():
        if isinstance(item, str):
            text.append(item)
        elif item.id is not None:
            calls.append(ToolCall(item.id, item.name or "", item.arguments))
        else:
            call = calls[item.index]
            calls[item.index] = ToolCall(call.id, call.name, call.arguments + item.arguments)
    return "".join(text) or None, tuple(calls)
