"""Interleaved-pair RoPE on the trailing channels of a vector, and its inverse."""

from __future__ import annotations

import torch
from torch import nn

from dsv4.models.config import RopeConfig


class RotaryTable(nn.Module):
    """cos/sin of one rope configuration, computed from positions on demand (fp32, like the reference)."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, cfg.dim
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq(), dtype=torch.float32), persistent=False)

    def reset(self) -> None:
        """Recompute the table in place (after the module was materialized from the meta device)."""
        self.inv_freq.copy_(torch.tensor(self.cfg.inv_freq(), dtype=torch.float32))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) [..., dim/2] in fp32."""
        freqs = positions.float()[..., None] * self.inv_freq
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing `2*cos.shape[-1]` channels of x in interleaved pairs (2i, 2i+1).

    x: [T, ..., D]; cos/sin: [T, D_rope/2]. cos/sin are rounded to x's dtype first and the rotation runs in
    fp32, then the result is cast back: this matches the reference bit for bit in fp32 and closely in bf16.
    `inverse` rotates by -angle (used to undo the rope carried by V on the attention output).
    """
    rd = 2 * cos.shape[-1]
    cos = cos.to(x.dtype).float()
    sin = sin.to(x.dtype).float()
    if inverse:
        sin = -sin
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope = x[..., -rd:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)
