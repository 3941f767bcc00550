"""The image span cache (dsv4/runtime/image_cache.py): least recently used out first within its byte budget."""

from __future__ import annotations

import pytest
import torch

from dsv4.runtime.image_cache import ImageSpanCache


def _span(tokens: int, hidden: int = 8) -> torch.Tensor:
    return torch.randn(tokens, hidden)  # float32: 32 bytes a token at hidden 8


def test_hits_misses_and_least_recently_used_out_first() -> None:
    cache = ImageSpanCache(max_bytes=3 * 10 * 32)  # three spans of 10 tokens
    spans = {name: _span(10) for name in "abcd"}
    for name in "abc":
        assert cache.get((name, (3, 3))) is None
        cache.put((name, (3, 3)), spans[name])
    assert (cache.hits, cache.misses, len(cache), cache.nbytes) == (0, 3, 3, 960)
    assert cache.get(("a", (3, 3))) is spans["a"]  # a is now the most recently used: b goes first
    cache.put(("d", (3, 3)), spans["d"])
    assert cache.get(("b", (3, 3))) is None and cache.get(("c", (3, 3))) is spans["c"]
    assert cache.get(("a", (3, 3))) is spans["a"] and cache.get(("d", (3, 3))) is spans["d"]
    assert (cache.hits, cache.misses, len(cache), cache.nbytes) == (4, 4, 3, 960)
    assert cache.get(("a", (3, 4))) is None  # another grid of the same pixels is another key


def test_a_large_span_evicts_several_and_a_too_large_one_is_not_kept() -> None:
    cache = ImageSpanCache(max_bytes=1000)
    for i in range(3):
        cache.put((str(i), (1, 1)), _span(10))  # 320 bytes each
    cache.put(("big", (1, 1)), _span(25))  # 800 bytes: all three go
    assert len(cache) == 1 and cache.nbytes == 800
    cache.put(("huge", (1, 1)), _span(40))  # 1280 > the budget: not kept, nothing evicted
    assert cache.get(("huge", (1, 1))) is None and len(cache) == 1
    cache.put(("big", (1, 1)), _span(5))  # a key put again replaces its span
    assert len(cache) == 1 and cache.nbytes == 160


def test_zero_keeps_nothing_and_a_negative_budget_is_refused() -> None:
    cache = ImageSpanCache(0)
    cache.put(("a", (1, 1)), _span(1))
    assert len(cache) == 0 and cache.get(("a", (1, 1))) is None
    with pytest.raises(ValueError, match=">= 0 bytes"):
        ImageSpanCache(-1)


def test_a_view_into_a_larger_output_is_kept_as_a_copy() -> None:
    """Spans of one packed encode call are views of one output: the cache keeps copies, so evicting an entry frees
    what the budget counted."""
    packed = torch.randn(30, 8)
    first, second, third = packed.split(10)
    cache = ImageSpanCache(10_000)
    cache.put(("a", (1, 1)), first)
    kept = cache.get(("a", (1, 1)))
    assert kept is not None and torch.equal(kept, first)
    assert kept.untyped_storage().nbytes() == 320 and kept.data_ptr() != packed.data_ptr()
    whole = torch.randn(10, 8)
    cache.put(("b", (1, 1)), whole)
    assert cache.get(("b", (1, 1))) is whole  # its own storage: kept as it is
