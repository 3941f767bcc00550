"""Deterministic top-k: ties always go to the lowest index, so results never depend on row length."""

from __future__ import annotations

import torch


def stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, descending, ties broken toward the lowest index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]
