"""BlockPool: the blocks of ONE KV cache group, with reference counts and a FIFO free queue.

Block 0 is the null block: tables are padded with it, so it is never handed out. Blocks are shared by
reference count (a prefix-cache hit will bump it); a block returns to the free queue when its count drops to 0.

Prefix caching plugs in here later: a freed block keeps its hash and stays in the free queue, where a hit can
take it back (`incr_ref` on a free block) and `_pop_free` evicts the oldest one's hash when it is reused. The
queue is an OrderedDict rather than a deque so that such a hit can remove a block from the middle in O(1).
"""

from __future__ import annotations

from collections import OrderedDict

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
        """Share blocks already held by someone else (a prefix-cache hit)."""
        for b in block_ids:
            assert b != NULL_BLOCK and self.ref_cnt[b] > 0, f"incr_ref on unowned block {b}"
            self.ref_cnt[b] += 1

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
        # The single place a block leaves the free queue: prefix caching will drop the block's hash here.
        b, _ = self._free.popitem(last=False)
        assert self.ref_cnt[b] == 0, f"free block {b} has ref count {self.ref_cnt[b]}"
        self.ref_cnt[b] = 1
        return b
