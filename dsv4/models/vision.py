"""DeepSeek-V4.1 vision encoder: ViT, 3x3 aligner and the image-span embeddings (model.md 8.2-8.4, weights 10.2).

`VisionEncoder` holds the checkpoint's three top-level groups as direct attributes, so its own state-dict names are
exactly model.md 10.2's: `vision.*` (the ViT, `VisionTower`), `aligner.*` (`Aligner`) and the learned delimiters
`image_start`, `image_end`, `image_newline`. The text model holds it as `self.vision_encoder`; the loader's
`route_v41` maps every checkpoint spelling onto `vision_encoder.<10.2 name>` (`loader.VISION_MODULE`).

Several images run as one packed sequence (rows concatenated, `cu_seqlens` marking image boundaries); attention
never crosses images. With the boundaries as host values attention runs one SDPA call per image. With `cu_seqlens`
on the device (the CUDA-graph path: no host read, so it can be captured) it runs the Triton varlen flash-attention
kernel or FlashAttention's varlen forward (dsv4/ops/varlen_attention.py, O(sum of len^2) work, O(rows) memory) on
CUDA, and elsewhere one block-diagonal masked SDPA, the exact torch reference (O(rows^2) mask and score memory).
On CUDA the blocks' elementwise work (the q/k rope, the SwiGLU product, each residual add with the norm after it) runs
as fused Triton launches with the same bits (dsv4/ops/vision_fused.py); `DSV4_VISION_FUSED=0` keeps the torch ops,
which the CPU always runs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.models.config import ConfigError
from dsv4.models.layers.norm import RMSNorm
from dsv4.ops import varlen_attention as varlen_ops
from dsv4.ops import vision_fused as vf
from dsv4.ops.varlen_attention import (
    HAS_TRITON,
    flash_supported,
    varlen_attention_flash,
    varlen_attention_triton,
)

Grid = tuple[int, int]  # (rows, cols) of ViT patches of one image

# vLLM flattens the vision config into the top level under these names (model.md 1.2).
_FLAT_NAMES = {
    "hidden_size": "vision_dim",
    "intermediate_size": "vision_inter_dim",
    "num_hidden_layers": "vision_n_layers",
    "num_attention_heads": "vision_n_heads",
    "patch_size": "vision_patch_size",
    "downsample_ratio": "vision_downsample_ratio",
    "rope_theta": "vision_rope_theta",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}


# ---- config ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VisionConfig:
    """DeepseekV41VisionConfig (model.md 1.2); the defaults are the released model's."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936  # 544^2
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        """Channels per ViT attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened RGB patch (3 * p * p, channel-major)."""
        return 3 * self.patch_size * self.patch_size


def _number(value: Any, where: str, integer: bool) -> float | int:
    # bool is an int subclass, and a JSON "3" or 3.5 for a size is a broken config, not something to coerce.
    ok = isinstance(value, int) or (not integer and isinstance(value, float))
    if isinstance(value, bool) or not ok:
        raise ConfigError(f"config field `{where}`: expected {'an integer' if integer else 'a number'}, "
                          f"got {value!r}")
    return int(value) if integer else float(value)


def parse_vision_config(raw: dict[str, Any]) -> VisionConfig | None:
    """The vision tower's config from a whole V4.1 config.json dict: the composite `vision_config` object, else
    vLLM's flattened `vision_*` fields; None when the config has neither (a text-only config). Missing fields take
    the released defaults; wrong types and values raise `ConfigError` naming the field."""
    sub = raw.get("vision_config")
    if sub is not None and not isinstance(sub, dict):
        raise ConfigError(f"config field `vision_config`: expected an object, got {type(sub).__name__}")
    if sub is not None:
        values, where = sub, {name: f"vision_config.{name}" for name in _FLAT_NAMES}
        where["rms_norm_eps"] = "vision_config.rms_norm_eps"
    elif any(flat in raw for flat in _FLAT_NAMES.values()):
        values = {name: raw[flat] for name, flat in _FLAT_NAMES.items() if flat in raw}
        where = dict(_FLAT_NAMES)
    else:
        return None

    default = VisionConfig()
    fields: dict[str, Any] = {}
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size",
                 "downsample_ratio", "max_image_tokens", "min_pixels"):
        v = values.get(name)
        fields[name] = getattr(default, name) if v is None else _number(v, where[name], integer=True)
    for name in ("rope_theta", "rms_norm_eps"):
        v = values.get(name) if name in where else None
        fields[name] = getattr(default, name) if v is None else _number(v, where[name], integer=False)
    ratio = values.get("max_wh_ratio")
    fields["max_wh_ratio"] = None if ratio is None else _number(ratio, where["max_wh_ratio"], integer=False)
    cfg = VisionConfig(**fields)

    def require(cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config field `{where[name]}`: {msg}")

    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "patch_size", "downsample_ratio"):
        require(fields[name] > 0, name, f"must be positive, got {fields[name]}")
    require(cfg.num_hidden_layers >= 0, "num_hidden_layers", f"must be >= 0, got {cfg.num_hidden_layers}")
    require(cfg.hidden_size % cfg.num_attention_heads == 0, "num_attention_heads",
            f"{cfg.num_attention_heads} heads do not divide hidden_size {cfg.hidden_size}")
    # 2D RoPE: half the head for rows, half for columns, each half rotated in pairs.
    require(cfg.head_dim % 4 == 0, "num_attention_heads",
            f"head_dim {cfg.head_dim} (hidden_size / heads) must be a multiple of 4 for the 2D rope")
    require(cfg.rope_theta > 0, "rope_theta", f"must be positive, got {cfg.rope_theta}")
    require(cfg.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {cfg.rms_norm_eps}")
    # The smallest image span is a 1x1 aligner grid: START, IMAGE, NEW_LINE, END.
    require(cfg.max_image_tokens >= 4, "max_image_tokens", f"must be >= 4 (a 1x1 image's span), got "
            f"{cfg.max_image_tokens}")
    require(cfg.min_pixels >= 0, "min_pixels", f"must be >= 0, got {cfg.min_pixels}")
    require(cfg.max_wh_ratio is None or cfg.max_wh_ratio >= 1, "max_wh_ratio",
            f"must be null or >= 1, got {cfg.max_wh_ratio}")
    return cfg


def load_vision_config(model_dir: str) -> VisionConfig | None:
    """The vision config of the checkpoint in `model_dir`, or None when it has no vision tower. A composite
    config.json always carries a `vision_config` (the tiny text-only presets too), so the weights decide: the
    config counts only when the checkpoint holds vision tensors."""
    from dsv4.models.loader import has_vision_weights  # lazy: keeps this module importable on its own

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    cfg = parse_vision_config(raw)
    return cfg if cfg is not None and has_vision_weights(model_dir) else None


_FP32_PARAM = re.compile(r"(^|\.)(vision\.(blocks\.\d+\.norm[12]|norm)\.weight|image_(start|end|newline))$")


def vision_param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a vision-encoder tensor in a model of dtype `dtype`: the ViT RMSNorm weights and the delimiter
    vectors stay float32 (as shipped), everything else follows the model. Takes a name with or without a prefix."""
    return torch.float32 if _FP32_PARAM.search(name) else dtype


# ---- packed layout and 2D rope ---------------------------------------------------------------------------------
def _check_grids(grids: Sequence[Grid]) -> list[Grid]:
    out = [(int(h), int(w)) for h, w in grids]
    bad = [g for g in out if g[0] <= 0 or g[1] <= 0]
    if bad:
        raise ValueError(f"image grids must be positive (rows, cols) patch counts, got {bad}")
    return out


def cu_seqlens_of(grids: Sequence[Grid]) -> torch.Tensor:
    """int32 [num_images + 1] row offsets of each image in the packed sequence (host tensor)."""
    sizes = [h * w for h, w in _check_grids(grids)]
    return torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def vision_positions(grids: Sequence[Grid]) -> torch.Tensor:
    """int64 [sum nh*nw, 2] (row, col) of every patch of the packed images, row-major within each image (host)."""
    parts = [torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
             for h, w in _check_grids(grids)]
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int64)


def vision_rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, head_dim/2] (fp32, on positions' device) of the 2D rope (model.md 8.2): with rope_dim =
    head_dim/2 and inv = theta^(-2i/rope_dim), i < rope_dim/2, the angles are [row*inv | col*inv]."""
    rope_dim = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim)
    angles = (positions.float()[:, :, None] * inv).flatten(1)  # [n, 2, rope_dim/2] -> rows' angles, then cols'
    return angles.cos(), angles.sin()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NeoX) rotation over the whole head: x1 = x[:d/2] pairs with x2 = x[d/2:]; in fp32.
    x [n, heads, d], cos/sin [n, d/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def per_image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """Full bidirectional attention over each packed image [bounds[i], bounds[i+1]), one SDPA call per image.
    q/k/v [n, heads, d] -> [n, heads, d]; rows past bounds[-1] are padding and come out 0."""
    scale = q.shape[-1] ** -0.5

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        # [1, heads, n, d]: SDPA's fused (flash, memory-efficient) kernels take 4-D inputs only; a 3-D call falls
        # back to the math kernel, which materialises the n x n scores: the likely cause of the ~22 TFLOP/s eager
        # encoder measured on an H200 (benchmarks/results/2026-11-30-h200), not re-measured yet
        return t.transpose(0, 1).unsqueeze(0)

    outs = [F.scaled_dot_product_attention(heads_first(q[a:b]), heads_first(k[a:b]), heads_first(v[a:b]),
                                           scale=scale)[0].transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])]
    end = bounds[-1] if len(bounds) else 0
    if end < q.shape[0]:
        outs.append(q.new_zeros(q.shape[0] - end, *q.shape[1:]))
    return torch.cat(outs) if outs else q[:0].clone()


def block_diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
                             ) -> torch.Tensor:
    """The same as `per_image_attention` in one SDPA call with a block-diagonal mask built on cu_seqlens' device
    (no host read, so it can be captured). Rows past `cu_seqlens[-1]` are graph padding: they come out 0 (they attend
    to their own block here, then are zeroed; the Triton kernel skips them)."""
    rows = torch.arange(q.shape[0], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    image = torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)  # image index of every row
    mask = image[:, None] == image[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=q.shape[-1] ** -0.5)[0]  # 4-D: see per_image_attention
    padding = image == cu_seqlens.numel() - 1  # past cu_seqlens[-1]
    return out.transpose(0, 1).masked_fill(padding[:, None, None], 0)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Attention within each packed image, none across images: per image when `cu_seqlens` is a host (CPU)
    tensor; with it on the device (graph capture: no host read allowed), on CUDA the kernel
    `DSV4_ENCODER_GRAPH_ATTENTION` names (FlashAttention's varlen forward where it takes q, else the Triton
    varlen kernel), else the block-diagonal masked SDPA (the reference; O(rows^2), so only for small
    inputs off CUDA)."""
    if cu_seqlens.device.type == "cpu":
        return per_image_attention(q, k, v, cu_seqlens.tolist())
    if cu_seqlens.is_cuda and varlen_ops.GRAPH_ATTENTION == "flash" and flash_supported(q):
        return varlen_attention_flash(q, k, v, cu_seqlens)
    if cu_seqlens.is_cuda and q.is_cuda and HAS_TRITON:
        return varlen_attention_triton(q, k, v, cu_seqlens)
    return block_diagonal_attention(q, k, v, cu_seqlens)


# ---- ViT -------------------------------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """Linear patch projection (no class token, no absolute position table)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    """Fused qkv, 2D rope on q and k, full attention within each image, output projection (all with biases)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if vf.use_fused(x):  # CUDA: q and k roped in one launch (dsv4/ops/vision_fused.py), the same bits
            q, k, v = vf.vision_qk_rope(self.wqkv(x), cos, sin, self.num_heads, self.head_dim)
            return self.wo(varlen_attention(q, k, v, cu_seqlens).reshape(n, -1))
        q, k, v = (t.reshape(n, self.num_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        o = varlen_attention(apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin), v, cu_seqlens)
        return self.wo(o.reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU: w1 gives [gate | up] (no bias), silu(gate) * up, then w2."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if vf.use_fused(x):  # CUDA: silu(gate) * up in one launch
            return self.w2(vf.silu_mul(self.w1(x)))
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm block: x += attn(norm1(x)); x += mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))

    def forward_fused(self, x: torch.Tensor, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cu_seqlens: torch.Tensor, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with each residual add fused with the norm after it (`vision_fused.add_rms_norm`): x, its
        norm1 `xn` -> (the block's output, `next_norm` of it: the next block's norm1 or the tower's final norm).
        The same values as `forward` then `next_norm`."""
        x, xn = vf.add_rms_norm(x, self.attn(xn, cos, sin, cu_seqlens), self.norm2.weight, self.norm2.eps)
        return vf.add_rms_norm(x, self.mlp(xn), next_norm.weight, next_norm.eps)


class VisionTower(nn.Module):
    """The ViT (model.md 8.2): patch embedding, `num_hidden_layers` blocks, final RMSNorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """patches [sum nh*nw, 3*p*p] (or [.., 3, p, p]) of the images in `grids` order, each row-major ->
        features [sum nh*nw, hidden_size] in the weights' dtype."""
        grids = _check_grids(grids)
        total = sum(h * w for h, w in grids)
        if patches.shape[0] != total or patches[:1].numel() not in (0, self.cfg.patch_dim):
            raise ValueError(f"patches {list(patches.shape)} do not fit grids {grids}: expected [{total}, "
                             f"{self.cfg.patch_dim}]")
        weight = self.patch_embed.proj.weight
        positions = vision_positions(grids).to(weight.device)
        cos, sin = vision_rope(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return self.forward_packed(patches, cos, sin, cu_seqlens_of(grids))

    def forward_packed(self, patches: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The tower on prepared packed inputs: patches [n, 3*p*p], rope cos/sin [n, head_dim/2] (`vision_rope`),
        cu_seqlens int32 [images + 1] (host for the per-image path, device for the masked graph-safe path)."""
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(patches.reshape(patches.shape[0], -1).to(device=weight.device, dtype=weight.dtype))
        if vf.use_fused(x) and len(self.blocks):
            # CUDA: every residual add runs with the norm that follows it (the next block's norm1, the final norm
            # after the last block) in one launch; with the fused rope and SwiGLU, a block's elementwise work is
            # four launches instead of ~24 (dsv4/ops/vision_fused.py)
            nexts = [b.norm1 for b in self.blocks[1:]] + [self.norm]
            xn = self.blocks[0].norm1(x)
            for block, next_norm in zip(self.blocks, nexts):
                x, xn = block.forward_fused(x, xn, cos, sin, cu_seqlens, next_norm)
            return xn
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.norm(x)


# ---- aligner ---------------------------------------------------------------------------------------------------
def merge_index(grids: Sequence[Grid], ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather plan of the aligner over packed images (host tensors): for every aligner row (images in order, r x r
    blocks row-major), the packed feature row of each of its r*r cells in (ky, kx) order [rows, r*r] int64, and
    whether the cell lies inside its image [rows, r*r] bool (outside = the zero padding)."""
    idx, inside, offset = [], [], 0
    for h, w in _check_grids(grids):
        lh, lw = -(-h // ratio), -(-w // ratio)
        ys = (torch.arange(lh)[:, None, None, None] * ratio + torch.arange(ratio)[None, None, :, None])
        xs = (torch.arange(lw)[None, :, None, None] * ratio + torch.arange(ratio)[None, None, None, :])
        ys, xs = torch.broadcast_tensors(ys, xs)  # [lh, lw, r, r]
        ok = (ys < h) & (xs < w)
        idx.append(torch.where(ok, offset + ys * w + xs, 0).reshape(lh * lw, ratio * ratio))
        inside.append(ok.reshape(lh * lw, ratio * ratio))
        offset += h * w
    if not idx:
        return torch.zeros(0, ratio * ratio, dtype=torch.int64), torch.zeros(0, ratio * ratio, dtype=torch.bool)
    return torch.cat(idx), torch.cat(inside)


class Aligner(nn.Module):
    """Pixel-unshuffle by `downsample_ratio` r, then w1 -> exact GELU -> w2 (model.md 8.3)."""

    def __init__(self, cfg: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.ratio = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.ratio**2, hidden_size, bias=True)
        self.w2 = nn.Linear(hidden_size, hidden_size, bias=True)

    def mlp(self, blocks: torch.Tensor) -> torch.Tensor:
        """[rows, dim*r*r] -> [rows, hidden]."""
        return self.w2(F.gelu(self.w1(blocks), approximate="none"))

    def unshuffle(self, features: torch.Tensor, nh: int, nw: int) -> torch.Tensor:
        """One image's features [nh*nw, dim] -> blocks [lh*lw, dim*r*r], lh = ceil(nh/r), lw = ceil(nw/r): grid
        [dim, nh, nw] zero-padded right/bottom to multiples of r, r x r blocks in row-major block order, each
        flattened channel-major (c, ky, kx)."""
        if nh <= 0 or nw <= 0 or features.dim() != 2 or features.shape[0] != nh * nw:
            raise ValueError(f"aligner input {list(features.shape)} does not fit a {nh}x{nw} grid")
        r, dim = self.ratio, features.shape[1]
        lh, lw = -(-nh // r), -(-nw // r)
        grid = F.pad(features.reshape(nh, nw, dim).permute(2, 0, 1), (0, lw * r - nw, 0, lh * r - nh))
        return grid.reshape(dim, lh, r, lw, r).permute(1, 3, 0, 2, 4).reshape(lh * lw, dim * r * r)

    def forward(self, features: torch.Tensor, nh: int, nw: int) -> torch.Tensor:
        """One image's features [nh*nw, dim] -> aligner rows [lh*lw, hidden] in reading order."""
        return self.mlp(self.unshuffle(features, nh, nw))

    def forward_packed(self, features: torch.Tensor, merge_idx: torch.Tensor, merge_mask: torch.Tensor) -> torch.Tensor:
        """All images at once from `merge_index` (device tensors; no host read): [n, dim] -> [rows, hidden]."""
        cells = features[merge_idx].masked_fill(~merge_mask[..., None], 0)  # [rows, r*r, dim]
        return self.mlp(cells.transpose(1, 2).reshape(cells.shape[0], -1))  # channel-major (c, ky, kx)


# ---- the encoder -----------------------------------------------------------------------------------------------
class VisionEncoder(nn.Module):
    """ViT + aligner + the learned span delimiters; state-dict names = model.md 10.2 (`vision.*`, `aligner.*`,
    `image_start`, `image_end`, `image_newline`). `hidden_size` is the text model's."""

    def __init__(self, cfg: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTower(cfg)
        self.aligner = Aligner(cfg, hidden_size)
        # fp32 as shipped; cast to the activations' dtype where used.
        self.image_start = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        self.image_end = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        self.image_newline = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))

    def llm_grid(self, nh: int, nw: int) -> Grid:
        """(lh, lw) aligner rows and columns of an nh x nw patch grid."""
        r = self.cfg.downsample_ratio
        return -(-nh // r), -(-nw // r)

    def encode(self, patches: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        """Aligner rows [lh*lw, hidden] per image: one packed ViT pass over all images, then the aligner per image."""
        grids = _check_grids(grids)
        if not grids:
            return []
        features = self.vision(patches, grids).split([h * w for h, w in grids])
        return [self.aligner(f, h, w) for f, (h, w) in zip(features, grids)]

    def span_embeddings(self, rows: torch.Tensor, lh: int, lw: int) -> torch.Tensor:
        """One image's span [lh*(lw+1)+2, hidden] in the layout [START] + ([IMAGE]*lw + [NEW_LINE])*lh + [END]:
        aligner rows at the IMAGE slots in reading order, a NEW_LINE after every row (the last included)."""
        if rows.shape[0] != lh * lw:
            raise ValueError(f"{rows.shape[0]} aligner rows do not fill a {lh}x{lw} grid")
        dt, hidden = rows.dtype, rows.shape[-1]
        newline = self.image_newline.to(dt).expand(lh, 1, hidden)
        body = torch.cat([rows.reshape(lh, lw, hidden), newline], dim=1).reshape(lh * (lw + 1), hidden)
        return torch.cat([self.image_start.to(dt)[None], body, self.image_end.to(dt)[None]])

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        """Span embeddings per image (`encode`, then `span_embeddings`), in the weights' dtype."""
        grids = _check_grids(grids)
        return [self.span_embeddings(rows, *self.llm_grid(h, w))
                for rows, (h, w) in zip(self.encode(patches, grids), grids)]

