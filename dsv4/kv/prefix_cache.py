"""PrefixCache: reuse the KV of a prompt prefix another request already computed.

Only prefix-cacheable groups take part (V4.1's compressed entries and indexer keys: exact functions of the
prefix); the window group is rebuilt by replay instead (runtime.md 2, model.md 9.3) and the compressor rings are
per request. Prefixes are cached in UNITS of `unit_tokens` tokens, the least common multiple of every cacheable
group's block span (block_size * compress ratio tokens), so a unit boundary is a block boundary in every group
and closes a whole compress window in each: the entries before it are complete and no open state crosses it.

A unit is identified by a chained hash: hash(parent unit's hash, its token ids, the content hashes of the images
overlapping it). A lookup walks a request's units from the start and stops at the first miss; each hit also
compares the stored parent hash and tokens, so a hash collision can only ever shorten a hit, never serve KV of
other tokens. Cached blocks keep their contents after their last owner frees them and stay in the pool's free
queue: a hit takes them back (`BlockPool.incr_ref`), and when the queue hands one out for new contents
(`BlockPool.on_reuse`) the unit it belongs to is forgotten (lazy eviction, least recently freed first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsv4.kv.block_pool import BlockPool
from dsv4.kv.spec import KVGroupSpec

_ROOT = 0x5D5F4  # the parent hash of a prompt's first unit


@dataclass(frozen=True)
class CachedUnit:
    """One cached unit: what it holds (checked on every hit) and where (blocks per cacheable group)."""

    key: int
    parent: int
    tokens: tuple[int, ...]
    images: tuple[str, ...]  # content hashes of the images overlapping the unit
    blocks: tuple[tuple[int, ...], ...]  # one tuple per cacheable group, in PrefixCache.group_ids order


class PrefixCache:
    """The cached units of the prefix-cacheable groups among `groups` (whose block pools are `pools`)."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], pools: tuple[BlockPool, ...]) -> None:
        self.group_ids = tuple(i for i, g in enumerate(groups) if g.prefix_cacheable)
        assert self.group_ids, "no prefix-cacheable KV group"
        spans = [groups[i].block_size * groups[i].tokens_per_row for i in self.group_ids]
        self.unit_tokens = math.lcm(*spans)
        self.blocks_per_unit = tuple(self.unit_tokens // s for s in spans)
        self._units: dict[int, CachedUnit] = {}
        self._owner: dict[tuple[int, int], int] = {}  # (group index, block id) -> key of the unit it holds
        for gi in self.group_ids:
            pools[gi].on_reuse = lambda block, gi=gi: self._evict(gi, block)
        # metrics, in tokens: prompt tokens looked up and tokens served from the cache
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._units)

    # ---- keys ------------------------------------------------------------------------------------------------
    def extend_keys(self, keys: list[int], token_ids: Sequence[int], images: Sequence[Any] | None,
                    num_units: int) -> list[int]:
        """Extend `keys` (a request's unit keys so far, cached on the request) to its first `num_units` units."""
        U = self.unit_tokens
        while len(keys) < num_units:
            u = len(keys)
            parent = keys[-1] if keys else _ROOT
            keys.append(hash((parent, tuple(token_ids[u * U: (u + 1) * U]), _images_in(images, u * U, (u + 1) * U))))
        return keys

    # ---- lookup and insertion ---------------------------------------------------------------------------------
    def lookup(self, keys: list[int], token_ids: Sequence[int], images: Sequence[Any] | None,
               max_units: int) -> list[CachedUnit]:
        """The cached units of the longest cached prefix of at most `max_units` units (`keys` extended as
        needed)."""
        self.extend_keys(keys, token_ids, images, max_units)
        U, hit, parent = self.unit_tokens, [], _ROOT
        for u in range(max_units):
            unit = self._units.get(keys[u])
            if (unit is None or unit.parent != parent
                    or unit.tokens != tuple(token_ids[u * U: (u + 1) * U])
                    or unit.images != _images_in(images, u * U, (u + 1) * U)):
                break
            hit.append(unit)
            parent = unit.key
        return hit

    def insert(self, keys: list[int], token_ids: Sequence[int], images: Sequence[Any] | None, u: int,
               blocks: tuple[tuple[int, ...], ...]) -> bool:
        """Cache unit `u` of a request (its keys extended past u) held in `blocks`; False (nothing cached) if
        that prefix is cached already, in other blocks."""
        key = keys[u]
        if key in self._units:
            return False
        U = self.unit_tokens
        unit = CachedUnit(key, keys[u - 1] if u else _ROOT, tuple(token_ids[u * U: (u + 1) * U]),
                          _images_in(images, u * U, (u + 1) * U), blocks)
        self._units[key] = unit
        for gi, ids in zip(self.group_ids, blocks):
            for b in ids:
                self._owner[(gi, b)] = key
        return True

    def _evict(self, gi: int, block: int) -> None:
        """`block` of group `gi` gets new contents: forget the unit it held (all its blocks, every group)."""
        key = self._owner.pop((gi, block), None)
        if key is None:
            return
        unit = self._units.pop(key)
        for gj, ids in zip(self.group_ids, unit.blocks):
            for b in ids:
                self._owner.pop((gj, b), None)


def _images_in(images: Sequence[Any] | None, lo: int, hi: int) -> tuple[str, ...]:
    """Content hashes of the image spans overlapping token positions [lo, hi): the same token ids with another
    image are another prefix."""
    if not images:
        return ()
    return tuple(im.content_hash for im in images if im.offset < hi and im.offset + im.num_tokens > lo)
