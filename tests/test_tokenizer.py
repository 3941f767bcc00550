"""Tokenizer, IncrementalDetokenizer and chat templates, on the built-in byte-level BPE (checked against
transformers' fast tokenizer on the same files)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from dsv4.make_model import ASSISTANT, BOS, EOS, MARKER_TOKENS, SYSTEM, USER, write_tokenizer_files
from dsv4.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    "Hello, world! The quick brown fox.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Café naïve résumé jalapeño façade über",
    "你好，世界。今天天气很好。こんにちは",
    "emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧",
    "mixed: a😀b 你 é 1+1=2 \u0000 \U0010FFFF",
    "",
]


# A DeepSeek-style Jinja template (no tools, no thinking): the built-in tokenizer ships none (DeepSeek's prompts come
# from dsv4.chat), so the Jinja path is checked with this one. Unknown roles fail loudly through raise_exception.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{ bos_token }}{{ ns.system }}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}\n"
    "<｜User｜>{{ message['content'] }}\n"
    "{%- elif message['role'] == 'assistant' -%}\n"
    "<｜Assistant｜>{{ message['content'] }}{{ eos_token }}\n"
    "{%- elif message['role'] != 'system' -%}\n"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer_files(d)
    config_path = os.path.join(d, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({**config, "chat_template": CHAT_TEMPLATE}, f, ensure_ascii=False)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: str) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.bos_token == BOS and tok.eos_token == EOS
    assert tok.all_special_ids == [0, 1, 2, 3, 4, 5]
    assert tok.token_to_id(USER) == 3 and tok.token_to_id(ASSISTANT) == 4 and tok.token_to_id(SYSTEM) == 5
    # DeepSeek's reply markers are single tokens that decoding keeps (the reasoning and tool-call parsers read them)
    assert [tok.token_to_id(m) for m in MARKER_TOKENS] == [6, 7, 8]
    assert tok.decode([6, 7, 8]) == "".join(MARKER_TOKENS)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id] + ids  # add_bos_token: true
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == BOS + text


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_bos_flag_overrides_post_processor(tok_dir: str, tmp_path: Path) -> None:
    # add_bos_token: false must drop the BOS that tokenizer.json's post-processor would add.
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["add_bos_token"] = False
    for name in ("tokenizer.json",):
        with open(os.path.join(tok_dir, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    # With no flag at all, the post-processor decides (it adds BOS).
    del config["add_bos_token"], config["add_eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.encode("hi")[0] == tok.bos_token_id


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = [tok.bos_token_id] + tok.encode("abc", add_special_tokens=False) + [tok.token_to_id(USER), tok.eos_token_id]
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special_tokens=False) == BOS + "abc" + USER + EOS


def _detok_pieces(tok: Tokenizer, prompt_ids: list[int], out_ids: list[int], skip: bool,
                  rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    pieces, i = [], 0
    while i < len(out_ids):
        n = rng.randint(1, 3)
        pieces.append(detok.step(out_ids[i:i + n]))
        i += n
    pieces.append(detok.flush())
    assert detok.output_ids == out_ids
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_on_valid_utf8(tok: Tokenizer, text: str) -> None:
    rng = random.Random(0)
    ids = tok.encode(text, add_special_tokens=False)
    for trial in range(20):
        cut = rng.randint(0, len(ids))  # prompt/output boundary anywhere, even inside a character
        prompt, out = [tok.bos_token_id] + ids[:cut], ids[cut:]
        pieces = _detok_pieces(tok, prompt, out, skip=True, rng=rng)
        assert "".join(pieces) == tok.decode(out)
        if not tok.decode(out).count("\ufffd"):  # the output alone is valid UTF-8: no piece may be broken
            assert all("\ufffd" not in p for p in pieces), pieces


def test_emoji_over_several_byte_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀👍🏽 done", add_special_tokens=False)
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) >= 2, "the emoji should be split over byte tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=True)
    pieces = [detok.step([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "ok 😀👍🏽 done"
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces  # held back until the last byte token, then emitted whole
    assert pieces.count("") >= len(emoji_ids) - 1


def test_incremental_on_random_ids(tok: Tokenizer) -> None:
    # Random ids include specials and invalid byte sequences: the pieces must still add up to the full decode.
    rng = random.Random(1)
    for trial in range(200):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            pieces = _detok_pieces(tok, prompt, out, skip=skip, rng=rng)
            assert "".join(pieces) == tok.decode(out, skip_special_tokens=skip)
            # Only flush() may end in U+FFFD: a step never emits a dangling incomplete character.
            assert all(not p.endswith("\ufffd") for p in pieces[:-1])


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 😀"}],
    [{"role": "user", "content": "  spaces\nand newlines  "}, {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, tok_dir: str, hf_tok: Any, messages: list,
                                            add_generation_prompt: bool) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    # Also the HF class built from the tokenizer file alone, with the template and tokens passed in.
    transformers = pytest.importorskip("transformers")
    direct = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                                  chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS)
    assert ours == direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_chat_render_shape(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert text == f"{BOS}You are terse.{USER}2+2?{ASSISTANT}4{EOS}{USER}And 3+3? 😀{ASSISTANT}"
    ids = tok.encode(text, add_special_tokens=False)  # the template already holds the BOS
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[-1] == tok.token_to_id(ASSISTANT)


def test_chat_template_errors(tok: Tokenizer, tok_dir: str, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="unsupported chat role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with open(os.path.join(tok_dir, "tokenizer.json"), "rb") as f:
        (tmp_path / "tokenizer.json").write_bytes(f.read())
    bare = Tokenizer.from_dir(str(tmp_path))  # no tokenizer_config.json at all
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    # chat_template.jinja (what newer transformers write) is found too.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_sandbox(tok_dir: str, tmp_path: Path) -> None:
    with open(os.path.join(tok_dir, "tokenizer.json"), "rb") as f:
        (tmp_path / "tokenizer.json").write_bytes(f.read())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}", encoding="utf-8")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
