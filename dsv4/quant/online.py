"""`--quantization fp8` on a float checkpoint: quantized at load, as vLLM quantizes a bf16 model it is asked to run in
FP8, here into the released layout of the model's family (FP8 block-scaled dense weights, MXFP4 routed experts, V4.1's
FP8 Engram tables: `dsv4 quantize`, dsv4.quant.convert), so the engine then runs exactly what a released checkpoint
runs.

The conversion writes a checkpoint directory (one tensor at a time) into a cache, `$DSV4_CACHE_DIR/quantized/<key>`
(default `~/.cache/dsv4`), and the engine loads that directory: the loader keeps stored FP8 / FP4 tensors as they are,
and the Engram tables stay memory-mapped from it. The key hashes the source's resolved path, its config.json bytes
and every weight and tokenizer file's name, size and modification time, so an edited or retrained checkpoint gets a
new copy and an unchanged one is converted once. Several processes (ranks) converting at once each write a private
directory and rename it into place; the first rename wins and the others drop theirs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile

from dsv4.quant.config import QuantConfigError, parse_quant_config

logger = logging.getLogger(__name__)

# the switch values that ask for the released FP8 format (quant/config.py: QUANTIZATION_CHOICES)
ONLINE_CHOICES = ("fp8", "deepseek_v4_fp8")
_DONE = ".dsv4-quantized"  # written last into a finished copy


def cache_root() -> str:
    return os.environ.get("DSV4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsv4")


def _config(model_dir: str) -> dict:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise QuantConfigError(f"cannot read {model_dir}/config.json: {e}") from None
    return config if isinstance(config, dict) else {}


def checkpoint_key(model_dir: str) -> str:
    """What the copy depends on: the source's real path, config.json's bytes, and the name, size and modification
    time of each weight and tokenizer file (not their bytes: hashing a large checkpoint would take minutes)."""
    h = hashlib.sha256()
    root = os.path.realpath(model_dir)
    h.update(root.encode())
    with open(os.path.join(root, "config.json"), "rb") as f:
        h.update(f.read())
    for path in sorted(glob.glob(os.path.join(root, "*.safetensors")) + glob.glob(os.path.join(root, "*.json"))):
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def load_dir(model_dir: str, quantization: str | None) -> tuple[str, str | None]:
    """The directory the engine loads and the switch it loads it with: a float checkpoint asked for `fp8` (or
    `deepseek_v4_fp8`) -> its cached released-format copy (made now if missing) and "auto"; anything else as given."""
    if quantization not in ONLINE_CHOICES or parse_quant_config(_config(model_dir)) is not None:
        return model_dir, quantization
    from dsv4.quant.convert import quantize_checkpoint

    out = os.path.join(cache_root(), "quantized", checkpoint_key(model_dir))
    if os.path.isfile(os.path.join(out, _DONE)):
        logger.info("--quantization %s: the released-format copy of %s in %s", quantization, model_dir, out)
        return out, "auto"
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".partial-", dir=parent)
    logger.info("--quantization %s: %s is a float checkpoint; writing its released FP8 / MXFP4 copy to %s",
                quantization, model_dir, out)
    try:
        try:
            quantize_checkpoint(model_dir, tmp, "released")
        except ValueError as e:  # a vision tower, a layout mismatch: the switch cannot be honoured
            raise QuantConfigError(f"--quantization {quantization}: {e}") from None
        with open(os.path.join(tmp, _DONE), "w", encoding="utf-8") as f:
            f.write(os.path.realpath(model_dir) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first (its copy is the same): keep it
            if not os.path.isfile(os.path.join(out, _DONE)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, "auto"
