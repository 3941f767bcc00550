"""The KV cache tensors of every layer, allocated from the KV group specs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec, state_ring_rows
from dsv4.models.config import CSA, ModelConfig


@dataclass
class LayerKVCache:
    """One layer's cache. Slots are `block_id * block_size + row` of the layer's group."""

    window: torch.Tensor  # [window slots, head_dim]: post-rope K=V latent per token
    compressed: torch.Tensor | None = None  # [entry slots, head_dim]: pooled, normed, roped entries
    index_keys: torch.Tensor | None = None  # [entry slots, index_head_dim] (CSA)
    ring_kv: torch.Tensor | None = None  # [state blocks, ring rows, coff*head_dim]: raw compressor rows
    ring_gate: torch.Tensor | None = None  # same shape, fp32: raw gate rows (position bias added at pooling)
    index_ring_kv: torch.Tensor | None = None  # [state blocks, ring rows, 2*index_head_dim] (CSA)
    index_ring_gate: torch.Tensor | None = None


def allocate_kv_caches(cfg: ModelConfig, groups: tuple[KVGroupSpec, ...], dtype: torch.dtype,
                       device: torch.device | str) -> list[LayerKVCache]:
    """Zero-filled caches for every layer, sized by the group pools."""
    by_kind = {}
    for g in groups:
        by_kind.setdefault(g.kind, []).append(g)
    window = by_kind[WINDOW][0]
    caches = []
    for layer in range(cfg.num_hidden_layers):
        c = LayerKVCache(window=torch.zeros(window.num_blocks * window.block_size, cfg.head_dim, dtype=dtype,
                                            device=device))
        ratio = cfg.compress_ratios[layer]
        if ratio > 0:
            is_csa = cfg.layer_types[layer] == CSA
            g = next(g for g in by_kind[COMPRESSED] if layer in g.layer_ids)
            slots = g.num_blocks * g.block_size
            c.compressed = torch.zeros(slots, cfg.head_dim, dtype=dtype, device=device)
            st = by_kind[STATE][0]
            ring = state_ring_rows(ratio, is_csa)
            coff = 2 if is_csa else 1
            c.ring_kv = torch.zeros(st.num_blocks, ring, coff * cfg.head_dim, dtype=dtype, device=device)
            c.ring_gate = torch.zeros(st.num_blocks, ring, coff * cfg.head_dim, dtype=torch.float32, device=device)
            if is_csa:
                c.index_keys = torch.zeros(slots, cfg.index_head_dim, dtype=dtype, device=device)
                c.index_ring_kv = torch.zeros(st.num_blocks, ring, 2 * cfg.index_head_dim, dtype=dtype,
                                              device=device)
                c.index_ring_gate = torch.zeros(st.num_blocks, ring, 2 * cfg.index_head_dim, dtype=torch.float32,
                                                device=device)
        caches.append(c)
    return caches
