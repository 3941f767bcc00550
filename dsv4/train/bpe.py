"""The demo model's tokenizer: a byte-level BPE trained on the training text, built as `dsv4.make_model` builds the
engine's built-in tokenizer (the same special tokens at the same ids, the same pre-tokenizer, decoder, BOS
post-processor and tokenizer_config.json), only on another corpus and with a larger vocabulary. With make_model's
own corpus and size, `train_tokenizer` reproduces `make_model.build_tokenizer()` exactly (a test checks it), so the
two stay one recipe.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsv4.make_model import BOS, MARKER_TOKENS, SPECIAL_TOKENS, tokenizer_config


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` ids trained on `texts` (deterministic): DeepSeek's special tokens
    first (BOS 0, EOS 1, PAD 2, then the chat and reply markers, each one token), the 256 byte symbols, then
    merges; BOS added in front by the post-processor, as DeepSeek's tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + MARKER_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"the training text yields {tok.get_vocab_size()} tokens, fewer than vocab_size "
                         f"{vocab_size}: use a smaller vocabulary or more text")
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:  # the trainer makes all of them special; the reply markers must survive
        added["special"] = added["content"] not in MARKER_TOKENS  # decoding, for the reasoning/tool parsers
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def write_tokenizer(tok: Tokenizer, out_dir: str, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (make_model's fields), which the engine loads from any checkpoint."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(max_length), f, indent=2, ensure_ascii=False)
        f.write("\n")
