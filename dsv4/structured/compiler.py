"""Compiling StructuredOutputsParams into xgrammar grammars over the model's tokenizer, with an LRU cache.

xgrammar needs to know what every token id spells (`TokenizerInfo`): the tokenizer's vocabulary, padded to the
model's logits width (ids past the tokenizer's are never allowed), with the engine's EOS ids as the stop tokens
a grammar allows once its structure is complete. Special tokens are given an empty spelling, which xgrammar
never allows inside a structure: the detokenizer drops them from the text (skip_special_tokens), so a special
token inside a JSON string would make the text differ from what the grammar accepted.

The mapping follows vLLM's xgrammar backend: a JSON schema and json_object compile with `compile_json_schema`
(json_object as `{"type": "object"}`), any whitespace unless `disable_any_whitespace`; a regex with
`compile_regex`; an EBNF grammar with `compile_grammar`; a choice as the grammar `root ::= "a" | "b" ...`; a
structural tag with `compile_structural_tag`.

Threads: the server compiles on a worker pool (AsyncLLMEngine) while the engine thread looks grammars up, so the
cache is guarded by a lock, never held while compiling; two threads asking for one spec at once share one compile.
A grammar the engine has admitted a request with is held (`hold` / `release`) until that request ends, whatever
the LRU evicts meanwhile: the runner looks it up again at admission and after each preemption, on the engine
thread, where a recompile would stall every running request.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from dsv4.sampling_params import StructuredOutputsParams
from dsv4.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

INSTALL_HINT = "structured outputs need xgrammar: pip install 'dsv4[structured]'"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def import_xgrammar() -> "xgrammar":
    """xgrammar, imported on first use (it is an optional extra, and slow to import); ValueError if missing, so a
    request that needs it fails alone."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


def choice_as_ebnf(choice: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choice`: JSON string literals are xgrammar's EBNF string literals
    (the same escapes for quotes, backslashes and control characters)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


GrammarKey = tuple[str, str, bool]  # (kind, the spec as text, any whitespace)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """What a compiled grammar depends on, hashable: (kind, the spec as text, any whitespace). A schema dict is
    keyed by its JSON text in its own key order, which is the order the grammar generates its properties in."""
    kind = params.kind
    if kind == "json":
        try:
            spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        except (TypeError, ValueError) as e:  # a dict holding something JSON cannot spell
            raise ValueError(f"structured outputs: invalid JSON schema: {e}") from None
    elif kind == "choice":
        spec = choice_as_ebnf(params.choice)
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(params, kind)
    return kind, spec, not params.disable_any_whitespace


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and logits width. Builds nothing until the first request
    asks, so an engine without structured requests never imports xgrammar. Safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # the first compile builds the xgrammar compiler, once
        self._lock = threading.Lock()  # guards the three maps below; never held while compiling
        self._cache: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._held: dict[GrammarKey, tuple[xgrammar.CompiledGrammar, int]] = {}  # grammar, number of holders
        self._compiling: dict[GrammarKey, Future[xgrammar.CompiledGrammar]] = {}

    def compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `params` (from the cache when an equal spec was compiled recently or is held);
        ValueError naming the problem if the schema, regex or grammar is invalid or xgrammar is not installed."""
        key = grammar_key(params)
        with self._lock:
            hit = self._lookup(key)
            if hit is not None:
                return hit
            pending = self._compiling.get(key)
            if pending is None:
                pending = self._compiling[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()  # the other thread's grammar, or its ValueError
        try:
            compiled = self._compile(*key)
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._compiling[key]
            self._store(key, compiled)
        pending.set_result(compiled)
        return compiled

    def hold(self, params: StructuredOutputsParams, grammar: "xgrammar.CompiledGrammar") -> GrammarKey:
        """Keep `grammar` (compiled for `params`) until `release` of the returned key: `compile(params)` finds it
        however much was compiled meanwhile. Holds are counted: each needs its release."""
        key = grammar_key(params)
        with self._lock:
            _, holders = self._held.get(key, (grammar, 0))
            self._held[key] = (grammar, holders + 1)
            self._store(key, grammar)
        return key

    def release(self, key: GrammarKey) -> None:
        """Drop one hold of `key` (the grammar stays in the LRU cache while it has room)."""
        with self._lock:
            grammar, holders = self._held[key]
            if holders > 1:
                self._held[key] = (grammar, holders - 1)
            else:
                del self._held[key]

    @property
    def num_held(self) -> int:
        """How many specs are held (tests check that requests release theirs)."""
        with self._lock:
            return len(self._held)

    def _lookup(self, key: GrammarKey) -> "xgrammar.CompiledGrammar | None":
        held = self._held.get(key)
        if held is not None:
            return held[0]
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _store(self, key: GrammarKey, compiled: "xgrammar.CompiledGrammar") -> None:
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> "xgrammar.CompiledGrammar":
        """Compile one spec (no lock held: this is the slow part, minutes for a pathological schema)."""
        compiler = self._get_compiler()
        # compact separators: xgrammar's default without any whitespace still puts a space after ',' and ':'
        separators = None if any_whitespace else (",", ":")
        try:
            if kind == "json":
                json.loads(spec)  # Python's message for broken JSON text is clearer than xgrammar's
                return compiler.compile_json_schema(spec, any_whitespace=any_whitespace, separators=separators)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                    separators=separators)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(spec)
            return compiler.compile_grammar(spec)  # "grammar", and "choice" as its grammar
        except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError from C++, json ValueError
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                    "structural_tag": "structural tag"}.get(kind, kind)
            raise ValueError(f"structured outputs: invalid {what}: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        with self._compiler_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                # xgrammar's own cache is unbounded: ours (LRU, cache_size grammars) is the one that keeps grammars
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(xgr), max_threads=8, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self, xgr: "xgrammar") -> "xgrammar.TokenizerInfo":
        from transformers import PreTrainedTokenizerFast  # an xgrammar dependency: present whenever it is

        tok = self.tokenizer
        if self.vocab_size < tok.vocab_size:  # checked here, not at start-up: only structured requests need it
            raise ValueError(f"structured outputs: the model's vocabulary ({self.vocab_size} ids) is smaller than "
                             f"its tokenizer's ({tok.vocab_size})")
        # xgrammar reads how the vocabulary spells bytes (byte-level, byte-fallback or raw) and whether the
        # tokenizer prepends a space from the tokenizer.json it wraps; the vocabulary itself is built below
        detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                                                      vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        special = set(tok.all_special_ids)
        vocab = ["" if i in special else (tok.id_to_token(i) or "") for i in range(tok.vocab_size)]
        return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=detected.add_prefix_space)
