"""KV cache groups: what each group stores, how blocks map to tokens, and whether it can be prefix-cached.

A group is a set of layers that share one block table per request. DeepSeek-V4 has three kinds:
- `window`: every layer's sliding-window K=V latent, one row per token (block = `block_size` tokens);
- `compressed`: the compressed entries (and, for CSA, the indexer keys) of the layers with one compress
  ratio r, one row per r tokens (block = `block_size` entries = `block_size * r` tokens, so any block size
  works with any ratio);
- `state`: the compressors' open-window rows (and CSA overlap rows), a per-request ring of fixed size: one
  block per request, never prefix-cacheable.

Prefix caching (dsv4.kv.prefix_cache): V4.1's compressed groups are exact functions of the prefix and cacheable;
the window group is not (a layer's window KV depends on the previous layer's window) and is rebuilt after a hit
by replaying the hit's last `prefix_replay_tokens` tokens. V4's compressed groups are not cacheable either: a V4
compressor also carries open-window and CSA overlap rows across every boundary, which a hit would have to restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4.models.config import CSA, ModelConfig

WINDOW = "window"
COMPRESSED = "compressed"
STATE = "state"
NULL_BLOCK = 0  # block 0 of every pool is never handed out: tables are padded with it
PAD_SLOT = -1  # slot-mapping value meaning "no KV write for this token"
TRASH_SLOT = 0  # slot 0 of the null block: writes that must land nowhere (padding rows, no closed group) go here


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group."""

    name: str
    kind: str  # WINDOW | COMPRESSED | STATE
    layer_ids: tuple[int, ...]
    block_size: int  # rows per block: tokens (window), entries (compressed), ring rows (state)
    tokens_per_row: int = 1  # the compress ratio for compressed groups
    num_blocks: int = 0  # pool size including the null block
    prefix_cacheable: bool = False  # its blocks may be shared by requests with the same prefix
    prefix_replay_tokens: int = 0  # window group under prefix caching: a hit's last tokens computed again
    sliding_window: int = 0  # window group: a token reads the W tokens up to itself, so older blocks are freed
    ring_slack: int = 0  # state group: ring rows past each compressor's window (`ring_slack`)

    def first_live_block(self, num_computed: int) -> int:
        """Blocks before this one hold only positions no future query reads (those before num_computed - W + 1,
        the oldest key of the next token's window): a window group frees them."""
        if self.kind != WINDOW or self.sliding_window <= 0:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request needs once `num_tokens` tokens have been computed."""
        if self.kind == STATE:
            return 1
        rows = num_tokens // self.tokens_per_row
        return math.ceil(rows / self.block_size)


@dataclass(frozen=True)
class LayerCacheLayout:
    """What one layer keeps in the cache besides its window KV."""

    ratio: int = 0  # the layer owns compressed entries, one per `ratio` tokens (0: none)
    index_keys: bool = False  # ...and indexer keys next to them
    ring_rows: int = 0  # compressor open-window rows per request (0: no state)
    ring_width: int = 0  # channels of one ring row (kv and gate each)
    index_ring_width: int = 0  # V4 CSA: the indexer's own compressor ring (0: none)


def ring_slack(num_speculative_tokens: int | None) -> int:
    """Rows a compressor ring keeps past its window under speculation: k + 1. A verify step writes the ring rows of
    its k + 1 positions (slot = position % rows), rejected drafts' included; with the slack those slots held
    positions at least one window older than any the next step reads, so nothing has to be restored after a
    rejection (the rejected positions are recomputed before they are read, dsv4/spec_decode/speculator.py)."""
    return num_speculative_tokens + 1 if num_speculative_tokens else 0


def layer_cache_layout(model: ModelConfig, layer: int, slack: int = 0) -> LayerCacheLayout:
    """V4: every CSA/HCA layer owns its entries (CSA pools two overlapping windows, so its ring holds 2*ratio
    rows). V4.1: only KV-source layers own entries and keys; ratio 2 keeps one open pair, ratio 1 no state. A ring
    is `slack` rows longer than its window (`ring_slack`)."""
    r = model.compress_ratios[layer]
    if r == 0:
        return LayerCacheLayout()
    if model.v41 is not None:
        if layer not in model.v41.kv_source_layer_ids:
            return LayerCacheLayout()
        rows = r + slack if r > 1 else 0
        return LayerCacheLayout(r, layer in model.v41.index_source_layer_ids, rows, model.head_dim if rows else 0)
    if model.layer_types[layer] == CSA:
        return LayerCacheLayout(r, True, 2 * r + slack, 2 * model.head_dim, 2 * model.index_head_dim)
    return LayerCacheLayout(r, False, r + slack, model.head_dim)


def replay_tokens(model: ModelConfig, bounded: bool) -> int:
    """Tokens of a prefix hit computed again to rebuild the window KV. Bounded replay (vLLM's): the last window,
    W; the replayed tokens see windows cut at the replay start, so the window KV of layers >= 1 is approximate.
    Exact: a token's window KV at layer l depends on inputs as far as l * (W - 1) tokens back, so replaying
    n_layers * (W - 1) tokens rebuilds the last window of every layer as a cold prefill computes it."""
    W = model.sliding_window
    return W if bounded else model.num_hidden_layers * (W - 1)


def make_kv_groups(model: ModelConfig, block_size: int, num_blocks: int, max_num_seqs: int,
                   prefix_replay_tokens: int = 0, slack: int = 0) -> tuple[KVGroupSpec, ...]:
    """The KV groups of a model, with pool sizes derived from the window pool's `num_blocks`.
    `prefix_replay_tokens` > 0 (prefix caching on, see `replay_tokens`) marks V4.1's compressed groups
    prefix-cacheable and the window group replayed. `slack`: the compressor rings' extra rows (`ring_slack`)."""
    n = model.num_hidden_layers
    layouts = [layer_cache_layout(model, i, slack) for i in range(n)]
    cacheable = prefix_replay_tokens > 0 and model.v41 is not None
    groups = [KVGroupSpec("window", WINDOW, tuple(range(n)), block_size, 1, num_blocks, prefix_cacheable=False,
                          prefix_replay_tokens=prefix_replay_tokens if cacheable else 0,
                          sliding_window=model.sliding_window)]
    for r in sorted({lay.ratio for lay in layouts if lay.ratio > 0}):
        layers = tuple(i for i in range(n) if layouts[i].ratio == r)
        # a compressed block covers block_size*r tokens; +1 partially filled block per request of slack
        blocks = math.ceil((num_blocks - 1) / r) + max_num_seqs + 1
        groups.append(KVGroupSpec(f"compressed_{r}", COMPRESSED, layers, block_size, r, blocks,
                                  prefix_cacheable=cacheable))
    ring_layers = tuple(i for i in range(n) if layouts[i].ring_rows > 0)
    if ring_layers:
        rows = max(layouts[i].ring_rows for i in ring_layers)
        groups.append(KVGroupSpec("compressor_state", STATE, ring_layers, rows, 1, max_num_seqs + 1,
                                  prefix_cacheable=False, ring_slack=slack))
    return tuple(groups)
