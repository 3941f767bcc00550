"""KVCacheManager: per-group block counts, incremental growth, all-or-nothing allocation, freeing, usage."""

from __future__ import annotations

import math
import random

import pytest

from dsv4.kv.manager import KVCacheManager
from dsv4.kv.spec import COMPRESSED, NULL_BLOCK, STATE, WINDOW, KVGroupSpec


def make_groups(window_blocks: int = 33, compressed_blocks: int = 17, state_blocks: int = 5,
                block_size: int = 4, ratio: int = 4, comp_block_size: int = 2) -> tuple[KVGroupSpec, ...]:
    return (
        KVGroupSpec("window", WINDOW, (0, 1, 2), block_size, 1, window_blocks),
        KVGroupSpec(f"compressed_{ratio}", COMPRESSED, (1,), comp_block_size, ratio, compressed_blocks),
        KVGroupSpec("compressor_state", STATE, (1, 2), 8, 1, state_blocks, prefix_cacheable=False),
    )


def test_block_counts_per_group() -> None:
    kv = KVCacheManager(make_groups(window_blocks=100, compressed_blocks=100))
    for n in [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100]:
        assert kv.allocate_slots(f"r{n}", n) is not None
        w, c, s = kv.get_block_ids(f"r{n}")
        assert len(w) == math.ceil(n / 4)
        # compressed: one row per 4 tokens (a partial window writes nothing), 2 rows per block
        assert len(c) == math.ceil((n // 4) / 2)
        assert len(s) == 1
        kv.free(f"r{n}")


@pytest.mark.parametrize("seed", range(4))
def test_growth_returns_only_new_blocks(seed: int) -> None:
    rng = random.Random(seed)
    groups = make_groups(window_blocks=200, compressed_blocks=200)
    kv = KVCacheManager(groups)
    n = 0
    seen: list[list[int]] = [[], [], []]
    for _ in range(30):
        n += rng.randint(0, 9)
        new = kv.allocate_slots("a", n)
        assert new is not None
        for g, spec in enumerate(groups):
            seen[g] += new[g]
            assert kv.get_block_ids("a")[g] == seen[g]
            assert len(seen[g]) == spec.num_blocks_for(n)
            assert NULL_BLOCK not in seen[g] and len(set(seen[g])) == len(seen[g])


def test_shrinking_target_allocates_nothing() -> None:
    kv = KVCacheManager(make_groups())
    assert kv.allocate_slots("a", 20) is not None
    before = kv.get_block_ids("a")
    assert kv.allocate_slots("a", 3) == ([], [], [])
    assert kv.get_block_ids("a") == before


def test_all_or_nothing_when_one_group_is_short() -> None:
    # the state group has 2 allocatable blocks: a third request fails although window and compressed have room
    kv = KVCacheManager(make_groups(state_blocks=3))
    assert kv.allocate_slots("a", 5) is not None
    assert kv.allocate_slots("b", 5) is not None
    free_before = [p.num_free for p in kv.pools]
    assert kv.allocate_slots("c", 5) is None
    assert [p.num_free for p in kv.pools] == free_before
    assert kv.get_block_ids("c") == ([], [], [])
    # the compressed group is the short one now: window has room, compressed does not
    kv = KVCacheManager(make_groups(window_blocks=100, compressed_blocks=3))  # 2 blocks = 16 tokens
    assert kv.allocate_slots("a", 16) is not None
    free_before = [p.num_free for p in kv.pools]
    assert kv.allocate_slots("a", 24) is None
    assert [p.num_free for p in kv.pools] == free_before
    assert [len(b) for b in kv.get_block_ids("a")] == [4, 2, 1]


def test_free_returns_everything_and_usage_follows_window_group() -> None:
    kv = KVCacheManager(make_groups(window_blocks=11))  # 10 allocatable window blocks
    assert kv.usage() == 0.0
    assert kv.allocate_slots("a", 12) is not None  # 3 window blocks
    assert kv.usage() == pytest.approx(0.3)
    assert kv.allocate_slots("b", 28) is not None  # 7 more
    assert kv.usage() == pytest.approx(1.0)
    kv.free("a")
    assert kv.usage() == pytest.approx(0.7)
    kv.free("b")
    kv.free("never-seen")  # no-op
    assert [p.num_free for p in kv.pools] == [p.capacity for p in kv.pools]


def test_get_block_ids_is_a_copy() -> None:
    kv = KVCacheManager(make_groups())
    kv.allocate_slots("a", 9)
    kv.get_block_ids("a")[0].append(999)
    assert 999 not in kv.get_block_ids("a")[0]


def test_can_fit_matches_the_smallest_group() -> None:
    kv = KVCacheManager(make_groups(window_blocks=11, compressed_blocks=100))  # window: 40 tokens
    assert kv.can_fit(40) and not kv.can_fit(41)
    kv = KVCacheManager(make_groups(window_blocks=100, compressed_blocks=3))  # compressed: 2*2 rows * 4 tokens
    assert kv.can_fit(19) and not kv.can_fit(20)  # 19 tokens -> 4 rows; 20 -> 5 rows
    assert not KVCacheManager(make_groups(state_blocks=1)).can_fit(1)


@pytest.mark.parametrize("seed", range(5))
def test_random_requests_never_share_blocks_and_free_all(seed: int) -> None:
    rng = random.Random(seed)
    groups = make_groups(window_blocks=rng.randint(5, 40), compressed_blocks=rng.randint(3, 20),
                         state_blocks=rng.randint(2, 6))
    kv = KVCacheManager(groups)
    sizes: dict[str, int] = {}
    for step in range(200):
        if sizes and rng.random() < 0.2:
            rid = rng.choice(sorted(sizes))
            kv.free(rid)
            del sizes[rid]
        else:
            rid = rng.choice(sorted(sizes)) if sizes and rng.random() < 0.7 else f"r{step}"
            target = sizes.get(rid, 0) + rng.randint(1, 12)
            free_before = [p.num_free for p in kv.pools]
            new = kv.allocate_slots(rid, target)
            if new is None:
                assert [p.num_free for p in kv.pools] == free_before
                expected_ok = all(spec.num_blocks_for(target) - len(held) <= f
                                  for spec, held, f in zip(groups, kv.get_block_ids(rid), free_before))
                assert not expected_ok
            else:
                sizes[rid] = target
        for g, (spec, pool) in enumerate(zip(groups, kv.pools)):
            owned = [b for rid in sizes for b in kv.get_block_ids(rid)[g]]
            assert len(owned) == len(set(owned)) and NULL_BLOCK not in owned
            assert len(owned) + pool.num_free == pool.capacity
            for rid, n in sizes.items():
                assert len(kv.get_block_ids(rid)[g]) == spec.num_blocks_for(n)
    for rid in list(sizes):
        kv.free(rid)
    assert [p.num_free for p in kv.pools] == [p.capacity for p in kv.pools]


def test_window_group_frees_blocks_behind_the_window() -> None:
    """Blocks holding only positions before num_computed - W + 1 go back to the pool (as the null block in the
    request's list); other groups keep growing; freeing everything afterwards returns every block once."""
    W, bs = 8, 4
    window = KVGroupSpec("window", WINDOW, (0,), bs, 1, 40, sliding_window=W)
    comp = KVGroupSpec("compressed_2", COMPRESSED, (0,), bs, 2, 40)
    kv = KVCacheManager((window, comp))
    computed = 0
    for step in (5, 7, 1, 1, 13, 1, 9):
        assert kv.allocate_slots("a", computed + step, computed) is not None
        computed += step
        held = kv.get_block_ids("a")
        first_needed = max(0, computed - step - W + 1)  # oldest key read by this step's first query
        live = [i for i, b in enumerate(held[0]) if b != NULL_BLOCK]
        assert live and live[0] == first_needed // bs and live == list(range(live[0], len(held[0])))
        assert len(held[0]) == window.num_blocks_for(computed)
        assert NULL_BLOCK not in held[1] and len(held[1]) == comp.num_blocks_for(computed)
        assert kv.pools[0].num_free == kv.pools[0].capacity - len(live)
    kv.free("a")
    assert all(p.num_free == p.capacity for p in kv.pools)
