"""BlockPool: the blocks of ONE KV cache group, with reference counts and a FIFO free queue.

Block 0 is the null block: tables are padded with it, so it is never handed out. Blocks are shared by
reference count (a prefix-cache hit will bump it); a block returns to the free queue when its count drops to 0.

Prefix caching (dsv4.kv.prefix_cache) plugs in with two hooks: a freed block keeps its cached contents and
stays in the free queue, where a hit can take it back (`incr_ref` on a free block), and `on_reuse` tells the
cache when the queue hands such a block out again (its contents are about to be overwritten: lazy eviction, the
least recently freed first). The queue is an OrderedDict rather than a deque so that a hit can remove a block
from the middle in O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from dsv4.kv.spec import NULL_BLOCK


class BlockPool:
    """`num_blocks` blocks (including the null block) of one KV group."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, f"a pool needs at least the null block, got num_blocks={num_blocks}"
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # Oldest-freed first: reusing the least recently freed block keeps recently freed (likely hot,
        # later cacheable) blocks around longest.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks) if b != NULL_BLOCK)
        self.on_reuse: Callable[[int], None] | None = None  # called with a block id as it leaves the free queue

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks (ref count 1 each), or None and take nothing if fewer than `n` are free."""
        assert n >= 0, n
        if n > len(self._free):
            return None
        return [self._pop_free() for _ in range(n)]

    def incr_ref(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix-cache hit): held ones gain a reference, free ones leave the free queue with
        their contents (no `on_reuse`: they are taken for what they hold)."""
        for b in block_ids:
            assert b != NULL_BLOCK, "incr_ref on the null block"
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def num_free_of(self, block_ids: list[int]) -> int:
        """How many of `block_ids` sit in the free queue (a hit on them uses up that many free blocks)."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the back of the free queue, in order.

        Callers free a request's blocks tail first, so that with prefix caching the deepest (least shareable)
        blocks are evicted first.
        """
        for b in block_ids:
            assert b != NULL_BLOCK and self.ref_cnt[b] > 0, f"double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def _pop_free(self) -> int:
        # The single place a free block is handed out for new contents: the prefix cache forgets it here.
        b, _ = self._free.popitem(last=False)
        assert self.ref_cnt[b] == 0, f"free block {b} has ref count {self.ref_cnt[b]}"
        self.ref_cnt[b] = 1
        if self.on_reuse is not None:
            self.on_reuse(b)
        return b
