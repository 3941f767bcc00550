"""BlockPool: null block, FIFO free queue, reference counts, all-or-nothing allocation."""

from __future__ import annotations

import random

import pytest

from dsv4.kv.block_pool import BlockPool
from dsv4.kv.spec import NULL_BLOCK


@pytest.mark.parametrize("num_blocks", [1, 2, 5, 64])
def test_null_block_is_never_allocated(num_blocks: int) -> None:
    pool = BlockPool(num_blocks)
    assert pool.num_free == pool.capacity == num_blocks - 1
    got = pool.allocate(num_blocks - 1)
    assert got is not None and NULL_BLOCK not in got
    assert sorted(got) == list(range(1, num_blocks))
    assert pool.num_free == 0
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_allocate_too_many_takes_nothing() -> None:
    pool = BlockPool(6)
    assert pool.allocate(3) is not None
    assert pool.allocate(3) is None
    assert pool.num_free == 2
    assert pool.allocate(2) is not None and pool.num_free == 0


def test_free_queue_is_fifo() -> None:
    pool = BlockPool(5)
    assert pool.allocate(2) == [1, 2]
    a = pool.allocate(2)
    assert a == [3, 4]
    pool.free([4, 3])
    # blocks freed go to the back: never-used 1, 2 were taken first, so the order is exactly the free order
    pool.free([1])
    assert pool.allocate(3) == [4, 3, 1]


def test_ref_counts_share_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.incr_ref(blocks)
    assert [pool.ref_cnt[b] for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free == 1, "a block still referenced once must not return to the free queue"
    pool.free(blocks)
    assert pool.num_free == 3
    assert all(c == 0 for c in pool.ref_cnt)


def test_double_free_and_null_block_misuse_are_bugs() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free([NULL_BLOCK])
    with pytest.raises(AssertionError):
        pool.incr_ref([NULL_BLOCK])


def test_incr_ref_takes_a_free_block_back_and_reuse_is_reported() -> None:
    """A prefix hit on a freed block takes it out of the free queue with its contents (no reuse callback); a
    block handed out for new contents is reported to `on_reuse`, oldest freed first."""
    pool = BlockPool(5)
    reused: list[int] = []
    pool.on_reuse = reused.append
    a = pool.allocate(4)
    assert a == [1, 2, 3, 4] and reused == [1, 2, 3, 4]
    pool.free([3, 1, 4])
    assert pool.num_free == 3 and pool.num_free_of([1, 2, 3]) == 2
    pool.incr_ref([1])  # cached block taken back: no longer free, not reported as reused
    assert pool.num_free == 2 and pool.ref_cnt[1] == 1 and reused == [1, 2, 3, 4]
    pool.incr_ref([2])  # held block: shared
    assert pool.ref_cnt[2] == 2
    assert pool.allocate(2) == [3, 4] and reused[-2:] == [3, 4]
    assert pool.allocate(1) is None


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_keeps_accounting(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.randint(2, 40)
    pool = BlockPool(num_blocks)
    owners: list[list[int]] = []  # each entry holds one reference to each of its blocks
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            got = pool.allocate(rng.randint(0, 6))
            if got is not None:
                owners.append(got)
        elif op < 0.65 and owners:
            owners.append(list(rng.choice(owners)))
            pool.incr_ref(owners[-1])
        elif owners:
            pool.free(owners.pop(rng.randrange(len(owners))))
        refs = [0] * num_blocks
        for blocks in owners:
            for b in blocks:
                refs[b] += 1
        assert refs == pool.ref_cnt
        assert pool.num_free == sum(1 for b in range(1, num_blocks) if refs[b] == 0)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free == num_blocks - 1
