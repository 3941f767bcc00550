"""The vision encoder's FLOP model (dsv4.bench.vision_flops) against torch's FlopCounterMode over a real encode on the
CPU, component by component; attention through a matmul transcription of per-image attention (the CPU SDPA kernel
is not one FlopCounterMode counts)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dsv4.bench.vision_flops import EncoderFlops, encoder_flops
from dsv4.models import vision
from dsv4.models.vision import VisionConfig, VisionEncoder, cu_seqlens_of, vision_positions, vision_rope

CFG = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                   max_image_tokens=64, min_pixels=14 * 14 * 9 * 4)
HIDDEN = 40


def _matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Per-image attention as two batched matmuls a image (what FlopCounterMode counts), padding rows zero."""
    out = q.new_zeros(q.shape)
    for a, b in pairwise(bounds):
        qh, kh, vh = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        p = torch.softmax(qh @ kh.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        out[a:b] = (p @ vh).transpose(0, 1)
    return out


def _counts(fc: FlopCounterMode) -> dict[str, int]:
    """Counted FLOPs by component, from the per-module table."""
    per_module = {name: sum(ops.values()) for name, ops in fc.get_flop_counts().items()}
    blocks = sum(per_module.get(f"VisionEncoder.vision.blocks.{i}", 0) for i in range(CFG.num_hidden_layers))
    return {"patch_embed": per_module.get("VisionEncoder.vision.patch_embed", 0), "blocks": blocks,
            "aligner": per_module.get("VisionEncoder.aligner", 0), "total": fc.get_total_flops()}


@pytest.fixture
def encoder(monkeypatch: pytest.MonkeyPatch) -> VisionEncoder:
    monkeypatch.setattr(vision, "per_image_attention", _matmul_attention)
    torch.manual_seed(0)
    return VisionEncoder(CFG, HIDDEN).eval()


@pytest.mark.parametrize("grids", [[(6, 6)], [(7, 8), (6, 6)], [(5, 4), (3, 9), (10, 2)]])
def test_encoder_flops_match_the_counter(encoder: VisionEncoder, grids: list[tuple[int, int]]) -> None:
    patches = torch.randn(sum(h * w for h, w in grids), CFG.patch_dim)
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        encoder(patches, grids)
    counted, model = _counts(fc), encoder_flops(CFG, HIDDEN, grids)
    assert counted["patch_embed"] == model.patch_embed
    assert counted["blocks"] == model.tower_linear + model.attention
    assert counted["aligner"] == model.aligner
    assert counted["total"] == model.total


def test_attention_is_per_image_and_quadratic(encoder: VisionEncoder) -> None:
    one, two = encoder_flops(CFG, HIDDEN, [(6, 6)]), encoder_flops(CFG, HIDDEN, [(6, 6), (6, 6)])
    big = encoder_flops(CFG, HIDDEN, [(12, 6)])  # the same patches as the two images, in one image
    assert two.attention == 2 * one.attention and big.attention == 2 * two.attention
    assert two.tower_linear == big.tower_linear == 2 * one.tower_linear


def test_padded_rows_count_in_the_linear_layers_only(encoder: VisionEncoder) -> None:
    """A graph's buffers: the tower over `rows` patch rows (the tail padding), attention on the images' own."""
    grids, rows = [(7, 8), (6, 6)], 128
    real = sum(h * w for h, w in grids)
    patches = torch.cat([torch.randn(real, CFG.patch_dim), torch.zeros(rows - real, CFG.patch_dim)])
    positions = torch.cat([vision_positions(grids), torch.zeros(rows - real, 2, dtype=torch.long)])
    cos, sin = vision_rope(positions, CFG.head_dim, CFG.rope_theta)
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        encoder.vision.forward_packed(patches, cos, sin, cu_seqlens_of(grids))
    model = encoder_flops(CFG, HIDDEN, grids, patch_rows=rows)
    assert fc.get_total_flops() == model.patch_embed + model.tower_linear + model.attention
    assert model.tower_linear == encoder_flops(CFG, HIDDEN, grids).tower_linear * rows // real
    assert model.attention == encoder_flops(CFG, HIDDEN, grids).attention
    assert encoder_flops(CFG, HIDDEN, grids, aligner_rows=40).aligner == 2 * 40 * (32 * 9 * HIDDEN + HIDDEN**2)


def test_released_shape_by_hand() -> None:
    """One 896x896 image (64x64 patches, 22x22 aligner rows) of the released tower, written out."""
    cfg = VisionConfig()
    got = encoder_flops(cfg, 5120, [(64, 64)])
    n, d = 4096, 1024
    assert got == EncoderFlops(patch_embed=2 * n * 588 * d,
                               tower_linear=2 * 32 * n * (3 * d * d + d * d + 2 * 2816 * d + 2816 * d),
                               attention=4 * 32 * d * n * n, aligner=2 * 484 * (9 * d * 5120 + 5120 * 5120))
    assert got.to_json()["total"] == got.total


def test_too_few_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 72 patches"):
        encoder_flops(CFG, HIDDEN, [(8, 9)], patch_rows=71)
    with pytest.raises(ValueError, match="aligner rows"):
        encoder_flops(CFG, HIDDEN, [(8, 9)], aligner_rows=8)
