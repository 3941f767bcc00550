"""The KV cache tensors of every layer, allocated from the KV group specs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.kv.spec import COMPRESSED, STATE, WINDOW, KVGroupSpec, layer_cache_layout
from dsv4.models.config import ModelConfig


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
    """Zero-filled caches for every layer, sized by the group pools. Ring gates are fp32 (pre-softmax)."""
    window = next(g for g in groups if g.kind == WINDOW)
    state = next((g for g in groups if g.kind == STATE), None)
    slack = state.ring_slack if state is not None else 0
    caches = []
    for layer in range(cfg.num_hidden_layers):
        c = LayerKVCache(window=torch.zeros(window.num_blocks * window.block_size, cfg.head_dim, dtype=dtype,
                                            device=device))
        lay = layer_cache_layout(cfg, layer, slack)
        if lay.ratio > 0:
            g = next(g for g in groups if g.kind == COMPRESSED and layer in g.layer_ids)
            slots = g.num_blocks * g.block_size
            c.compressed = torch.zeros(slots, cfg.head_dim, dtype=dtype, device=device)
            if lay.index_keys:
                c.index_keys = torch.zeros(slots, cfg.index_head_dim, dtype=dtype, device=device)
        if lay.ring_rows > 0:
            shape = (state.num_blocks, lay.ring_rows, lay.ring_width)
            ring_dtype = torch.float32 if cfg.v41 is not None else dtype  # V4.1 keeps the open pair in fp32
            c.ring_kv = torch.zeros(shape, dtype=ring_dtype, device=device)
            c.ring_gate = torch.zeros(shape, dtype=torch.float32, device=device)
            if lay.index_ring_width:
                ishape = (state.num_blocks, lay.ring_rows, lay.index_ring_width)
                c.index_ring_kv = torch.zeros(ishape, dtype=dtype, device=device)
                c.index_ring_gate = torch.zeros(ishape, dtype=torch.float32, device=device)
        caches.append(c)
    return caches


def kv_cache_bytes(cfg: ModelConfig, groups: tuple[KVGroupSpec, ...], dtype: torch.dtype) -> int:
    """Bytes `allocate_kv_caches` takes for these groups (the same layout rules, without allocating)."""
    elem = torch.empty((), dtype=dtype).element_size()
    window = next(g for g in groups if g.kind == WINDOW)
    state = next((g for g in groups if g.kind == STATE), None)
    slack = state.ring_slack if state is not None else 0
    total = 0
    for layer in range(cfg.num_hidden_layers):
        total += window.num_blocks * window.block_size * cfg.head_dim * elem
        lay = layer_cache_layout(cfg, layer, slack)
        if lay.ratio > 0:
            g = next(g for g in groups if g.kind == COMPRESSED and layer in g.layer_ids)
            dims = cfg.head_dim + (cfg.index_head_dim if lay.index_keys else 0)
            total += g.num_blocks * g.block_size * dims * elem
        if lay.ring_rows > 0:
            ring_elem = 4 if cfg.v41 is not None else elem
            total += state.num_blocks * lay.ring_rows * lay.ring_width * (ring_elem + 4)
            if lay.index_ring_width:
                total += state.num_blocks * lay.ring_rows * lay.index_ring_width * (elem + 4)
    return total
