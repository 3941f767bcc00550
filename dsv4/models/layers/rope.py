"""Rotary tables (cos/sin from positions); the rotation itself is `dsv4.ops.rope.apply_rope`."""

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
