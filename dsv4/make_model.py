"""Write random-weight DeepSeek-V4/V4.1 checkpoints (`dsv4 make-model`); locate the built-in (trained) default model.

A checkpoint here is what a real one ships: config.json, model.safetensors (HF DeepseekV4ForCausalLM names for V4;
the layout HF-V41 saves for V4.1, with a composite config.json; the presets of `VISION_PRESETS` add the vision
encoder's tensors under their original names), tokenizer.json, tokenizer_config.json and generation_config.json.
Like DeepSeek's releases, the tokenizer has no chat template: chat prompts are DeepSeek's own encoding
(dsv4.chat), whose special tokens and reply markers the tokenizer holds as single tokens.
Everything is deterministic given the seed, so tests and `dsv4 generate` need no download.

The large benchmark presets (`LARGE_PRESETS`, several GB in bf16) are streamed instead: each tensor is drawn in chunks,
each chunk from its own generator seeded by (seed, tensor name, chunk index), optionally on a GPU (`device`), and
written straight into sharded safetensors files with an index, so the whole checkpoint is never held in memory.
Their tokenizer is the built-in BPE extended with synthetic words to the released 129280 ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsv4.chat.tokens import special_tokens
from dsv4.models.image_processor import IMAGE_PLACEHOLDER
from dsv4.models.config import parse_config_dict
from dsv4.models.presets import (CONFIG_ONLY_PRESETS, DRAFTER_FIELDS, LARGE_PRESETS, TOKENIZER_VOCAB_SIZE,
                                 VISION_PRESETS, dspark_tensor_shapes, mtp_tensor_shapes, preset_config, preset_dtype,
                                 tensor_shapes, text_config, vision_tensor_shapes)
from dsv4.quant.config import QuantConfig
from dsv4.quant.released import release_quant, released_config, write_released, write_sharded
from dsv4.models.vision import parse_vision_config
from dsv4.spec_decode.config import parse_dspark

# The special tokens of DeepSeek's prompts (dsv4.chat.tokens), BOS/EOS/PAD at DeepSeek's ids 0/1/2 (config
# bos_token_id 0, eos_token_id 1). One tokenizer serves every preset, so it holds both families' tokens: V4.1's
# system token too (a V4 prompt never contains it).
_TOKENS = special_tokens("v41")
BOS, EOS, PAD = _TOKENS.bos, _TOKENS.eos, "<｜▁pad▁｜>"
USER, ASSISTANT, SYSTEM = _TOKENS.user, _TOKENS.assistant, _TOKENS.system
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM]
# Reply markers: single tokens but not special ones, as in DeepSeek's tokenizers, so that decoding with
# skip_special_tokens=True keeps them for the reasoning and tool-call parsers. `｜DSML｜` is the part both families'
# DSML tags share (`<｜DSML｜tool_calls>`, `<｜DSML｜ invoke ...`).
MARKER_TOKENS = [_TOKENS.think_start, _TOKENS.think_end, _TOKENS.dsml]
# DeepSeek-V4.1's image placeholder: a regular added token, not a special one (model.md 1.2).

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
        special_tokens=SPECIAL_TOKENS + MARKER_TOKENS,  # ids 0.. in this order, each one token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Several copies make every pair frequent enough that merge order depends on counts, not just on ties.
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built-in corpus yields {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:  # the trainer makes all of them special; the markers must survive decoding
        added["special"] = added["content"] not in MARKER_TOKENS
    tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


@functools.lru_cache(maxsize=4)
def _synthetic_tokenizer_json(vocab_size: int, image_token: bool = False) -> str:
    if image_token:  # the placeholder takes the last id, after the text vocabulary
        tok = Tokenizer.from_str(_synthetic_tokenizer_json(vocab_size - 1))
        tok.add_tokens([AddedToken(IMAGE_PLACEHOLDER, special=False, normalized=False)])
        if tok.token_to_id(IMAGE_PLACEHOLDER) != vocab_size - 1:
            raise RuntimeError(f"image placeholder landed at id {tok.token_to_id(IMAGE_PLACEHOLDER)}, "
                               f"not {vocab_size - 1}")
        return tok.to_str()
    base = build_tokenizer()
    if vocab_size == TOKENIZER_VOCAB_SIZE:
        return base.to_str()
    data = json.loads(base.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    # Lowercase words after a byte-level space ("Ġ"), in base-26 order from "aaa": every one decodes to plain text,
    # and distinct words stay distinct keys of the engram token map. Words the BPE already holds are skipped. No merge
    # builds them, so they are never produced by encoding; they exist so that every id decodes.
    n = 0
    while len(vocab) < vocab_size:
        k, word = n + 26 * 26, ""
        while k:
            k, r = divmod(k, 26)
            word = string.ascii_lowercase[r] + word
        n += 1
        if "\u0120" + word not in vocab:
            vocab["\u0120" + word] = len(vocab)
    return json.dumps(data, ensure_ascii=False)


def synthetic_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, image_token: bool = False) -> Tokenizer:
    """The tokenizer make_model writes for a `vocab_size`-id model: the built-in BPE (exactly, at 512 ids), extended
    with synthetic words up to `vocab_size` ids so that every id of a released-size vocabulary decodes and the engram
    token map covers it. With `image_token`, the last id is the image placeholder `<｜deepseek_image｜>`."""
    if vocab_size < TOKENIZER_VOCAB_SIZE + image_token:
        raise ValueError(f"vocab_size {vocab_size} < the built-in tokenizer's {TOKENIZER_VOCAB_SIZE} ids"
                         + (" plus the image placeholder" if image_token else ""))
    return Tokenizer.from_str(_synthetic_tokenizer_json(vocab_size, image_token))


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
    }


def write_tokenizer_files(out_dir: str, max_length: int = 1024, vocab_size: int = TOKENIZER_VOCAB_SIZE,
                          image_token: bool = False) -> None:
    """Write tokenizer.json (`synthetic_tokenizer(vocab_size, image_token)`: the built-in one by default) and
    tokenizer_config.json to `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    synthetic_tokenizer(vocab_size, image_token).save(os.path.join(out_dir, "tokenizer.json"))
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(max_length))


@dataclass(frozen=True)
class _Init:
    """How one tensor is drawn: "ones", "normal" (mean + std * N(0, 1)) or "experts" (tid2eid rows of distinct
    random experts)."""

    kind: str
    std: float = 0.0
    mean: float = 0.0


def _init_v4(name: str) -> _Init:
    """V4: linear weights (and the mHC fn) ~ N(0, 0.02); norms and mHC scales = 1; sinks, position biases and mHC
    bases ~ 0.5 N(0, 1) and the router bias ~ 0.1 N(0, 1), so none of them is zero and every code path matters;
    `tid2eid` rows are distinct random experts. The MTP layer's released names (`mtp.0.hc_attn_scale`,
    `mtp.0.attn.attn_sink`, `mtp.0.ffn.gate.bias`, ...) follow the same rule; no target (HF) name ends like them."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        return _Init("experts")
    if "norm" in name or leaf in ("scale", "hc_scale") or leaf.endswith("_scale"):
        return _Init("ones")
    if leaf in ("sinks", "position_bias", "base", "hc_base", "attn_sink") or leaf.endswith("_base"):
        return _Init("normal", 0.5)
    if leaf == "e_score_correction_bias" or name.endswith("gate.bias"):
        return _Init("normal", 0.1)
    return _Init("normal", 0.02)


def _init_v41(name: str) -> _Init:
    """V4.1, following model.md 11.1's recipe: HF initialises sinks, mHC bases and router biases to 0 and the engram
    q/k weights to 1, which would leave those paths untested, so they are randomised here. The vision encoder's
    tensors (no text name ends like them) follow the same rule: norms 1, everything else N(0, 0.02)."""
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "_scale", "engram.embed.scale")):
        return _Init("ones")  # norms, mHC scales, and the dummy scale of a float engram table
    if name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base")):
        return _Init("normal", 0.5)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return _Init("normal", 0.1)
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return _Init("normal", 0.5, 1.0)  # only their product matters; keep it away from 0
    if name.endswith("engram.embed.weight"):
        return _Init("normal", 1.0)  # std 1, so the engram visibly changes the output
    return _Init("normal", 0.02)


def _draw(init: _Init, shape: tuple[int, ...], gen: torch.Generator, n_experts: int) -> torch.Tensor:
    """One float32 CPU tensor from one shared generator (the tiny presets' recipe; their bytes depend on it)."""
    if init.kind == "experts":
        return torch.rand((shape[0], n_experts), generator=gen).argsort(dim=1)[:, : shape[1]]
    if init.kind == "ones":
        return torch.ones(shape)
    t = torch.randn(shape, generator=gen) * init.std
    return t + init.mean if init.mean else t


def _checkpoint_shapes(config: dict[str, Any], dtype: str, vision: bool
                       ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`tensor_shapes` of the config, followed by `vision_tensor_shapes` of its vision_config when `vision`, then
    the drafter's `mtp.*` tensors when the config has draft layers: V4.1's DSpark stages, V4's MTP layer (last, so
    that the target's and the vision tower's draws do not depend on the drafter)."""
    cfg = parse_config_dict(config)
    shapes = tensor_shapes(cfg, dtype)
    if vision:
        vcfg = parse_vision_config(config)
        if cfg.v41 is None or vcfg is None:
            raise ValueError("vision weights need a DeepSeek-V4.1 config with a vision_config")
        shapes.update(vision_tensor_shapes(vcfg, cfg.hidden_size, dtype))
    ds = parse_dspark(config) if cfg.v41 is not None else None
    if ds is not None:
        shapes.update(dspark_tensor_shapes(cfg, ds, dtype))
    if cfg.v41 is None and cfg.num_nextn_predict_layers > 0:
        shapes.update(mtp_tensor_shapes(cfg, dtype))
    return shapes


def random_weights(config: dict, seed: int = 0, dtype: str = "float32", vision: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Random tensors for every name of `v4_tensor_shapes` (or `v41_tensor_shapes` for a V4.1 config, then
    `vision_tensor_shapes` when `vision`), drawn in that order from one seeded generator (recipes: `_init_v4`,
    `_init_v41`); the text tensors do not depend on `vision`."""
    cfg = parse_config_dict(config)
    gen = torch.Generator().manual_seed(seed)
    init = _init_v41 if cfg.v41 is not None else _init_v4
    out: dict[str, torch.Tensor] = {}
    for name, (shape, disk_dtype) in _checkpoint_shapes(config, dtype, vision).items():
        out[name] = _draw(init(name), shape, gen, cfg.n_routed_experts).to(disk_dtype).contiguous()
    return out


# ---- streamed writer (large presets) ---------------------------------------------------------------------------
DEFAULT_SHARD_BYTES = 4 << 30  # safetensors shards of at most 4 GiB (a larger single tensor gets a shard of its own)
_CHUNK_ELEMENTS = 1 << 26  # draw at most 64M values at a time: 128 MB in bf16, whatever the tensor size


def _chunk_generator(seed: int, name: str, chunk: int, device: torch.device) -> torch.Generator:
    """A generator for one chunk of one tensor: the draws do not depend on the order or the shard layout."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _stream_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, init: _Init, seed: int, n_experts: int,
                   device: torch.device) -> Iterator[torch.Tensor]:
    """The tensor in row chunks along dim 0 (contiguous CPU tensors, in order), drawn in `dtype` on `device`."""
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:])
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    for chunk, start in enumerate(range(0, rows, step)):
        part = (min(step, rows - start), *shape[1:])
        if init.kind == "ones":
            t = torch.ones(part, dtype=dtype, device=device)
        elif init.kind == "experts":
            gen = _chunk_generator(seed, name, chunk, device)
            t = torch.rand((part[0], n_experts), generator=gen, device=device).argsort(dim=1)[:, : shape[1]]
        else:
            gen = _chunk_generator(seed, name, chunk, device)
            t = torch.empty(part, dtype=dtype, device=device).normal_(init.mean, init.std, generator=gen)
        yield t.to(dtype).cpu().contiguous()


def _plan_shards(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in layout order, each shard at most `max_shard_bytes` (unless one tensor is larger)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, (shape, dt) in shapes.items():
        size = math.prod(shape) * dt.itemsize
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_random_safetensors(config: dict[str, Any], out_dir: str, seed: int = 0, dtype: str = "bfloat16",
                             device: str | torch.device = "cpu", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                             vision: bool = False) -> list[str]:
    """Stream random weights of `config` (names, shapes and dtypes of `tensor_shapes`, plus `vision_tensor_shapes`
    when `vision`; recipes `_init_v4` / `_init_v41`) into `out_dir`: model.safetensors, or
    model-0000i-of-0000n.safetensors plus model.safetensors.index.json when the total exceeds `max_shard_bytes`.
    Returns the files written.

    Peak memory is one tensor (drawn in chunks), not the checkpoint. The values depend on (seed, device): a GPU draws
    other
    numbers than the CPU from the same seed."""
    cfg = parse_config_dict(config)
    shapes = _checkpoint_shapes(config, dtype, vision)
    init = _init_v41 if cfg.v41 is not None else _init_v4
    dev = torch.device(device)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:  # one tensor in memory at a time, drawn in chunks
        for name, (shape, dt) in shapes.items():
            parts = list(_stream_tensor(name, shape, dt, init(name), seed, cfg.n_routed_experts, dev))
            yield name, parts[0] if len(parts) == 1 else torch.cat(parts)

    return write_sharded(shapes, tensors(), out_dir, max_shard_bytes)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def make_model(preset: str, out_dir: str, seed: int = 0, dtype: str | None = None, device: str | None = None,
               overrides: dict[str, Any] | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
               quant: str | QuantConfig | None = None, config_only: bool = False, drafter: bool | None = None) -> str:
    """Write preset `preset` with random weights (seeded) to `out_dir`; return out_dir.

    `dtype` defaults to the preset's (`preset_dtype`: bf16 for the large presets). The large presets, or any preset
    given a `device` (e.g. "cuda", which draws much faster), are streamed by `write_random_safetensors`; the tiny
    presets otherwise keep their single-generator draws and single file. `overrides` replace text-config fields
    (a scaled-down variant of a preset). The presets of `VISION_PRESETS` also get the vision encoder's weights
    and the image placeholder as the tokenizer's last id.

    `quant` ("none" | "released" | "released-fp8-experts" | a QuantConfig; `dsv4.quant.released.release_quant`):
    write the released checkpoint layout instead (original DeepSeek names, FP8 / MXFP4 weights quantized from the
    same float draws, `quantization_config` in config.json). `config_only`: config.json, tokenizer and
    generation_config only (for `--load-format dummy`); the only way to "write" a `CONFIG_ONLY_PRESETS` preset.

    `drafter`: None = the preset's own (tiny-v41 ships a tiny DSpark drafter, tiny-v4 one MTP layer, the others
    none); True adds the released drafter: DSpark's fields (`DRAFTER_FIELDS`) and `mtp.*` weights to a V4.1 preset,
    one MTP layer to a V4 preset; False writes none. The released (quantized) layout carries no drafter tensors yet:
    its config then says none either."""
    if preset in CONFIG_ONLY_PRESETS and not config_only:
        raise ValueError(f"preset {preset!r} is the full released model (hundreds of GB of weights): its weights are "
                         f"not written. Write its config with `dsv4 make-model --preset {preset} --out DIR "
                         f"--config-only` and run it with `--load-format dummy`")
    if quant not in (None, "none") and preset in VISION_PRESETS:
        raise ValueError(f"preset {preset!r}: the released layout is written without a vision tower (quant {quant!r})")
    dtype = dtype or preset_dtype(preset)
    config = preset_config(preset, overrides)
    is_v41 = text_config(config).get("model_type") in ("deepseek_v41", "deepseek_v41_text")
    if not is_v41 and (drafter is not None or quant not in (None, "none")):
        keep = (bool(text_config(config).get("num_nextn_predict_layers")) if drafter is None else drafter)
        text_config(config)["num_nextn_predict_layers"] = int(keep and quant in (None, "none"))  # V4 ships one
    if is_v41 and (drafter is not None or quant not in (None, "none")):
        keep = bool(drafter) and quant in (None, "none")
        if keep and not text_config(config).get("num_nextn_predict_layers"):
            text_config(config).update(DRAFTER_FIELDS)
        elif not keep:
            text_config(config)["num_nextn_predict_layers"] = 0
    text_config(config)["dtype"] = dtype  # V4.1 parses the dtype from text_config, as HF writes it
    cfg = parse_config_dict(config)  # validates the preset before anything is written
    vision = preset in VISION_PRESETS
    if cfg.vocab_size < TOKENIZER_VOCAB_SIZE:  # every id the tokenizer emits must have an embedding row
        raise ValueError(f"preset {preset!r} vocab_size {cfg.vocab_size} < tokenizer size {TOKENIZER_VOCAB_SIZE}")
    if vision and (parse_vision_config(config) is None or cfg.v41.image_token_id != cfg.vocab_size - 1):
        raise ValueError(f"preset {preset!r}: a vision preset needs a vision_config and image_token_id = "
                         f"vocab_size - 1 (the tokenizer's placeholder id), got {cfg.v41.image_token_id}")

    qcfg = release_quant(quant, cfg)
    os.makedirs(out_dir, exist_ok=True)
    streamed = preset in LARGE_PRESETS or device is not None
    if config_only:
        _write_json(os.path.join(out_dir, "config.json"), config if qcfg is None else released_config(config, qcfg))
    elif qcfg is not None:
        write_released(config, out_dir, qcfg, seed=seed, dtype=dtype, device=device, stream=streamed,
                       max_shard_bytes=max_shard_bytes)
    elif streamed:
        _write_json(os.path.join(out_dir, "config.json"), config)
        write_random_safetensors(config, out_dir, seed=seed, dtype=dtype, device=device or "cpu",
                                 max_shard_bytes=max_shard_bytes, vision=vision)
    else:
        _write_json(os.path.join(out_dir, "config.json"), config)
        tensors = random_weights(config, seed=seed, dtype=dtype, vision=vision)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out_dir, cfg.max_position_embeddings, cfg.vocab_size, image_token=vision)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]})
    return out_dir


DEFAULT_MODEL_NAME = "dsv4-demo"  # the API's model name for the built-in model (`dsv4 serve` without --model)
ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")  # package data (pyproject.toml)


def default_model_dir() -> str:
    """The built-in default model: the V4.1-architecture demo model `dsv4 train-demo` trained on the Python
    standard library (12M parameters, bf16, with its DSpark drafter), shipped inside the package (dsv4/assets/;
    its train_info.json says how it was made). The random-weight presets (`make-model --preset tiny-v4`, ...)
    remain for tests."""
    path = os.path.join(ASSETS_DIR, DEFAULT_MODEL_NAME)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not os.path.isfile(
        os.path.join(path, f))]
    if missing:  # an install that dropped the package data: say so instead of a loader traceback
        raise FileNotFoundError(f"the built-in model is incomplete: {', '.join(missing)} missing in {path} "
                                f"(reinstall dsv4, or pass --model DIR)")
    return path
