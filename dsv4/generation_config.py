"""The model's own sampling defaults, from its checkpoint's generation_config.json (vLLM's `--generation-config`).

Model creators ship the sampling settings their model is meant to run with (DeepSeek's, the trained demo model's
temperature 0.6 / top_p 0.95) in generation_config.json, Hugging Face's file. vLLM, whose habits dsv4's users bring,
takes them as the *default* sampling parameters (`--generation-config auto`, its default): a field a request or a
flag sets explicitly wins, a field it leaves unset takes the model's value, and a field the file does not give keeps
the engine's own default (SamplingParams': temperature 1.0, top_p 1.0, top_k off, ...). `--generation-config vllm`
ignores the file; dsv4 calls that `none`.

As in vLLM, only sampling fields are read (those SamplingParams has: temperature, top_p, top_k, min_p,
repetition_penalty); `max_new_tokens` is not made the default max_tokens, and `do_sample` is ignored (vLLM ignores
it too: temperature says whether to sample). A null value counts as absent. An invalid value fails here, once, at
start-up, with SamplingParams' own validation and a message naming the file and the field, rather than every
request failing later.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from dsv4.models.config import ConfigError
from dsv4.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# auto: the file's sampling fields are the defaults (vLLM's default); none: ignore the file (vLLM's "vllm")
GENERATION_CONFIG_MODES = ("auto", "none")
# the generation_config.json keys that are SamplingParams fields of the same name and meaning (vLLM reads these,
# plus max_new_tokens, which dsv4 deliberately does not take)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(model_dir: str, mode: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields that the checkpoint in `model_dir` sets in its generation_config.json: `{}` for
    mode "none", a checkpoint without the file, or a file without sampling fields. Logs what it took (once per
    call: callers call it once, at start-up). ConfigError, naming the file and the field, for an unknown mode, a
    file that is not a JSON object, or a value SamplingParams refuses."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ConfigError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if mode == "none" or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:  # (a JSONDecodeError or bad UTF-8 is a ValueError)
        raise ConfigError(f"{path}: cannot read it as JSON ({e}); fix it, or ignore it with --generation-config "
                          "none") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    defaults = {name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None}
    try:  # SamplingParams' own checks, so a value that passes here is one every request accepts
        SamplingParams(**defaults)
    except SamplingParamsError as e:
        raise ConfigError(f"{path}: {e}; fix it, or ignore the file with --generation-config none") from None
    if defaults:
        logger.info("default sampling parameters from the model's %s: %s (a request's own values win; "
                    "--generation-config none ignores the file)", path, format_defaults(defaults))
    return defaults


def format_defaults(defaults: dict[str, Any]) -> str:
    """`temperature=0.6, top_p=0.95`: the defaults as a log line shows them."""
    return ", ".join(f"{name}={value!r}" for name, value in defaults.items())
