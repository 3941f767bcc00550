"""Tokenizer: a checkpoint's tokenizer.json (the `tokenizers` library) plus tokenizer_config.json.

No transformers dependency at run time. What it reproduces from transformers' fast tokenizer:
- special tokens named in tokenizer_config.json (`bos_token`, `eos_token`, ...; a string or an AddedToken dict);
- BOS/EOS handling: when tokenizer_config.json sets `add_bos_token` / `add_eos_token` (as Llama- and
  DeepSeek-style configs do), those flags decide, exactly as transformers rewrites the post-processor from them;
  otherwise the post-processor in tokenizer.json decides (`add_special_tokens=True` runs it);
- chat templates rendered with jinja2 in a sandbox, with the globals and options transformers gives them.
Decoding never applies `clean_up_tokenization_spaces` (DeepSeek ships it off, and it would break the rule that
incremental detokenization equals a full decode).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT = "\ufffd"
# Tokens of prompt context the incremental detokenizer decodes with the output (vLLM uses 5): enough for
# decoders whose output depends on the previous token (e.g. a Metaspace leading space).
_CONTEXT_TOKENS = 5


class TokenizerError(ValueError):
    """A tokenizer or chat template problem the user can fix (missing file, no template, bad message)."""


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore attributes so templates cannot reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set the attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does: sandboxed, trim_blocks + lstrip_blocks."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

        # Named special tokens (bos_token, eos_token, pad_token, unk_token, ...) as strings; they are also
        # the variables a chat template sees.
        self.special_tokens: dict[str, str] = {}
        for key, value in config.items():
            content = _token_content(value)
            if key.endswith("_token") and content is not None:
                self.special_tokens[key] = content
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.pad_token = self.special_tokens.get("pad_token")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)

        # None = let tokenizer.json's post-processor decide; a bool overrides it (transformers' Llama behaviour).
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.add_eos_token: bool | None = config.get("add_eos_token")

        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        specials |= set(self.special_tokens.values())
        self.all_special_ids: list[int] = sorted({i for i in map(self._id_of, specials) if i is not None})

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        """Load `<model_dir>/tokenizer.json` and (optionally) tokenizer_config.json and chat_template.jinja."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer.json in {model_dir!r} (dsv4 needs a fast tokenizer file; "
                                 f"--skip-tokenizer-init runs without one, on token ids only)")
        try:
            tok = _HFTokenizer.from_file(path)
        except Exception as e:  # the Rust error is the best description we have
            raise TokenizerError(f"cannot read {path}: {e}") from None
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(tok, config, _find_chat_template(model_dir, config))

    # ---- ids and text ------------------------------------------------------------------------
    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` tokenizer underneath, for libraries that read it (xgrammar, dsv4.structured)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of one id, or None."""
        return self._tok.id_to_token(token_id)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch of one: the same ids as encode, but the Rust side releases the GIL meanwhile (encode holds it:
        # a 10 MB prompt tokenized in a worker thread would still stall the server's event loop for seconds)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, BOS/EOS follow `add_bos_token`/`add_eos_token` when the
        config sets them, else tokenizer.json's post-processor. Special-token strings inside `text` become their
        ids either way (as in transformers)."""
        if not add_special_tokens:
            return self._encode(text, False)
        if self.add_bos_token is None and self.add_eos_token is None:
            return self._encode(text, True)
        ids = self._encode(text, False)
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if self.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 byte sequences become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the checkpoint's chat template (the text, not ids).

        The template sees `messages`, `add_generation_prompt`, `tools`/`documents` (None unless passed), the
        named special tokens (`bos_token`, `eos_token`, ...) and any extra `kwargs`. The rendered text usually
        starts with the BOS token already, so encode it with `add_special_tokens=False`."""
        if self.chat_template is None:
            raise TokenizerError(
                "this checkpoint has no chat template (no `chat_template` in tokenizer_config.json and no "
                "chat_template.jinja); use generate() with plain prompts instead of chat()"
            )
        if not isinstance(messages, list) or any(not isinstance(m, dict) for m in messages):
            raise TokenizerError("chat messages must be a list of dicts with `role` and `content`")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def _find_chat_template(model_dir: str, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json `chat_template` (a string, or a list of named templates), else the
    chat_template.jinja / chat_template.json files newer transformers versions write."""
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the "default" one is the chat template
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    json_path = os.path.join(model_dir, "chat_template.json")
    if os.path.isfile(json_path):
        with open(json_path, encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
        if isinstance(value, str):
            return value
    return None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of final text pieces (vLLM's offset scheme).

    `step()` decodes a small window `[prefix_offset, end)` of prompt-context + output tokens and returns what it
    adds beyond the already-final `[prefix_offset, read_offset)`. While the window's text ends in U+FFFD (an
    incomplete UTF-8 sequence, e.g. an emoji split over byte tokens) nothing is emitted, so a piece never holds a
    broken character. Because pieces are cut only where the decoded text ends on a complete character, the
    concatenation of all pieces plus `flush()` equals `tokenizer.decode(output_ids)` for byte-level tokenizers
    (DeepSeek's); for decoders that drop a leading space at the start of a decode (Metaspace), the prompt
    context keeps that space, as vLLM does.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        # A prompt that ends mid-character would make the first output token "complete" the context's U+FFFD and
        # shift every offset; decode without context then.
        if context and tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._num_context = len(context)
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        """The output token ids seen so far."""
        return self._ids[self._num_context:]

    def _pending(self) -> tuple[str, str]:
        prefix = self.tokenizer.decode(self._ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self._ids[self.prefix_offset:], self.skip_special_tokens)
        return prefix, full

    def step(self, new_token_ids: list[int]) -> str:
        """Add output tokens; return the newly final text (possibly "")."""
        self._ids.extend(new_token_ids)
        prefix, full = self._pending()
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """At the end of a request: return the held-back tail (it may contain U+FFFD for truly broken bytes)."""
        prefix, full = self._pending()
        piece = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += piece
        return piece
