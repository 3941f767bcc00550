"""KVCacheManager: one BlockPool per KV group, and each request's block list per group.

A request's blocks grow with its computed tokens, in every group at once: a step either gets all the blocks it
needs in all groups or none at all, so a failed allocation never leaves a request half-grown. The window group
also shrinks from the front: blocks that only hold positions older than every future query's window go back to
the pool and become the null block in the request's list (the runner keeps the stale ids, which nothing reads:
a query reads window positions (t - W, t] only).
"""

from __future__ import annotations

from dsv4.kv.block_pool import BlockPool
from dsv4.kv.spec import NULL_BLOCK, STATE, WINDOW, KVGroupSpec

_NEVER = 1 << 62


class KVCacheManager:
    """Block allocation for the KV groups `groups` (pool sizes from `spec.num_blocks`)."""

    def __init__(self, groups: tuple[KVGroupSpec, ...], max_chunk: int | None = None) -> None:
        """`max_chunk`: the most tokens a request computes in one step (the scheduler's token budget); it bounds
        the live blocks of a window group, so a long request fits a pool smaller than its whole length."""
        assert groups, "at least one KV group is needed"
        self.groups, self.max_chunk = groups, max_chunk
        self.pools = tuple(BlockPool(g.num_blocks) for g in groups)
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

    def free(self, req_id: str) -> None:
        """Release every block of `req_id` (no-op if it holds none)."""
        held = self._blocks.pop(req_id, None)
        self._freed.pop(req_id, None)
        self._quiet.pop(req_id, None)
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
