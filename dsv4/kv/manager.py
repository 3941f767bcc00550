"""KVCacheManager: one BlockPool per KV group, and each request's block list per group.

A request's blocks grow with its computed tokens, in every group at once: a step either gets all the blocks it
needs in all groups or none at all, so a failed allocation never leaves a request half-grown. The window group
also shrinks from the front: blocks that only hold positions older than every future query's window go back to
the pool and become the null block in the request's list (the runner keeps the stale ids, which nothing reads:
a query reads window positions (t - W, t] only).

With prefix caching (`enable_prefix_caching` and a prefix-cacheable group), a request admitted with a hit of H
tokens (`find_prefix`) starts at `replay_start` <= H (runtime.md 2.2): its prefix-cacheable groups share every hit
block (replayed range included) and get new blocks only for the tail; its window group holds the null block below
replay_start and fresh blocks from there (`allocate_with_prefix`). Each step's full units are cached
(`cache_blocks`), so later requests can hit them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsv4.kv.block_pool import BlockPool
from dsv4.kv.prefix_cache import CachedUnit, PrefixCache
from dsv4.kv.spec import NULL_BLOCK, STATE, WINDOW, KVGroupSpec

_NEVER = 1 << 62


class KVCacheManager:
    """Block allocation for the KV groups `groups` (pool sizes from `spec.num_blocks`)."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_chunk: int | None = None,
                 enable_prefix_caching: bool = False) -> None:
        """`max_chunk`: the most tokens a request computes in one step (the scheduler's token budget); it bounds
        the live blocks of a window group, so a long request fits a pool smaller than its whole length.
        `enable_prefix_caching` takes effect when some group is prefix-cacheable."""
        assert groups, "at least one KV group is needed"
        self.groups, self.max_chunk = groups, max_chunk
        self.pools = tuple(BlockPool(g.num_blocks) for g in groups)
        cacheable = enable_prefix_caching and any(g.prefix_cacheable for g in groups)
        self.prefix = PrefixCache(groups, self.pools) if cacheable else None
        # a hit's last tokens computed again (the window group is rebuilt from them); 0 without replay
        self.replay_tokens = max(g.prefix_replay_tokens for g in groups) if cacheable else 0
        self._cached_units: dict[str, int] = {}  # per request: leading units cached (hit or inserted)
        windows = sorted({g.prefix_replay_tokens for g in groups if g.prefix_replay_tokens > 0})
        if len(windows) > 1:
            raise ValueError(f"replay windows disagree across KV groups: {windows}; one replay must rebuild them all")
        # usage() reports the window group: it is the one that grows with every token, so it fills first.
        self._usage_group = next((i for i, g in enumerate(groups) if g.kind == WINDOW), 0)
        self._blocks: dict[str, tuple[list[int], ...]] = {}
        # window groups that free blocks behind the window, and per request how many leading blocks of each group
        # are already freed (null): a step frees only the blocks the window left since, O(1) per step
        self._window_groups = tuple(i for i, g in enumerate(groups) if g.kind == WINDOW and g.sliding_window > 0)
        self._freed: dict[str, list[int]] = {}
        # per request (grow_at, free_at): allocate_slots changes nothing while num_tokens < grow_at (no group needs
        # a block) and num_computed < free_at (no window block to free), so most decode steps skip all the work
        self._quiet: dict[str, tuple[int, int]] = {}

    def allocate_slots(self, req_id: str, num_tokens: int, num_computed: int = 0) -> tuple[list[int], ...] | None:
        """Grow `req_id` to hold `num_tokens` computed tokens in every group (it has `num_computed` already).

        Returns the newly allocated block ids per group (possibly empty lists), or None, allocating nothing,
        if any group lacks free blocks. Window blocks no query from `num_computed` on reads are freed first.
        """
        # (an entry left by a failed call is stale only towards more work: it only ever freed blocks)
        quiet = self._quiet.get(req_id)
        if quiet is not None and num_tokens < quiet[0] and num_computed < quiet[1]:
            return tuple([] for _ in self.groups)
        held = self._blocks.get(req_id)
        if held is None:
            need = [g.num_blocks_for(num_tokens) for g in self.groups]
        else:
            if self._window_groups:
                self._free_behind_window(req_id, held, num_computed)
            need = [g.num_blocks_for(num_tokens) - len(b) for g, b in zip(self.groups, held)]
        for n, pool in zip(need, self.pools):
            if n > 0 and n > pool.num_free:
                return None
        new = tuple(pool.allocate(n) if n > 0 else [] for n, pool in zip(need, self.pools))
        if held is None:
            held = self._blocks[req_id] = tuple([] for _ in self.groups)
        for blocks, add in zip(held, new):
            assert add is not None  # checked above: every group had room
            if add:
                blocks.extend(add)
        self._quiet[req_id] = self._quiet_until(req_id, held)
        return new  # type: ignore[return-value]

    def can_grow(self, targets: dict[str, int]) -> bool:
        """Whether every request of `targets` could grow to hold its number of computed tokens at once, from the
        free blocks alone (window blocks allocate_slots would free first are not counted: a conservative answer)."""
        need = [0] * len(self.groups)
        for req_id, num_tokens in targets.items():
            held = self._blocks.get(req_id)
            for gi, g in enumerate(self.groups):
                need[gi] += max(g.num_blocks_for(num_tokens) - (len(held[gi]) if held is not None else 0), 0)
        return all(n <= pool.num_free for n, pool in zip(need, self.pools))

    def _quiet_until(self, req_id: str, held: tuple[list[int], ...]) -> tuple[int, int]:
        """(grow_at, free_at) of a request holding `held`: the fewest tokens at which some group needs one more
        block (num_blocks_for(t) > len(blocks)), and the fewest computed tokens at which some window group has a
        block to free (first_live_block(c) > its freed prefix, which is below its length)."""
        grow_at = free_at = _NEVER
        for g, blocks in zip(self.groups, held):
            n = len(blocks)
            if g.kind == STATE:  # num_blocks_for is 1
                if n == 0:
                    grow_at = 0
            else:  # ceil((t // r) / bs) > n  <=>  t // r >= n * bs + 1
                grow_at = min(grow_at, (n * g.block_size + 1) * g.tokens_per_row)
        freed = self._freed.get(req_id)
        for gi in self._window_groups:
            f, g = (freed[gi] if freed is not None else 0), self.groups[gi]
            if f < len(held[gi]):  # (c - W + 1) // bs >= f + 1  <=>  c >= (f + 1) * bs + W - 1
                free_at = min(free_at, (f + 1) * g.block_size + g.sliding_window - 1)
        return grow_at, free_at

    def _free_behind_window(self, req_id: str, held: tuple[list[int], ...], num_computed: int) -> None:
        freed = self._freed.get(req_id)
        if freed is None:
            freed = self._freed[req_id] = [0] * len(self.groups)
        for gi in self._window_groups:
            blocks = held[gi]
            end = min(self.groups[gi].first_live_block(num_computed), len(blocks))
            if end <= freed[gi]:
                continue  # blocks [0, freed) are null already; the list only grows at its end
            pool = self.pools[gi]
            for i in range(freed[gi], end):
                if blocks[i] != NULL_BLOCK:
                    pool.free([blocks[i]])
                    blocks[i] = NULL_BLOCK
            freed[gi] = end

    # ---- prefix caching --------------------------------------------------------------------------------------
    def find_prefix(self, keys: list[int], token_ids: Sequence[int], images: Sequence[Any] | None
                    ) -> list[CachedUnit]:
        """The cached units of the longest cached prefix of `token_ids` (at least one token is left to compute:
        it produces the logits). Empty without prefix caching. `keys` is the request's unit-key cache."""
        if self.prefix is None:
            return []
        return self.prefix.lookup(keys, token_ids, images, (len(token_ids) - 1) // self.prefix.unit_tokens)

    def allocate_with_prefix(self, req_id: str, hit: list[CachedUnit], replay_start: int,
                             num_tokens: int) -> tuple[list[int], ...] | None:
        """Blocks of a request holding none, admitted with the cached units `hit` and computing from
        `replay_start` up to `num_tokens` tokens: the hit blocks shared plus new ones for the tail in the
        prefix-cacheable groups, the null block below replay_start's block then fresh blocks in the window
        group, fresh blocks elsewhere. Returns the whole block lists per group, or None, taking nothing, if some
        pool lacks room (a hit on free cached blocks takes them out of the free queue: they count)."""
        assert self.prefix is not None and req_id not in self._blocks, req_id
        assert replay_start <= len(hit) * self.prefix.unit_tokens and replay_start < num_tokens, replay_start
        shared: dict[int, list[int]] = {gi: [] for gi in self.prefix.group_ids}
        for unit in hit:
            for gi, ids in zip(self.prefix.group_ids, unit.blocks):
                shared[gi].extend(ids)
        nulls = [0] * len(self.groups)
        new = [0] * len(self.groups)
        for gi, g in enumerate(self.groups):
            total = g.num_blocks_for(num_tokens)
            if gi in shared:
                new[gi] = max(0, total - len(shared[gi]))
            elif g.kind == WINDOW:
                nulls[gi] = replay_start // g.block_size
                new[gi] = total - nulls[gi]
            else:
                new[gi] = total
            busy = self.pools[gi].num_free_of(shared[gi]) if gi in shared else 0
            if new[gi] + busy > self.pools[gi].num_free:
                return None
        held = []
        for gi, pool in enumerate(self.pools):
            if gi in shared:
                pool.incr_ref(shared[gi])  # before allocating: a hit block must not be handed out as new
            got = pool.allocate(new[gi])
            assert got is not None  # checked above
            held.append(shared.get(gi, []) + [NULL_BLOCK] * nulls[gi] + got)
        self._blocks[req_id] = tuple(held)
        if self._window_groups:
            self._freed[req_id] = nulls
        self._cached_units[req_id] = len(hit)
        self._quiet[req_id] = self._quiet_until(req_id, self._blocks[req_id])
        return tuple(list(b) for b in held)

    def num_cached_units(self, req_id: str) -> int:
        """Leading units of `req_id` in the prefix cache (hit at admission or cached since)."""
        return self._cached_units.get(req_id, 0)

    def cache_blocks(self, req_id: str, keys: list[int], token_ids: Sequence[int], images: Sequence[Any] | None,
                     num_computed: int) -> None:
        """Cache the units of `req_id` that its first `num_computed` tokens (all known) fill."""
        if self.prefix is None or req_id not in self._blocks:
            return
        U = self.prefix.unit_tokens
        full, done = num_computed // U, self._cached_units.get(req_id, 0)
        if full <= done:
            return
        self.prefix.extend_keys(keys, token_ids, images, full)
        held = self._blocks[req_id]
        for u in range(done, full):
            blocks = tuple(tuple(held[gi][u * n: (u + 1) * n])
                           for gi, n in zip(self.prefix.group_ids, self.prefix.blocks_per_unit))
            self.prefix.insert(keys, token_ids, images, u, blocks)
        self._cached_units[req_id] = full

    def free(self, req_id: str) -> None:
        """Release every block of `req_id` (no-op if it holds none); cached blocks keep their contents."""
        held = self._blocks.pop(req_id, None)
        self._freed.pop(req_id, None)
        self._quiet.pop(req_id, None)
        self._cached_units.pop(req_id, None)
        if held is None:
            return
        for pool, blocks in zip(self.pools, held):
            pool.free([b for b in blocks[::-1] if b != NULL_BLOCK])  # tail first: see BlockPool.free

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """A copy of the blocks `req_id` holds, one list per group (empty lists if none)."""
        held = self._blocks.get(req_id)
        if held is None:
            return tuple([] for _ in self.groups)
        return tuple(list(b) for b in held)

    def usage(self) -> float:
        """Fraction of the window group's allocatable blocks in use (0.0 to 1.0)."""
        pool = self.pools[self._usage_group]
        return 1.0 - pool.num_free / pool.capacity if pool.capacity else 0.0

    def can_fit(self, num_tokens: int) -> bool:
        """Whether one request of `num_tokens` computed tokens fits in the empty pools."""
        return all(self._peak_blocks(g, num_tokens) <= pool.capacity for g, pool in zip(self.groups, self.pools))

    def _peak_blocks(self, g: KVGroupSpec, num_tokens: int) -> int:
        """The most blocks of `g` one request of `num_tokens` holds at once: all of them, except that a window
        group only keeps the blocks of one step's windows (W - 1 older tokens plus one chunk, unaligned: +2)."""
        need = g.num_blocks_for(num_tokens)
        if g.kind == WINDOW and g.sliding_window > 0 and self.max_chunk is not None:
            need = min(need, -(-(g.sliding_window - 1 + self.max_chunk) // g.block_size) + 2)
        return need
