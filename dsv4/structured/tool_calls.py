"""Tool-call grammars: `tool_choice` "required" or a named function enforced on the reply, as vLLM turns them into
a structured-output constraint for its tool parsers.

`tool_call_constraint(tools, tool_choice, family)` gives the StructuredOutputsParams of a request, or None for
"auto" / "none" (free text). The constraint is an xgrammar structural tag (JSON), built here from the request's
tools so that the reply is exactly what DeepSeek's encoder writes for an assistant turn that only calls tools
(dsv4.chat.encoding `_tool_calls_block`) and what the DSML parser (dsv4.serve.parsers.tool_calls) reads back:

    \\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="get_weather">\\n
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\\n
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\\n
    </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls>                      then EOS, the end of the message

(V4.1 names the tags ` calls` / ` invoke` / ` parameter`, with the leading space.) "required": one or more calls,
each to any of the tools (one only with `parallel_tool_calls: false`); a named function: exactly one call, to it.

Parameters, per tool, follow its `parameters` JSON schema:
- in the order of the schema's `properties`, every `required` one present, the others optional, no others (as
  xgrammar's JSON-schema grammars generate objects: schema order, strict about extra properties); a tool whose
  schema lists no properties takes any parameters (or none) unless `additionalProperties` is false;
- a string parameter is written raw with `string="true"`, as the encoder writes strings: an `enum` / `const` of
  strings is one of its values, a `pattern` is a regex the whole value matches (anchors dropped), `maxLength`
  bounds its characters, a `format` (date, email, uri...) is xgrammar's own reading of it (its DeepSeek XML style
  for that one parameter, which allows one whitespace character around the tag: the parser ignores it); raw text
  cannot have both a DSML-free value and a `minLength` in xgrammar, so such a string is written as a JSON string
  with `string="false"`, which the parser reads back as the same string;
- anything else is JSON with `string="false"` (the encoder's `json.dumps`, so at most one whitespace character
  between tokens, which also keeps a model from rambling whitespace), checked against the property's schema by
  xgrammar (the tool schema's `$defs` / `definitions` go along, so local `$ref`s resolve); a property that may be
  a string or something else (no type, a type list with "string") may take either form;
- no value may contain a DSML tag opener (`<｜DSML｜`, `</｜DSML｜`), which the parser would take for a tag;
  except inside a JSON value whose schema bounds string lengths somewhere (`minLength` / `maxLength`): xgrammar
  drops length bounds where it keeps substrings out, and the schema wins there.
A tool with no parameters renders as the encoder renders an empty call (`>\\n\\n</｜DSML｜invoke>`); when every
parameter is optional the call may also leave them all out as `>\\n</｜DSML｜invoke>` (the parser reads `{}`).

Thinking: the constraint applies from the reply's first token, so the server renders a request it constrains with
thinking off (the rule of every structured chat reply here, `api_server._without_thinking`); a request that itself
asks for thinking gets a 400. Bad input (no tools, a name not in them, a name the DSML markup cannot carry) is a
ValueError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dsv4.chat.encoding import BLANK_LINE, NEWLINE
from dsv4.chat.messages import check_tools
from dsv4.chat.tokens import Family, SpecialTokens, special_tokens
from dsv4.sampling_params import StructuredOutputsParams

Format = dict[str, Any]  # one format of an xgrammar structural tag, as its JSON object

# JSON values: the encoder's `json.dumps` puts one space after ',' and ':'; allowing one whitespace character
# wherever JSON allows whitespace accepts that and compact JSON, and nothing a model could ramble on in.
MAX_JSON_WHITESPACE = 1
# Parameter names of a tool that declares no properties: what a key usually looks like, bounded so a model cannot
# spend its whole budget on one name.
FREE_NAME_REGEX = r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}"
# Characters a tool or parameter name cannot hold: the DSML attribute is `name="..."`, read up to the next quote.
_BAD_NAME_CHARS = ('"', "<", ">", "\n")
# xgrammar's JSON-schema styles that write an object as DSML parameters, by family (the tag names differ).
_XML_STYLES: dict[Family, str] = {"v4": "deepseek_xml", "v41": "deepseek_v4_1_xml"}


def tool_call_constraint(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
                         family: Family, parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The structured-output constraint that enforces `tool_choice` ("required" or {"type": "function",
    "function": {"name": ...}}) over `tools` (OpenAI's list) in `family`'s DSML; None for "auto", "none" or no
    choice. ValueError naming the problem for a choice the tools cannot satisfy."""
    tag = tool_call_structural_tag(tools, tool_choice, family, parallel_tool_calls)
    if tag is None:
        return None
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))


def tool_call_structural_tag(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
                             family: Family, parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """The xgrammar structural tag (a JSON object) of `tool_call_constraint`, or None when nothing is enforced."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = check_tools(tools) if tools is not None else ()
    if not functions:
        raise ValueError(f"tool_choice {_describe(tool_choice)} needs `tools`")
    writer = _DsmlWriter(special_tokens(family))
    if tool_choice == "required":
        one = _or([writer.invoke(f) for f in functions])
        calls = one if not parallel_tool_calls else _seq(one, {"type": "star", "content": _seq(_const(NEWLINE), one)})
    else:
        name = _named_function(tool_choice)
        function = next((f for f in functions if f["name"] == name), None)
        if function is None:
            raise ValueError(f"tool_choice names the tool {name!r}, which is not in `tools`")
        calls = writer.invoke(function)
    t = writer.tokens
    return {"type": "structural_tag",
            "format": _seq(_const(BLANK_LINE + t.tool_calls_start + NEWLINE), calls,
                           _const(NEWLINE + t.tool_calls_end))}


def _describe(tool_choice: Any) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "(a named function)"


def _named_function(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (not isinstance(tool_choice, Mapping) or tool_choice.get("type", "function") != "function"
            or not isinstance(name, str)):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    return name


# ---- structural-tag formats, as JSON objects ------------------------------------------------------------------

def _const(value: str) -> Format:
    return {"type": "const_string", "value": value}


def _seq(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def _or(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _optional(content: Format) -> Format:
    return {"type": "optional", "content": content}


class _DsmlWriter:
    """The formats of one family's DSML calls and parameters."""

    def __init__(self, tokens: SpecialTokens) -> None:
        self.tokens = tokens
        # a value holding a tag opener would be cut there by the parser
        self.excludes = ["<" + tokens.dsml, "</" + tokens.dsml]
        self.xml_style = _XML_STYLES[tokens.family]

    def invoke(self, function: Mapping[str, Any]) -> Format:
        """One call of `function`: its invoke tag, its parameters, each followed by a newline, the closing tag."""
        t = self.tokens
        name = _checked_name(function["name"], "tool")
        schema = function.get("parameters")
        return _seq(_const(f'{t.invoke_start} name="{name}">{NEWLINE}'), self._parameters(name, schema),
                    _const(t.invoke_end))

    def _parameters(self, tool: str, schema: Any) -> Format:
        empty = _const(NEWLINE)  # the encoder's rendering of a call without arguments: `>\n\n</invoke>`
        if schema is None or schema is True or (isinstance(schema, Mapping) and "properties" not in schema):
            if isinstance(schema, Mapping) and schema.get("additionalProperties") is False:
                return empty
            return _or([empty, {"type": "plus", "content": _seq(self._free_parameter(), _const(NEWLINE))}])
        if not isinstance(schema, Mapping) or not isinstance(schema["properties"], Mapping):
            raise ValueError(f"tool {tool!r}: `parameters` must be a JSON schema object with `properties`")
        properties: Mapping[str, Any] = schema["properties"]
        required = schema.get("required") or []
        missing = [r for r in required if r not in properties]
        if missing:
            raise ValueError(f"tool {tool!r}: required parameter(s) {missing} are not in its `properties`")
        if not properties:
            return empty
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        items = []
        for key, prop in properties.items():
            item = _seq(self._parameter(tool, key, prop, defs), _const(NEWLINE))
            items.append(item if key in required else _optional(item))
        if required:
            return _seq(*items)
        return _or([empty, _seq(*items)])  # all optional: the encoder's empty rendering, or any of them

    def _parameter(self, tool: str, key: str, schema: Any, defs: Mapping[str, Any]) -> Format:
        """One parameter `key` whose value follows `schema`, raw, as JSON, or either (module docstring)."""
        key = _checked_name(key, f"tool {tool!r}: parameter")
        forms = []
        raw = self._raw_parameter(key, schema)
        if raw is not None:
            forms.append(raw)
        if raw is None or _may_be_other_than_string(schema):
            forms.append(self._tagged(key, False, self._json(schema, defs)))
        return _or(forms)

    def _tagged(self, key: str, is_string: bool, value: Format) -> Format:
        t = self.tokens
        begin = f'{t.parameter_start} name="{key}" string="{"true" if is_string else "false"}">'
        if value.get("type") == "any_text":  # free text ends where its closing tag starts: a tag, for xgrammar
            return {"type": "tag", "begin": begin, "content": value, "end": t.parameter_end}
        return _seq(_const(begin), value, _const(t.parameter_end))

    def _raw_parameter(self, key: str, schema: Any) -> Format | None:
        """Parameter `key` in the raw (`string="true"`) form, or None when `schema` has no such form or raw text
        cannot follow it exactly."""
        if schema is True or schema == {}:
            return self._tagged(key, True, self._any_text(None))
        if not isinstance(schema, Mapping):
            return None
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(values, list):
            strings = [v for v in values if isinstance(v, str) and not any(x in v for x in self.excludes)]
            return self._tagged(key, True, _or([_const(v) for v in strings])) if strings else None
        kind = schema.get("type")
        if kind != "string" and not (isinstance(kind, list) and "string" in kind):
            # no type at all: a string is allowed only if nothing else constrains the value
            if kind is not None or any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "not")):
                return None
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            return self._tagged(key, True, {"type": "regex", "pattern": _full_match(pattern)})
        if "minLength" in schema or ("format" in schema and "maxLength" in schema):
            return None  # the JSON form, where xgrammar applies lengths (module docstring)
        if "format" in schema:
            return self._xml_format_string(key, schema)
        max_length = schema.get("maxLength")
        return self._tagged(key, True, self._any_text(max_length if isinstance(max_length, int) and max_length >= 0
                                                      else None))

    def _xml_format_string(self, key: str, schema: Mapping[str, Any]) -> Format:
        """A raw string with a JSON-schema `format` (date, email, uri...): xgrammar's DeepSeek XML style knows the
        formats, so the parameter is that style's one-property object (it allows one whitespace character around
        the parameter tag, which the parser ignores)."""
        one = {"type": "object", "properties": {key: {**schema, "type": "string"}}, "required": [key],
               "additionalProperties": False}
        return {"type": "json_schema", "json_schema": one, "style": self.xml_style,
                "max_whitespace_cnt": MAX_JSON_WHITESPACE, "excludes": self.excludes}

    def _any_text(self, max_chars: int | None) -> Format:
        text: Format = {"type": "any_text", "excludes": self.excludes}
        if max_chars is not None:
            text["max_chars"] = max_chars
        return text

    def _json(self, schema: Any, defs: Mapping[str, Any]) -> Format:
        if isinstance(schema, Mapping) and defs:
            schema = {**defs, **schema}  # the tool schema's definitions, so that `#/$defs/...` resolves here too
        json_format: Format = {"type": "json_schema",
                               "json_schema": schema if isinstance(schema, (Mapping, bool)) else True,
                               "style": "json", "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        if not _bounds_string_lengths(schema):  # xgrammar drops length bounds where it applies excludes
            json_format["excludes"] = self.excludes
        return json_format

    def _free_parameter(self) -> Format:
        """A parameter of a tool that declares none: any name, a raw string or any JSON value."""
        t = self.tokens
        value = _or([{"type": "tag", "begin": '" string="true">', "content": self._any_text(None),
                      "end": t.parameter_end},
                     _seq(_const('" string="false">'), self._json(True, {}), _const(t.parameter_end))])
        return _seq(_const(f'{t.parameter_start} name="'), {"type": "regex", "pattern": FREE_NAME_REGEX}, value)


def _may_be_other_than_string(schema: Any) -> bool:
    """Whether a value of `schema` may be something other than a string (then its JSON form is allowed too)."""
    if not isinstance(schema, Mapping):
        return schema is not False
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return any(not isinstance(v, str) for v in values)
    kind = schema.get("type")
    if kind == "string":
        return False
    if isinstance(kind, list):
        return any(k != "string" for k in kind)
    return True


def _bounds_string_lengths(schema: Any) -> bool:
    """Whether `schema` has a `minLength` / `maxLength` anywhere in it."""
    if isinstance(schema, Mapping):
        return "minLength" in schema or "maxLength" in schema or any(
            _bounds_string_lengths(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_bounds_string_lengths(v) for v in schema)
    return False


def _full_match(pattern: str) -> str:
    """A JSON-schema `pattern` as a regex the whole value matches (xgrammar's reading of `pattern` in JSON)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def _checked_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in _BAD_NAME_CHARS):
        raise ValueError(f"{what} name {name!r} cannot be written in a DSML tool call (it must be non-empty and "
                         "hold no quote, '<', '>' or newline)")
    return name
