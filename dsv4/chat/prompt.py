"""How a chat request becomes a prompt: the checkpoint's Jinja chat template, or DeepSeek's own encoder.

`ChatRenderer` is what the server (`/v1/chat/completions`, `/tokenize`) and `LLM.chat` both call. Its mode follows
vLLM's `--tokenizer-mode` names:

- "hf": the checkpoint's chat template (tokenizer_config.json `chat_template`, or chat_template.jinja), rendered with
  the request's `tools` and `chat_template_kwargs` as template variables, as transformers and vLLM do;
- "deepseek_v4" / "deepseek_v41": DeepSeek's prompt encoding (`dsv4.chat.encode_chat`) of that family;
- "auto" (the default): a chat template the checkpoint ships wins; otherwise DeepSeek's encoder of the checkpoint's
  family (V4.1 when the model config has V4.1's schedule, else V4). DeepSeek's released checkpoints ship no
  template, so they get the encoder.

For the encoder, `chat_template_kwargs` takes `thinking` (or its alias `enable_thinking`), `reasoning_effort` and
`drop_thinking`; any other key is refused (a template would ignore it, the encoder has nothing to give it to).
Image parts: the encoder may reorder a turn's tool results and drops earlier developer messages, so each image part
goes in as a unique marker text part and the images are listed in the order their markers come out of the encoder.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv4.chat.encoding import encode_chat
from dsv4.chat.tokens import Family, special_tokens
from dsv4.engine.multimodal import split_chat_images
from dsv4.tokenizer import Tokenizer, TokenizerError

TOKENIZER_MODES = ("auto", "hf", "deepseek_v4", "deepseek_v41")
# The server's --reasoning-parser / --tool-call-parser values (vLLM's names), here beside the modes they mirror.
PARSER_CHOICES = ("deepseek_v4", "deepseek_v41", "none")
_FAMILY_OF_MODE: dict[str, Family] = {"deepseek_v4": "v4", "deepseek_v41": "v41"}
_ENCODER_KWARGS = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")
_IMAGE_PART_TYPES = ("image_url", "image")


class ChatPromptError(ValueError):
    """A request the renderer cannot turn into a prompt; `param` is the request field at fault (the server's
    400 names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat request.

    text: the prompt, BOS included: tokenize it without adding special tokens.
    images: the request's images (URLs, or what an offline `image` part carries), in the order of their
        placeholders in `text`.
    thinking: the prompt ends with the think-start token, so the reply starts inside the reasoning.
    """

    text: str
    images: tuple[Any, ...]
    thinking: bool


def family_of(model_config: Any) -> Family:
    """The DeepSeek family of a ModelConfig: V4.1 configs carry their layer schedule (`v41`), V4 ones do not."""
    return "v41" if model_config.v41 is not None else "v4"


@dataclass(frozen=True)
class ChatRenderer:
    """Renders chat requests for one checkpoint. `family` is the DeepSeek family whose encoder renders, or None
    when the checkpoint's chat template does."""

    tokenizer: Tokenizer
    family: Family | None

    @classmethod
    def create(cls, tokenizer: Tokenizer, model_config: Any, mode: str = "auto") -> "ChatRenderer":
        """The renderer `mode` (TOKENIZER_MODES) picks for a checkpoint; a ValueError for an unknown mode."""
        if mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer mode {mode!r} is not one of {', '.join(TOKENIZER_MODES)}")
        if mode == "hf" or (mode == "auto" and tokenizer.chat_template is not None):
            return cls(tokenizer, None)
        return cls(tokenizer, _FAMILY_OF_MODE.get(mode) or family_of(model_config))

    @property
    def mode(self) -> str:
        """The resolved mode: "hf", "deepseek_v4" or "deepseek_v41"."""
        return "hf" if self.family is None else f"deepseek_{self.family}"

    def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
               chat_template_kwargs: dict[str, Any] | None = None, reasoning_effort: str | int | None = None,
               add_generation_prompt: bool = True) -> ChatPrompt:
        """The prompt for an OpenAI-style conversation; ChatPromptError names the field of a bad request."""
        kwargs = dict(chat_template_kwargs or {})
        if self.family is None:
            return self._render_template(list(messages), tools, kwargs, reasoning_effort, add_generation_prompt)
        return self._render_encoder(messages, self.family, tools, kwargs, reasoning_effort, add_generation_prompt)

    def _render_template(self, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                         kwargs: dict[str, Any], reasoning_effort: str | int | None,
                         add_generation_prompt: bool) -> ChatPrompt:
        clash = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
        if clash:
            raise ChatPromptError(f"chat_template_kwargs: {', '.join(map(repr, clash))} are request fields, not "
                                  "template variables", "chat_template_kwargs")
        if reasoning_effort is not None:
            kwargs["reasoning_effort"] = reasoning_effort  # a template that knows the variable reads it
        try:
            text_messages, images = split_chat_images(messages)
            text = self.tokenizer.apply_chat_template(text_messages, add_generation_prompt=add_generation_prompt,
                                                      **{**kwargs, "tools": list(tools) if tools else None})
        except (TokenizerError, ValueError) as e:
            raise ChatPromptError(str(e), "messages") from None
        # A template's thinking switch has no fixed name; the prompt's last token is what the reply continues from.
        return ChatPrompt(text, tuple(images), text.rstrip().endswith(special_tokens("v4").think_start))

    @staticmethod
    def _render_encoder(messages: Sequence[dict[str, Any]], family: Family, tools: Sequence[dict[str, Any]] | None,
                        kwargs: dict[str, Any], reasoning_effort: str | int | None,
                        add_generation_prompt: bool) -> ChatPrompt:
        unknown = sorted(set(kwargs) - set(_ENCODER_KWARGS))
        if unknown:
            raise ChatPromptError(f"chat_template_kwargs: {', '.join(map(repr, unknown))} not understood by "
                                  f"DeepSeek's prompt encoding (it takes {', '.join(_ENCODER_KWARGS)})",
                                  "chat_template_kwargs")
        thinking = _one_of(kwargs, "thinking", "enable_thinking")
        effort = _same("reasoning_effort", reasoning_effort, kwargs.get("reasoning_effort"))
        marked, images, marker = _mark_images(messages, family)
        try:
            text = encode_chat(marked, family, thinking=thinking, reasoning_effort=effort, tools=tools,
                               drop_thinking=kwargs.get("drop_thinking", True),
                               add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise ChatPromptError(str(e), _param_of(str(e))) from None
        ordered: list[Any] = []
        if images:
            placeholder = special_tokens(family).image

            def place(m: re.Match[str]) -> str:
                ordered.append(images[int(m.group(1))])
                return placeholder

            text = marker.sub(place, text)
        return ChatPrompt(text, tuple(ordered), text.endswith(special_tokens(family).think_start))


def _one_of(kwargs: dict[str, Any], name: str, alias: str) -> Any:
    """`kwargs[name]` or its alias (vLLM's and Qwen's `enable_thinking`); both given must agree."""
    return _same(f"chat_template_kwargs.{name}", kwargs.get(name), kwargs.get(alias))


def _same(name: str, first: Any, second: Any) -> Any:
    if first is not None and second is not None and first != second:
        raise ChatPromptError(f"{name} is given twice with different values ({first!r}, {second!r})",
                              name.split(".")[0])
    return first if first is not None else second


def _param_of(message: str) -> str:
    """The request field an encoder error is about, from the field path its message starts with."""
    head = re.match(r"\w+", message)
    field = head.group(0) if head else ""
    if field in ("messages", "tools", "reasoning_effort"):
        return field
    return "chat_template_kwargs"  # thinking, drop_thinking


def _mark_images(messages: Sequence[dict[str, Any]], family: Family
                 ) -> tuple[Sequence[dict[str, Any]], list[Any], re.Pattern[str]]:
    """V4.1: each image part replaced by a text part holding a marker unique to this call and the image's index;
    the images by index, and the pattern that finds the markers. V4 has no images: its messages go to the encoder
    unchanged, which refuses image parts with a message naming them."""
    nonce = secrets.token_hex(8)
    marker = re.compile(f"\x00dsv4-image-{nonce}-(\\d+)\x00")
    if special_tokens(family).image is None:
        return messages, [], marker
    images: list[Any] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PART_TYPES:
                parts.append(part)
                continue
            source = part.get("image_url") if kind == "image_url" else part.get("image")
            source = source.get("url") if isinstance(source, dict) else source
            if source is None or source == "":
                raise ChatPromptError(f"messages[{i}].content[{j}]: an image part needs its image "
                                      f"({'image_url.url' if kind == 'image_url' else 'image'})", "messages")
            parts.append({"type": "text", "text": f"\x00dsv4-image-{nonce}-{len(images)}\x00"})
            images.append(source)
        out.append({**m, "content": parts})
    return out, images, marker
