"""Build a model from its config and fill it from a checkpoint, without a throwaway random init."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.config import LOAD_FORMATS
from dsv4.distributed import Parallel, shard_attention, shard_experts, shard_vocab
from dsv4.models.config import ConfigError, ModelConfig
from dsv4.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsv4.models.layers import gemv_linear
from dsv4.models.layers.merged import merge_siblings
from dsv4.models.layers.rope import RotaryTable
from dsv4.models.loader import (DUMMY_FILE, VISION_MODULE, CheckpointError, dummy_infos, load_into_module,
                                param_dtype, route_v4, route_v41, stored_formats)
from dsv4.models.vision import vision_param_dtype
from dsv4.quant.config import QuantConfig
from dsv4.quant.layers import quantize_model

if TYPE_CHECKING:
    from dsv4.models.engram import HostTable

logger = logging.getLogger(__name__)

# V4.1 keeps the mHC parameters, attention sinks and router biases in fp32 (its norms follow the model dtype), and
# here also the router and ratio-2 gate weights: the model computes with them in fp32 (model.md 5, 6), so storing
# them in fp32 saves an upcast copy of each on every step (checkpoints ship them in bf16: the values are the same).
_V41_FP32 = re.compile(r"(hc_(attn|ffn)_(fn|base|scale)|attn_sink|gate\.bias(_vl)?|ffn\.gate\.weight|"
                       r"compressor\.wgate\.weight)$")


def v41_param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a V4.1 tensor in a model of dtype `dtype`."""
    return torch.float32 if _V41_FP32.search(name) else dtype


def _materialize(model: nn.Module, device: torch.device | str, dtype_of) -> nn.Module:
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(dtype_of(name))
        for module in model.modules():
            if isinstance(module, RotaryTable):
                module.reset()
    return model


def checkpoint_layout(cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None
                      ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of the checkpoint a model of `cfg` loads, without files (load_format "dummy"): the released
    layout when quantized, else the float layout in the model dtype."""
    if quant is not None:
        from dsv4.quant.released import released_layout

        return released_layout(cfg, quant)
    from dsv4.models.presets import tensor_shapes

    return tensor_shapes(cfg, str(dtype).removeprefix("torch."))


def build_model(cfg: ModelConfig, model_dir: str | None, dtype: torch.dtype, device: torch.device | str,
                par: Parallel | None = None, quant: QuantConfig | None = None, load_format: str = "auto",
                engram_placement: str = "auto", merge: bool = False) -> nn.Module:
    """Create the module on the meta device, materialize every tensor in its load dtype on `device`, then load
    the checkpoint (all tensors must be present). V4.1 also binds the engram token map and host tables. With
    expert parallelism (`par` of several ranks) the module holds, and the load reads, this rank's experts only.
    `quant` (the checkpoint's QuantConfig, or None): the weights the checkpoint stores in FP8 / MXFP4 stay so, in
    quantized layers (`dsv4.quant.layers`); None dequantizes them at load. `load_format` "dummy": no weight files,
    random weights of the checkpoint's layout drawn on `device` (config.json and tokenizer only).
    `engram_placement`: auto | device | host, where V4.1's engram tables live (dsv4.models.engram_host).
    `merge`: sibling projections of one input become one module once loaded (dsv4.models.layers.merged; the engine
    merges, callers that need the checkpoint's module names do not)."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    par = par or Parallel()
    v41 = cfg.v41 is not None
    if v41:
        from dsv4.models.deepseek_v41 import DeepseekV41ForCausalLM as model_cls
    else:
        model_cls = DeepseekV4ForCausalLM
    with torch.device("meta"):
        model = model_cls(cfg)
    shard, spans = shard_experts(model, par)
    spans |= {**shard_vocab(model, par), **shard_attention(model, par)}
    layout = checkpoint_layout(cfg, dtype, quant) if load_format == "dummy" else None
    route = route_v41 if v41 else route_v4
    if quant is not None and model_dir is not None:
        infos = dummy_infos(layout) if layout is not None else None
        quantize_model(model, stored_formats(model_dir, route, infos), spans)
    if v41:
        model = _materialize(model, device, lambda n: vision_param_dtype(n, dtype)
                             if n.startswith(f"{VISION_MODULE}.") else v41_param_dtype(n, dtype))
    else:
        model = _materialize(model, device, lambda n: param_dtype(n, dtype))
    if model_dir is not None:
        load_into_module(model, model_dir, route, experts=shard and (shard.first, shard.count), spans=spans,
                         dummy_layout=layout, dummy_int_high=cfg.n_routed_experts)
        if v41 and cfg.v41.engram is not None:
            bind_engram(model, model_dir, torch.device(device), par, layout, engram_placement)
        if merge:
            merge_siblings(model)
            if gemv_linear.GEMV_SCOPE is not None:  # one-row products as a Triton GEMV (the LM head by default)
                logger.info("bf16 GEMV: %d linears", gemv_linear.use_gemv_linears(model, gemv_linear.GEMV_SCOPE))
    return model.eval()


def bind_engram(model: nn.Module, model_dir: str, device: torch.device, par: Parallel | None = None,
                dummy_layout: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                placement: str = "auto") -> None:
    """Token map from the checkpoint's tokenizer (its size must equal engram_compressed_vocab_size) and one table
    per engram layer, memory-mapped from the checkpoint, then placed on the device or left in host memory the GPU
    reads (`placement`, dsv4.models.engram_host). `dummy_layout` (load_format "dummy"): random tables of the
    layout's shapes and dtypes, drawn where the placement puts them."""
    import tokenizers

    from dsv4.models.engram import HostTable, build_compressed_token_map
    from dsv4.models.engram_host import choose_placement, place

    eng = model.cfg.v41.engram
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise ConfigError(f"engram needs the checkpoint's tokenizer.json (not found in {model_dir!r})")
    token_map, size = build_compressed_token_map(tokenizers.Tokenizer.from_file(tok_path))
    if size != eng.compressed_vocab_size:
        raise ConfigError(f"config field `engram_compressed_vocab_size`: the tokenizer gives {size} compressed ids, "
                          f"the config says {eng.compressed_vocab_size}; refusing to run with a mismatched engram")
    if len(token_map) < model.cfg.vocab_size:
        raise ConfigError(f"the tokenizer covers {len(token_map)} ids but vocab_size is {model.cfg.vocab_size}")
    files = _tensor_files(model_dir) if dummy_layout is None else dict.fromkeys(dummy_layout, DUMMY_FILE)
    keys = {}  # layer -> (table key, its file, (scale key, its file) or None)
    for layer in eng.layer_ids:
        w = _find(files, [f"model.layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.weight",
                          f"model.engram_tables.{layer}.weight", f"engram_tables.{layer}.weight"])
        if w is None:
            raise CheckpointError(f"missing engram table of layer {layer} (layers.{layer}.engram.embed.weight)")
        keys[layer] = (*w, _find(files, [w[0].replace("embed.weight", "embed.scale"),
                                         w[0].replace(".weight", ".weight_scale_inv")]))
    if dummy_layout is not None:
        total = sum(_nbytes(*dummy_layout[k]) + (_nbytes(*dummy_layout[sc[0]]) if sc else 0)
                    for k, _, sc in keys.values())
    else:  # memory maps: nothing is read yet
        mapped = {layer: HostTable.from_safetensors(path, key, sc[0] if sc else None, sc[1] if sc else None)
                  for layer, (key, path, sc) in keys.items()}
        total = sum(t.nbytes for t in mapped.values())
    on_device, line = choose_placement(total, placement, device, par)
    logger.info("%s", line)
    model.engram_placement = line
    tables = {}
    layout = model.engram_layout
    for layer, (key, path, sc) in keys.items():
        if dummy_layout is not None:
            table = _dummy_table(dummy_layout, key, sc[0] if sc else None, device, on_device)
        else:
            table = place(mapped[layer], on_device, device)
        if table.num_rows < layout.rows[layer]:
            raise CheckpointError(f"engram table of layer {layer} has {table.num_rows} rows; the hash layout "
                                  f"needs {layout.rows[layer]}")
        tables[layer] = table
    model.bind_engram(torch.from_numpy(token_map).long(), tables)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _dummy_table(layout: dict[str, tuple[tuple[int, ...], torch.dtype]], key: str, scale_key: str | None,
                 device: torch.device, on_device: bool) -> HostTable:
    """A random engram table of the layout's shape and dtype (FP8 codes with UE8M0 scales near 1 when the layout
    stores it so; float tables in +-1), drawn on `device` in chunks and kept there (`on_device`), or copied chunk by
    chunk into host memory that is then mapped for the GPU (a released table is ~98 GB as stored: plain host memory
    registered afterwards, since the pinned allocator would round it up to the next power of two)."""
    from dsv4.models.engram import HostTable
    from dsv4.models.engram_host import map_for_device

    shape, dt = layout[key]
    host = device.type == "cuda" and not on_device
    gen = torch.Generator(device=device).manual_seed(1)
    table = torch.empty(shape, dtype=dt, device="cpu" if host else device)
    step = max(1, (1 << 26) // shape[1])
    for r in range(0, shape[0], step):
        part = table[r: r + step]
        drawn = torch.empty(part.shape, device=device).uniform_(-1.0, 1.0, generator=gen)
        part.copy_((drawn * (64 if dt == torch.float8_e4m3fn else 1)).to(dt))
    scale = None
    if dt == torch.float8_e4m3fn:
        scale = torch.randint(124, 128, layout[scale_key][0], dtype=torch.uint8, device=device, generator=gen)
        scale = scale.cpu() if host else scale
    return map_for_device(HostTable(table, scale)) if host else HostTable(table, scale)


def _tensor_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it (from the index, or the single file's header)."""
    from dsv4.models.engram import read_safetensors_header

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            path = os.path.join(model_dir, name)
            out.update({k: path for k in read_safetensors_header(path) if not k.startswith("__")})
    return out


def _find(files: dict[str, str], names: list[str]) -> tuple[str, str] | None:
    for n in names:
        if n in files:
            return n, files[n]
    return None
