"""KV pool sizing: the byte count used to size the pool equals what the allocator takes, and the pool size chosen
for a memory budget is the largest that fits."""

from __future__ import annotations

import os

import pytest
import torch
from hf_reference import tiny_config

from dsv4.engine.engine import kv_blocks_for_budget
from dsv4.kv.spec import make_kv_groups
from dsv4.models.config import load_model_config, parse_config_dict
from dsv4.runtime.kv_cache import allocate_kv_caches, kv_cache_bytes

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "deepseek-v41-tiny")


@pytest.mark.parametrize("which", ["v4", "v41"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_match_the_allocator(which: str, dtype: torch.dtype) -> None:
    cfg = parse_config_dict(tiny_config()) if which == "v4" else load_model_config(GOLDEN)
    for block_size, num_blocks in ((16, 9), (6, 40)):
        groups = make_kv_groups(cfg, block_size, num_blocks, 3)
        caches = allocate_kv_caches(cfg, groups, dtype, "cpu")
        real = sum(t.numel() * t.element_size() for c in caches for t in vars(c).values()
                   if isinstance(t, torch.Tensor))
        assert kv_cache_bytes(cfg, groups, dtype) == real


def test_blocks_for_budget_is_the_largest_that_fits() -> None:
    cfg = load_model_config(GOLDEN)
    for budget in (10_000_000, 3_333_333, 50_000_000):
        n = kv_blocks_for_budget(cfg, 16, 4, torch.bfloat16, budget)
        assert kv_cache_bytes(cfg, make_kv_groups(cfg, 16, n, 4), torch.bfloat16) <= budget
        assert kv_cache_bytes(cfg, make_kv_groups(cfg, 16, n + 1, 4), torch.bfloat16) > budget
    assert kv_blocks_for_budget(cfg, 16, 4, torch.bfloat16, 100) < 2  # nothing fits
