"""Write random-weight DeepSeek-V4/V4.1 checkpoints (`dsv4 make-model`) and the cached built-in default model.

A checkpoint here is what a real one ships: config.json, model.safetensors (HF DeepseekV4ForCausalLM names for V4;
the layout HF-V41 saves for V4.1, with a composite config.json), tokenizer.json, tokenizer_config.json (with a
DeepSeek-style chat template) and generation_config.json.
Everything is deterministic given the seed, so tests and `dsv4 generate` need no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsv4.models.config import parse_config_dict
from dsv4.models.presets import TOKENIZER_VOCAB_SIZE, preset_config, text_config, v4_tensor_shapes, v41_tensor_shapes

# Bump when anything make_model writes changes, so cached default models are rebuilt.
FORMAT_VERSION = 1
DEFAULT_PRESET = "tiny-v4"

# DeepSeek-V3/V4 special tokens, at DeepSeek's ids 0/1/2 (config bos_token_id 0, eos_token_id 1).
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT]

# DeepSeek's format without tools or thinking: BOS, the system prompt, then User/Assistant turns; an assistant
# turn ends with EOS. Unknown roles fail loudly through raise_exception.
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

# The tokenizer's training text: plain English with some punctuation, digits, whitespace runs, accents and CJK,
# so merges cover common words while rarer scripts fall back to byte tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the forest.
A small language model reads one token at a time. It keeps a cache of keys and values for every layer, so
that the next token costs little more than the last one. When the cache is full, old blocks are evicted and
new requests take their place.

Once upon a time there was a little robot who wanted to learn how to write stories. Every morning it read a
book from the library, and every evening it wrote a short paragraph about what it had learned. Some days the
stories were funny, some days they were sad, but they were always its own.

Inference engines schedule requests in batches. A request starts with a prompt, which is processed in one or
more chunks (prefill), and then produces new tokens one step after another (decode). The scheduler decides
how many tokens each request may run in a step, and the runner executes the model on the whole batch.

Questions and answers: What is the capital of France? Paris is the capital of France. How many days are in a
week? There are 7 days in a week, 12 months in a year, and 365 or 366 days in a year. What is 2 + 2? It is 4.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

Café, naïve, résumé, jalapeño, über, façade. 你好，世界。今天天气很好。 こんにちは。 Привет, мир!
"""


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """Train the built-in byte-level BPE (deterministic): special tokens first, then the 256 byte symbols, then
    merges. Byte-level, so any UTF-8 text encodes; a BOS is added by the post-processor, as DeepSeek's does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Several copies make every pair frequent enough that merge order depends on counts, not just on ties.
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built-in corpus yields {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json for the built-in tokenizer (DeepSeek's fields, minus the Llama class)."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        # The generic fast class: transformers loads tokenizer.json as is (a Llama class would rebuild it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(out_dir: str, max_length: int = 1024) -> None:
    """Write the built-in tokenizer.json and tokenizer_config.json to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(max_length))


def random_weights(config: dict, seed: int = 0, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Random tensors for every name of `v4_tensor_shapes` (or `v41_tensor_shapes` for a V4.1 config), drawn in
    that order from one seeded generator.

    V4: linear weights (and the mHC fn) ~ N(0, 0.02); norms and mHC scales = 1; sinks, position biases and mHC
    bases ~ 0.5 N(0, 1) and the router bias ~ 0.1 N(0, 1), so none of them is zero and every code path matters;
    `tid2eid` rows are distinct random experts. V4.1: see `_init_v41`."""
    cfg = parse_config_dict(config)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    if cfg.v41 is not None:
        for name, (shape, disk_dtype) in v41_tensor_shapes(cfg, dtype).items():
            out[name] = _init_v41(name, shape, gen).to(disk_dtype).contiguous()
        return out
    for name, (shape, disk_dtype) in v4_tensor_shapes(cfg, dtype).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            t = torch.rand((shape[0], cfg.n_routed_experts), generator=gen).argsort(dim=1)[:, : shape[1]]
        elif "norm" in name or leaf in ("scale", "hc_scale"):
            t = torch.ones(shape)
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif leaf == "e_score_correction_bias":
            t = torch.randn(shape, generator=gen) * 0.1
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        out[name] = t.to(disk_dtype).contiguous()
    return out


def _init_v41(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One V4.1 tensor, following model.md 11.1's recipe: HF initialises sinks, mHC bases and router biases to 0
    and the engram q/k weights to 1, which would leave those paths untested, so they are randomised here."""
    if name.endswith(("norm.weight", "_scale", "engram.embed.scale")):
        return torch.ones(shape)  # norms, mHC scales, and the dummy scale of a float engram table
    if name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return 1 + torch.randn(shape, generator=gen) * 0.5  # only their product matters; keep it away from 0
    if name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=gen)  # std 1, so the engram visibly changes the output
    return torch.randn(shape, generator=gen) * 0.02


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_model(preset: str, out_dir: str, seed: int = 0, dtype: str = "float32") -> str:
    """Write preset `preset` with random weights (seeded) to `out_dir`; return out_dir."""
    config = preset_config(preset)
    text_config(config)["dtype"] = dtype  # V4.1 parses the dtype from text_config, as HF writes it
    cfg = parse_config_dict(config)  # validates the preset before anything is written
    if cfg.vocab_size < TOKENIZER_VOCAB_SIZE:  # every id the tokenizer emits must have an embedding row
        raise ValueError(f"preset {preset!r} vocab_size {cfg.vocab_size} < tokenizer size {TOKENIZER_VOCAB_SIZE}")
    if cfg.v41 is not None and cfg.vocab_size > TOKENIZER_VOCAB_SIZE:  # the engram map must cover every id
        raise ValueError(f"preset {preset!r} vocab_size {cfg.vocab_size} > tokenizer size {TOKENIZER_VOCAB_SIZE}")
    tensors = random_weights(config, seed=seed, dtype=dtype)

    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), config)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out_dir, cfg.max_position_embeddings)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]})
    return out_dir


def cache_root() -> str:
    """Where dsv4 keeps built models: $DSV4_HOME, else $XDG_CACHE_HOME/dsv4, else ~/.cache/dsv4."""
    if os.environ.get("DSV4_HOME"):
        return os.environ["DSV4_HOME"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv4")


def default_model_dir() -> str:
    """The built-in default model (tiny-v4, seed 0), made on first use under cache_root().

    Built in a temporary sibling directory and renamed into place, so a half-written model is never seen and
    concurrent first uses are safe (the loser of the rename discards its copy)."""
    root = cache_root()
    final = os.path.join(root, f"{DEFAULT_PRESET}-v{FORMAT_VERSION}")
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEFAULT_PRESET}-", dir=root)
    try:
        make_model(DEFAULT_PRESET, tmp, seed=0)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
