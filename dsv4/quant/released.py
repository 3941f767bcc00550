"""The released DeepSeek-V4 / V4.1 checkpoints' layout: which tensors are low precision, their names, dtypes and bytes,
and a writer of random-weight checkpoints in that layout (`dsv4 make-model --quant released`).

The release (peers_v4.md 1.1 / 1.2, model.md 10) stores, under DeepSeek's original names (no `model.` prefix):
* FP8 e4m3 with block scales (`X.weight` + `X.scale`): the attention projections (wq_a, wq_b, wkv, wo_a, wo_b), the
  indexer's query up-projection (wq_b), the shared expert's w1/w2/w3 and the V4.1 engram `wkv`; scales UE8M0
  (`float8_e8m0fnu`) or float32 (the Base checkpoints), blocks of 128x128 (V4) or 32x32 (V4.1);
* the routed experts per expert (`ffn.experts.E.w1/w2/w3`): MXFP4 (int8 [N, K/2] + UE8M0 [N, K/32]), or the dense
  FP8 format (`expert_dtype` "fp8", the Base checkpoints);
* V4.1 engram tables: FP8 rows + one UE8M0 scale per 32 values of a row;
* everything else as it is in the float model: BF16, the mHC parameters, sinks, position biases and router biases
  FP32, `tid2eid` int64. The compressor / indexer projections (wkv, wgate, weights_proj, wk) ship BF16 without scales.

The writer draws exactly the float weights `make_model` draws for the same preset, seed and dtype, then quantizes
them with `dsv4.quant.formats`: the float checkpoint and the released one are one model up to quantization.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from dsv4.models.config import ModelConfig, parse_config_dict
from dsv4.models.loader import SAFETENSORS_DTYPES, v4_original_names
from dsv4.models.presets import disk_dtype, tensor_shapes, text_config
from dsv4.quant.config import QuantConfig
from dsv4.quant.formats import MX_BLOCK, quantize_fp8, quantize_mxfp4

DENSE, EXPERT, ENGRAM_TABLE = "dense", "expert", "engram_table"
RELEASE_DTYPE = torch.bfloat16  # the float tensors of the release
E8M0 = torch.float8_e8m0fnu

# `dsv4 make-model --quant` choices -> the release's format per model version (None: a float checkpoint).
QUANT_CHOICES = ("none", "released", "released-fp8-experts")
V4_RELEASE = QuantConfig((128, 128), "ue8m0", "fp4")  # V4-Flash / V4-Pro instruct
V4_BASE_RELEASE = QuantConfig((128, 128), "float", "fp8")  # V4-*-Base: float32 scales, FP8 experts
V41_RELEASE = QuantConfig((32, 32), "ue8m0", "fp4")  # V4.1-Flash

# Names of `tensor_shapes` (internal, with `model.`) or of the release (original): anchored on a dot or the start.
_DENSE_RE = re.compile(
    r"(?:^|\.)(?:"
    r"self_attn\.(?:q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"  # V4 HF names
    r"|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)"
    r"|attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"  # original names (V4 and V4.1)
    r"|ffn\.shared_experts\.w[123]|engram\.wkv"
    r")\.weight$")
_EXPERT_RE = re.compile(r"(?:^|\.)(?:mlp\.experts\.(?:gate_up_proj|down_proj)|ffn\.experts\.\d+\.w[123]\.weight)$")
_ENGRAM_RE = re.compile(r"(?:^|\.)engram\.embed\.weight$")
_ENGRAM_SCALE_RE = re.compile(r"(?:^|\.)engram\.embed\.scale$")

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def quant_kind(name: str) -> str | None:
    """"dense" (FP8 block-scaled linear), "expert" (routed expert), "engram_table" (V4.1 engram table) or None (kept
    in its float dtype) for a tensor name of `tensor_shapes` or of the release."""
    if _DENSE_RE.search(name):
        return DENSE
    if _EXPERT_RE.search(name):
        return EXPERT
    if _ENGRAM_RE.search(name):
        return ENGRAM_TABLE
    return None


def release_quant(choice: str | QuantConfig | None, cfg: ModelConfig) -> QuantConfig | None:
    """A `--quant` choice -> the QuantConfig of the release of that model version (None: float checkpoint)."""
    if choice is None or isinstance(choice, QuantConfig):
        return choice
    if choice not in QUANT_CHOICES:
        raise ValueError(f"quant {choice!r} is not one of {list(QUANT_CHOICES)}")
    if choice == "none":
        return None
    if choice == "released-fp8-experts":
        if cfg.v41 is not None:
            raise ValueError("quant 'released-fp8-experts' (the V4 Base format) is for DeepSeek-V4 presets; "
                             "V4.1-Flash ships MXFP4 experts only ('released')")
        return V4_BASE_RELEASE
    return V41_RELEASE if cfg.v41 is not None else V4_RELEASE


# ---- names -------------------------------------------------------------------------------------------------------
_V4_TOP, _V4_LAYER = v4_original_names()  # internal (HF) name -> the release's, the loader's renames inverted
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# One released tensor cut from an internal one: (original name, logical shape, index into the internal tensor).
Piece = tuple[str, tuple[int, ...], tuple[Any, ...] | None]


def released_pieces(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[Piece]:
    """The released tensors (before quantization: original name, logical shape, index) that tensor `name` of
    `tensor_shapes` becomes. V4's packed experts split per expert (gate_up_proj rows [0, I) = w1, [I, 2I) = w3;
    down_proj = w2); V4.1 names are the original ones under `model.` (head: `lm_head`)."""
    if cfg.v41 is not None:
        bare = "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        return [(bare, shape, None)]
    if name in _V4_TOP:
        return [(_V4_TOP[name], shape, None)]
    m = _LAYER_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a DeepSeek-V4 tensor name")
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        E, R, C = shape
        if rest.endswith("down_proj"):
            return [(f"{prefix}ffn.experts.{e}.w2.weight", (R, C), (e,)) for e in range(E)]
        half = R // 2
        return [(f"{prefix}ffn.experts.{e}.{w}.weight", (half, C), (e, slice(h * half, (h + 1) * half)))
                for e in range(E) for h, w in enumerate(("w1", "w3"))]
    if rest not in _V4_LAYER:
        raise ValueError(f"{name!r} has no original DeepSeek-V4 name")
    return [(prefix + _V4_LAYER[rest], shape, None)]


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.scale`, the release's name of a weight's block scales."""
    return weight_name.removesuffix(".weight") + ".scale"


def _stored(name: str, shape: tuple[int, ...], kind: str | None, float_dtype: torch.dtype, qcfg: QuantConfig
            ) -> Layout:
    """The released tensor(s) of one piece: the weight and, when quantized, its scales."""
    if kind == DENSE or (kind == EXPERT and qcfg.expert_dtype == "fp8"):
        (bn, bk), (N, K) = qcfg.block, shape
        return {name: (shape, torch.float8_e4m3fn),
                scale_name(name): ((math.ceil(N / bn), math.ceil(K / bk)), E8M0 if qcfg.ue8m0 else torch.float32)}
    if kind in (EXPERT, ENGRAM_TABLE):  # MXFP4 experts; FP8 engram rows: both one UE8M0 per 32 values along K
        N, K = shape
        if K % MX_BLOCK:
            raise ValueError(f"{name}: {K} columns are not a multiple of {MX_BLOCK}")
        w = ((N, K // 2), torch.int8) if kind == EXPERT else (shape, torch.float8_e4m3fn)
        return {name: w, scale_name(name): ((N, K // MX_BLOCK), E8M0)}
    return {name: (shape, float_dtype)}


def _layout_of(name: str, shape: tuple[int, ...], cfg: ModelConfig, qcfg: QuantConfig) -> Layout:
    if _ENGRAM_SCALE_RE.search(name):
        return {}  # the float layout's dummy table scale: the release's real one comes with its table
    kind, float_dtype = quant_kind(name), disk_dtype(name, RELEASE_DTYPE)
    out: Layout = {}
    for piece, pshape, _ in released_pieces(name, shape, cfg):
        out.update(_stored(piece, pshape, kind, float_dtype, qcfg))
    return out


def released_layout(cfg: ModelConfig, qcfg: QuantConfig) -> Layout:
    """Every tensor of the released checkpoint of `cfg` (original names) -> (shape, stored dtype), in the order of
    `tensor_shapes` (each weight followed by its scale). No vision tower, MTP or DSpark drafter."""
    out: Layout = {}
    for name, (shape, _) in tensor_shapes(cfg).items():
        out.update(_layout_of(name, shape, cfg, qcfg))
    return out


def stored_nbytes(name: str, shape: tuple[int, ...], cfg: ModelConfig, qcfg: QuantConfig) -> int:
    """Bytes tensor `name` of `tensor_shapes` (logical `shape`) takes in the release, scales included: FP8 1 B per value
    plus its block scales, MXFP4 0.5 B per value plus 1 B per 32, float tensors at their release dtype. A V4.1 float
    layout's dummy `engram.embed.scale` counts 0 (the table's real scales are counted with the table)."""
    return sum(math.prod(s) * dt.itemsize for s, dt in _layout_of(name, shape, cfg, qcfg).values())


# ---- quantize ----------------------------------------------------------------------------------------------------
_Q_CHUNK = 1 << 24  # values quantized at once: fp32 temporaries stay ~100s of MB for a 2.4M-row engram table


def _rowwise(w: torch.Tensor, block_rows: int, fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(w)` -> (values, scales) computed over row chunks that are whole scale blocks (same result, less memory)."""
    step = max(block_rows, _Q_CHUNK // max(1, w.shape[-1]) // block_rows * block_rows)
    if w.shape[-2] <= step:
        return fn(w)
    parts = [fn(w[i:i + step]) for i in range(0, w.shape[-2], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def quantize_released(name: str, t: torch.Tensor, cfg: ModelConfig, qcfg: QuantConfig) -> dict[str, torch.Tensor]:
    """One float tensor of `tensor_shapes` -> its released tensors (CPU, contiguous), quantized on `t`'s device."""
    if _ENGRAM_SCALE_RE.search(name):
        return {}
    kind, float_dtype = quant_kind(name), disk_dtype(name, RELEASE_DTYPE)
    out: dict[str, torch.Tensor] = {}
    for piece, _, index in released_pieces(name, tuple(t.shape), cfg):
        w = t[index] if index is not None else t
        if kind == DENSE or (kind == EXPERT and qcfg.expert_dtype == "fp8"):
            q, s = _rowwise(w, qcfg.block[0], lambda x: quantize_fp8(x, qcfg.block, qcfg.ue8m0))
            s = s.view(E8M0) if qcfg.ue8m0 else s
        elif kind == EXPERT:
            # formats.quantize_mxfp4 builds its e2m1 grid on the CPU and bucketizes against it (one device needed):
            # encode there until it follows the input's device (exact either way: power-of-two scales)
            q, s = _rowwise(w, 1, lambda x: quantize_mxfp4(x.cpu()))
            q, s = q.view(torch.int8), s.view(E8M0)
        elif kind == ENGRAM_TABLE:
            q, s = _rowwise(w, 1, lambda x: quantize_fp8(x, (1, MX_BLOCK), True))
            s = s.view(E8M0)
        else:
            out[piece] = w.to(float_dtype).cpu().contiguous()
            continue
        out[piece], out[scale_name(piece)] = q.cpu().contiguous(), s.cpu().contiguous()
    return out


# ---- write -------------------------------------------------------------------------------------------------------


def released_config(config: dict[str, Any], qcfg: QuantConfig) -> dict[str, Any]:
    """`config` with the release's quantization fields: `quantization_config` (V4: and `expert_dtype` beside it, as
    the V4 release; V4.1 composite: at the top level and in `text_config`) and dtype bfloat16."""
    out = json.loads(json.dumps(config))
    text = text_config(out)
    text["dtype"] = "bfloat16"
    qc = qcfg.to_json()
    out["quantization_config"] = qc
    if text is out:
        out["expert_dtype"] = qcfg.expert_dtype
    else:
        text["quantization_config"] = dict(qc)
    return out


def iter_released(config: dict[str, Any], qcfg: QuantConfig, seed: int = 0, dtype: str = "float32",
                  device: str | torch.device | None = None, chunked: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) of the whole checkpoint, one float tensor drawn and quantized at a time.

    The float draws are make_model's for the same arguments: `chunked` = the streamed writer's per-chunk draws in
    `dtype` on `device` (the large presets, or any preset given a device), else `random_weights` (one generator)."""
    from dsv4 import make_model as mm  # lazy: make_model imports this module

    cfg = parse_config_dict(config)
    dev = torch.device(device or "cpu")
    if not chunked:
        for name, t in mm.random_weights(config, seed=seed, dtype=dtype).items():
            yield from quantize_released(name, t, cfg, qcfg).items()
        return
    init = mm._init_v41 if cfg.v41 is not None else mm._init_v4
    for name, (shape, dt) in tensor_shapes(cfg, dtype).items():
        if _ENGRAM_SCALE_RE.search(name):
            continue  # never drawn: the float writer fills it with ones
        parts = list(mm._stream_tensor(name, shape, dt, init(name), seed, cfg.n_routed_experts, dev))
        t = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dev)
        del parts
        yield from quantize_released(name, t, cfg, qcfg).items()


def write_sharded(layout: Layout, tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str,
                  max_shard_bytes: int) -> list[str]:
    """Write `tensors` (every name of `layout` once, in any order) into safetensors shards + index (one
    model.safetensors if it fits). Headers come from `layout` first, so each tensor is written at its final offset
    as it arrives (one tensor in memory at a time); within a shard, wider dtypes come first so every tensor starts at
    a multiple of its item size. Returns the files written."""
    from dsv4.make_model import _plan_shards  # lazy: make_model imports this module

    shards = _plan_shards(layout, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    where: dict[str, tuple[int, int, int]] = {}  # name -> (file index, absolute offset, bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, (file, names) in enumerate(zip(files, shards)):
        names = sorted(names, key=lambda n: -layout[n][1].itemsize)  # stable: layout order within a width
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            shape, dt = layout[name]
            size = math.prod(shape) * dt.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
            weight_map[name] = file
            offset += size
        total += offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned
        start = 8 + len(raw)
        for name in names:
            begin, end = header[name]["data_offsets"]
            where[name] = (i, start + begin, end - begin)
        with open(os.path.join(out_dir, file), "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            f.truncate(start + offset)  # the full size now; tensors are written into it at their offsets
    handles = [open(os.path.join(out_dir, f), "r+b") for f in files]
    try:
        seen: set[str] = set()
        for name, t in tensors:
            if name not in layout or name in seen:
                raise ValueError(f"tensor {name!r} is {'written twice' if name in seen else 'not in the layout'}")
            shape, dt = layout[name]
            if tuple(t.shape) != shape or t.dtype != dt:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, the layout says {shape} {dt}")
            i, offset, size = where[name]
            handles[i].seek(offset)
            handles[i].write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            seen.add(name)
        if len(seen) != len(layout):
            raise ValueError(f"{len(layout) - len(seen)} tensors of the layout were never written, e.g. "
                             f"{next(n for n in layout if n not in seen)}")
    finally:
        for h in handles:
            h.close()
    if len(files) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")
    return files


def write_released(config: dict[str, Any], out_dir: str, qcfg: QuantConfig, seed: int = 0, dtype: str = "float32",
                   device: str | torch.device | None = None, stream: bool = False,
                   max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write config.json (`released_config`) and the released-layout weights of `config` to `out_dir`; return the
    weight files. The float values are make_model's for (seed, dtype, device); `stream` (the large presets): drawn
    per chunk, quantized on `device` and written tensor by tensor into shards (`write_sharded`); otherwise
    `random_weights` quantized in memory into one model.safetensors."""
    cfg = parse_config_dict(config)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(released_config(config, qcfg), f, indent=2, ensure_ascii=False)
        f.write("\n")
    tensors = iter_released(config, qcfg, seed, dtype, device, chunked=stream)
    if stream:
        return write_sharded(released_layout(cfg, qcfg), tensors, out_dir, max_shard_bytes)
    save_file(dict(tensors), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return ["model.safetensors"]
