"""Rotary tables (cos/sin from positions); the rotation itself is `dsv4.ops.rope.apply_rope`."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from dsv4.models.config import RopeConfig

# cos|sin of positions [0, P) per (configuration, device, P), shared by every RotaryTable of that configuration (a
# model has one or two configurations but a table per layer). Weak values: a table lives as long as a model uses it.
_SHARED: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


class RotaryTable(nn.Module):
    """cos/sin of one rope configuration in fp32 (like the reference): computed from the positions on demand, or,
    once `prepare`d, gathered from a precomputed table: one kernel per lookup instead of four (cast, multiply, cos,
    sin), which a decode step makes once per layer and compressor. The table holds exactly the values the
    on-demand path computes (the same elementwise ops on the same device)."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, cfg.dim
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq(), dtype=torch.float32), persistent=False)
        self.table: torch.Tensor | None = None  # [P, dim] = cos | sin; not a buffer: not saved, shared

    def reset(self) -> None:
        """Recompute the frequencies in place (after the module was materialized from the meta device)."""
        self.inv_freq.copy_(torch.tensor(self.cfg.inv_freq(), dtype=torch.float32))
        self.table = None

    def prepare(self, max_positions: int) -> None:
        """Precompute positions [0, max_positions): every later lookup must stay below it (the engine's
        max_model_len bounds every position it computes)."""
        key = (self.cfg, str(self.inv_freq.device), max_positions)
        table = _SHARED.get(key)
        if table is None:
            cos, sin = self._compute(torch.arange(max_positions, device=self.inv_freq.device))
            table = torch.cat([cos, sin], dim=-1)
            _SHARED[key] = table
        self.table = table

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) [..., dim/2] in fp32 (views of one gather when prepared)."""
        if self.table is None:
            return self._compute(positions)
        if positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling():
            self._check_range(positions)
        rows = self.table[positions]
        half = self.table.shape[-1] // 2
        return rows[..., :half], rows[..., half:]


    def _check_range(self, positions: torch.Tensor) -> None:
        """A position outside the table would wrap (negative) or fail (too large). Checked only where it costs no
        device sync (CPU tensors), so the CPU tests catch a caller that breaks the bound."""
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= self.table.shape[0]:
            raise IndexError(f"rope positions [{lo}, {hi}] outside the prepared table [0, {self.table.shape[0]})")


def prepare_rope_tables(model: nn.Module, max_positions: int) -> None:
    """`prepare` every rotary table of a model for positions below `max_positions`."""
    for module in model.modules():
        if isinstance(module, RotaryTable):
            module.prepare(max_positions)


def rope_once(found: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]], rope: RotaryTable,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope's (cos, sin) at a decode step's positions (the same tensor in every layer of one forward), looked up once
    per rope configuration into `found` (a dict that lives for that forward): each lookup is a gather launch on a
    layer's critical chain, before its first product."""
    if rope.cfg not in found:
        found[rope.cfg] = rope(positions)
    return found[rope.cfg]
