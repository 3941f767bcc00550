"""The special token strings of DeepSeek-V4 and V4.1 prompts and replies, one frozen table per family.

The prompt encoder (`dsv4.chat.encoding`), the tokenizer and the reply parsers (reasoning, DSML tool calls) all
need the same strings; they read them from here so that a change is made once. The strings are those of DeepSeek's
reference encoders (`encoding/encoding_dsv4.py`, `encoding/encoding_dsv41.py` in the model repos). The `｜` in them
is U+FF5C (FULLWIDTH VERTICAL LINE) and the `▁` in BOS/EOS is U+2581, not ASCII.

Families: "v4" is DeepSeek-V4 (Flash, Pro); "v41" is DeepSeek-V4.1. V4.1 adds a system token and an image
placeholder, and renames the DSML tags (each V4.1 tag name starts with a space: `<｜DSML｜ calls>`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["v4", "v41"]
FAMILIES: tuple[Family, ...] = ("v4", "v41")


@dataclass(frozen=True)
class SpecialTokens:
    """One family's special strings. Fields a family does not have are None."""

    family: Family
    bos: str
    eos: str
    user: str
    assistant: str
    # V4.1 opens a system message with it; V4 has no system token (a system prompt is bare text after BOS).
    system: str | None
    think_start: str
    think_end: str
    # DSML, DeepSeek's XML-like tool-call markup: every tag is `<` or `</`, then `dsml`, then a tag name.
    dsml: str
    dsml_block: str
    dsml_invoke: str
    dsml_parameter: str
    # A tool's output goes back to the model inside these plain-text (not special-token) tags.
    tool_result_start: str
    tool_result_end: str
    # One per image in a V4.1 prompt; the engine expands it to the image's embedding positions.
    image: str | None

    @property
    def tool_calls_start(self) -> str:
        return f"<{self.dsml}{self.dsml_block}>"

    @property
    def tool_calls_end(self) -> str:
        return f"</{self.dsml}{self.dsml_block}>"

    @property
    def invoke_start(self) -> str:
        """The start of an invoke tag, up to where its ` name="..."` attribute begins."""
        return f"<{self.dsml}{self.dsml_invoke}"

    @property
    def invoke_end(self) -> str:
        return f"</{self.dsml}{self.dsml_invoke}>"

    @property
    def parameter_start(self) -> str:
        """The start of a parameter tag, up to where its ` name="..." string="..."` attributes begin."""
        return f"<{self.dsml}{self.dsml_parameter}"

    @property
    def parameter_end(self) -> str:
        return f"</{self.dsml}{self.dsml_parameter}>"


_V4 = SpecialTokens(
    family="v4",
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    user="<｜User｜>",
    assistant="<｜Assistant｜>",
    system=None,
    think_start="<think>",
    think_end="</think>",
    dsml="｜DSML｜",
    dsml_block="tool_calls",
    dsml_invoke="invoke",
    dsml_parameter="parameter",
    tool_result_start="<tool_result>",
    tool_result_end="</tool_result>",
    image=None,
)

# The encoder looks the table up on every call (never caches it), so a test can plant a change here.
TOKENS: dict[str, SpecialTokens] = {
    "v4": _V4,
    "v41": SpecialTokens(
        family="v41",
        bos=_V4.bos,
        eos=_V4.eos,
        user=_V4.user,
        assistant=_V4.assistant,
        system="<｜System｜>",
        think_start=_V4.think_start,
        think_end=_V4.think_end,
        dsml=_V4.dsml,
        dsml_block=" calls",
        dsml_invoke=" invoke",
        dsml_parameter=" parameter",
        tool_result_start=_V4.tool_result_start,
        tool_result_end=_V4.tool_result_end,
        image="<｜deepseek_image｜>",
    ),
}


def special_tokens(family: str) -> SpecialTokens:
    """The special strings of `family` ("v4" or "v41"); a ValueError names the known families otherwise."""
    try:
        return TOKENS[family]
    except (KeyError, TypeError):  # TypeError: an unhashable family such as a list
        raise ValueError(f"unknown model family {family!r} (known: {', '.join(FAMILIES)})") from None
