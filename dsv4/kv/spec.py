"""KV cache groups: what each group stores, how blocks map to tokens, and whether it can be prefix-cached.

A group is a set of layers that share one block table per request. DeepSeek-V4 has three kinds:
- `window`: every layer's sliding-window K=V latent, one row per token (block = `block_size` tokens);
- `compressed`: the compressed entries (and, for CSA, the indexer keys) of the layers with one compress
  ratio r, one row per r tokens (block = `block_size` entries = `block_size * r` tokens, so any block size
  works with any ratio);
- `state`: the compressors' open-window rows (and CSA overlap rows), a per-request ring of fixed size: one
  block per request, never prefix-cacheable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4.models.config import SLIDING, ModelConfig

WINDOW = "window"
COMPRESSED = "compressed"
STATE = "state"
NULL_BLOCK = 0  # block 0 of every pool is never handed out: tables are padded with it
PAD_SLOT = -1  # slot-mapping value meaning "no KV write for this token"


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group."""

    name: str
    kind: str  # WINDOW | COMPRESSED | STATE
    layer_ids: tuple[int, ...]
    block_size: int  # rows per block: tokens (window), entries (compressed), ring rows (state)
    tokens_per_row: int = 1  # the compress ratio for compressed groups
    num_blocks: int = 0  # pool size including the null block
    prefix_cacheable: bool = True
    prefix_replay_tokens: int = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request needs once `num_tokens` tokens have been computed."""
        if self.kind == STATE:
            return 1
        rows = num_tokens // self.tokens_per_row
        return math.ceil(rows / self.block_size)


def state_ring_rows(ratio: int, is_csa: bool) -> int:
    """Ring capacity of a compressor's open-window state: CSA pools two windows (overlap), HCA one."""
    return 2 * ratio if is_csa else ratio


def make_kv_groups(model: ModelConfig, block_size: int, num_blocks: int, max_num_seqs: int) -> tuple[KVGroupSpec, ...]:
    """The KV groups of a DeepSeek-V4 model, with pool sizes derived from the window pool's `num_blocks`."""
    n = model.num_hidden_layers
    groups = [KVGroupSpec("window", WINDOW, tuple(range(n)), block_size, 1, num_blocks)]
    for r in model.compressed_ratios:
        layers = tuple(i for i in range(n) if model.compress_ratios[i] == r)
        # a compressed block covers block_size*r tokens; +1 partially filled block per request of slack
        blocks = math.ceil((num_blocks - 1) / r) + max_num_seqs + 1
        groups.append(KVGroupSpec(f"compressed_{r}", COMPRESSED, layers, block_size, r, blocks))
    compressed_layers = tuple(i for i in range(n) if model.layer_types[i] != SLIDING)
    if compressed_layers:
        ring = max(state_ring_rows(model.compress_ratios[i], model.compress_ratios[i] > 0 and
                                   model.layer_types[i] == "compressed_sparse_attention") for i in compressed_layers)
        groups.append(KVGroupSpec("compressor_state", STATE, compressed_layers, ring, 1, max_num_seqs + 1,
                                  prefix_cacheable=False))
    return tuple(groups)
